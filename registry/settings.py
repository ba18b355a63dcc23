"""Deprecated: the environment variables moved to :mod:`fp8_backends.core.settings`; this module re-exports them."""

from __future__ import annotations

import warnings

from fp8_backends.core.settings import *  # noqa: F403

warnings.warn("fp8_backends.registry.settings moved to fp8_backends.core.settings", DeprecationWarning, stacklevel=2)
