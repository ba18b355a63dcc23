"""The torch side of the Triton GEMM: the ``fp8_backends::triton_gemm`` op and its launcher.

The op is defined on first use (:func:`fp8_backends.core.oplib.define_ops`) as a ``torch.library.triton_op``: under
``torch.compile`` its body (:func:`.traced_ops.triton_gemm`) decomposes into the kernel launch, which Inductor
makes from its generated code (the traced body picks the tile config when it is traced: a graph with a dynamic M
is guarded per M bucket). Plain eager calls run :func:`launch` instead, which picks the tile config (``auto``: the
M-bucket table) per call, allocates the output and launches the kernel on torch's current stream through
:class:`.launcher.KernelLauncher` (the compiled kernel, not Triton's Python launch path), with PDL where
:func:`._support.pdl_on` allows. No host-device synchronisation.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Any

from fp8_backends.core.oplib import LazyOps, TritonOpSpec, gemm_fake, gemm_schema

from . import _support
from .gemm_args import cdiv, kernel_of, pick_config, pointer_kernel_args
from .gemm_configs import TileConfig
from .launcher import ReplayCache, launcher_for, raw_stream

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("fp8_backends")

OP_BASENAME = "triton_gemm"
OP_NAME = f"fp8_backends::{OP_BASENAME}"
#: the persistent TMA configs as an opaque op (what the traced ``triton_gemm`` calls for them)
TMA_OP_BASENAME = "triton_gemm_tma"
#: the ops' option after the GEMM arguments (:func:`fp8_backends.core.oplib.gemm_schema`)
OP_OPTIONS = ("str config",)


#: run_config's replays of the pointer kernels; the 12 arguments each call passes itself: x, w, out, x_scale,
#: w_scale, bias, M, N, K and the three row strides
_replays = ReplayCache(head=12)


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: str,
) -> torch.Tensor:
    """``out[M, N] = x_scale · w_scale · (x @ wᵀ) (+ bias)``; inputs as :func:`triton_gemm` states (an ``x`` whose
    columns are strided, which the kernels cannot address, is copied row-major first)."""
    m, k = x.shape
    if k > 1 and x.stride(1) != 1:
        x = x.contiguous()
    n = w.shape[0]
    out = x.new_empty((m, n), dtype=out_dtype)  # x's device; fewer arguments to parse than torch.empty
    if m == 0:
        return out
    run_config(pick_config(config, m, n, k), x, w, x_scale, w_scale, bias, out)
    return out


def run_config(
    cfg: TileConfig,
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    pdl: bool | None = None,
    x_quant: int = 0,
) -> None:
    """Launch ``cfg``'s kernel writing ``out [M, N]`` (M >= 1). ``pdl``: force PDL on or off (benchmarks);
    ``None`` follows :func:`._support.pdl_on`. ``x_quant``: the kernel quantizes an unquantized ``x`` itself
    (:data:`.gemm_kernels.QUANT_STATIC` and siblings; ``swap`` and ``gemv`` configs only; see :func:`fused_launch`).

    The pointer kernels' hot path: a call whose key (config, M, N, K, row strides, dtypes, scale kinds, bias,
    PDL, device; every data pointer 16-byte aligned) was launched before replays that launch's compiled
    kernel and grid with this call's pointers (:class:`.launcher.Replay`), on the current stream, when the
    device is the current one and no Triton launch hook is set. Every other call takes the general path
    below, which records the replay."""
    index = x.get_device()
    use_pdl = _support.pdl_on(index) if pdl is None else pdl
    key = None
    if cfg.family != "tma" and index >= 0:
        b = out if bias is None else bias
        px, pw, po, psx, psw, pb = (x.data_ptr(), w.data_ptr(), out.data_ptr(), x_scale.data_ptr(),
                                    w_scale.data_ptr(), b.data_ptr())
        if not (px | pw | po | psx | psw | pb) & 15:
            m, k = x.shape
            n = w.shape[0]
            sx, sw, so = x.stride(0), w.stride(0), out.stride(0)
            key = (cfg, m, n, k, sx, sw, so, x.dtype, w.dtype, out.dtype, b.dtype, x_scale.numel() > 1,
                   w_scale.numel() > 1, bias is None, use_pdl, index, x_quant)
            hit = _replays.lookup(key)
            if hit is not None and index == _support.current_device():
                r, tail = hit[0], hit[1]
                r.run(r.g0, r.g1, r.g2, raw_stream(index), r.function, r.packed, None, None, None,
                      px, pw, po, psx, psw, pb, m, n, k, sx, sw, so, *tail)
                return
    if cfg.family == "tma" and (x.data_ptr() % 16 or w.data_ptr() % 16 or x.stride(0) % 16 or w.stride(0) % 16):
        # TMA needs 16-byte aligned bases and rows (a view at an odd offset, K not a multiple of 16): the same tiles
        # without TMA. Only auto's picks get here (a forced TMA config refuses such operands:
        # TritonGemmBackend._forced_tma_gemm)
        cfg = _pointer_tiles(cfg)
    _support.on_device(index, _launch_general, cfg, x, w, x_scale, w_scale, bias, out, use_pdl, index, key, x_quant)


def _launch_general(cfg: TileConfig, x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, out: torch.Tensor, use_pdl: bool, index: int,
                    key: tuple | None, x_quant: int = 0) -> None:
    """run_config's general path (on x's device): the TMA family through Triton's JIT, the pointer kernels
    through their KernelLauncher, recording the replay under ``key`` (``None``: not replayable)."""
    if cfg.family == "tma":
        _launch_tma(cfg, x, w, x_scale, w_scale, bias, out, use_pdl)
        return
    grid, args = pointer_kernel_args(cfg, x, w, x_scale, w_scale, bias, out, use_pdl, x_quant)
    kernel_launcher = launcher_for(kernel_of(cfg.family))
    options = {"num_warps": cfg.warps, "num_stages": cfg.stages, "pdl": use_pdl, "device_index": max(index, 0)}
    kernel_launcher(grid, args, **options)
    if key is not None:
        _replays.record(key, kernel_launcher, grid, args, **options)


#: the largest M :func:`fused_launch` serves: every program of a dynamic per-tensor launch reads all of ``x`` for
#: its amax (M x K from L2, a few hundred KB at decode sizes), which stops paying off as M grows
FUSED_MAX_M = 16

#: the ``X_QUANT`` code of each activation mode (:mod:`.gemm_kernels`' ``QUANT_*``)
_X_QUANT = {"per_tensor_static": 1, "per_tensor_dynamic": 2, "per_token": 3}


def fused_launch(x: torch.Tensor, w: torch.Tensor, input_scale: torch.Tensor | None, w_scale: torch.Tensor,
                 bias: torch.Tensor | None, out_dtype: torch.dtype, config: str, mode: str) -> torch.Tensor | None:
    """``out[M, N]`` of the unquantized ``x [M, K]`` (bf16/fp16/fp32, unit column stride) quantized in ``mode``
    (an :class:`~fp8_backends.core.types.ActScale` value; ``input_scale``: the static scale, fp32 ``[1]``) to ``w``'s
    float8 type inside the GEMM kernel: the unfused path's result bit for bit, one launch instead of two or three.
    ``None`` (nothing launched) where the config picked for this M is not a ``swap`` or ``gemv`` kernel, M = 0 or
    M > :data:`FUSED_MAX_M`:
    the caller quantizes and calls :func:`triton_gemm` then. Eager calls only (the compiled path keeps the
    quantization as torch ops that Inductor fuses into the producer)."""
    m, k = x.shape
    if not 0 < m <= FUSED_MAX_M or x.stride(1) != 1:
        return None
    n = w.shape[0]
    cfg = pick_config(config, m, n, k)
    if cfg.family not in ("swap", "gemv"):
        return None
    x_quant = _X_QUANT[mode]
    out = x.new_empty((m, n), dtype=out_dtype)
    # dynamic modes: the kernel computes the scale and never reads x_scale; any fp32 pointer fills the slot
    run_config(cfg, x, w, input_scale if x_quant == 1 else w_scale, w_scale, bias, out, x_quant=x_quant)
    return out


def _launch_tma(cfg: TileConfig, x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out: torch.Tensor, use_pdl: bool) -> None:
    """The TMA family: host-built tensor descriptors, launched through Triton's JIT (prefill sizes: the
    host cost is small against the kernel)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from . import gemm_kernels as K

    m, k = x.shape
    n = w.shape[0]
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [cfg.block_n, cfg.block_k])
    flags = (x_scale.numel() > 1, w_scale.numel() > 1, bias is not None)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    progs = min(tiles, cfg.persistent * _support.sm_count(x.device)) if cfg.persistent else tiles
    extra: dict[str, Any] = {"num_warps": cfg.warps, "num_stages": cfg.stages}
    if use_pdl:
        extra["launch_pdl"] = True
    K.fp8_gemm_tma_kernel[(progs,)](
        x_desc, w_desc, out, x_scale, w_scale, out if bias is None else bias, m, n, k, out.stride(0), progs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        X_PER_TOKEN=flags[0], W_PER_CHANNEL=flags[1], HAS_BIAS=flags[2], USE_PDL=use_pdl, **extra)


@functools.lru_cache(maxsize=64)
def _pointer_tiles(cfg: TileConfig) -> TileConfig:
    """The ``mm`` config with ``cfg``'s tiles (for operands TMA cannot address); logged once per config (INFO)."""
    twin = dataclasses.replace(cfg, family="mm", persistent=0)
    logger.info("triton GEMM: an operand's base or rows are not 16-byte aligned, so TMA config %s runs as %s (same "
                "tiles, pointer loads); logged once per config", cfg.name, twin.name)
    return twin


def _dispatch_keys() -> tuple[str, ...]:
    return ("CUDA", "CPU") if _support.interpreting() else ("CUDA",)


def _specs() -> dict[str, Any]:
    """``triton_gemm`` as a ``triton_op`` (torch.compile launches its kernels itself; see :mod:`.traced_ops`),
    beside the opaque ``triton_gemm_tma`` its traced body calls for the TMA configs. Under Triton's interpreter
    (CPU tests) both are plain opaque ops: Inductor cannot launch interpreted kernels."""
    if _support.interpreting():
        return {name: (gemm_schema(name, *OP_OPTIONS), launch, gemm_fake) for name in (OP_BASENAME, TMA_OP_BASENAME)}
    from . import traced_ops

    return {OP_BASENAME: TritonOpSpec(traced_ops.triton_gemm, launch),
            TMA_OP_BASENAME: (gemm_schema(TMA_OP_BASENAME, *OP_OPTIONS), launch, gemm_fake)}


_OPS = LazyOps(_specs, _dispatch_keys)


def load_op() -> Any:
    """The op's OpOverload (what the provider's ``load_op`` returns), defined now with ``triton_gemm_tma`` (which its
    traced body calls) and their hot-path callables (:meth:`fp8_backends.core.oplib.LazyOps.preload`: load time, never
    inside ``torch.compile`` tracing)."""
    _OPS.preload()
    return _OPS.op(OP_BASENAME)


def triton_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: str = "auto",
) -> torch.Tensor:
    """The custom op. ``x: [M, K]`` and ``w: [N, K]`` float8 (same type), row-major with unit column
    stride; ``x_scale`` fp32 one value or ``[M, 1]`` contiguous; ``w_scale`` fp32 ``[1]`` or ``[N]``
    contiguous; ``bias`` ``[N]`` contiguous in ``out_dtype`` or ``None``. Inputs are assumed validated."""
    return _OPS.call(OP_BASENAME)(x, w, x_scale, w_scale, bias, out_dtype, config)


__all__ = [
    "OP_NAME", "fused_launch", "launch", "load_op", "run_config", "triton_gemm",
]
