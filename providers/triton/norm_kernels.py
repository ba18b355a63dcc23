"""Triton kernels: fused RMSNorm -> static per-tensor FP8 quant, and residual add -> RMSNorm -> quant.

Operands (what :func:`rmsnorm_quant` and :func:`fused_add_rmsnorm_quant` take; the provider validates them):

- ``x``: ``[T, H]`` bf16, fp16 or fp32, columns contiguous, rows ``x.stride(0)`` elements apart.
- ``residual`` (add variant): ``[T, H]`` in x's dtype, columns contiguous. Updated **in place** to
  ``x + residual`` (summed in fp32, rounded once to the dtype).
- ``weight``: ``[H]`` in x's dtype, any stride.
- ``scale``: one fp32 value on x's device (``[]``, ``[1]`` or ``[1, 1]``); the kernel loads it and
  multiplies by its reciprocal. It is never read on the host.
- ``out``: ``[T, H]`` float8_e4m3fn (or float8_e5m2), columns contiguous.

Per row, in fp32 (the order of :func:`fp8_backends.core.reference.rmsnorm` and ``quantize_static``)::

    s = x (+ residual)                   # the add variant stores s to residual, normalizes the fp32 s
    rrms = rsqrt(sum(s * s) / H + eps)
    out = fp8(clamp(((s * rrms) * w) * (1 / scale), -fmax, fmax))     # fmax 448 (e4m3fn), 57344 (e5m2)

Paths, chosen by :func:`.quant_kernels.row_config` (cached per ``H`` and "large", see below):

- ``rows`` (``next_pow2(H) <= 1024``): a ``[ROWS, BLOCK]`` block of several rows per program
  (``ROWS * BLOCK = 4096``, 4 warps), so small hidden sizes still move full tiles per program.
- ``row`` (``next_pow2(H) <= SINGLE_PASS_MAX = 32768``): one row per program, the whole row in
  registers: one read of ``x`` (and ``residual``), one write of ``out`` (and ``residual``).
- ``loop`` (larger ``H``): one row per program, two passes over the row in 16384-element chunks: the
  sum of squares, then normalize / quantize / store. The add variant does not store the residual in
  the first pass: the second pass reloads ``x`` and ``residual`` (mostly from L2), recomputes the same
  fp32 sum and stores both outputs, so the normalized value is the fp32 sum, as in the other paths.

``num_warps`` (measured on the H200, bf16, CUDA graphs): 4 for the ``rows`` path; for one-row programs
of up to 16384 elements 4 in large launches (many waves of programs: more rows in flight pay) and 16 in
smaller ones (latency: more threads per row pay); 16 for 32768-element rows and the ``loop`` chunks. A
launch is large from ``T * H >= 2^22`` for the plain kernel and ``2^25`` for the add variant
(:func:`default_config`; ``bench/norm_configs.py`` measures the warps). Masks cover any ``H`` (not only
powers of two) and the last rows of the ``rows`` path.
Row offsets are 64-bit.

PDL: with ``USE_PDL`` (SM >= 9.0, not the interpreter, ``FP8_BACKENDS_PDL`` not ``0``; see
:func:`._support.pdl_enabled`) a program first waits for the previous grid (``gdc_wait``: before any
global load, so weights and scales written by the previous kernel are seen too), then lets the next grid
launch (``gdc_launch_dependents``) once its inputs are loaded; the launch passes ``launch_pdl=True``.

No host-device synchronisation and no allocation: CUDA-graph capturable. This module imports torch and
triton: import it lazily.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import _support
from .launcher import ReplayCache, launcher_for, raw_stream
from .nan_math import nan_clamp
from .quant_kernels import FMAX, LARGE_LAUNCH, LARGE_LAUNCH_NORM, RowConfig, is_large, row_config


@triton.jit
def _norm_quant_block_kernel(
    x_ptr, r_ptr, w_ptr, s_ptr, o_ptr, T, H, stride_x, stride_r, stride_o, stride_w, eps,
    FMAX: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """``ROWS`` whole rows (``BLOCK >= H``) per program, one pass."""
    eps = tl.cast(eps, tl.float32)  # Inductor passes a Python float as fp64; fp64 math cannot be cast to fp8
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < H
    mask = (rows < T)[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:
        r_ptrs = r_ptr + rows64 * stride_r + cols[None, :]
        x += tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols * stride_w, mask=col_mask, other=0.0).to(tl.float32)
    inv_scale = tl.math.div_rn(1.0, tl.load(s_ptr))
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if ADD:
        tl.store(r_ptrs, x.to(r_ptr.dtype.element_ty), mask=mask)
    rrms = tl.math.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    y = nan_clamp(x * rrms[:, None] * w[None, :] * inv_scale, -FMAX, FMAX)
    tl.store(o_ptr + rows64 * stride_o + cols[None, :], y.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_quant_loop_kernel(
    x_ptr, r_ptr, w_ptr, s_ptr, o_ptr, H, stride_x, stride_r, stride_o, stride_w, eps,
    FMAX: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One row per program, two passes over it in ``BLOCK``-element chunks."""
    eps = tl.cast(eps, tl.float32)  # as in _norm_quant_block_kernel
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    r_row = r_ptr + row * stride_r
    o_row = o_ptr + row * stride_o
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        v = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if ADD:
            v += tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += v * v
    inv_scale = tl.math.div_rn(1.0, tl.load(s_ptr))
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    rrms = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps)
    for start in range(0, H, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < H
        v = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if ADD:
            v += tl.load(r_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            tl.store(r_row + cols, v.to(r_ptr.dtype.element_ty), mask=mask)
        w = tl.load(w_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
        y = nan_clamp(v * rrms * w * inv_scale, -FMAX, FMAX)
        tl.store(o_row + cols, y.to(o_ptr.dtype.element_ty), mask=mask)


#: replays of the two kernels (see :class:`.launcher.ReplayCache`); the arguments each call passes itself: x,
#: residual, weight, scale, out, (T,) H, the four strides and eps
_block_replays = ReplayCache(head=12)
_loop_replays = ReplayCache(head=11)


def _launch(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            scale: torch.Tensor, eps: float, cfg: RowConfig, index: int) -> None:
    """Launch on ``index``, the current device (``x.get_device()``: -1 for CPU tensors under the interpreter).
    A call whose key (config, T, H, strides, dtypes, residual, PDL, device; every data pointer 16-byte aligned)
    was launched before replays that launch with this call's pointers and eps; other calls take the general
    path, which records the replay."""
    t, h = x.shape
    pdl = _support.pdl_on(index)
    add = residual is not None
    r = residual if add else x  # unused without ADD
    sx, sr, so, sw = x.stride(0), r.stride(0), out.stride(0), weight.stride(0)
    loop = cfg.path == "loop"
    replays = _loop_replays if loop else _block_replays
    key = None
    if index >= 0:
        px, pr, pw, ps, po = x.data_ptr(), r.data_ptr(), weight.data_ptr(), scale.data_ptr(), out.data_ptr()
        if not (px | pr | pw | ps | po) & 15:
            key = (cfg, t, h, sx, sr, so, sw, x.dtype, r.dtype, weight.dtype, scale.dtype, out.dtype, add, pdl, index)
            hit = replays.lookup(key)
            if hit is not None:
                rp, tail = hit[0], hit[1]
                if loop:
                    rp.run(rp.g0, rp.g1, rp.g2, raw_stream(index), rp.function, rp.packed, None, None, None,
                           px, pr, pw, ps, po, h, sx, sr, so, sw, eps, *tail)
                else:
                    rp.run(rp.g0, rp.g1, rp.g2, raw_stream(index), rp.function, rp.packed, None, None, None,
                           px, pr, pw, ps, po, t, h, sx, sr, so, sw, eps, *tail)
                return
    kernel, grid, args = kernel_args(cfg, out, x, residual, weight, scale, eps, pdl)
    kernel_launcher = launcher_for(kernel)
    options = {"num_warps": cfg.num_warps, "pdl": pdl, "device_index": index if index > 0 else 0}
    kernel_launcher(grid, args, **options)
    if key is not None:
        replays.record(key, kernel_launcher, grid, args, **options)


def kernel_args(cfg: RowConfig, out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                weight: torch.Tensor, scale: torch.Tensor, eps: float, pdl: bool) -> tuple[Any, tuple, tuple]:
    """``(kernel, grid, args)`` of a launch over ``x [T, H]`` with ``cfg``: every kernel parameter in order,
    constexprs included. Sizes may be symbolic (the traced op builds the same launch under torch.compile)."""
    t, h = x.shape
    add = residual is not None
    r = residual if add else x  # unused without ADD
    strides = (x.stride(0), r.stride(0), out.stride(0), weight.stride(0))
    fmax = FMAX[out.dtype]
    if cfg.path == "loop":
        return (_norm_quant_loop_kernel, (t,),
                (x, r, weight, scale, out, h, *strides, eps, fmax, cfg.block, add, pdl))
    return (_norm_quant_block_kernel, ((t + cfg.rows - 1) // cfg.rows,),
            (x, r, weight, scale, out, t, h, *strides, eps, fmax, cfg.rows, cfg.block, add, pdl))


#: the plain RMSNorm+quant over a large launch (T x H >= LARGE_LAUNCH_NORM) with rows of 1025-4096 elements runs
#: programs of two whole rows, 32 elements per thread (4 warps at H <= 2048, 8 at 4096). Measured on the H200
#: (bench/norm_configs.py --rows 1,2, 2026-11-29): at H = 4096, T = 4096 / 8192 / 16384 it took 13.8 / 25.6 / 48.8 µs
#: against 14.6 / 27.3 / 52.5 µs for one row and 4 warps (83 -> 87%, 88 -> 94%, 92 -> 99% of copy bandwidth), and
#: at H = 2048 2-10% less time; at H = 8192 and with the residual add two rows were slower.
PAIR_ROWS_MAX_BLOCK = 4096


def one_row_config(t: int, h: int, add: bool) -> RowConfig:
    """:func:`.quant_kernels.row_config` for ``[t, h]`` rows, with the "large launch" threshold of the variant
    (``LARGE_LAUNCH`` with the residual add, ``LARGE_LAUNCH_NORM`` without)."""
    return row_config(h, is_large(t, h, LARGE_LAUNCH if add else LARGE_LAUNCH_NORM))


def default_config(t: int, h: int, add: bool) -> RowConfig:
    """The launch shape for ``[t, h]`` rows: :func:`one_row_config`, except that the plain kernel over a large
    launch runs two rows per program when a row fits ``PAIR_ROWS_MAX_BLOCK`` (see there)."""
    cfg = one_row_config(t, h, add)
    if not add and cfg.path == "row" and cfg.block <= PAIR_ROWS_MAX_BLOCK and is_large(t, h, LARGE_LAUNCH_NORM):
        return RowConfig("rows", 2, cfg.block, max(4, cfg.block // 512))
    return cfg


def _run(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
         scale: torch.Tensor, eps: float, config: RowConfig | None) -> None:
    if x.shape[0] == 0 or x.shape[1] == 0:
        return
    cfg = config if config is not None else default_config(x.shape[0], x.shape[1], residual is not None)
    index = x.get_device()
    _support.on_device(index, _launch, out, x, residual, weight, scale, eps, cfg, index)


def rmsnorm_quant(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float,
                  *, config: RowConfig | None = None) -> None:
    """Write ``clamp(rmsnorm(x) · weight / scale, ±fmax)`` into ``out`` (fp8). ``config`` overrides
    :func:`.quant_kernels.row_config` (tests use it to reach the two-pass path at small ``H``)."""
    _run(out, x, None, weight, scale, eps, config)


def fused_add_rmsnorm_quant(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                            scale: torch.Tensor, eps: float, *, config: RowConfig | None = None) -> None:
    """``residual <- x + residual`` (in place, in its dtype); write the quantized RMSNorm of the fp32 sum
    into ``out``."""
    _run(out, x, residual, weight, scale, eps, config)


__all__ = ["default_config", "fused_add_rmsnorm_quant", "kernel_args", "rmsnorm_quant"]
