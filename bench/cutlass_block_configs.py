"""Every CUTLASS SM90 block-scaled config x block-checkpoint GEMM shapes x M, against bf16 ``torch.mm`` (device
benchmark): the measurement that replaces the block dispatch table's first choice.

    python -m bench.cutlass_block_configs --out DIR [--configs all] [--ms 1,4,16,64,256,1024,4096]
                                          [--shapes 2112x7168,...] [--rounds 5] [--quick]

Per (N, K) and M:
- builds (once, in parallel) and loads every block config's bf16 library;
- quantizes random activations per 1x128 group and weights per 128x128 block (the activation scales in the
  padded M-major layout the kernels read without a copy);
- times bf16 ``torch.mm`` and each config (``fp8_backends.providers.cutlass.block_ops.cutlass_block_gemm`` with
  ``config=<name>``) with :class:`fp8_backends.tuning.timing.CudaGraphTimer`: one CUDA graph per candidate over input
  copies rotated past 4x L2, candidates interleaved over several rounds, median per call;
- checks every output against an fp32 dequantize-then-matmul reference (relerr < 1e-2 to count).

Writes ``cutlass_block_configs.json`` (every number), ``cutlass_block_configs.md`` (µs per config, best config,
ratio to bf16, % of the weight-read floor at the copy bandwidth) and ``cutlass_block_table.json``: the measured best
config per M bucket in :class:`fp8_backends.providers.cutlass.block_configs.BlockDispatchTable`'s format (per shape,
``default`` from the shapes with K < 3N and ``long_k`` from those with K >= 3N, each by geometric-mean speed over its
shapes; bucket bounds at the geometric midpoints of the measured M).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import config_sweep as sweep

#: (N, K) of block-checkpoint layers: DeepSeek-V3 (q_a + kv_a 2112x7168, q_b 24576x1536, kv_a 576x7168, o 7168x16384,
#: dense gate_up 36864x7168 / down 7168x18432, their TP8 splits 4608x7168 and 7168x2304), Qwen3-8B (qkv 6144x4096,
#: o 4096x4096, gate_up 24576x4096, down 4096x12288), Qwen3-32B (qkv 10240x5120, down 5120x25600)
SHAPES = [(2112, 7168), (24576, 1536), (576, 7168), (7168, 16384), (36864, 7168), (7168, 18432), (4608, 7168),
          (7168, 2304), (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (10240, 5120), (5120, 25600)]
MS = [1, 4, 16, 64, 256, 1024, 4096]
BF16 = "torch_mm_bf16"
PREFIX = "cutlass:"
GROUP = 128


def _quantized(m: int, n: int, k: int, device: str, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g)
    w = torch.randn(n, k, device=device, generator=g) * 0.02
    kb, nb = -(-k // GROUP), -(-n // GROUP)
    xp = torch.nn.functional.pad(x, (0, kb * GROUP - k)).view(m, kb, GROUP)
    xs = (xp.abs().amax(-1) / 448.0).clamp_min(1e-12)
    x_q = (xp / xs[..., None]).view(m, kb * GROUP)[:, :k].to(torch.float8_e4m3fn).contiguous()
    wp = torch.nn.functional.pad(w, (0, kb * GROUP - k, 0, nb * GROUP - n)).view(nb, GROUP, kb, GROUP)
    ws = (wp.abs().amax((1, 3)) / 448.0).clamp_min(1e-12)
    w_q = (wp / ws[:, None, :, None]).view(nb * GROUP, kb * GROUP)[:n, :k].to(torch.float8_e4m3fn).contiguous()
    rows = -(-m // 4) * 4
    xs_buf = torch.zeros(kb, rows, device=device)
    xs_buf[:, :m] = xs.t()
    xs_mm = xs_buf[:, :m].t()  # the padded M-major layout
    ref = (x_q.float() * xs.repeat_interleave(GROUP, 1)[:, :k]) @ (
        w_q.float() * ws.repeat_interleave(GROUP, 0)[:n].repeat_interleave(GROUP, 1)[:, :k]).t()
    return {"x_q": x_q, "xs": xs_mm, "w_q": w_q, "ws": ws.contiguous(), "x_bf16": x.to(torch.bfloat16),
            "w_bf16": w.to(torch.bfloat16), "ref": ref}


def measure_point(n: int, k: int, m: int, names: list[str], timer: Any, l2: int, device: str) -> dict[str, Any]:
    """bf16 torch.mm and every block config on one problem, interleaved in CUDA graphs; outputs checked."""
    import torch

    from fp8_backends.providers.cutlass.block_ops import cutlass_block_gemm
    from fp8_backends.tuning.timing import Run, rotation_count

    n_sets = rotation_count(n * k * 2 + m * k * 2 + 2 * m * n, l2)
    d = _quantized(m, n, k, device, 1000 * m + n + k)
    ref, ref_norm = d["ref"], d["ref"].norm().item()
    x_sets = [d["x_q"]] + [d["x_q"].clone() for _ in range(n_sets - 1)]
    w_sets = [d["w_q"]] + [d["w_q"].clone() for _ in range(n_sets - 1)]
    wb_sets = [d["w_bf16"]] + [d["w_bf16"].clone() for _ in range(n_sets - 1)]
    xs, ws, xb = d["xs"], d["ws"], d["x_bf16"]

    def check(out: Any) -> tuple[float, str | None]:
        err = ((out.float() - ref).norm() / ref_norm).item()
        return err, (None if err < 1e-2 else f"relerr {err:.3g}")

    def check_bf16(out: Any) -> tuple[float, str | None]:
        return 0.0, None  # a different computation (unquantized inputs): timed, not compared

    runs = {BF16: Run(lambda i: torch.mm(xb, wb_sets[i].t()), n_sets, check_bf16)}
    for name in names:
        runs[PREFIX + name] = Run(
            lambda i, name=name: cutlass_block_gemm(x_sets[i], w_sets[i], xs, ws, None, torch.bfloat16, name),
            n_sets, check)
    errors: dict[str, float] = {}
    for label, run in runs.items():
        try:
            errors[label] = run.check(run.fn(0))[0] if run.check else float("nan")
        except Exception as exc:  # recorded; the sweep goes on
            errors[label] = float("nan")
            print(f"  {label} failed eagerly: {type(exc).__name__}: {exc}", flush=True)
    results = timer(runs)
    row: dict[str, Any] = {"n": n, "k": k, "m": m, "n_sets": n_sets, "results": {}}
    for label, meas in results.items():
        row["results"][label] = {**meas.to_json(), "relerr": errors.get(label)}
    return row


def _us(row: dict[str, Any], label: str) -> float | None:
    r = row["results"].get(label)
    if not r or r.get("error") or r.get("median_us") is None:
        return None
    if label != BF16 and not (r.get("relerr") is not None and r["relerr"] < 1e-2):
        return None
    return r["median_us"]


def _best(row: dict[str, Any], names: list[str]) -> tuple[str, float] | None:
    cands = [(n, _us(row, PREFIX + n)) for n in names]
    cands = [(n, t) for n, t in cands if t is not None]
    return min(cands, key=lambda c: c[1]) if cands else None


def _geomean_best(by: dict, names: list[str], shapes: list[tuple[int, int]], m: int) -> str | None:
    scores = {}
    for name in names:
        ratios = []
        for n, k in shapes:
            row = by[(n, k, m)]
            b, c = _us(row, BF16), _us(row, PREFIX + name)
            if b and c:
                ratios.append(b / c)
        if ratios and len(ratios) == len(shapes):
            scores[name] = sweep.geomean(ratios)
    return max(scores, key=scores.get) if scores else None


def summarize(rows: list[dict[str, Any]], names: list[str], ms: list[int],
              shapes: list[tuple[int, int]]) -> dict[str, Any]:
    """The measured block table (per shape; ``default`` / ``long_k`` by geometric mean) and the speed of the best
    config per point relative to bf16."""
    from fp8_backends.providers.cutlass.block_configs import LONG_K_RATIO, BlockDispatchTable

    by = {(r["n"], r["k"], r["m"]): r for r in rows}
    per_shape = {}
    for n, k in shapes:
        best_by_m = {m: b[0] for m in ms if (b := _best(by[(n, k, m)], names))}
        if len(best_by_m) == len(ms):
            per_shape[f"{n}x{k}"] = sweep.buckets(best_by_m, ms)
    table: dict[str, Any] = {"format": BlockDispatchTable.FORMAT,
                             "source": f"bench/cutlass_block_configs.py measurement, {_dt.date.today().isoformat()}",
                             "shapes": per_shape}
    for key, group in (("default", [s for s in shapes if s[1] < LONG_K_RATIO * s[0]]),
                       ("long_k", [s for s in shapes if s[1] >= LONG_K_RATIO * s[0]])):
        picks = {m: p for m in ms if group and (p := _geomean_best(by, names, group, m))}
        table[key] = sweep.buckets(picks, ms) if len(picks) == len(ms) else None
    if table["default"] is None:
        table["default"] = table.get("long_k")
    ratios = []
    for row in rows:
        b, best = _us(row, BF16), _best(row, names)
        if b and best:
            ratios.append({"n": row["n"], "k": row["k"], "m": row["m"], "best": best[0],
                           "best_over_bf16": round(b / best[1], 3)})
    valid = None
    if table["default"]:
        try:
            BlockDispatchTable.from_json({k: v for k, v in table.items() if v is not None})
            valid = True
        except ValueError as exc:
            valid = str(exc)
    return {"table": table, "table_valid": valid, "best_vs_bf16": ratios}


def markdown(report: dict[str, Any], names: list[str], copy_gbps: float | None) -> str:
    from bench.common import fmt, md_table

    h = report["header"]
    lines = ["# CUTLASS SM90 block-scaled FP8 configs vs bf16 torch.mm", "",
             f"- {h['date']}; {h['gpu']} (SM {h['sm']}); torch {h['torch']}; nvcc {h.get('nvcc')}; CUTLASS "
             f"{h.get('cutlass')}; copy {fmt(copy_gbps, '.0f')} GB/s",
             "- µs per call inside a CUDA graph (median of interleaved rounds, inputs rotated past 4x L2); "
             "1x128 activation groups (padded M-major scales), 128x128 weight blocks, bf16 out; outputs checked "
             "against fp32 dequantize-then-matmul (relerr < 1e-2)",
             f"- command: `{h['command']}`", "", "## µs per call", ""]
    head = ["N,K", "M", "bf16", *names, "best", "bf16/best", "floor µs", "best % floor"]
    body = []
    for row in report["rows"]:
        n, k, m = row["n"], row["k"], row["m"]
        best = _best(row, names)
        b = _us(row, BF16)
        floor = ((n * k + (-(-n // GROUP)) * (-(-k // GROUP)) * 4) / (copy_gbps * 1e3)) if copy_gbps else None
        body.append([f"{n},{k}", m, fmt(b, ".1f"), *(fmt(_us(row, PREFIX + c), ".1f") for c in names),
                     best[0] if best else "-", fmt(b / best[1] if b and best else None),
                     fmt(floor, ".1f"), fmt(100 * floor / best[1] if floor and best else None, ".0f")])
    lines += md_table(head, body)
    lines += ["", "## Measured table", "", "```json", json.dumps(report["summary"]["table"], indent=1), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default="all")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="3 rounds x 2 replays")
    args = parser.parse_args(argv)

    import torch

    from fp8_backends.core.errors import BuildError
    from fp8_backends.providers.cutlass import block_configs, build
    from fp8_backends.tuning.timing import l2_cache_bytes, measure_copy_bandwidth

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(block_configs.BLOCK_CONFIG_NAMES) if args.configs == "all" else args.configs.split(",")
    device = "cuda"
    ms, shapes, timer = sweep.grid_and_timer(args, device)
    props = torch.cuda.get_device_properties(0)
    header: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "gpu": props.name,
        "sm": f"{props.major}.{props.minor}", "torch": torch.__version__, "command": " ".join(sys.argv),
    }
    specs = build.block_specs_for(names)
    missing = [s for s in specs if build.locate(s) is None]
    t0 = time.perf_counter()
    if missing:
        print(f"building {len(missing)} block libraries ...", flush=True)
        for s, r in build.build_many(missing).items():
            if isinstance(r, BuildError):
                print(f"  FAILED {s.name}: {r}", flush=True)
    header["build_s"] = round(time.perf_counter() - t0, 1)
    usable = []
    for s in specs:
        try:
            build.get_library(s)
            usable.append(s.config)
        except BuildError as exc:
            print(f"  unusable {s.config}: {exc}", flush=True)
    try:
        tc = build.get_toolchain()
        header.update(nvcc=tc.nvcc_version, cutlass=tc.cutlass_version)
    except BuildError as exc:
        header["toolchain_error"] = str(exc)
    copy_gbps = measure_copy_bandwidth(device)
    header["copy_gbps"] = round(copy_gbps, 1)
    l2 = l2_cache_bytes(device)
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        for m in ms:
            t_point = time.perf_counter()
            row = measure_point(n, k, m, usable, timer, l2, device)
            rows.append(row)
            (out_dir / "cutlass_block_configs.json").write_text(
                json.dumps({"header": header, "rows": rows, "complete": False}) + "\n")  # survives a timeout
            torch.cuda.empty_cache()
            best = _best(row, usable)
            b = _us(row, BF16)
            line = f"{n:6d}x{k:<6d} M={m:5d} bf16 {round(b, 1) if b else None} us"
            if best:
                line += f"  best {best[0]} {best[1]:.1f} us  x{(b or float('nan')) / best[1]:.2f}"
            print(line + f"  ({time.perf_counter() - t_point:.1f} s)", flush=True)
    summary = summarize(rows, usable, ms, shapes)
    report = {"header": header, "configs": {c: block_configs.BLOCK_CONFIGS[c].describe() for c in names},
              "rows": rows, "summary": summary}
    (out_dir / "cutlass_block_configs.json").write_text(json.dumps(report, indent=1) + "\n")
    (out_dir / "cutlass_block_table.json").write_text(json.dumps(summary["table"], indent=1) + "\n")
    md = markdown(report, usable, copy_gbps)
    (out_dir / "cutlass_block_configs.md").write_text(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
