"""What the model for unseen shapes costs at layer load, on the shipped H200 data (CPU, no GPU):

    python bench/results/2026-12-01-loo-model2/lookup_time.py > bench/results/2026-12-01-loo-model2/lookup_time.md

1. ``nearest.build_models`` (once per process, when ``auto`` first needs a nearest answer) and one
   ``NearestModel.predict`` (one problem at one M bucket), with the trend and without it (the vote alone).
2. ``resolve_gemm_buckets`` for a layer whose shape the data lacks (what ``Fp8Linear`` calls once per layer at
   load: 7 buckets), on a simulated H200, after the file is loaded: the first such layer (it builds the model)
   and the next 39.
"""

from __future__ import annotations

import functools
import random
import statistics
import time

from fp8_backends.registry import nearest, resolution, shipped, shipped_data
from fp8_backends.registry.platform import simulate_platform
from fp8_backends.types import GemmProblem

DATA = shipped.packaged_dir() / "sm90-nvidia-h200.json"


def model_costs(trend) -> str:
    entries = shipped_data.the_section(shipped_data.load_file(DATA))["entries"]
    builds = []
    for _ in range(7):
        t0 = time.perf_counter()
        models = nearest.build_models(entries, trend=trend)
        builds.append(time.perf_counter() - t0)
    model = next(m for c, m in models.items() if not dict(c)["has_bias"])
    rng = random.Random(1)
    queries = [(rng.randrange(256, 80000), rng.randrange(256, 40000), rng.choice(model.buckets)) for _ in range(2000)]
    per = []
    for _ in range(7):
        t0 = time.perf_counter()
        for q in queries:
            model.predict(*q)
        per.append((time.perf_counter() - t0) / len(queries))
    return (f"| {'trend + vote' if trend else 'vote alone'} | {1e3 * statistics.median(builds):.0f} | "
            f"{1e6 * statistics.median(per):.0f} | {7e3 * statistics.median(per):.2f} |")


def layer_costs(trend) -> str:
    h200 = simulate_platform("9.0")
    original = shipped.build_models
    shipped.build_models = functools.partial(nearest.build_models, trend=trend)
    try:
        shipped.reset_state()
        assert shipped.data_for(h200) is not None  # load and check the file first
        rng = random.Random(0)
        unseen = [(16 * rng.randint(40, 4000), 16 * rng.randint(40, 2000)) for _ in range(40)]
        times = []
        for n, k in unseen:
            t0 = time.perf_counter()
            table = resolution.resolve_gemm_buckets("auto", problem=GemmProblem(n=n, k=k), platform=h200)
            times.append(time.perf_counter() - t0)
            assert len(table) == 7
        src = resolution.explain("gemm", problem=GemmProblem(n=unseen[1][0], k=unseen[1][1], m=64), platform=h200)
        assert src.source == "shipped-nearest", src.source
    finally:
        shipped.build_models = original
        shipped.reset_state()
    return (f"| {'trend + vote' if trend else 'vote alone'} | {1e3 * times[0]:.0f} | "
            f"{1e3 * statistics.median(times[1:]):.2f} | {1e3 * min(times[1:]):.2f} |")


def main() -> None:
    print("| model | build, all classes (ms, once) | one prediction (µs) | 7 buckets (ms) |\n|---|---|---|---|")
    for trend in (None, nearest.DEFAULT_TREND):
        print(model_costs(trend))
    print("\n`resolve_gemm_buckets` per layer of an unseen shape (7 buckets), simulated H200, file already loaded:\n")
    print("| model | first layer, builds the model (ms) | next 39: median (ms) | min (ms) |\n|---|---|---|---|")
    layer_costs(None)  # warm-up: the first resolution in a process also imports the policies
    for trend in (None, nearest.DEFAULT_TREND):
        print(layer_costs(trend))


if __name__ == "__main__":
    main()
