"""The model ``auto`` uses for GEMM shapes that the shipped selection data never measured.

Data: for one GPU family, one problem class (dtypes, scale modes, bias) and one M bucket, a set of measured
shapes ``(N, K)``, each with the µs of every candidate (provider + options) the tuner timed there.

At each measured shape a candidate's *relative time* is its µs over that shape's fastest µs (1.0 for the fastest);
a candidate the shape did not measure (it could not serve, failed its check, or was pruned) counts as
:data:`MISSING_RATIO`. The model predicts every candidate's relative time at the asked ``(N, K)`` in two parts:

1. **Trend** (:class:`Trend`): per bucket and candidate, a ridge regression of the log relative time over every
   measured shape of the class, on six or seven features of a shape (:func:`trend_features`): ``log2 N``,
   ``log2 K``, K's and N's alignment (how many times 2 divides them, capped at 256, over 8), and the wave fill on
   the GPU's SMs of each tile grid the tiled kernels (Triton, CUTLASS) launch at that M (:data:`KERNEL_TILES`, from
   their default dispatch tables: 64-wide N tiles up to M = 128, 64x128 tiles up to 512, 128x256 and 128x128
   above). Features are standardized,
   the intercept is not penalized, ``log2 N`` and ``log2 K`` are clamped to the measured range (no extrapolation
   in size). A candidate measured at fewer than ``shapes_per_coefficient`` x its coefficients gets no trend (0).
   The trend carries what holds across shapes (the tiled kernels lose where their last wave is nearly empty or K
   is less aligned; cuBLAS gains with size) to shapes whose measured neighbours are far or all on one side.
2. **Vote of the nearest measured shapes** on the trend's residuals: the ``k`` measured shapes nearest to the
   asked ``(N, K)`` (same class, same bucket), each weighted ``1 / (distance + EPS)^2`` (normalized; a neighbour
   at distance 0.05 outweighs one at 0.5 by 16x), add the weighted mean of their residuals (measured log
   relative time minus the trend there). Near a measured shape the prediction is close to that shape's
   measurement;
   between shapes it is the neighbours' vote corrected by how the trend moves from them to the asked shape.
   Distance is Euclidean over four features of a shape at a bucket M (:func:`features`, weights in
   :class:`Metric`):

   - ``log2 N`` and ``log2 K`` (a factor of 2 in N or K is 1.0);
   - the *wave fill* of a grid of 64x64 (N x M) tiles on the GPU's SMs (132 on the H100/H200 SXM the data was
     measured on): tiles / (waves x SMs), 1.0 when the last wave is full, 0.55 for 144 tiles (one full wave and
     12 tiles). The small-M kernels (Triton swap-AB, CUTLASS) tile N by 64, so a shape just past a whole number
     of waves (N = 9216 at M <= 64: 144 tiles) behaves unlike its neighbour in log N (N = 8192: 128 tiles);
     weight 2;
   - K's alignment: how many times 2 divides K, capped at 7 (K a multiple of 128), over 7; weight 2. Masked K
     tails slow the tiled kernels, not cuBLAS, so a shape with K = 3696 is a poor witness for K = 3584 or 3840.

A candidate's score is ``exp(trend + vote)``: its predicted time relative to the fastest candidate (scaled so that
the best score is at least 1.0). The candidate with the lowest score wins; among those within :data:`TIE_MARGIN`
(1%) of it, the one static priorities rank first. ``trend=None`` is the vote alone (the model before the trend:
the weighted geometric mean of the neighbours' relative times), and ``Metric(wave_weight=0, align_weight=0)`` with
a 2% tie margin the first model (log N, log K only); both are kept for comparisons
(``python -m fp8_backends.selection_data loo --compare vote baseline``).

So the answer is local where the data is dense and follows the data's trend where it is sparse: it comes from the
data of this GPU family at this M, never from a global rule. :func:`leave_out` runs the model on the data itself (each
group of shapes predicted from a model built without it), which measures how well it generalizes without any GPU time:
``bench/results/selection_data_loo/2026-12-01-cpu/`` (held out by model on the H200 data, >= 0.95 of the fastest at 1277
of 1323 points, geomean 0.994, min 0.802; the vote alone: 1264, 0.993, 0.697).

Pure Python, no torch; the trend is fitted once per class when the model is built.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fp8_backends.core.objective import SelectionObjective

from . import host_aware

#: (provider, distribution or "", sorted options)
CandKey = tuple[str, str, tuple[tuple[str, str], ...]]

DEFAULT_NEIGHBOURS = 4
EPS = 0.1
MISSING_RATIO = 2.0
#: predicted scores this close to the best go to static priority (measured choices use the tuner's margin, 0 since
#: 2026-12-01: lockfile.DEFAULT_TIE_MARGIN; this one was chosen by the leave-out studies of the predictions)
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


#: ``(largest M or None, tiles)``: the ``(tile over M, tile over N)`` grids the tiled kernels launch up to that M,
#: from the providers' default dispatch tables as measured (Triton: GEMV at M = 1, swap-AB 16x64 / 32x64 / 64x64,
#: 64x128, then TMA 128x256; CUTLASS: swap-AB 16x64 up to 32, 64x64 up to 128, ping-pong 64x128 up to 512, then
#: 128x128). Shapes the tables name explicitly run other tiles: the trend treats them like any other shape.
KERNEL_TILES: tuple[tuple[int | None, tuple[tuple[int, int], ...]], ...] = (
    (16, ((16, 64),)),
    (32, ((32, 64), (16, 64))),
    (128, ((64, 64),)),
    (512, ((64, 128),)),
    (None, ((128, 256), (128, 128))),
)


@dataclass(frozen=True)
class Trend:
    """The per-candidate trend under the vote (module docstring): ridge penalty ``ridge`` on standardized features,
    alignment capped at ``2 ** align_cap``, the kernels' tile grids per M range, and how many measured shapes per
    coefficient a candidate needs for a trend of its own."""

    ridge: float = 1.0
    align_cap: int = 8
    kernel_tiles: tuple[tuple[int | None, tuple[tuple[int, int], ...]], ...] = KERNEL_TILES
    shapes_per_coefficient: int = 2

    def __post_init__(self) -> None:
        if self.ridge <= 0 or self.align_cap < 1 or self.shapes_per_coefficient < 1:
            raise ValueError("ridge must be > 0, align_cap and shapes_per_coefficient >= 1")
        if not self.kernel_tiles or self.kernel_tiles[-1][0] is not None:
            raise ValueError("kernel_tiles must end with a row for any M (None)")
        if any(not tiles or min(min(t) for t in tiles) < 1 for _, tiles in self.kernel_tiles):
            raise ValueError("every kernel_tiles row needs tiles of at least 1x1")

    def tiles(self, m: int) -> tuple[tuple[int, int], ...]:
        """The tile grids at bucket ``m``."""
        return next(t for top, t in self.kernel_tiles if top is None or m <= top)


DEFAULT_TREND = Trend()


def trend_features(n: int, k: int, m: int, trend: Trend = DEFAULT_TREND, sms: int = DEFAULT_METRIC.sms
                   ) -> tuple[float, ...]:
    """The trend's features of shape ``(n, k)`` at bucket ``m``: log2 N, log2 K, K's and N's alignment, and the wave
    fill of each kernel tile grid at ``m`` on ``sms`` SMs."""
    fills = []
    for tm, tn in trend.tiles(m):
        tiles = -(-m // tm) * -(-n // tn)
        fills.append(tiles / (-(-tiles // sms) * sms))
    cap = trend.align_cap
    return (math.log2(n), math.log2(k), twos(k, cap) / cap, twos(n, cap) / cap, *fills)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``x`` with ``a x = b`` (Gaussian elimination with partial pivoting; ``a`` symmetric positive definite)."""
    size = len(b)
    rows = [list(r) + [v] for r, v in zip(a, b)]
    for col in range(size):
        piv = max(range(col, size), key=lambda r: (abs(rows[r][col]), -r))
        rows[col], rows[piv] = rows[piv], rows[col]
        p = rows[col][col]
        for r in range(col + 1, size):
            f = rows[r][col] / p
            if f:
                rr, rc = rows[r], rows[col]
                for c in range(col, size + 1):
                    rr[c] -= f * rc[c]
    x = [0.0] * size
    for r in range(size - 1, -1, -1):
        x[r] = (rows[r][size] - sum(rows[r][c] * x[c] for c in range(r + 1, size))) / rows[r][r]
    return x


@dataclass(frozen=True)
class _BucketTrend:
    """One bucket's fitted trend: the measured size range, and each candidate's intercept and slopes on the raw
    features (None: no trend for that candidate)."""

    lo: tuple[float, float]
    hi: tuple[float, float]
    coef: Mapping[CandKey, tuple[float, tuple[float, ...]] | None]

    def clamp(self, x: Sequence[float]) -> tuple[float, ...]:
        """Features with log2 N and log2 K clamped to the measured range."""
        return (min(max(x[0], self.lo[0]), self.hi[0]), min(max(x[1], self.lo[1]), self.hi[1]), *x[2:])

    def value(self, ck: CandKey, x: Sequence[float]) -> float:
        """The trend's log relative time of ``ck`` at (clamped) features ``x`` (0.0 without a trend)."""
        fit = self.coef.get(ck)
        if fit is None:
            return 0.0
        intercept, slopes = fit
        return intercept + sum(a * v for a, v in zip(slopes, x))


def _fit_trend(xs: Sequence[Sequence[float]], logs: Mapping[CandKey, Sequence[float | None]], trend: Trend
               ) -> _BucketTrend:
    """Ridge fits of each candidate's log relative times ``logs[ck][i]`` (None: not measured at shape i) on
    features ``xs[i]``."""
    n, p = len(xs), len(xs[0])
    mean = tuple(sum(x[j] for x in xs) / n for j in range(p))
    scale = tuple(math.sqrt(sum((x[j] - mean[j]) ** 2 for x in xs) / n) or 1.0 for j in range(p))
    zs = [[1.0, *((x[j] - mean[j]) / scale[j] for j in range(p))] for x in xs]
    gram: dict[tuple[int, ...], list[list[float]]] = {}
    coef: dict[CandKey, tuple[float, tuple[float, ...]] | None] = {}
    for ck in sorted(logs):
        rows = tuple(i for i, v in enumerate(logs[ck]) if v is not None)
        if len(rows) < trend.shapes_per_coefficient * (p + 1):
            coef[ck] = None
            continue
        if rows not in gram:
            a = [[sum(zs[i][r] * zs[i][c] for i in rows) for c in range(p + 1)] for r in range(p + 1)]
            for j in range(1, p + 1):
                a[j][j] += trend.ridge
            gram[rows] = a
        b = [sum(zs[i][r] * logs[ck][i] for i in rows) for r in range(p + 1)]
        w = _solve(gram[rows], b)
        slopes = tuple(w[j + 1] / scale[j] for j in range(p))  # back to the raw features
        coef[ck] = (w[0] - sum(a * mu for a, mu in zip(slopes, mean)), slopes)
    lo = (min(x[0] for x in xs), min(x[1] for x in xs))
    hi = (max(x[0] for x in xs), max(x[1] for x in xs))
    return _BucketTrend(lo, hi, coef)


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

    @property
    def log_size(self) -> float:
        """``log(N x K)``."""
        return math.log(self.n * self.k)


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
    #: the predicted µs of the fastest candidate (score 1.0) at this shape: the neighbours' fastest µs, each
    #: carried to ``N x K`` along the bucket's size trend (:meth:`NearestModel.size_slope`), weighted like the vote;
    #: ``score x fastest_us`` is a candidate's predicted kernel µs (what the ``host`` objective weighs). 0.0: unknown
    fastest_us: float = 0.0

    def record(self, key: CandKey) -> dict[str, Any]:
        """A choice record for a candidate: ``{"provider", "distribution", "options"}``."""
        provider, dist, options = key
        return {"provider": provider, "distribution": dist or None, "options": dict(options)}

    def describe_neighbours(self) -> str:
        """``"4096x4096 (w 0.52), 6144x4096 (w 0.31)"``."""
        return ", ".join(f"{nb.shape.shape} (w {nb.weight:.2f})" for nb in self.neighbours)

    def kernel_us(self, key: CandKey) -> float | None:
        """A candidate's predicted kernel µs (its score times :attr:`fastest_us`); None when unknown."""
        score = dict(self.scores).get(key)
        return None if score is None or not self.fastest_us else score * self.fastest_us


def distance(n: int, k: int, shape: MeasuredShape, metric: Metric = DEFAULT_METRIC) -> float:
    """The distance from ``(n, k)`` to a measured shape, at that shape's bucket."""
    return math.dist(features(n, k, shape.m, metric), features(shape.n, shape.k, shape.m, metric))


class NearestModel:
    """Measured shapes of one problem class, by M bucket (see the module docstring). ``trend=None``: the vote
    alone."""

    def __init__(self, shapes: Iterable[MeasuredShape], *, neighbours: int = DEFAULT_NEIGHBOURS, eps: float = EPS,
                 missing_ratio: float = MISSING_RATIO, metric: Metric = DEFAULT_METRIC,
                 trend: Trend | None = DEFAULT_TREND) -> None:
        if neighbours < 1:
            raise ValueError("neighbours must be >= 1")
        self.by_bucket: dict[int, list[MeasuredShape]] = {}
        for s in shapes:
            self.by_bucket.setdefault(s.m, []).append(s)
        for values in self.by_bucket.values():
            values.sort(key=lambda s: (s.n, s.k, s.key))
        self.buckets = sorted(self.by_bucket)
        self.neighbours, self.eps, self.missing_ratio, self.metric = neighbours, eps, missing_ratio, metric
        self.trend = trend
        #: per bucket, the slope of log(fastest µs) over log(N x K) across the measured shapes (clamped to [0, 1];
        #: 1.0 without spread): how the fastest time grows with the weight's size, which carries each neighbour's
        #: fastest µs to the asked shape (:attr:`Prediction.fastest_us`)
        self.size_slope: dict[int, float] = {b: _size_slope(values) for b, values in self.by_bucket.items()}
        # per bucket, computed once: the trend, and each shape's features with its residual log relative time per
        # candidate (what the vote averages; the log relative time itself without a trend)
        self._trends: dict[int, _BucketTrend] = {}
        self._points: dict[int, list[tuple[tuple[float, ...], MeasuredShape, dict[CandKey, float]]]] = {}
        missing = math.log(missing_ratio)
        for b, values in self.by_bucket.items():
            keys = sorted({ck for s in values for ck in s.ratios})
            logs = {ck: [math.log(s.ratios[ck]) if ck in s.ratios else None for s in values] for ck in keys}
            fitted, xs = None, []
            if trend is not None:
                xs = [trend_features(s.n, s.k, b, trend, metric.sms) for s in values]
                fitted = self._trends[b] = _fit_trend(xs, logs, trend)
            self._points[b] = [
                (features(s.n, s.k, b, metric), s,
                 {ck: (missing if logs[ck][i] is None else logs[ck][i])
                  - (0.0 if fitted is None else fitted.value(ck, xs[i])) for ck in keys})
                for i, s in enumerate(values)]

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_bucket.values())

    def rebuilt(self, shapes: Iterable[MeasuredShape]) -> NearestModel:
        """A model of this type with these settings on other shapes."""
        return type(self)(shapes, neighbours=self.neighbours, eps=self.eps, missing_ratio=self.missing_ratio,
                            metric=self.metric, trend=self.trend)

    def predict(self, n: int, k: int, bucket: int,
                exclude: Callable[[MeasuredShape], bool] | None = None) -> Prediction | None:
        """Scores for ``(n, k)`` at ``bucket`` (which must be one of :attr:`buckets`); None without data.
        ``exclude`` keeps shapes out of the vote only (the trend was fitted on every shape: to hold shapes out of
        both, build a model without them, as :func:`leave_out` does)."""
        if n < 1 or k < 1:
            return None
        q = features(n, k, bucket, self.metric)
        dist = math.dist
        points = self._points.get(bucket, ())
        ranked = heapq.nsmallest(self.neighbours, [(dist(q, f), s.n, s.k, s.key, i)
                                                   for i, (f, s, _) in enumerate(points)
                                                   if exclude is None or not exclude(s)])
        if not ranked:
            return None
        near = [(t[0], *points[t[4]][1:]) for t in ranked]
        raw = [1.0 / (d + self.eps) ** 2 for d, _, _ in near]
        total = sum(raw)
        nbs = tuple(Neighbour(s, d, w / total) for (d, s, _), w in zip(near, raw))
        keys = sorted({ck for nb in nbs for ck in nb.shape.ratios})
        fitted = self._trends.get(bucket)
        x = None if fitted is None or self.trend is None else fitted.clamp(
            trend_features(n, k, bucket, self.trend, self.metric.sms))
        logs = []
        for ck in keys:
            log_sum = sum(nb.weight * r[ck] for nb, (_, _, r) in zip(nbs, near))
            logs.append((ck, log_sum + (0.0 if x is None else fitted.value(ck, x))))
        floor = min(0.0, min(v for _, v in logs))  # the best score is at least 1.0 (relative to the fastest)
        scores = sorted(((ck, math.exp(v - floor)) for ck, v in logs), key=lambda t: (t[1], t[0]))
        slope, size = self.size_slope.get(bucket, 1.0), math.log(n * k)
        fastest = math.exp(sum(nb.weight * (math.log(nb.shape.fastest_us) + slope * (size - nb.shape.log_size))
                               for nb in nbs))
        return Prediction(n, k, bucket, nbs, tuple(scores), fastest)


def _size_slope(shapes: Sequence[MeasuredShape]) -> float:
    """The least-squares slope of log(fastest µs) over log(N x K), clamped to [0, 1] (1.0: no spread in size)."""
    xs = [s.log_size for s in shapes]
    ys = [math.log(s.fastest_us) for s in shapes]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var <= 1e-12:
        return 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return min(max(slope, 0.0), 1.0)


def choose(
    scores: Sequence[tuple[CandKey, float]], rank: Callable[[CandKey], tuple | None], tie_margin: float, *,
    objective: SelectionObjective | str = SelectionObjective.KERNEL,
    host: Callable[[CandKey], float | None] | None = None, fastest_us: float = 0.0,
    lower: Sequence[host_aware.Row] | None = None,
) -> tuple[CandKey, float] | None:
    """The winner among the candidates ``rank`` accepts (it returns a static rank, or None for a candidate that
    cannot serve): the best score, or among the scores within ``tie_margin`` of it the best static rank.

    Under the ``host`` objective that winner is the kernel answer, and the candidates are re-ranked by the cost of
    a host-enqueued call (:func:`.host_aware.choose`): ``host(ck)`` is a candidate's host µs (None: undeclared)
    and ``fastest_us`` the predicted µs of score 1.0 (:attr:`Prediction.fastest_us`); without them (or with
    ``fastest_us`` 0) the kernel answer stands. ``lower``: the candidates' rows predicted at the bottom of the M
    range the bucket serves (:func:`.host_aware.span_choice`)."""
    ok = [(ck, s, r) for ck, s in scores if (r := rank(ck)) is not None]
    if not ok:
        return None
    best = min(s for _, s, _ in ok)
    near = [t for t in ok if t[1] <= best * (1.0 + tie_margin)]
    ck, score, _ = min(near, key=lambda t: (t[2], t[1], t[0]))
    if SelectionObjective.of(objective).for_resolution() is not SelectionObjective.HOST or host is None \
            or not fastest_us > 0:
        return ck, score
    rows = host_rows(ok, host, fastest_us)
    won = host_aware.choose(rows, SelectionObjective.HOST, incumbent=ck, lower=lower)
    return (ck, score) if won is None else (won.key, next(s for c, s, _ in ok if c == won.key))


def host_rows(ranked: Sequence[tuple[CandKey, float, tuple]], host: Callable[[CandKey], float | None],
              fastest_us: float) -> list[host_aware.Row]:
    """``(candidate, score, static rank)`` triples as :class:`.host_aware.Row`: predicted kernel µs
    ``score x fastest_us``, host µs ``host(candidate)``."""
    return [host_aware.Row(ck, s * fastest_us, host(ck), r, ck[0]) for ck, s, r in ranked]


def entries_by_class(entries: Mapping[str, Mapping[str, Any]]) -> dict[tuple, dict[str, Mapping[str, Any]]]:
    """Lockfile-format GEMM entries grouped by problem class (:func:`class_key`; other kinds are left out)."""
    out: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for key, entry in entries.items():
        problem = entry.get("problem")
        if entry.get("kind") == "gemm" and isinstance(problem, Mapping):
            out.setdefault(class_key(problem), {})[key] = entry
    return out


def build_model(entries: Mapping[str, Mapping[str, Any]], **kw: Any) -> NearestModel | None:
    """The model of entries of one class (:func:`entries_by_class`), or None when none of them is usable."""
    shapes = [s for s in (MeasuredShape.from_entry(key, entry) for key, entry in entries.items()) if s is not None]
    return NearestModel(shapes, **kw) if shapes else None


def build_models(entries: Mapping[str, Mapping[str, Any]], **kw: Any) -> dict[tuple, NearestModel]:
    """One model per GEMM problem class from lockfile-format entries (others are ignored)."""
    built = {ck: build_model(group, **kw) for ck, group in entries_by_class(entries).items()}
    return {ck: model for ck, model in built.items() if model is not None}


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
    """Predict every measured shape from a model built, with ``model``'s settings, on the shapes outside its group
    (``group_of``, e.g. its model): neither the vote nor the trend sees the group. Shapes whose group is None are
    not predicted (and stay in every prediction's data)."""
    every = [s for b in model.buckets for s in model.by_bucket[b]]
    held: dict[str, NearestModel | None] = {}
    rows = []
    for bucket in model.buckets:
        for shape in model.by_bucket[bucket]:
            group = group_of(shape)
            if group is None:
                continue
            if group not in held:
                rest = [s for s in every if group_of(s) != group]
                held[group] = model.rebuilt(rest) if rest else None
            other = held[group]
            pred = None if other is None or bucket not in other.by_bucket else other.predict(shape.n, shape.k, bucket)
            picked = None if pred is None else choose(pred.scores, rank, tie_margin)
            if picked is None:
                rows.append(LeaveOutRow(shape, group, None, None, None))
                continue
            rows.append(LeaveOutRow(shape, group, picked[0], picked[1], shape.ratios.get(picked[0])))
    return rows


__all__ = [
    "DEFAULT_METRIC",
    "DEFAULT_NEIGHBOURS",
    "DEFAULT_TREND",
    "KERNEL_TILES",
    "LOG_SHAPE_METRIC",
    "TIE_MARGIN",
    "CandKey",
    "LeaveOutRow",
    "MeasuredShape",
    "Metric",
    "NearestModel",
    "Neighbour",
    "Prediction",
    "Trend",
    "build_model",
    "build_models",
    "cand_key",
    "cand_label",
    "choose",
    "class_key",
    "distance",
    "features",
    "leave_out",
    "trend_features",
    "twos",
    "wave_fill",
]
