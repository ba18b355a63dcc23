"""Kernel configurations of the CUTLASS SM90 provider and the M-bucket dispatch table (data, no torch).

A :class:`KernelConfig` fixes everything a compiled kernel is specialised on except the epilogue, the
output dtype and the accumulation mode (those form the library *family*, see ``build.LibrarySpec``):
the CTA tile, the cluster shape, the warp-specialised schedule, stream-K, and whether A and B are
swapped. Swapping computes ``outᵀ = w · xᵀ`` so that a small M lands on the tile's N (16 or 64 wide)
instead of wasting a 64- or 128-row tile on a handful of tokens: the decode configs use it.

The :class:`DispatchTable` maps a problem ``(M, N, K)`` to a config name: per ``(N, K)`` where the
table has that shape, else the ``default`` buckets. Each bucket is ``(max_m, name)`` with ``max_m``
inclusive and increasing; the last bucket has ``max_m = None`` (no limit). The table is data: replace
it with ``FP8_BACKENDS_CUTLASS_TABLE=/path/table.json`` (the format :meth:`DispatchTable.to_json`
writes and ``bench/cutlass_configs.py`` produces from its measurements).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TABLE_ENV = "FP8_BACKENDS_CUTLASS_TABLE"

SCHEDULES = {"ws": 0, "pingpong": 1, "cooperative": 2}


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
        return {
            "FP8B_TILE_M": str(self.tile[0]),
            "FP8B_TILE_N": str(self.tile[1]),
            "FP8B_TILE_K": str(self.tile[2]),
            "FP8B_CLUSTER_M": str(self.cluster[0]),
            "FP8B_CLUSTER_N": str(self.cluster[1]),
            "FP8B_SCHEDULE": str(SCHEDULES[self.schedule]),
            "FP8B_STREAM_K": str(int(self.stream_k)),
            "FP8B_SWAP_AB": str(int(self.swap_ab)),
        }

    def describe(self) -> str:
        t = "x".join(map(str, self.tile))
        extras = [self.schedule, f"cluster {self.cluster[0]}x{self.cluster[1]}"]
        if self.stream_k:
            extras.append("stream-K")
        if self.swap_ab:
            extras.append("swap AB")
        return f"{self.name}: tile {t}, " + ", ".join(extras)


#: Every config the provider can build. Names say schedule, tile (of the kernel's problem) and cluster.
#: Notes say where each one was the fastest in the H200 measurement of 2026-11-29 (bench/results/).
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

Buckets = tuple[tuple[int | None, str], ...]


def _check_buckets(buckets: Sequence[Sequence[Any]], where: str) -> Buckets:
    out: list[tuple[int | None, str]] = []
    last = 0
    for i, item in enumerate(buckets):
        if len(item) != 2:
            raise ValueError(f"{where}: bucket {i} must be [max_m, config], got {item!r}")
        max_m, name = item
        if name not in CONFIGS:
            raise ValueError(f"{where}: unknown config {name!r} (known: {', '.join(CONFIG_NAMES)})")
        if max_m is None:
            if i != len(buckets) - 1:
                raise ValueError(f"{where}: only the last bucket may have max_m = null")
        else:
            max_m = int(max_m)
            if max_m <= last:
                raise ValueError(f"{where}: bucket bounds must increase (got {max_m} after {last})")
            last = max_m
        out.append((max_m, str(name)))
    if not out or out[-1][0] is not None:
        raise ValueError(f"{where}: the last bucket must have max_m = null (covers every larger M)")
    return tuple(out)


@dataclass(frozen=True)
class DispatchTable:
    """M buckets -> config name, per ``(N, K)`` shape with a fallback ``default``."""

    default: Buckets
    shapes: Mapping[tuple[int, int], Buckets] = field(default_factory=dict)
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", _check_buckets(self.default, "default"))
        shapes = {(int(n), int(k)): _check_buckets(b, f"shape {n}x{k}") for (n, k), b in self.shapes.items()}
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "_index", {})

    def buckets_for(self, n: int, k: int) -> Buckets:
        return self.shapes.get((n, k), self.default)

    def pick(self, m: int, n: int, k: int) -> str:
        """The config name for ``M x N x K`` (``M`` may be 0)."""
        index = self._index.get((n, k))  # type: ignore[attr-defined]
        if index is None:
            buckets = self.buckets_for(n, k)
            bounds = [b for b, _ in buckets[:-1]]
            names = [name for _, name in buckets]
            index = (bounds, names)
            self._index[(n, k)] = index  # type: ignore[attr-defined]
        bounds, names = index
        return names[bisect.bisect_left(bounds, m)]

    def config_names(self) -> set[str]:
        """Every config this table can pick."""
        names = {name for _, name in self.default}
        for buckets in self.shapes.values():
            names.update(name for _, name in buckets)
        return names

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "fp8_backends.cutlass_table/1",
            "source": self.source,
            "default": [list(b) for b in self.default],
            "shapes": {f"{n}x{k}": [list(b) for b in buckets] for (n, k), buckets in sorted(self.shapes.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DispatchTable:
        fmt = data.get("format", "fp8_backends.cutlass_table/1")
        if fmt != "fp8_backends.cutlass_table/1":
            raise ValueError(f"unsupported CUTLASS table format {fmt!r}")
        shapes: dict[tuple[int, int], Iterable[Sequence[Any]]] = {}
        for key, buckets in (data.get("shapes") or {}).items():
            n, _, k = str(key).partition("x")
            shapes[(int(n), int(k))] = buckets
        return cls(default=data["default"], shapes=shapes, source=str(data.get("source", "")))


#: The built-in table: measured on an H200 (bench/cutlass_configs.py, two runs of 7 interleaved rounds each,
#: 2026-11-29; bench/results/2026-11-29-h200-cutlass-table.json). Per Llama-3-8B shape, the config with the
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

_loaded: tuple[str, float, DispatchTable] | None = None


def active_table() -> DispatchTable:
    """The table ``auto`` uses: ``$FP8_BACKENDS_CUTLASS_TABLE`` (a JSON file) if set, else the built-in one.

    The file is re-read when its path or modification time changes; a broken file raises ``ValueError``.
    """
    global _loaded
    path = os.environ.get(TABLE_ENV, "").strip()
    if not path:
        return DEFAULT_TABLE
    try:
        mtime = os.stat(path).st_mtime
    except OSError as exc:
        raise ValueError(f"{TABLE_ENV}={path}: cannot read the CUTLASS dispatch table ({exc})") from None
    if _loaded is not None and _loaded[0] == path and _loaded[1] == mtime:
        return _loaded[2]
    try:
        with open(path, encoding="utf-8") as f:
            table = DispatchTable.from_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{TABLE_ENV}={path}: invalid CUTLASS dispatch table: {exc}") from None
    _loaded = (path, mtime, table)
    return table


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
