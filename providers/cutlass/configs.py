"""Kernel configurations of the CUTLASS SM90 provider and the M-bucket dispatch table (data, no torch).

A :class:`KernelConfig` fixes everything a compiled kernel is specialised on except the epilogue, the
output dtype and the accumulation mode (those form the library *family*, see ``build.LibrarySpec``):
the CTA tile, the cluster shape, the warp-specialised schedule, stream-K, and whether A and B are
swapped. Swapping computes ``outᵀ = w · xᵀ`` so that a small M lands on the tile's N (16 or 64 wide)
instead of wasting a 64- or 128-row tile on a handful of tokens: the decode configs use it.

The :class:`DispatchTable` (a :class:`fp8_backends.core.bucket_tables.BucketTable`) maps a problem ``(M, N, K)``
to a config name per M bucket, per ``(N, K)`` where it lists that shape. The table is data: replace it
with ``FP8_BACKENDS_CUTLASS_TABLE=/path/table.json`` (the format :meth:`DispatchTable.to_json`
writes and ``bench/cutlass_configs.py`` produces from its measurements).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fp8_backends.core import settings
from fp8_backends.core.bucket_tables import BucketTable, TableSource

TABLE_ENV = settings.CUTLASS_TABLE_ENV

SCHEDULES = {"ws": 0, "pingpong": 1, "cooperative": 2}


def shape_defines(cfg: Any) -> dict[str, str]:
    """The ``FP8B_*`` macros both kernel sources take from a config's shape (a :class:`KernelConfig` or a
    :class:`.block_configs.BlockKernelConfig`): tile, cluster, schedule, stream-K and the A/B swap."""
    return {
        "FP8B_TILE_M": str(cfg.tile[0]),
        "FP8B_TILE_N": str(cfg.tile[1]),
        "FP8B_TILE_K": str(cfg.tile[2]),
        "FP8B_CLUSTER_M": str(cfg.cluster[0]),
        "FP8B_CLUSTER_N": str(cfg.cluster[1]),
        "FP8B_SCHEDULE": str(SCHEDULES[cfg.schedule]),
        "FP8B_STREAM_K": str(int(cfg.stream_k)),
        "FP8B_SWAP_AB": str(int(cfg.swap_ab)),
    }


def shape_traits(cfg: Any) -> list[str]:
    """A config's shape in words beside its tile: schedule, cluster, stream-K, swap."""
    traits = [cfg.schedule, f"cluster {cfg.cluster[0]}x{cfg.cluster[1]}"]
    if cfg.stream_k:
        traits.append("stream-K")
    if cfg.swap_ab:
        traits.append("swap AB")
    return traits


@dataclass(frozen=True)
class KernelConfig:
    """One CUTLASS 3.x SM90 kernel shape.

    - ``tile``: CTA tile ``(M, N, K)`` of the kernel's own problem (after a swap, the tile's M runs
      over the output channels N and the tile's N over the tokens M).
    - ``cluster``: thread-block cluster ``(M, N)``; TMA multicasts the shared operand across it.
    - ``schedule``: ``ws`` (one consumer warpgroup per CTA, not persistent), ``pingpong`` (two
      consumer warpgroups alternating tiles) or ``cooperative`` (two warpgroups share a tile; tile
      M >= 128).
    - ``stream_k``: split the K loop across CTAs (stream-K / split-K chosen by CUTLASS's heuristic;
      cooperative only); needs a zeroed workspace each call, which the launch sets up on the stream.
    - ``swap_ab``: compute ``outᵀ = w · xᵀ`` (small-M configs).
    """

    name: str
    tile: tuple[int, int, int]
    cluster: tuple[int, int] = (1, 1)
    schedule: str = "cooperative"
    stream_k: bool = False
    swap_ab: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"{self.name}: schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        tm, tn, tk = self.tile
        if self.schedule == "cooperative" and tm < 128:
            raise ValueError(f"{self.name}: the cooperative schedule needs tile M >= 128")
        if self.stream_k and self.schedule != "cooperative":
            raise ValueError(f"{self.name}: stream-K needs the cooperative schedule")
        if tm % 64 or tn % 8 or tn > 256 or tk % 32:
            raise ValueError(f"{self.name}: tile {self.tile} is not a valid SM90 FP8 wgmma tile")
        if not self.name.isidentifier():
            raise ValueError(f"config name {self.name!r} must be an identifier")

    def defines(self) -> dict[str, str]:
        """The ``FP8B_*`` macros of ``fp8_gemm_sm90.cu`` that select this config."""
        return shape_defines(self)

    def describe(self) -> str:
        return f"{self.name}: tile {'x'.join(map(str, self.tile))}, " + ", ".join(shape_traits(self))


#: Every config the provider can build. Names say schedule, tile (of the kernel's problem) and cluster.
#: Notes say where each one was the fastest in the H200 measurement of 2026-11-29
#: (bench/results/cutlass_configs/2026-11-29-h200/).
CONFIG_LIST: tuple[KernelConfig, ...] = (
    # decode: swapped (tokens on the tile's N), one 64-row consumer warpgroup per CTA, not persistent
    KernelConfig("ws64x16_swap", (64, 16, 256), (1, 1), "ws", swap_ab=True, note="M <= 16"),
    KernelConfig("ws64x64_swap", (64, 64, 256), (1, 1), "ws", swap_ab=True, note="M 17-64"),
    # decode, persistent ping-pong: loads never stop between tiles (N / 64 >> SM count, e.g. N = 28672)
    KernelConfig("pp64x16_swap", (64, 16, 256), (1, 1), "pingpong", swap_ab=True, note="M <= 16, large N"),
    KernelConfig("pp64x64_swap", (64, 64, 256), (1, 1), "pingpong", swap_ab=True, note="M 17-64, large N"),
    # decode with stream-K: the K loop spread over every SM when the output tiles alone leave SMs idle
    KernelConfig("sk128x16_swap", (128, 16, 128), (1, 1), "cooperative", stream_k=True, swap_ab=True,
                 note="M <= 16, large N"),
    KernelConfig("sk128x64_swap", (128, 64, 128), (1, 1), "cooperative", stream_k=True, swap_ab=True,
                 note="M 64-256, N = 4096"),
    # mid M
    KernelConfig("pp64x128_c2x1", (64, 128, 128), (2, 1), "pingpong", note="M 128-512"),
    KernelConfig("pp64x192_c2x1", (64, 192, 128), (2, 1), "pingpong", note="M 256 at N = 6144; M 8192 at N = 28672"),
    # prefill
    KernelConfig("pp128x128_c2x1", (128, 128, 128), (2, 1), "pingpong", note="M >= 1024"),
    KernelConfig("pp128x128_c1x2", (128, 128, 128), (1, 2), "pingpong", note="M ~4096"),
    KernelConfig("coop128x256_c2x1", (128, 256, 128), (2, 1), "cooperative", note="M 256-1024, large N or K"),
)
# Measured and dropped (never within 1% of the best on the Llama-3-8B shapes, 2026-11-29): cooperative
# 128x256 cluster 1x2, cooperative 256x128 (clusters 2x1 and 1x2), stream-K 128x128 and 128x256.

CONFIGS: dict[str, KernelConfig] = {c.name: c for c in CONFIG_LIST}
CONFIG_NAMES: tuple[str, ...] = tuple(CONFIGS)

class DispatchTable(BucketTable):
    """The CUTLASS provider's M-bucket table (buckets name configs of :data:`CONFIGS`)."""

    FORMAT: ClassVar[str] = "fp8_backends.cutlass_table/1"

    @classmethod
    def known_names(cls) -> Sequence[str]:
        return CONFIG_NAMES


#: The built-in table: measured on an H200 (bench/cutlass_configs.py, two runs of 7 interleaved rounds each,
#: 2026-11-29; bench/results/cutlass_configs/2026-11-29-h200/table.json). Per Llama-3-8B shape, the config with the
#: lowest time (geometric mean of the two runs) at M = 1, 16, 64, 256, 1024, 4096, 8192; bucket bounds are the
#: geometric midpoints. ``default`` (other shapes) is the config with the best geometric-mean speed over the
#: four shapes at each M.
DEFAULT_TABLE = DispatchTable(
    default=(
        (32, "ws64x16_swap"),
        (128, "ws64x64_swap"),
        (512, "pp64x128_c2x1"),
        (2048, "pp128x128_c2x1"),
        (5792, "pp128x128_c1x2"),
        (None, "pp128x128_c2x1"),
    ),
    shapes={
        (6144, 4096): ((32, "ws64x16_swap"), (128, "ws64x64_swap"), (512, "pp64x192_c2x1"),
                       (2048, "pp128x128_c2x1"), (5792, "pp128x128_c1x2"), (None, "pp128x128_c2x1")),
        (4096, 4096): ((32, "ws64x16_swap"), (128, "ws64x64_swap"), (512, "sk128x64_swap"),
                       (2048, "pp128x128_c2x1"), (5792, "pp128x128_c1x2"), (None, "pp128x128_c2x1")),
        (28672, 4096): ((4, "sk128x16_swap"), (32, "pp64x16_swap"), (128, "pp64x64_swap"),
                        (512, "coop128x256_c2x1"), (2048, "pp128x128_c2x1"), (5792, "pp128x128_c1x2"),
                        (None, "pp64x192_c2x1")),
        (4096, 14336): ((32, "ws64x16_swap"), (128, "ws64x64_swap"), (512, "sk128x64_swap"),
                        (2048, "coop128x256_c2x1"), (None, "pp128x128_c2x1")),
    },
    source="H200 measurement 2026-11-29 (bench/cutlass_configs.py, 2 runs x 7 rounds, fast accumulation)",
)

_SOURCE: TableSource[DispatchTable] = TableSource(TABLE_ENV, DEFAULT_TABLE, "CUTLASS dispatch table")


def active_table() -> DispatchTable:
    """The table ``auto`` uses: ``$FP8_BACKENDS_CUTLASS_TABLE`` (a JSON file) if set, else the built-in one.

    The file is re-read when its path or modification time changes; a broken file raises ``ValueError``.
    """
    return _SOURCE.active()


__all__ = [
    "CONFIGS",
    "CONFIG_LIST",
    "CONFIG_NAMES",
    "DEFAULT_TABLE",
    "DispatchTable",
    "KernelConfig",
    "TABLE_ENV",
    "active_table",
]
