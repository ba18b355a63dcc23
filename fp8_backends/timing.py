"""Deprecated: moved to :mod:`fp8_backends.tuning.timing`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.tuning import timing as _moved

warnings.warn("fp8_backends.timing moved to fp8_backends.tuning.timing", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
