"""What ``torch.compile`` sees of the Triton fused RMSNorm + dynamic quantization: the bodies of the
``fp8_backends::triton_rmsnorm_quant_dynamic`` and ``triton_fused_add_rmsnorm_quant_dynamic`` ``triton_op`` ops (the
launch the eager path makes, through :func:`torch.library.wrap_triton`, without PDL). Real type hints (no
``from __future__ import annotations``): ``triton_op`` infers the schemas from them. This module imports torch and
triton."""

import typing

import torch
from torch.library import wrap_triton

from .norm_dynamic_kernels import dyn_config, kernel_args, output_buffers

#: the token count whose launch shape a symbolic token count gets (a prefill's: dynamic M comes from prefills)
SYMBOLIC_T = 4096


def _norm(x: torch.Tensor, residual: typing.Optional[torch.Tensor], weight: torch.Tensor,  # noqa: UP045
          eps: float, group_size: int, scale_layout: str, fp8_dtype: torch.dtype
          ) -> typing.Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    q, scale, buffer = output_buffers(x, group_size, scale_layout, fp8_dtype)  # the kernel writes the buffer
    t, h = x.shape
    if t == 0 or h == 0:
        return q, scale
    per_token = group_size == 0
    # a dynamic size under torch.compile: the hidden size is the model's constant (specialized: the kernel's row block
    # covers it), a symbolic token count takes the launch shape of a many-token launch (any count computes right)
    h_cfg = int(h)
    t_cfg = t if isinstance(t, int) and not isinstance(t, torch.SymInt) else SYMBOLIC_T
    cfg = dyn_config(t_cfg, h_cfg, residual is not None, group_size or 128, per_token)
    kernel, grid, args = kernel_args(cfg, x, residual, weight, q, scale, eps, per_token, False, scale_buffer=buffer)
    wrap_triton(kernel)[grid](*args, num_warps=cfg.num_warps)
    return q, scale


def triton_rmsnorm_quant_dynamic(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, scale_layout: str, fp8_dtype: torch.dtype
) -> typing.Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """Fused RMSNorm + dynamic quantization (``group_size = 0``: per token)."""
    return _norm(x, None, weight, eps, group_size, scale_layout, fp8_dtype)


def triton_fused_add_rmsnorm_quant_dynamic(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, scale_layout: str,
    fp8_dtype: torch.dtype,
) -> typing.Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    """``residual <- x + residual`` in place, then :func:`triton_rmsnorm_quant_dynamic` of the fp32 sum."""
    return _norm(x, residual, weight, eps, group_size, scale_layout, fp8_dtype)


__all__ = ["triton_fused_add_rmsnorm_quant_dynamic", "triton_rmsnorm_quant_dynamic"]
