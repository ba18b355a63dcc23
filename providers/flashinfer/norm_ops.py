"""torch.library ops around flashinfer's fused RMSNorm + FP8 quant kernels (the ``flashinfer`` norm-quant provider).

Importing this module imports torch and registers two ops in the ``fp8_backends`` namespace (the provider
imports it lazily, at the first norm-quant call): ``fp8_backends::flashinfer_rmsnorm_quant(Tensor(a!) out,
Tensor x, Tensor weight, Tensor scale, float eps) -> ()`` and ``fp8_backends::flashinfer_fused_add_rmsnorm_quant(
Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, Tensor scale, float eps) -> ()``. Each has a fake
(meta) implementation; they are defined with :func:`fp8_backends.core.oplib.define_ops` and are inference-only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.oplib import define_ops

from . import _support as support

logger = logging.getLogger("fp8_backends")

NORM_OP = "flashinfer_rmsnorm_quant"
ADD_NORM_OP = "flashinfer_fused_add_rmsnorm_quant"


# ---------------------------------------------------------------------------------------- norm-quant
class NormDevice:
    """Per-device entry points of flashinfer's norm+quant kernels and whether PDL is on."""

    FEATURES = ("rmsnorm_quant", "fused_add_rmsnorm_quant")

    def __init__(self, device: torch.device) -> None:
        fi = support.require_flashinfer(self.FEATURES)
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.pdl = tuple(torch.cuda.get_device_capability(self.index)) >= (9, 0)
        self.kind = "api"
        self.rq: Callable[..., Any] = lambda out, x, w, s, eps, pdl: fi.rmsnorm_quant(out, x, w, s, eps, pdl)
        self.arq: Callable[..., Any] = lambda out, x, r, w, s, eps, pdl: fi.fused_add_rmsnorm_quant(
            out, x, r, w, s, eps, pdl
        )
        try:
            from flashinfer import norm as fi_norm

            dev = torch.device("cuda", self.index)
            if fi_norm._use_cuda_norm(dev):
                module = fi_norm.get_norm_module()
                self.rq, self.arq = module.rmsnorm_quant, module.fused_add_rmsnorm_quant
                self.kind = "direct"
        except Exception as exc:
            logger.info("flashinfer norm: compiled module not callable directly (%s); using the public API", exc)


_NORM_DEVICES: dict[int, NormDevice] = {}


def norm_device(device: torch.device) -> NormDevice:
    """Load (once) what the norm-quant ops need on ``device``."""
    return support.per_device(_NORM_DEVICES, NormDevice, device, "loading flashinfer's norm module")


def _norm_aligned(x: torch.Tensor, out: torch.Tensor, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``x`` as flashinfer's kernels can read it, after checking the other operands. The kernels load gcd(16 /
    itemsize, H) elements per vector access from row ``t`` at ``x + t * x.stride(0)``: an ``x`` whose start or row
    stride breaks that alignment (a row-strided view of a buffer of odd width, a view at an odd offset) is copied
    row-major (a fresh, aligned allocation); a misaligned weight, residual (updated in place) or out is refused."""
    vec = math.gcd(16 // x.element_size(), x.shape[1])
    nbytes = vec * x.element_size()
    if support.misaligned(x, nbytes) or (x.shape[0] > 1 and x.stride(0) % vec):
        x = x.clone(memory_format=torch.contiguous_format)
    for t in tensors:
        if support.misaligned(t, nbytes):
            raise InvalidInputError(
                f"flashinfer norm-quant needs {nbytes}-byte aligned data pointers for H={x.shape[1]}"
            )
    if support.misaligned(out, vec):
        raise InvalidInputError(f"flashinfer norm-quant needs out's data pointer {vec}-byte aligned")
    return x


def _scale_1d(scale: torch.Tensor) -> torch.Tensor:
    return scale if scale.dim() == 1 else scale.reshape(1)


def _rmsnorm_quant_impl(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> None:
    if x.shape[0] == 0:
        return
    state = _NORM_DEVICES.get(x.get_device()) or norm_device(x.device)
    x = _norm_aligned(x, out, (weight,))
    state.rq(out, x, weight, _scale_1d(scale), eps, state.pdl)


def _fused_add_rmsnorm_quant_impl(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                                  weight: torch.Tensor, scale: torch.Tensor, eps: float) -> None:
    if x.shape[0] == 0:
        return
    state = _NORM_DEVICES.get(x.get_device()) or norm_device(x.device)
    x = _norm_aligned(x, out, (residual, weight))
    state.arq(out, x, residual, weight, _scale_1d(scale), eps, state.pdl)


def _rmsnorm_quant_fake(out, x, weight, scale, eps) -> None:
    return None


def _fused_add_rmsnorm_quant_fake(out, x, residual, weight, scale, eps) -> None:
    return None


# ------------------------------------------------------------------------------------- registration
_SCHEMAS = {
    NORM_OP: (
        "flashinfer_rmsnorm_quant(Tensor(a!) out, Tensor x, Tensor weight, Tensor scale, float eps) -> ()",
        _rmsnorm_quant_impl, _rmsnorm_quant_fake,
    ),
    ADD_NORM_OP: (
        "flashinfer_fused_add_rmsnorm_quant(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, "
        "Tensor scale, float eps) -> ()",
        _fused_add_rmsnorm_quant_impl, _fused_add_rmsnorm_quant_fake,
    ),
}


_OPS = define_ops(_SCHEMAS, ("CUDA",))

rmsnorm_quant_op = _OPS[NORM_OP]
fused_add_rmsnorm_quant_op = _OPS[ADD_NORM_OP]
