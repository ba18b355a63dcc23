"""``python -m bench.gemm``: every usable FP8 GEMM provider over Llama-3-8B and -70B linear shapes x M.

    python -m bench.gemm                        # 8 shapes x M = 1 ... 16384, results in bench/results/<date>-<gpu>/
    python -m bench.gemm --quick                # 2 shapes x 4 M values, fewer repeats (smoke run)
    python -m bench.gemm --models llama3-8b --tp 2 --m 1-4096 --out /tmp/gemm
    FP8_BACKENDS_LOCKFILE=sel.lock.json python -m bench.gemm   # `auto` as a given lockfile makes it pick

Per grid point (shape, M) every provider that can serve it is measured (once per value of its tunable
options), plus what ``auto`` picks (lockfile included) and ``torch._scaled_mm`` (the baseline), all
in one interleaved CUDA-graph timing (see :mod:`fp8_backends.tuning.timing`). Ceilings are measured in the
same run: device-to-device copy bandwidth and the best FP8 GEMM rate at 8192^3 among the providers.

Columns: µs (median per call), TFLOP/s, GB/s (x + w + y bytes), % of the roofline ceiling at that
arithmetic intensity, speed relative to torch._scaled_mm (>1: faster), what ``auto`` picks and its
time relative to the fastest candidate (the oracle). Writes ``gemm.json``, ``gemm.md`` and
``gemm.png`` under ``--out``; prints a compact table and the targets (auto within 3% of the oracle and
at least as fast as torch._scaled_mm at every point).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fp8_backends.core.types import GemmProblem
from fp8_backends.registry import lockfile
from fp8_backends.tuning.models import linear_shapes
from fp8_backends.tuning.plan import QUICK_M_BUCKETS, parse_m_list

from . import common, plot

DEFAULT_MODELS = ("llama3-8b", "llama3-70b")
BASELINE = "torch_scaled_mm"
AUTO_TOLERANCE = 0.03  # target: auto within 3% of the oracle


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"model shape tables (default {' '.join(DEFAULT_MODELS)}; 'none' for --shapes only)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the shapes")
    ap.add_argument("--shapes", nargs="+", default=[], metavar="N,K", help="extra shapes")
    ap.add_argument("--m", default=None, help="M values: '1,16,256' or '1-16384' (powers of two; the default)")
    ap.add_argument("--quick", action="store_true", help="2 shapes x M 1,16,256,4096, fewer repeats")
    common.add_run_options(ap, "shapes")
    ap.add_argument("--skip-peak", action="store_true", help="do not measure the 8192^3 GEMM ceiling")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _templates(args: argparse.Namespace, device: str) -> list[tuple[str, GemmProblem]]:
    models = [] if args.models == ["none"] else (args.models or (["llama3-8b"] if args.quick else list(DEFAULT_MODELS)))
    shapes: list[tuple[str, int, int, bool]] = []
    for model in models:
        layers = linear_shapes(model, args.tp)
        if args.quick:
            layers = layers[:2]
        shapes += [(f"{model} {s.name}", s.n, s.k, s.bias) for s in layers]
    for text in args.shapes:
        n, k = (int(v) for v in text.split(","))
        shapes.append((f"{n}x{k}", n, k, False))
    seen, out = set(), []
    for name, n, k, bias in shapes:
        if (n, k, bias) not in seen:
            seen.add((n, k, bias))
            out.append((f"{n}x{k} ({name})" if "x" not in name else name,
                        GemmProblem(n=n, k=k, has_bias=bias, device=device)))
    return out


def analyse(points: list[common.Point], copy_gbps: float | None, peak_tflops: float | None) -> dict[str, Any]:
    """Per-candidate rows, per-point summary and the targets."""
    rows, summary = [], []
    for p in points:
        base, auto, oracle = p.us(p.baseline_label), p.us(p.auto_label), p.oracle
        intensity = p.flops / p.bytes
        roof = None
        if copy_gbps and peak_tflops:
            roof = min(peak_tflops, intensity * copy_gbps / 1e3)
        for r in p.results:
            row: dict[str, Any] = {
                "shape": p.shape, "n": p.problem.n, "k": p.problem.k, "m": p.m, "label": r.label,
                "provider": r.provider, "options": r.options, "intensity": intensity,
                "is_auto": r.label == p.auto_label, "is_oracle": oracle is not None and r is oracle,
                "is_baseline": r.label == p.baseline_label, "error": r.error, "reason": r.reason,
            }
            if r.measurement is not None:
                row.update(r.measurement.to_json())
            if r.ok:
                row["us"] = r.us
                row["tflops"] = p.flops / (r.us * 1e-6) / 1e12
                row["gbps"] = p.bytes / (r.us * 1e-6) / 1e9
                row["pct_ceiling"] = None if roof is None else 100 * row["tflops"] / roof
                row["bound"] = None if roof is None else ("compute" if roof >= peak_tflops else "memory")
                row["x_torch"] = None if base is None else base / r.us
            rows.append(row)
        summary.append({
            "shape": p.shape, "m": p.m, "oracle": oracle.label if oracle else None,
            "oracle_us": oracle.us if oracle else None, "auto": p.auto_label, "auto_source": p.auto_source,
            "auto_note": p.auto_note, "auto_error": p.auto_error, "auto_us": auto, "torch_us": base,
            "auto_over_oracle": auto / oracle.us if auto and oracle else None,
            "torch_over_auto": base / auto if base and auto else None,
            "best_over_torch": base / oracle.us if base and oracle else None,
        })
    return {"rows": rows, "summary": summary, "targets": targets(summary)}


def targets(summary: list[dict[str, Any]]) -> dict[str, Any]:
    """auto within 3% of the oracle, and at least as fast as torch._scaled_mm, at every point."""
    within = [s for s in summary if s["auto_over_oracle"] is not None]
    vs_torch = [s for s in summary if s["torch_over_auto"] is not None]
    bad_oracle = [f"{s['shape']} M={s['m']}: auto {s['auto']} {s['auto_over_oracle']:.3f}x oracle {s['oracle']}"
                  for s in within if s["auto_over_oracle"] > 1 + AUTO_TOLERANCE]
    bad_torch = [f"{s['shape']} M={s['m']}: auto {s['auto']} at {s['torch_over_auto']:.3f}x torch speed"
                 for s in vs_torch if s["torch_over_auto"] < 1.0]
    return {
        "auto_within_3pct_of_oracle": {"points": len(within), "met": len(within) - len(bad_oracle),
                                       "violations": bad_oracle},
        "auto_at_least_torch": {"points": len(vs_torch), "met": len(vs_torch) - len(bad_torch),
                                "violations": bad_torch},
        "unmeasured_points": [f"{s['shape']} M={s['m']}" for s in summary if s["auto_over_oracle"] is None],
    }


def markdown(header: dict[str, Any], ceilings: dict[str, Any], result: dict[str, Any], failures: list[str],
             method: str) -> str:
    fmt = common.fmt
    lines = common.header_markdown(header, "FP8 GEMM providers")
    peak = ceilings.get("gemm_peak") or {}
    lines += [
        "## Ceilings (measured in this run)",
        "",
        f"- device-to-device copy: {fmt(ceilings.get('copy_gbps'), '.0f')} GB/s (read + write)",
        f"- best FP8 GEMM at 8192^3: {fmt(peak.get('tflops'), '.0f')} TFLOP/s ({peak.get('provider') or '-'}); "
        + ", ".join(f"{k} {v:.0f}" for k, v in (peak.get("per_provider") or {}).items()),
        "",
        f"Method: {method}",
        "",
        "## Targets",
        "",
    ]
    for name, t in result["targets"].items():
        if isinstance(t, dict):
            lines.append(f"- {name}: {t['met']}/{t['points']} points" + ("" if not t["violations"] else ":"))
            lines += [f"  - {v}" for v in t["violations"]]
        elif t:
            lines.append(f"- {name}: {', '.join(t)}")
    lines += ["", "## auto vs the fastest provider (oracle) and torch._scaled_mm", ""]
    lines += common.md_table(
        ["shape", "M", "fastest", "µs", "auto picks", "source", "auto µs", "auto/oracle", "torch µs", "torch/auto"],
        [[s["shape"], s["m"], s["oracle"] or "-", fmt(s["oracle_us"]), s["auto"] or s["auto_error"] or "-",
          s["auto_source"] or "-", fmt(s["auto_us"]), fmt(s["auto_over_oracle"], ".3f"), fmt(s["torch_us"]),
          fmt(s["torch_over_auto"], ".3f")] for s in result["summary"]],
    )
    lines += ["", "## Every provider", ""]
    lines += common.md_table(
        ["shape", "M", "provider", "µs", "TFLOP/s", "GB/s", "% ceiling", "bound", "x torch", "note"],
        [[r["shape"], r["m"], r["label"], fmt(r.get("us")), fmt(r.get("tflops"), ".1f"), fmt(r.get("gbps"), ".0f"),
          fmt(r.get("pct_ceiling"), ".0f"), r.get("bound") or "-", fmt(r.get("x_torch"), ".3f"),
          ("auto " if r["is_auto"] else "") + ("fastest " if r["is_oracle"] else "") + (r["reason"] or "")]
         for r in result["rows"]],
    )
    if failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, platform, device = common.parse_run_args(ap, argv, "shapes", "small --shapes (and --models none)")
    try:
        buckets = parse_m_list(args.m) if args.m else list(QUICK_M_BUCKETS if args.quick else
                                                          lockfile.DEFAULT_M_BUCKETS)
        templates = _templates(args, "cpu" if device == "cpu" else "cuda")
    except ValueError as exc:
        ap.error(str(exc))
    providers, timer, out, header = common.run_setup(args, platform, device)
    header["lockfile"] = lockfile.describe_lockfile(platform)
    print(f"bench.gemm on {platform.describe()}: {len(templates)} shapes x {len(buckets)} M -> {out}", file=sys.stderr)

    ceilings: dict[str, Any] = {"copy_gbps": None, "gemm_peak": None}
    if device != "cpu":
        ceilings["copy_gbps"] = common.copy_ceiling(device)
        if not args.skip_peak:
            ceilings["gemm_peak"] = common.gemm_peak(platform, device, timer, providers)
    peak = (ceilings["gemm_peak"] or {}).get("tflops")
    points = common.run_grid("gemm", templates, buckets, platform, device, timer, providers=providers,
                             baseline=BASELINE, show_progress=not args.no_progress)
    result = analyse(points, ceilings["copy_gbps"], peak)
    failures = common.failures_text(points)
    method = (f"CUDA graph per candidate over input copies rotated past L2 (> 4x), {timer.config.rounds} interleaved "
              f"rounds x {timer.config.replays} replays, median per call; every candidate checked against the fp32 "
              "reference first" if device != "cpu" else "CPU wall clock (smoke run)")
    common.write_json(out / "gemm.json", {"schema": "fp8_backends.bench.gemm/1", "meta": header,
                                          "ceilings": ceilings, "method": method, "m_values": buckets, **result,
                                          "failures": failures})
    (out / "gemm.md").write_text(markdown(header, ceilings, result, failures, method), encoding="utf-8")
    if not args.no_plot:
        ok_rows = [r for r in result["rows"] if r.get("tflops")]
        plot.roofline(ok_rows, ceilings["copy_gbps"], peak, out / "gemm.png",
                      f"FP8 GEMM, {header['gpu']}, {header['date'][:10]}")
    _print(result, ceilings, failures, out)
    return 0 if any(s["oracle"] for s in result["summary"]) else 1


def _print(result: dict[str, Any], ceilings: dict[str, Any], failures: list[str], out: Path) -> None:
    fmt = common.fmt
    peak = ceilings.get("gemm_peak") or {}
    print(f"ceilings: copy {fmt(ceilings.get('copy_gbps'), '.0f')} GB/s, FP8 GEMM 8192^3 "
          f"{fmt(peak.get('tflops'), '.0f')} TFLOP/s ({peak.get('provider') or '-'})")
    print(common.console_table(
        ["shape", "M", "fastest", "µs", "auto", "auto/oracle", "torch/auto"],
        [[s["shape"], s["m"], s["oracle"] or "-", fmt(s["oracle_us"]), s["auto"] or "-",
          fmt(s["auto_over_oracle"], ".3f"), fmt(s["torch_over_auto"], ".3f")] for s in result["summary"]],
    ))
    for name, t in result["targets"].items():
        if isinstance(t, dict):
            print(f"target {name}: {t['met']}/{t['points']}" + "".join(f"\n  {v}" for v in t["violations"]))
    for f in failures:
        print(f"failed: {f}")
    print(f"results: {out}/gemm.json, gemm.md, gemm.png")


if __name__ == "__main__":
    sys.exit(main())
