"""``torch`` norm-quant provider: the unfused reference path (fp32 RMSNorm, then quantization: static per-tensor,
or dynamic per token / per token group).

Runs anywhere torch runs. It is several kernels per call, so it is the lowest-priority choice;
fused providers replace it where they are available.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from fp8_backends.core.backend import NormQuantBackend
from fp8_backends.core.capabilities import NormQuantCapabilities
from fp8_backends.core.types import ActScale, DeviceKind, OutDtype, ScaleLayout

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
        act_scales=frozenset({ActScale.PER_TENSOR_STATIC, ActScale.PER_TOKEN, ActScale.PER_TOKEN_GROUP}),
        group_sizes=frozenset({64, 128}),
        strided_rows=True,  # torch ops read any strides
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

    def rmsnorm_quant_dynamic_impl(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, act_scale: ActScale,
        group_size: int, scale_layout: ScaleLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from fp8_backends.core import group_scales, reference

        q, scale, new_residual = reference.rmsnorm_quant_dynamic(
            x, weight, eps, act_scale=act_scale, group_size=group_size, residual=residual)
        if new_residual is not None:
            residual.copy_(new_residual)
        if act_scale is ActScale.PER_TOKEN_GROUP:
            scale = group_scales.to_layout(scale, scale_layout)
        return q, scale
