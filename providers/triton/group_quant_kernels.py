"""Triton per-token-group FP8 activation quantization: ``x [M, K] -> (q [M, K], scale [M, ceil(K / G)])``.

Semantics (:func:`fp8_backends.core.reference`'s per-token quantization applied to each group of ``G`` columns of a
row; ``fmax`` 448 for e4m3fn, 57344 for e5m2)::

    scale[m, g] = max(amax(|x[m, g·G : (g+1)·G]|) / fmax, 1e-12)        # the last group may be shorter
    q[m, k]     = fp8(clamp(x[m, k] / scale[m, k // G], ±fmax))

in fp32 with IEEE-rounded divisions (``div_rn``), so codes and scales equal the reference's CPU results bit for bit
(see :mod:`.quant_kernels` for why not a reciprocal). A NaN in a group makes that group's scale NaN and its codes
NaN, as the reference's ``amax`` and ``clamp`` keep it (:mod:`.nan_math`).

- ``x``: bf16/fp16/fp32 with any strides (transposed, sliced, row stride > K): addressed through ``stride(0)`` /
  ``stride(1)``; a unit column stride gives vector loads.
- ``q``: a new row-major ``[M, K]`` tensor (or :func:`.group_quant_ops.quant_per_token_group`'s ``q_out``, any row
  stride, unit column stride).
- ``scale``: fp32 ``[M, ceil(K / G)]`` in the requested layout (:data:`SCALE_LAYOUTS`, :func:`group_scale_empty`):
  ``row_major`` (strides ``(Kg, 1)``), ``m_major`` (the transpose of a contiguous ``[Kg, M]``: strides ``(1, M)``,
  what cuBLASLt's blockwise ``torch._scaled_mm`` reads) or ``m_major_tma`` (M padded to a multiple of 4: strides
  ``(1, round_up(M, 4))``, the 16-byte aligned columns TMA-fed kernels such as DeepGEMM's and flashinfer's
  ``fp8_blockscale_gemm_sm90`` load; the padding rows are left unwritten). ``scale_out`` takes any ``[M, Kg]`` fp32
  tensor instead, whatever its strides. The kernel writes through the strides, so every layout costs the same.
- ``G``: 128 or 64 (any power of two >= 16 works).

Launch shape: programs of ``ROWS x GROUPS`` groups (about :data:`TILE` elements, 4 warps), a ``[ROWS, GROUPS, G]``
block, grid ``(cdiv(M, ROWS), cdiv(Kg, GROUPS))``; ``GROUPS`` is the power of two (at most ``TILE / G``) that wastes
the fewest masked groups (``K = 7168``: 56 groups of 128 as 7 programs of 8, not 2 of 32); ``ROWS`` at most
``next_pow2(M)`` below 64 tokens. PDL as the other quant
kernels: ``gdc_wait`` before the first load, ``gdc_launch_dependents`` once ``x`` is read.

This module holds the kernel and what one launch of it is (:func:`kernel_args`), shared by the eager call and the op
(:mod:`.group_quant_ops`) and the op's traced body (:mod:`.group_quant_traced`). It imports torch and triton: import it
lazily.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fp8_backends.core import group_scales
from fp8_backends.core.errors import Fp8BackendError, InvalidInputError
from fp8_backends.core.types import Fp8Dtype, ScaleLayout

from .nan_math import dynamic_scale, nan_max_reduce, scaled_cast

#: the largest finite value of each float8 type the kernel writes
FMAX: dict[torch.dtype, float] = {dt.torch_dtype(): dt.max for dt in Fp8Dtype}

#: the scale layouts :func:`group_scale_empty` makes (:class:`fp8_backends.core.types.ScaleLayout` values)
SCALE_LAYOUTS = tuple(layout.value for layout in ScaleLayout)
GROUP_SIZES = (64, 128)
#: elements per program and its warps
TILE = 4096
TILE_WARPS = 4


@triton.jit
def _group_quant_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_sm, stride_sg,
    FMAX: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr, G: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``ROWS`` rows x ``GROUPS`` groups of ``G`` columns: one amax, scale and quantization per group."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * G + tl.arange(0, G)[None, :]  # [GROUPS, G]
    row_in = rows < M
    mask = row_in[:, None, None] & (cols < K)[None, :, :]
    rows64 = rows.to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + rows64[:, None, None] * stride_xm + cols[None, :, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    scale = dynamic_scale(nan_max_reduce(tl.abs(x), 2), FMAX)  # [ROWS, GROUPS]
    tl.store(s_ptr + rows64[:, None] * stride_sm + groups[None, :] * stride_sg, scale,
             mask=row_in[:, None] & (groups * G < K)[None, :])
    y = scaled_cast(x, scale[:, :, None], FMAX, q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows64[:, None, None] * stride_qm + cols[None, :, :], y, mask=mask)


class GroupConfig(NamedTuple):
    rows: int
    groups: int
    num_warps: int


@functools.lru_cache(maxsize=512)
def group_config(k: int, group_size: int, m: int | None = None) -> GroupConfig:
    """``ROWS x GROUPS`` of a program for rows of ``k`` columns in groups of ``group_size`` (module docstring); with
    ``m`` given, at most ``next_pow2(m)`` rows (a decode batch of 1-8 tokens gets programs of its own rows only)."""
    kg = max(1, -(-k // group_size))
    most = max(1, TILE // group_size)
    best, best_pad = 1, None
    g = 1
    while g <= most:
        pad = -(-kg // g) * g - kg
        if best_pad is None or pad <= best_pad:  # ties: the larger block
            best, best_pad = g, pad
        g *= 2
    rows = max(1, TILE // (best * group_size))
    if m is not None:
        rows = min(rows, triton.next_power_of_2(max(m, 1)))
    return GroupConfig(rows, best, TILE_WARPS)


def check_fp8(fp8_dtype: torch.dtype) -> float:
    try:
        return FMAX[fp8_dtype]
    except KeyError:
        raise InvalidInputError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}") \
            from None


def group_scale_buffer(m: int, kg: int, layout: str | ScaleLayout, like: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, scale)``: a new fp32 ``[m, kg]`` scale tensor on ``like``'s device in ``layout``
    (:data:`SCALE_LAYOUTS`) and the contiguous buffer it views
    (:func:`fp8_backends.core.group_scales.empty_group_scale_buffer`)."""
    try:
        layout = ScaleLayout.of(layout)
    except (ValueError, Fp8BackendError):
        raise InvalidInputError(f"scale_layout must be one of {', '.join(SCALE_LAYOUTS)}, got {layout!r}") from None
    return group_scales.empty_group_scale_buffer(m, kg, layout, like.device)


def group_scale_empty(m: int, kg: int, layout: str | ScaleLayout, like: torch.Tensor) -> torch.Tensor:
    """A new fp32 ``[m, kg]`` scale tensor on ``like``'s device in ``layout`` (:data:`SCALE_LAYOUTS`)."""
    return group_scale_buffer(m, kg, layout, like)[1]


def scale_layout_of(scale: torch.Tensor) -> str | None:
    """The :data:`SCALE_LAYOUTS` name of a ``[M, Kg]`` scale tensor's strides (``None``: another layout; the first
    that fits where a size-1 dimension makes several fit)."""
    for layout in ScaleLayout:
        if group_scales.is_layout(scale, layout):
            return layout.value
    return None


def kernel_args(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int, use_pdl: bool,
                scale_buffer: torch.Tensor | None = None) -> tuple[Any, tuple[int, ...], tuple[Any, ...], int]:
    """``(kernel, grid, args, num_warps)`` of a launch (sizes may be symbolic under tracing). ``scale_buffer``: the
    tensor the kernel is handed to write ``scale`` through (``scale``'s strides from its first element: the buffer
    :func:`group_scale_buffer` returns with it; default ``scale`` itself). A K unknown while tracing gets the
    one-group-per-program configuration."""
    m, k = x.shape
    if isinstance(k, int):
        cfg = group_config(k, group_size, m if isinstance(m, int) and m < 64 else None)
    else:
        cfg = GroupConfig(max(1, TILE // group_size), 1, TILE_WARPS)
    kg = (k + group_size - 1) // group_size
    grid = ((m + cfg.rows - 1) // cfg.rows, (kg + cfg.groups - 1) // cfg.groups)
    args = (x, q, scale if scale_buffer is None else scale_buffer, m, k, x.stride(0), x.stride(1), q.stride(0),
            scale.stride(0), scale.stride(1), FMAX[q.dtype], cfg.rows, cfg.groups, group_size, use_pdl)
    return _group_quant_kernel, grid, args, cfg.num_warps


__all__ = [
    "FMAX", "GROUP_SIZES", "SCALE_LAYOUTS", "GroupConfig", "check_fp8", "group_config", "group_scale_buffer",
    "group_scale_empty",
    "kernel_args", "scale_layout_of",
]
