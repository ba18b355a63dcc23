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

These global M rules are a fallback for GPUs the shipped selection data (:mod:`.shipped`) does not cover: where a
data file exists for the GPU's SM, the per-shape data decides (a rule learnt on the four Llama-3-8B shapes loses to
cuBLAS on others, e.g. 0.89x at N=4608 K=3584 M=1) and these rules step aside entirely.

Only built-in providers are named here (a third-party provider that happens to be called ``triton`` is never
picked by these rules). :func:`buckets` gives :class:`fp8_backends.layers.Fp8Linear` the M buckets to
prepare one weight per provider for, as the lockfile's buckets do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fp8_backends.core import settings

from .platform import Platform
from .policy import SelectionPolicy, register_selection_policy

logger = logging.getLogger("fp8_backends")

POLICY_NAME = "measured-default"


@dataclass(frozen=True)
class MRule:
    """Problems with ``M <= max_m`` prefer the built-in providers ``prefer`` (in order)."""

    max_m: int
    prefer: tuple[str, ...]


@dataclass(frozen=True)
class PlatformDefaults:
    """The rules of one kind (``gemm``) for GPUs with ``min_sm <= SM <= max_sm``; rules ascend in ``max_m``."""

    kind: str
    min_sm: tuple[int, int]
    max_sm: tuple[int, int]
    rules: tuple[MRule, ...]
    source: str

    def covers(self, kind: str, platform: Platform) -> bool:
        return kind == self.kind and platform.sm is not None and self.min_sm <= platform.sm <= self.max_sm

    def rule_for(self, m: int) -> MRule | None:
        return next((r for r in self.rules if m <= r.max_m), None)


DEFAULTS: tuple[PlatformDefaults, ...] = (
    PlatformDefaults(
        kind="gemm",
        min_sm=(9, 0),
        max_sm=(9, 0),
        rules=(MRule(16, ("triton",)),),
        source="H200, 2026-11-29: triton 1.12x torch._scaled_mm geomean at M <= 16 (Llama-3-8B shapes)",
    ),
)


def defaults_for(kind: str, platform: Platform) -> PlatformDefaults | None:
    """The rules for ``kind`` on ``platform``; None when turned off, when none apply, or when shipped selection
    data covers the GPU."""
    if not settings.measured_defaults_enabled():
        return None
    table = next((d for d in DEFAULTS if d.covers(kind, platform)), None)
    if table is not None:
        from . import shipped

        if shipped.covers(platform):
            return None
    return table


def measured_default_policy(
    kind: str, problem: Any, platform: Platform, serving: list[Any]
) -> tuple[Any, dict[str, str], str] | None:
    """The ``auto`` policy: the first preferred built-in provider that can serve this problem's M, or None."""
    m = getattr(problem, "m", None) if problem is not None else None
    table = defaults_for(kind, platform) if m is not None else None
    rule = table.rule_for(m) if table is not None else None
    if rule is None:
        return None
    for name in rule.prefer:
        for cand in serving:
            if cand.entry.builtin and cand.entry.name == name:
                return cand.entry, {}, f"measured default for M <= {rule.max_m} on SM {platform.arch} ({table.source})"
    logger.debug("measured default for M <= %d prefers %s, none of which can serve %s", rule.max_m,
                 ", ".join(rule.prefer), problem.describe())
    return None


def buckets(kind: str, platform: Platform) -> list[int]:
    """The M buckets the defaults distinguish on ``platform`` (each rule's ``max_m``, then one bucket for
    every larger M), or ``[]``."""
    table = defaults_for(kind, platform)
    if table is None or not table.rules:
        return []
    return [r.max_m for r in table.rules] + [table.rules[-1].max_m + 1]


class MeasuredDefaultPolicy(SelectionPolicy):
    """The measured defaults as ``auto``'s last policy rung (rank -100): :func:`measured_default_policy` picks, and
    the buckets are the rules' (:func:`buckets`: ``[16, 17]`` on SM 9.0 without shipped data)."""

    name = POLICY_NAME
    rank = -100

    def pick(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Any]):
        return measured_default_policy(kind, problem, platform, list(serving))

    def buckets(self, kind: str, problem: Any, platform: Platform) -> list[int]:
        return buckets(kind, platform)


POLICY = register_selection_policy(MeasuredDefaultPolicy())

__all__ = ["DEFAULTS", "POLICY", "MRule", "MeasuredDefaultPolicy", "POLICY_NAME", "PlatformDefaults", "buckets",
           "defaults_for", "measured_default_policy"]
