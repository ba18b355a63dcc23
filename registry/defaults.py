"""Measured defaults for ``auto``: which built-in provider serves which M on a GPU family, when no tuned
lockfile covers the problem.

Static priorities rank the providers the same way for every problem (``torch_scaled_mm`` first). On the H200
the ``triton`` decode kernels (GEMV at M = 1, swap-AB up to 16 tokens, launched with PDL) beat cuBLAS at every
decode point measured: 1.12x ``torch._scaled_mm`` geomean at M <= 16 over the Llama-3-8B shapes (1.01-1.18x;
``bench/results/triton_configs/2026-11-29-h200/triton_configs.md``), while cuBLAS stays ahead at M 64-256 and the
providers are within a few percent of each other above. This module holds such measured preferences as data:
per SM range, an M bucket and the provider names preferred there (the first that can serve wins; where none
can, static priorities decide). A tuned lockfile (:mod:`.lockfile_policy`) is asked first; ``FP8_BACKENDS_DEFAULTS=0``
turns these defaults off.

These global M rules are a fallback for what the shipped selection data (:mod:`.shipped`) does not cover: where a
data file exists for the GPU's SM and holds the problem's class, the per-shape data decides (a rule learnt on the four
Llama-3-8B shapes loses to cuBLAS on others, e.g. 0.89x at N=4608 K=3584 M=1) and these rules step aside; a class
the file lacks keeps them (:func:`defaults_for`).

Only built-in providers are named here (a third-party provider that happens to be called ``triton`` is never
picked by these rules). :func:`buckets` gives :class:`fp8_backends.layers.Fp8Linear` the M buckets to
prepare one weight per provider for, as the lockfile's buckets do.

Block-wise FP8 problems (``per_token_group`` activations x ``block`` weights) have tables of their own
(:attr:`PlatformDefaults.block`; the per-tensor tables never apply to them, nor theirs to other problems). They
apply wherever no tuned lockfile and no shipped data covers the block problem: the shipped file for the H200 holds
the block class (group size 128) since 2026-12-03, so on SM 9.0 its policies, ranked above, answer first and these
rules decide only what it lacks (group size 64, another GPU family). Their rules are a ladder per M bucket: the
first provider that can serve *and is ready* wins.
Ready means its first call builds nothing for minutes (:meth:`~fp8_backends.core.backend.ProviderBase.first_use_build`:
flashinfer's block module, about 2 minutes; cutlass's block libraries, about 100 s each): ``auto`` never silently
stalls a model's first step on a JIT build. Whatever the ladder passes over, and why, is in the choice's note
(``python -m fp8_backends.list --problem M,N,K --act-scale per_token_group --weight-scale block``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fp8_backends.core import settings

from .candidates import pending_build
from .platform import Platform
from .policy import SelectionPolicy, register_selection_policy

logger = logging.getLogger("fp8_backends")

POLICY_NAME = "measured-default"


@dataclass(frozen=True)
class MRule:
    """Problems with ``M <= max_m`` (any M when ``max_m`` is None) prefer the built-in providers ``prefer`` (in
    order). ``source``: this bucket's evidence, when it has its own (else the table's)."""

    max_m: int | None
    prefer: tuple[str, ...]
    source: str = ""

    def covers(self, m: int) -> bool:
        return self.max_m is None or m <= self.max_m

    @property
    def label(self) -> str:
        """``M <= 16`` or ``any M``."""
        return "any M" if self.max_m is None else f"M <= {self.max_m}"


@dataclass(frozen=True)
class PlatformDefaults:
    """The rules of one kind (``gemm``) for GPUs with ``min_sm <= SM <= max_sm``; rules ascend in ``max_m`` (a last
    rule with ``max_m=None`` takes every larger M). ``block``: the rules of block-wise FP8 problems (which no other
    table applies to); they take only providers that are ready (module docstring)."""

    kind: str
    min_sm: tuple[int, int]
    max_sm: tuple[int, int]
    rules: tuple[MRule, ...]
    source: str
    block: bool = False

    def covers(self, kind: str, platform: Platform, problem: Any = None) -> bool:
        return (kind == self.kind and platform.sm is not None and self.min_sm <= platform.sm <= self.max_sm
                and self.block == is_block(problem))

    def rule_for(self, m: int) -> MRule | None:
        return next((r for r in self.rules if r.covers(m)), None)


def is_block(problem: Any) -> bool:
    """Whether ``problem`` is a block-wise FP8 GEMM (False for None and other kinds)."""
    return bool(getattr(problem, "block_scaled", False))


#: the block-wise ladders: the first provider that can serve the problem and is ready (nothing to build for minutes
#: at its first call) wins. torch._scaled_mm (cuBLASLt's block-scaled GEMM) needs no build and is never far behind.
_BLOCK_DECODE = ("triton", "flashinfer_block", "cutlass", "torch_scaled_mm")
_BLOCK_SMALL = ("flashinfer_block", "triton", "cutlass", "torch_scaled_mm")
_BLOCK_MID = ("flashinfer_block", "torch_scaled_mm", "cutlass", "triton")
_BLOCK_LARGE = ("torch_scaled_mm", "flashinfer_block", "cutlass", "triton")

DEFAULTS: tuple[PlatformDefaults, ...] = (
    PlatformDefaults(
        kind="gemm",
        min_sm=(9, 0),
        max_sm=(9, 0),
        rules=(MRule(16, ("triton",)),),
        source="H200, 2026-11-29: triton 1.12x torch._scaled_mm geomean at M <= 16 (Llama-3-8B shapes)",
    ),
    # Block-wise FP8 on SM 9.0, from two H200 measurements of 2026-12-03:
    # - bench/results/block_gemm/2026-12-03-h200/ (CUDA graphs, L2 rotated; DeepSeek-V3 kv_a 576x7168 and o
    #   7168x16384, Qwen3-8B qkv 6144x4096, Qwen3-32B gate_up 51200x5120; triton, cutlass, torch._scaled_mm; flashinfer
    #   not timed): at M = 1 triton's GEMV is 1.04x the fastest (geomean of µs / best; cutlass 1.33x, torch 1.76x); at
    #   M = 16 triton 1.19x, cutlass 1.22x, torch 1.32x; at M = 256 and 4096 torch._scaled_mm is the fastest on all 4
    #   shapes (cutlass 1.28x / 1.07x, triton 1.82x / 1.81x);
    # - a probe of flashinfer's kernels against torch._scaled_mm (eager, 5 shapes: 6144x4096, 4096x12288, 7168x16384,
    #   2112x7168, 576x7168): flashinfer 0.85x torch's µs at M = 16 and 0.73x at M = 128 (faster on 5 of 5 shapes),
    #   0.91x at M = 1024 and 0.96x at 4096 but slower on the 3 larger shapes by 1-5%.
    PlatformDefaults(
        kind="gemm",
        min_sm=(9, 0),
        max_sm=(9, 0),
        rules=(
            MRule(4, _BLOCK_DECODE, "H200 2026-12-03: triton's GEMV 1.04x the fastest at M = 1 (4 shapes, graphs)"),
            MRule(16, _BLOCK_SMALL, "H200 2026-12-03: flashinfer 0.85x torch._scaled_mm's µs at M = 16 (5 of 5 "
                                    "shapes); triton 1.19x the fastest of triton / cutlass / torch"),
            MRule(128, _BLOCK_MID, "H200 2026-12-03: flashinfer 0.73x torch._scaled_mm's µs at M = 128, faster on "
                                   "5 of 5 shapes"),
            MRule(None, _BLOCK_LARGE, "H200 2026-12-03: torch._scaled_mm the fastest at M = 256 and 4096 on 4 of 4 "
                                      "shapes; flashinfer slower on the 3 larger of 5 at M = 1024 and 4096"),
        ),
        source="H200 2026-12-03: bench/results/block_gemm/2026-12-03-h200/ and a flashinfer probe (5 shapes)",
        block=True,
    ),
)


def defaults_for(kind: str, platform: Platform, problem: Any = None) -> PlatformDefaults | None:
    """The rules for ``problem`` (of ``kind``) on ``platform``: the block-wise table for a block-wise problem, else
    the other one (also for ``problem=None``). None when turned off, when none apply, or (other problems) when
    shipped selection data covers the GPU and ``problem``'s class (its dtypes, scale modes and bias: the data's
    nearest-shapes model answers for it; with ``problem=None``, whenever data covers the GPU). A class the data
    lacks keeps these rules: ModelOpt's and compressed-tensors' static per-tensor inputs with fused siblings'
    per-shard scales (per-channel weights) are such a class on the H200, where static priority alone would run
    ``torch._scaled_mm`` at one token too."""
    if not settings.measured_defaults_enabled():
        return None
    table = next((d for d in DEFAULTS if d.covers(kind, platform, problem)), None)
    if table is not None and not table.block:
        from . import shipped

        if shipped.covers(platform) and (problem is None or shipped.nearest_buckets(kind, problem, platform)):
            return None
    return table


def measured_default_policy(
    kind: str, problem: Any, platform: Platform, serving: list[Any]
) -> tuple[Any, dict[str, str], str] | None:
    """The ``auto`` policy: the first preferred built-in provider that can serve this problem's M (and, for the
    block-wise table, is ready: nothing to build for minutes at its first call), or None. The note says which
    preferred providers were passed over and why."""
    m = getattr(problem, "m", None) if problem is not None else None
    table = defaults_for(kind, platform, problem) if m is not None else None
    rule = table.rule_for(m) if table is not None else None
    if rule is None:
        return None
    passed: list[str] = []
    for name in rule.prefer:
        cand = next((c for c in serving if c.entry.builtin and c.entry.name == name), None)
        if cand is None:
            if table.block:
                passed.append(f"{name} cannot serve it here")
            continue
        if table.block:
            pending = pending_build(cand, problem, platform)
            if pending:
                passed.append(f"{name} passed over: {pending}")
                continue
        what = "measured block-wise default" if table.block else "measured default"
        note = f"{what} for {rule.label} on SM {platform.arch} ({rule.source or table.source})"
        if passed:
            note += "; " + "; ".join(passed)
        return cand.entry, {}, note
    logger.debug("measured default for %s prefers %s, none of which can serve %s%s", rule.label,
                 ", ".join(rule.prefer), problem.describe(), f" ({'; '.join(passed)})" if passed else "")
    return None


def buckets(kind: str, platform: Platform, problem: Any = None) -> list[int]:
    """The M buckets the defaults distinguish for ``problem`` on ``platform`` (each bounded rule's ``max_m``, then
    one bucket for every larger M), or ``[]``."""
    table = defaults_for(kind, platform, problem)
    bounds = [r.max_m for r in table.rules if r.max_m is not None] if table is not None else []
    if not bounds:
        return []
    return bounds + [bounds[-1] + 1]


class MeasuredDefaultPolicy(SelectionPolicy):
    """The measured defaults as ``auto``'s last policy rung (rank -100): :func:`measured_default_policy` picks, and
    the buckets are the rules' (:func:`buckets`: ``[16, 17]`` on SM 9.0 without shipped data)."""

    name = POLICY_NAME
    rank = -100

    def pick(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Any]):
        return measured_default_policy(kind, problem, platform, list(serving))

    def buckets(self, kind: str, problem: Any, platform: Platform) -> list[int]:
        return buckets(kind, platform, problem)


POLICY = register_selection_policy(MeasuredDefaultPolicy())

__all__ = ["DEFAULTS", "POLICY", "MRule", "MeasuredDefaultPolicy", "POLICY_NAME", "PlatformDefaults", "buckets",
           "defaults_for", "is_block", "measured_default_policy"]
