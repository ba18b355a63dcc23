"""Triton kernels of the FP8 GEMM provider: ``out[M, N] = (x·s_x) @ (w·s_w)ᵀ (+ bias)``.

Shared contract of the three kernels (validated by the caller, not here):

- ``x``: ``[M, K]`` float8 (e4m3fn or e5m2), row stride ``stride_xm``, unit column stride.
- ``w``: ``[N, K]`` float8 of the same type, row stride ``stride_wn``, unit column stride (K-major).
- ``out``: ``[M, N]`` bf16/fp16/fp32, row stride ``stride_om``.
- ``x_scale``: fp32, one value, or ``[M]`` values when ``X_PER_TOKEN``; ``w_scale``: one value, or
  ``[N]`` values when ``W_PER_CHANNEL``. Scales are read on the device, never on the host.
- ``bias``: ``[N]`` in the output dtype when ``HAS_BIAS`` (any pointer otherwise, never read).
- Accumulation in fp32; the epilogue computes ``acc · s_x · s_w (+ bias)`` in fp32 and casts once.
- Ragged edges: rows of x and w past M and N are read through a modulo (always in bounds, discarded at
  the store); K past the end is masked to zero unless ``EVEN_K`` (K a multiple of ``BLOCK_K``).
- ``USE_PDL``: programmatic dependent launch. The kernel waits for the grid it depends on
  (``gdc_wait``) before its first read of ``x``/scales and then lets its own dependents launch
  (``gdc_launch_dependents``); the weight is not produced by an earlier kernel, so the first weight
  tile may be loaded before the wait.
- ``X_QUANT`` (the ``swap`` and ``gemv`` kernels): ``x`` arrives unquantized (bf16/fp16/fp32) and the kernel
  quantizes every tile it loads exactly as :mod:`fp8_backends.core.reference` does (``clamp(x / s, ±FMAX)`` with an
  IEEE division, rounded to ``w``'s float8 type), so the products are those of the unfused path, bit for bit:
  ``QUANT_STATIC`` with the scale at ``x_scale``; ``QUANT_DYNAMIC`` with ``s = max(amax(x) / FMAX, 1e-12)``
  over all of ``x`` and ``QUANT_PER_TOKEN`` over each row, computed by each program from ``x`` itself (small M:
  ``x`` is a few KB read from L2), the scale applied in the epilogue from registers (``x_scale`` not read).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .nan_math import dynamic_scale, nan_max_reduce, nan_maximum, scaled_cast

#: ``X_QUANT`` values: ``x`` already float8 / quantized in the kernel with a static scale / a dynamic per-tensor
#: scale / dynamic per-token scales (the two dynamic modes are the codes from QUANT_DYNAMIC up)
QUANT_NONE = tl.constexpr(0)
QUANT_STATIC = tl.constexpr(1)
QUANT_DYNAMIC = tl.constexpr(2)
QUANT_PER_TOKEN = tl.constexpr(3)


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, out_ptr, stride_om, x_scale_ptr, w_scale_ptr, bias_ptr,
              X_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
              X_SCALED: tl.constexpr = False):
    """Scale, add bias and store a tile. ``offs_m``/``offs_n`` broadcast against ``acc``'s shape.
    ``X_SCALED``: ``acc`` already carries the activation scale (a dynamic scale computed in the kernel)."""
    in_m = offs_m < M
    in_n = offs_n < N
    if X_SCALED:
        pass
    elif X_PER_TOKEN:
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=in_m, other=1.0)
    else:
        acc = acc * tl.load(x_scale_ptr)
    if W_PER_CHANNEL:
        acc = acc * tl.load(w_scale_ptr + offs_n, mask=in_n, other=1.0)
    else:
        acc = acc * tl.load(w_scale_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=in_m & in_n)


@triton.jit
def _absmax_rows(x_ptr, offs_m, M, K, stride_xm, BLOCK_K: tl.constexpr):
    """``max |x[r, :]|`` for each row ``r`` of ``offs_m`` (rows past ``M`` give 0), shape of ``offs_m``."""
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = offs_m < M
    rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    acc = tl.zeros(offs_m.shape, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + offs_k
        v = tl.load(rows[:, None] + cols[None, :], mask=row_mask[:, None] & (cols < K)[None, :], other=0.0)
        acc = nan_maximum(acc, nan_max_reduce(tl.abs(v.to(tl.float32)), 1))
    return acc


@triton.jit
def _absmax_all(x_ptr, M, K, stride_xm, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """``max |x|`` over all ``M`` rows (read ``ROWS`` at a time)."""
    amax = tl.zeros((ROWS,), dtype=tl.float32)
    for r0 in range(0, M, ROWS):
        amax = nan_maximum(amax, _absmax_rows(x_ptr, r0 + tl.arange(0, ROWS), M, K, stride_xm, BLOCK_K))
    return nan_max_reduce(amax, 0)


@triton.jit
def fp8_gemm_mm_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    X_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Tiled GEMM, one ``[BLOCK_M, BLOCK_N]`` output tile per program, grouped tile order. Grid:
    ``(cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)``."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_x = offs_m % M
    rows_w = offs_n % N
    x_ptrs = x_ptr + rows_x[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + rows_w[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of wᵀ

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue(acc, offs_m[:, None], offs_n[None, :], M, N, out_ptr, stride_om, x_scale_ptr, w_scale_ptr,
              bias_ptr, X_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)


@triton.jit
def fp8_gemm_swap_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, X_QUANT: tl.constexpr, FMAX: tl.constexpr,
):
    """Swap-AB GEMM for small M: ``accᵀ[BLOCK_N, BLOCK_M] = w_tile · x_tileᵀ``; the weight rows fill
    the MMA's wide side. Grid: ``(cdiv(N, BLOCK_N), cdiv(M, BLOCK_M))``. ``X_QUANT``: see the module
    docstring."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = offs_n % N
    rows_x = offs_m % M
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + rows_x[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M] view of xᵀ

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if X_QUANT == QUANT_STATIC:
        qscale = tl.load(x_scale_ptr)
    elif X_QUANT == QUANT_DYNAMIC:
        qscale = dynamic_scale(_absmax_all(x_ptr, M, K, stride_xm, BLOCK_M, BLOCK_K), FMAX)
    elif X_QUANT == QUANT_PER_TOKEN:
        qscale = dynamic_scale(_absmax_rows(x_ptr, rows_x, M, K, stride_xm, BLOCK_K), FMAX)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(w_ptrs)
            b = tl.load(x_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(x_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if X_QUANT != QUANT_NONE:
            b = scaled_cast(b, qscale, FMAX, w_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if X_QUANT >= QUANT_DYNAMIC:
        acc = acc * qscale
    _epilogue(acc, offs_m[None, :], offs_n[:, None], M, N, out_ptr, stride_om, x_scale_ptr, w_scale_ptr,
              bias_ptr, X_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS, X_QUANT >= QUANT_DYNAMIC)


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    X_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, USE_PDL: tl.constexpr, X_QUANT: tl.constexpr, FMAX: tl.constexpr,
):
    """CUDA-core GEMV: ``BLOCK_N`` weight rows against one token per program, fp32 products summed
    over K. Grid: ``(cdiv(N, BLOCK_N), M)`` (the weight is streamed once per token). ``X_QUANT``: see the
    module docstring."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows_w = offs_n % N
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + m * stride_xm + offs_k

    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if X_QUANT == QUANT_STATIC:
        qscale = tl.load(x_scale_ptr)
    elif X_QUANT == QUANT_DYNAMIC:
        qscale = dynamic_scale(_absmax_all(x_ptr, M, K, stride_xm, 1, BLOCK_K), FMAX)
    elif X_QUANT == QUANT_PER_TOKEN:
        qscale = dynamic_scale(nan_max_reduce(_absmax_rows(x_ptr, tl.full((1,), 0, tl.int32) + m, M, K, stride_xm,
                                                    BLOCK_K), 0), FMAX)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            wv = tl.load(w_ptrs)
            xv = tl.load(x_ptrs)
        else:
            k_left = K - k * BLOCK_K
            wv = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            xv = tl.load(x_ptrs, mask=offs_k < k_left, other=0.0)
        if X_QUANT != QUANT_NONE:
            xv = scaled_cast(xv, qscale, FMAX, w_ptr.dtype.element_ty)
        acc += wv.to(tl.float32) * xv.to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    total = tl.sum(acc, axis=1)[:, None]  # [BLOCK_N, 1]
    if X_QUANT >= QUANT_DYNAMIC:
        total = total * qscale
    offs_m = tl.full((1, 1), 0, tl.int32) + m
    _epilogue(total, offs_m, offs_n[:, None], M, N, out_ptr, stride_om, x_scale_ptr, w_scale_ptr,
              bias_ptr, X_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS, X_QUANT >= QUANT_DYNAMIC)


@triton.jit
def fp8_gemm_tma_kernel(
    x_desc, w_desc, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr,
    M, N, K, stride_om, num_progs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    X_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Tiled GEMM whose operand tiles arrive through TMA (host-built tensor descriptors over ``x [M, K]``
    and ``w [N, K]``, block shapes ``[BLOCK_M, BLOCK_K]`` and ``[BLOCK_N, BLOCK_K]``; TMA zero-fills
    past the edges, so no masks in the K loop). Persistent when ``num_progs`` < number of tiles: each
    program walks tiles ``pid, pid + num_progs, ...`` in grouped order. Grid: ``(num_progs,)``."""
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = num_m * num_n
    per_group = GROUP_M * num_n
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    for tile in tl.range(start, num_tiles, num_progs, flatten=True):
        first_m = (tile // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([off_m, ki * BLOCK_K])
            b = w_desc.load([off_n, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        _epilogue(acc, offs_m[:, None], offs_n[None, :], M, N, out_ptr, stride_om, x_scale_ptr, w_scale_ptr,
                  bias_ptr, X_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)


__all__ = ["fp8_gemm_mm_kernel", "fp8_gemm_swap_kernel", "fp8_gemm_tma_kernel", "fp8_gemv_kernel"]
