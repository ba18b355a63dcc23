"""Deprecated: moved to :mod:`fp8_backends.tuning.models`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.tuning import models as _moved

warnings.warn("fp8_backends.models moved to fp8_backends.tuning.models", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
