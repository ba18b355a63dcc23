"""Every Triton GEMM tile config x the Llama-3-8B GEMM shapes x M, against torch._scaled_mm (device benchmark).

    python -m bench.triton_configs --out DIR [--configs shipped|explore|NAME,...] [--ms 1,16,64,...]
                                   [--shapes 6144x4096,...] [--rounds 5] [--quick] [--no-pdl-column]

Per (N, K) and M: times every config (launched with PDL where the GPU has it, as the provider does) and
torch._scaled_mm (plain and fast accumulation) in CUDA graphs, interleaved over rounds, input copies
rotated past 4x L2; checks every output against :func:`fp8_backends.core.reference.fp8_gemm`. For the best
config of each point it also times the same kernel launched without PDL (the like-for-like comparison
with cuBLAS, which does not use PDL). The copy bandwidth is measured at the start of the run: the
weight-read floor of a point is ``N*K bytes / copy GB/s``.

``--configs explore`` adds tile shapes beyond the shipped ones (the search that sets the shipped list);
``--configs decode`` takes the GEMV and 16-token swap-AB configs of both lists (the decode search).

Writes ``triton_configs.json`` (every number), ``triton_configs.md`` (µs per config, best, ratio to
torch, % of the floor) and ``triton_table.json``: the measured best shipped config per M bucket, in the
format of ``FP8_BACKENDS_TRITON_TABLE`` / ``gemm_configs.TritonTable``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import config_sweep as sweep
from bench.config_sweep import TORCH

MS = [1, 16, 32, 64, 256, 1024, 4096, 8192]
PREFIX = "triton:"
NOPDL = "triton_nopdl:"


def explore_configs() -> list[Any]:
    """Tile shapes beyond the shipped list, for the search (not all valid for every problem)."""
    from fp8_backends.providers.triton.gemm_configs import TileConfig

    return [
        TileConfig("gemv", 1, 2, 512, 1, 2),
        TileConfig("gemv", 1, 1, 1024, 1, 2),
        TileConfig("gemv", 1, 4, 1024, 1, 4),
        TileConfig("swap", 16, 64, 256, 4, 4),
        TileConfig("swap", 16, 64, 512, 3, 4),
        TileConfig("swap", 16, 128, 128, 4, 4),
        TileConfig("swap", 32, 128, 256, 3, 4),
        TileConfig("swap", 64, 128, 256, 3, 8),
        TileConfig("mm", 64, 64, 256, 4, 4),
        TileConfig("mm", 64, 256, 128, 3, 8),
        TileConfig("mm", 128, 128, 256, 3, 8),
        TileConfig("mm", 128, 256, 64, 4, 8),
        TileConfig("mm", 128, 256, 128, 4, 8),
        TileConfig("mm", 256, 128, 128, 3, 8),
        TileConfig("gemv", 1, 8, 512, 1, 4),
        TileConfig("gemv", 1, 4, 256, 1, 2),
        TileConfig("swap", 16, 128, 256, 4, 4),
        TileConfig("swap", 16, 64, 128, 8, 4),
        TileConfig("swap", 32, 128, 128, 4, 4),
        TileConfig("tma", 16, 64, 256, 6, 4),
        TileConfig("tma", 64, 128, 128, 4, 4),
        TileConfig("tma", 128, 128, 128, 4, 8),
        TileConfig("tma", 128, 128, 128, 4, 8, persistent=1),
        TileConfig("tma", 128, 256, 128, 3, 8),
        TileConfig("tma", 128, 256, 128, 3, 8, persistent=1),
        TileConfig("tma", 128, 256, 64, 4, 8, persistent=1),
        TileConfig("tma", 256, 128, 128, 3, 8),
        TileConfig("tma", 256, 128, 128, 3, 8, persistent=1),
    ]


def _eligible(cfg: Any, m: int) -> bool:
    """The configs worth timing at M (the provider refuses forced small-M configs far above their range)."""
    if cfg.family == "gemv":
        return m <= 2
    if cfg.family == "swap":
        return m <= 4 * cfg.block_m
    return m >= cfg.block_m // 4


def triton_runs(cfgs: dict[str, Any], m: int, nopdl_of: str | None = None) -> Any:
    """``runs_for`` of :func:`bench.config_sweep.measure_point`: one run per config (PDL as the provider
    launches it) and, with ``nopdl_of``, that config once more with PDL off."""

    def runs_for(xsets, wsets, xs, ws, n_sets, check):
        import torch

        from fp8_backends.providers.triton.gemm_ops import run_config
        from fp8_backends.tuning.timing import Run

        n = wsets[0].shape[0]
        outs = [torch.empty((m, n), dtype=torch.bfloat16, device=xsets[0].device) for _ in range(n_sets)]

        def run(cfg: Any, pdl: bool | None) -> Run:
            def fn(i: int) -> Any:
                run_config(cfg, xsets[i], wsets[i], xs, ws, None, outs[i], pdl=pdl)
                return outs[i]

            return Run(fn, n_sets, check)

        runs = {PREFIX + name: run(cfg, None) for name, cfg in cfgs.items() if _eligible(cfg, m)}
        if nopdl_of is not None:
            runs[NOPDL + nopdl_of] = run(cfgs[nopdl_of], False)
        return runs

    return runs_for


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sweep.add_sweep_args(parser, "explore", MS)
    parser.add_argument("--no-pdl-column", action="store_true", help="skip timing the best config without PDL")
    args = parser.parse_args(argv)

    import torch

    from bench.common import copy_ceiling, run_header
    from fp8_backends.providers.triton import _support
    from fp8_backends.providers.triton.gemm_configs import CONFIG_LIST, CONFIGS
    from fp8_backends.registry.platform import detect_platform
    from fp8_backends.tuning.timing import l2_cache_bytes

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda"
    known = {c.name: c for c in [*CONFIG_LIST, *explore_configs()]}
    if args.configs in ("shipped", "explore"):
        cfg_list = list(CONFIG_LIST) + (explore_configs() if args.configs == "explore" else [])
    elif args.configs == "decode":
        cfg_list = [c for c in [*CONFIG_LIST, *explore_configs()] if c.family in ("gemv", "swap") and c.block_m <= 16]
    else:
        cfg_list = [known[name] if name in known else CONFIGS[name] for name in args.configs.split(",")]
    cfgs = {c.name: c for c in cfg_list}
    names = list(cfgs)
    ms, shapes, timer = sweep.grid_and_timer(args, device)
    header = run_header(detect_platform(device), device)
    header["pdl"] = _support.pdl_enabled(torch.device(device))
    header["copy_gbps"] = copy_ceiling(device)
    print(f"{header['gpu']} SM {header['sm']}, copy {header['copy_gbps']:.0f} GB/s, PDL {header['pdl']}, "
          f"{len(names)} configs", flush=True)

    l2 = l2_cache_bytes(device)
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        for m in ms:
            t_point = time.perf_counter()
            row = sweep.measure_point(n, k, m, triton_runs(cfgs, m), timer, l2, device)
            b = sweep.best(row, names, PREFIX)
            if b and header["pdl"] and not args.no_pdl_column:
                extra = sweep.measure_point(n, k, m, triton_runs({b[0]: cfgs[b[0]]}, m, nopdl_of=b[0]), timer,
                                            l2, device)
                row["nopdl"] = {"config": b[0], "results": extra["results"]}
            rows.append(row)
            (out_dir / "triton_configs.json").write_text(
                json.dumps({"header": header, "rows": rows, "complete": False}) + "\n")  # survives a timeout
            torch.cuda.empty_cache()
            tt = sweep.us(row, TORCH)
            floor = n * k / header["copy_gbps"] / 1e3
            line = f"{n:6d}x{k:<6d} M={m:5d} torch {tt if tt is None else round(tt, 2)} us"
            if b:
                line += (f"  best {b[0]} {b[1]:.2f} us x{(tt or float('nan')) / b[1]:.2f} "
                         f"({100 * floor / b[1]:.0f}% floor)")
            if row.get("nopdl"):
                npd = sweep.us({"results": row["nopdl"]["results"]}, NOPDL + b[0])
                line += f"  no-PDL {npd if npd is None else round(npd, 2)}"
            print(line + f"  ({time.perf_counter() - t_point:.1f} s)", flush=True)

    shipped = [c.name for c in CONFIG_LIST if c.name in cfgs]
    spec = _spec()
    summary = sweep.summarize(rows, shipped, ms, shapes, spec, eligible=lambda name, m: _eligible(cfgs[name], m))
    summary["decode"] = decode_summary(rows, names, header["copy_gbps"])
    report = {"header": header, "configs": names, "rows": rows, "summary": summary}
    (out_dir / "triton_configs.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "triton_table.json").write_text(sweep.table_text(summary["table"]) + "\n")
    md = markdown(report, names)
    (out_dir / "triton_configs.md").write_text(md)
    print(md, flush=True)
    return 0


def _spec() -> sweep.SweepSpec:
    from fp8_backends.providers.triton.gemm_configs import DEFAULT_TABLE, TritonTable

    return sweep.SweepSpec("triton", PREFIX, TritonTable, DEFAULT_TABLE)


def decode_summary(rows: list[dict[str, Any]], names: list[str], copy_gbps: float) -> dict[str, Any]:
    """At M <= 16: % of the weight-read floor for torch, the best config (PDL) and it without PDL, with
    geometric means per M (the issue's decode target: >= 80% geomean over the four shapes)."""
    out: dict[str, Any] = {"points": []}
    for row in rows:
        if row["m"] > 16:
            continue
        floor = row["n"] * row["k"] / copy_gbps / 1e3
        t = sweep.us(row, TORCH)
        b = sweep.best(row, names, PREFIX)
        npd = None
        if row.get("nopdl"):
            npd = sweep.us({"results": row["nopdl"]["results"]}, NOPDL + row["nopdl"]["config"])
        out["points"].append({"n": row["n"], "k": row["k"], "m": row["m"], "floor_us": floor, "torch_us": t,
                              "best": b[0] if b else None, "best_us": b[1] if b else None, "nopdl_us": npd})
    for m in sorted({p["m"] for p in out["points"]}):
        pts = [p for p in out["points"] if p["m"] == m]
        out[f"M={m}"] = {
            key: sweep.geomean([p["floor_us"] / p[col] for p in pts if p[col]])
            for key, col in (("torch_floor_frac", "torch_us"), ("best_floor_frac", "best_us"),
                             ("nopdl_floor_frac", "nopdl_us"))
        }
    return out


def markdown(report: dict[str, Any], names: list[str]) -> str:
    from bench.common import header_markdown

    h = report["header"]
    header = header_markdown(h, "x")[2:-1] + [
        f"- copy bandwidth at the start of the run: {h['copy_gbps']:.0f} GB/s (eager copy, read + write); "
        "floor = weight bytes / copy bandwidth",
        f"- PDL: {'on' if h['pdl'] else 'off'} for the config columns; 'no-PDL' times the best config without it",
        "- µs per call inside a CUDA graph (median over interleaved rounds, input copies rotated past 4x L2); "
        "per-tensor scales, bf16 out, no bias; every output checked against fp8_backends.core.reference "
        "(relerr < 1e-2)",
    ]

    def floor_us(row: dict[str, Any]) -> float:
        return row["n"] * row["k"] / h["copy_gbps"] / 1e3

    text = sweep.markdown(report, names, _spec(), "Triton FP8 GEMM configs vs torch._scaled_mm", header, floor_us)
    lines = ["", "## Decode (M <= 16): % of the weight-read floor", "",
             "| N,K | M | floor µs | torch µs (% floor) | best (PDL) µs (% floor) | best without PDL µs (% floor) "
             "| torch / best |", "|---|---|---|---|---|---|---|"]
    dec = report["summary"]["decode"]
    def cell(v: float | None, floor: float) -> str:
        return f"{v:.2f} ({100 * floor / v:.0f}%)" if v else "-"

    for p in dec["points"]:
        f = p["floor_us"]
        ratio = f"{p['torch_us'] / p['best_us']:.2f}" if p["torch_us"] and p["best_us"] else "-"
        lines.append(f"| {p['n']},{p['k']} | {p['m']} | {f:.2f} | {cell(p['torch_us'], f)} | "
                     f"{cell(p['best_us'], f)} {p['best']} | {cell(p['nopdl_us'], f)} | {ratio} |")
    for key, val in dec.items():
        if key.startswith("M="):
            parts = ", ".join(f"{k2.replace('_floor_frac', '')} {100 * v:.1f}%" for k2, v in val.items() if v)
            lines.append(f"\nGeomean % of floor at {key}: {parts}")
    return text + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
