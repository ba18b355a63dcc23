"""Replay the nearest-shape model on the H200 held-out bench (no GPU).

``bench/results/2026-12-01-h200-stop13/heldout/auto_eval.json`` timed every candidate at each point of four models
left out of the data (gemma3-12b, mistral-nemo-12b, qwen2.5-3b, phi3-mini) in a separate run from the tuner's.
For its ``shipped-nearest`` points this predicts the pick from the shipped data without those models, with the
first (log N, log K) model and with the current one, and reads the pick's time from that bench:

    python bench/results/2026-12-01-loo-nearest/heldout_replay.py

The first model's replay must reproduce the picks ``auto`` made in that run (it prints at how many points it does).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fp8_backends import selection_data
from fp8_backends.registry import nearest, shipped_data, tuning

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fp8_backends" / "data" / "selection" / "sm90-nvidia-h200.json"
BENCH = ROOT / "bench" / "results" / "2026-12-01-h200-stop13" / "heldout" / "auto_eval.json"
HELD_OUT = ["gemma3-12b", "mistral-nemo-12b", "qwen2.5-3b", "phi3-mini"]
PRIORITY = {"cutlass": 8, "flashinfer_bmm": 5, "torch_scaled_mm": 10, "triton": 6}  # the built-ins' priorities


def bench_label(ck: nearest.CandKey, labels) -> str:
    """The bench's label for a candidate of the data (the bench names more options, e.g. autotune=off)."""
    provider, _, options = ck
    for label in labels:
        name, _, rest = label.partition("[")
        opts = dict(part.split("=", 1) for part in rest.rstrip("]").split(",")) if rest else {}
        if name == provider and all(opts.get(k) == v for k, v in options):
            return label
    raise KeyError(ck)


def main() -> None:
    doc = shipped_data.load_file(DATA)
    full = shipped_data.the_section(doc)["entries"]
    classes = {label: nearest.class_key(e["problem"]) for e in full.values() for label in e.get("labels") or ()}
    kept = selection_data.exclude_models(full, HELD_OUT)
    variants = {"baseline": (nearest.LOG_SHAPE_METRIC, tuning.DEFAULT_TIE_MARGIN),
                "nearest": (nearest.DEFAULT_METRIC, nearest.TIE_MARGIN)}
    # both without the trend (the models as they were when this ran; 2026-12-01-loo-model2 replays the trend)
    models = {name: nearest.build_models(kept, metric=metric, trend=None) for name, (metric, _) in variants.items()}

    def rank(ck: nearest.CandKey) -> tuple:
        return (-PRIORITY.get(ck[0], -999), ck[2])

    rows = [r for r in json.loads(BENCH.read_text())["rows"] if r["source"] == "shipped-nearest"]
    speed: dict[str, list[float]] = {name: [] for name in variants}
    reproduced, worst = 0, []
    for row in rows:
        label = row["shape"].split(" (")[1].rstrip(")").split(", ")[0]
        for name, (_, tie) in variants.items():
            model = models[name][classes[label]]
            pred = model.predict(row["n"], row["k"], tuning.bucket_for(row["m"], model.buckets))
            ck, _ = nearest.choose(pred.scores, rank, tie)
            picked = bench_label(ck, row["candidates"])
            s = row["fastest_us"] / row["candidates"][picked]
            speed[name].append(s)
            reproduced += name == "baseline" and picked == row["auto"]
            if name == "nearest":
                worst.append((s, row["shape"], row["m"], picked))
    print(f"{len(rows)} shipped-nearest points of {BENCH.relative_to(ROOT)}; the baseline replay reproduces the "
          f"recorded pick at {reproduced}")
    print("| model | geomean | min | >= 0.95 |\n|---|---|---|---|")
    for name, values in speed.items():
        g = math.exp(sum(map(math.log, values)) / len(values))
        print(f"| {name} | {g:.4f} | {min(values):.3f} | {sum(v >= 0.95 for v in values)} of {len(values)} |")
    print("\nbelow 0.95 (nearest):")
    for s, shape, m, picked in sorted(worst):
        if s < 0.95:
            print(f"- {shape} M={m}: {picked} {s:.3f}")


if __name__ == "__main__":
    main()
