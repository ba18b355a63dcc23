"""What ``torch.compile`` sees of the experts GEMV, GEMM and routing: the bodies of the
``fp8_backends::triton_experts_gemv``, ``triton_experts_gemm`` and ``triton_experts_route`` ``triton_op`` s, the
launches :mod:`.experts_ops` makes, through :func:`torch.library.wrap_triton`.

Real type hints (no ``from __future__ import annotations``): ``triton_op`` infers the op's schema from them.
"""

import typing

import torch
from torch.library import wrap_triton

from .experts_args import gemm_kernel_args, kernel_args, route_buffer_len, route_launches


def triton_experts_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    ids: torch.Tensor,
    rw: typing.Optional[torch.Tensor],  # noqa: UP045 - triton_op's schema inference on every torch version
    token_div: int,
    out_dtype: torch.dtype,
    config: str,
) -> torch.Tensor:
    """The experts GEMV (operands as :mod:`.experts_ops` states, checked by the caller)."""
    out = x.new_empty((ids.shape[0], w.shape[1]), dtype=out_dtype)
    if ids.shape[0] == 0:
        return out
    kernel, grid, args, warps = kernel_args(x, w, w_scale, ids, rw, token_div, out, config)
    wrap_triton(kernel)[grid](*args, num_warps=warps, num_stages=1)
    return out


def triton_experts_gemm(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    order: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row0: torch.Tensor,
    tile_end: torch.Tensor,
    rw: typing.Optional[torch.Tensor],  # noqa: UP045 - triton_op's schema inference on every torch version
    token_div: int,
    block_m: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The tiled experts GEMM (operands as :mod:`.experts_ops` states, checked by the caller)."""
    out = x_q.new_empty((order.shape[0], w.shape[1]), dtype=out_dtype)
    kernel, grid, args, warps, stages = gemm_kernel_args(x_q, x_scale, w, w_scale, order, tile_expert, tile_row0,
                                                         tile_end, rw, token_div, block_m, out)
    wrap_triton(kernel)[grid](*args, num_warps=warps, num_stages=stages)
    return out


def triton_experts_route(ids: torch.Tensor, experts: int, block_m: int) -> torch.Tensor:
    """The pairs sorted by expert and the tile plan in one int32 tensor (:func:`.experts_ops.tile_plan`)."""
    buf = ids.new_empty((route_buffer_len(ids.shape[0], experts, block_m),), dtype=torch.int32)
    for kernel, grid, args, warps in route_launches(ids, experts, block_m, buf):
        wrap_triton(kernel)[grid](*args, num_warps=warps, num_stages=1)
    return buf


__all__ = ["triton_experts_gemm", "triton_experts_gemv", "triton_experts_route"]
