"""Every model variant tried for unseen shapes, evaluated the same way (no GPU).

Leave-out on the shipped H200 data by model, family, TP split and shape (``nearest.leave_out``: each group predicted
by a model built without it), and the replay on the independent held-out bench (``heldout_replay.py``):

    python bench/results/2026-12-01-loo-model2/variants.py > bench/results/2026-12-01-loo-model2/variants.md

Cells: geomean / min / points below 0.95 of the fastest. Pure Python, ~10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import heldout_replay  # noqa: E402

from fp8_backends import selection_data  # noqa: E402
from fp8_backends.registry import nearest, shipped_data  # noqa: E402

GROUPS = ("model", "family", "tp", "shape")


class TrendOnly(nearest.NearestModel):
    """The per-candidate cost model alone: the trend's prediction, no vote (argmin of the fitted log relative
    time; the neighbours only say which candidates exist)."""

    def predict(self, n, k, bucket, exclude=None):
        pred = super().predict(n, k, bucket, exclude)
        if pred is None:
            return None
        fitted = self._trends[bucket]
        x = fitted.clamp(nearest.trend_features(n, k, bucket, self.trend, self.metric.sms))
        scores = sorted(((ck, math.exp(fitted.value(ck, x))) for ck, _ in pred.scores), key=lambda t: (t[1], t[0]))
        return nearest.Prediction(n, k, bucket, pred.neighbours, tuple(scores))


def risk_aware(kappa: float) -> type[nearest.NearestModel]:
    class Risk(nearest.NearestModel):
        """Trend + vote, plus ``kappa`` x the weighted spread of the neighbours' residuals (a candidate the
        neighbours disagree on is charged for it)."""

        def predict(self, n, k, bucket, exclude=None):
            pred = super().predict(n, k, bucket, exclude)
            if pred is None:
                return None
            res = {id(s): r for _, s, r in self._points[bucket]}
            scores = []
            for ck, score in pred.scores:
                vals = [(nb.weight, res[id(nb.shape)][ck]) for nb in pred.neighbours]
                mean = sum(w * v for w, v in vals)
                sd = math.sqrt(sum(w * (v - mean) ** 2 for w, v in vals))
                scores.append((ck, score * math.exp(kappa * sd)))
            scores.sort(key=lambda t: (t[1], t[0]))
            return nearest.Prediction(n, k, bucket, pred.neighbours, tuple(scores))
    return Risk


ORIGINAL_FEATURES = nearest.trend_features


def features_64x64(n, k, m, trend=nearest.DEFAULT_TREND, sms=132):
    """The trend with the kNN's 64x64 (N x M) grid instead of the kernels' tile grids."""
    base = ORIGINAL_FEATURES(n, k, m, trend, sms)[:4]
    tiles = -(-m // 64) * -(-n // 64)
    return (*base, tiles / (-(-tiles // sms) * sms))


def features_no_alignment(n, k, m, trend=nearest.DEFAULT_TREND, sms=132):
    f = ORIGINAL_FEATURES(n, k, m, trend, sms)
    return (f[0], f[1], *f[4:])


def features_quadratic(n, k, m, trend=nearest.DEFAULT_TREND, sms=132):
    f = ORIGINAL_FEATURES(n, k, m, trend, sms)
    return (*f, f[0] * f[0], f[1] * f[1], f[0] * f[1])


def features_k_tail(n, k, m, trend=nearest.DEFAULT_TREND, sms=132):
    """Plus the wasted share of the last K block of 128 and of 256 (the tiled kernels' BLOCK_K)."""
    f = ORIGINAL_FEATURES(n, k, m, trend, sms)
    return (*f, (-k % 128) / 128, (-k % 256) / 256)


@contextlib.contextmanager
def trend_features_as(fn: Callable | None) -> Iterator[None]:
    if fn is None:
        yield
        return
    nearest.trend_features = fn
    try:
        yield
    finally:
        nearest.trend_features = ORIGINAL_FEATURES


#: name -> (model class, keyword arguments of the model, trend feature function or None)
VARIANTS: list[tuple[str, type[nearest.NearestModel], dict, Callable | None]] = [
    ("vote alone (the model before: nearest shapes' vote, no trend)", nearest.NearestModel, {"trend": None}, None),
    ("**trend + vote (adopted)**", nearest.NearestModel, {}, None),
    ("trend alone: per-candidate ridge cost model, argmin", TrendOnly, {}, None),
    ("trend on the 64x64 grid's fill instead of the kernels' tile grids", nearest.NearestModel, {}, features_64x64),
    ("trend without the alignment features", nearest.NearestModel, {}, features_no_alignment),
    ("trend + quadratic size terms (log2 N^2, log2 K^2, log2 N log2 K)", nearest.NearestModel, {},
     features_quadratic),
    ("trend + K tail features (BLOCK_K 128, 256)", nearest.NearestModel, {}, features_k_tail),
    ("risk-aware: trend + vote + 0.5 x the neighbours' residual spread", risk_aware(0.5), {}, None),
    ("risk-aware: + 1.0 x spread", risk_aware(1.0), {}, None),
    ("ridge 0.3", nearest.NearestModel, {"trend": nearest.Trend(ridge=0.3)}, None),
    ("ridge 3", nearest.NearestModel, {"trend": nearest.Trend(ridge=3.0)}, None),
    ("k = 6", nearest.NearestModel, {"neighbours": 6}, None),
    ("k = 8", nearest.NearestModel, {"neighbours": 8}, None),
    ("eps 0.2", nearest.NearestModel, {"eps": 0.2}, None),
    ("trend only with >= 4 shapes per coefficient", nearest.NearestModel,
     {"trend": nearest.Trend(shapes_per_coefficient=4)}, None),
]


def loo(entries, cls, kw, rank) -> dict[str, tuple[float, float, int]]:
    models = {c: cls([s for b in m.buckets for s in m.by_bucket[b]], **kw)
              for c, m in nearest.build_models(entries, trend=None).items()}
    out = {}
    for group in GROUPS:
        of = selection_data._group_of(group)
        speeds = [1.0 / r.actual for model in models.values()
                  for r in nearest.leave_out(model, of, rank, nearest.TIE_MARGIN) if r.actual is not None]
        out[group] = (math.exp(sum(map(math.log, speeds)) / len(speeds)), min(speeds), sum(v < 0.95 for v in speeds))
    return out


def main() -> None:
    entries = shipped_data.the_section(shipped_data.load_file(heldout_replay.DATA))["entries"]
    rank = selection_data._static_rank(selection_data._provider_priorities())
    rows = heldout_replay.bench_rows()
    print("| variant | by model | by family | by TP | by shape | held-out bench replay |")
    print("|---|---|---|---|---|---|")
    for name, cls, kw, feats in VARIANTS:
        t0 = time.perf_counter()
        with trend_features_as(feats):
            res = loo(entries, cls, kw, rank)

            def build(e, cls=cls, kw=kw):
                return {c: cls([s for b in m.buckets for s in m.by_bucket[b]], **kw)
                        for c, m in nearest.build_models(e, trend=None).items()}

            g, lo, ok = heldout_replay.summary(heldout_replay.replay(build, nearest.TIE_MARGIN, rows))
        cells = " | ".join(f"{res[x][0]:.4f} / {res[x][1]:.3f} / {res[x][2]}" for x in GROUPS)
        print(f"| {name} | {cells} | {g:.4f} / {lo:.3f} / {len(rows) - ok} |", flush=True)
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
