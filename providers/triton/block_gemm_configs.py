"""Tile configurations of the block-scaled Triton FP8 GEMM and its M-bucket dispatch table (data: no torch/triton).

Four kernel families (:mod:`.block_gemm_kernels`):

- ``gemv``: CUDA-core GEMV, ``block_n`` weight rows per program and ``groups`` activation groups per K step
  (``groups · G`` columns: 1024 at G = 128 with ``groups = 8``); one program column per token, so the weight is
  streamed once per token: M = 1.
- ``swap``: swap-AB tensor-core GEMM for small M: ``outᵀ[BN, BM] = w[BN, K] · x[BM, K]ᵀ``, the weight rows on the
  MMA's 64-row side (wgmma on SM90) and ``block_m`` (16-64) tokens on its narrow side; one K step per activation
  group; optional split-K.
- ``mm``: the classic tiled GEMM ``out[BM, BN] = x[BM, K] · w[BN, K]ᵀ`` with grouped tile order; optional split-K.
- ``tma``: the tiled GEMM with its operand tiles through TMA descriptors (SM >= 9.0, 16-byte aligned rows),
  optionally persistent (``persistent`` programs per SM walking the tiles).

Every tensor-core family takes one activation group (``G`` = 128, or 64) per K step: the MMA's fp32 result is
scaled by that group's activation and weight scales before it joins the accumulator (the promotion), so a K step
never spans two scales. That also fixes what a tile costs in registers: the accumulator plus one step's MMA result,
two ``BM x BN`` fp32 blocks; 128x128 tiles on 8 warps (two warpgroups of 64 rows) hold 64 + 64 registers per thread,
which is why no shipped config has a 128x256 tile on 8 warps (it spills on sm_90a; the same tile of the per-tensor
kernel, whose MMA accumulates in place, holds half as many).

The promotion waits for its MMA (``wgmma.wait_group 0`` after every K step in the sm_90a code), so the tensor cores
idle while a warpgroup scales; another warpgroup's MMAs can fill that time only if it is not in the same phase. The
two warpgroups of an 8-warp program are not: Triton's pipeline puts a CTA-wide barrier in every K step. Two or three
independent 4-warp programs per SM (64x128 tiles: ``tma_n128_m64_s4_w4_g8_p2``, ``mm_n128_m64_s3_w4_g8_sk0``) are,
which is why the table's large-M picks are those rather than the 128x128 tiles of the per-tensor kernel (both
measured by ``bench/block_gemm.py --sweep``). ``python -m bench.block_kernels_sm90`` prints each config's registers
and shared memory on sm_90a.

``split_k``: ``1`` none; ``0`` (``sk0``) chosen per launch by :func:`auto_split` from the number of output tiles,
the SM count and the K groups (tall-skinny problems such as N = 576 or 1536 with K = 7168, where N / BN tiles do
not fill 132 SMs); ``n > 1`` fixed.

A config's name spells its family and tile, e.g. ``swap_n64_m16_s8_w4_sk0``. The dispatch table maps ``(M, N, K)``
to a config name; :func:`use_table` replaces it (``bench/block_gemm.py --sweep`` writes a measured one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fp8_backends.core.bucket_tables import BucketTable

FAMILIES = ("gemv", "swap", "mm", "tma")
#: the weight block the configs are laid out for (``(128, 128)``: DeepSeek-V3, Qwen3-FP8, compressed-tensors)
WEIGHT_BLOCK = (128, 128)
#: split-K: at most this many splits, each covering at least MIN_GROUPS_PER_SPLIT activation groups
MAX_SPLIT_K = 16
MIN_GROUPS_PER_SPLIT = 4


def _pow2(v: int) -> bool:
    return v >= 1 and not v & (v - 1)


@dataclass(frozen=True)
class BlockTileConfig:
    """One launch configuration of the block-scaled GEMM.

    - ``family``: ``gemv``, ``swap``, ``mm`` or ``tma`` (module docstring).
    - ``block_m`` / ``block_n``: the tile over tokens (M) and output channels (N); ``gemv`` has ``block_m = 1``.
    - ``groups``: ``gemv`` only, activation groups per K step.
    - ``stages``: software-pipelining depth (``gemv``: 1, its K loop is not pipelined); ``warps``: ``num_warps``.
    - ``group_m``: ``mm``/``tma`` grouped tile order.
    - ``split_k``: ``swap``/``mm``: 1, a fixed count, or 0 (per launch, :func:`auto_split`).
    - ``persistent``: ``tma`` only, programs per SM walking the tiles (0: one program per tile).
    - ``prefetch``: ``gemv``/``swap``/``mm``: each program asks L2 for its whole share of the weight (bulk
      prefetches, no registers held) before it waits on the launch it depends on (PDL), so the weight streams while
      the kernel before still runs; only with PDL (SM >= 9.0) and unit K stride, else the plain kernel. Name suffix
      ``_pf``.
    """

    family: str
    block_m: int
    block_n: int
    stages: int
    warps: int
    groups: int = 1
    group_m: int = 8
    split_k: int = 1
    persistent: int = 0
    prefetch: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for what in ("block_m", "block_n", "warps", "groups"):
            if not _pow2(getattr(self, what)):
                raise ValueError(f"{self.name}: {what} must be a power of two, got {getattr(self, what)}")
        wbn = WEIGHT_BLOCK[0]
        if self.family == "gemv":
            if self.block_m != 1 or self.block_n > wbn:
                raise ValueError(f"{self.name}: gemv takes block_m = 1 and block_n <= {wbn}")
            if self.stages != 1:
                raise ValueError(f"{self.name}: gemv takes stages = 1 (its K loop is not pipelined)")
        elif self.block_m < 16 or self.block_n < 16:
            raise ValueError(f"{self.name}: tensor-core tiles need block_m, block_n >= 16")
        if self.family == "swap" and self.block_n > wbn:
            raise ValueError(f"{self.name}: swap tiles stay within one weight block (block_n <= {wbn})")
        if self.split_k < 0 or self.split_k > MAX_SPLIT_K:
            raise ValueError(f"{self.name}: split_k must be 0 (auto) .. {MAX_SPLIT_K}")
        if self.split_k != 1 and self.family not in ("swap", "mm"):
            raise ValueError(f"{self.name}: only swap and mm configs split K")
        if self.persistent and self.family != "tma":
            raise ValueError(f"{self.name}: only tma configs can be persistent")
        if self.prefetch and self.family == "tma":
            raise ValueError(f"{self.name}: tma configs do not prefetch (their loads are TMA's)")

    @property
    def name(self) -> str:
        pf = "_pf" if self.prefetch else ""
        if self.family == "gemv":
            return f"gemv_n{self.block_n}_g{self.groups}_w{self.warps}{pf}"
        g = f"_g{self.group_m}" if self.family in ("mm", "tma") else ""
        sk = f"_sk{self.split_k}" if self.family in ("swap", "mm") else ""
        p = f"_p{self.persistent}" if self.persistent else ""
        return f"{self.family}_n{self.block_n}_m{self.block_m}_s{self.stages}_w{self.warps}{g}{sk}{p}{pf}"

    @classmethod
    def from_name(cls, name: str) -> BlockTileConfig:
        """The config a name spells (the inverse of :attr:`name`), e.g. ``mm_n64_m64_s4_w4_g8_sk7``: for configs that
        are not shipped (``bench/block_gemm.py --configs``). Raises ``ValueError`` on a name that spells none."""
        gemv = re.fullmatch(r"gemv_n(\d+)_g(\d+)_w(\d+)(_pf)?", name)
        if gemv:
            n, groups, warps = map(int, gemv.groups()[:3])
            return cls("gemv", 1, n, 1, warps, groups=groups, prefetch=gemv.group(4) is not None)
        tiled = re.fullmatch(r"(swap|mm|tma)_n(\d+)_m(\d+)_s(\d+)_w(\d+)(?:_g(\d+))?(?:_sk(\d+))?(?:_p(\d+))?(_pf)?",
                             name)
        if tiled is None:
            raise ValueError(f"{name!r} spells no block GEMM config (e.g. mm_n128_m64_s4_w4_g8_sk0)")
        family, n, m, stages, warps, group_m, split_k, persistent, pf = tiled.groups()
        cfg = cls(family, int(m), int(n), int(stages), int(warps), group_m=int(group_m or 8),
                  split_k=int(split_k) if split_k is not None else 1, persistent=int(persistent or 0),
                  prefetch=pf is not None)
        if cfg.name != name:
            raise ValueError(f"{name!r} is not spelled as its config's name {cfg.name!r}")
        return cfg

    @property
    def max_m(self) -> int | None:
        """The largest M this config is meant for (``None``: any). Larger M still computes correctly."""
        return {"gemv": 4, "swap": 256}.get(self.family)


def auto_split(tiles: int, groups: int, sms: int) -> int:
    """Splits of K for a launch of ``tiles`` output tiles over ``groups`` activation groups on ``sms`` SMs: enough
    programs to give every SM one (a memory-bound small-M GEMM wants bytes in flight on every SM), each split keeping
    at least :data:`MIN_GROUPS_PER_SPLIT` groups, at most :data:`MAX_SPLIT_K`; rounded so that no split is empty."""
    if tiles >= sms or groups < 2 * MIN_GROUPS_PER_SPLIT:
        return 1
    split = min(-(-sms // tiles), groups // MIN_GROUPS_PER_SPLIT, MAX_SPLIT_K)
    if split <= 1:
        return 1
    per = -(-groups // split)
    return -(-groups // per)


C = BlockTileConfig
#: Every config the provider ships. Not measured yet: reasoned from the per-tensor kernels' H200 sweep
#: (../gemm_configs.py: GEMV with 2 rows x 1024 columns on 2 warps at M = 1, swap-AB with 64 weight rows and
#: 16-64 tokens at 4-8 stages for M <= 64, 128-row tiles on 8 warps above) with one K step per 128-column group
#: (half the per-tensor kernels' 256-column steps, hence more stages for the same bytes in flight).
CONFIG_LIST: tuple[BlockTileConfig, ...] = (
    C("gemv", 1, 2, 1, 2, groups=8, note="M = 1, N >= 2048: 2 rows x 1024 columns per step, 64 threads"),
    C("gemv", 1, 4, 1, 4, groups=4, note="M = 1, K <= 2048 (q_b 24576x1536, kv_b 32768x512)"),
    C("gemv", 1, 8, 1, 4, groups=8, note="M = 1, the activation quantized in the launch (fused), K > 2048: 8 rows "
      "per program, so each program's quantization of the row is spread over 8 weight rows"),
    C("gemv", 1, 16, 1, 2, groups=2, note="M = 1 fused, K <= 2048 (q_b 24576x1536, kv_b 32768x512)"),
    C("gemv", 1, 1, 1, 2, groups=32, note="M = 1, a narrow weight: one row x 4096 columns a step per program (kv_a "
      "576x7168: 3.77 µs against 5.4 for swap-AB)"),
    C("gemv", 1, 2, 1, 4, groups=16, note="M = 1, a narrow weight: 2 rows x 2048 columns a step (q_a 1536x7168: "
      "6.05 µs against 6.6 for gemv_n2_g8_w2)"),
    C("swap", 16, 64, 8, 4, split_k=0, note="M <= 16: 64 KB of weight in flight per program"),
    C("swap", 16, 64, 8, 4, split_k=0, prefetch=True, note="M <= 16 on a weight of a few MB (kv_a 576x7168): the "
      "weight asked of L2 before the PDL wait, 0.90x the plain twin's time at M = 1-16 on an H100, 0.95-1.34x "
      "(1.13x geomean) on the weights of 11 MB and more (bench/results/block_gemm/2026-12-06-h100-weight-prefetch/)"),
    C("swap", 16, 64, 6, 4, split_k=0, note="M <= 16, fewer stages (more programs per SM)"),
    C("swap", 16, 128, 4, 4, split_k=0, note="M <= 16, wide N"),
    C("swap", 32, 64, 6, 4, split_k=0, note="M 17-32"),
    C("swap", 64, 64, 5, 4, split_k=0, note="M 33-64"),
    C("swap", 64, 128, 4, 8, split_k=0, note="M 65-128, wide N"),
    C("mm", 64, 64, 5, 4, split_k=0, note="M ~64-128, narrow N (split K)"),
    C("mm", 64, 128, 4, 4, split_k=0, note="M ~128-256"),
    C("mm", 128, 128, 4, 8, split_k=0, note="M ~256-1024 (split K where tiles do not fill the SMs)"),
    C("mm", 128, 128, 3, 8, note="M >= 1024 without TMA (rows not 16-byte aligned)"),
    C("tma", 64, 128, 4, 4, persistent=2, note="M >= 1024: two 4-warp programs per SM (106 KB of shared memory "
      "each), whose promotions overlap the other's MMAs"),
    C("mm", 64, 128, 3, 4, split_k=0, note="M >= 1024 (and short K from M = 2): 4-warp programs of 72 KB of shared "
      "memory, two per SM (213 registers a thread with the scales loaded a step ahead); with those it ran 0.65-0.92x "
      "the persistent TMA kernel's time at M = 1024 / 4096 (bench/results/block_gemm/2026-12-04-h200-scales-ahead/)"),
    C("tma", 64, 128, 4, 4, persistent=1, note="M ~512-1024, narrow N"),
    C("tma", 128, 128, 4, 8, persistent=1, note="M >= 1024: one 8-warp program per SM"),
    C("tma", 128, 128, 4, 8, note="M >= 1024, one program per tile"),
    # narrow N (DeepSeek-V3 kv_a 576 / q_a 1536 x 7168): few output tiles, each K step a latency-bound promotion, so
    # smaller tiles and a fixed K split (bench/results/block_gemm/2026-12-03-h200-thin-n/)
    C("mm", 32, 64, 4, 4, split_k=7, note="narrow N, M 17-64: 32x64 tiles, K in 7"),
    C("swap", 64, 64, 5, 4, split_k=7, note="narrow N (576), M 65-256, K in 7: named by the table until the scales "
      "were loaded a step ahead, then 64x64 tiles with K in 4 ran faster there (a sweep candidate since)"),
    C("mm", 64, 64, 4, 4, split_k=2, note="narrow N, M 65-4096: 64x64 tiles, K in 2"),
    C("mm", 64, 64, 4, 4, split_k=4, note="narrow N: q_a 1536x7168 at M 33-64"),
    C("mm", 64, 64, 3, 4, split_k=6, note="narrow N: kv_a 576x7168 at M 65-256, 3 stages (four programs an SM) and K "
      "in 6: 10.34 / 10.50 µs in two runs against 11.9 for 4 stages and K in 4 "
      "(bench/results/block_gemm/2026-12-05-h200-deepseek-v3-kv-a-m256-splits/)"),
)
del C

CONFIGS: dict[str, BlockTileConfig] = {c.name: c for c in CONFIG_LIST}
CONFIG_NAMES: tuple[str, ...] = tuple(CONFIGS)


class BlockTable(BucketTable):
    """The block-scaled GEMM's M-bucket table (buckets name configs of :data:`CONFIGS`)."""

    FORMAT: ClassVar[str] = "fp8_backends.triton_block_table/1"

    @classmethod
    def known_names(cls) -> Sequence[str]:
        return CONFIG_NAMES


_GEMV = "gemv_n2_g8_w2"
_GEMV_SHORT_K = "gemv_n4_g4_w4"
_SWAP16 = "swap_n64_m16_s8_w4_sk0"
_SWAP32 = "swap_n64_m32_s6_w4_sk0"
_SWAP64 = "swap_n64_m64_s5_w4_sk0"
_MM64 = "mm_n128_m64_s4_w4_g8_sk0"
_TMA = "tma_n128_m64_s4_w4_g8_p2"


_MM64_SMALL_SK2 = "mm_n64_m64_s4_w4_g8_sk2"
_MM64_SMALL_SK4 = "mm_n64_m64_s4_w4_g8_sk4"
_MM_LARGE = "mm_n128_m64_s3_w4_g8_sk0"
#: the buckets of every shape the table does not list
_DEFAULT_BUCKETS: tuple[tuple[int | None, str], ...] = (
    (1, _GEMV), (16, _SWAP16), (32, _SWAP32), (64, _SWAP64), (512, _MM64), (None, _MM_LARGE))


#: one token on the narrow DeepSeek-V3 weights and Qwen3-8B's N = 4096 weights: GEMVs that stream more bytes per
#: program and step than the 2-row default, measured against it, the table's former picks and flashinfer
#: (bench/results/block_gemm/2026-12-05-h200-gemv-long-steps/): kv_a 576x7168 3.77 µs with one row x 4096 columns
#: (swap-AB 5.4, gemv_n2_g8_w2 5.7), q_a 1536x7168 6.05 with two rows x 2048 (6.6), o 4096x4096 / down 4096x12288
#: 7.45 / 17.5 with eight rows x 1024 (8.3 / 20.2; flashinfer 8.5 / 18.9)
_GEMV_ONE_ROW = "gemv_n1_g32_w2"
#: M 2-16 on kv_a 576x7168 (4 MB): the swap-AB default with the weight's L2 prefetch ahead of the PDL wait, 5.20 /
#: 5.61 µs at M = 4 / 16 against 5.79 / 6.14 without (an H100, interleaved:
#: bench/results/block_gemm/2026-12-06-h100-weight-prefetch/); on the weights of 11 MB and more the prefetch is slower
_SWAP16_PREFETCH = "swap_n64_m16_s8_w4_sk0_pf"
_GEMV_LONG_STEP = "gemv_n2_g16_w4"
_GEMV_EIGHT_ROWS = "gemv_n8_g8_w4"


def _narrow(n: int) -> tuple[tuple[int | None, str], ...]:
    """Buckets of a narrow-N shape (N <= 2048 with K = 7168: N / 64 tiles leave most SMs idle, and each program's
    K steps wait on their promotions): swap-AB with split K up to M = 32, then 64x64 tiles with K split in 2-7 (kv_a
    576x7168 also 32x64 tiles with K in 7 at M 33-64), then the 128x64 tiles with an automatic split
    (``bench/results/block_gemm/2026-12-03-h200-thin-n/``; buckets from M = 64 up re-measured with the scales loaded
    a step ahead, ``bench/results/block_gemm/2026-12-04-h200-scales-ahead/``: q_a at M = 64 11.0 µs against 12.5
    for swap-AB, M = 1024 / 4096 31.3 / 103 against 41.2 / 124; kv_a at M = 256 12.1 against 12.9, M = 4096 60.0
    against 64.1; kv_a at M 65-256 64x64 tiles on 3 stages with K in 6,
    ``bench/results/block_gemm/2026-12-05-h200-deepseek-v3-kv-a-m256-splits/``). One token: GEMVs with long K steps
    (:data:`_GEMV_ONE_ROW`, :data:`_GEMV_LONG_STEP`)."""
    if n <= 576:
        return ((1, _GEMV_ONE_ROW), (16, _SWAP16_PREFETCH), (32, _SWAP32), (64, "mm_n64_m32_s4_w4_g8_sk7"),
                (256, "mm_n64_m64_s3_w4_g8_sk6"), (1024, _MM64_SMALL_SK2), (None, _MM_LARGE))
    return ((1, _GEMV_LONG_STEP), (16, _SWAP16), (32, _SWAP32), (64, _MM64_SMALL_SK4), (256, _MM64_SMALL_SK2),
            (None, _MM_LARGE))


def _short_k(k: int) -> tuple[tuple[int | None, str], ...]:
    """Buckets of a short-K shape (K <= 2048: q_b 24576x1536, kv_b 32768x512): at one token the GEMV's 512-column
    step for q_b, swap-AB for kv_b, whose 4 K steps leave the GEMV's programs little to stream (9.1 µs against 11.6,
    bench/results/block_gemm/2026-12-04-h200-fused-gemv/ and 2026-12-05-h200-gemv-prefetch/), the 128x64 tiles up to
    M = 64 (q_b / kv_b at M = 16: 13.2 / 6.7 µs against 16.1 / 7.9 for swap-AB; M = 64: 13.8 / 7.3 against 18.9 /
    10.6), the persistent TMA kernel above (kv_b at M = 256 / 1024: 17.0 / 56.3 against 20.5 / 73.2;
    ``bench/results/block_gemm/2026-12-04-h200-scales-ahead/``)."""
    return ((1, _GEMV_SHORT_K if k > 512 else _SWAP16), (64, _MM_LARGE), (None, _TMA))


#: The built-in table for the H200: GEMV at M = 1 for N >= 2048 (the per-tensor sweep's winner at M = 1 on
#: 4096-28672 x 4096-14336), swap-AB with automatic split K up to M = 64, tiled 128x64 with automatic split K above:
#: 4 stages up to M = 512, 3 above (at M = 1024 / 4096 0.65-0.85x the time of the persistent TMA kernel this table
#: named before, on every DeepSeek-V3 / Qwen3-8B / Qwen3-32B weight but the short-K ones:
#: bench/results/block_gemm/2026-12-04-h200-scales-ahead/); the narrow and short-K DeepSeek-V3 shapes measured
#: (:func:`_narrow`, :func:`_short_k`) and Qwen3-8B's o / down at one token (:data:`_GEMV_EIGHT_ROWS`). ``default``
#: covers the rest.
DEFAULT_TABLE = BlockTable(
    default=_DEFAULT_BUCKETS,
    shapes={
        # DeepSeek-V3: q_a, kv_a (narrow N, K = 7168), q_b, kv_b (short K)
        (1536, 7168): _narrow(1536),
        (576, 7168): _narrow(576),
        (24576, 1536): _short_k(1536),
        (32768, 512): _short_k(512),
        # Qwen3-8B: o, down (N = 4096)
        (4096, 4096): ((1, _GEMV_EIGHT_ROWS), *_DEFAULT_BUCKETS[1:]),
        (4096, 12288): ((1, _GEMV_EIGHT_ROWS), *_DEFAULT_BUCKETS[1:]),
    },
    source="reasoned defaults below M = 1024, the M >= 1024 bucket, the narrow / short-K DeepSeek-V3 shapes and "
           "Qwen3-8B's N = 4096 weights at one token measured (bench/results/block_gemm/2026-12-03-h200-thin-n/, "
           "2026-12-04-h200-scales-ahead/, 2026-12-05-h200-gemv-long-steps/): bench/block_gemm.py --sweep measures "
           "a replacement",
)

#: the fused GEMV (the activation's group quantization inside the launch, :func:`.block_gemm_ops.fused_launch`): its
#: configs and the largest M it serves (one token: a decode step's linears, where the launches it saves are the host's
#: time). Every program quantizes the row it reads, so the fused configs take more weight rows per program than the
#: plain GEMV: measured at M = 1 on the DeepSeek-V3, Qwen3-8B and Qwen3-32B shapes against 9 other GEMV configs
#: (bench/results/block_gemm/2026-12-04-h200-fused-gemv/), 8 rows x 1024 columns on 4 warps was the fastest or within
#: 10% on 10 of the 13 shapes with K > 2048, 16 rows x 256 columns on 2 warps on the short-K ones (q_b, kv_b). Against
#: the group-quant kernel + the plain GEMV in CUDA graphs it takes 2-27% less time where K <= 4096 (Qwen3-8B, q_b,
#: kv_b) and on DeepSeek-V3's thin q_a / kv_a, and 2-22% more on the other weights with K >= 5120 (the quantization
#: every program repeats: Qwen3-32B down 22%, DeepSeek-V3 o 10%); outside CUDA graphs its saved launches decide
FUSED_GEMV = "gemv_n8_g8_w4"
FUSED_GEMV_SHORT_K = "gemv_n16_g2_w2"
FUSED_MAX_M = 1


def fused_shape_config(n: int, k: int) -> str:
    """The fused GEMV's config for an ``N x K`` weight (whatever M)."""
    return FUSED_GEMV_SHORT_K if k <= 2048 else FUSED_GEMV


def fused_pick(m: int, n: int, k: int) -> str | None:
    """The config of a fused launch at ``M x N x K`` (``None``: not fused there, M > :data:`FUSED_MAX_M`)."""
    return fused_shape_config(n, k) if m <= FUSED_MAX_M else None


_active: BlockTable | None = None


def active_table() -> BlockTable:
    """The table ``auto`` uses: the one :func:`use_table` set, else :data:`DEFAULT_TABLE`."""
    return _active if _active is not None else DEFAULT_TABLE


def use_table(table: BlockTable | None) -> BlockTable | None:
    """Make ``table`` the active one (``None``: back to the built-in); returns the previous override."""
    global _active
    previous, _active = _active, table
    return previous


__all__ = [
    "CONFIGS", "CONFIG_LIST", "CONFIG_NAMES", "DEFAULT_TABLE", "FAMILIES", "MAX_SPLIT_K", "MIN_GROUPS_PER_SPLIT",
    "FUSED_GEMV", "FUSED_GEMV_SHORT_K", "FUSED_MAX_M", "WEIGHT_BLOCK", "BlockTable", "BlockTileConfig", "active_table",
    "auto_split", "fused_pick", "fused_shape_config", "use_table",
]
