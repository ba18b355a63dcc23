"""The launch arguments of the experts kernels (:mod:`.experts_kernels`), shared by the eager launches
(:mod:`.experts_ops`) and the traced bodies (:mod:`.experts_traced`): sizes may be symbolic under tracing."""

from __future__ import annotations

from typing import Any

import torch

from fp8_backends.core.types import Fp8Dtype

from .block_gemm_args import row_align
from .block_gemm_configs import CONFIGS, WEIGHT_BLOCK, fused_shape_config

GROUP_SIZE = 128


#: the tiled GEMM's tile heights (an MMA needs at least 16 rows)
BLOCK_MS = (16, 32, 64)


def block_m_for(pairs: int, experts: int) -> int:
    """The tile height for ``pairs`` pairs over ``experts`` experts: about the pairs an expert gets (16 to 64)."""
    per_expert = pairs / max(1, min(experts, pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


#: the routing kernel's ids per step of its passes, and its warps
ROUTE_CHUNK = 2048
ROUTE_WARPS = 8


def route_sizes(pairs: Any, experts: int, block_m: int) -> tuple[Any, int]:
    """``(max_tiles, E_P2)`` of :func:`.experts_kernels.experts_route_kernel` for ``pairs`` pairs over ``experts``
    experts: the most tiles any routing needs (each expert's pairs and the pairs without an expert in whole tiles)
    and the histogram's bins (``E + 2`` rounded up to a power of two)."""
    return -(-pairs // block_m) + min(experts + 1, pairs), max(16, 1 << (experts + 1).bit_length())


def route_kernel_args(ids: torch.Tensor, experts: int, block_m: int, buf: torch.Tensor, chunk: int = ROUTE_CHUNK,
                      warps: int = ROUTE_WARPS) -> tuple[Any, tuple[int], tuple[Any, ...], int]:
    """The routing kernel's launch over ``buf`` (int32 ``[P + 3 * max_tiles + E_P2]``: the order, the three tile
    plan rows and the kernel's scratch, :func:`route_views`); ``chunk`` and ``warps`` other than the defaults for
    ``bench/experts_routing.py``."""
    from .experts_kernels import experts_route_kernel

    p = ids.shape[0]
    n_tiles, e_p2 = route_sizes(p, experts, block_m)
    order, tile_expert, tile_row0, tile_end, cursor = route_views(buf, p, n_tiles)
    args = (ids, order, tile_expert, tile_row0, tile_end, cursor, p, experts, n_tiles, block_m, e_p2, chunk)
    return experts_route_kernel, (1,), args, warps


def route_views(buf: torch.Tensor, pairs: Any, n_tiles: Any) -> tuple[torch.Tensor, ...]:
    """``(order, tile_expert, tile_row0, tile_end, scratch)``: the views of the routing kernel's one int32 output."""
    return (buf[:pairs], buf[pairs:pairs + n_tiles], buf[pairs + n_tiles:pairs + 2 * n_tiles],
            buf[pairs + 2 * n_tiles:pairs + 3 * n_tiles], buf[pairs + 3 * n_tiles:])


def _kernel() -> Any:
    from .experts_kernels import experts_gemv_kernel

    return experts_gemv_kernel


def scale_strides(w_scale: torch.Tensor) -> tuple[Any, Any, Any, bool]:
    """``(stride_wse, stride_wsn, stride_wsk, W_ROWS)`` of the weight scales: ``[E, ceil(N/128), ceil(K/128)]`` block
    scales, or ``[E, N]`` one per output row (``W_ROWS``; the K stride 0)."""
    if w_scale.dim() == 2:
        return w_scale.stride(0), w_scale.stride(1), 0, True
    return w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), False


def kernel_args(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor | None,
          token_div: int, out: torch.Tensor, config: str) -> tuple[Any, tuple[int, int], tuple[Any, ...], int]:
    e, n, k = w.shape
    cfg = CONFIGS[config if config in CONFIGS and CONFIGS[config].family == "gemv" else fused_shape_config(n, k)]
    step = cfg.groups * GROUP_SIZE
    se, sn, sk, rows = scale_strides(w_scale)
    args = (x, w, out, w_scale, ids, out if rw is None else rw, n, k, e, token_div,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            se, sn, sk, cfg.block_n, cfg.groups, GROUP_SIZE, WEIGHT_BLOCK[0], WEIGHT_BLOCK[1], k % step == 0,
            row_align(k, x.stride(0), w.stride(1)), rw is not None, Fp8Dtype.of(w.dtype).max, rows)
    return _kernel(), (-(-n // cfg.block_n), ids.shape[0]), args, cfg.warps


def gemm_kernel_args(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     order: torch.Tensor, tile_expert: torch.Tensor, tile_row0: torch.Tensor, tile_end: torch.Tensor,
                     rw: torch.Tensor | None, token_div: int, block_m: int, out: torch.Tensor
                     ) -> tuple[Any, tuple[int, int], tuple[Any, ...], int, int]:
    from .experts_kernels import experts_gemm_kernel

    e, n, k = w.shape
    block_n = 128
    args = (x_q, w, out, x_scale, w_scale, order, tile_expert, tile_row0, tile_end, out if rw is None else rw,
            n, k, e, token_div,
            x_q.stride(0), x_q.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            x_scale.stride(0), x_scale.stride(1), *scale_strides(w_scale)[:3],
            block_m, block_n, GROUP_SIZE, WEIGHT_BLOCK[0], WEIGHT_BLOCK[1], k % GROUP_SIZE == 0, rw is not None,
            w_scale.dim() == 2)
    return experts_gemm_kernel, (tile_expert.shape[0], -(-n // block_n)), args, 4, 3


__all__ = ["BLOCK_MS", "GROUP_SIZE", "block_m_for", "gemm_kernel_args", "kernel_args", "route_kernel_args",
           "route_sizes", "route_views", "scale_strides"]
