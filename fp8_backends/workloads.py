"""Deprecated: moved to :mod:`fp8_backends.tuning.workloads`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.tuning import workloads as _moved

warnings.warn("fp8_backends.workloads moved to fp8_backends.tuning.workloads", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
