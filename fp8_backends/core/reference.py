"""Pure-torch reference semantics. Every provider is tested against these functions.

- GEMM: ``y = (x_q·s_x) @ (w_q·s_w)ᵀ + bias``, computed in fp32 and cast to ``out_dtype``.
  ``s_x`` is one value or ``[M, 1]``; ``s_w`` one value, ``[N]`` or ``[N, 1]``.
- Quantization: ``clamp(x / s, -448, 448) -> float8_e4m3fn`` (``±57344`` for e5m2).
- RMSNorm: in fp32, ``x · rsqrt(mean(x²) + eps) · weight``.

These run on any device torch supports; they are slow by design (several kernels, fp32 copies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .types import ActScale, Fp8Dtype

if TYPE_CHECKING:
    import torch

#: smallest scale produced by dynamic quantization (an all-zero input would give 0 otherwise)
MIN_DYNAMIC_SCALE = 1e-12


def _fp8(dtype: object) -> tuple[torch.dtype, float]:
    fp8 = Fp8Dtype.of(dtype)
    return fp8.torch_dtype(), fp8.max


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale`` with ``scale`` one value or broadcastable rows (``[M, 1]``)."""
    return q.float() * scale.float().reshape(-1, 1) if scale.numel() > 1 else q.float() * scale.float()


def fp8_gemm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference FP8 GEMM. ``x_q: [M, K]``, ``w_q: [N, K]`` (float8), scales fp32; returns ``[M, N]``."""
    x = x_q.float() * (x_scale.float().reshape(-1, 1) if x_scale.numel() > 1 else x_scale.float().reshape(()))
    w = w_q.float() * (w_scale.float().reshape(-1, 1) if w_scale.numel() > 1 else w_scale.float().reshape(()))
    y = x @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def quantize_static(x: torch.Tensor, scale: torch.Tensor, dtype: object = "e4m3fn") -> torch.Tensor:
    """``clamp(x / scale, ±max) -> fp8`` with a given per-tensor (or ``[M, 1]``) fp32 scale."""
    fp8, fmax = _fp8(dtype)
    return scaled_cast(x, scale, fp8, fmax)


def quantize_dynamic_per_tensor(
    x: torch.Tensor, dtype: object = "e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic quantization: ``scale = max(amax(x) / max, 1e-12)`` as a ``[1]`` fp32 tensor (an empty
    ``x`` gets ``1e-12``, as an all-zero one does)."""
    fp8, fmax = _fp8(dtype)
    scale = dynamic_scale(x, fmax)
    return scaled_cast(x, scale, fp8, fmax), scale


def quantize_per_token(x: torch.Tensor, dtype: object = "e4m3fn") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic quantization of ``x: [M, K]``; ``scale: [M, 1]`` fp32 (rows of an ``x`` with
    K = 0 get ``1e-12``)."""
    fp8, fmax = _fp8(dtype)
    scale = per_token_scale(x, fmax)
    return scaled_cast(x, scale, fp8, fmax), scale


# The math itself, with the float8 torch dtype and its largest value given: what the functions above compute once
# they parsed their dtype, and what a compiled layer's generated plan calls with both as constants (no parsing, no
# enum lookups for Dynamo to guard).
def scaled_cast(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype, fmax: float) -> torch.Tensor:
    """``clamp(x.float() / scale.float(), ±fmax).to(fp8)``."""
    return (x.float() / scale.float()).clamp(-fmax, fmax).to(fp8)


def dynamic_scale(x: torch.Tensor, fmax: float) -> torch.Tensor:
    """``[1]`` fp32: ``max(amax(x) / fmax, 1e-12)`` (``1e-12`` for an empty ``x``)."""
    import torch

    if x.numel() == 0:
        return torch.full((1,), MIN_DYNAMIC_SCALE, dtype=torch.float32, device=x.device)
    return (x.detach().abs().amax().float() / fmax).clamp_min(MIN_DYNAMIC_SCALE).reshape(1)


def per_token_scale(x: torch.Tensor, fmax: float) -> torch.Tensor:
    """``[M, 1]`` fp32: each row's ``max(amax / fmax, 1e-12)`` (``1e-12`` where K = 0)."""
    import torch

    if x.shape[-1] == 0:
        return torch.full((*x.shape[:-1], 1), MIN_DYNAMIC_SCALE, dtype=torch.float32, device=x.device)
    return (x.detach().abs().amax(dim=-1, keepdim=True).float() / fmax).clamp_min(MIN_DYNAMIC_SCALE)


def quantize(
    x: torch.Tensor, mode: ActScale, scale: torch.Tensor | None = None, dtype: object = "e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` in ``mode``; ``scale`` is required for (and only used by) the static mode."""
    mode = ActScale.of(mode)
    if mode is ActScale.PER_TENSOR_STATIC:
        if scale is None:
            from .errors import InvalidInputError

            raise InvalidInputError("static quantization needs a scale")
        return quantize_static(x, scale, dtype), scale
    if mode is ActScale.PER_TENSOR_DYNAMIC:
        return quantize_dynamic_per_tensor(x, dtype)
    return quantize_per_token(x, dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32 RMSNorm of ``x: [T, H]`` times ``weight: [H]``; returns fp32."""
    import torch

    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rmsnorm_quant(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, dtype: object = "e4m3fn"
) -> torch.Tensor:
    """``clamp(rmsnorm(x)·weight / scale, ±max) -> fp8`` (``dtype``: float8_e4m3fn by default, ±448)."""
    return quantize_static(rmsnorm(x, weight, eps), scale, dtype)


def fused_add_rmsnorm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    dtype: object = "e4m3fn",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(q, new_residual)`` with ``new_residual = (x + residual)`` in x's dtype and ``q`` the
    quantized RMSNorm of the fp32 sum (in ``dtype``). Does not modify its inputs."""
    total = x.float() + residual.float()
    return quantize_static(rmsnorm(total, weight, eps), scale, dtype), total.to(x.dtype)


__all__ = [
    "dequantize",
    "dynamic_scale",
    "fp8_gemm",
    "fused_add_rmsnorm_quant",
    "per_token_scale",
    "quantize",
    "quantize_dynamic_per_tensor",
    "quantize_per_token",
    "quantize_static",
    "rmsnorm",
    "rmsnorm_quant",
    "scaled_cast",
]
