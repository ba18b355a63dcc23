"""Triton kernels of the block-scaled FP8 GEMMs over routed experts (a MoE layer): :func:`experts_gemv_kernel` for
few (token, slot) pairs (decode), :func:`experts_gemm_kernel` for many (prefill).

The GEMV:

``out[p, n] = sum_g (q(x[p // TOKEN_DIV])[g] · x_scale[g]) · (w[e_p, n, g] · w_scale[e_p, n // WBN, g·G // WBK])``
for every (token, slot) pair ``p`` with ``e_p = ids[p]``: each pair's row is multiplied by its own expert's weight,
in one launch for all pairs, so a decode step's MoE layer reads each routed expert's weight once per pair and needs
no host-side knowledge of which experts were hit (CUDA-graph capturable, no sync).

Shared contract (validated by the caller, :mod:`.experts_ops`):

- ``x``: ``[R, K]`` bf16/fp16/fp32, the *unquantized* rows; pair ``p`` reads row ``p // TOKEN_DIV`` (``TOKEN_DIV = k``
  for the gate/up projection, where the ``k`` slots of a token share its hidden state; 1 for the down projection).
  Each group of ``G`` columns is quantized here to ``w``'s float8 type as the per-token-group quantization does
  (``scale = max(amax / FMAX, 1e-12)``), the same codes as :mod:`.block_gemm_kernels`' fused GEMV.
- ``w``: ``[E, N, K]`` float8 (strides ``stride_we, stride_wn, stride_wk``); ``w_scale``: fp32 ``[E, ceil(N / WBN),
  ceil(K / WBK)]`` (any strides), or with ``W_ROWS`` one scale per output row, ``[E, N]`` (``stride_wse,
  stride_wsn``; per-channel checkpoints, and per-tensor ones with the value repeated), applied to the finished row.
- ``ids``: ``[P]`` integer expert ids; a pair whose id is outside ``[0, E)`` (an expert-parallel sentinel) gets a
  zero row and reads no weight of its own (expert 0's, discarded).
- ``out``: ``[P, N]`` (``stride_om, stride_on``), bf16/fp16/fp32; ``HAS_RW``: row ``p`` is multiplied by the fp32
  routing weight ``rw[p]`` before the store.
- Grid ``(cdiv(N, BLOCK_N), P)``; ``BLOCK_N`` divides ``WBN`` (a program's rows lie in one weight block).

The tiled GEMM (tensor cores, pairs sorted by expert; the sort and the tile plan are made on the device by
:func:`experts_route_kernel`, or for many pairs :func:`experts_route_count_kernel` then
:func:`experts_route_place_kernel`, so nothing is read on the host):

- ``x_q``: ``[R, K]`` float8, already quantized per group of ``G`` (``x_scale`` fp32 ``[R, ceil(K / G)]``, any
  strides); pair ``p`` reads row ``p // TOKEN_DIV``.
- ``order``: ``[P]`` the pairs sorted by expert (pairs without one, ids outside ``[0, E)``, last); tile ``b`` covers
  ``order[row0[b] : min(row0[b] + BLOCK_M, row_end[b])]``, all of expert ``tile_expert[b]``: ``E`` for the pairs
  without an expert (the tile writes their rows' zeros), ``> E`` an unused tile (exits at once). Each expert's pairs
  start a new tile, so a tile reads one expert's weight; every row of ``out`` is written by exactly one tile.
- ``w``: ``[E, N, K]`` float8 with ``w_scale`` ``[E, ceil(N / WBN), ceil(K / WBK)]``; ``BLOCK_N`` divides ``WBN``
  and ``G`` divides ``WBK`` (one weight scale per tile and K step); with ``W_ROWS`` ``[E, N]``, one scale per output
  row, applied to the finished tile.
- Every K step of ``G`` columns is one MMA whose fp32 result is multiplied by the rows' activation scales and the
  tile's weight scale and added to the fp32 accumulator; ``out`` row ``p`` (``[P, N]``) gets the sum, times ``rw[p]``
  where ``HAS_RW``. Grid ``(max_tiles, cdiv(N, BLOCK_N))``, or ``(cdiv(N, BLOCK_N), max_tiles)`` with ``N_FIRST``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_gemm_kernels import _gemv_load, _gemv_step, _row_aligned, gemv_tile


@triton.jit
def experts_gemv_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, ids_ptr, rw_ptr,
    N, K, E, TOKEN_DIV,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_wse, stride_wsn, stride_wsk,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr,
    EVEN_K: tl.constexpr, ROW_ALIGN: tl.constexpr, HAS_RW: tl.constexpr, FMAX: tl.constexpr, W_ROWS: tl.constexpr,
):
    """One program: ``BLOCK_N`` rows of pair ``program_id(1)``'s expert against that pair's row of ``x``."""
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    stride_xm, stride_wn, K = _row_aligned(stride_xm, stride_wn, K, ROW_ALIGN)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    valid = (expert >= 0) & (expert < E)
    expert = tl.where(valid, expert, 0)
    STEP: tl.constexpr = GROUPS * GROUP_K
    offs_n, rows_w, offs_g, cols = gemv_tile(pid_n, N, BLOCK_N, GROUPS, GROUP_K)
    w_ptrs = w_ptr + expert * stride_we + rows_w[:, None, None] * stride_wn + cols[None, :, :] * stride_wk
    x_ptrs = x_ptr + (p // TOKEN_DIV).to(tl.int64) * stride_xm + cols * stride_xk
    ws_row = ws_ptr + expert * stride_wse + ((pid_n * BLOCK_N) // WBN) * stride_wsn
    acc = tl.zeros((BLOCK_N, GROUPS, GROUP_K), dtype=tl.float32)
    code = w_ptr.dtype.element_ty
    for k0 in range(0, K, STEP):
        # X_QUANT: the activation scale slot is not read (the weight's row pointer fills it)
        wv, xv, xs, ws = _gemv_load(w_ptrs, x_ptrs, ws_row, ws_row, k0, K, cols, offs_g, stride_wk, stride_xk, 0,
                                    stride_wsk, GROUPS, GROUP_K, WBK, EVEN_K, True)
        if W_ROWS:  # the rows' scales come after the loop (the load above read one row's scale at stride 0)
            ws = tl.full([GROUPS], 1.0, tl.float32)
        acc = _gemv_step(acc, wv, xv, xs, ws, True, FMAX, code)
    total = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
    if W_ROWS:
        total = total * tl.load(ws_ptr + expert * stride_wse + rows_w * stride_wsn)
    if HAS_RW:
        total = total * tl.load(rw_ptr + p).to(tl.float32)
    total = tl.where(valid, total, 0.0)
    tl.store(out_ptr + p.to(tl.int64) * stride_om + offs_n * stride_on, total.to(out_ptr.dtype.element_ty),
             mask=offs_n < N)


@triton.jit
def experts_gemm_kernel(
    x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr, tile_end_ptr, rw_ptr,
    N, K, E, TOKEN_DIV,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_K: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_RW: tl.constexpr, W_ROWS: tl.constexpr, N_FIRST: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_N`` output tile of one expert's sorted pairs, or zeros for pairs without an expert
    (module docstring). ``N_FIRST``: the grid is ``(cdiv(N, BLOCK_N), tiles)``, the programs of one tile's row
    blocks launched together (its gathered activation rows read while in L2), else ``(tiles, cdiv(N, BLOCK_N))``."""
    if N_FIRST:
        pid_n = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + b).to(tl.int64)
    if expert > E:
        return
    row0 = tl.load(tile_row0_ptr + b)
    row_end = tl.load(tile_end_ptr + b)
    offs_r = row0 + tl.arange(0, BLOCK_M)
    in_m = offs_r < row_end
    pairs = tl.load(order_ptr + offs_r, mask=in_m, other=0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert < E:
        rows_x = pairs // TOKEN_DIV
        rows_w = (offs_n % N).to(tl.int64)
        offs_k = tl.arange(0, GROUP_K)
        x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_ptrs = w_ptr + expert * stride_we + rows_w[None, :] * stride_wn + offs_k[:, None] * stride_wk
        xs_ptrs = xs_ptr + rows_x * stride_xsm
        ws_row = ws_ptr + expert * stride_wse + ((pid_n * BLOCK_N) // WBN) * stride_wsn
        for kb in range(0, tl.cdiv(K, GROUP_K)):
            k0 = kb * GROUP_K
            if EVEN_K:
                a = tl.load(x_ptrs + k0 * stride_xk, mask=in_m[:, None], other=0.0)
                bw = tl.load(w_ptrs + k0 * stride_wk)
            else:
                in_k = offs_k < K - k0
                a = tl.load(x_ptrs + k0 * stride_xk, mask=in_m[:, None] & in_k[None, :], other=0.0)
                bw = tl.load(w_ptrs + k0 * stride_wk, mask=in_k[:, None], other=0.0)
            xs = tl.load(xs_ptrs + kb * stride_xsk, mask=in_m, other=0.0)
            if W_ROWS:
                acc += tl.dot(a, bw) * xs[:, None]
            else:
                ws = tl.load(ws_row + (k0 // WBK) * stride_wsk)
                acc += tl.dot(a, bw) * (xs[:, None] * ws)
        if W_ROWS:
            acc = acc * tl.load(ws_ptr + expert * stride_wse + rows_w * stride_wsn)[None, :]
        if HAS_RW:
            acc = acc * tl.load(rw_ptr + pairs, mask=in_m, other=0.0).to(tl.float32)[:, None]
    ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=in_m[:, None] & (offs_n[None, :] < N))


@triton.jit
def _route_bins(ids_ptr, offs, live, E):
    """The histogram bins of ids ``offs``: the expert, or ``E`` for an id outside ``[0, E)``."""
    e = tl.load(ids_ptr + offs, mask=live, other=0)
    return tl.where((e >= 0) & (e < E), e, E).to(tl.int32)


@triton.jit
def _route_tiles(counts, seg_start, seg_end, tile_expert_ptr, tile_row0_ptr, tile_end_ptr, E, n_tiles,
                 BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    """The tile plan from the bins' counts (``[E_P2]``, zero past bin ``E``) and their segments of the order: each
    bin's pairs in whole tiles of ``BLOCK_M`` rows, written bin by bin (tile expert ``E``: the pairs without one);
    the tiles past them ``E + 1`` (unused)."""
    offs_e = tl.arange(0, E_P2)
    offs_c = tl.arange(0, CHUNK)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    first_tile = tl.cumsum(tiles, 0) - tiles
    used = tl.sum(tiles, axis=0)
    for b0 in range(0, n_tiles, CHUNK):  # unused tiles
        b = b0 + offs_c
        tl.store(tile_expert_ptr + b, E + 1, mask=(b >= used) & (b < n_tiles))
    for j in range(0, tl.max(tiles, axis=0)):  # each bin's j-th tile
        has = j < tiles
        b = first_tile + j
        tl.store(tile_expert_ptr + b, offs_e, mask=has)
        tl.store(tile_row0_ptr + b, seg_start + j * BLOCK_M, mask=has)
        tl.store(tile_end_ptr + b, seg_end, mask=has)


@triton.jit
def experts_route_kernel(
    ids_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr, tile_end_ptr, cursor_ptr, P, E, n_tiles,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr,
):
    """The tiled GEMM's routing in one program: the pairs sorted by expert (``order [P]``, int32) and the tile plan
    (``tile_expert`` / ``tile_row0`` / ``tile_end``, ``n_tiles`` each) from the expert ids ``ids [P]``.

    A histogram of the ids, ``CHUNK`` at a time (ids outside ``[0, E)`` counted in bin ``E``, which sorts after every
    expert); the tiles from the counts (:func:`_route_tiles`); then each pair's place, its bin's start plus an atomic
    counter (any order within an expert, which no output row depends on). ``cursor [E_P2]`` int32 is scratch;
    ``E_P2 >= E + 2`` a power of two (bin ``E_P2 - 1`` takes a chunk's padding)."""
    offs_e = tl.arange(0, E_P2)
    offs_c = tl.arange(0, CHUNK)
    counts = tl.zeros([E_P2], dtype=tl.int32)
    for c0 in range(0, P, CHUNK):
        live = c0 + offs_c < P
        e = _route_bins(ids_ptr, c0 + offs_c, live, E)
        counts += tl.histogram(tl.where(live, e, E_P2 - 1), E_P2)
    counts = tl.where(offs_e <= E, counts, 0)
    seg_end = tl.cumsum(counts, 0)
    seg_start = seg_end - counts
    tl.store(cursor_ptr + offs_e, seg_start)
    _route_tiles(counts, seg_start, seg_end, tile_expert_ptr, tile_row0_ptr, tile_end_ptr, E, n_tiles, BLOCK_M, E_P2,
                 CHUNK)
    tl.debug_barrier()  # the cursors stored above, before any thread of the program takes a place from them
    for c0 in range(0, P, CHUNK):
        live = c0 + offs_c < P
        e = _route_bins(ids_ptr, c0 + offs_c, live, E)
        place = tl.atomic_add(cursor_ptr + e, 1, mask=live, sem="relaxed", scope="cta")
        tl.store(order_ptr + place, c0 + offs_c, mask=live)


@triton.jit
def experts_route_count_kernel(ids_ptr, hist_ptr, P, E, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    """The routing over many programs, first launch: program ``c`` writes the histogram of ids ``[c * CHUNK,
    (c + 1) * CHUNK)`` to ``hist[c] ([E_P2]`` int32, bins as :func:`experts_route_kernel`'s)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    live = offs < P
    e = _route_bins(ids_ptr, offs, live, E)
    tl.store(hist_ptr + c * E_P2 + tl.arange(0, E_P2), tl.histogram(tl.where(live, e, E_P2 - 1), E_P2))


@triton.jit
def experts_route_place_kernel(
    ids_ptr, hist_ptr, order_ptr, tile_expert_ptr, tile_row0_ptr, tile_end_ptr, cursor_ptr, P, E, n_tiles, CHUNKS,
    BLOCK_M: tl.constexpr, E_P2: tl.constexpr, CHUNK: tl.constexpr,
):
    """The routing over many programs, second launch (``CHUNKS`` programs, after
    :func:`experts_route_count_kernel`): program ``c`` sums the chunks' histograms (every bin's total, and the pairs
    of chunks before ``c`` in each bin), places its chunk's pairs at their bin's start plus those, plus an atomic
    counter in its own ``cursor[c]`` (``[E_P2]`` int32 scratch); program 0 also writes the tile plan from the totals.
    The same order and plan as :func:`experts_route_kernel` (up to the order within an expert)."""
    c = tl.program_id(0)
    offs_e = tl.arange(0, E_P2)
    total = tl.zeros([E_P2], dtype=tl.int32)
    before = tl.zeros([E_P2], dtype=tl.int32)
    for g in range(0, CHUNKS):
        h = tl.load(hist_ptr + g * E_P2 + offs_e)
        total += h
        before += tl.where(g < c, h, 0)
    total = tl.where(offs_e <= E, total, 0)
    seg_end = tl.cumsum(total, 0)
    seg_start = seg_end - total
    tl.store(cursor_ptr + c * E_P2 + offs_e, seg_start + before)
    if c == 0:
        _route_tiles(total, seg_start, seg_end, tile_expert_ptr, tile_row0_ptr, tile_end_ptr, E, n_tiles, BLOCK_M,
                     E_P2, CHUNK)
    tl.debug_barrier()  # this program's cursors stored, before any of its threads takes a place from them
    offs = c * CHUNK + tl.arange(0, CHUNK)
    live = offs < P
    e = _route_bins(ids_ptr, offs, live, E)
    place = tl.atomic_add(cursor_ptr + c * E_P2 + e, 1, mask=live, sem="relaxed", scope="cta")
    tl.store(order_ptr + place, offs, mask=live)
