"""The torch side of the block-scaled Triton FP8 GEMM: the launch API, the per-launch plan (config, split-K,
buffers), replayed launches and the ``fp8_backends::triton_block_gemm`` op.

Entry points:

- :func:`block_gemm`: the checked call. ``x_q [M, K]`` and ``w_q [N, K]`` float8 (same type), ``x_scale
  [M, ceil(K / G)]`` fp32 in any layout (row-major, M-major, M-major with M padded to 4: any strides),
  ``w_scale [ceil(N / 128), ceil(K / 128)]`` fp32 (any strides; :func:`prepare_weight_scale` makes the row-major
  contiguous fp32 copy the kernels read best, once at load time), ``bias [N]`` or ``None``, ``out_dtype``
  bf16/fp16/fp32, ``group_size`` G (128 or 64). Returns a new ``[M, N]`` tensor (or writes ``out``).
- :func:`launch`: the same without the checks (a provider that validated its inputs).
- :func:`run_config`: one config's launch into ``out`` (benchmarks and tests name configs).
- the launch itself (config, K split, kernel, grid, arguments) is :mod:`.block_gemm_args`, shared with the traced op
  body (:mod:`.block_gemm_traced`), so ``torch.compile`` launches the same kernel from Inductor's code.

Split K (``swap``/``mm`` configs with ``split_k != 1``): the partial tiles go to a new fp32 ``[S, M, N]`` buffer of
the launch (torch's caching allocator: a CUDA graph captures it from its pool) and the arrival counters to a zeroed
int32 buffer kept per (device, stream) and reset by the kernel itself, so launches on one stream never need a
memset and two streams never share counters. A launch whose tiles exceed :data:`COUNTER_SLOTS` runs unsplit.

No host-device synchronisation: CUDA-graph capturable (the first launch of each configuration compiles it: make
that call outside capture). Eager launches go through :mod:`.launcher` (the compiled kernel's launcher directly,
and a replay of an earlier launch with the same key), with PDL where :func:`._support.pdl_on` allows.

This module imports torch and triton: import it lazily.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.oplib import LazyOps, TritonOpSpec

from . import _support
from .block_gemm_args import (
    COUNTER_SLOTS,
    QUANT_OP_BASENAME,
    TMA_OP_BASENAME,
    Plan,
    cdiv,
    empty_k,
    fit_weight_block,
    fused_config,
    kernel_args,
    new_output,
    pick_config,
    plan_launch,
    pointer_twin,
    row_align,
    sm_count,
    tiles_of,
    tma_ok,
)
from .block_gemm_configs import CONFIGS, WEIGHT_BLOCK, BlockTileConfig
from .launcher import ReplayCache, launcher_for, raw_stream

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GROUP_SIZES = (64, 128)
OP_BASENAME = "triton_block_gemm"
OP_SCHEMA_ARGS = ("Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, ScalarType out_dtype, "
                  "int group_size, str config")
QUANT_OP_SCHEMA_ARGS = ("Tensor x, Tensor w, Tensor w_scale, Tensor? bias, ScalarType out_dtype, int group_size, "
                        "str config")


# ---------------------------------------------------------------------------------------------- weight scales
def prepare_weight_scale(w_scale: torch.Tensor) -> torch.Tensor:
    """The layout the kernels read best, made once at load time: ``[ceil(N/128), ceil(K/128)]`` fp32, row-major
    contiguous (checkpoints store bf16 or fp32 row-major; a transposed view is copied)."""
    if w_scale.dim() != 2:
        raise InvalidInputError(f"w_scale must be 2-D [ceil(N/128), ceil(K/128)], got shape {tuple(w_scale.shape)}")
    return w_scale.to(torch.float32).contiguous()


# ---------------------------------------------------------------------------------------------- checks
def check_inputs(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, group_size: int,
                 weight_block: tuple[int, int] = WEIGHT_BLOCK) -> None:
    """Raise :class:`InvalidInputError` for anything the kernels would compute wrong (shapes, dtypes, devices)."""
    if x.dim() != 2 or w.dim() != 2:
        raise InvalidInputError(f"x_q and w_q must be 2-D, got {tuple(x.shape)} and {tuple(w.shape)}")
    m, k = x.shape
    n, kw = w.shape
    if kw != k:
        raise InvalidInputError(f"x_q is [M, K={k}] but w_q is [N, K={kw}]")
    if x.dtype not in FP8_DTYPES or w.dtype != x.dtype:
        raise InvalidInputError(f"x_q and w_q must share a float8 dtype (e4m3fn or e5m2), got {x.dtype} and {w.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise InvalidInputError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    wbn, wbk = weight_block
    if group_size not in GROUP_SIZES or wbk % group_size:
        raise InvalidInputError(f"group_size must be 64 or 128 and divide the weight block's K ({wbk}), "
                                f"got {group_size}")
    if wbn < 16 or wbn & (wbn - 1) or wbk & (wbk - 1):
        raise InvalidInputError(f"weight_block must be powers of two with N >= 16, got {weight_block}")
    want_xs = (m, cdiv(k, group_size))
    if tuple(x_scale.shape) != want_xs or x_scale.dtype != torch.float32:
        raise InvalidInputError(f"x_scale must be fp32 {list(want_xs)} ([M, ceil(K/{group_size})]), got "
                                f"{x_scale.dtype} {list(x_scale.shape)}")
    want_ws = (cdiv(n, wbn), cdiv(k, wbk))
    if tuple(w_scale.shape) != want_ws or w_scale.dtype != torch.float32:
        raise InvalidInputError(f"w_scale must be fp32 {list(want_ws)} ([ceil(N/{wbn}), ceil(K/{wbk})]), got "
                                f"{w_scale.dtype} {list(w_scale.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n):
        raise InvalidInputError(f"bias must be [N={n}], got {list(bias.shape)}")
    devices = {t.device for t in (x, w, x_scale, w_scale, *(() if bias is None else (bias,)))}
    if len(devices) != 1:
        raise InvalidInputError(f"every operand must be on one device, got {sorted(map(str, devices))}")


# ---------------------------------------------------------------------------------------------- the plan
# ---------------------------------------------------------------------------------------------- buffers
_counters: dict[tuple[int, int], torch.Tensor] = {}


def counters_for(device: torch.device) -> torch.Tensor:
    """The zeroed int32 arrival counters of split-K launches on ``device``'s current stream (kept zero by the
    kernels). Made at the first split launch on a stream: under CUDA-graph capture that is a zero-fill captured into
    the graph, harmless at replay."""
    index = device.index if device.index is not None else 0
    key = (index, raw_stream(index)) if device.type == "cuda" else (-1, 0)
    buf = _counters.get(key)
    if buf is None:
        buf = _counters[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return buf


def reset_buffers() -> None:
    """Forget the counter buffers (tests)."""
    _counters.clear()


# ---------------------------------------------------------------------------------------------- launches
#: replays of the pointer kernels: a call passes its data pointers (6 for gemv, 8 for swap/mm); every other argument
#: is fixed by the key
_replays = ReplayCache(head=8)
_gemv_replays = ReplayCache(head=6)


def run_config(cfg: BlockTileConfig, x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out: torch.Tensor, group_size: int = 128,
               weight_block: tuple[int, int] = WEIGHT_BLOCK, pdl: bool | None = None, x_quant: bool = False) -> None:
    """Launch ``cfg``'s kernel writing ``out [M, N]`` (any strides; M, N >= 1). ``pdl``: force PDL on or off
    (benchmarks); ``None`` follows :func:`._support.pdl_on`. Inputs as :func:`block_gemm` states, unchecked.
    ``x_quant`` (``gemv`` configs): ``x`` is the unquantized activation, quantized per group inside the launch
    (:func:`fused_launch`)."""
    index = x.get_device()
    use_pdl = _support.pdl_on(index) if pdl is None else pdl
    m, k = x.shape
    n = w.shape[0]
    if cfg.family == "tma" and not tma_ok(x, w):
        cfg = pointer_twin(cfg)
    plan = plan_launch(cfg, m, n, k, group_size, sm_count(x.device))
    _support.on_device(index, _launch, plan, x, w, x_scale, w_scale, bias, out, group_size, weight_block, use_pdl,
                       index, x_quant)


def _launch(plan: Plan, x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor, group_size: int, weight_block: tuple[int, int],
            use_pdl: bool, index: int, x_quant: bool = False) -> None:
    cfg = plan.cfg
    if cfg.family == "tma":
        _launch_tma(cfg, x, w, x_scale, w_scale, bias, out, group_size, weight_block, use_pdl)
        return
    gemv = cfg.family == "gemv"
    part = counters = None
    if plan.split > 1:
        m, n = out.shape
        part = x.new_empty((plan.split, m, n), dtype=torch.float32)
        counters = counters_for(x.device)
    b = out if bias is None else bias
    key = None
    if index >= 0:
        ptrs = [x.data_ptr(), w.data_ptr(), out.data_ptr(), x_scale.data_ptr(), w_scale.data_ptr(), b.data_ptr()]
        if not gemv:
            ptrs += [(out if part is None else part).data_ptr(), (out if counters is None else counters).data_ptr()]
        if not functools.reduce(int.__or__, ptrs) & 15:
            key = (plan, x.shape, w.shape[0], group_size, weight_block, x.stride(), w.stride(), out.stride(),
                   x_scale.stride(), w_scale.stride(), b.stride(0), x.dtype, w.dtype, out.dtype, b.dtype,
                   bias is None, use_pdl, index, x_quant)
            cache = _gemv_replays if gemv else _replays
            hit = cache.lookup(key)
            if hit is not None and index == _support.current_device():
                r = hit[0]
                r.run(r.g0, r.g1, r.g2, raw_stream(index), r.function, r.packed, None, None, None, *ptrs, *hit[1])
                return
    kernel, grid, args = kernel_args(plan, x, w, x_scale, w_scale, bias, out, part, counters, group_size,
                                     weight_block, use_pdl, x_quant)
    kernel_launcher = launcher_for(kernel)
    options = {"num_warps": cfg.warps, "num_stages": cfg.stages, "pdl": use_pdl, "device_index": max(index, 0)}
    kernel_launcher(grid, args, **options)
    if key is not None:
        (_gemv_replays if gemv else _replays).record(key, kernel_launcher, grid, args, **options)


def _launch_tma(cfg: BlockTileConfig, x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor,
                w_scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, group_size: int,
                weight_block: tuple[int, int], use_pdl: bool) -> None:
    """The TMA family: host-built tensor descriptors, launched through Triton's JIT (prefill sizes: the host cost is
    small against the kernel)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from . import block_gemm_kernels as K

    m, k = x.shape
    n = w.shape[0]
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.block_m, group_size])
    w_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [cfg.block_n, group_size])
    tiles = tiles_of(cfg, m, n)
    progs = min(tiles, cfg.persistent * sm_count(x.device)) if cfg.persistent else tiles
    b = out if bias is None else bias
    extra: dict[str, Any] = {"num_warps": cfg.warps, "num_stages": cfg.stages}
    if use_pdl:
        extra["launch_pdl"] = True
    K.block_gemm_tma_kernel[(progs,)](
        x_desc, w_desc, out, x_scale, w_scale, b, m, n, k, progs, out.stride(0), out.stride(1), x_scale.stride(0),
        x_scale.stride(1), w_scale.stride(0), w_scale.stride(1), b.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_K=group_size, WBN=weight_block[0], WBK=weight_block[1],
        GROUP_M=cfg.group_m, HAS_BIAS=bias is not None, USE_PDL=use_pdl, **extra)


def launch(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype, group_size: int = 128, config: str = "auto",
           out: torch.Tensor | None = None, weight_block: tuple[int, int] = WEIGHT_BLOCK) -> torch.Tensor:
    """:func:`block_gemm` without the input checks (the hot path of a provider that validated its inputs)."""
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = x.new_empty((m, n), dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return empty_k(out, bias)
    cfg = pick_config(config, m, n, k)
    if weight_block != WEIGHT_BLOCK:  # the table's configs fit 128x128 blocks
        cfg = fit_weight_block(cfg, config, weight_block)
    run_config(cfg, x, w, x_scale, w_scale, bias, out, group_size, weight_block)
    return out


def fused_launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype, group_size: int = 128, config: str = "auto",
                 weight_block: tuple[int, int] = WEIGHT_BLOCK) -> torch.Tensor | None:
    """``out [M, N]`` of the *unquantized* ``x [M, K]`` (bf16/fp16/fp32, any strides) quantized per token group of
    ``group_size`` to ``w``'s float8 type inside the GEMV's own launch: equal, bit for bit, to
    :func:`.group_quant_ops.quant_per_token_group` followed by :func:`launch` with the same config. ``None`` where
    no fused config serves ``M x N x K`` (:func:`.block_gemm_args.fused_config`): the caller quantizes, then
    launches. Unchecked operands (a provider that validated them)."""
    cfg = fused_config(config, x.shape[0], w.shape[0], x.shape[1])
    return None if cfg is None else fused_run(cfg, x, w, w_scale, bias, out_dtype, group_size, weight_block)


def fused_run(cfg: BlockTileConfig, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype, group_size: int = 128,
              weight_block: tuple[int, int] = WEIGHT_BLOCK) -> torch.Tensor:
    """:func:`fused_launch` with its ``gemv`` config already chosen (a caller that chose it once: a bound layer)."""
    out, done = new_output(x, w.shape[0], out_dtype, bias)
    if not done:
        run_config(cfg, x, w, w_scale, w_scale, bias, out, group_size, weight_block, x_quant=True)
    return out


def block_gemm(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16, *, group_size: int = 128,
               config: str = "auto", out: torch.Tensor | None = None,
               weight_block: tuple[int, int] = WEIGHT_BLOCK) -> torch.Tensor:
    """``out[M, N] = sum_g (x_q[:, g] @ w_q[:, g]ᵀ) · x_scale[:, g] · w_scale[n // 128, g] (+ bias)`` in fp32, cast
    to ``out_dtype`` (module docstring: operands and layouts). ``config``: ``auto`` (the M-bucket table) or a name of
    :data:`.block_gemm_configs.CONFIGS`. ``out``: an ``[M, N]`` tensor of ``out_dtype`` to write (any strides)."""
    check_inputs(x_q, w_q, x_scale, w_scale, bias, out_dtype, group_size, weight_block)
    if out is not None and (tuple(out.shape) != (x_q.shape[0], w_q.shape[0]) or out.dtype != out_dtype
                            or out.device != x_q.device):
        raise InvalidInputError(f"out must be {out_dtype} [{x_q.shape[0]}, {w_q.shape[0]}] on {x_q.device}, got "
                                f"{out.dtype} {list(out.shape)} on {out.device}")
    if config != "auto" and config not in CONFIGS:
        raise InvalidInputError(f"unknown block GEMM config {config!r}")
    return launch(x_q, w_q, x_scale, w_scale, bias, out_dtype, group_size, config, out, weight_block)


# ---------------------------------------------------------------------------------------------- the torch op
def _op_launch(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype, group_size: int, config: str) -> torch.Tensor:
    return launch(x, w, x_scale, w_scale, bias, out_dtype, group_size, config)


def _fake(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
          out_dtype: torch.dtype, group_size: int, config: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


def _op_fused(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype, group_size: int, config: str) -> torch.Tensor:
    cfg = fused_config(config, x.shape[0], w.shape[0], x.shape[1], any_m=True)
    return fused_run(cfg, x, w, w_scale, bias, out_dtype, group_size)


def _fake_fused(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype, group_size: int, config: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


def _dispatch_keys() -> tuple[str, ...]:
    return ("CUDA", "CPU") if _support.interpreting() else ("CUDA",)


def _specs() -> dict[str, Any]:
    """``triton_block_gemm`` as a ``triton_op`` (torch.compile launches the pointer kernels itself, see
    :mod:`.block_gemm_traced`) beside the opaque ``triton_block_gemm_tma`` its traced body calls for the TMA configs.
    Under Triton's interpreter both are plain opaque ops: Inductor cannot launch interpreted kernels."""
    schemas = {name: f"{name}({OP_SCHEMA_ARGS}) -> Tensor" for name in (OP_BASENAME, TMA_OP_BASENAME)}
    if _support.interpreting():
        specs: dict[str, Any] = {name: (schema, _op_launch, _fake) for name, schema in schemas.items()}
        specs[QUANT_OP_BASENAME] = (f"{QUANT_OP_BASENAME}({QUANT_OP_SCHEMA_ARGS}) -> Tensor", _op_fused, _fake_fused)
        return specs
    from . import block_gemm_traced

    return {OP_BASENAME: TritonOpSpec(block_gemm_traced.triton_block_gemm, _op_launch),
            TMA_OP_BASENAME: (schemas[TMA_OP_BASENAME], _op_launch, _fake),
            QUANT_OP_BASENAME: TritonOpSpec(block_gemm_traced.triton_block_gemm_quant, _op_fused)}


_OPS = LazyOps(_specs, _dispatch_keys)


def load_op() -> Any:
    """Define the ops now (load time, never inside ``torch.compile`` tracing) and return ``triton_block_gemm``'s
    OpOverload."""
    _OPS.preload()
    return _OPS.op(OP_BASENAME)


def load_fused_op() -> Any:
    """Define the ops now (load time) and return the fused GEMV's OpOverload (``fp8_backends::triton_block_gemm_quant``:
    ``(x, w, w_scale, bias, out_dtype, group_size, config) -> out``, the unquantized ``x`` quantized per group in the
    launch, :func:`fused_launch`'s config at any M)."""
    _OPS.preload()
    return _OPS.op(QUANT_OP_BASENAME)


def triton_block_gemm(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype, group_size: int = 128,
                      config: str = "auto") -> torch.Tensor:
    """The custom op (``fp8_backends::triton_block_gemm``): :func:`launch` for plain eager calls, the traced body
    under ``torch.compile``. Inputs are assumed validated (:func:`check_inputs`)."""
    return _OPS.call(OP_BASENAME)(x, w, x_scale, w_scale, bias, out_dtype, group_size, config)


__all__ = [
    "COUNTER_SLOTS", "Plan", "block_gemm", "check_inputs", "counters_for", "fused_launch", "fused_run", "kernel_args",
    "launch", "load_fused_op", "load_op",
    "pick_config", "plan_launch", "prepare_weight_scale", "reset_buffers", "row_align", "run_config", "sm_count",
    "tma_ok", "triton_block_gemm",
]
