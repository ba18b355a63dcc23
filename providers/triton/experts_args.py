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



__all__ = ["BLOCK_MS", "GROUP_SIZE", "block_m_for", "gemm_kernel_args", "kernel_args", "scale_strides"]
