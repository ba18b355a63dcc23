"""Deprecated: moved to :mod:`fp8_backends.providers.flashinfer.gemm`; this module re-exports it."""

from __future__ import annotations

import warnings

from .flashinfer.gemm import *  # noqa: F403
from .flashinfer.gemm import FlashinferBmmBackend  # noqa: F401

warnings.warn("fp8_backends.providers.flashinfer_bmm moved to fp8_backends.providers.flashinfer.gemm",
              DeprecationWarning, stacklevel=2)
