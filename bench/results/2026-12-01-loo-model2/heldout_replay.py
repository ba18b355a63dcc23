"""Replay the models for unseen shapes on the H200 held-out bench (no GPU).

``bench/results/2026-12-01-h200-stop13/heldout/auto_eval.json`` timed every candidate at each point of four models
left out of the data (gemma3-12b, mistral-nemo-12b, qwen2.5-3b, phi3-mini) in a separate run from the tuner's
(5 interleaved rounds x 3 replays). For its ``shipped-nearest`` points this predicts the pick from the shipped
data without those models, with the first model (``baseline``: log N, log K), the vote of the nearest shapes without
the trend (``vote``, the model before this change) and the current one (``nearest``: trend + vote), and reads the
pick's time from that bench:

    python bench/results/2026-12-01-loo-model2/heldout_replay.py > bench/results/2026-12-01-loo-model2/heldout_replay.md

The baseline replay must reproduce the picks ``auto`` made in that run (it prints at how many points it does).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8_backends import selection_data
from fp8_backends.registry import lockfile, nearest, shipped_data

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "fp8_backends" / "data" / "selection" / "sm90-nvidia-h200.json"
BENCH = ROOT / "bench" / "results" / "2026-12-01-h200-stop13" / "heldout" / "auto_eval.json"
HELD_OUT = ["gemma3-12b", "mistral-nemo-12b", "qwen2.5-3b", "phi3-mini"]
PRIORITY = {"cutlass": 8, "flashinfer_bmm": 5, "torch_scaled_mm": 10, "triton": 6}  # the built-ins' priorities
#: name -> (keyword arguments of nearest.build_models, tie margin)
MODELS: dict[str, tuple[dict[str, Any], float]] = {
    "baseline": ({"metric": nearest.LOG_SHAPE_METRIC, "trend": None}, lockfile.DEFAULT_TIE_MARGIN),
    "vote": ({"trend": None}, nearest.TIE_MARGIN),
    "nearest": ({}, nearest.TIE_MARGIN),
}


def rank(ck: nearest.CandKey) -> tuple:
    return (-PRIORITY.get(ck[0], -999), ck[2])


def bench_label(ck: nearest.CandKey, labels: Sequence[str]) -> str:
    """The bench's label for a candidate of the data (the bench names more options, e.g. autotune=off)."""
    provider, _, options = ck
    for label in labels:
        name, _, rest = label.partition("[")
        opts = dict(part.split("=", 1) for part in rest.rstrip("]").split(",")) if rest else {}
        if name == provider and all(opts.get(k) == v for k, v in options):
            return label
    raise KeyError(ck)


def bench_rows() -> list[dict[str, Any]]:
    return [r for r in json.loads(BENCH.read_text())["rows"] if r["source"] == "shipped-nearest"]


def row_label(row: Mapping[str, Any]) -> str:
    return row["shape"].split(" (")[1].rstrip(")").split(", ")[0]


def replay(build: Callable[[Mapping[str, Any]], Mapping[tuple, nearest.NearestModel]], tie: float,
           rows: Sequence[Mapping[str, Any]] | None = None) -> list[tuple[float, Mapping[str, Any], str]]:
    """(speed relative to the fastest, bench row, picked label) per shipped-nearest point, for models built by
    ``build(entries without the held-out models)``."""
    full = shipped_data.the_section(shipped_data.load_file(DATA))["entries"]
    classes = {label: nearest.class_key(e["problem"]) for e in full.values() for label in e.get("labels") or ()}
    models = build(selection_data.exclude_models(full, HELD_OUT))
    out = []
    for row in rows if rows is not None else bench_rows():
        model = models[classes[row_label(row)]]
        pred = model.predict(row["n"], row["k"], lockfile.bucket_for(row["m"], model.buckets))
        ck, _ = nearest.choose(pred.scores, rank, tie)
        picked = bench_label(ck, row["candidates"])
        out.append((row["fastest_us"] / row["candidates"][picked], row, picked))
    return out


def summary(results: Sequence[tuple[float, Any, str]]) -> tuple[float, float, int]:
    speeds = [s for s, _, _ in results]
    return math.exp(sum(map(math.log, speeds)) / len(speeds)), min(speeds), sum(v >= 0.95 for v in speeds)


def main() -> None:
    rows = bench_rows()
    results = {name: replay(lambda e, kw=kw: nearest.build_models(e, **kw), tie, rows)
               for name, (kw, tie) in MODELS.items()}
    reproduced = sum(picked == row["auto"] for _, row, picked in results["baseline"])
    print(f"{len(rows)} shipped-nearest points of {BENCH.relative_to(ROOT)}; the baseline replay reproduces the "
          f"recorded pick at {reproduced}\n")
    print("| model | geomean | min | >= 0.95 |\n|---|---|---|---|")
    for name, res in results.items():
        g, lo, ok = summary(res)
        print(f"| {name} | {g:.4f} | {lo:.3f} | {ok} of {len(res)} |")
    for name in ("vote", "nearest"):
        print(f"\nbelow 0.95 ({name}):")
        for s, row, picked in sorted(results[name], key=lambda t: t[0]):
            if s < 0.95:
                print(f"- {row['shape']} M={row['m']}: {picked} {s:.3f}")
    changed = [(a, b, row) for (a, row, pa), (b, _, pb) in zip(results["vote"], results["nearest"]) if pa != pb]
    print(f"\npicks that differ between vote and nearest: {len(changed)}; better {sum(b > a for a, b, _ in changed)}, "
          f"worse {sum(b < a for a, b, _ in changed)}")
    for a, b, row in sorted(changed, key=lambda t: t[1] - t[0]):
        print(f"- {row['shape']} M={row['m']}: {a:.3f} -> {b:.3f}")


if __name__ == "__main__":
    main()
