"""Kernel configurations of the CUTLASS SM90 block-scaled FP8 GEMM and its M-bucket dispatch table (data, no torch).

The block kernel (``fp8_blockwise_gemm_sm90.cu``) computes ``out = Σ_kb sx[m, kb]·sw[n//128, kb]·(x·wᵀ)_kb`` for
1x128 activation groups and 128x128 weight blocks, the scales applied per 128-deep K block in fp32 by CUTLASS's
blockwise-scaling mainloop (``KernelTmaWarpSpecialized{Cooperative,Pingpong}FP8BlockScaledAccum``). A
:class:`BlockKernelConfig` fixes what one compiled kernel is specialised on besides the output dtype: the CTA tile
(K always 128: one K tile is one scale block), the cluster, the schedule (ping-pong or cooperative: that mainloop has
no plain warp-specialised form), stream-K, and whether A and B are swapped (``outᵀ = w·xᵀ``, so that a small M lands
on the tile's N).

Tile rules the mainloop imposes (checked here, before nvcc sees them): the tile must cover whole 128-row weight
blocks, so tile N % 128 == 0 without a swap and tile M % 128 == 0 with one; the activation side has one scale per
token, so the other tile side is free (64-row ping-pong tiles, 16-token swapped tiles).

Activation scales (``[M, ceil(K/128)]`` fp32) are read M-major: token ``t`` of group ``kb`` at ``ptr[kb*ld + t]``.
Configs whose tile puts 32 or more tokens on one side load them with TMA (:attr:`BlockKernelConfig.act_scale_tma`),
which needs ``ld % 4 == 0`` and a 16-byte aligned pointer: the contract's ``m_major_tma`` layout
(:data:`ACT_SCALE_LAYOUT`). The other configs load them with ``cp.async`` and take any ``ld >= M``.
Weight scales are read K-major, the checkpoint's row-major ``[ceil(N/128), ceil(K/128)]`` as it is.

:data:`DEFAULT_BLOCK_TABLE` maps ``(M, N, K)`` to a config per M bucket: per listed ``(N, K)``, else ``long_k``
buckets when ``K >= LONG_K_RATIO * N`` (stream-K spreads the long K loop over the SMs that the few output tiles
leave idle), else ``default``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fp8_backends.core.bucket_tables import Buckets, BucketTable

from .configs import shape_defines, shape_traits

#: the activation group size along K and the weight block (rows, K) the kernels are built for
GROUP_K = 128
WEIGHT_BLOCK = (128, 128)
#: the activation-scale layout every block config reads without a copy (``fp8_backends.core.types.ScaleLayout``'s
#: value): M-major with the K-block stride padded to a multiple of 4 floats; ``m_major`` with M % 4 == 0 is the same
ACT_SCALE_LAYOUT = "m_major_tma"
#: a problem with ``K >= LONG_K_RATIO * N`` takes the table's ``long_k`` buckets (unless its shape is listed)
LONG_K_RATIO = 3
#: tokens on one side of the tile from which the mainloop loads activation scales with TMA (CUTLASS 4.2's
#: ``ScaleTmaThreshold``)
SCALE_TMA_THRESHOLD = 32

_BLOCK_SCHEDULES = ("pingpong", "cooperative")


@dataclass(frozen=True)
class BlockKernelConfig:
    """One block-scaled CUTLASS SM90 kernel shape.

    - ``tile``: CTA tile ``(M, N, 128)`` of the kernel's own problem (after a swap, M runs over the output
      channels N and N over the tokens).
    - ``cluster``: thread-block cluster ``(M, N)``.
    - ``schedule``: ``pingpong`` (two consumer warpgroups alternating tiles) or ``cooperative`` (two warpgroups
      share a tile; tile M >= 128).
    - ``stream_k``: stream-K tile scheduler (cooperative only); needs a workspace the launch zeroes on the stream.
    - ``swap_ab``: compute ``outᵀ = w·xᵀ`` (small-M configs).
    """

    name: str
    tile: tuple[int, int, int]
    cluster: tuple[int, int] = (1, 1)
    schedule: str = "cooperative"
    stream_k: bool = False
    swap_ab: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or not self.name.startswith("bw_"):
            raise ValueError(f"block config name {self.name!r} must be an identifier starting with 'bw_'")
        if self.schedule not in _BLOCK_SCHEDULES:
            raise ValueError(f"{self.name}: schedule must be one of {', '.join(_BLOCK_SCHEDULES)} (the blockwise "
                             f"mainloop has no plain warp-specialised form), got {self.schedule!r}")
        tm, tn, tk = self.tile
        if tk != GROUP_K:
            raise ValueError(f"{self.name}: tile K must be {GROUP_K} (one K tile is one scale block)")
        if self.schedule == "cooperative" and tm < 128:
            raise ValueError(f"{self.name}: the cooperative schedule needs tile M >= 128")
        if self.stream_k and self.schedule != "cooperative":
            raise ValueError(f"{self.name}: stream-K needs the cooperative schedule")
        if tm % 64 or tn % 8 or tn > 256:
            raise ValueError(f"{self.name}: tile {self.tile} is not a valid SM90 FP8 wgmma tile")
        weight_side = tm if self.swap_ab else tn
        if weight_side % WEIGHT_BLOCK[0]:
            raise ValueError(f"{self.name}: the tile's weight side ({'M' if self.swap_ab else 'N'} = {weight_side}) "
                             f"must cover whole {WEIGHT_BLOCK[0]}-row weight blocks")

    @property
    def act_scale_tma(self) -> bool:
        """The mainloop loads the activation scales with TMA (needs the padded M-major layout), else cp.async."""
        tokens = self.tile[1] if self.swap_ab else self.tile[0]
        return tokens >= SCALE_TMA_THRESHOLD

    def defines(self) -> dict[str, str]:
        """The ``FP8B_*`` macros of ``fp8_blockwise_gemm_sm90.cu`` that select this config (all but the output
        dtype and the name)."""
        return shape_defines(self)

    def describe(self) -> str:
        traits = [*shape_traits(self), "act scales by TMA" if self.act_scale_tma else "act scales by cp.async"]
        return f"{self.name}: tile {'x'.join(map(str, self.tile))}, " + ", ".join(traits)


#: Every block config the provider can build. Not measured yet: the notes say what each one is meant for; the
#: bench (bench/block_gemm.py, ``cutlass`` variants with ``config=<name>``) decides the table.
BLOCK_CONFIG_LIST: tuple[BlockKernelConfig, ...] = (
    # decode: swapped (tokens on the tile's N), stream-K spreads the K loop over every SM (N / 128 output tiles
    # alone leave most SMs idle: 17 tiles for N = 2112)
    BlockKernelConfig("bw_sk128x16_swap", (128, 16, 128), (1, 1), "cooperative", stream_k=True, swap_ab=True,
                      note="M <= 16"),
    BlockKernelConfig("bw_sk128x32_swap", (128, 32, 128), (1, 1), "cooperative", stream_k=True, swap_ab=True,
                      note="M 17-32"),
    BlockKernelConfig("bw_sk128x64_swap", (128, 64, 128), (1, 1), "cooperative", stream_k=True, swap_ab=True,
                      note="M 33-64"),
    # decode with many output tiles (N / 128 >= SM count): persistent ping-pong, no stream-K fix-up
    BlockKernelConfig("bw_pp128x32_swap", (128, 32, 128), (1, 1), "pingpong", swap_ab=True,
                      note="M <= 32, N >= 16384"),
    # mid M: 64-token ping-pong tiles
    BlockKernelConfig("bw_pp64x128", (64, 128, 128), (1, 1), "pingpong", note="M 65-512"),
    # prefill: example 67's shape (cooperative 128x128, cluster 1x2 multicasts x across two N tiles)
    BlockKernelConfig("bw_coop128x128_c1x2", (128, 128, 128), (1, 2), "cooperative", note="M >= 1024"),
    BlockKernelConfig("bw_pp64x128_c2x1", (64, 128, 128), (2, 1), "pingpong", note="M 512-2048"),
    # K >> N (down projections): stream-K over 128x128 tiles
    BlockKernelConfig("bw_sk128x128", (128, 128, 128), (1, 1), "cooperative", stream_k=True,
                      note="M 65-1024, K >= 3N"),
)

BLOCK_CONFIGS: dict[str, BlockKernelConfig] = {c.name: c for c in BLOCK_CONFIG_LIST}
BLOCK_CONFIG_NAMES: tuple[str, ...] = tuple(BLOCK_CONFIGS)


@dataclass(frozen=True)
class BlockDispatchTable(BucketTable):
    """The block kernel's M-bucket table: per ``(N, K)`` shape, else ``long_k`` for ``K >= LONG_K_RATIO·N``,
    else ``default`` (buckets name configs of :data:`BLOCK_CONFIGS`)."""

    FORMAT: ClassVar[str] = "fp8_backends.cutlass_block_table/1"

    long_k: Buckets = field(default=())

    @classmethod
    def known_names(cls) -> Sequence[str]:
        return BLOCK_CONFIG_NAMES

    def __post_init__(self) -> None:
        super().__post_init__()
        long_k = self._check_buckets(self.long_k, "long_k") if self.long_k else self.default
        object.__setattr__(self, "long_k", long_k)

    def buckets_for(self, n: int, k: int) -> Buckets:
        listed = self.shapes.get((n, k))
        if listed is not None:
            return listed
        return self.long_k if k >= LONG_K_RATIO * n else self.default

    def config_names(self) -> set[str]:
        return super().config_names() | {name for _, name in self.long_k}

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        data["long_k"] = [list(b) for b in self.long_k]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BlockDispatchTable:
        base = super().from_json(data)
        return cls(default=base.default, shapes=base.shapes, source=base.source,
                   long_k=tuple(tuple(b) for b in data.get("long_k") or ()))  # type: ignore[arg-type]


#: The built-in table: a first choice from the configs' intent, NOT measured (replace it from bench/block_gemm.py's
#: per-config timings on the H200). Decode takes the swapped stream-K tiles sized to M; mid M the 64-row ping-pong
#: tiles; prefill the cooperative 128x128 tile of CUTLASS's example 67; K >= 3N the stream-K tiles up to M = 1024.
DEFAULT_BLOCK_TABLE = BlockDispatchTable(
    default=(
        (16, "bw_sk128x16_swap"),
        (32, "bw_sk128x32_swap"),
        (64, "bw_sk128x64_swap"),
        (512, "bw_pp64x128"),
        (None, "bw_coop128x128_c1x2"),
    ),
    long_k=(
        (16, "bw_sk128x16_swap"),
        (32, "bw_sk128x32_swap"),
        (64, "bw_sk128x64_swap"),
        (1024, "bw_sk128x128"),
        (None, "bw_coop128x128_c1x2"),
    ),
    source="unmeasured first choice (block_configs.py); tune with bench/block_gemm.py",
)


def active_block_table() -> BlockDispatchTable:
    """The table ``auto`` uses for block-scaled problems (the built-in one)."""
    return DEFAULT_BLOCK_TABLE


__all__ = [
    "ACT_SCALE_LAYOUT",
    "BLOCK_CONFIGS",
    "BLOCK_CONFIG_LIST",
    "BLOCK_CONFIG_NAMES",
    "BlockDispatchTable",
    "BlockKernelConfig",
    "DEFAULT_BLOCK_TABLE",
    "GROUP_K",
    "LONG_K_RATIO",
    "WEIGHT_BLOCK",
    "active_block_table",
]
