"""How noisy are the shipped H200 measurements? (no GPU)

1. Run to run: ``bench/results/2026-12-01-h200-stop13/heldout/auto_eval.json`` timed every candidate again at 441
   points of the grid (4 models x their shapes x 7 M; 5 interleaved rounds x 3 replays, a separate run from the
   tuner's). Per point and candidate, the log of (relative time in the data) / (relative time in that run).
2. Within the data: kernels that are the same at two M buckets. CUTLASS runs one config (``ws64x16_swap``) at
   M = 1, 4 and 16 and the Triton swap-AB config ``swap_n64_m16`` serves M = 4 and 16; at these memory-bound sizes
   their times should match, so the spread of the ratio around its median bounds a single measurement's noise.

    python bench/results/2026-12-01-loo-model2/noise.py > bench/results/2026-12-01-loo-model2/noise.md
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import heldout_replay  # noqa: E402

from fp8_backends.registry import nearest, shipped_data  # noqa: E402

BUCKETS = (1, 4, 16, 64, 256, 1024, 4096)


def quantile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def measured():
    """(n, k, m, label) -> MeasuredShape, for every label of every entry."""
    doc = shipped_data.load_file(heldout_replay.DATA)
    out = {}
    for key, e in shipped_data.the_section(doc)["entries"].items():
        s = nearest.MeasuredShape.from_entry(key, e)
        for label in s.labels:
            out[(s.n, s.k, s.m, label)] = s
    return out


def band(per_m) -> dict[int, tuple[float, float]]:
    """M -> (p95, p99) of |log relative-time difference| between the two runs."""
    return {m: (quantile(v, 0.95), quantile(v, 0.99)) for m, v in per_m.items()}


def run_to_run():
    data = measured()
    rows = __import__("json").loads(heldout_replay.BENCH.read_text())["rows"]
    per_m: dict[int, list[float]] = {m: [] for m in BUCKETS}
    offset: dict[int, list[float]] = {m: [] for m in BUCKETS}
    ceiling: dict[int, list[float]] = {m: [] for m in BUCKETS}
    for row in rows:
        s = data[(row["n"], row["k"], row["m"], heldout_replay.row_label(row))]
        for ck, ratio in s.ratios.items():
            us = row["candidates"][heldout_replay.bench_label(ck, row["candidates"])]
            per_m[row["m"]].append(abs(math.log(ratio / (us / row["fastest_us"]))))
            offset[row["m"]].append(math.log(ratio * s.fastest_us / us))
        best = min(s.ratios, key=lambda ck: (s.ratios[ck], ck))
        ceiling[row["m"]].append(row["fastest_us"] / row["candidates"][heldout_replay.bench_label(best, row["candidates"])])
    return rows, per_m, offset, ceiling


def main() -> None:
    rows, per_m, offset, ceiling = run_to_run()
    print(f"## 1. Run to run: the shipped data against the held-out bench ({len(rows)} points x 6 candidates)\n")
    print("|Δ log relative time| per candidate and point; the data's time over the bench's (absolute, median); the "
          "data's fastest candidate read in the bench (what an oracle of the shipped data would get in another "
          "run).\n")
    print("| M | pairs | p50 | p90 | p95 | p99 | max | > 5% | abs. offset | data's fastest in the bench: geomean / min "
          "/ >= 0.95 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    every = []
    for m in BUCKETS:
        v = per_m[m]
        every += v
        c = ceiling[m]
        g = math.exp(sum(map(math.log, c)) / len(c))
        print(f"| {m} | {len(v)} | {quantile(v, .5):.3f} | {quantile(v, .9):.3f} | {quantile(v, .95):.3f} | "
              f"{quantile(v, .99):.3f} | {max(v):.3f} | {sum(x > math.log(1.05) for x in v)} | "
              f"{statistics.median(offset[m]):+.3f} | {g:.4f} / {min(c):.3f} / {sum(x >= .95 for x in c)} of {len(c)} |")
    allc = [x for m in BUCKETS for x in ceiling[m]]
    print(f"| all | {len(every)} | {quantile(every, .5):.3f} | {quantile(every, .9):.3f} | {quantile(every, .95):.3f} "
          f"| {quantile(every, .99):.3f} | {max(every):.3f} | {sum(x > math.log(1.05) for x in every)} | | "
          f"{math.exp(sum(map(math.log, allc)) / len(allc)):.4f} / {min(allc):.3f} / "
          f"{sum(x >= .95 for x in allc)} of {len(allc)} |")

    print("\n## 2. Within the data: the same kernel at two M buckets (260 shapes each)\n")
    print("log(time at the larger M / time at the smaller), its median over the shapes, and |deviation from the "
          "median|.\n")
    print("| kernel | pair | median | p50 | p90 | p95 | p99 | max | largest deviations |")
    print("|---|---|---|---|---|---|---|---|---|")
    doc = shipped_data.load_file(heldout_replay.DATA)
    by_shape: dict[tuple, dict[int, nearest.MeasuredShape]] = {}
    for key, e in shipped_data.the_section(doc)["entries"].items():
        s = nearest.MeasuredShape.from_entry(key, e)
        by_shape.setdefault((s.n, s.k, e["problem"]["has_bias"]), {})[s.m] = s
    for provider, a, b in (("cutlass", 1, 4), ("cutlass", 4, 16), ("triton", 4, 16)):
        vals = []
        for (n, k, bias), ms in sorted(by_shape.items()):
            ck = next(c for c in ms[a].ratios if c[0] == provider)
            ua, ub = ms[a].ratios[ck] * ms[a].fastest_us, ms[b].ratios[ck] * ms[b].fastest_us
            vals.append((math.log(ub / ua), f"{n}x{k}{'+bias' if bias else ''}"))
        med = statistics.median(v for v, _ in vals)
        dev = [abs(v - med) for v, _ in vals]
        worst = sorted(vals, key=lambda t: -abs(t[0] - med))[:3]
        print(f"| {provider} | M={a} / M={b} | {med:+.3f} | {quantile(dev, .5):.3f} | {quantile(dev, .9):.3f} | "
              f"{quantile(dev, .95):.3f} | {quantile(dev, .99):.3f} | {max(dev):.3f} | "
              + ", ".join(f"{name} {v - med:+.3f}" for v, name in worst) + " |")


if __name__ == "__main__":
    main()
