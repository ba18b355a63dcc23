"""Deprecated: moved to :mod:`fp8_backends.providers.flashinfer.common`; this module re-exports it."""

from __future__ import annotations

import warnings

from .flashinfer.common import *  # noqa: F403

warnings.warn("fp8_backends.providers._flashinfer_common moved to fp8_backends.providers.flashinfer.common",
              DeprecationWarning, stacklevel=2)
