"""Deprecated: moved to :mod:`fp8_backends.core.bucket_tables`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.core import bucket_tables as _moved

warnings.warn("fp8_backends.bucket_tables moved to fp8_backends.core.bucket_tables", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
