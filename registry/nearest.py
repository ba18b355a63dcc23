"""The model ``auto`` uses for GEMM shapes that the shipped selection data never measured.

Data: for one GPU family, one problem class (dtypes, scale modes, bias) and one M bucket, a set of measured
shapes ``(N, K)``, each with the µs of every candidate (provider + options) the tuner timed there.

Model: the ``k`` measured shapes nearest to the asked ``(N, K)`` (same class, same bucket) vote. Distance is
Euclidean over four features of a shape at a bucket M (:func:`features`, weights in :class:`Metric`):

- ``log2 N`` and ``log2 K`` (a factor of 2 in N or K is 1.0);
- the *wave fill* of a grid of 64x64 (N x M) tiles on the GPU's SMs (132 on the H100/H200 SXM the data was
  measured on): tiles / (waves x SMs), 1.0 when the last wave is full, 0.55 for 144 tiles (one full wave and 12
  tiles). The small-M kernels (Triton swap-AB, CUTLASS) tile N by 64, so a shape just past a whole number of
  waves (N = 9216 at M <= 64: 144 tiles) behaves unlike its neighbour in log N (N = 8192: 128 tiles); weight 2;
- K's alignment: how many times 2 divides K, capped at 7 (K a multiple of 128), over 7; weight 2. Masked K tails
  slow the tiled kernels, not cuBLAS, so a shape with K = 3696 is a poor witness for K = 3584 or 3840.

At each neighbour a candidate's *relative time* is its µs over that neighbour's fastest µs (1.0 for
the fastest); a candidate the neighbour did not measure (it could not serve, failed its check, or was pruned)
counts as :data:`MISSING_RATIO`. A candidate's score is the weighted geometric mean of its relative times with
weights ``1 / (distance + EPS)^2`` (a neighbour at distance 0.05 outweighs one at 0.5 by 16x). The candidate
with the lowest score wins; among those within :data:`TIE_MARGIN` (1%) of it, the one static priorities rank
first. The score itself is the predicted time relative to the fastest candidate. ``Metric(wave_weight=0,
align_weight=0)`` with a 2% tie margin is the first model (log N, log K only), kept for comparisons
(``python -m fp8_backends.selection_data loo --baseline``).

So the answer is always local: it comes from the data of this GPU family near this shape and M, never from a
global rule. :func:`leave_out` runs the model on the data itself (each group of shapes predicted from the
others), which measures how well it generalizes without any GPU time.

Pure Python, no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: (provider, distribution or "", sorted options)
CandKey = tuple[str, str, tuple[tuple[str, str], ...]]

DEFAULT_NEIGHBOURS = 4
EPS = 0.1
MISSING_RATIO = 2.0
#: predicted scores this close to the best go to static priority (measured near-ties use the tuner's 2%)
TIE_MARGIN = 0.01


def cand_key(record: Mapping[str, Any]) -> CandKey:
    """The identity of a candidate record ``{"provider", "distribution", "options"}``."""
    options = record.get("options") or {}
    return (str(record["provider"]), str(record.get("distribution") or ""),
            tuple(sorted((str(k), str(v)) for k, v in options.items())))


def cand_label(key: CandKey) -> str:
    """``cutlass[config=auto]`` (options in key order)."""
    provider, _, options = key
    return f"{provider}[{','.join(f'{k}={v}' for k, v in options)}]" if options else provider


def class_key(fields: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A problem's class: its fields without N and K (dtypes, scale modes, bias)."""
    return tuple(sorted((k, v) for k, v in fields.items() if k not in ("n", "k")))


@dataclass(frozen=True)
class Metric:
    """What the distance between two shapes measures (module docstring). ``sms``: the SM count of the GPU the data
    was measured on (``provenance.model.sms``; 132 on the H100/H200 SXM)."""

    sms: int = 132
    tile_n: int = 64
    tile_m: int = 64
    wave_weight: float = 2.0
    align_weight: float = 2.0
    align_cap: int = 7

    def __post_init__(self) -> None:
        if self.sms < 1 or self.tile_n < 1 or self.tile_m < 1 or self.align_cap < 1:
            raise ValueError("sms, tile_n, tile_m and align_cap must be >= 1")
        if self.wave_weight < 0 or self.align_weight < 0:
            raise ValueError("feature weights must be >= 0")


DEFAULT_METRIC = Metric()
#: the first model: log N and log K only
LOG_SHAPE_METRIC = Metric(wave_weight=0.0, align_weight=0.0)


def twos(value: int, cap: int) -> int:
    """How many times 2 divides ``value`` (``value`` >= 1), at most ``cap``."""
    count = 0
    while count < cap and value % 2 == 0:
        value //= 2
        count += 1
    return count


def wave_fill(n: int, m: int, metric: Metric = DEFAULT_METRIC) -> float:
    """The fill of the last wave of ``ceil(N / tile_n) x ceil(M / tile_m)`` tiles on ``sms`` SMs (0-1]."""
    tiles = -(-n // metric.tile_n) * -(-m // metric.tile_m)
    return tiles / (-(-tiles // metric.sms) * metric.sms)


def features(n: int, k: int, m: int, metric: Metric = DEFAULT_METRIC) -> tuple[float, float, float, float]:
    """The weighted features of shape ``(n, k)`` at bucket ``m`` (module docstring)."""
    return (math.log2(n), math.log2(k), metric.wave_weight * wave_fill(n, m, metric),
            metric.align_weight * twos(k, metric.align_cap) / metric.align_cap)


@dataclass(frozen=True)
class MeasuredShape:
    """One tuned entry: shape, bucket, the fastest µs and every measured candidate relative to it."""

    n: int
    k: int
    m: int
    key: str
    labels: tuple[str, ...]
    fastest_us: float
    ratios: Mapping[CandKey, float]
    records: Mapping[CandKey, Mapping[str, Any]] = field(repr=False)

    @classmethod
    def from_entry(cls, key: str, entry: Mapping[str, Any]) -> MeasuredShape | None:
        """None when the entry has no measured candidate."""
        times: dict[CandKey, float] = {}
        records: dict[CandKey, Mapping[str, Any]] = {}
        for rec in entry.get("ranking") or ():
            us = rec.get("us") if isinstance(rec, dict) else None
            if isinstance(us, (int, float)) and not isinstance(us, bool) and us > 0 and "provider" in rec:
                ck = cand_key(rec)
                if ck not in times or us < times[ck]:
                    times[ck], records[ck] = float(us), rec
        if not times:
            return None
        fastest = min(times.values())
        problem = entry["problem"]
        return cls(int(problem["n"]), int(problem["k"]), int(entry["m"]), key, tuple(entry.get("labels") or ()),
                   fastest, {ck: us / fastest for ck, us in times.items()}, records)

    @property
    def shape(self) -> str:
        return f"{self.n}x{self.k}"


@dataclass(frozen=True)
class Neighbour:
    shape: MeasuredShape
    distance: float
    weight: float  # normalized: the neighbours' weights sum to 1


@dataclass(frozen=True)
class Prediction:
    """The model's answer for one shape and bucket: neighbours and every candidate's predicted relative time."""

    n: int
    k: int
    bucket: int
    neighbours: tuple[Neighbour, ...]
    scores: tuple[tuple[CandKey, float], ...]  # ascending score, then key

    def record(self, key: CandKey) -> dict[str, Any]:
        """A choice record for a candidate: ``{"provider", "distribution", "options"}``."""
        provider, dist, options = key
        return {"provider": provider, "distribution": dist or None, "options": dict(options)}

    def describe_neighbours(self) -> str:
        """``"4096x4096 (w 0.52), 6144x4096 (w 0.31)"``."""
        return ", ".join(f"{nb.shape.shape} (w {nb.weight:.2f})" for nb in self.neighbours)


def distance(n: int, k: int, shape: MeasuredShape, metric: Metric = DEFAULT_METRIC) -> float:
    """The distance from ``(n, k)`` to a measured shape, at that shape's bucket."""
    return math.dist(features(n, k, shape.m, metric), features(shape.n, shape.k, shape.m, metric))


class NearestModel:
    """Measured shapes of one problem class, by M bucket (see the module docstring)."""

    def __init__(self, shapes: Iterable[MeasuredShape], *, neighbours: int = DEFAULT_NEIGHBOURS, eps: float = EPS,
                 missing_ratio: float = MISSING_RATIO, metric: Metric = DEFAULT_METRIC) -> None:
        if neighbours < 1:
            raise ValueError("neighbours must be >= 1")
        self.by_bucket: dict[int, list[MeasuredShape]] = {}
        for s in shapes:
            self.by_bucket.setdefault(s.m, []).append(s)
        for values in self.by_bucket.values():
            values.sort(key=lambda s: (s.n, s.k, s.key))
        self.buckets = sorted(self.by_bucket)
        self.neighbours, self.eps, self.missing_ratio, self.metric = neighbours, eps, missing_ratio, metric
        # each bucket's shapes with their features, computed once
        self._points = {b: [(features(s.n, s.k, b, metric), s) for s in v] for b, v in self.by_bucket.items()}

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_bucket.values())

    def predict(self, n: int, k: int, bucket: int,
                exclude: Callable[[MeasuredShape], bool] | None = None) -> Prediction | None:
        """Scores for ``(n, k)`` at ``bucket`` (which must be one of :attr:`buckets`); None without data."""
        if n < 1 or k < 1:
            return None
        q = features(n, k, bucket, self.metric)
        dist = math.dist
        near = heapq.nsmallest(
            self.neighbours,
            ((dist(q, f), s) for f, s in self._points.get(bucket, ()) if exclude is None or not exclude(s)),
            key=lambda t: (t[0], t[1].n, t[1].k, t[1].key))
        if not near:
            return None
        raw = [1.0 / (d + self.eps) ** 2 for d, _ in near]
        total = sum(raw)
        nbs = tuple(Neighbour(s, d, w / total) for (d, s), w in zip(near, raw))
        keys = sorted({ck for nb in nbs for ck in nb.shape.ratios})
        scores = []
        for ck in keys:
            log_sum = sum(nb.weight * math.log(nb.shape.ratios.get(ck, self.missing_ratio)) for nb in nbs)
            scores.append((ck, math.exp(log_sum)))
        scores.sort(key=lambda t: (t[1], t[0]))
        return Prediction(n, k, bucket, nbs, tuple(scores))


def choose(
    scores: Sequence[tuple[CandKey, float]], rank: Callable[[CandKey], tuple | None], tie_margin: float
) -> tuple[CandKey, float] | None:
    """The winner among the candidates ``rank`` accepts (it returns a static rank, or None for a candidate that
    cannot serve): the best score, or among the scores within ``tie_margin`` of it the best static rank."""
    ok = [(ck, s, r) for ck, s in scores if (r := rank(ck)) is not None]
    if not ok:
        return None
    best = min(s for _, s, _ in ok)
    near = [t for t in ok if t[1] <= best * (1.0 + tie_margin)]
    ck, score, _ = min(near, key=lambda t: (t[2], t[1], t[0]))
    return ck, score


def build_models(entries: Mapping[str, Mapping[str, Any]], **kw: Any) -> dict[tuple, NearestModel]:
    """One model per GEMM problem class from lockfile-format entries (others are ignored)."""
    shapes: dict[tuple, list[MeasuredShape]] = {}
    for key, entry in entries.items():
        if entry.get("kind") != "gemm":
            continue
        shape = MeasuredShape.from_entry(key, entry)
        if shape is not None:
            shapes.setdefault(class_key(entry["problem"]), []).append(shape)
    return {ck: NearestModel(v, **kw) for ck, v in shapes.items()}


@dataclass(frozen=True)
class LeaveOutRow:
    """One measured shape predicted without its group: what the model picked and how fast that was there."""

    shape: MeasuredShape
    group: str
    picked: CandKey | None
    predicted: float | None
    actual: float | None  # the picked candidate's measured µs over the fastest (None: not measured there)


def leave_out(
    model: NearestModel, group_of: Callable[[MeasuredShape], str | None], rank: Callable[[CandKey], tuple | None],
    tie_margin: float,
) -> list[LeaveOutRow]:
    """Predict every measured shape from the shapes outside its group (``group_of``, e.g. its model). Shapes whose
    group is None are not predicted (and stay in every prediction's data)."""
    rows = []
    for bucket in model.buckets:
        for shape in model.by_bucket[bucket]:
            group = group_of(shape)
            if group is None:
                continue
            pred = model.predict(shape.n, shape.k, bucket, exclude=lambda s, g=group: group_of(s) == g)
            picked = None if pred is None else choose(pred.scores, rank, tie_margin)
            if picked is None:
                rows.append(LeaveOutRow(shape, group, None, None, None))
                continue
            rows.append(LeaveOutRow(shape, group, picked[0], picked[1], shape.ratios.get(picked[0])))
    return rows


__all__ = [
    "DEFAULT_METRIC",
    "DEFAULT_NEIGHBOURS",
    "LOG_SHAPE_METRIC",
    "TIE_MARGIN",
    "CandKey",
    "LeaveOutRow",
    "MeasuredShape",
    "Metric",
    "NearestModel",
    "Neighbour",
    "Prediction",
    "build_models",
    "cand_key",
    "cand_label",
    "choose",
    "class_key",
    "distance",
    "features",
    "leave_out",
    "twos",
    "wave_fill",
]
