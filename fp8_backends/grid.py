"""Deprecated: moved to :mod:`fp8_backends.tuning.grid`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.tuning import grid as _moved

warnings.warn("fp8_backends.grid moved to fp8_backends.tuning.grid", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
