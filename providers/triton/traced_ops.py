"""What ``torch.compile`` sees of the Triton providers: the bodies of their ``torch.library.triton_op`` ops.

Each body builds the same launch the eager path makes (config pick, grid, every kernel argument) and
launches the kernel through :func:`torch.library.wrap_triton`. Under ``torch.compile`` AOTAutograd decomposes
the op into that kernel call, so Inductor launches the kernel from its generated code (no Python body, no
dispatcher per call) and schedules its own kernels around it. Plain eager calls never run these bodies: they
take the providers' cached launchers (:mod:`.gemm_ops`, :mod:`.norm_kernels`), with the replays and PDL.

Differences from the eager path, by design:

- no programmatic dependent launch (Inductor launches user kernels without the launch attribute, so the
  kernels are built with ``USE_PDL=False``);
- the GEMM's persistent TMA configs (prefill sizes) stay an opaque op, ``fp8_backends::triton_gemm_tma``, whose
  body launches them through Triton's JIT with host-built tensor descriptors; their kernel time dwarfs the call.

The signatures carry real type hints (no ``from __future__ import annotations``): ``triton_op`` infers each
op's schema from them. This module imports torch and triton: it is imported when the ops are defined.
"""

import typing

import torch
from torch.library import wrap_triton

from .gemm_args import kernel_of, pick_config, pointer_kernel_args
from .gemm_configs import TileConfig
from .norm_kernels import default_config, kernel_args

#: the opaque op of the TMA configs (defined by :mod:`.gemm_ops` beside ``triton_gemm``)
TMA_OP = "triton_gemm_tma"


def triton_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: typing.Optional[torch.Tensor],  # noqa: UP045 - triton_op's schema inference on every torch version
    out_dtype: torch.dtype,
    config: str,
) -> torch.Tensor:
    """``out[M, N] = x_scale · w_scale · (x @ wᵀ) (+ bias)``; operands as :func:`.gemm_ops.triton_gemm` states."""
    m, k = x.shape
    if k > 1 and x.stride(1) != 1:  # the kernels read unit-stride columns (never the case for the library's x_q)
        x = x.contiguous()
    n = w.shape[0]
    out = x.new_empty((m, n), dtype=out_dtype)
    if m == 0:
        return out
    cfg: TileConfig = pick_config(config, m, n, k)
    if cfg.family == "tma":
        return getattr(torch.ops.fp8_backends, TMA_OP)(x, w, x_scale, w_scale, bias, out_dtype, cfg.name)
    grid, args = pointer_kernel_args(cfg, x, w, x_scale, w_scale, bias, out, False)
    wrap_triton(kernel_of(cfg.family))[grid](*args, num_warps=cfg.warps, num_stages=cfg.stages)
    return out


def _norm(out: torch.Tensor, x: torch.Tensor, residual: typing.Optional[torch.Tensor],  # noqa: UP045
          weight: torch.Tensor, scale: torch.Tensor, eps: float) -> None:
    t, h = x.shape
    if t == 0 or h == 0:
        return
    cfg = default_config(t, h, residual is not None)
    kernel, grid, args = kernel_args(cfg, out, x, residual, weight, scale, eps, False)
    wrap_triton(kernel)[grid](*args, num_warps=cfg.num_warps)


def triton_rmsnorm_quant(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         eps: float) -> None:
    """``out <- fp8(clamp(rmsnorm(x) · weight / scale))``; operands as :mod:`.norm_kernels` states."""
    _norm(out, x, None, weight, scale, eps)


def triton_fused_add_rmsnorm_quant(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                   scale: torch.Tensor, eps: float) -> None:
    """``residual <- x + residual`` in place, then :func:`triton_rmsnorm_quant` of the fp32 sum."""
    _norm(out, x, residual, weight, scale, eps)


__all__ = ["TMA_OP", "triton_fused_add_rmsnorm_quant", "triton_gemm", "triton_rmsnorm_quant"]
