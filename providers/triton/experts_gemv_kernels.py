"""Triton kernel of the block-scaled FP8 GEMV over routed experts (a MoE layer's decode).

``out[p, n] = sum_g (q(x[p // TOKEN_DIV])[g] · x_scale[g]) · (w[e_p, n, g] · w_scale[e_p, n // WBN, g·G // WBK])``
for every (token, slot) pair ``p`` with ``e_p = ids[p]``: each pair's row is multiplied by its own expert's weight,
in one launch for all pairs, so a decode step's MoE layer reads each routed expert's weight once per pair and needs
no host-side knowledge of which experts were hit (CUDA-graph capturable, no sync).

Shared contract (validated by the caller, :mod:`.experts_gemv_ops`):

- ``x``: ``[R, K]`` bf16/fp16/fp32, the *unquantized* rows; pair ``p`` reads row ``p // TOKEN_DIV`` (``TOKEN_DIV = k``
  for the gate/up projection, where the ``k`` slots of a token share its hidden state; 1 for the down projection).
  Each group of ``G`` columns is quantized here to ``w``'s float8 type as the per-token-group quantization does
  (``scale = max(amax / FMAX, 1e-12)``), the same codes as :mod:`.block_gemm_kernels`' fused GEMV.
- ``w``: ``[E, N, K]`` float8 (strides ``stride_we, stride_wn, stride_wk``); ``w_scale``: fp32 ``[E, ceil(N / WBN),
  ceil(K / WBK)]`` (any strides).
- ``ids``: ``[P]`` integer expert ids; a pair whose id is outside ``[0, E)`` (an expert-parallel sentinel) gets a
  zero row and reads no weight of its own (expert 0's, discarded).
- ``out``: ``[P, N]`` (``stride_om, stride_on``), bf16/fp16/fp32; ``HAS_RW``: row ``p`` is multiplied by the fp32
  routing weight ``rw[p]`` before the store.
- Grid ``(cdiv(N, BLOCK_N), P)``; ``BLOCK_N`` divides ``WBN`` (a program's rows lie in one weight block).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .block_gemm_kernels import _gemv_load, _gemv_step, _row_aligned


@triton.jit
def experts_gemv_kernel(
    x_ptr, w_ptr, out_ptr, ws_ptr, ids_ptr, rw_ptr,
    N, K, E, TOKEN_DIV,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_om, stride_on,
    stride_wse, stride_wsn, stride_wsk,
    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP_K: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr,
    EVEN_K: tl.constexpr, ROW_ALIGN: tl.constexpr, HAS_RW: tl.constexpr, FMAX: tl.constexpr,
):
    """One program: ``BLOCK_N`` rows of pair ``program_id(1)``'s expert against that pair's row of ``x``."""
    pid_n = tl.program_id(0)
    p = tl.program_id(1)
    stride_xm, stride_wn, K = _row_aligned(stride_xm, stride_wn, K, ROW_ALIGN)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    valid = (expert >= 0) & (expert < E)
    expert = tl.where(valid, expert, 0)
    STEP: tl.constexpr = GROUPS * GROUP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_w = (offs_n % N).to(tl.int64)
    offs_g = tl.arange(0, GROUPS)
    offs_j = tl.arange(0, GROUP_K)
    cols = offs_g[:, None] * GROUP_K + offs_j[None, :]  # [GROUPS, GROUP_K]
    w_ptrs = w_ptr + expert * stride_we + rows_w[:, None, None] * stride_wn + cols[None, :, :] * stride_wk
    x_ptrs = x_ptr + (p // TOKEN_DIV).to(tl.int64) * stride_xm + cols * stride_xk
    ws_row = ws_ptr + expert * stride_wse + ((pid_n * BLOCK_N) // WBN) * stride_wsn
    acc = tl.zeros((BLOCK_N, GROUPS, GROUP_K), dtype=tl.float32)
    code = w_ptr.dtype.element_ty
    for k0 in range(0, K, STEP):
        # X_QUANT: the activation scale slot is not read (the weight's row pointer fills it)
        wv, xv, xs, ws = _gemv_load(w_ptrs, x_ptrs, ws_row, ws_row, k0, K, cols, offs_g, stride_wk, stride_xk, 0,
                                    stride_wsk, GROUPS, GROUP_K, WBK, EVEN_K, True)
        acc = _gemv_step(acc, wv, xv, xs, ws, True, FMAX, code)
    total = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BLOCK_N]
    if HAS_RW:
        total = total * tl.load(rw_ptr + p).to(tl.float32)
    total = tl.where(valid, total, 0.0)
    tl.store(out_ptr + p.to(tl.int64) * stride_om + offs_n * stride_on, total.to(out_ptr.dtype.element_ty),
             mask=offs_n < N)
