"""Triton kernels of the block-scaled FP8 GEMM (DeepSeek-V3 style scaling).

``out[M, N] = sum_g (x_q[:, g] @ w_q[:, g]ᵀ) · x_scale[:, g] · w_scale[n // WBN, (g·G) // WBK] (+ bias)``
where ``g`` runs over the activation groups of ``G`` columns of K.

Shared contract of the kernels (validated by the caller, :mod:`.block_gemm_ops`, not here):

- ``x``: ``[M, K]`` float8 (e4m3fn or e5m2); ``w``: ``[N, K]`` float8 of the same type. Both addressed through
  explicit strides (``stride_xm, stride_xk`` / ``stride_wn, stride_wk``); unit K strides give vector loads (Triton
  specializes a stride equal to 1).
- ``x_scale``: fp32 ``[M, ceil(K / G)]`` in any layout (``stride_xsm, stride_xsk``): row-major ``(Kg, 1)``, M-major
  ``(1, M)`` or M-major with M padded ``(1, round_up(M, 4))`` all read correctly. ``G`` is the activation group size
  (the kernels' ``GROUP_K``: 128, or 64).
- ``w_scale``: fp32 ``[ceil(N / WBN), ceil(K / WBK)]`` (``stride_wsn, stride_wsk``); ``(WBN, WBK)`` the weight block
  (``(128, 128)``), with ``WBK`` a multiple of ``G``. Read once per program and K step (a scalar where the program's
  output columns lie in one weight block); any layout computes right, row-major is what :mod:`.block_gemm_ops`
  prepares.
- ``out``: ``[M, N]`` bf16/fp16/fp32 (``stride_om, stride_on``); ``bias``: ``[N]`` (``stride_b``) when ``HAS_BIAS``.
- fp32 accumulation: every K step of ``G`` columns is one MMA (or CUDA-core dot) whose fp32 result is multiplied by
  ``x_scale[m, g] · w_scale[nb, g·G // WBK]`` and added to the fp32 accumulator (the promotion of DeepGEMM and
  vLLM's Triton kernel); the bias is added in fp32 and the sum cast once. Triton's software pipeline covers the
  operand tiles, not the scale loads. The swap-AB and tiled kernels load each step's scales one step ahead, after
  the step before has multiplied by its own (the register is then free: no copy at the end of the step waits for
  the load), so their latency overlaps a whole step; in the step they cost one global-load latency each
  (bench/results/block_gemm/2026-12-04-h200-scales-ahead/: 0.68-0.95x the time ahead, geomean per config). The TMA
  kernel loads them first in the step, which was faster there (ahead, Triton carried them through its persistent
  loop's pipeline in registers and the kernel ran up to 18% slower).
- Ragged edges: rows of ``x``/``w`` past ``M``/``N`` are read through a modulo (always in bounds, discarded at the
  store); columns past ``K`` are masked to zero unless ``EVEN_K`` (``K`` a multiple of the K step): the last group
  may be short. ``N``, ``K`` need no alignment (``ROW_ALIGN`` tells the compiler the largest power of two, at most
  16, dividing the row strides, so ragged K still gets 8- or 4-byte loads).
- ``SPLIT_K`` (``swap`` and ``mm``): program ``s`` of a tile covers groups ``[s·kb_per_split, (s+1)·kb_per_split)``.
  With ``SPLIT_K > 1`` each program writes its fp32 partial tile to ``part [SPLIT_K, M, N]`` and increments the
  tile's counter in ``counters`` (int32, zero at launch; acq_rel, GPU scope). The program that arrives last sums the
  ``SPLIT_K`` partials in split order (deterministic), runs the epilogue and resets the counter to zero, so the
  next launch (or CUDA-graph replay) needs no memset. The counters are a per-stream buffer of the caller's.
- ``USE_PDL``: programmatic dependent launch: each program waits for the grid it depends on (``gdc_wait``) before
  its first global read and then lets its dependents launch (``gdc_launch_dependents``).
- ``PREFETCH`` (``gemv``/``swap``/``mm``; ``0``: off): before that wait, each program asks L2 for its whole share
  of the weight (its rows over its K range, ``PREFETCH`` bulk prefetches a row, :func:`_prefetch_rows`): the weight
  is no output of the launch before, so it streams while that launch still runs, and the K loop's loads find it in
  L2. Only with PDL (SM >= 9.0, where the instruction exists) and a unit K stride (rows contiguous). A prefetch
  moves no value into a register or L1: the loads after the wait read what L2 holds then, and L2 takes every store,
  so a weight the launch before wrote (a state dict copied in) is still read right.
- NaN: a NaN code or a NaN scale makes the outputs it reaches NaN, as the fp32 reference does.

Kernels:

- :func:`block_gemv_kernel`: CUDA-core GEMV, one token per program column, ``BLOCK_N`` weight rows per program,
  ``BLOCK_K`` columns per step (a multiple of ``G``); the activation is dequantized per element
  (``x_q · x_scale · w_scale``) and multiplied into fp32 partial sums. Grid ``(cdiv(N, BLOCK_N), M)``. With
  ``X_QUANT`` it reads the *unquantized* activation (bf16/fp16/fp32) and quantizes each group itself, as the
  per-token-group quantization does (``scale = max(amax / FMAX, 1e-12)``, ``q = fp8(clamp(x / scale, ±FMAX))``,
  IEEE-rounded divisions: the same codes and scales, so the same output as quantize-then-GEMV bit for bit): one
  launch per linear instead of two or three. Every program quantizes the whole row it reads (``K`` divisions per
  ``BLOCK_N · K`` weight bytes), so the fused configs take more weight rows per program than the plain GEMV's.
- :func:`block_gemm_swap_kernel`: swap-AB tensor-core GEMM for small M, ``accᵀ[BLOCK_N, BLOCK_M] = w · xᵀ`` (the
  weight rows on the MMA's 64-row side). Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K)``.
- :func:`block_gemm_mm_kernel`: tiled GEMM with grouped tile order. Grid ``(tiles, SPLIT_K)``.
- :func:`block_gemm_tma_kernel`: the tiled GEMM with operand tiles through host-built TMA descriptors, persistent
  when ``num_progs`` is below the tile count. Grid ``(num_progs,)``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .nan_math import dynamic_scale, nan_max_reduce, scaled_cast


@triton.jit
def _row_aligned(stride_xm, stride_wn, K, ROW_ALIGN: tl.constexpr):
    """``(stride_xm, stride_wn, K)``, each rewritten as ``(v // ROW_ALIGN) * ROW_ALIGN`` when ``ROW_ALIGN > 1``: the
    launch guarantees they are multiples of it, so these are identities that tell the compiler the alignment
    (``tl.multiple_of`` ignores scalars)."""
    if ROW_ALIGN > 1:
        stride_xm = (stride_xm // ROW_ALIGN) * ROW_ALIGN
        stride_wn = (stride_wn // ROW_ALIGN) * ROW_ALIGN
        K = (K // ROW_ALIGN) * ROW_ALIGN
    return stride_xm, stride_wn, K


@triton.jit
def _split_groups(split, kb_per_split, K, GROUP_K: tl.constexpr):
    """K split ``split``'s activation groups: ``(kb_first, kb_last, k_first)``, groups ``kb_first`` to
    ``kb_last - 1`` (``kb_per_split`` of them, fewer in the last split), starting at column ``k_first``."""
    kb_first = split * kb_per_split
    kb_last = tl.minimum(kb_first + kb_per_split, tl.cdiv(K, GROUP_K))
    k_first = kb_first * GROUP_K
    return kb_first, kb_last, k_first


#: one L2 bulk prefetch (SM >= 9.0) of ``$2`` bytes from ``$1``, widened to 16-byte bounds (what the instruction
#: takes; an allocation's 16-byte granules lie wholly inside it), none where ``$2 <= 0``; ``$0`` is a dummy result
_L2_PREFETCH_ASM = tl.constexpr("""{
.reg .b64 lo, hi;
.reg .b32 sz;
.reg .pred on;
setp.gt.s32 on, $2, 0;
and.b64 lo, $1, 0xFFFFFFFFFFFFFFF0;
cvt.s64.s32 hi, $2;
add.s64 hi, hi, $1;
add.s64 hi, hi, 15;
and.b64 hi, hi, 0xFFFFFFFFFFFFFFF0;
sub.s64 hi, hi, lo;
cvt.u32.u64 sz, hi;
@on cp.async.bulk.prefetch.L2.global [lo], sz;
mov.u32 $0, 0;
}""")


@triton.jit
def _prefetch_rows(row_ptrs, nbytes, CHUNKS: tl.constexpr):
    """Ask L2 for ``nbytes`` contiguous bytes from each of ``row_ptrs [R]`` (a program's weight rows from its first
    K column, unit K stride), in ``CHUNKS`` bulk prefetches a row: ``R · CHUNKS`` of them, about one a thread. No
    registers stay held and nothing waits for the data; the K loop's loads then find it in L2 (or in flight)."""
    chunk = tl.cdiv(nbytes, CHUNKS)
    offs = tl.arange(0, CHUNKS) * chunk
    sizes = tl.minimum(tl.maximum(nbytes - offs, 0), chunk)
    tl.inline_asm_elementwise(_L2_PREFETCH_ASM, "=r,l,r", [row_ptrs[:, None] + offs[None, :], sizes[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _bias_store(acc, offs_m, offs_n, M, N, out_ptr, stride_om, stride_on, bias_ptr, stride_b, HAS_BIAS: tl.constexpr):
    """Add the bias (fp32) and store ``acc`` (``offs_m``/``offs_n`` broadcast against its shape)."""
    in_n = offs_n < N
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n * stride_b, mask=in_n, other=0.0).to(tl.float32)
    ptrs = out_ptr + offs_m.to(tl.int64) * stride_om + offs_n * stride_on
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M) & in_n)


@triton.jit
def _finish(acc, offs_m, offs_n, M, N, tile, split, out_ptr, stride_om, stride_on, bias_ptr, stride_b, part_ptr,
            cnt_ptr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """The epilogue of program ``split`` of output tile ``tile``: straight to ``out`` when ``SPLIT_K == 1``, else
    through the partials and the tile's arrival counter (module docstring)."""
    if SPLIT_K == 1:
        _bias_store(acc, offs_m, offs_n, M, N, out_ptr, stride_om, stride_on, bias_ptr, stride_b, HAS_BIAS)
    else:
        mask = (offs_m < M) & (offs_n < N)
        plane = tl.cast(M, tl.int64) * N  # M may arrive as a Python int (Triton specializes 1)
        offs = offs_m.to(tl.int64) * N + offs_n
        tl.store(part_ptr + split * plane + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the counter moves (release is cumulative)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT_K):  # not unrolled: one partial in registers at a time
                total += tl.load(part_ptr + s * plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
            _bias_store(total, offs_m, offs_n, M, N, out_ptr, stride_om, stride_on, bias_ptr, stride_b, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def gemv_tile(pid_n, N, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr):
    """A GEMV program's indices: its output columns ``offs_n [BLOCK_N]``, the weight rows it reads (``offs_n % N``,
    int64: always in bounds), the groups of a K step ``offs_g [GROUPS]`` and their columns ``[GROUPS, GROUP_K]``."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_w = (offs_n % N).to(tl.int64)
    offs_g = tl.arange(0, GROUPS)
    cols = offs_g[:, None] * GROUP_K + tl.arange(0, GROUP_K)[None, :]
    return offs_n, rows_w, offs_g, cols


@triton.jit
def _gemv_load(w_ptrs, x_ptrs, xs_ptrs, ws_row, k0, K, cols, offs_g, stride_wk, stride_xk, stride_xsk, stride_wsk,
               GROUPS: tl.constexpr, GROUP_K: tl.constexpr, WBK: tl.constexpr, EVEN_K: tl.constexpr,
               X_QUANT: tl.constexpr):
    """The GEMV's operands of the K step at column ``k0``: weight ``[BLOCK_N, GROUPS, GROUP_K]``, activation
    ``[GROUPS, GROUP_K]`` and their ``[GROUPS]`` scales (``X_QUANT``: no activation scales, the weight's in their
    place)."""
    ws_ptrs = ws_row + ((k0 + offs_g * GROUP_K) // WBK) * stride_wsk
    w_ptrs += k0 * stride_wk
    x_ptrs += k0 * stride_xk
    xs_ptrs += (k0 // GROUP_K) * stride_xsk
    if EVEN_K:
        wv = tl.load(w_ptrs)
        xv = tl.load(x_ptrs)
        ws = tl.load(ws_ptrs)
        xs = ws
        if not X_QUANT:
            xs = tl.load(xs_ptrs)
    else:
        k_left = K - k0
        in_k = cols < k_left
        in_g = offs_g * GROUP_K < k_left
        wv = tl.load(w_ptrs, mask=in_k[None, :, :], other=0.0)
        xv = tl.load(x_ptrs, mask=in_k, other=0.0)
        ws = tl.load(ws_ptrs, mask=in_g, other=0.0)
        xs = ws
        if not X_QUANT:
            xs = tl.load(xs_ptrs, mask=in_g, other=0.0)
    return wv, xv, xs, ws


@triton.jit
def _gemv_step(acc, wv, xv, xs, ws, X_QUANT: tl.constexpr, FMAX: tl.constexpr, CODE: tl.constexpr):
    """One K step of the GEMV: ``acc += w · (x · x_scale · w_scale)`` per element; ``X_QUANT``: ``xv`` is unquantized
    and its groups are quantized here to ``CODE`` first (masked columns load 0: they move no amax)."""
    if X_QUANT:
        xf = xv.to(tl.float32)
        xs = dynamic_scale(nan_max_reduce(tl.abs(xf), 1), FMAX)  # [GROUPS]
        xv = scaled_cast(xf, xs[:, None], FMAX, CODE)
    xd = xv.to(tl.float32) * (xs * ws)[:, None]  # the dequantized activation, both scales folded in
    return acc + wv.to(tl.float32) * xd[None, :, :]


@triton.jit
def block_gemv_kernel(
    x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, bias_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_b,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ROW_ALIGN: tl.constexpr, USE_PDL: tl.constexpr,
    X_QUANT: tl.constexpr, FMAX: tl.constexpr, PREFETCH: tl.constexpr = 0,
):
    """CUDA-core GEMV: ``BLOCK_N`` weight rows (within one weight block: ``WBN % BLOCK_N == 0``) against token
    ``program_id(1)``, ``GROUPS`` activation groups (``GROUPS · GROUP_K`` columns) per step, held as a
    ``[BLOCK_N, GROUPS, GROUP_K]`` block so each group's two scales are one load each. ``EVEN_K``: ``K`` is a
    multiple of ``GROUPS · GROUP_K``. ``X_QUANT``: ``x`` is unquantized and each group is quantized here to
    ``w``'s float8 type (largest value ``FMAX``); ``xs_ptr`` is then never read."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    stride_xm, stride_wn, K = _row_aligned(stride_xm, stride_wn, K, ROW_ALIGN)
    STEP: tl.constexpr = GROUPS * GROUP_K
    offs_n, rows_w, offs_g, cols = gemv_tile(pid_n, N, BLOCK_N, GROUPS, GROUP_K)
    w_ptrs = w_ptr + rows_w[:, None, None] * stride_wn + cols[None, :, :] * stride_wk
    x_ptrs = x_ptr + m.to(tl.int64) * stride_xm + cols * stride_xk
    xs_ptrs = xs_ptr + m.to(tl.int64) * stride_xsm + offs_g * stride_xsk
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // WBN) * stride_wsn
    if PREFETCH:
        _prefetch_rows(w_ptr + rows_w * stride_wn, K, PREFETCH)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, GROUPS, GROUP_K), dtype=tl.float32)
    code = w_ptr.dtype.element_ty
    for k0 in range(0, K, STEP):
        wv, xv, xs, ws = _gemv_load(w_ptrs, x_ptrs, xs_ptrs, ws_row, k0, K, cols, offs_g, stride_wk, stride_xk,
                                    stride_xsk, stride_wsk, GROUPS, GROUP_K, WBK, EVEN_K, X_QUANT)
        acc = _gemv_step(acc, wv, xv, xs, ws, X_QUANT, FMAX, code)
    total = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
    _bias_store(total, tl.full((1,), 0, tl.int32) + m, offs_n, M, N, out_ptr, stride_om, stride_on, bias_ptr,
                stride_b, HAS_BIAS)


@triton.jit
def _swap_scales(xs_row, ws_row, kb, stride_xsk, stride_wsk, GROUP_K: tl.constexpr, WBK: tl.constexpr):
    """The scales of K step ``kb`` for a swap-AB tile: ``[BLOCK_M]`` activation scales of its tokens (``xs_row``:
    their row pointers) and the one weight scale of its rows' block (``ws_row``: that block's row)."""
    xs = tl.load(xs_row + kb * stride_xsk)
    ws = tl.load(ws_row + ((kb * GROUP_K) // WBK) * stride_wsk)
    return xs, ws


@triton.jit
def block_gemm_swap_kernel(
    x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, bias_ptr, part_ptr, cnt_ptr,
    M, N, K, kb_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ROW_ALIGN: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = 0,
):
    """Swap-AB GEMM for small M: ``accᵀ[BLOCK_N, BLOCK_M] += (w_tile · x_tileᵀ) · x_scale · w_scale`` per group;
    ``BLOCK_N`` weight rows within one weight block (``WBN % BLOCK_N == 0``: the weight scale is one value per
    step). Grid ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K)``."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    stride_xm, stride_wn, K = _row_aligned(stride_xm, stride_wn, K, ROW_ALIGN)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, GROUP_K)
    rows_w = offs_n % N
    rows_x = offs_m % M
    kb_first, kb_last, k_first = _split_groups(split, kb_per_split, K, GROUP_K)
    w_ptrs = w_ptr + rows_w.to(tl.int64)[:, None] * stride_wn + (k_first + offs_k)[None, :] * stride_wk
    x_ptrs = x_ptr + rows_x.to(tl.int64)[None, :] * stride_xm + (k_first + offs_k)[:, None] * stride_xk
    xs_row = xs_ptr + rows_x * stride_xsm
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // WBN) * stride_wsn

    if PREFETCH:
        _prefetch_rows(w_ptr + rows_w.to(tl.int64) * stride_wn + k_first,
                       tl.minimum(kb_last * GROUP_K, K) - k_first, PREFETCH)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    xs, ws = _swap_scales(xs_row, ws_row, kb_first, stride_xsk, stride_wsk, GROUP_K, WBK)
    for kb in range(kb_first, kb_last):
        if EVEN_K:
            a = tl.load(w_ptrs)
            b = tl.load(x_ptrs)
        else:
            k_left = K - kb * GROUP_K
            a = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(x_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc += tl.dot(a, b) * (xs * ws)[None, :]
        w_ptrs += GROUP_K * stride_wk
        x_ptrs += GROUP_K * stride_xk
        # the next step's scales (the last step reloads its own), in flight until that step's promotion
        xs, ws = _swap_scales(xs_row, ws_row, tl.minimum(kb + 1, kb_last - 1), stride_xsk, stride_wsk, GROUP_K, WBK)
    _finish(acc, offs_m[None, :], offs_n[:, None], M, N, pid_m * tl.num_programs(0) + pid_n, split, out_ptr,
            stride_om, stride_on, bias_ptr, stride_b, part_ptr, cnt_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped tile order: ``GROUP_M`` row blocks walk the column blocks together (the weight tiles stay in L2)."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % group_rows
    pid_n = (tile % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _weight_scales(ws_ptr, pid_n, rows_w, kw, stride_wsn, stride_wsk, BLOCK_N: tl.constexpr, WBN: tl.constexpr):
    """The weight scales of K step ``kw`` (a weight-block column) for this tile's columns: one value when the tile
    lies in one weight block, else a ``[1, BLOCK_N]`` vector."""
    if BLOCK_N <= WBN:
        ws = tl.load(ws_ptr + ((pid_n * BLOCK_N) // WBN) * stride_wsn + kw * stride_wsk)
    else:
        ws = tl.load(ws_ptr + (rows_w // WBN) * stride_wsn + kw * stride_wsk)[None, :]
    return ws


@triton.jit
def _tile_scales(xs_row, ws_ptr, pid_n, rows_w, kb, stride_xsk, stride_wsn, stride_wsk, GROUP_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr):
    """The scales of K step ``kb`` (activation group ``kb``) for a ``[BLOCK_M, BLOCK_N]`` tile: ``[BLOCK_M]``
    activation scales of its rows (``xs_row``: their row pointers) and :func:`_weight_scales`."""
    xs = tl.load(xs_row + kb * stride_xsk)
    ws = _weight_scales(ws_ptr, pid_n, rows_w, (kb * GROUP_K) // WBK, stride_wsn, stride_wsk, BLOCK_N, WBN)
    return xs, ws


@triton.jit
def block_gemm_mm_kernel(
    x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, bias_ptr, part_ptr, cnt_ptr,
    M, N, K, kb_per_split,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    ROW_ALIGN: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = 0,
):
    """Tiled GEMM, one ``[BLOCK_M, BLOCK_N]`` tile per program (grouped order) and K split. ``BLOCK_N`` either
    divides ``WBN`` (one weight scale per step) or is a multiple of it (a vector). Grid ``(tiles, SPLIT_K)``."""
    tile = tl.program_id(0)
    split = tl.program_id(1)
    stride_xm, stride_wn, K = _row_aligned(stride_xm, stride_wn, K, ROW_ALIGN)
    pid_m, pid_n = _tile_coords(tile, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP_K)
    rows_x = offs_m % M
    rows_w = offs_n % N
    kb_first, kb_last, k_first = _split_groups(split, kb_per_split, K, GROUP_K)
    x_ptrs = x_ptr + rows_x.to(tl.int64)[:, None] * stride_xm + (k_first + offs_k)[None, :] * stride_xk
    w_ptrs = w_ptr + rows_w.to(tl.int64)[None, :] * stride_wn + (k_first + offs_k)[:, None] * stride_wk  # wᵀ view
    xs_row = xs_ptr + rows_x * stride_xsm

    if PREFETCH:
        _prefetch_rows(w_ptr + rows_w.to(tl.int64) * stride_wn + k_first,
                       tl.minimum(kb_last * GROUP_K, K) - k_first, PREFETCH)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xs, ws = _tile_scales(xs_row, ws_ptr, pid_n, rows_w, kb_first, stride_xsk, stride_wsn, stride_wsk, GROUP_K,
                          BLOCK_N, WBN, WBK)
    for kb in range(kb_first, kb_last):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - kb * GROUP_K
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc += tl.dot(a, b) * (xs[:, None] * ws)
        x_ptrs += GROUP_K * stride_xk
        w_ptrs += GROUP_K * stride_wk
        xs, ws = _tile_scales(xs_row, ws_ptr, pid_n, rows_w, tl.minimum(kb + 1, kb_last - 1), stride_xsk, stride_wsn,
                              stride_wsk, GROUP_K, BLOCK_N, WBN, WBK)
    _finish(acc, offs_m[:, None], offs_n[None, :], M, N, tile, split, out_ptr, stride_om, stride_on, bias_ptr,
            stride_b, part_ptr, cnt_ptr, HAS_BIAS, SPLIT_K)


@triton.jit
def block_gemm_tma_kernel(
    x_desc, w_desc, out_ptr, xs_ptr, ws_ptr, bias_ptr,
    M, N, K, num_progs,
    stride_om, stride_on, stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_b,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Tiled GEMM with operand tiles through TMA (host-built descriptors over ``x [M, K]`` and ``w [N, K]``, block
    shapes ``[BLOCK_M, GROUP_K]`` and ``[BLOCK_N, GROUP_K]``; TMA zero-fills past the edges, so the K loop has no
    masks). Persistent when ``num_progs`` is below the tile count: program ``p`` walks tiles ``p, p + num_progs,
    ...`` in grouped order. Grid ``(num_progs,)``."""
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, GROUP_K)
    num_tiles = num_m * num_n
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for tile in tl.range(start, num_tiles, num_progs, flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        rows_x = offs_m % M
        rows_w = offs_n % N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(k_steps):
            # in the step, first (loaded a step ahead, as in the pointer kernels, they made this kernel up to 18%
            # slower at M = 4096: bench/results/block_gemm/2026-12-04-h200-scales-ahead/)
            xs = tl.load(xs_ptr + rows_x * stride_xsm + kb * stride_xsk)
            ws = _weight_scales(ws_ptr, pid_n, rows_w, (kb * GROUP_K) // WBK, stride_wsn, stride_wsk, BLOCK_N, WBN)
            a = x_desc.load([off_m, kb * GROUP_K])
            b = w_desc.load([off_n, kb * GROUP_K])
            acc += tl.dot(a, b.T) * (xs[:, None] * ws)
        _bias_store(acc, offs_m[:, None], offs_n[None, :], M, N, out_ptr, stride_om, stride_on, bias_ptr, stride_b,
                    HAS_BIAS)


__all__ = ["block_gemm_mm_kernel", "block_gemm_swap_kernel", "block_gemm_tma_kernel", "block_gemv_kernel"]
