"""Deprecated: moved to :mod:`fp8_backends.providers.flashinfer.norm_quant`; this module re-exports it."""

from __future__ import annotations

import warnings

from .flashinfer.norm_quant import *  # noqa: F403
from .flashinfer.norm_quant import FlashinferNormQuantBackend, fused_add_smem_bytes  # noqa: F401

warnings.warn("fp8_backends.providers.flashinfer_norm_quant moved to fp8_backends.providers.flashinfer.norm_quant",
              DeprecationWarning, stacklevel=2)
