"""A different model family for unseen shapes: a random forest of multi-output regression trees per M bucket (numpy).

Each tree predicts every candidate's log relative time at once from the trend's features
(``nearest.trend_features``: log2 N, log2 K, K and N alignment, the kernels' wave fills); 30 trees, depth 6, 3
features tried per split, at least 3 shapes per leaf, bootstrap samples, seed 0 (deterministic). The pick is the
argmin of the forest's mean. Evaluated like ``variants.py`` (leave-out by model, family, TP split, shape; the
held-out bench replay):

    python bench/results/2026-12-01-loo-model2/forest.py > bench/results/2026-12-01-loo-model2/forest.md

Not a candidate for the library (numpy, and a fit of ~0.3 s per class): kept to show what a nonparametric model
does with the same features.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import heldout_replay  # noqa: E402
import variants  # noqa: E402

from fp8_backends import selection_data  # noqa: E402
from fp8_backends.registry import nearest, shipped_data  # noqa: E402

TREES, DEPTH, MIN_LEAF, MTRY = 30, 6, 3, 3


def grow(x, y, idx, depth, rng):
    if depth == 0 or len(idx) < 2 * MIN_LEAF:
        return y[idx].mean(0)
    best = None
    for f in rng.sample(range(x.shape[1]), min(MTRY, x.shape[1])):
        order = idx[np.argsort(x[idx, f], kind="stable")]
        xs, ys = x[order, f], y[order]
        cs, cs2 = np.cumsum(ys, 0), np.cumsum(ys ** 2, 0)
        n = len(order)
        for i in range(MIN_LEAF, n - MIN_LEAF + 1):
            if xs[i - 1] == xs[i]:
                continue
            left = (cs2[i - 1] - cs[i - 1] ** 2 / i).sum()
            right = ((cs2[-1] - cs2[i - 1]) - (cs[-1] - cs[i - 1]) ** 2 / (n - i)).sum()
            if best is None or left + right < best[0]:
                best = (left + right, f, (xs[i - 1] + xs[i]) / 2)
    if best is None:
        return y[idx].mean(0)
    _, f, t = best
    return (f, t, grow(x, y, idx[x[idx, f] <= t], depth - 1, rng), grow(x, y, idx[x[idx, f] > t], depth - 1, rng))


def walk(node, v):
    while isinstance(node, tuple):
        f, t, lo, hi = node
        node = lo if v[f] <= t else hi
    return node


class Forest(nearest.NearestModel):
    def __init__(self, shapes, **kw):
        super().__init__(shapes, **{**kw, "trend": None})
        self.forests = {}
        for b, values in self.by_bucket.items():
            keys = sorted({ck for s in values for ck in s.ratios})
            x = np.array([nearest.trend_features(s.n, s.k, b, nearest.DEFAULT_TREND, self.metric.sms) for s in values])
            y = np.array([[math.log(s.ratios.get(ck, self.missing_ratio)) for ck in keys] for s in values])
            rng = random.Random(0)
            trees = [grow(x, y, np.array(sorted(rng.choices(range(len(values)), k=len(values)))), DEPTH, rng)
                     for _ in range(TREES)]
            self.forests[b] = (keys, trees)

    def predict(self, n, k, bucket, exclude=None):
        pred = super().predict(n, k, bucket, exclude)
        if pred is None:
            return None
        keys, trees = self.forests[bucket]
        v = nearest.trend_features(n, k, bucket, nearest.DEFAULT_TREND, self.metric.sms)
        mean = np.mean([walk(t, v) for t in trees], 0)
        scores = sorted(((ck, math.exp(float(p))) for ck, p in zip(keys, mean)), key=lambda t: (t[1], t[0]))
        return nearest.Prediction(n, k, bucket, pred.neighbours, tuple(scores))


def main() -> None:
    entries = shipped_data.the_section(shipped_data.load_file(heldout_replay.DATA))["entries"]
    rank = selection_data._static_rank(selection_data._provider_priorities())
    res = variants.loo(entries, Forest, {}, rank)

    def build(e):
        return {c: Forest([s for b in m.buckets for s in m.by_bucket[b]])
                for c, m in nearest.build_models(e, trend=None).items()}

    rows = heldout_replay.bench_rows()
    g, lo, ok = heldout_replay.summary(heldout_replay.replay(build, nearest.TIE_MARGIN, rows))
    print("| variant | by model | by family | by TP | by shape | held-out bench replay |\n|---|---|---|---|---|---|")
    cells = " | ".join(f"{res[x][0]:.4f} / {res[x][1]:.3f} / {res[x][2]}" for x in variants.GROUPS)
    print(f"| random forest (30 multi-output trees per bucket, trend features) | {cells} | {g:.4f} / {lo:.3f} / "
          f"{len(rows) - ok} |")


if __name__ == "__main__":
    main()
