"""Replays of ``bench.auto_eval`` runs on the CPU: the shipped data's recorded rankings against a later measurement.

``bench.auto_eval`` times every candidate at each point it evaluates (JSON ``rows``: ``shape``, ``n``, ``k``, ``m``,
``source``, ``fastest_us``, ``torch_us`` and ``candidates``, a mapping of candidate label -> µs, e.g.
``"cutlass[config=auto,fast_accum=true]" -> 366.7``). The shipped selection data (``fp8_backends/data/selection/``)
records, per entry, the tuner's ``ranking`` (candidates fastest first, each ``{"provider", "options", "us"}``) and
its ``choice``. Matching the two by entry key answers questions no single run can:

- ``tie-margin``: what `auto` would have measured had the data been decided with another near-tie margin (a pick
  within the margin of the fastest keeps the recorded choice, else the fastest), each pick timed by the run;
- ``noise``: how far each candidate's time moved between the tuning run and the evaluation run, once the shift every
  candidate of a point shares is divided out;
- ``runs``: the same between two evaluation runs (no data file).

Only bias-free per-tensor bf16-out points match an entry key (the rows of q/k/v projections with biases have
another key). Files may be gzip-compressed (``.json.gz``)::

    python -m bench.eval_replay tie-margin DATA.json EVAL.json[.gz] [--margins 0 0.005 0.01 0.02]
    python -m bench.eval_replay noise DATA.json EVAL.json[.gz]
    python -m bench.eval_replay runs EVAL_A.json[.gz] EVAL_B.json[.gz]

``bench/results/auto_eval/2026-12-01-h200-tie-margin-2pct/`` holds the first two on the data as it was before the
tuner's margin became 0 (``git show b4e1bd1:fp8_backends/data/selection/sm90-nvidia-h200.json``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

#: the near-tie margins replayed by default; at >= ``RECORDED_MARGIN`` a pick is the data's recorded choice
DEFAULT_MARGINS = (0.0, 0.0025, 0.005, 0.01, 0.02)
RECORDED_MARGIN = 0.02
#: a candidate whose relative time moved by more than this between two runs counts as moved
MOVED = 0.03


def read_json(path: str | Path) -> Any:
    """A JSON document from ``path``, gzip-compressed when the name ends in ``.gz``."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return json.loads(path.read_text(encoding="utf-8"))


def shipped_entries(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Every entry of a shipped data (or lockfile) document, by key, all sections together."""
    entries: dict[str, Any] = {}
    for section in doc["sections"].values():
        entries.update(section["entries"])
    return entries


def entry_key(row: Mapping[str, Any]) -> str:
    """The entry key of a bias-free per-tensor e4m3 -> bf16 point of an auto_eval row."""
    return (f"gemm/n={row['n']}/k={row['k']}/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0"
            f"/m={row['m']}")


def parse_label(label: str) -> tuple[str, dict[str, str]]:
    """``"cutlass[config=auto,fast_accum=true]"`` -> ``("cutlass", {"config": "auto", "fast_accum": "true"})``."""
    provider, _, rest = label.partition("[")
    options = dict(kv.split("=", 1) for kv in rest.rstrip("]").split(",") if kv) if rest else {}
    return provider, options


def matches(label: str, record: Mapping[str, Any]) -> bool:
    """Whether a candidate label names a recorded candidate (the record's options a subset of the label's)."""
    provider, options = parse_label(label)
    return provider == record["provider"] and all(options.get(k) == v for k, v in record["options"].items())


def exact_points(entries: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]
                 ) -> Iterator[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """``(row, entry)`` for every ``shipped-exact`` row whose entry the data holds."""
    for row in rows:
        entry = entries.get(entry_key(row))
        if row["source"] == "shipped-exact" and entry is not None:
            yield row, entry


def pick(entry: Mapping[str, Any], margin: float) -> Mapping[str, Any]:
    """The candidate an entry's ranking gives at near-tie ``margin``: the recorded choice at ``RECORDED_MARGIN`` or
    more; below it the recorded choice while it is within ``margin`` of the fastest (and ``margin`` > 0), else the
    fastest (``ranking[0]``)."""
    choice = entry["choice"]
    if margin >= RECORDED_MARGIN:
        return choice
    ranking = entry["ranking"]
    near = [r for r in ranking if r["us"] <= ranking[0]["us"] * (1 + margin)]
    kept = any(r["provider"] == choice["provider"] and r["options"] == choice["options"] for r in near)
    return choice if margin > 0 and kept else ranking[0]


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def tie_margin_replay(entries: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                      margins: Sequence[float] = DEFAULT_MARGINS) -> list[dict[str, Any]]:
    """Per margin: how the picks it gives fare in the run's timings. ``speed`` = fastest µs / pick µs over the
    matched points (``n``; ``geomean``, ``min``, ``below_0.97``); ``decode`` = torch µs / pick µs at M <= 16
    (``decode_n``, ``decode_min``, ``decode_below_0.98``). A point whose pick the run did not time is skipped."""
    out = []
    for margin in margins:
        speeds: list[float] = []
        decode: list[float] = []
        for row, entry in exact_points(entries, rows):
            chosen = pick(entry, margin)
            label = next((c for c in row["candidates"] if matches(c, chosen)), None)
            if label is None:
                continue
            us = row["candidates"][label]
            speeds.append(row["fastest_us"] / us)
            if row["m"] <= 16:
                decode.append(row["torch_us"] / us)
        out.append({"margin": margin, "n": len(speeds),
                    "geomean": _geomean(speeds) if speeds else None, "min": min(speeds, default=None),
                    "below_0.97": sum(s < 0.97 for s in speeds), "decode_n": len(decode),
                    "decode_min": min(decode, default=None), "decode_below_0.98": sum(d < 0.98 for d in decode)})
    return out


def quantiles(values: Sequence[float], moved: float = MOVED) -> dict[str, Any]:
    """p1 / p5 / p50 / p95 / p99 of ``values`` (nearest rank below), their count, and how many lie farther than
    ``moved`` from 1."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "moved": 0}

    def q(p: float) -> float:
        return ordered[int(p * (len(ordered) - 1))]

    return {"n": len(ordered), "p1": q(0.01), "p5": q(0.05), "p50": q(0.5), "p95": q(0.95), "p99": q(0.99),
            "moved": sum(abs(v - 1) > moved for v in ordered)}


def _shared_shift_removed(ratios: Sequence[float]) -> list[float]:
    med = statistics.median(ratios)
    return [r / med for r in ratios]


def run_to_run_noise(entries: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each candidate's µs in the run over its µs in the data's ranking, divided by the median of that ratio over the
    point's candidates (the shift every candidate of the point shares): :func:`quantiles` of those, and ``points``,
    the points with at least two matched candidates."""
    rel: list[float] = []
    points = 0
    for row, entry in exact_points(entries, rows):
        ratios = []
        for label, us in row["candidates"].items():
            tuned = next((r["us"] for r in entry["ranking"] if matches(label, r)), None)
            if tuned:
                ratios.append(us / tuned)
        if len(ratios) >= 2:
            rel.extend(_shared_shift_removed(ratios))
            points += 1
    return {"points": points, **quantiles(rel)}


def runs_noise(rows_a: Sequence[Mapping[str, Any]], rows_b: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """:func:`run_to_run_noise` between two evaluation runs: per point (shape, M) both timed, each common
    candidate's µs in run B over its µs in run A, divided by the median of that ratio over the point's candidates."""
    by_point = {(r["shape"], r["m"]): r for r in rows_a}
    rel: list[float] = []
    points = 0
    for row in rows_b:
        other = by_point.get((row["shape"], row["m"]))
        if other is None:
            continue
        ratios = [us / other["candidates"][label] for label, us in row["candidates"].items()
                  if other["candidates"].get(label)]
        if len(ratios) >= 2:
            rel.extend(_shared_shift_removed(ratios))
            points += 1
    return {"points": points, **quantiles(rel)}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def tie_margin_markdown(results: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| tie margin | points | geomean (fastest / pick) | min | points < 0.97 | M <= 16 points | "
             "min vs torch | < 0.98x torch |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['margin']:g} | {r['n']} | {_fmt(r['geomean'], 4)} | {_fmt(r['min'])} | {r['below_0.97']} "
                     f"| {r['decode_n']} | {_fmt(r['decode_min'])} | {r['decode_below_0.98']} |")
    return lines


def noise_markdown(result: Mapping[str, Any], what: str) -> list[str]:
    if not result["n"]:
        return [f"{what}: no point with two matched candidates"]
    return [f"{what}: {result['points']} points, {result['n']} candidate timings relative to their point's median "
            f"ratio: p1 {result['p1']:.3f}, p5 {result['p5']:.3f}, p50 {result['p50']:.3f}, p95 {result['p95']:.3f}, "
            f"p99 {result['p99']:.3f}; moved by more than {MOVED:.0%}: {result['moved']}"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.eval_replay", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tie-margin", help="re-decide the data's rankings at other near-tie margins, timed by a run")
    t.add_argument("data", help="shipped selection data or lockfile (JSON)")
    t.add_argument("eval", help="bench.auto_eval JSON (.json or .json.gz)")
    t.add_argument("--margins", type=float, nargs="+", default=list(DEFAULT_MARGINS))
    n = sub.add_parser("noise", help="the data's timings against a run's, per candidate")
    n.add_argument("data")
    n.add_argument("eval")
    r = sub.add_parser("runs", help="two runs' timings against each other, per candidate")
    r.add_argument("eval_a")
    r.add_argument("eval_b")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "runs":
        lines = noise_markdown(runs_noise(read_json(args.eval_a)["rows"], read_json(args.eval_b)["rows"]),
                               f"{args.eval_b} over {args.eval_a}")
    else:
        entries = shipped_entries(read_json(args.data))
        rows = read_json(args.eval)["rows"]
        if args.command == "tie-margin":
            lines = tie_margin_markdown(tie_margin_replay(entries, rows, args.margins))
        else:
            lines = noise_markdown(run_to_run_noise(entries, rows), f"{args.eval} over {args.data}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
