"""Cache, for every held-out point of the four leave-out groupings and of the held-out bench replay, what a choice
rule may use (no GPU): per candidate the model's predicted log relative time (trend + vote), the trend alone, each
neighbour's residual and weight, the trend's leverage at the point, and per candidate the errors the model makes on
its own training shapes (each predicted with itself out of the vote). Rules are then evaluated on the cache.

    python bench/results/2026-12-01-loo-robust/harness.py     # writes /tmp/robust_cache.pkl (~75 s)

``rules.py`` and ``signals.py`` read the cache (and build it when it is missing).
"""

from __future__ import annotations

import math
import pickle
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "2026-12-01-loo-model2"))

import heldout_replay  # noqa: E402

from fp8_backends import selection_data  # noqa: E402
from fp8_backends.registry import lockfile, nearest, shipped_data  # noqa: E402

GROUPS = ("model", "family", "tp", "shape")
CACHE = Path("/tmp/robust_cache.pkl")


def leverage_fn(model: nearest.NearestModel, bucket: int):
    """h(x) = z^T (Z^T Z + ridge I')^-1 z of the trend's standardized design (every shape of the bucket)."""
    shapes = model.by_bucket[bucket]
    xs = np.array([nearest.trend_features(s.n, s.k, bucket, model.trend, model.metric.sms) for s in shapes])
    mean, scale = xs.mean(0), xs.std(0)
    scale[scale == 0] = 1.0
    z = np.hstack([np.ones((len(xs), 1)), (xs - mean) / scale])
    a = z.T @ z + model.trend.ridge * np.diag([0.0] + [1.0] * xs.shape[1])
    inv = np.linalg.inv(a)
    fitted = model._trends[bucket]
    hmax = float(np.max(np.einsum("ij,jk,ik->i", z, inv, z)))

    def h(n, k):
        x = np.array(fitted.clamp(nearest.trend_features(n, k, bucket, model.trend, model.metric.sms)))
        zq = np.concatenate([[1.0], (x - mean) / scale])
        return float(zq @ inv @ zq)
    return h, hmax, xs.min(0).tolist(), xs.max(0).tolist()


def point(model: nearest.NearestModel, n: int, k: int, bucket: int, exclude=None) -> dict | None:
    pred = model.predict(n, k, bucket, exclude)
    if pred is None:
        return None
    fitted = model._trends.get(bucket)
    x = fitted.clamp(nearest.trend_features(n, k, bucket, model.trend, model.metric.sms))
    res = {id(s): r for _, s, r in model._points[bucket]}
    keys = [ck for ck, _ in pred.scores]
    trend = {ck: fitted.value(ck, x) for ck in keys}
    nbs = [(nb.weight, nb.distance, {ck: res[id(nb.shape)][ck] for ck in keys},
            {ck: nb.shape.ratios.get(ck, model.missing_ratio) for ck in keys}, nb.shape.key) for nb in pred.neighbours]
    mu = {ck: trend[ck] + sum(w * r[ck] for w, _, r, *_ in nbs) for ck in keys}
    return {"keys": keys, "mu": mu, "trend": trend, "nbs": nbs}


def training_errors(model: nearest.NearestModel, bucket: int) -> dict:
    """Per candidate, (nearest-neighbour distance, predicted - measured log relative time) at each training shape
    predicted with itself out of the vote (the trend keeps it)."""
    out: dict = {}
    for s in model.by_bucket[bucket]:
        p = point(model, s.n, s.k, bucket, exclude=lambda t, s=s: t is s)
        if p is None:
            continue
        d0 = p["nbs"][0][1]
        for ck in p["keys"]:
            measured = math.log(s.ratios.get(ck, model.missing_ratio))
            out.setdefault(ck, []).append((d0, p["mu"][ck] - measured, p["trend"][ck] - measured, s.key, measured))
    return out


def records_for(model: nearest.NearestModel, targets, rank) -> list[dict]:
    """``targets``: (n, k, bucket, actual ratios by candidate, meta). Calibration per bucket computed once."""
    cal, lev = {}, {}
    out = []
    for n, k, bucket, actual, meta in targets:
        if bucket not in model.by_bucket:
            continue
        if bucket not in cal:
            cal[bucket] = training_errors(model, bucket)
            lev[bucket] = leverage_fn(model, bucket)
        p = point(model, n, k, bucket)
        if p is None:
            continue
        p.update(actual=actual, meta=meta, bucket=bucket, h=lev[bucket][0](n, k), hmax=lev[bucket][1],
                 lo=lev[bucket][2], hi=lev[bucket][3],
                 x=nearest.trend_features(n, k, bucket, model.trend, model.metric.sms),
                 cal=cal[bucket],
                 rank={ck: rank(ck) for ck in p["keys"]})
        out.append(p)
    return out


def loo_records(entries, group: str, rank) -> list[dict]:
    of = selection_data._group_of(group)
    recs = []
    for cls, model in sorted(nearest.build_models(entries).items()):
        every = [s for b in model.buckets for s in model.by_bucket[b]]
        groups = sorted({g for s in every if (g := of(s)) is not None})
        for g in groups:
            rest = model.rebuilt([s for s in every if of(s) != g])
            targets = [(s.n, s.k, s.m, dict(s.ratios), {"shape": s.shape, "group": g, "cls": cls,
                                                          "missing": model.missing_ratio})
                       for s in every if of(s) == g]
            recs += records_for(rest, targets, rank)
    return recs


def replay_records(rank) -> list[dict]:
    full = shipped_data.the_section(shipped_data.load_file(heldout_replay.DATA))["entries"]
    classes = {label: nearest.class_key(e["problem"]) for e in full.values() for label in e.get("labels") or ()}
    models = nearest.build_models(selection_data.exclude_models(full, heldout_replay.HELD_OUT))
    recs = []
    for row in heldout_replay.bench_rows():
        model = models[classes[heldout_replay.row_label(row)]]
        bucket = lockfile.bucket_for(row["m"], model.buckets)
        keys = sorted({ck for s in model.by_bucket[bucket] for ck in s.ratios})
        actual = {}
        for ck in keys:
            try:
                actual[ck] = row["candidates"][heldout_replay.bench_label(ck, row["candidates"])] / row["fastest_us"]
            except KeyError:
                pass
        recs += records_for(model, [(row["n"], row["k"], bucket, actual,
                                     {"shape": row["shape"], "group": "bench", "m": row["m"], "missing": 2.0})], rank)
    return recs


def build() -> dict:
    entries = shipped_data.the_section(shipped_data.load_file(heldout_replay.DATA))["entries"]
    rank = selection_data._static_rank(selection_data._provider_priorities())
    cache = {g: loo_records(entries, g, rank) for g in GROUPS}
    cache["replay"] = replay_records(heldout_replay.rank)
    CACHE.write_bytes(pickle.dumps(cache))
    return cache


def load() -> dict:
    """The cache (built when missing)."""
    return pickle.loads(CACHE.read_bytes()) if CACHE.exists() else build()


def main() -> None:
    print({g: len(v) for g, v in build().items()})


if __name__ == "__main__":
    main()
