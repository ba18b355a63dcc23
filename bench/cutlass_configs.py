"""Every CUTLASS SM90 config x the Llama-3-8B GEMM shapes x M, against torch._scaled_mm (device benchmark).

    python -m bench.cutlass_configs --out DIR [--configs all] [--ms 1,16,64,256,1024,4096,8192]
                                    [--rounds 5] [--quick] [--precise] [--rowwise] [--no-load-time]

What it does, per (N, K) in (6144,4096) (4096,4096) (28672,4096) (4096,14336) and per M:
- builds (once, in parallel) and loads every config's per-tensor bf16 library;
- times each config and torch._scaled_mm (use_fast_accum False and True) with
  :class:`fp8_backends.timing.CudaGraphTimer`: one CUDA graph per candidate over input copies rotated past
  4x L2, candidates interleaved over several rounds, median per call;
- checks every candidate's graph output against :func:`fp8_backends.reference.fp8_gemm` (fp32);
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
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = [1, 16, 64, 256, 1024, 4096, 8192]
TORCH = "torch_scaled_mm"
TORCH_FA = "torch_scaled_mm_fast_accum"
PREFIX = "cutlass:"


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _bounds(ms: list[int]) -> list[int | None]:
    """Upper bucket bounds: the geometric midpoint between neighbouring measured M values; last unbounded."""
    out: list[int | None] = [int(math.floor(math.sqrt(a * b))) for a, b in zip(ms, ms[1:])]
    return [*out, None]


def _buckets(best_by_m: dict[int, str], ms: list[int]) -> list[list[Any]]:
    buckets: list[list[Any]] = []
    for bound, m in zip(_bounds(ms), ms):
        name = best_by_m[m]
        if buckets and buckets[-1][1] == name:
            buckets[-1][0] = bound
        else:
            buckets.append([bound, name])
    return buckets


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
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default="all")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="3 rounds x 2 replays")
    parser.add_argument("--precise", action="store_true", help="time the precise-accumulation kernels")
    parser.add_argument("--rowwise", action="store_true",
                        help="per-token x per-channel scales (the row-wise epilogue; torch's row-wise kernel)")
    parser.add_argument("--no-load-time", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from fp8_backends.errors import BuildError
    from fp8_backends.providers.cutlass import build, configs
    from fp8_backends.timing import CudaGraphTimer, TimerConfig, l2_cache_bytes

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(configs.CONFIG_NAMES) if args.configs == "all" else args.configs.split(",")
    ms = [int(v) for v in args.ms.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    fast = not args.precise
    device = "cuda"
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

    cfg = TimerConfig(rounds=3, replays=2) if args.quick else TimerConfig(rounds=args.rounds, replays=args.replays)
    timer = CudaGraphTimer(cfg, device)
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


def measure_point(n: int, k: int, m: int, names: list[str], fast: bool, timer: Any, l2: int,
                  device: str, rowwise: bool = False) -> dict[str, Any]:
    """Time torch._scaled_mm (both accumulations) and every config on one problem; check every output."""
    import torch

    from fp8_backends import reference
    from fp8_backends.providers.cutlass.ops import cutlass_gemm
    from fp8_backends.timing import Run, rotation_count

    fp8 = torch.float8_e4m3fn
    n_sets = rotation_count(n * k + m * k + 2 * m * n, l2)
    g = torch.Generator(device=device).manual_seed(1000 * m + n + k)
    x0 = (torch.randn(m, k, device=device, generator=g) * 2).to(fp8)
    w0 = (torch.randn(n, k, device=device, generator=g) * 2).to(fp8)
    if rowwise:
        xs = torch.rand(m, 1, device=device, generator=g) * 0.05 + 0.01
        ws = torch.rand(n, device=device, generator=g) * 0.05 + 0.01
    else:
        xs = torch.tensor([0.05], device=device)
        ws = torch.tensor([0.02], device=device)
    ref = reference.fp8_gemm(x0, w0, xs, ws, torch.float32)
    ref_norm = ref.norm().item()
    xsets = [x0] + [x0.clone() for _ in range(n_sets - 1)]
    wsets = [w0] + [w0.clone() for _ in range(n_sets - 1)]
    sa, sb = (xs, ws.reshape(1, n)) if rowwise else (xs.reshape(()), ws.reshape(()))

    def check(out: Any) -> tuple[float, str | None]:
        err = ((out.float() - ref).norm() / ref_norm).item()
        return err, (None if err < 1e-2 else f"relerr {err:.3g}")

    def torch_run(fast_accum: bool) -> Run:
        return Run(lambda i: torch._scaled_mm(xsets[i], wsets[i].t(), scale_a=sa, scale_b=sb,
                                              out_dtype=torch.bfloat16, use_fast_accum=fast_accum), n_sets, check)

    def cutlass_run(name: str) -> Run:
        return Run(lambda i: cutlass_gemm(xsets[i], wsets[i], xs, ws, None, torch.bfloat16, name, fast), n_sets, check)

    runs = {TORCH: torch_run(False), TORCH_FA: torch_run(True)}
    runs.update({PREFIX + name: cutlass_run(name) for name in names})
    errors: dict[str, float] = {}
    for label, run in runs.items():  # eager correctness of set 0 (the timer re-checks the graph outputs)
        try:
            errors[label] = check(run.fn(0))[0]
        except Exception as exc:  # recorded; the run goes on
            errors[label] = float("nan")
            print(f"  {label} failed eagerly: {type(exc).__name__}: {exc}", flush=True)
    results = timer(runs)
    row: dict[str, Any] = {"n": n, "k": k, "m": m, "n_sets": n_sets, "results": {}}
    for label, meas in results.items():
        row["results"][label] = {**meas.to_json(), "relerr": errors.get(label)}
    return row


def toolchain_info(build: Any) -> dict[str, Any]:
    try:
        tc = build.get_toolchain()
        return {"nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version}
    except Exception as exc:
        return {"toolchain_error": str(exc)}


def _us(row: dict[str, Any], label: str) -> float | None:
    r = row["results"].get(label)
    if not r or r.get("error") or r.get("median_us") is None:
        return None
    if r.get("relerr") is None or not (r["relerr"] < 1e-2):
        return None
    return r["median_us"]


def _best(row: dict[str, Any], names: list[str]) -> tuple[str, float] | None:
    cands = [(n, _us(row, PREFIX + n)) for n in names]
    cands = [(n, t) for n, t in cands if t is not None]
    return min(cands, key=lambda c: c[1]) if cands else None


def summarize(rows: list[dict[str, Any]], names: list[str], ms: list[int], shapes: list[tuple]) -> dict[str, Any]:
    from fp8_backends.providers.cutlass.configs import DEFAULT_TABLE, DispatchTable

    by = {(r["n"], r["k"], r["m"]): r for r in rows}
    per_shape: dict[str, list[list[Any]]] = {}
    default_best: dict[int, str] = {}
    for n, k in shapes:
        best_by_m = {}
        for m in ms:
            b = _best(by[(n, k, m)], names)
            if b:
                best_by_m[m] = b[0]
        if len(best_by_m) == len(ms):
            per_shape[f"{n}x{k}"] = _buckets(best_by_m, ms)
    for m in ms:  # the config with the best geometric-mean speed (relative to torch) over the shapes
        scores = {}
        for name in names:
            ratios = []
            for n, k in shapes:
                row = by[(n, k, m)]
                t, c = _us(row, TORCH), _us(row, PREFIX + name)
                if t and c:
                    ratios.append(t / c)
            if len(ratios) == len(shapes):
                scores[name] = _geomean(ratios)
        if scores:
            default_best[m] = max(scores, key=scores.get)
    table = {
        "format": "fp8_backends.cutlass_table/1",
        "source": f"bench/cutlass_configs.py measurement, {_dt.date.today().isoformat()}",
        "default": _buckets(default_best, ms) if len(default_best) == len(ms) else None,
        "shapes": per_shape,
    }

    def ratios(pick) -> dict[str, Any]:
        out: dict[str, Any] = {}
        classes = {"M<=16": lambda m: m <= 16, "M=64-256": lambda m: 64 <= m <= 256, "M<=256": lambda m: m <= 256,
                   "M=1024": lambda m: m == 1024, "M>=4096": lambda m: m >= 4096}
        for cls, sel in classes.items():
            vals = []
            for (n, k, m), row in by.items():
                if not sel(m):
                    continue
                t = _us(row, TORCH)
                name = pick(n, k, m, row)
                c = _us(row, PREFIX + name) if name else None
                if t and c:
                    vals.append(t / c)
            if vals:
                out[cls] = {"geomean": round(_geomean(vals), 3), "min": round(min(vals), 3),
                            "max": round(max(vals), 3), "points": len(vals)}
        return out

    def pick_best(n, k, m, row):
        b = _best(row, names)
        return b[0] if b else None

    measured = DispatchTable.from_json(table) if table["default"] is not None else None
    summary = {
        "table": table,
        "ratio_best_per_point": ratios(pick_best),
        "ratio_builtin_table": ratios(lambda n, k, m, row: DEFAULT_TABLE.pick(m, n, k)),
        "ratio_measured_table": ratios(lambda n, k, m, row: measured.pick(m, n, k)) if measured else None,
        "ratio_measured_default_only": ratios(
            lambda n, k, m, row: DispatchTable.from_json({**table, "shapes": {}}).pick(m, n, k)) if measured else None,
        "torch_fast_accum_vs_torch": {},
    }
    fa = []
    for row in rows:
        t, f = _us(row, TORCH), _us(row, TORCH_FA)
        if t and f:
            fa.append(t / f)
    summary["torch_fast_accum_vs_torch"] = {"geomean": round(_geomean(fa), 3)} if fa else {}
    return summary


def _table_text(table: dict[str, Any]) -> str:
    """The table JSON with one line per bucket list."""
    lines = ["{", f' "format": {json.dumps(table["format"])},', f' "source": {json.dumps(table["source"])},',
             f' "default": {json.dumps(table["default"])},', ' "shapes": {']
    items = list(table["shapes"].items())
    for i, (shape, buckets) in enumerate(items):
        lines.append(f'  {json.dumps(shape)}: {json.dumps(buckets)}' + ("," if i < len(items) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines)


def markdown(report: dict[str, Any], names: list[str], ms: list[int], shapes: list[tuple]) -> str:
    h = report["header"]
    lines = [
        "# CUTLASS SM90 FP8 configs vs torch._scaled_mm",
        "",
        f"- date: {h['date']}; GPU: {h['gpu']} (SM {h['sm']}, {h['multiprocessors']} SMs); torch {h['torch']} "
        f"(CUDA {h['cuda']}); nvcc {h.get('nvcc')}; CUTLASS {h.get('cutlass')}",
        f"- accumulation: {'fast' if h['fast_accum'] else 'precise'}; {h.get('scales', 'per-tensor')} scales, "
        "bf16 out, no bias",
        "- µs per call inside a CUDA graph (median over interleaved rounds, input copies rotated past 4x L2); "
        "every output checked against fp8_backends.reference (relerr < 1e-2)",
        f"- command: `{h['command']}`",
    ]
    load = report.get("load")
    if load and "error" not in load:
        lines.append(
            f"- cached libraries in a fresh process: import {load['import_s']:.3f} s, load {load['libraries']} "
            f"libraries {load['load_all_s']:.3f} s, first GEMM call (op registration + launch) "
            f"{load['first_gemm_call_s']:.3f} s")
    elif load:
        lines.append(f"- cached load failed: {load['error'][:300]}")
    lines += ["", "## Configs", ""] + [f"- {d}" for d in report["configs"].values()]
    lines += ["", "## µs per call", ""]
    head = ["N,K", "M", "torch", "torch fa", *names, "best", "torch/best"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for row in report["rows"]:
        cells = [f"{row['n']},{row['k']}", str(row["m"])]
        for label in (TORCH, TORCH_FA, *(PREFIX + n for n in names)):
            t = _us(row, label)
            r = row["results"].get(label, {})
            cells.append(f"{t:.1f}" if t is not None else ("err" if r.get("error") or r else "-"))
        b = _best(row, names)
        t = _us(row, TORCH)
        cells += [b[0] if b else "-", f"{t / b[1]:.2f}" if b and t else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    s = report["summary"]
    lines += ["", "## Speed relative to torch._scaled_mm (geometric mean over points; min-max)", ""]
    lines.append("| pick | " + " | ".join(["M<=16", "M=64-256", "M<=256", "M=1024", "M>=4096"]) + " |")
    lines.append("|---|---|---|---|---|---|")
    for label, key in (("best config per point", "ratio_best_per_point"),
                       ("measured table (per shape)", "ratio_measured_table"),
                       ("measured table (default buckets only)", "ratio_measured_default_only"),
                       ("built-in table at run time", "ratio_builtin_table")):
        data = s.get(key) or {}
        cells = []
        for cls in ("M<=16", "M=64-256", "M<=256", "M=1024", "M>=4096"):
            d = data.get(cls)
            cells.append(f"{d['geomean']:.2f} ({d['min']:.2f}-{d['max']:.2f})" if d else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if s.get("torch_fast_accum_vs_torch"):
        lines.append(f"\ntorch._scaled_mm use_fast_accum=True vs False: {s['torch_fast_accum_vs_torch']['geomean']}x "
                     "(geomean over every point)")
    lines += ["", "## Measured dispatch table (cutlass_table.json)", "", "```json", _table_text(s["table"]), "```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
