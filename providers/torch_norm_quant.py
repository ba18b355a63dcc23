"""``torch`` norm-quant provider: the unfused reference path (fp32 RMSNorm, then static quant).

Runs anywhere torch runs. It is several kernels per call, so it is the lowest-priority choice;
fused providers replace it where they are available.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fp8_backends.core.backend import NormQuantBackend
from fp8_backends.core.capabilities import NormQuantCapabilities
from fp8_backends.core.types import DeviceKind, OutDtype

if TYPE_CHECKING:
    import torch


class TorchNormQuantBackend(NormQuantBackend):
    name: ClassVar[str] = "torch"
    aliases: ClassVar[tuple[str, ...]] = ("reference",)
    description: ClassVar[str] = "unfused torch ops: fp32 RMSNorm, divide, clamp, cast"
    requires: ClassVar[tuple[str, ...]] = ("torch",)
    install_hint: ClassVar[str] = "pip install torch"
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities(
        devices=frozenset({DeviceKind.CUDA, DeviceKind.CPU}),
        in_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16, OutDtype.FP32}),
        residual=True,
        priority=0,
    )

    def rmsnorm_quant_impl(
        self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float
    ) -> None:
        from fp8_backends.core import reference

        out.copy_(reference.rmsnorm_quant(x, weight, scale, eps))

    def fused_add_rmsnorm_quant_impl(
        self, out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        scale: torch.Tensor, eps: float,
    ) -> None:
        from fp8_backends.core import reference

        q, new_residual = reference.fused_add_rmsnorm_quant(x, residual, weight, scale, eps)
        out.copy_(q)
        residual.copy_(new_residual)
