"""Tile configurations of the Triton FP8 GEMM and its M-bucket dispatch table (data, no torch/triton).

Three kernel families (see :mod:`.gemm_kernels`):

- ``gemv``: CUDA-core GEMV for a handful of tokens. Each program streams ``block_n`` weight rows over
  K in ``block_k`` chunks with 16-byte loads, converts to fp32 and reduces; one program column per
  token, so the weight is read once per token: decode at M = 1 only.
- ``swap``: swap-AB tensor-core GEMM for small M: ``outᵀ[BN, BM] = w[BN, K] · x[BM, K]ᵀ``. The weight
  rows fill the MMA's 64-row side (wgmma on SM90) and the few tokens its narrow side (``block_m`` 16-64).
- ``mm``: the classic tiled GEMM ``out[BM, BN] = x[BM, K] · w[BN, K]ᵀ`` with grouped tile order,
  for prefill.
- ``tma``: the same tiles loaded through TMA tensor descriptors (no address math or masks in the K
  loop), optionally persistent (one program per SM walking the tiles): prefill on SM >= 9.0.

A config's name spells its family and tile, e.g. ``swap_n64_m16_k256_s6_w4``. The dispatch table maps
``(M, N, K)`` to a config name (``auto``); ``FP8_BACKENDS_TRITON_TABLE=/path/table.json`` replaces it
(format :meth:`TritonTable.to_json`; ``bench/triton_configs.py`` writes one from measurements).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from fp8_backends.core import settings
from fp8_backends.core.bucket_tables import BucketTable, TableSource

TABLE_ENV = settings.TRITON_TABLE_ENV
FAMILIES = ("gemv", "swap", "mm", "tma")


@dataclass(frozen=True)
class TileConfig:
    """One Triton GEMM launch configuration.

    - ``family``: ``gemv``, ``swap`` or ``mm`` (module docstring).
    - ``block_m`` / ``block_n`` / ``block_k``: the tile over tokens (M), output channels (N) and K.
      ``gemv`` ignores ``block_m`` (one token per program).
    - ``stages``: software-pipelining depth (``num_stages``); ``warps``: ``num_warps``.
    - ``group_m``: ``mm``/``tma``, tiles of this many M-blocks walk N together (L2 reuse of the weight).
    - ``persistent``: ``tma`` only, launch one program per SM (times ``persistent``) walking the tiles.
    """

    family: str
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    persistent: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        for what in ("block_m", "block_n", "block_k", "warps"):
            v = getattr(self, what)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{self.name}: {what} must be a power of two, got {v}")
        if self.family != "gemv" and (self.block_m < 16 or self.block_n < 16 or self.block_k < 32):
            raise ValueError(f"{self.name}: tensor-core tiles need block_m, block_n >= 16 and block_k >= 32")
        if self.persistent and self.family != "tma":
            raise ValueError(f"{self.name}: only tma configs can be persistent")

    @property
    def name(self) -> str:
        if self.family == "gemv":
            return f"gemv_n{self.block_n}_k{self.block_k}_w{self.warps}"
        g = f"_g{self.group_m}" if self.family in ("mm", "tma") else ""
        p = f"_p{self.persistent}" if self.persistent else ""
        return f"{self.family}_n{self.block_n}_m{self.block_m}_k{self.block_k}_s{self.stages}_w{self.warps}{g}{p}"

    @property
    def max_m(self) -> int | None:
        """The largest M this config is meant for (``None``: any). Larger M still computes correctly."""
        return 1 if self.family == "gemv" else None


#: Every config the provider ships: the winners of ``bench/triton_configs.py --configs explore`` on the H200
#: (2026-11-29, 38 configs x the Llama-3-8B shapes x M 1-4096; bench/results/triton_configs/2026-11-29-h200/), each
#: noted with where it won.
CONFIG_LIST: tuple[TileConfig, ...] = (
    TileConfig("gemv", 1, 2, 1024, 1, 2, note="M = 1 (4096x4096, 28672x4096, 4096x14336)"),
    TileConfig("gemv", 1, 4, 512, 1, 4, note="M = 1 (6144x4096)"),
    TileConfig("swap", 16, 64, 256, 6, 4, note="M <= 16 (4096x4096, 4096x14336)"),
    TileConfig("swap", 16, 64, 128, 8, 4, note="M <= 16 (6144x4096)"),
    TileConfig("swap", 16, 64, 256, 4, 4, note="M <= 16 (28672x4096)"),
    TileConfig("swap", 32, 64, 256, 5, 4, note="M 17-32; M = 64 at 4096x4096"),
    TileConfig("swap", 64, 64, 256, 4, 4, note="M 33-128"),
    TileConfig("swap", 64, 128, 256, 3, 8, note="M ~256, N = 4096"),
    TileConfig("mm", 64, 128, 128, 4, 4, note="M ~64 at N = 28672"),
    TileConfig("mm", 128, 128, 128, 4, 8, note="M ~256 at 6144x4096"),
    TileConfig("tma", 128, 128, 128, 4, 8, persistent=1, note="M ~1024 at 6144x4096"),
    TileConfig("tma", 128, 256, 128, 3, 8, persistent=1, note="M >= 1024 (1.01-1.08x torch._scaled_mm)"),
)
# Measured and dropped (never the fastest, or within 1% of a shipped config): GEMV with 1 or 8 rows per program or
# BK 256-512 at 2 rows; swap-AB with BN 128 at M <= 32, BK 512, or 3-5 stages at BN 64 / M 16; pointer-based mm
# 64x64x256, 64x256, 128x256 (3-4 stages), 256x128 and 128x256x64; TMA 64x128, 128x128 (not persistent),
# 128x256 (not persistent: within 0-5% of the persistent one), 256x128 and 128x256x64.

CONFIGS: dict[str, TileConfig] = {c.name: c for c in CONFIG_LIST}
CONFIG_NAMES: tuple[str, ...] = tuple(CONFIGS)


class TritonTable(BucketTable):
    """The Triton GEMM provider's M-bucket table (buckets name configs of :data:`CONFIGS`)."""

    FORMAT: ClassVar[str] = "fp8_backends.triton_table/1"

    @classmethod
    def known_names(cls) -> Sequence[str]:
        return CONFIG_NAMES


#: The built-in table, from the same measurement: per Llama-3-8B shape, the fastest shipped config at M = 1, 16, 64,
#: 256, 1024, 4096 (bucket bounds at the geometric midpoints, except that GEMV, which streams the weight once per
#: token, serves M = 1 only and swap-AB tiles of 16 tokens stop at M = 16). ``default`` (other shapes) takes the
#: config most often fastest at each M.
_TMA = "tma_n256_m128_k128_s3_w8_g8_p1"
DEFAULT_TABLE = TritonTable(
    default=(
        (1, "gemv_n2_k1024_w2"),
        (16, "swap_n64_m16_k256_s6_w4"),
        (32, "swap_n64_m32_k256_s5_w4"),
        (128, "swap_n64_m64_k256_s4_w4"),
        (512, "swap_n128_m64_k256_s3_w8"),
        (None, _TMA),
    ),
    shapes={
        (6144, 4096): ((1, "gemv_n4_k512_w4"), (16, "swap_n64_m16_k128_s8_w4"), (32, "swap_n64_m32_k256_s5_w4"),
                       (128, "swap_n64_m64_k256_s4_w4"), (512, "mm_n128_m128_k128_s4_w8_g8"),
                       (2048, "tma_n128_m128_k128_s4_w8_g8_p1"), (None, _TMA)),
        (4096, 4096): ((1, "gemv_n2_k1024_w2"), (16, "swap_n64_m16_k256_s6_w4"), (128, "swap_n64_m32_k256_s5_w4"),
                       (512, "swap_n128_m64_k256_s3_w8"), (None, _TMA)),
        (28672, 4096): ((1, "gemv_n2_k1024_w2"), (16, "swap_n64_m16_k256_s4_w4"), (32, "swap_n64_m32_k256_s5_w4"),
                        (128, "mm_n128_m64_k128_s4_w4_g8"), (None, _TMA)),
        (4096, 14336): ((1, "gemv_n2_k1024_w2"), (16, "swap_n64_m16_k256_s6_w4"), (32, "swap_n64_m32_k256_s5_w4"),
                        (128, "swap_n64_m64_k256_s4_w4"), (512, "swap_n128_m64_k256_s3_w8"), (None, _TMA)),
    },
    source="H200 measurement 2026-11-29 (bench/triton_configs.py --configs explore, 3 rounds x 3 replays)",
)

_SOURCE: TableSource[TritonTable] = TableSource(TABLE_ENV, DEFAULT_TABLE, "Triton dispatch table")


def active_table() -> TritonTable:
    """The table ``auto`` uses: ``$FP8_BACKENDS_TRITON_TABLE`` (a JSON file) if set, else the built-in one."""
    return _SOURCE.active()


__all__ = ["CONFIGS", "CONFIG_LIST", "CONFIG_NAMES", "DEFAULT_TABLE", "TABLE_ENV", "TileConfig", "TritonTable",
           "active_table"]
