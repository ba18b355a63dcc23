"""Triton kernels: fused RMSNorm (+ residual add, in place) + dynamic FP8 quantization, per token group or per token.

What vLLM calls ``rms_norm_per_block_quant`` and ``rms_norm_dynamic_per_token_quant``. Per row, in fp32 (the order of
:func:`fp8_backends.core.reference.rmsnorm`; then the reference's per-token / per-token-group quantization)::

    s = x (+ residual)                   # the add variant stores s to residual (its dtype), normalizes the fp32 s
    y = (s * rsqrt(sum(s * s) / H + eps)) * w
    per_token_group:  scale[t, g] = max(amax(|y[g·G : (g+1)·G]|) / fmax, 1e-12)   -> [T, ceil(H / G)]
    per_token:        scale[t, 0] = max(amax(|y|) / fmax, 1e-12)                  -> [T, 1]
    q = fp8(clamp(y * (1 / scale), ±fmax))  # 1 / scale rounded once per group or row; fmax 448 (e4m3fn), 57344 (e5m2)

Operands (what :func:`rmsnorm_quant_dynamic` takes; a provider validates them):

- ``x``: ``[T, H]`` bf16/fp16/fp32, unit column stride, any row stride (``x[:, :H]`` of a wider buffer works).
- ``residual`` (add variant): ``[T, H]`` in any float dtype, unit column stride, updated **in place**.
- ``weight``: ``[H]``, any stride.
- ``q``: ``[T, H]`` float8 (new, row-major; or ``q_out``); ``scale``: fp32, new in the requested layout
  (:data:`.group_quant_kernels.SCALE_LAYOUTS`; ``[T, 1]`` contiguous per token) or ``scale_out`` in any layout.

The codes and scales match the reference up to the order of the sum of squares and of the products: the one-pass
kernel takes each group's maximum of ``|s · w|`` while the row's sum of squares is reduced (no wait for it), and
scales it by the row's ``r = rsqrt(...)`` after: ``scale = max(amax(|s · w|) · r / fmax, 1e-12)`` (``r`` > 0, so
this is the reference's maximum up to the rounding of the products), and the codes are ``(s · w) · ((1 / scale) ·
r)``; the chunked path computes ``y`` first, in the reference's order, and multiplies by ``1 / scale``. Either way
the result sits within an fp32 ulp or two of the reference's ``y / scale``, which moves a code one FP8 step only
when the quotient lies that close to a rounding midpoint: a code may rarely sit one step away, a scale a few fp32
ulps. A NaN in a row makes its whole normalized row, so all its scales and codes, NaN, as in the reference; an inf
makes the row's ``r`` 0: NaN scales and codes in its group (the reference's ``inf · 0``), zeros elsewhere (per
token: the whole row NaN). One division per group instead of one per element: on the H200 the per-element IEEE
division made the kernel compute-bound (bench/results/block_gemm/2026-12-03-h200-norm-launch-shapes/: 61 µs against
25 µs for the static-scale kernel over the same bytes, T = 4096, H = 7168); taking the maxima before the row's
reduction took 7-10% off with group scales (9-19% per token) without the residual add and up to 4% with it, against
the best launch shape of the former order (bench/results/block_gemm/2026-12-04-h200-norm-early-amax/).

Paths (the launch shape of :func:`dyn_config`, from the static kernel's :func:`.norm_kernels.one_row_config`):

- one pass (``next_pow2(H) <= 32768``): ``ROWS`` whole rows per program as a ``[ROWS, NG, GB]`` block: ``NG`` groups
  of ``GB = G`` columns (per token: one "group" of ``GB = next_pow2(H)`` columns), so each group's amax is a reduction
  over the last axis and the row's sum of squares over the last two. One read of ``x`` (and ``residual``), one write
  of ``q``, the scales (and ``residual``).
- packed (one pass): ``ROWS`` rows per program packed group after group into a power-of-two block of ``G``-column
  slots, the rows' sums and maxima gathered over their slots; large launches whose row fills less than
  :data:`PACKED_MAX_FILL` of its power-of-two block of groups and is not two parts run it with one row per program.
- parts (one pass): one row per program as up to three power-of-two blocks of groups (:func:`row_parts`: H = 5120 is
  32 + 8 groups), so no lane idles and no gather over slots is needed; 80 registers a thread on sm_90a at H = 5120
  against the packed kernel's 120. Large launches whose row fills less than :data:`PACKED_MAX_FILL` of its
  power-of-two block and is two parts run it, in every mode (:data:`PARTS_MAX`).
- two / three passes (larger ``H``): one row per program in chunks of ``NGC x G`` columns: the sum of squares, then
  (per token) the amax of the normalized row, then normalize / quantize / store, re-reading the row (mostly from L2);
  the residual is stored in the last pass, from the same fp32 sum.

PDL as the static kernels (``gdc_wait`` before the first load, ``gdc_launch_dependents`` once the inputs are read),
for launches below :data:`PDL_MAX_ELEMENTS` elements.
No host-device synchronisation and no allocation besides the outputs: CUDA-graph capturable.

This module holds the kernels and what one launch is (:func:`dyn_config`, :func:`kernel_args`), shared by the eager
call and the ops (:mod:`.norm_dynamic_ops`) and the ops' traced bodies (:mod:`.norm_dynamic_traced`). It imports torch
and triton: import it lazily.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from fp8_backends.core.errors import InvalidInputError

from .group_quant_kernels import FMAX, group_scale_buffer
from .nan_math import nan_clamp, nan_max_reduce, nan_maximum
from .norm_kernels import one_row_config
from .quant_kernels import LOOP_BLOCK, LOOP_WARPS

#: act_scale values (``fp8_backends.core.types.ActScale`` values): per token and per token group
PER_TOKEN = "per_token"
PER_TOKEN_GROUP = "per_token_group"


@triton.jit
def _sum_and_weight(x_ptr, r_ptr, w_ptr, x_offs, r_offs, w_offs, mask, w_mask, ADD: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """The one-pass kernels' inputs in fp32: ``x (+ residual)``, stored back to ``residual`` (its dtype) with the add,
    and the weight; the loads wait for the grid this launch depends on, which may launch once they are issued."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
    if ADD:
        x += tl.load(r_ptr + r_offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + w_offs, mask=w_mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if ADD:
        tl.store(r_ptr + r_offs, x.to(r_ptr.dtype.element_ty), mask=mask)
    return x, w


@triton.jit
def _norm_dyn_block_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, T, H, stride_x, stride_r, stride_q, stride_w, stride_sm, stride_sg, eps,
    FMAX: tl.constexpr, ROWS: tl.constexpr, NG: tl.constexpr, GB: tl.constexpr, ADD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``ROWS`` whole rows per program as ``[ROWS, NG, GB]``: ``NG`` scale groups of ``GB`` columns each. The groups'
    maxima are taken of ``x · w`` while the row's sum of squares is reduced, then scaled by the row's ``rsqrt``
    (module docstring)."""
    eps = tl.cast(eps, tl.float32)  # Inductor passes a Python float as fp64
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    groups = tl.arange(0, NG)
    cols = groups[:, None] * GB + tl.arange(0, GB)[None, :]  # [NG, GB]
    col_in = cols < H
    row_in = rows < T
    mask = row_in[:, None, None] & col_in[None, :, :]
    rows2 = rows.to(tl.int64)[:, None]
    rows64 = rows2[:, :, None]
    x, w = _sum_and_weight(x_ptr, r_ptr, w_ptr, rows64 * stride_x + cols[None, :, :],
                           rows64 * stride_r + cols[None, :, :], cols * stride_w, mask, col_in, ADD, USE_PDL)
    xw = x * w[None, :, :]
    amax = nan_max_reduce(tl.abs(xw), 2)  # [ROWS, NG]: no wait for the row's reduction
    rrms = tl.math.rsqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / H + eps)[:, None]  # [ROWS, 1]
    scale = nan_maximum(tl.math.div_rn(amax * rrms, FMAX), 1e-12)  # [ROWS, NG]
    tl.store(s_ptr + rows2 * stride_sm + groups[None, :] * stride_sg, scale,
             mask=row_in[:, None] & (groups * GB < H)[None, :])
    # one correctly rounded reciprocal per group (module docstring), times the row's rsqrt: one product per code
    q = nan_clamp(xw * (tl.math.div_rn(1.0, scale) * rrms)[:, :, None], -FMAX, FMAX)
    tl.store(q_ptr + rows64 * stride_q + cols[None, :, :], q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_dyn_packed_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, T, H, stride_x, stride_r, stride_q, stride_w, stride_sm, stride_sg, eps,
    FMAX: tl.constexpr, ROWS: tl.constexpr, ROWS_P2: tl.constexpr, NGR: tl.constexpr, SLOTS: tl.constexpr,
    GB: tl.constexpr, PER_TOKEN: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``ROWS`` whole rows per program packed group after group into ``SLOTS`` slots of ``GB`` columns: slot
    ``i`` holds group ``i % NGR`` of the program's row ``i // NGR`` (``NGR = ceil(H / GB)`` groups a row; ``SLOTS``
    the power of two at or above ``ROWS · NGR``, ``ROWS_P2`` the one at or above ``ROWS``). Where ``NGR`` is not a
    power of two, a row as one ``[next_pow2(NGR), GB]`` block leaves lanes idle (H = 5120: 40 groups in 64 slots); a
    few rows fill more of a block (3 rows: 120 in 128). Per slot the group's maximum of ``|x · w|`` and its sum of
    squares; the rows' sums, ``rsqrt`` and (per token) maxima are gathered over the slots of each row, with the
    one-pass kernel's order of operations."""
    eps = tl.cast(eps, tl.float32)
    slot = tl.arange(0, SLOTS)
    local = slot // NGR
    grp = slot - local * NGR
    rows = tl.program_id(0) * ROWS + local
    slot_in = (slot < ROWS * NGR) & (rows < T)
    cols = grp[:, None] * GB + tl.arange(0, GB)[None, :]  # [SLOTS, GB]
    col_in = cols < H
    mask = slot_in[:, None] & col_in
    rows64 = rows.to(tl.int64)[:, None]
    x, w = _sum_and_weight(x_ptr, r_ptr, w_ptr, rows64 * stride_x + cols, rows64 * stride_r + cols, cols * stride_w,
                           mask, mask, ADD, USE_PDL)
    squares = tl.sum(x * x, axis=1)  # [SLOTS]
    xw = x * w
    amax = nan_max_reduce(tl.abs(xw), 1)  # [SLOTS]
    row_ids = tl.arange(0, ROWS_P2)
    own = local[None, :] == row_ids[:, None]  # [rows, SLOTS]: the slots of each row
    rrms_row = tl.math.rsqrt(tl.sum(tl.where(own, squares[None, :], 0.0), axis=1) / H + eps)
    rrms = tl.sum(tl.where(own, rrms_row[:, None], 0.0), axis=0)  # [SLOTS]: its row's rsqrt
    if PER_TOKEN:
        scale_row = nan_maximum(tl.math.div_rn(nan_max_reduce(tl.where(own, amax[None, :], 0.0), 1) * rrms_row,
                                               FMAX), 1e-12)
        token = tl.program_id(0) * ROWS + row_ids
        tl.store(s_ptr + token.to(tl.int64) * stride_sm, scale_row, mask=(row_ids < ROWS) & (token < T))
        inv = tl.sum(tl.where(own, (tl.math.div_rn(1.0, scale_row) * rrms_row)[:, None], 0.0), axis=0)
    else:
        scale = nan_maximum(tl.math.div_rn(amax * rrms, FMAX), 1e-12)  # [SLOTS]
        tl.store(s_ptr + rows.to(tl.int64) * stride_sm + grp * stride_sg, scale, mask=slot_in)
        inv = tl.math.div_rn(1.0, scale) * rrms
    q = nan_clamp(xw * inv[:, None], -FMAX, FMAX)
    tl.store(q_ptr + rows64 * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _part_in(x_row, r_row, w_ptr, first_group, H, stride_w, P: tl.constexpr, GB: tl.constexpr, ADD: tl.constexpr,
             USE_PDL: tl.constexpr):
    """Groups ``first_group`` to ``first_group + P - 1`` of a row as a ``[P, GB]`` block: the fp32 ``x (+ residual)``
    (the residual stored), ``x · w``, its sum of squares and its groups' maxima of ``|x · w|``."""
    cols = (first_group + tl.arange(0, P))[:, None] * GB + tl.arange(0, GB)[None, :]
    mask = cols < H
    x, w = _sum_and_weight(x_row, r_row, w_ptr, cols, cols, cols * stride_w, mask, mask, ADD, USE_PDL)
    xw = x * w
    return xw, tl.sum(tl.sum(x * x, axis=1), axis=0), nan_max_reduce(tl.abs(xw), 1)


@triton.jit
def _part_out(xw, amax, rrms, inv_token, q_row, s_row, first_group, H, stride_sg, FMAX: tl.constexpr,
              P: tl.constexpr, GB: tl.constexpr, PER_TOKEN: tl.constexpr):
    """Quantize and store a part of :func:`_part_in`: per group (its scales stored) or by the row's ``inv_token``."""
    groups = first_group + tl.arange(0, P)
    cols = groups[:, None] * GB + tl.arange(0, GB)[None, :]
    if PER_TOKEN:
        inv = inv_token
    else:
        scale = nan_maximum(tl.math.div_rn(amax * rrms, FMAX), 1e-12)  # [P]
        tl.store(s_row + groups * stride_sg, scale, mask=groups * GB < H)
        inv = (tl.math.div_rn(1.0, scale) * rrms)[:, None]
    q = nan_clamp(xw * inv, -FMAX, FMAX)
    tl.store(q_row + cols, q.to(q_row.dtype.element_ty), mask=cols < H)


@triton.jit
def _norm_dyn_parts_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, H, stride_x, stride_r, stride_q, stride_w, stride_sm, stride_sg, eps,
    FMAX: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, GB: tl.constexpr,
    PER_TOKEN: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row per program as up to three power-of-two blocks of ``GB``-column groups (``P0 + P1 + P2`` groups, ``P1``
    / ``P2`` zero when absent; :func:`row_parts`): a row of 40 groups (H = 5120) is 32 + 8 groups with no idle lane,
    where one power-of-two block holds 64. The one-pass kernel's order of operations: each part's maxima of
    ``|x · w|`` and sum of squares, then the row's ``rsqrt``, then the scales and codes part by part."""
    eps = tl.cast(eps, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    q_row = q_ptr + row * stride_q
    s_row = s_ptr + row * stride_sm
    xw0, ss, a0 = _part_in(x_row, r_row, w_ptr, 0, H, stride_w, P0, GB, ADD, USE_PDL)
    amax = nan_max_reduce(a0, 0)
    if P1 > 0:
        xw1, ss1, a1 = _part_in(x_row, r_row, w_ptr, P0, H, stride_w, P1, GB, ADD, False)
        ss += ss1
        amax = nan_maximum(amax, nan_max_reduce(a1, 0))
    if P2 > 0:
        xw2, ss2, a2 = _part_in(x_row, r_row, w_ptr, P0 + P1, H, stride_w, P2, GB, ADD, False)
        ss += ss2
        amax = nan_maximum(amax, nan_max_reduce(a2, 0))
    rrms = tl.math.rsqrt(ss / H + eps)
    inv_token = rrms
    if PER_TOKEN:
        token_scale = nan_maximum(tl.math.div_rn(amax * rrms, FMAX), 1e-12)
        tl.store(s_row, token_scale)
        inv_token = tl.math.div_rn(1.0, token_scale) * rrms
    _part_out(xw0, a0, rrms, inv_token, q_row, s_row, 0, H, stride_sg, FMAX, P0, GB, PER_TOKEN)
    if P1 > 0:
        _part_out(xw1, a1, rrms, inv_token, q_row, s_row, P0, H, stride_sg, FMAX, P1, GB, PER_TOKEN)
    if P2 > 0:
        _part_out(xw2, a2, rrms, inv_token, q_row, s_row, P0 + P1, H, stride_sg, FMAX, P2, GB, PER_TOKEN)


def row_parts(groups: int) -> tuple[int, int, int]:
    """A row of ``groups`` groups as the parts of :func:`_norm_dyn_parts_kernel`: the two largest powers of two of
    ``groups``' binary form, and the power of two at or above the rest (its idle lanes masked): 40 -> (32, 8, 0),
    56 -> (32, 16, 8), 120 -> (64, 32, 32)."""
    p0 = 1 << (groups.bit_length() - 1)
    rest = groups - p0
    p1 = 1 << (rest.bit_length() - 1) if rest else 0
    rest -= p1
    return p0, p1, triton.next_power_of_2(rest) if rest else 0


@triton.jit
def _row_chunk(x_row, r_row, cols, mask, ADD: tl.constexpr, EVICT: tl.constexpr):
    """One chunk of a row: the fp32 sum ``x (+ residual)``."""
    v = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    if ADD:
        v += tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
    return v


@triton.jit
def _norm_dyn_loop_kernel(
    x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, H, stride_x, stride_r, stride_q, stride_w, stride_sm, stride_sg, eps,
    FMAX: tl.constexpr, NGC: tl.constexpr, G: tl.constexpr, PER_TOKEN: tl.constexpr, ADD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row per program in chunks of ``NGC`` groups of ``G`` columns: sum of squares; (per token) the row's amax;
    then normalize, quantize and store (module docstring)."""
    eps = tl.cast(eps, tl.float32)
    CHUNK: tl.constexpr = NGC * G
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    q_row = q_ptr + row * stride_q
    groups = tl.arange(0, NGC)
    local = groups[:, None] * G + tl.arange(0, G)[None, :]  # [NGC, G]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([NGC, G], dtype=tl.float32)
    for start in range(0, H, CHUNK):
        cols = start + local
        v = _row_chunk(x_row, r_row, cols, cols < H, ADD, "evict_last")
        acc += v * v
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rrms = tl.math.rsqrt(tl.sum(tl.sum(acc, axis=1), axis=0) / H + eps)
    if PER_TOKEN:
        amax = tl.zeros([NGC, G], dtype=tl.float32)
        for start in range(0, H, CHUNK):
            cols = start + local
            mask = cols < H
            v = _row_chunk(x_row, r_row, cols, mask, ADD, "evict_last")
            w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
            amax = nan_maximum(amax, tl.abs(v * rrms * w))
        token_scale = nan_maximum(tl.math.div_rn(nan_max_reduce(nan_max_reduce(amax, 1), 0), FMAX), 1e-12)
        tl.store(s_ptr + row * stride_sm, token_scale)
        token_inv = tl.math.div_rn(1.0, token_scale)
    for start in range(0, H, CHUNK):
        cols = start + local
        mask = cols < H
        v = _row_chunk(x_row, r_row, cols, mask, ADD, "evict_first")
        if ADD:
            tl.store(r_row + cols, v.to(r_ptr.dtype.element_ty), mask=mask)
        w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
        y = v * rrms * w
        if PER_TOKEN:
            inv = token_inv
        else:
            group_scale = nan_maximum(tl.math.div_rn(nan_max_reduce(tl.abs(y), 1), FMAX), 1e-12)  # [NGC]
            g = start // G + groups
            tl.store(s_ptr + row * stride_sm + g * stride_sg, group_scale, mask=g * G < H)
            inv = tl.math.div_rn(1.0, group_scale)[:, None]
        q = nan_clamp(y * inv, -FMAX, FMAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


#: elements of the row block per thread in the one-pass launch with the residual add (the static kernel's table has
#: 16 warps below 2^25 elements and 4 above): 8 warps at H = 7168 (32 elements each) ran 54.2 against 60.9 µs with 16
#: at T = 4096 (bench/results/block_gemm/2026-12-03-h200-norm-reciprocal/), and 1-6% less time than 4 at T = 16384,
#: H = 4096-7168 (bench/results/block_gemm/2026-12-04-h200-norm-early-amax/). Without the residual add the dynamic
#: launch keeps the static table's warps (4 for large launches: 3-12% faster than 8 in that run, one row per program).
DYN_ELEMS_PER_THREAD = 32


#: launches of at least this many elements (``T · H``) run without PDL: on the H200 at H = 7168, T = 4096 / 16384 the
#: one-pass kernel without the residual add took 34.0 / 128.1 µs with PDL against 27.2 / 95.0 without it (a chain of
#: these kernels in a CUDA graph), per token with the residual add 57.5 against 52.1 µs; the static-scale kernel was
#: unaffected (bench/results/block_gemm/2026-12-04-h200-norm-pdl/). Smaller launches (decode) keep PDL, whose overlap
#: of the next kernel's launch pays where a launch is a few µs.
PDL_MAX_ELEMENTS = 1 << 22

#: large launches (``T · H >= PDL_MAX_ELEMENTS``) whose row fills less than this share of its power-of-two block of
#: groups leave the one-row block: the parts kernel where the row is at most :data:`PARTS_MAX` parts, else the packed
#: kernel, one row per program on 4 warps (group scales, or per token with the residual add). The packed kernel, when
#: it was measured against the one-row block at H = 5120 (40 groups filling 40 of 64 slots) on the H200, took 22.4 /
#: 75.2 µs against the one-row block's 24.7 / 87.8 with group scales at T = 4096 / 16384 (69 / 82% of copy bandwidth
#: against 62 / 70%), 40.9 / 147.7 against 41.6 / 157.5 with the residual add, per token with it 147.8 against 154.1
#: at T = 16384; at H = 7168 (56 of 64) and 4096 it was no faster, per token without the residual add slower
#: (bench/results/block_gemm/2026-12-04-h200-norm-packed/).
PACKED_MAX_FILL = 0.75

#: the most parts a row may take to run the parts kernel where :data:`PACKED_MAX_FILL` calls for a repacked row: at
#: H = 5120 (32 + 8 groups), 4 warps, on the H200 it took 19.9 / 68.8 µs per token without the residual add at
#: T = 4096 / 16384 against the one-row block's 21.0 / 74.8 (77 / 89% of copy bandwidth against 72 / 82%), 38.5 / 144.0
#: with group scales and the residual add against the packed kernel's 40.8 / 148.4, per token with it 38.8 / 143.3
#: against 40.8 / 148.0, with group scales without it 21.9 / 77.7 against 22.3 / 75.9; a row of three parts ran
#: 1.01-1.23x the one-row block's time at H = 7168 (32 + 16 + 8), so those keep the packed kernel
#: (bench/results/block_gemm/2026-12-05-h200-norm-parts/).
PARTS_MAX = 2

#: the columns of a part's group when per-token scales are computed by the parts kernel (the scale is the row's; the
#: groups only cut the row into parts)
PARTS_TOKEN_GROUP = 128


class DynConfig(NamedTuple):
    """A launch: ``path`` ``"block"`` (``rows`` rows of ``ng`` groups of ``gb`` columns per program), ``"packed"``
    (``rows`` rows of ``ng = ceil(H / gb)`` groups each, packed into the power of two of slots at or above
    ``rows · ng``), ``"parts"`` (one row of ``ng = ceil(H / gb)`` groups as :func:`row_parts`; per token ``gb`` only
    slices the row) or ``"loop"`` (one row per program, chunks of ``ng`` groups of ``gb`` columns), and its warps."""

    path: str
    rows: int
    ng: int
    gb: int
    num_warps: int


def dyn_config(t: int, h: int, add: bool, group_size: int, per_token: bool, single_pass_max: int | None = None,
               loop_block: int = LOOP_BLOCK) -> DynConfig:
    """The launch shape for ``[t, h]`` rows: :func:`.norm_kernels.one_row_config` (rows per program and warps as
    measured for the static kernel, without its pairing of rows: one row per program ran 4-7% faster at H = 4096,
    bench/results/block_gemm/2026-12-04-h200-norm-early-amax/), the warps of :data:`DYN_ELEMS_PER_THREAD` with the
    residual add, the row block split into scale groups; the parts or packed kernel where :data:`PACKED_MAX_FILL`
    and :data:`PARTS_MAX` say.
    ``single_pass_max`` / ``loop_block`` let tests reach the chunked path at small ``H``."""
    from .quant_kernels import SINGLE_PASS_MAX

    base = one_row_config(t, h, add)
    limit = SINGLE_PASS_MAX if single_pass_max is None else single_pass_max
    block = triton.next_power_of_2(max(h, 1))
    if block <= limit and base.path != "loop":
        gb = PARTS_TOKEN_GROUP if per_token else group_size
        groups = -(-h // gb)
        fill = groups / triton.next_power_of_2(groups)
        if fill < PACKED_MAX_FILL and t * h >= PDL_MAX_ELEMENTS:
            if sum(1 for p in row_parts(groups) if p) <= PARTS_MAX:
                return DynConfig("parts", 1, groups, gb, 4)
            if add or not per_token:
                return DynConfig("packed", 1, groups, gb, 4)
        width = max(base.block, block)
        warps = min(16, max(4, base.rows * width // (32 * DYN_ELEMS_PER_THREAD)))
        if not add:
            warps = min(base.num_warps, warps)
        if per_token:
            return DynConfig("block", base.rows, 1, width, warps)
        gb = group_size
        # a row narrower than one group still takes a whole group's columns: fewer rows keep the program's size
        rows = base.rows if width >= gb else max(1, base.rows * width // gb)
        return DynConfig("block", rows, max(1, width // gb), gb, warps)
    gb = group_size
    chunk = max(gb, min(triton.next_power_of_2(loop_block), block))
    return DynConfig("loop", 1, chunk // gb, gb, LOOP_WARPS if chunk >= LOOP_BLOCK else 8)


def kernel_args(cfg: DynConfig, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                q: torch.Tensor, scale: torch.Tensor, eps: float, per_token: bool, use_pdl: bool,
                scale_buffer: torch.Tensor | None = None) -> tuple[Any, tuple[int, ...], tuple[Any, ...]]:
    """``(kernel, grid, args)`` of a launch: every kernel parameter in order, the five pointers first (a replay passes
    those and ``eps`` itself). Sizes may be symbolic under tracing. ``scale_buffer``: the tensor the kernel writes
    ``scale`` through (``scale``'s strides from its first element; default ``scale``): a traced launch hands the
    contiguous buffer a padded scale views (:func:`.group_quant_kernels.group_scale_buffer`), so the write is not
    traced as a write of a copy."""
    t, h = x.shape
    add = residual is not None
    r = residual if add else x
    strides = (x.stride(0), r.stride(0), q.stride(0), weight.stride(0), scale.stride(0), scale.stride(1))
    fmax = FMAX[q.dtype]
    s = scale if scale_buffer is None else scale_buffer
    if cfg.path == "loop":
        return (_norm_dyn_loop_kernel, (t,),
                (x, r, weight, q, s, h, *strides, eps, fmax, cfg.ng, cfg.gb, per_token, add, use_pdl))
    if cfg.path == "parts":
        return (_norm_dyn_parts_kernel, (t,),
                (x, r, weight, q, s, h, *strides, eps, fmax, *row_parts(cfg.ng), cfg.gb, per_token, add, use_pdl))
    if cfg.path == "packed":
        return (_norm_dyn_packed_kernel, ((t + cfg.rows - 1) // cfg.rows,),
                (x, r, weight, q, s, t, h, *strides, eps, fmax, cfg.rows, triton.next_power_of_2(cfg.rows), cfg.ng,
                 triton.next_power_of_2(cfg.rows * cfg.ng), cfg.gb, per_token, add, use_pdl))
    return (_norm_dyn_block_kernel, ((t + cfg.rows - 1) // cfg.rows,),
            (x, r, weight, q, s, t, h, *strides, eps, fmax, cfg.rows, cfg.ng, cfg.gb, add, use_pdl))


def per_token_mode(act_scale: object) -> bool:
    """True for per token, False for per token group (``act_scale``: an ActScale or its value)."""
    value = getattr(act_scale, "value", act_scale)
    if value == PER_TOKEN:
        return True
    if value == PER_TOKEN_GROUP:
        return False
    raise InvalidInputError(f"act_scale must be {PER_TOKEN!r} or {PER_TOKEN_GROUP!r}, got {act_scale!r}")


def output_buffers(x: torch.Tensor, group_size: int, scale_layout: str, fp8_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, scale's buffer)``: new outputs of the ops, and the contiguous buffer the scale views."""
    t, h = x.shape
    q = x.new_empty((t, h), dtype=fp8_dtype)
    if group_size == 0:
        scale = x.new_empty((t, 1), dtype=torch.float32)
        return q, scale, scale
    buffer, scale = group_scale_buffer(t, (h + group_size - 1) // group_size, scale_layout, x)
    return q, scale, buffer


def outputs_like(x: torch.Tensor, group_size: int, scale_layout: str, fp8_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """New ``q`` and ``scale`` of the ops (also their fake implementations)."""
    return output_buffers(x, group_size, scale_layout, fp8_dtype)[:2]


__all__ = ["PDL_MAX_ELEMENTS", "PER_TOKEN", "PER_TOKEN_GROUP", "DynConfig", "dyn_config", "kernel_args",
           "output_buffers", "outputs_like", "per_token_mode"]
