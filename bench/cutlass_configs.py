"""Every CUTLASS SM90 config x the Llama-3-8B GEMM shapes x M, against torch._scaled_mm (device benchmark).

    python -m bench.cutlass_configs --out DIR [--configs all] [--ms 1,16,64,256,1024,4096,8192]
                                    [--rounds 5] [--quick] [--precise] [--rowwise] [--no-load-time]

What it does, per (N, K) in (6144,4096) (4096,4096) (28672,4096) (4096,14336) and per M:
- builds (once, in parallel) and loads every config's per-tensor bf16 library;
- times each config and torch._scaled_mm (use_fast_accum False and True) with
  :class:`fp8_backends.tuning.timing.CudaGraphTimer`: one CUDA graph per candidate over input copies rotated past
  4x L2, candidates interleaved over several rounds, median per call;
- checks every candidate's graph output against :func:`fp8_backends.core.reference.fp8_gemm` (fp32);
- measures, in a fresh process, how long loading the cached libraries takes (import + dlopen + first call).

Writes ``cutlass_configs.json`` (every number), ``cutlass_configs.md`` (tables: µs per config, best config,
ratio to torch._scaled_mm, geometric means per M class) and ``cutlass_table.json``: the measured best config
per M bucket, in the format of ``FP8_BACKENDS_CUTLASS_TABLE`` / ``configs.DispatchTable`` (per shape, plus a
``default`` from the geometric mean over the shapes; bucket bounds are the geometric midpoints between the
measured M values).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from bench import config_sweep as sweep
from bench.config_sweep import TORCH

SHAPES = sweep.SHAPES
MS = [1, 16, 64, 256, 1024, 4096, 8192]
PREFIX = "cutlass:"


def measure_load_time(specs_json: str) -> dict[str, Any]:
    """A fresh Python process: import, load every cached library, first GEMM call (all timed)."""
    code = textwrap.dedent(
        f"""
        import json, time
        t0 = time.perf_counter()
        from fp8_backends.providers.cutlass import build
        specs = [build.LibrarySpec(**d) for d in json.loads({specs_json!r})]
        t1 = time.perf_counter()
        for s in specs:
            assert build.locate(s) is not None, s.name
            build.get_library(s)
        t2 = time.perf_counter()
        import torch
        from fp8_backends.providers.cutlass.backend import CutlassSm90Backend
        x = torch.ones(16, 4096, device="cuda").to(torch.float8_e4m3fn)
        w = torch.ones(4096, 4096, device="cuda").to(torch.float8_e4m3fn)
        s = torch.ones(1, device="cuda")
        rowwise = specs[0].epilogue == "rowwise"
        sx = torch.ones(16, 1, device="cuda") if rowwise else s
        sw = torch.ones(4096, device="cuda") if rowwise else s
        torch.cuda.synchronize()
        b = CutlassSm90Backend(config=specs[0].config)
        p = b.prepare_weight(w, sw)
        t3 = time.perf_counter()
        y = b.gemm(x, p, sx)
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        print(json.dumps({{"import_s": t1 - t0, "load_all_s": t2 - t1, "libraries": len(specs),
                           "first_gemm_call_s": t4 - t3, "value_ok": bool((y.float() == 4096).all())}}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sweep.add_sweep_args(parser, "all", MS)
    parser.add_argument("--precise", action="store_true", help="time the precise-accumulation kernels")
    parser.add_argument("--rowwise", action="store_true",
                        help="per-token x per-channel scales (the row-wise epilogue; torch's row-wise kernel)")
    parser.add_argument("--no-load-time", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from fp8_backends.core.errors import BuildError
    from fp8_backends.providers.cutlass import build, configs
    from fp8_backends.tuning.timing import l2_cache_bytes

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(configs.CONFIG_NAMES) if args.configs == "all" else args.configs.split(",")
    fast = not args.precise
    device = "cuda"
    ms, shapes, timer = sweep.grid_and_timer(args, device)
    props = torch.cuda.get_device_properties(0)
    header = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": props.name,
        "sm": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": " ".join(sys.argv),
        "fast_accum": fast,
        "scales": "per-token x per-channel" if args.rowwise else "per-tensor",
    }
    print(f"{header['gpu']} SM {header['sm']}, torch {header['torch']}, configs {names}", flush=True)

    # ---- build / load
    specs = build.specs_for(names, ("rowwise" if args.rowwise else "tensor",), ("bfloat16",), (fast,))
    missing = [s for s in specs if build.locate(s) is None]
    t0 = time.perf_counter()
    if missing:
        print(f"building {len(missing)} libraries ...", flush=True)
        for s, r in build.build_many(missing).items():
            if isinstance(r, BuildError):
                print(f"  FAILED {s.name}: {r}", flush=True)
    header["build_s"] = round(time.perf_counter() - t0, 1)
    header["built"] = [s.name for s in missing]
    usable = []
    for s in specs:
        try:
            build.get_library(s)
            usable.append(s.config)
        except BuildError as exc:
            print(f"  unusable {s.config}: {exc}", flush=True)
    tk = toolchain_info(build)
    header.update(tk)

    load = None if args.no_load_time else measure_load_time(
        json.dumps([{"config": s.config, "epilogue": s.epilogue, "out_dtype": s.out_dtype,
                     "fast_accum": s.fast_accum} for s in specs if s.config in usable]))
    if load is not None:
        print(f"cached load (fresh process): {load}", flush=True)

    l2 = l2_cache_bytes(device)
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        for m in ms:
            t_point = time.perf_counter()
            row = measure_point(n, k, m, usable, fast, timer, l2, device, args.rowwise)
            rows.append(row)
            partial = {"header": header, "load": load, "rows": rows, "complete": False}
            (out_dir / "cutlass_configs.json").write_text(json.dumps(partial) + "\n")  # survives a timeout
            torch.cuda.empty_cache()
            best = _best(row, usable)
            tt = row["results"][TORCH]["median_us"]
            line = f"{n:6d}x{k:<6d} M={m:5d} torch {tt if tt is None else round(tt, 1)} us"
            if best:
                line += f"  best {best[0]} {best[1]:.1f} us  x{(tt or float('nan')) / best[1]:.2f}"
            print(line + f"  ({time.perf_counter() - t_point:.1f} s)", flush=True)

    summary = summarize(rows, usable, ms, shapes)
    report = {"header": header, "load": load, "configs": {n: configs.CONFIGS[n].describe() for n in names},
              "rows": rows, "summary": summary}
    (out_dir / "cutlass_configs.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "cutlass_table.json").write_text(_table_text(summary["table"]) + "\n")
    md = markdown(report, usable, ms, shapes)
    (out_dir / "cutlass_configs.md").write_text(md)
    print(md, flush=True)
    return 0


def cutlass_runs(names: list[str], fast: bool) -> Any:
    """``runs_for`` of :func:`bench.config_sweep.measure_point`: one run per CUTLASS config."""

    def runs_for(xsets, wsets, xs, ws, n_sets, check):
        import torch

        from fp8_backends.providers.cutlass.ops import cutlass_gemm
        from fp8_backends.tuning.timing import Run

        def run(name: str) -> Run:
            return Run(lambda i: cutlass_gemm(xsets[i], wsets[i], xs, ws, None, torch.bfloat16, name, fast),
                       n_sets, check)

        return {PREFIX + name: run(name) for name in names}

    return runs_for


def measure_point(n: int, k: int, m: int, names: list[str], fast: bool, timer: Any, l2: int,
                  device: str, rowwise: bool = False) -> dict[str, Any]:
    """Time torch._scaled_mm (both accumulations) and every config on one problem; check every output."""
    return sweep.measure_point(n, k, m, cutlass_runs(names, fast), timer, l2, device, rowwise)


def toolchain_info(build: Any) -> dict[str, Any]:
    try:
        tc = build.get_toolchain()
        return {"nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version}
    except Exception as exc:
        return {"toolchain_error": str(exc)}


def _spec() -> sweep.SweepSpec:
    from fp8_backends.providers.cutlass.configs import DEFAULT_TABLE, DispatchTable

    return sweep.SweepSpec("cutlass", PREFIX, DispatchTable, DEFAULT_TABLE)


def _best(row: dict[str, Any], names: list[str]) -> tuple[str, float] | None:
    return sweep.best(row, names, PREFIX)


def summarize(rows: list[dict[str, Any]], names: list[str], ms: list[int], shapes: list[tuple]) -> dict[str, Any]:
    return sweep.summarize(rows, names, ms, shapes, _spec())


_table_text = sweep.table_text


def markdown(report: dict[str, Any], names: list[str], ms: list[int], shapes: list[tuple]) -> str:
    h = report["header"]
    header = [
        f"- date: {h['date']}; GPU: {h['gpu']} (SM {h['sm']}, {h['multiprocessors']} SMs); torch {h['torch']} "
        f"(CUDA {h['cuda']}); nvcc {h.get('nvcc')}; CUTLASS {h.get('cutlass')}",
        f"- accumulation: {'fast' if h['fast_accum'] else 'precise'}; {h.get('scales', 'per-tensor')} scales, "
        "bf16 out, no bias",
        "- µs per call inside a CUDA graph (median over interleaved rounds, input copies rotated past 4x L2); "
        "every output checked against fp8_backends.core.reference (relerr < 1e-2)",
        f"- command: `{h['command']}`",
    ]
    load = report.get("load")
    if load and "error" not in load:
        header.append(
            f"- cached libraries in a fresh process: import {load['import_s']:.3f} s, load {load['libraries']} "
            f"libraries {load['load_all_s']:.3f} s, first GEMM call (op registration + launch) "
            f"{load['first_gemm_call_s']:.3f} s")
    elif load:
        header.append(f"- cached load failed: {load['error'][:300]}")
    header += ["", "## Configs", ""] + [f"- {d}" for d in report["configs"].values()]
    return sweep.markdown(report, names, _spec(), "CUTLASS SM90 FP8 configs vs torch._scaled_mm", header)


if __name__ == "__main__":
    sys.exit(main())
