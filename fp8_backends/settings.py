"""Deprecated: moved to :mod:`fp8_backends.core.settings`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.core import settings as _moved

warnings.warn("fp8_backends.settings moved to fp8_backends.core.settings", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
