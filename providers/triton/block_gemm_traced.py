"""What ``torch.compile`` sees of the block-scaled Triton GEMM: the body of the ``fp8_backends::triton_block_gemm``
``triton_op``.

As :mod:`.traced_ops` does for the per-tensor GEMM: the body builds the launch the eager path makes
(:mod:`.block_gemm_args`: config, K split, grid, every kernel argument) and launches the kernel through
:func:`torch.library.wrap_triton`, so Inductor launches it from its generated code. By design, unlike the eager path:

- no programmatic dependent launch (Inductor launches user kernels without it: ``USE_PDL=False``);
- the TMA configs stay an opaque op (``fp8_backends::triton_block_gemm_tma``: host-built descriptors);
- a split-K launch takes its arrival counters from a fresh zeroed tensor (one small fill kernel), not the eager
  path's per-stream buffer, which a compiled graph could not own.

The signature carries real type hints (no ``from __future__ import annotations``): ``triton_op`` infers the op's
schema from them. This module imports torch and triton: it is imported when the op is defined.
"""

import typing

import torch
from torch.library import wrap_triton

from . import block_gemm_args as A
from .block_gemm_configs import WEIGHT_BLOCK


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
    out, done = A.new_output(x, n, out_dtype, bias)
    if done:
        return out
    cfg = A.pick_config(config, m, n, k)
    if cfg.family == "tma":
        return getattr(torch.ops.fp8_backends, A.TMA_OP_BASENAME)(x, w, x_scale, w_scale, bias, out_dtype, group_size,
                                                                 cfg.name)
    plan = A.plan_launch(cfg, m, n, k, group_size, A.sm_count(x.device))
    part = counters = None
    if plan.split > 1:
        part = x.new_empty((plan.split, m, n), dtype=torch.float32)
        counters = torch.zeros((A.tiles_of(cfg, m, n),), dtype=torch.int32, device=x.device)
    kernel, grid, args = A.kernel_args(plan, x, w, x_scale, w_scale, bias, out, part, counters, group_size,
                                       WEIGHT_BLOCK, False)
    wrap_triton(kernel)[grid](*args, num_warps=cfg.warps, num_stages=cfg.stages)
    return out


def triton_block_gemm_quant(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: typing.Optional[torch.Tensor],  # noqa: UP045 - triton_op's schema inference on every torch version
    out_dtype: torch.dtype,
    group_size: int,
    config: str,
) -> torch.Tensor:
    """The fused GEMV (:func:`.block_gemm_ops.fused_launch`): the unquantized ``x [M, K]`` quantized per group inside
    the launch. The caller (a compiled layer, for the M its provider fuses) guarantees a fused config serves M; an M
    it does not (a symbolic M the plan did not expect) gets the config anyway: every config computes every M."""
    m, k = x.shape
    n = w.shape[0]
    out, done = A.new_output(x, n, out_dtype, bias)
    if done:
        return out
    cfg = A.fused_config(config, m, n, k, any_m=True)
    plan = A.plan_launch(cfg, m, n, k, group_size, A.sm_count(x.device))
    kernel, grid, args = A.kernel_args(plan, x, w, w_scale, w_scale, bias, out, None, None, group_size, WEIGHT_BLOCK,
                                       False, True)
    wrap_triton(kernel)[grid](*args, num_warps=cfg.warps, num_stages=cfg.stages)
    return out


__all__ = ["triton_block_gemm", "triton_block_gemm_quant"]
