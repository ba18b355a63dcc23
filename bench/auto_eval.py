"""``python -m bench.auto_eval``: is ``auto`` (without a lockfile) as fast as the fastest provider, per point?

    python -m bench.auto_eval --model llama3-8b qwen2-7b --out DIR                  # points the data holds
    python -m bench.auto_eval --model gemma3-12b mistral-nemo-12b --data heldout.json --out DIR   # held out
    python -m bench.auto_eval --shapes-file my_model.csv --m 1,16,256 --out DIR
    python -m bench.auto_eval --shipped-grid --shard 1/2 --out A; ...; python -m bench.auto_eval --merge A B --out C

Per point (a model shape at a TP degree x M) every provider that can serve it is timed in one interleaved
CUDA-graph measurement (:mod:`fp8_backends.tuning.timing`, through :func:`bench.common.run_grid`): the candidates the
shipped grid tunes (kernel-config tables pinned to ``auto``; ``--no-pins``: every config), what ``auto`` picks and
``torch._scaled_mm`` with its default options. ``FP8_BACKENDS_LOCKFILE`` is off during the run; ``--data`` points
``auto`` at other shipped data (``FP8_BACKENDS_SHIPPED``), e.g. a file packed without the held-out models.

Reported per point: where ``auto``'s choice came from (``shipped-exact`` / ``shipped-nearest`` / ``priority``),
auto's speed relative to the fastest candidate (fastest µs / auto µs: 1.000 = the fastest) and to
``torch._scaled_mm`` (torch µs / auto µs). The targets of issue 15: at points the data holds, auto >= 0.97 of the
fastest everywhere, >= 1.04x torch geomean at M >= 256 and never below 0.98x torch at M <= 16; at points it does
not hold (``shipped-nearest``), auto >= 0.95 of the fastest everywhere and >= 0.98 geomean. Writes
``auto_eval.json`` and ``auto_eval.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8_backends.core.types import GemmProblem
from fp8_backends.registry.platform import detect_platform
from fp8_backends.tuning import grid
from fp8_backends.tuning.plan import parse_m_list

from . import common

BASELINE = "torch_scaled_mm"
TARGETS = {"exact_min": 0.97, "prefill_geomean_vs_torch": 1.04, "decode_min_vs_torch": 0.98,
           "nearest_min": 0.95, "nearest_geomean": 0.98}


class _Stop(Exception):
    """The time limit is reached."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.auto_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=[], help="model shape tables (fp8_backends/tuning/models.py)")
    ap.add_argument("--shipped-grid", action="store_true", help="every model of the shipped grid (grid.py)")
    ap.add_argument("--exclude-model", nargs="+", default=[], help="leave these models' shapes out")
    ap.add_argument("--tp", nargs="+", type=int, default=list(grid.SHIPPED_TPS), help="TP degrees (default 1 2 4 8)")
    ap.add_argument("--shapes-file", nargs="+", default=[], help="JSON/CSV shapes files (see fp8_backends.tuning.grid)")
    ap.add_argument("--m", default=None, help="M values (default: the shipped grid's 1,4,16,64,256,1024,4096)")
    ap.add_argument("--data", default=None, help="shipped data file or folder for auto (FP8_BACKENDS_SHIPPED)")
    ap.add_argument("--lockfile", default="off", help="lockfile auto reads (default off)")
    ap.add_argument("--no-pins", action="store_true", help="time every kernel config, not the providers' auto")
    ap.add_argument("--providers", default=None, help="comma-separated provider names (default: all usable)")
    ap.add_argument("--limit-seconds", type=float, default=None, help="stop starting points after this long")
    ap.add_argument("--out", default=None, help="output folder (default bench/results/<date>-<gpu>/auto_eval)")
    ap.add_argument("--device", default=None, help="cuda or cuda:N")
    ap.add_argument("--quick", action="store_true", help="fewer timing repeats")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--replays", type=int, default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--shard", default=None, metavar="I/N", help="measure shard I of N of the shapes (one process per "
                                                                 "GPU; --merge their folders afterwards)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                    help="measure nothing: combine the auto_eval.json of these folders into one report in --out")
    return ap


def templates(args: argparse.Namespace, device: str) -> list[tuple[str, GemmProblem]]:
    """``(label, problem)`` per deduplicated shape of the models x TP degrees and shapes files."""
    models = list(args.model) or (list(grid.SHIPPED_MODELS) if args.shipped_grid else [])
    shapes, notes = grid.model_shapes(models, args.tp, exclude=args.exclude_model) if models else ([], [])
    for note in notes:
        print(f"left out: {note}", file=sys.stderr)
    for path in args.shapes_file:
        shapes += grid.read_shapes_file(path)
    out = []
    for s in grid.merge_shapes(shapes):
        where = ", ".join(s.labels[:3]) + (f" +{len(s.labels) - 3}" if len(s.labels) > 3 else "")
        out.append((f"{s.n}x{s.k}{'+bias' if s.bias else ''} ({where})" if where else f"{s.n}x{s.k}",
                    GemmProblem(n=s.n, k=s.k, has_bias=s.bias, device=device)))
    return out


def point_rows(points: Sequence[common.Point]) -> list[dict[str, Any]]:
    """One JSON-ready row per measured point."""
    rows = []
    for p in points:
        oracle, auto_us, torch_us = p.oracle, p.us(p.auto_label), p.us(p.baseline_label)
        rows.append({
            "shape": p.shape, "n": p.problem.n, "k": p.problem.k, "m": p.m, "source": p.auto_source,
            "auto": p.auto_label, "auto_note": p.auto_note, "auto_error": p.auto_error, "auto_us": auto_us,
            "fastest": oracle.label if oracle else None, "fastest_us": oracle.us if oracle else None,
            "torch_us": torch_us,
            "auto_vs_fastest": oracle.us / auto_us if oracle and auto_us else None,
            "auto_vs_torch": torch_us / auto_us if torch_us and auto_us else None,
            "candidates": {r.label: (r.us if r.ok else None) for r in p.results},
        })
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The rows, and the targets by where ``auto``'s choice came from."""
    rows = list(rows)
    exact = [r for r in rows if r["source"] == "shipped-exact" and r["auto_vs_fastest"]]
    near = [r for r in rows if r["source"] == "shipped-nearest" and r["auto_vs_fastest"]]
    prefill = [r["auto_vs_torch"] for r in exact if r["m"] >= 256 and r["auto_vs_torch"]]
    decode = [r for r in exact if r["m"] <= 16 and r["auto_vs_torch"]]

    def below(rs, key, bound):
        return [f"{r['shape']} M={r['m']}: {r['auto']} {r[key]:.3f}" for r in rs if r[key] < bound]

    groups = {}
    for source in sorted({r["source"] or "error" for r in rows}):
        rs = [r for r in rows if (r["source"] or "error") == source and r["auto_vs_fastest"]]
        groups[source] = {"points": len(rs), "min": min((r["auto_vs_fastest"] for r in rs), default=None),
                          "geomean": common.geomean([r["auto_vs_fastest"] for r in rs]),
                          "geomean_vs_torch": common.geomean([r["auto_vs_torch"] for r in rs if r["auto_vs_torch"]])}
    near_geo = common.geomean([r["auto_vs_fastest"] for r in near])
    targets = {
        "exact: auto >= 0.97 of the fastest at every point": {
            "points": len(exact), "violations": below(exact, "auto_vs_fastest", TARGETS["exact_min"])},
        "exact, M >= 256: auto >= 1.04x torch geomean": {
            "points": len(prefill), "value": common.geomean(prefill),
            "met": None if not prefill else common.geomean(prefill) >= TARGETS["prefill_geomean_vs_torch"]},
        "exact, M <= 16: auto >= 0.98x torch at every point": {
            "points": len(decode), "violations": below(decode, "auto_vs_torch", TARGETS["decode_min_vs_torch"])},
        "nearest: auto >= 0.95 of the fastest at every point": {
            "points": len(near), "violations": below(near, "auto_vs_fastest", TARGETS["nearest_min"])},
        "nearest: auto >= 0.98 of the fastest geomean": {
            "points": len(near), "value": near_geo,
            "met": None if near_geo is None else near_geo >= TARGETS["nearest_geomean"]},
    }
    return {"rows": rows, "by_source": groups, "targets": targets}


def markdown(header: dict[str, Any], result: dict[str, Any], method: str, stopped: str | None) -> list[str]:
    fmt = common.fmt
    lines = common.header_markdown(header, "auto vs the fastest provider vs torch._scaled_mm")
    shipped = header.get("shipped_data") or {}
    lines += [f"- shipped data: {shipped.get('path')} ({shipped.get('status')}: {shipped.get('detail')})",
              f"- method: {method}", ""]
    if stopped:
        lines += [f"**Stopped early ({stopped}): not every point was measured.**", ""]
    lines += ["## Targets", ""]
    for name, t in result["targets"].items():
        if "violations" in t:
            lines.append(f"- {name}: {t['points'] - len(t['violations'])}/{t['points']} points")
            lines += [f"  - {v}" for v in t["violations"]]
        else:
            state = "-" if t["met"] is None else ("met" if t["met"] else "NOT met")
            lines.append(f"- {name}: {fmt(t['value'], '.3f')} over {t['points']} points ({state})")
    lines += ["", "## By source of auto's choice", ""]
    lines += common.md_table(
        ["source", "points", "auto/fastest min", "auto/fastest geomean", "auto vs torch geomean"],
        [[s, g["points"], fmt(g["min"], ".3f"), fmt(g["geomean"], ".3f"), fmt(g["geomean_vs_torch"], ".3f")]
         for s, g in result["by_source"].items()])
    lines += ["", "## Every point", "",
              "auto/fastest = fastest µs / auto µs (1.000: auto picked the fastest); x torch = torch µs / auto µs", ""]
    lines += common.md_table(
        ["shape", "M", "source", "auto picks", "auto µs", "fastest", "fastest µs", "torch µs", "auto/fastest",
         "x torch"],
        [[r["shape"], r["m"], r["source"] or "-", r["auto"] or r["auto_error"] or "-", fmt(r["auto_us"]),
          r["fastest"] or "-", fmt(r["fastest_us"]), fmt(r["torch_us"]), fmt(r["auto_vs_fastest"], ".3f"),
          fmt(r["auto_vs_torch"], ".3f")] for r in result["rows"]])
    notes = [r for r in result["rows"] if r["source"] == "shipped-nearest"]
    if notes:
        lines += ["", "## Where the nearest choices came from", ""]
        lines += [f"- {r['shape']} M={r['m']}: {r['auto']}: {r['auto_note']}" for r in notes]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    os.environ["FP8_BACKENDS_LOCKFILE"] = args.lockfile
    if args.data and not Path(args.data).exists():
        ap.error(f"--data {args.data}: no such file or folder")
    if args.data:
        os.environ["FP8_BACKENDS_SHIPPED"] = str(Path(args.data).resolve())
    platform = detect_platform(args.device)
    device = "cpu" if platform.kind.value == "cpu" else platform.torch_device
    if args.merge:
        return merge(args.merge, Path(args.out or "auto_eval"))
    if not args.model and not args.shapes_file and not args.shipped_grid:
        ap.error("name --model(s), --shipped-grid or --shapes-file")
    try:
        buckets = parse_m_list(args.m) if args.m else list(grid.SHIPPED_M_BUCKETS)
        points_in = templates(args, "cpu" if device == "cpu" else "cuda")
        if args.shard:
            from fp8_backends.tuning.plan import parse_shard

            index, count = parse_shard(args.shard)
            points_in = [t for i, t in enumerate(points_in) if i % count == index - 1]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        ap.error(str(exc))
    pins = None if args.no_pins else grid.SHIPPED_PINS
    timer = common.timer_from_args(args, device)
    out = Path(args.out) if args.out else common.default_out_dir(platform) / "auto_eval"
    header = common.run_header(platform, device)
    from fp8_backends.registry import shipped

    total = len(points_in) * len(buckets)
    print(f"bench.auto_eval on {platform.describe()}: {len(points_in)} shapes x {len(buckets)} M = {total} points "
          f"-> {out}", file=sys.stderr)
    points: list[common.Point] = []
    deadline = None if args.limit_seconds is None else time.perf_counter() + args.limit_seconds
    last = [0.0]

    def on_point(point: common.Point) -> None:
        points.append(point)
        last[0] = max(last[0], point.seconds)
        if deadline is not None and time.perf_counter() + 1.25 * last[0] > deadline:
            raise _Stop

    stopped = None
    try:
        common.run_grid("gemm", points_in, buckets, platform, device, timer, providers=common.providers_from_args(args),
                        baseline=BASELINE, show_progress=not args.no_progress, on_point=on_point, pins=pins)
    except _Stop:
        stopped = "time limit"
    except KeyboardInterrupt:
        stopped = "interrupted"
    header["shipped_data"] = shipped.describe(platform)
    result = summarize(point_rows(points))
    method = (f"CUDA graph per candidate over input copies rotated past L2, {timer.config.rounds} interleaved rounds x "
              f"{timer.config.replays} replays, median per call; candidates: "
              + ("every config" if pins is None else "kernel-config tables pinned to auto (as the shipped grid)")
              if device != "cpu" else "CPU wall clock (smoke run)")
    common.write_json(out / "auto_eval.json", {"schema": "fp8_backends.bench.auto_eval/1", "meta": header,
                                               "method": method, "m_values": buckets, "stopped": stopped,
                                               "points_planned": total, **result,
                                               "failures": common.failures_text(points)})
    common.write_markdown(out / "auto_eval.md", markdown(header, result, method, stopped))
    print(f"results: {out}/auto_eval.json, auto_eval.md ({len(points)}/{total} points)")
    return 0 if points else 1


def merge(folders: Sequence[str], out: Path) -> int:
    """One report from several runs' ``auto_eval.json`` (shards measured on several GPUs of one host)."""
    import json

    docs = [json.loads((Path(f) / "auto_eval.json").read_text(encoding="utf-8")) for f in folders]
    rows = [r for d in docs for r in d["rows"]]
    header = dict(docs[0]["meta"], command=f"merge of {len(docs)} runs: " + "; ".join(d["meta"]["command"]
                                                                                        for d in docs))
    stopped = "; ".join(sorted({d["stopped"] for d in docs if d.get("stopped")})) or None
    result = summarize(rows)
    common.write_json(out / "auto_eval.json", {"schema": "fp8_backends.bench.auto_eval/1", "meta": header,
                                               "method": docs[0]["method"], "m_values": docs[0]["m_values"],
                                               "stopped": stopped, "merged": list(folders),
                                               "points_planned": sum(d["points_planned"] for d in docs), **result,
                                               "failures": [f for d in docs for f in d.get("failures", [])]})
    common.write_markdown(out / "auto_eval.md", markdown(header, result, docs[0]["method"], stopped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
