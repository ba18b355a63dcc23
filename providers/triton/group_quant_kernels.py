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
- ``q``: a new row-major ``[M, K]`` tensor (or ``q_out``, any row stride, unit column stride).
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

Eager calls (:func:`quant_per_token_group`) launch through :mod:`.launcher` with replays; ``torch.compile`` sees the
``fp8_backends::triton_quant_per_token_group`` op (:func:`load_op`), a ``triton_op`` whose traced body
(:mod:`.block_traced_ops`) launches the same kernel from Inductor's code. No host-device synchronisation;
CUDA-graph capturable. This module imports torch and triton: import it lazily.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fp8_backends.core import group_scales
from fp8_backends.core.errors import Fp8BackendError, InvalidInputError
from fp8_backends.core.oplib import LazyOps, TritonOpSpec
from fp8_backends.core.types import ScaleLayout

from . import _support
from .launcher import ReplayCache, launcher_for, raw_stream
from .nan_math import nan_clamp, nan_max_reduce, nan_maximum
from .quant_kernels import FMAX

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
    scale = nan_maximum(tl.math.div_rn(nan_max_reduce(tl.abs(x), 2), FMAX), 1e-12)  # [ROWS, GROUPS]
    tl.store(s_ptr + rows64[:, None] * stride_sm + groups[None, :] * stride_sg, scale,
             mask=row_in[:, None] & (groups * G < K)[None, :])
    y = nan_clamp(tl.math.div_rn(x, scale[:, :, None]), -FMAX, FMAX)
    tl.store(q_ptr + rows64[:, None, None] * stride_qm + cols[None, :, :], y.to(q_ptr.dtype.element_ty), mask=mask)


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


def _fmax(fp8_dtype: torch.dtype) -> float:
    try:
        return FMAX[fp8_dtype]
    except KeyError:
        raise InvalidInputError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}") \
            from None


def group_scale_empty(m: int, kg: int, layout: str | ScaleLayout, like: torch.Tensor) -> torch.Tensor:
    """A new fp32 ``[m, kg]`` scale tensor on ``like``'s device in ``layout`` (:data:`SCALE_LAYOUTS`;
    :func:`fp8_backends.core.group_scales.empty_group_scale`)."""
    try:
        layout = ScaleLayout.of(layout)
    except (ValueError, Fp8BackendError):
        raise InvalidInputError(f"scale_layout must be one of {', '.join(SCALE_LAYOUTS)}, got {layout!r}") from None
    return group_scales.empty_group_scale(m, kg, layout, like.device)


def scale_layout_of(scale: torch.Tensor) -> str | None:
    """The :data:`SCALE_LAYOUTS` name of a ``[M, Kg]`` scale tensor's strides (``None``: another layout; the first
    that fits where a size-1 dimension makes several fit)."""
    for layout in ScaleLayout:
        if group_scales.is_layout(scale, layout):
            return layout.value
    return None


def _q_empty(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    if x.is_contiguous():
        return torch.empty_like(x, dtype=fp8_dtype)
    return x.new_empty(x.shape, dtype=fp8_dtype)


def kernel_args(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int, use_pdl: bool
                ) -> tuple[Any, tuple[int, ...], tuple[Any, ...], int]:
    """``(kernel, grid, args, num_warps)`` of a launch (sizes may be symbolic under tracing)."""
    m, k = x.shape
    cfg = group_config(k, group_size, m if isinstance(m, int) and m < 64 else None)
    kg = (k + group_size - 1) // group_size
    grid = ((m + cfg.rows - 1) // cfg.rows, (kg + cfg.groups - 1) // cfg.groups)
    args = (x, q, scale, m, k, x.stride(0), x.stride(1), q.stride(0), scale.stride(0), scale.stride(1),
            FMAX[q.dtype], cfg.rows, cfg.groups, group_size, use_pdl)
    return _group_quant_kernel, grid, args, cfg.num_warps


#: replays: a call passes its three data pointers; sizes, strides and flags are fixed by the key
_replays = ReplayCache(head=3)


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int, index: int) -> None:
    use_pdl = _support.pdl_on(index)
    key = None
    if index >= 0:
        px, pq, ps = x.data_ptr(), q.data_ptr(), scale.data_ptr()
        if not (px | pq | ps) & 15:
            key = (x.shape, x.stride(), q.stride(0), scale.stride(), group_size, x.dtype, q.dtype, use_pdl, index)
            hit = _replays.lookup(key)
            if hit is not None and index == _support.current_device():
                r = hit[0]
                r.run(r.g0, r.g1, r.g2, raw_stream(index), r.function, r.packed, None, None, None, px, pq, ps,
                      *hit[1])
                return
    kernel, grid, args, warps = kernel_args(x, q, scale, group_size, use_pdl)
    kernel_launcher = launcher_for(kernel)
    options = {"num_warps": warps, "pdl": use_pdl, "device_index": max(index, 0)}
    kernel_launcher(grid, args, **options)
    if key is not None:
        _replays.record(key, kernel_launcher, grid, args, **options)


def quant_per_token_group(
    x: torch.Tensor, group_size: int = 128, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_layout: str = "row_major", *, q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization of ``x [M, K]``: ``(q [M, K], scale [M, ceil(K / group_size)])`` (module
    docstring). ``q_out`` / ``scale_out``: tensors to write instead of new ones (``scale_out`` in any layout, which
    then overrides ``scale_layout``)."""
    _fmax(fp8_dtype)
    if x.dim() != 2:
        raise InvalidInputError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if group_size < 16 or group_size & (group_size - 1):
        raise InvalidInputError(f"group_size must be a power of two >= 16 (64 or 128), got {group_size}")
    m, k = x.shape
    kg = -(-k // group_size)
    if q_out is None:
        q = _q_empty(x, fp8_dtype)
    else:
        if tuple(q_out.shape) != (m, k) or q_out.dtype != fp8_dtype or q_out.device != x.device or (
                k > 1 and q_out.stride(1) != 1):
            raise InvalidInputError(f"q_out must be {fp8_dtype} [{m}, {k}] on {x.device} with unit column stride")
        q = q_out
    if scale_out is None:
        scale = group_scale_empty(m, kg, scale_layout, x)
    else:
        if tuple(scale_out.shape) != (m, kg) or scale_out.dtype != torch.float32 or scale_out.device != x.device:
            raise InvalidInputError(f"scale_out must be fp32 [{m}, {kg}] on {x.device}, got {scale_out.dtype} "
                                    f"{list(scale_out.shape)} on {scale_out.device}")
        scale = scale_out
    if m == 0 or k == 0:
        return q, scale
    index = x.get_device()
    _support.on_device(index, _launch, x, q, scale, group_size, index)
    return q, scale


def quant_impl(x: torch.Tensor, group_size: int, scale_layout: str, fp8_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quant_per_token_group` with the argument order of the per-token-group entry of
    :func:`fp8_backends.quant.register_quant_impl`: ``(x, group_size, scale_layout, fp8_dtype) -> (q, scale)``."""
    return quant_per_token_group(x, group_size, fp8_dtype, str(getattr(scale_layout, "value", scale_layout)))


# ---------------------------------------------------------------------------------------------- the torch op
OP_BASENAME = "triton_quant_per_token_group"
OP_SCHEMA = (f"{OP_BASENAME}(Tensor x, int group_size, ScalarType fp8_dtype, str scale_layout) "
             "-> (Tensor, Tensor)")


def _op_eager(x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, scale_layout: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_per_token_group(x, group_size, fp8_dtype, scale_layout)


def _op_fake(x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, scale_layout: str
             ) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return x.new_empty((m, k), dtype=fp8_dtype), group_scale_empty(m, -(-k // group_size), scale_layout, x)


def _dispatch_keys() -> tuple[str, ...]:
    return ("CUDA", "CPU") if _support.interpreting() else ("CUDA",)


def _specs() -> dict[str, Any]:
    if _support.interpreting():
        return {OP_BASENAME: (OP_SCHEMA, _op_eager, _op_fake)}
    from . import block_traced_ops

    return {OP_BASENAME: TritonOpSpec(block_traced_ops.triton_quant_per_token_group, _op_eager)}


_OPS = LazyOps(_specs, _dispatch_keys)


def load_op() -> Any:
    """Define ``fp8_backends::triton_quant_per_token_group`` now (load time) and return its OpOverload."""
    _OPS.preload()
    return _OPS.op(OP_BASENAME)


def triton_quant_per_token_group(x: torch.Tensor, group_size: int = 128, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                                 scale_layout: str = "row_major") -> tuple[torch.Tensor, torch.Tensor]:
    """The op: :func:`quant_per_token_group` for plain eager calls, the traced body under ``torch.compile``."""
    return _OPS.call(OP_BASENAME)(x, group_size, fp8_dtype, scale_layout)


__all__ = [
    "GROUP_SIZES", "SCALE_LAYOUTS", "GroupConfig", "group_config", "group_scale_empty", "kernel_args", "load_op",
    "quant_impl", "quant_per_token_group", "scale_layout_of", "triton_quant_per_token_group",
]
