"""Every point below 0.95 of the fastest under each leave-out grouping, before (vote alone) and after (trend + vote),
and why the data misleads there (no GPU):

    python bench/results/2026-12-01-loo-model2/misses.py > bench/results/2026-12-01-loo-model2/misses.md

Classes (first that applies):

- ``noise``: the pick's loss is within the run-to-run p95 band at that M (``noise.py``), or another run of the
  same point (the held-out bench, 4 models) has the pick at >= 0.95;
- ``isolated``: the nearest measured shape is farther than 0.5 in the vote's distance (no measured shape close in
  N, K, wave fill and K alignment once the group is out);
- ``jump``: every one of the 4 nearest shapes has the picked candidate within 3% of its fastest: nothing near says
  otherwise; the shape itself differs (cuBLAS picks its kernels per shape);
- ``disagree``: the neighbours disagree and the model weighed them wrongly.

``retest``: the pick's speed in the held-out bench run, where it measured that point.
"""

from __future__ import annotations

import collections
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import heldout_replay  # noqa: E402
import noise  # noqa: E402

from fp8_backends import selection_data  # noqa: E402
from fp8_backends.registry import nearest, shipped_data  # noqa: E402

GROUPS = ("model", "family", "tp", "shape")
SHORT = {"triton": "triton", "cutlass": "cutlass"}


def short(ck) -> str:
    provider, _, options = ck
    o = dict(options)
    if provider == "flashinfer_bmm":
        return f"fi-{o.get('runner')}"
    if provider == "torch_scaled_mm":
        return "torch-fa" if o.get("fast_accum") == "true" else "torch"
    return provider


def main() -> None:
    entries = shipped_data.the_section(shipped_data.load_file(heldout_replay.DATA))["entries"]
    rank = selection_data._static_rank(selection_data._provider_priorities())
    _, per_m, _, _ = noise.run_to_run()
    p95 = {m: v[0] for m, v in noise.band(per_m).items()}
    retest = {}
    for row in json.loads(heldout_replay.BENCH.read_text())["rows"]:
        retest[(row["n"], row["k"], row["m"], heldout_replay.row_label(row))] = row
    models = {"vote": nearest.build_models(entries, trend=None), "nearest": nearest.build_models(entries)}
    misses: dict[str, dict[str, list]] = {name: {} for name in models}
    for name, built in models.items():
        for group in GROUPS:
            of = selection_data._group_of(group)
            out = []
            for cls, model in sorted(built.items()):
                full_vote = nearest.NearestModel([s for b in model.buckets for s in model.by_bucket[b]], trend=None)
                for r in nearest.leave_out(model, of, rank, nearest.TIE_MARGIN):
                    if r.actual is None or 1 / r.actual >= 0.95:
                        continue
                    s, speed = r.shape, 1 / r.actual
                    best = min(s.ratios, key=lambda ck: (s.ratios[ck], ck))
                    # the neighbours the vote saw with the group out
                    pred = full_vote.predict(s.n, s.k, s.m, exclude=lambda x, g=r.group: of(x) == g)
                    near_pick = [nb.shape.ratios.get(r.picked, nearest.MISSING_RATIO) for nb in pred.neighbours]
                    again = next((retest[(s.n, s.k, s.m, lab)] for lab in s.labels if (s.n, s.k, s.m, lab) in retest),
                                 None)
                    again_speed = None if again is None else again["fastest_us"] / again["candidates"][
                        heldout_replay.bench_label(r.picked, again["candidates"])]
                    if math.log(1 / speed) <= p95[s.m] or (again_speed is not None and again_speed >= 0.95):
                        why = "noise"
                    elif pred.neighbours[0].distance > 0.5:
                        why = "isolated"
                    elif max(near_pick) <= 1.03:
                        why = "jump"
                    else:
                        why = "disagree"
                    out.append((s, r.group, r.picked, speed, best, near_pick, pred.neighbours[0].distance, why,
                                again_speed, bool(dict(cls)["has_bias"])))
            misses[name][group] = out

    print("## Points below 0.95, by class\n")
    print("| held out | model | points < 0.95 | noise | isolated | jump | disagree |")
    print("|---|---|---|---|---|---|---|")
    for group in GROUPS:
        for name in models:
            c = collections.Counter(m[7] for m in misses[name][group])
            print(f"| {group} | {name} | {len(misses[name][group])} | {c['noise']} | {c['isolated']} | {c['jump']} | "
                  f"{c['disagree']} |")

    def key(m):
        s = m[0]
        return (s.n, s.k, s.m, m[9])

    for group in GROUPS:
        before = {key(m): m for m in misses["vote"][group]}
        after = {key(m): m for m in misses["nearest"][group]}
        print(f"\n## Held out by {group}: {len(before)} -> {len(after)} points below 0.95 "
              f"({len(set(before) - set(after))} fixed, {len(set(after) - set(before))} new)\n")
        print("| shape | M | group | vote: pick, speed | nearest: pick, speed | fastest | class (nearest, else vote) | "
              "picked at the 4 neighbours | nearest shape at | retest |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for k in sorted(set(before) | set(after), key=lambda k: (k[2], k[0], k[1], k[3])):
            b, a = before.get(k), after.get(k)
            m = a or b
            s = m[0]
            cell = (lambda x: "-" if x is None else f"{short(x[2])} {x[3]:.3f}")
            rt = "" if m[8] is None else f"{m[8]:.3f}"
            print(f"| {s.n}x{s.k}{'+bias' if m[9] else ''} | {s.m} | {m[1]} | {cell(b)} | {cell(a)} | {short(m[4])} | "
                  f"{m[7]} | {' '.join(f'{v:.2f}' for v in m[5])} | {m[6]:.2f} | {rt} |")


if __name__ == "__main__":
    main()
