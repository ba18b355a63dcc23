"""What ``torch.compile`` sees of the block-wise Triton ops: the bodies of their ``torch.library.triton_op`` ops.

As :mod:`.traced_ops` does for the per-tensor ops: each body builds the launch the eager path makes (config, grid,
every kernel argument) and launches the kernel through :func:`torch.library.wrap_triton`, so Inductor launches it
from its generated code and schedules its own kernels around it. Plain eager calls never run these bodies (they take
the cached launchers with PDL and replays). By design, unlike the eager path:

- no programmatic dependent launch (Inductor launches user kernels without it: ``USE_PDL=False``);
- the block GEMM's TMA configs stay an opaque op (``fp8_backends::triton_block_gemm_tma``): host-built descriptors;
- a split-K launch takes its arrival counters from a fresh zeroed tensor (one small fill kernel), not the eager
  path's per-stream buffer, which a compiled graph could not own.

The signatures carry real type hints (no ``from __future__ import annotations``): ``triton_op`` infers each op's
schema from them. This module imports torch and triton: it is imported when the ops are defined.
"""

import typing

import torch
from torch.library import wrap_triton

from . import block_gemm_ops as bg
from . import group_quant_kernels as gq
from . import norm_dynamic_kernels as nd

TMA_OP = bg.TMA_OP_BASENAME


def triton_block_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: typing.Optional[torch.Tensor],  # noqa: UP045 - triton_op's schema inference on every torch version
    out_dtype: torch.dtype,
    group_size: int,
    config: str,
) -> torch.Tensor:
    """The block-scaled GEMM (operands as :func:`.block_gemm_ops.block_gemm` states, validated by the caller)."""
    m, k = x.shape
    n = w.shape[0]
    out = x.new_empty((m, n), dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:  # the bias (or zeros)
        return bg.launch(x, w, x_scale, w_scale, bias, out_dtype, group_size, config, out)
    cfg = bg.pick_config(config, m, n, k)
    if cfg.family == "tma":
        return getattr(torch.ops.fp8_backends, TMA_OP)(x, w, x_scale, w_scale, bias, out_dtype, group_size, cfg.name)
    plan = bg.plan_launch(cfg, m, n, k, group_size, bg.sm_count(x.device))
    part = counters = None
    if plan.split > 1:
        part = x.new_empty((plan.split, m, n), dtype=torch.float32)
        counters = torch.zeros((bg.tiles_of(cfg, m, n),), dtype=torch.int32, device=x.device)
    kernel, grid, args = bg.kernel_args(plan, x, w, x_scale, w_scale, bias, out, part, counters, group_size,
                                        bg.WEIGHT_BLOCK, False)
    wrap_triton(kernel)[grid](*args, num_warps=cfg.warps, num_stages=cfg.stages)
    return out


def triton_quant_per_token_group(
    x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, scale_layout: str
) -> typing.Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006 - schema inference
    """Per-token-group quantization (:func:`.group_quant_kernels.quant_per_token_group`)."""
    m, k = x.shape
    q = x.new_empty((m, k), dtype=fp8_dtype)
    scale = gq.group_scale_empty(m, (k + group_size - 1) // group_size, scale_layout, x)
    if m == 0 or k == 0:
        return q, scale
    kernel, grid, args, warps = gq.kernel_args(x, q, scale, group_size, False)
    wrap_triton(kernel)[grid](*args, num_warps=warps)
    return q, scale


def _norm(x: torch.Tensor, residual: typing.Optional[torch.Tensor], weight: torch.Tensor,  # noqa: UP045
          eps: float, group_size: int, scale_layout: str, fp8_dtype: torch.dtype
          ) -> typing.Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006
    q, scale = nd.outputs_like(x, group_size, scale_layout, fp8_dtype)
    t, h = x.shape
    if t == 0 or h == 0:
        return q, scale
    per_token = group_size == 0
    cfg = nd.dyn_config(t, h, residual is not None, group_size or 128, per_token)
    kernel, grid, args = nd.kernel_args(cfg, x, residual, weight, q, scale, eps, per_token, False)
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


__all__ = ["TMA_OP", "triton_block_gemm", "triton_fused_add_rmsnorm_quant_dynamic", "triton_quant_per_token_group",
           "triton_rmsnorm_quant_dynamic"]
