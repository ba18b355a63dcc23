"""What one launch of the block-scaled Triton GEMM is, shared by the eager launcher (:mod:`.block_gemm_ops`) and the op
body ``torch.compile`` traces (:mod:`.block_gemm_traced`): the config picked for ``M x N x K`` (a TMA config becomes its
pointer twin where TMA cannot address the operands), the K split, and the kernel with its grid and every argument.
Pure host arithmetic on shapes and strides (no launch, no device sync); the kernels' module (and triton) is imported
when a kernel is first asked for. This module imports torch."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, NamedTuple

import torch

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.types import Fp8Dtype

from ._support import GRID_Y_MAX, sm_count
from .block_gemm_configs import (
    CONFIGS,
    BlockTileConfig,
    active_table,
    auto_split,
    fused_pick,
    fused_shape_config,
)

logger = logging.getLogger("fp8_backends")

#: arrival counters per (device, stream): at most this many output tiles in one split-K launch
COUNTER_SLOTS = 16384
#: the opaque op of the TMA configs (defined beside ``triton_block_gemm`` by :mod:`.block_gemm_ops`)
TMA_OP_BASENAME = "triton_block_gemm_tma"
#: the fused GEMV's op (the activation's group quantization inside the launch), defined beside it
QUANT_OP_BASENAME = "triton_block_gemm_quant"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pick_config(config: str, m: int, n: int, k: int) -> BlockTileConfig:
    """The :class:`BlockTileConfig` for ``config`` (a name, or ``auto``: the active table's pick for M x N x K)."""
    try:
        return CONFIGS[active_table().pick(m, n, k) if config == "auto" else config]
    except KeyError:
        raise InvalidInputError(f"unknown block GEMM config {config!r}") from None


#: what ``auto`` runs where its pick's tiles do not fit the weight block (a swap-AB tile taller than the block's N):
#: tiled 128x64, whose weight scales are a vector over its columns for any power-of-two block
SMALL_BLOCK_CONFIG = "mm_n128_m64_s4_w4_g8_sk0"


def fit_weight_block(cfg: BlockTileConfig, config: str, weight_block: tuple[int, int]) -> BlockTileConfig:
    """``cfg`` where its tiles serve ``weight_block``; else, for ``auto``, :data:`SMALL_BLOCK_CONFIG`, and for a named
    config the library error. The swap-AB and GEMV kernels read one weight scale per K step, so their ``block_n``
    rows must lie in one block (``BN % block_n == 0``); the tiled kernels read a vector where a tile spans blocks."""
    if cfg.family not in ("swap", "gemv") or not weight_block[0] % cfg.block_n:
        return cfg
    if config != "auto":
        raise InvalidInputError(f"config {cfg.name}: its {cfg.block_n}-row tiles do not fit {weight_block[0]}x"
                                f"{weight_block[1]} weight blocks (a {cfg.family} tile reads one weight scale per K "
                                "step); name a tiled (mm) config or use config=auto")
    return CONFIGS[SMALL_BLOCK_CONFIG]


def fused_config(config: str, m: int, n: int, k: int, any_m: bool = False) -> BlockTileConfig | None:
    """The ``gemv`` config of a fused launch (the activation quantized inside it) at ``M x N x K``: ``config`` where it
    names a ``gemv`` config (up to its ``max_m``), for ``auto`` the fused pick
    (:func:`.block_gemm_configs.fused_pick`); ``None`` where no fused launch serves that M (the caller quantizes,
    then launches). ``any_m``: whatever M (the traced op, whose caller chose the M it fuses): a ``gemv`` config as
    named, any other name (``auto``) the fused config of the shape (:func:`.block_gemm_configs.fused_shape_config`)."""
    cfg = CONFIGS.get(config)
    if cfg is not None and cfg.family == "gemv":
        return cfg if any_m or m <= (cfg.max_m or m) else None
    if any_m:
        return CONFIGS[fused_shape_config(n, k)]
    name = fused_pick(m, n, k) if config == "auto" else None
    return None if name is None else CONFIGS[name]


class Plan(NamedTuple):
    """What a launch runs: the config (a TMA config may become its pointer twin), the K split and the activation
    groups each split covers."""

    cfg: BlockTileConfig
    split: int
    groups_per_split: int


def tiles_of(cfg: BlockTileConfig, m: int, n: int) -> int:
    return cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)


def plan_launch(cfg: BlockTileConfig, m: int, n: int, k: int, group_size: int, sms: int) -> Plan:
    """The split-K of ``cfg`` on ``M x N x K`` (``split_k = 0``: :func:`.block_gemm_configs.auto_split`)."""
    groups = cdiv(k, group_size)
    if cfg.family not in ("swap", "mm") or groups == 0:
        return Plan(cfg, 1, groups)
    tiles = tiles_of(cfg, m, n)
    split = cfg.split_k if cfg.split_k else auto_split(tiles, groups, sms)
    split = max(1, min(split, groups))
    if split > 1 and tiles > COUNTER_SLOTS:
        split = 1
    per = cdiv(groups, split)
    return Plan(cfg, cdiv(groups, per), per)


def row_align(*values: int) -> int:
    """The largest power of two (at most 16) dividing every value (K and the row strides, in elements = bytes for
    float8): what the kernels may assume for vector loads."""
    align = 16
    for s in values:
        while align > 1 and s % align:
            align //= 2
    return align


def tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA can address both operands: 16-byte aligned bases and row strides, unit column strides."""
    return (x.stride(1) == 1 and w.stride(1) == 1 and not (x.stride(0) % 16 or w.stride(0) % 16)
            and not (x.data_ptr() % 16 or w.data_ptr() % 16))


@functools.lru_cache(maxsize=64)
def pointer_twin(cfg: BlockTileConfig) -> BlockTileConfig:
    """The ``mm`` config with ``cfg``'s tiles (for operands TMA cannot address); logged once per config (INFO)."""
    twin = dataclasses.replace(cfg, family="mm", persistent=0, split_k=1)
    logger.info("triton block GEMM: TMA cannot address an operand (16-byte alignment), so %s runs as %s (same "
                "tiles, pointer loads); logged once per config", cfg.name, twin.name)
    return twin


#: the fewest weight rows a fused GEMV program may stream for its launch to cost what the plain GEMV's does: every
#: program quantizes the activation row it reads, once per ``block_n`` weight rows
FUSED_AS_GEMM_MIN_ROWS = 8


def fused_is_gemm_launch(config: str, n: int, k: int) -> bool:
    """Whether the fused GEMV of an ``N x K`` weight at one token is the launch the plain GEMM runs there (the same
    ``gemv`` config) with at least :data:`FUSED_AS_GEMM_MIN_ROWS` rows a program: then it takes the GEMV's time and
    saves the quantization's launch, inside a CUDA graph too."""
    fused = fused_config(config, 1, n, k, any_m=True)
    return (fused is not None and fused.block_n >= FUSED_AS_GEMM_MIN_ROWS
            and fused == pick_config(config, 1, n, k))


#: threads of a warp: a prefetching program issues about one bulk prefetch per thread
_WARP = 32


def prefetch_chunks(cfg: BlockTileConfig, use_pdl: bool, stride_wk: int) -> int:
    """The kernels' ``PREFETCH``: bulk L2 prefetches per weight row before the PDL wait (``0``: none). Only for a
    ``prefetch`` config launched with PDL (SM >= 9.0, where the instruction exists; never under Triton's interpreter)
    on a weight whose rows are contiguous; about one prefetch per thread of the program."""
    if not (cfg.prefetch and use_pdl and stride_wk == 1):
        return 0
    return max(1, _WARP * cfg.warps // cfg.block_n)


@functools.cache
def kernel_of(family: str) -> Any:
    from . import block_gemm_kernels as K

    return {"gemv": K.block_gemv_kernel, "swap": K.block_gemm_swap_kernel, "mm": K.block_gemm_mm_kernel}[family]


def kernel_args(plan: Plan, x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out: torch.Tensor, part: torch.Tensor | None, counters: torch.Tensor | None,
                group_size: int, weight_block: tuple[int, int], use_pdl: bool, x_quant: bool = False
                ) -> tuple[Any, tuple[int, ...], tuple[Any, ...]]:
    """``(kernel, grid, args)`` of a pointer-kernel launch (``gemv``/``swap``/``mm``): every kernel parameter in
    declaration order, constexprs included, pointers first (``x, w, out, x_scale, w_scale, bias`` and, for the
    tensor-core kernels, ``part, counters``; a replay passes those itself). Sizes may be symbolic under tracing.
    ``x_quant`` (``gemv`` only): ``x`` is the unquantized activation, which the kernel quantizes per group to ``w``'s
    float8 type (``x_scale`` is not read: any fp32 tensor fills its slot)."""
    cfg = plan.cfg
    m, k = x.shape
    n = w.shape[0]
    wbn, wbk = weight_block
    b = out if bias is None else bias
    strides = (x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
               x_scale.stride(0), x_scale.stride(1), w_scale.stride(0), w_scale.stride(1), b.stride(0))
    align = row_align(k, x.stride(0), w.stride(0))
    pf = prefetch_chunks(cfg, use_pdl, w.stride(1))
    if cfg.family == "gemv":
        step = cfg.groups * group_size
        if m > GRID_Y_MAX:
            raise InvalidInputError(f"config {cfg.name} cannot launch {m} tokens (CUDA grid limit {GRID_Y_MAX})")
        return (kernel_of("gemv"), (cdiv(n, cfg.block_n), m),
                (x, w, out, x_scale, w_scale, b, m, n, k, *strides, cfg.block_n, cfg.groups, group_size, wbn, wbk,
                 bias is not None, k % step == 0, align, use_pdl, x_quant, Fp8Dtype.of(w.dtype).max, pf))
    if x_quant:
        raise InvalidInputError(f"config {cfg.name}: only the gemv configs quantize the activation themselves")
    part_t = out if part is None else part
    cnt_t = out if counters is None else counters
    head = (x, w, out, x_scale, w_scale, b, part_t, cnt_t, m, n, k, plan.groups_per_split, *strides)
    even = k % group_size == 0
    if cfg.family == "swap":
        m_tiles = cdiv(m, cfg.block_m)
        if m_tiles > GRID_Y_MAX:
            raise InvalidInputError(f"config {cfg.name} cannot launch {m_tiles} token blocks (CUDA grid limit "
                                    f"{GRID_Y_MAX}); use config=auto or an mm config for this M")
        return (kernel_of("swap"), (cdiv(n, cfg.block_n), m_tiles, plan.split),
                (*head, cfg.block_m, cfg.block_n, group_size, wbn, wbk, plan.split, bias is not None, even, align,
                 use_pdl, pf))
    return (kernel_of("mm"), (tiles_of(cfg, m, n), plan.split),
            (*head, cfg.block_m, cfg.block_n, group_size, wbn, wbk, cfg.group_m, plan.split, bias is not None, even,
             align, use_pdl, pf))


def empty_k(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """K = 0: the product is zero; the output is the bias (or zeros)."""
    if bias is None:
        return out.zero_()
    return out.copy_(bias.to(out.dtype).expand_as(out))


def new_output(x: torch.Tensor, n: int, out_dtype: torch.dtype, bias: torch.Tensor | None
               ) -> tuple[torch.Tensor, bool]:
    """``(out [M, N], done)``: a new output for ``x [M, K]``, and whether it is already the answer (no tokens or no
    output columns: empty; K = 0: the bias or zeros), so that no kernel is launched."""
    m, k = x.shape
    out = x.new_empty((m, n), dtype=out_dtype)
    if m == 0 or n == 0:
        return out, True
    if k == 0:
        return empty_k(out, bias), True
    return out, False


__all__ = [
    "COUNTER_SLOTS", "FUSED_AS_GEMM_MIN_ROWS", "QUANT_OP_BASENAME", "SMALL_BLOCK_CONFIG", "TMA_OP_BASENAME", "Plan",
    "cdiv", "empty_k", "fit_weight_block", "fused_config", "fused_is_gemm_launch", "kernel_args", "kernel_of",
    "new_output", "pick_config", "plan_launch", "pointer_twin", "prefetch_chunks", "row_align", "sm_count",
    "tiles_of",
    "tma_ok",
]
