"""Deprecated: moved to :mod:`fp8_backends.core.text_table`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.core import text_table as _moved

warnings.warn("fp8_backends.text_table moved to fp8_backends.core.text_table", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
