"""The launch arguments of the experts kernels (:mod:`.experts_kernels`), shared by the eager launches
(:mod:`.experts_ops`) and the traced bodies (:mod:`.experts_traced`): sizes may be symbolic under tracing."""

from __future__ import annotations

from typing import Any

import torch

from fp8_backends.core.types import Fp8Dtype

from ._support import GRID_Y_MAX
from .block_gemm_args import row_align
from .block_gemm_configs import CONFIGS, WEIGHT_BLOCK, fused_shape_config

GROUP_SIZE = 128


#: the tiled GEMM's tile heights (an MMA needs at least 16 rows). 128-row tiles with 8 warps were measured and not
#: kept: 5-20% slower than 64 rows on an H100 at 32-512 pairs an expert, and wrong on ragged N and K there
#: (``bench/results/moe_experts/2026-12-05-h100-tile-heights/``)
BLOCK_MS = (16, 32, 64)


def block_m_for(pairs: int, experts: int) -> int:
    """The tile height for ``pairs`` pairs over ``experts`` experts: about the pairs an expert gets (16 to 64)."""
    per_expert = pairs / max(1, min(experts, pairs))
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64


#: the routing kernels' ids per step (per program in the many-program form), and their warps
ROUTE_CHUNK = 2048
ROUTE_WARPS = 8
#: the most pairs the one-program routing takes; more run over ``cdiv(P, ROUTE_CHUNK)`` programs in two launches.
#: In CUDA graphs on an H100 (``bench/results/experts_routing/2026-12-05-h100-forms/``) the two forms were level up to
#: 4096 pairs (the one launch cheaper on the host), the two launches faster from 8192 (20 against 26 µs; 16 against
#: 160 at 65536)
ROUTE_ONE_PROGRAM_MAX = 4096


def route_sizes(pairs: Any, experts: int, block_m: int) -> tuple[Any, int]:
    """``(max_tiles, E_P2)`` of the routing kernels for ``pairs`` pairs over ``experts`` experts: the most tiles any
    routing needs (each expert's pairs and the pairs without an expert in whole tiles) and the histogram's bins
    (``E + 2`` rounded up to a power of two)."""
    return -(-pairs // block_m) + min(experts + 1, pairs), max(16, 1 << (experts + 1).bit_length())


def route_chunks(pairs: Any, chunk: int = ROUTE_CHUNK, one_program_max: int = ROUTE_ONE_PROGRAM_MAX) -> Any:
    """The routing's programs: 0 for the one-program kernel (up to ``one_program_max`` pairs), else one per
    ``chunk`` pairs (the count and place kernels)."""
    return 0 if pairs <= one_program_max else -(-pairs // chunk)


def route_buffer_len(pairs: Any, experts: int, block_m: int, chunk: int = ROUTE_CHUNK,
                     one_program_max: int = ROUTE_ONE_PROGRAM_MAX) -> Any:
    """The int32 elements of the routing's one output (:func:`route_views`): the order, the three tile plan rows and
    the kernels' scratch (``E_P2`` cursors, or per chunk a histogram and ``E_P2`` cursors)."""
    n_tiles, e_p2 = route_sizes(pairs, experts, block_m)
    chunks = route_chunks(pairs, chunk, one_program_max)
    return pairs + 3 * n_tiles + (e_p2 if chunks == 0 else 2 * chunks * e_p2)


def route_launches(ids: torch.Tensor, experts: int, block_m: int, buf: torch.Tensor, chunk: int = ROUTE_CHUNK,
                   warps: int = ROUTE_WARPS, one_program_max: int = ROUTE_ONE_PROGRAM_MAX
                   ) -> list[tuple[Any, tuple[Any], tuple[Any, ...], int]]:
    """The routing's launches ``(kernel, grid, args, warps)`` in order over ``buf`` (:func:`route_buffer_len`
    elements): :func:`.experts_kernels.experts_route_kernel` alone, or above ``one_program_max`` pairs
    :func:`.experts_kernels.experts_route_count_kernel` then :func:`.experts_kernels.experts_route_place_kernel`;
    ``chunk``, ``warps`` and ``one_program_max`` other than the defaults for ``bench/experts_routing.py``."""
    from .experts_kernels import experts_route_count_kernel, experts_route_kernel, experts_route_place_kernel

    p = ids.shape[0]
    n_tiles, e_p2 = route_sizes(p, experts, block_m)
    order, tile_expert, tile_row0, tile_end, scratch = route_views(buf, p, n_tiles)
    plan = (order, tile_expert, tile_row0, tile_end)
    chunks = route_chunks(p, chunk, one_program_max)
    if chunks == 0:
        args = (ids, *plan, scratch, p, experts, n_tiles, block_m, e_p2, chunk)
        return [(experts_route_kernel, (1,), args, warps)]
    hist, cursors = scratch[:chunks * e_p2], scratch[chunks * e_p2:]
    return [(experts_route_count_kernel, (chunks,), (ids, hist, p, experts, e_p2, chunk), warps),
            (experts_route_place_kernel, (chunks,),
             (ids, hist, *plan, cursors, p, experts, n_tiles, chunks, block_m, e_p2, chunk), warps)]


def route_views(buf: torch.Tensor, pairs: Any, n_tiles: Any) -> tuple[torch.Tensor, ...]:
    """``(order, tile_expert, tile_row0, tile_end, scratch)``: the views of the routing's one int32 output."""
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


#: the tiled GEMM's grid order: a tile's row blocks launched together (``N_FIRST``) where the tiles fit the grid's
#: second axis (:data:`GRID_Y_MAX`). In CUDA graphs on an H100, against the tiles of a row block together: level at
#: 512 tokens, 0.96x at 2048 and 0.91x at 8192 for Qwen3-30B-A3B's experts, 0.96x for DeepSeek-V3's at 8192
#: (``bench/results/moe_experts/2026-12-05-h100-grid-order/``)
GEMM_N_FIRST = True


def gemm_kernel_args(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     order: torch.Tensor, tile_expert: torch.Tensor, tile_row0: torch.Tensor, tile_end: torch.Tensor,
                     rw: torch.Tensor | None, token_div: int, block_m: int, out: torch.Tensor,
                     n_first: bool | None = None) -> tuple[Any, tuple[int, int], tuple[Any, ...], int, int]:
    """The tiled GEMM's launch ``(kernel, grid, args, warps, stages)``; ``n_first`` the grid order (default
    :data:`GEMM_N_FIRST`; tiles beyond :data:`GRID_Y_MAX` take the other)."""
    from .experts_kernels import experts_gemm_kernel

    e, n, k = w.shape
    block_n = 128
    tiles, n_blocks = tile_expert.shape[0], -(-n // block_n)
    n_first = (GEMM_N_FIRST if n_first is None else n_first) and tiles <= GRID_Y_MAX
    args = (x_q, w, out, x_scale, w_scale, order, tile_expert, tile_row0, tile_end, out if rw is None else rw,
            n, k, e, token_div,
            x_q.stride(0), x_q.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            x_scale.stride(0), x_scale.stride(1), *scale_strides(w_scale)[:3],
            block_m, block_n, GROUP_SIZE, WEIGHT_BLOCK[0], WEIGHT_BLOCK[1], k % GROUP_SIZE == 0, rw is not None,
            w_scale.dim() == 2, n_first)
    return experts_gemm_kernel, (n_blocks, tiles) if n_first else (tiles, n_blocks), args, 4, 3


__all__ = ["BLOCK_MS", "GROUP_SIZE", "block_m_for", "gemm_kernel_args", "kernel_args", "route_buffer_len",
           "route_chunks", "route_launches", "route_sizes", "route_views", "scale_strides"]
