"""Deprecated: moved to :mod:`fp8_backends.core.oplib`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.core import oplib as _moved

warnings.warn("fp8_backends.oplib moved to fp8_backends.core.oplib", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
