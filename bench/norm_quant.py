"""``python -m bench.norm_quant``: every RMSNorm + static FP8-quant provider over hidden sizes x tokens.

    python -m bench.norm_quant                  # H = 4096, 8192 (Llama-3-8B/70B), T = 1 ... 16384, +/- residual
    python -m bench.norm_quant --quick          # H = 4096, T = 1,16,256,4096, fewer repeats
    python -m bench.norm_quant --hidden 5120 --tokens 1-8192 --out /tmp/norm

Both ops: ``rmsnorm_quant`` (reads x, writes fp8) and ``fused_add_rmsnorm_quant`` (also reads and
writes the residual in place). Timing as in ``bench.gemm`` (CUDA graphs, inputs rotated past L2,
candidates interleaved, median); every candidate is checked against the reference first. Ceiling:
device-to-device copy bandwidth measured in the same run. Columns: µs, GB/s (bytes the op must move),
% of copy bandwidth, speed relative to the unfused torch provider, what ``auto`` picks and its time
relative to the fastest. On CUDA the unfused torch code compiled by ``torch.compile`` is measured beside
the providers as ``torch_compile`` (:mod:`bench.compiled_baseline`: what a user gets without the library).
Writes ``norm_quant.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fp8_backends.core.types import NormQuantProblem
from fp8_backends.registry import lockfile
from fp8_backends.tuning.models import hidden_size
from fp8_backends.tuning.plan import QUICK_M_BUCKETS, parse_m_list

from . import common, compiled_baseline, plot

DEFAULT_MODELS = ("llama3-8b", "llama3-70b")
BASELINE = "torch"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.norm_quant", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=None, help=f"hidden sizes of (default {' '.join(DEFAULT_MODELS)})")
    ap.add_argument("--hidden", nargs="+", type=int, default=[], help="extra hidden sizes")
    ap.add_argument("--tokens", default=None, help="token counts: '1,16,256' or '1-16384' (powers of two; default)")
    ap.add_argument("--residual", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--in-dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--quick", action="store_true", help="one hidden size, T 1,16,256,4096, fewer repeats")
    common.add_run_options(ap, "hidden")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--no-compiled-baseline", action="store_true",
                    help=f"leave out {compiled_baseline.NAME}: torch.compile of the unfused torch code")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _templates(args: argparse.Namespace, device: str) -> list[tuple[str, NormQuantProblem]]:
    models = [] if args.models == ["none"] else (args.models or (["llama3-8b"] if args.quick else list(DEFAULT_MODELS)))
    hiddens = list(dict.fromkeys([*(hidden_size(m) for m in models), *args.hidden]))
    residuals = {"both": [False, True], "yes": [True], "no": [False]}[args.residual]
    return [(f"H={h}{' +res' if r else ''}", NormQuantProblem(hidden=h, in_dtype=args.in_dtype, residual=r,
                                                               device=device))
            for h in hiddens for r in residuals]


def analyse(points: list[common.Point], copy_gbps: float | None) -> dict[str, Any]:
    rows, summary = [], []
    for p in points:
        base, auto, oracle = p.us(p.baseline_label), p.us(p.auto_label), p.oracle
        compiled = next((r.us for r in p.results if r.provider == compiled_baseline.NAME and r.ok), None)
        for r in p.results:
            row: dict[str, Any] = {
                "shape": p.shape, "hidden": p.problem.hidden, "residual": p.problem.residual, "tokens": p.m,
                "label": r.label, "provider": r.provider, "options": r.options, "bytes": p.bytes,
                "is_auto": r.label == p.auto_label, "is_oracle": oracle is not None and r is oracle,
                "error": r.error, "reason": r.reason,
            }
            if r.measurement is not None:
                row.update(r.measurement.to_json())
            if r.ok:
                row["us"] = r.us
                row["gbps"] = p.bytes / (r.us * 1e-6) / 1e9
                row["pct_copy"] = None if not copy_gbps else 100 * row["gbps"] / copy_gbps
                row["x_torch"] = None if base is None else base / r.us
            rows.append(row)
        summary.append({
            "shape": p.shape, "m": p.m, "oracle": oracle.label if oracle else None,
            "oracle_us": oracle.us if oracle else None, "auto": p.auto_label, "auto_source": p.auto_source,
            "auto_error": p.auto_error, "auto_us": auto, "torch_us": base,
            "auto_over_oracle": auto / oracle.us if auto and oracle else None,
            "best_over_torch": base / oracle.us if base and oracle else None,
            "compiled_us": compiled,
            "auto_vs_compiled": compiled / auto if compiled and auto else None,
        })
    slow = [f"{s['shape']} T={s['m']}: auto {s['auto']} {s['auto_over_oracle']:.3f}x oracle {s['oracle']}"
            for s in summary if s["auto_over_oracle"] and s["auto_over_oracle"] > 1.03]
    measured = sum(1 for s in summary if s["auto_over_oracle"])
    return {"rows": rows, "summary": summary,
            "targets": {"auto_within_3pct_of_oracle": {"points": measured, "met": measured - len(slow),
                                                       "violations": slow}}}


def markdown(header: dict[str, Any], copy_gbps: float | None, result: dict[str, Any], failures: list[str],
             method: str) -> str:
    fmt = common.fmt
    t = result["targets"]["auto_within_3pct_of_oracle"]
    lines = common.header_markdown(header, "RMSNorm + FP8 quant providers")
    lines += [f"Ceiling: device-to-device copy {fmt(copy_gbps, '.0f')} GB/s (read + write), measured in this run.",
              "", f"Method: {method}", "",
              f"auto within 3% of the fastest: {t['met']}/{t['points']} points", *[f"- {v}" for v in t["violations"]],
              "", "## auto vs the fastest provider", ""]
    lines += common.md_table(
        ["op", "T", "fastest", "µs", "auto picks", "source", "auto µs", "auto/oracle", "torch µs", "best x torch",
         "torch.compile µs", "auto x torch.compile"],
        [[s["shape"], s["m"], s["oracle"] or "-", fmt(s["oracle_us"]), s["auto"] or s["auto_error"] or "-",
          s["auto_source"] or "-", fmt(s["auto_us"]), fmt(s["auto_over_oracle"], ".3f"), fmt(s["torch_us"]),
          fmt(s["best_over_torch"], ".2f"), fmt(s["compiled_us"]), fmt(s["auto_vs_compiled"], ".2f")]
         for s in result["summary"]],
    )
    lines += ["", "## Every provider", ""]
    lines += common.md_table(
        ["op", "T", "provider", "µs", "GB/s", "% copy", "x torch", "note"],
        [[r["shape"], r["tokens"], r["label"], fmt(r.get("us")), fmt(r.get("gbps"), ".0f"),
          fmt(r.get("pct_copy"), ".0f"), fmt(r.get("x_torch"), ".2f"),
          ("auto " if r["is_auto"] else "") + ("fastest " if r["is_oracle"] else "") + (r["reason"] or "")]
         for r in result["rows"]],
    )
    if failures:
        lines += ["", "## Failures", ""] + [f"- {f}" for f in failures]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, platform, device = common.parse_run_args(ap, argv, "hidden", "a small --hidden (and --models none)")
    try:
        buckets = parse_m_list(args.tokens) if args.tokens else list(QUICK_M_BUCKETS if args.quick else
                                                                    lockfile.DEFAULT_M_BUCKETS)
        templates = _templates(args, "cpu" if device == "cpu" else "cuda")
    except ValueError as exc:
        ap.error(str(exc))
    providers, timer, out, header = common.run_setup(args, platform, device)
    header["lockfile"] = lockfile.describe_lockfile(platform)
    print(f"bench.norm_quant on {platform.describe()}: {len(templates)} ops x {len(buckets)} T -> {out}",
          file=sys.stderr)
    copy_gbps = common.copy_ceiling(device)
    extra = [] if args.no_compiled_baseline or device == "cpu" else [compiled_baseline.entry()]
    points = common.run_grid("norm_quant", templates, buckets, platform, device, timer, providers=providers,
                             baseline=BASELINE, show_progress=not args.no_progress, extra_entries=extra)
    result = analyse(points, copy_gbps)
    failures = common.failures_text(points)
    method = (f"CUDA graph per candidate over input copies rotated past L2, {timer.config.rounds} interleaved rounds x "
              f"{timer.config.replays} replays, median per call" if device != "cpu" else "CPU wall clock (smoke run)")
    common.write_json(out / "norm_quant.json", {"schema": "fp8_backends.bench.norm_quant/1", "meta": header,
                                                "ceilings": {"copy_gbps": copy_gbps}, "method": method,
                                                "tokens": buckets, **result, "failures": failures})
    (out / "norm_quant.md").write_text(markdown(header, copy_gbps, result, failures, method), encoding="utf-8")
    if not args.no_plot:
        plot.bandwidth([r for r in result["rows"] if r.get("gbps")], copy_gbps, out / "norm_quant.png",
                       f"RMSNorm + FP8 quant, {header['gpu']}, {header['date'][:10]}")
    fmt = common.fmt
    print(f"ceiling: copy {fmt(copy_gbps, '.0f')} GB/s")
    print(common.console_table(
        ["op", "T", "fastest", "µs", "GB/s", "auto", "auto/oracle", "best x torch"],
        [[s["shape"], s["m"], s["oracle"] or "-", fmt(s["oracle_us"]),
          fmt(points[i].bytes / (s["oracle_us"] * 1e-6) / 1e9 if s["oracle_us"] else None, ".0f"),
          s["auto"] or "-", fmt(s["auto_over_oracle"], ".3f"), fmt(s["best_over_torch"], ".2f")]
         for i, s in enumerate(result["summary"])],
    ))
    t = result["targets"]["auto_within_3pct_of_oracle"]
    print(f"target auto_within_3pct_of_oracle: {t['met']}/{t['points']}" + "".join(f"\n  {v}" for v in t["violations"]))
    for f in failures:
        print(f"failed: {f}")
    print(f"results: {out}/norm_quant.json, norm_quant.md, norm_quant.png")
    return 0 if any(s["oracle"] for s in result["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
