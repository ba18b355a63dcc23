"""Triton FP8 activation-quant kernels: static per-tensor, dynamic per-tensor and per-token (per token group:
:mod:`.group_quant_kernels`, installed beside these by :func:`impls`).

The three functions follow the contract of :func:`fp8_backends.quant.register_quant_impl` (and the
semantics of :mod:`fp8_backends.core.reference`); ``fmax`` is 448 for ``float8_e4m3fn``, 57344 for ``float8_e5m2``:

- :func:`quant_static` ``(x, scale, fp8_dtype) -> q``: ``q = clamp(x / scale, ±fmax) -> fp8``;
  ``scale`` is one fp32 value on ``x``'s device (``[]``, ``[1]`` or ``[1, 1]``), read on the device.
- :func:`quant_dynamic` ``(x, fp8_dtype) -> (q, scale)``: ``scale = max(amax(|x|) / fmax, 1e-12)`` as
  ``[1]`` fp32, then as above. A small ``x`` (``next_pow2(M) * next_pow2(K) <= 16384``: decode batches)
  is one program of one kernel. Larger ones take two kernels: an absmax kernel whose programs each write
  one partial maximum (no atomics, no zeroed buffer), then the quantization, whose programs reduce those
  partials to the scale on the device (its first program also writes ``scale``). No host-device
  synchronisation.
- :func:`quant_per_token` ``(x, fp8_dtype) -> (q, scale)``: ``scale[m] = max(amax(|x[m, :]|) / fmax,
  1e-12)`` as ``[M, 1]`` fp32 (contiguous), each row quantized with its own scale.

``x`` is ``[M, K]`` bf16/fp16/fp32 on a CUDA device (or the CPU under ``TRITON_INTERPRET=1``), with
any strides: the kernels address it through ``stride(0)`` / ``stride(1)`` (a row-major ``x`` gets the
contiguous, vectorised loads; a transposed view is read correctly, just not coalesced). ``q`` is a new
row-major ``[M, K]`` tensor; scales are new fp32 tensors. Row offsets are 64-bit.

Scales and quantization are computed in fp32 with IEEE-rounded divisions (``div_rn``), as the reference
does on the CPU: the codes and scales equal its results bit for bit. (Multiplying by a rounded reciprocal
instead flipped 0.15-0.8% of the codes on the H200 for bf16 inputs and round scales such as 0.03:
such quotients often land within an ulp of an fp8 tie. On CUDA torch's reference itself computes
``amax / fmax`` as a multiplication by ``1/fmax``, so its dynamic scales can differ from these by an ulp.)

A NaN propagates as in the reference (maxima and clamps from :mod:`.nan_math`): a NaN element gives a NaN code, and a
NaN scale (dynamic: the whole tensor; per token: its row) gives NaN codes wherever it divides.

Launch shapes (through :func:`.launcher.launch`; configs from small cached functions of ``K``; the numbers
were measured on the H200 with CUDA graphs, see ``ROW_WARPS_*``):

- static / dynamic quantization: 2-D tiles of ``ROWS x BLOCK_K`` (``BLOCK_K = min(next_pow2(K), 2048)``,
  ``ROWS * BLOCK_K = 4096``, 8 warps), grid ``(cdiv(M, ROWS), cdiv(K, BLOCK_K))``.
- dynamic absmax: the same tiles, each program looping over ``K`` and over enough row tiles to keep the
  grid at most ~1024 programs (so at most that many partial maxima for every quantization program to reduce).

Launches go through :mod:`.launcher`; a call whose sizes, strides, dtypes and flags were launched before (every
data pointer 16-byte aligned, on the current device) replays that launch with its own pointers
(:class:`.launcher.ReplayCache`).
- per-token, and the norm kernels: :func:`row_config`: several rows per program as a 2-D block for
  ``next_pow2(K) <= 1024`` (4096 elements, 4 warps), one whole row per program (``BLOCK = next_pow2(K)``)
  up to ``SINGLE_PASS_MAX = 32768``, two passes over the row in 16384-element chunks (16 warps) above
  that. One-row programs take 4 warps up to 16384 elements in large launches (``T * K >= 2^25``
  elements: many waves, more rows in flight pay) and 16 in smaller ones (latency: more threads per row
  pay); 32768-element rows take 16 either way.

Every kernel takes ``USE_PDL: tl.constexpr``: when :func:`._support.pdl_enabled` says so (SM >= 9.0, not
the interpreter, ``FP8_BACKENDS_PDL`` not ``0``) it calls ``gdc_wait()`` before its first global load and
``gdc_launch_dependents()`` once its inputs are read, and is launched with ``launch_pdl=True``.

:func:`register` installs the three functions as the quant ops' implementation for a device type;
:func:`impls` returns them without registering (what ``fp8_backends.quant`` uses as its CUDA default).
This module imports torch and triton: import it lazily.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from . import _support
from .launcher import ReplayCache, launcher_for, raw_stream
from .nan_math import nan_clamp, nan_max_reduce, nan_maximum

MIN_SCALE = 1e-12  # fp8_backends.core.reference.MIN_DYNAMIC_SCALE
FMAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

#: row-wise kernels: several rows per program (a 2-D block) while next_pow2(K) <= this
MULTI_ROW_MAX = 1024
#: row-wise kernels: elements per program in the multi-row path (ROWS * BLOCK) and its warps
ROW_TILE = 4096
ROW_TILE_WARPS = 4
#: row-wise kernels: whole row in registers, one pass, while next_pow2(K) <= this; chunked two-pass above
SINGLE_PASS_MAX = 32768
#: row-wise kernels: chunk size and warps of the two-pass path
LOOP_BLOCK = 16384
LOOP_WARPS = 16
#: row-wise kernels: a launch over at least this many elements (rows x row length) runs many waves of
#: programs, where fewer warps per row (more rows in flight) pay; below it more warps per row (latency) pay
LARGE_LAUNCH = 1 << 25
#: the same threshold for the plain fused RMSNorm + quant (one read, one fp8 write per row): there 4 warps per row
#: are fastest from T x H = 2^22 on (H = 4096 and 8192, T = 1024-16384: 5-20% faster than 16 warps at T = 1024-4096;
#: bench/norm_configs.py, H200, 2026-11-29). With the residual add the warps mattered less (within 10%) and 16 stayed
#: ahead below 2^25 at T = 1024, so the add variant keeps LARGE_LAUNCH.
LARGE_LAUNCH_NORM = 1 << 22
#: num_warps of a one-row program by block size, for small / large launches. Measured on the H200 (bf16,
#: CUDA graphs): large: 4096 x 16384 and 16384 x 4096 rows ran fastest with 4 warps (16 warps: 20-50%
#: slower without the residual), 32768-element rows with 16; small: T <= 512 rows of 4096 or 8192 with 16
#: (up to 1.4x faster than 4 with the residual), 4096 x 4096 with 8 or 16. 2048 (small) is not measured.
ROW_WARPS_SMALL = {2048: 8, 4096: 16, 8192: 16, 16384: 16, 32768: 16}
ROW_WARPS_LARGE = {2048: 4, 4096: 4, 8192: 4, 16384: 4, 32768: 16}
#: tile kernels (static / dynamic): elements per program, widest column block, warps per program
TILE = 4096
TILE_MAX_BLOCK_K = 2048
TILE_WARPS = 8
#: dynamic absmax: keep the grid at about this many programs (one partial maximum each)
AMAX_MAX_PROGRAMS = 1024
#: dynamic quant of at most this many (padded) elements: one program, one kernel, no atomics
SMALL_DYNAMIC_MAX = 16384


class RowConfig(NamedTuple):
    """How a row-wise kernel covers rows of ``n`` elements: ``path`` is ``"rows"`` (``rows`` rows per
    program, a ``[rows, block]`` block), ``"row"`` (one row per program, ``block >= n``) or ``"loop"``
    (one row per program, two passes in ``block``-element chunks)."""

    path: str
    rows: int
    block: int
    num_warps: int


def warps_for(block: int, large: bool = False) -> int:
    """num_warps of a one-row program holding ``block`` elements (4 below the tables, 16 above)."""
    table = ROW_WARPS_LARGE if large else ROW_WARPS_SMALL
    if block in table:
        return table[block]
    return 4 if block < min(table) else 16


@functools.lru_cache(maxsize=512)
def row_config(
    n: int, large: bool = False, single_pass_max: int = SINGLE_PASS_MAX, loop_block: int = LOOP_BLOCK
) -> RowConfig:
    """The launch shape for rows of ``n`` elements (cached); ``large``: the launch covers at least
    :data:`LARGE_LAUNCH` elements (:func:`is_large`). ``single_pass_max`` / ``loop_block`` let tests reach
    the two-pass path at small sizes."""
    block = triton.next_power_of_2(max(int(n), 1))
    if block <= MULTI_ROW_MAX and block <= single_pass_max:
        rows = max(1, ROW_TILE // block)
        return RowConfig("rows" if rows > 1 else "row", rows, block, ROW_TILE_WARPS)
    if block <= single_pass_max:
        return RowConfig("row", 1, block, warps_for(block, large))
    chunk = min(triton.next_power_of_2(loop_block), block)
    return RowConfig("loop", 1, chunk, LOOP_WARPS if chunk >= LOOP_BLOCK else warps_for(chunk, large))


def is_large(rows: int, n: int, threshold: int = LARGE_LAUNCH) -> bool:
    """Whether a row-wise launch over ``rows`` rows of ``n`` elements counts as large (see ROW_WARPS_*)."""
    return rows * n >= threshold


class TileConfig(NamedTuple):
    rows: int
    block_k: int
    num_warps: int


@functools.lru_cache(maxsize=512)
def tile_config(k: int) -> TileConfig:
    """``ROWS x BLOCK_K`` tiles for the static / dynamic kernels (cached per ``K``)."""
    block_k = min(triton.next_power_of_2(max(int(k), 1)), TILE_MAX_BLOCK_K)
    rows = max(1, TILE // block_k)
    return TileConfig(rows, block_k, TILE_WARPS)


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _x_rows(stride_xm, K, X_ALIGN: tl.constexpr):
    """``(stride_xm, K)`` rewritten as ``(v // X_ALIGN) * X_ALIGN`` when ``X_ALIGN > 1``: the launch guarantees both are
    multiples of it (:func:`x_align`), so these are identities that tell the compiler the rows start 16-byte aligned
    and the K mask is constant over a vector: ``x`` loads vectorize at a K such as 6840 that Triton's own
    specialization (multiples of 16) does not see (``tl.multiple_of`` ignores scalars)."""
    if X_ALIGN > 1:
        stride_xm = (stride_xm // X_ALIGN) * X_ALIGN
        K = (K // X_ALIGN) * X_ALIGN
    return stride_xm, K


@triton.jit
def _quant_tile_kernel(
    x_ptr, q_ptr, s_ptr, part_ptr, n_part, M, K, KQ, stride_xm, stride_xk, stride_qm,
    FMAX: tl.constexpr, FROM_AMAX: tl.constexpr, NPART: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr, X_ALIGN: tl.constexpr,
):
    """One ``ROWS x BLOCK_K`` tile: ``q = clamp(x / scale, ±FMAX)``. ``FROM_AMAX``: the scale is
    ``max(amax / FMAX, 1e-12)`` where ``amax`` is the largest of the ``n_part`` (<= ``NPART``) partial maxima at
    ``part_ptr`` (program (0, 0) stores the scale to ``s_ptr``); else it is read from ``s_ptr``. ``q`` rows hold
    ``KQ >= K`` codes: zeros beyond ``K`` (a padded row)."""
    stride_xm, K = _x_rows(stride_xm, K, X_ALIGN)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    out_mask = (rows < M)[:, None] & (cols < KQ)[None, :]
    if FROM_AMAX:
        parts = tl.arange(0, NPART)
        amax = nan_max_reduce(tl.load(part_ptr + parts, mask=parts < n_part, other=0.0), 0)
        scale = nan_maximum(tl.math.div_rn(amax, FMAX), 1e-12)
    else:
        scale = tl.load(s_ptr)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if FROM_AMAX:
        tl.store(s_ptr, scale, mask=(pid_m == 0) & (pid_k == 0))
    y = nan_clamp(tl.math.div_rn(x.to(tl.float32), scale), -FMAX, FMAX)
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _absmax_kernel(
    x_ptr, part_ptr, M, K, stride_xm, stride_xk, row_steps,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr, X_ALIGN: tl.constexpr,
):
    """``part[pid] = max |x|`` over ``row_steps`` row tiles of ``ROWS`` rows and all of ``K`` (one partial maximum
    per program: no atomics and no zeroed buffer; the quantization kernel reduces the partials)."""
    stride_xm, K = _x_rows(stride_xm, K, X_ALIGN)
    pid = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    for step in range(0, row_steps):
        rows = (pid * row_steps + step) * ROWS + tl.arange(0, ROWS)
        row_mask = (rows < M)[:, None]
        row_off = rows.to(tl.int64)[:, None] * stride_xm
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row_off + cols[None, :] * stride_xk, mask=row_mask & (cols < K)[None, :], other=0.0)
            acc = nan_maximum(acc, tl.abs(x.to(tl.float32)))
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(part_ptr + pid, nan_max_reduce(nan_max_reduce(acc, 1), 0))


@triton.jit
def _quant_dynamic_one_program_kernel(
    x_ptr, q_ptr, s_ptr, M, K, KQ, stride_xm, stride_xk, stride_qm,
    FMAX: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The whole (small) ``x`` as one ``ROWS x BLOCK_K`` block: absmax, scale, quantize, in one program (``q`` rows:
    ``KQ >= K`` codes, zeros beyond ``K``)."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    scale = nan_maximum(tl.math.div_rn(nan_max_reduce(nan_max_reduce(tl.abs(x), 1), 0), FMAX), 1e-12)
    tl.store(s_ptr, scale)
    y = nan_clamp(tl.math.div_rn(x, scale), -FMAX, FMAX)
    out_mask = (rows < M)[:, None] & (cols < KQ)[None, :]
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _per_token_kernel(
    x_ptr, q_ptr, s_ptr, M, K, KQ, stride_xm, stride_xk, stride_qm,
    FMAX: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOOP: tl.constexpr, USE_PDL: tl.constexpr,
    X_ALIGN: tl.constexpr,
):
    """``ROWS`` rows per program: ``scale = max(rowamax / FMAX, 1e-12)``, ``q = clamp(x / scale, ±FMAX)``; ``q``
    rows hold ``KQ >= K`` codes, zeros beyond ``K``. Without ``LOOP`` the whole row is one block (``BLOCK >= KQ``);
    with it, two passes in chunks."""
    stride_xm, K = _x_rows(stride_xm, K, X_ALIGN)
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * stride_xm
    q_rows = q_ptr + rows64[:, None] * stride_qm
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if LOOP:
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < K)[None, :]
            x = tl.load(x_rows + cols[None, :] * stride_xk, mask=mask, other=0.0, eviction_policy="evict_last")
            acc = nan_maximum(acc, tl.abs(x.to(tl.float32)))
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        scale = nan_maximum(tl.math.div_rn(nan_max_reduce(acc, 1), FMAX), 1e-12)
        tl.store(s_ptr + rows64, scale, mask=row_mask)
        for k0 in range(0, KQ, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & (cols < K)[None, :]
            x = tl.load(x_rows + cols[None, :] * stride_xk, mask=mask, other=0.0, eviction_policy="evict_first")
            y = nan_clamp(tl.math.div_rn(x.to(tl.float32), scale[:, None]), -FMAX, FMAX)
            out_mask = row_mask[:, None] & (cols < KQ)[None, :]
            tl.store(q_rows + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=out_mask)
    else:
        cols = tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = tl.load(x_rows + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        scale = nan_maximum(tl.math.div_rn(nan_max_reduce(tl.abs(x), 1), FMAX), 1e-12)
        tl.store(s_ptr + rows64, scale, mask=row_mask)
        y = nan_clamp(tl.math.div_rn(x, scale[:, None]), -FMAX, FMAX)
        tl.store(q_rows + cols[None, :], y.to(q_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols < KQ)[None, :])


# ------------------------------------------------------------------------------------------ launchers
def _fmax(fp8_dtype: torch.dtype) -> float:
    try:
        return FMAX[fp8_dtype]
    except KeyError:
        raise ValueError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}") from None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a JIT function: calling it from Python costs a few µs


#: replays of the four launches (see :class:`.launcher.ReplayCache`); a call passes the pointers and sizes of its
#: head itself: x, q, scale, partials, n_part, M, K, KQ and the three strides (tiles); x, partials, M, K, the two
#: strides, row_steps (absmax); x, q, scale, M, K, KQ and the three strides (one-program dynamic, per-token)
_tile_replays = ReplayCache(head=11)
_absmax_replays = ReplayCache(head=7)
_one_replays = ReplayCache(head=9)
_token_replays = ReplayCache(head=9)


def _run(cache: ReplayCache, key: tuple | None, head: tuple, fn: Any, grid: tuple[int, ...], args: tuple, *,
         num_warps: int, pdl: bool, index: int) -> None:
    """Launch ``fn``: a replay of an earlier launch with ``key`` (``head``: this call's pointers and scalars, in
    the kernel's order) when there is one, on the current device; else the general path, which records it.
    ``key`` is ``None`` when a pointer is not 16-byte aligned or the tensors are not on a GPU."""
    if key is not None:
        hit = cache.lookup(key)
        if hit is not None and index == _support.current_device():
            r = hit[0]
            r.run(r.g0, r.g1, r.g2, raw_stream(index), r.function, r.packed, None, None, None, *head, *hit[1])
            return
    device_index = max(index, 0)
    kernel_launcher = launcher_for(fn)
    kernel_launcher(grid, args, num_warps=num_warps, pdl=pdl, device_index=device_index)
    if key is not None:
        cache.record(key, kernel_launcher, grid, args, num_warps=num_warps, pdl=pdl, device_index=device_index)


def x_align(x: torch.Tensor) -> int:
    """The ``X_ALIGN`` hint of a launch on ``x [M, K]``: the elements in 16 bytes when x's rows start 16-byte aligned
    with unit column stride but K or the row stride is not a multiple of 16 (which Triton specializes on by itself),
    the largest power of two dividing both (at most 16 bytes' worth); 1 otherwise (no hint: the kernels compiled for
    aligned shapes stay as they are)."""
    k, sxm = x.shape[1], x.stride(0)
    if x.stride(1) != 1 or (k % 16 == 0 and sxm % 16 == 0) or x.data_ptr() % 16:
        return 1
    align = 16 // x.element_size()
    while align > 1 and (k % align or sxm % align):
        align //= 2
    return align


def _aligned(*pointers: int) -> bool:
    acc = 0
    for p in pointers:
        acc |= p
    return not acc & 15


def _launch_tiles(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmax: float, dynamic: bool) -> None:
    """Static (``dynamic=False``: ``scale`` given) or dynamic per-tensor quantization of ``x`` by tiles; the
    dynamic one first launches the absmax kernel, whose partial maxima the tile kernel reduces. ``q`` may be wider
    than ``x`` (``[M, KQ]``: zeros written beyond K)."""
    m, k = x.shape
    kq = q.shape[1]
    cfg = tile_config(kq)
    index = x.get_device()
    pdl = _support.pdl_on(index)
    grid = (_cdiv(m, cfg.rows), _cdiv(kq, cfg.block_k))
    sxm, sxk, sqm = x.stride(0), x.stride(1), q.stride(0)
    px, pq, ps = x.data_ptr(), q.data_ptr(), scale.data_ptr()
    gpu = index >= 0
    xa = x_align(x)
    if dynamic:
        steps = _cdiv(grid[0], AMAX_MAX_PROGRAMS)
        n_part = _cdiv(grid[0], steps)
        part = x.new_empty((n_part,), dtype=torch.float32)
        pp = part.data_ptr()
        key = (m, k, sxm, sxk, x.dtype, pdl, index, xa) if gpu and _aligned(px, pp) else None
        _run(_absmax_replays, key, (px, pp, m, k, sxm, sxk, steps), _absmax_kernel, (n_part,),
             (x, part, m, k, sxm, sxk, steps, cfg.rows, cfg.block_k, pdl, xa), num_warps=cfg.num_warps, pdl=pdl,
             index=index)
    else:
        part, pp, n_part = scale, ps, 1
    key = (m, k, kq, sxm, sxk, sqm, x.dtype, q.dtype, n_part, dynamic, pdl, index, xa) if gpu and _aligned(
        px, pq, ps, pp) else None
    _run(_tile_replays, key, (px, pq, ps, pp, n_part, m, k, kq, sxm, sxk, sqm), _quant_tile_kernel, grid,
         (x, q, scale, part, n_part, m, k, kq, sxm, sxk, sqm, fmax, dynamic, triton.next_power_of_2(n_part), cfg.rows,
          cfg.block_k, pdl, xa), num_warps=cfg.num_warps, pdl=pdl, index=index)


def _fp8_like(x: torch.Tensor, fp8_dtype: torch.dtype, k_out: int | None = None) -> torch.Tensor:
    """A new row-major ``[M, K]`` fp8 tensor on x's device, strides ``(K, 1)`` whatever x's (``empty_like`` parses
    fewer arguments than ``torch.empty(shape, device=...)``: about 2 µs less per call on the H200 host). Not
    ``empty_like``'s default, which copies the strides of a dense ``x``: an ``x`` that ``is_contiguous()`` may still
    have odd strides on a dimension of size 1 (``a.t()`` of a ``[K, 1]`` tensor: ``[1, K]`` with strides
    ``(1, 1)``), which ``torch._scaled_mm`` refuses as not row-major. ``k_out`` wider than K: ``[M, k_out]``."""
    if k_out is not None and k_out != x.shape[1]:
        if x.dim() != 2 or k_out < x.shape[1]:
            raise ValueError(f"k_out={k_out} must be at least K={x.shape[-1]} of a 2-D x")
        return torch.empty((x.shape[0], k_out), dtype=fp8_dtype, device=x.device)
    return torch.empty_like(x, dtype=fp8_dtype, memory_format=torch.contiguous_format)


def quant_static(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, *,
                 k_out: int | None = None) -> torch.Tensor:
    """``clamp(x / scale, ±fmax) -> fp8_dtype`` for ``x: [M, K]``; ``scale``: one fp32 value on x's device.
    ``k_out`` (>= K): the codes as ``[M, k_out]``, zeros beyond K (a padded row, in the same launch)."""
    fmax = _fmax(fp8_dtype)
    q = _fp8_like(x, fp8_dtype, k_out)
    if q.numel() == 0:
        return q
    _support.on_device(x.get_device(), _launch_tiles, x, q, scale, fmax, False)
    return q


def _one_program_block(m: int, k: int) -> tuple[int, int] | None:
    """``(ROWS, BLOCK_K)`` when the dynamic quantization of ``[m, k]`` fits one program, else None."""
    rows, block_k = triton.next_power_of_2(m), triton.next_power_of_2(k)
    return (rows, block_k) if rows * block_k <= SMALL_DYNAMIC_MAX else None


def _launch_dynamic(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmax: float) -> None:
    m, k = x.shape
    kq = q.shape[1]
    one = _one_program_block(m, kq)
    if one is None:
        _launch_tiles(x, q, scale, fmax, True)
        return
    index = x.get_device()
    pdl = _support.pdl_on(index)
    sxm, sxk, sqm = x.stride(0), x.stride(1), q.stride(0)
    px, pq, ps = x.data_ptr(), q.data_ptr(), scale.data_ptr()
    key = (m, k, kq, sxm, sxk, sqm, x.dtype, q.dtype, pdl, index) if index >= 0 and _aligned(px, pq, ps) else None
    _run(_one_replays, key, (px, pq, ps, m, k, kq, sxm, sxk, sqm), _quant_dynamic_one_program_kernel, (1,),
         (x, q, scale, m, k, kq, sxm, sxk, sqm, fmax, one[0], one[1], pdl), num_warps=warps_for(one[0] * one[1]),
         pdl=pdl, index=index)


def quant_dynamic(x: torch.Tensor, fp8_dtype: torch.dtype, *,
                  k_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic quantization of ``x: [M, K]``: ``(q [M, K], scale [1] fp32)``, the scale computed
    on the device (an all-zero or empty ``x`` gets ``1e-12``). ``k_out``: as :func:`quant_static`."""
    fmax = _fmax(fp8_dtype)
    q = _fp8_like(x, fp8_dtype, k_out)
    if q.numel() == 0:
        return q, torch.full((1,), MIN_SCALE, dtype=torch.float32, device=x.device)
    scale = x.new_empty((1,), dtype=torch.float32)
    _support.on_device(x.get_device(), _launch_dynamic, x, q, scale, fmax)
    return q, scale


def _launch_per_token(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, fmax: float, cfg: RowConfig) -> None:
    m, k = x.shape
    kq = q.shape[1]
    index = x.get_device()
    pdl = _support.pdl_on(index)
    sxm, sxk, sqm = x.stride(0), x.stride(1), q.stride(0)
    px, pq, ps = x.data_ptr(), q.data_ptr(), scale.data_ptr()
    xa = x_align(x)
    key = (cfg, m, k, kq, sxm, sxk, sqm, x.dtype, q.dtype, pdl, index, xa) if index >= 0 and _aligned(
        px, pq, ps) else None
    _run(_token_replays, key, (px, pq, ps, m, k, kq, sxm, sxk, sqm), _per_token_kernel, (_cdiv(m, cfg.rows),),
         (x, q, scale, m, k, kq, sxm, sxk, sqm, fmax, cfg.rows, cfg.block, cfg.path == "loop", pdl, xa),
         num_warps=cfg.num_warps, pdl=pdl, index=index)


def quant_per_token(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, config: RowConfig | None = None, k_out: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic quantization of ``x: [M, K]``: ``(q [M, K], scale [M, 1] fp32)``. ``config``
    overrides :func:`row_config` (tests); ``k_out``: as :func:`quant_static`."""
    fmax = _fmax(fp8_dtype)
    m, k = x.shape
    q = _fp8_like(x, fp8_dtype, k_out)
    if m == 0 or k == 0:
        if q.numel():
            q.zero_()
        return q, torch.full((m, 1), MIN_SCALE, dtype=torch.float32, device=x.device)
    kq = q.shape[1]
    scale = x.new_empty((m, 1), dtype=torch.float32)
    cfg = config if config is not None else row_config(kq, m * kq >= LARGE_LAUNCH)
    _support.on_device(x.get_device(), _launch_per_token, x, q, scale, fmax, cfg)
    return q, scale


# the three write padded codes (k_out=...) themselves: fp8_backends.quant.padded_quantizer
quant_static.pads_output = quant_dynamic.pads_output = quant_per_token.pads_output = True  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------------------ registration
def impls() -> dict[Any, Callable[..., Any]]:
    """``{ActScale: fn}`` for the four modes (what :func:`register` installs): the three of this module and the
    per-token-group quantization of :mod:`.group_quant_ops`."""
    from fp8_backends.core.types import ActScale

    from .group_quant_ops import quant_impl

    return {
        ActScale.PER_TENSOR_STATIC: quant_static,
        ActScale.PER_TENSOR_DYNAMIC: quant_dynamic,
        ActScale.PER_TOKEN: quant_per_token,
        ActScale.PER_TOKEN_GROUP: quant_impl,
    }


def register(device_type: str = "cuda") -> dict[Any, Callable[..., Any] | None]:
    """Make these kernels the implementation of the quant ops for ``device_type`` (``"cuda"``; ``"cpu"``
    only makes sense under ``TRITON_INTERPRET=1``). Returns the entries replaced, per mode, so a caller
    can restore them with :func:`fp8_backends.quant.register_quant_impl`."""
    from fp8_backends.quant import register_quant_impl

    return {mode: register_quant_impl(mode, device_type, fn) for mode, fn in impls().items()}


__all__ = [
    "FMAX",
    "RowConfig",
    "TileConfig",
    "impls",
    "quant_dynamic",
    "quant_per_token",
    "quant_static",
    "register",
    "row_config",
    "tile_config",
]
