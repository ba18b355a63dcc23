"""Deprecated: moved to :mod:`fp8_backends.core.output_contract`; this name is that module (private names and all)."""

from __future__ import annotations

import sys
import warnings

from fp8_backends.core import output_contract as _moved

warnings.warn("fp8_backends.output_contract moved to fp8_backends.core.output_contract", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
