"""Deprecated: moved to :mod:`fp8_backends.tuning.plan`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.tuning import plan as _moved

warnings.warn("fp8_backends.tune_plan moved to fp8_backends.tuning.plan", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
