"""Deprecated: split into :mod:`fp8_backends.providers.flashinfer.gemm_ops` and
:mod:`~fp8_backends.providers.flashinfer.norm_ops`; this module re-exports both (importing it imports torch)."""

from __future__ import annotations

import warnings

from .flashinfer.gemm_ops import *  # noqa: F403
from .flashinfer.norm_ops import *  # noqa: F403

warnings.warn("fp8_backends.providers._flashinfer_ops moved to fp8_backends.providers.flashinfer.gemm_ops and "
              ".norm_ops", DeprecationWarning, stacklevel=2)
