"""Benchmark: a Llama-3-8B decoder block, bf16 vs plain FP8 (torch ops) vs the library's FP8 path.

Variants (the block of ``examples/decoder_block.py``; one set of random weights, static per-tensor
input scales calibrated on the bf16 block):

- ``bf16``: ``nn.Linear`` in the model dtype
- ``plain_fp8``: torch ops only (divide / clamp / cast, ``torch._scaled_mm``)
- ``lib_unfused``: ``Fp8Linear`` quantizing its own input, plain RMSNorm
- ``lib_fused``: ``RMSNormFp8Quant`` handing ``Fp8Linear`` a ``QuantizedActivation``

each ``eager`` and ``compiled`` (``torch.compile(fullgraph=True, dynamic=False)``, Inductor), each
timed two ways: per call with CUDA events around one call (``call`` µs: includes host time the GPU
waits for) and inside a CUDA graph of ``--graph-reps`` calls (``graph`` µs: GPU time, no launch gaps).
``--rounds`` interleaved rounds (within a round the variants' single calls alternate one by one, so a change of the
GPU's clocks reaches every variant alike); medians reported with the min-max spread.

Also measured in the same run: the device-to-device copy bandwidth (bytes read + written), which
sets the FP8 weight-read floor at 1 token (``floor µs = FP8 weight bytes / copy bandwidth``).

Target: ``lib_fused`` at <= 0.85x the time of compiled ``plain_fp8`` at every size (same mode).

Writes into ``--out``: ``decoder_block_T<T>.json`` per size as it finishes (so an interrupted run
keeps what it measured), then ``decoder_block.json`` and ``decoder_block.md`` merged from every
per-size file in the folder (several runs with different ``--tokens`` into one folder combine).

    python bench/decoder_block.py --out bench/results/decoder_block            # H200: 1 16 256 4096
    python bench/decoder_block.py --out $OUT --tokens 1 16 && \
        python bench/decoder_block.py --out $OUT --tokens 256 4096              # two commands, one report
    python bench/decoder_block.py --out /tmp/db --device cpu --small --tokens 1 4 --rounds 1   # smoke test
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import gc
import importlib.util
import json
import logging
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
VARIANTS = ("bf16", "plain_fp8", "lib_unfused", "lib_fused")
MODES = ("eager", "compiled")
BASELINE = ("plain_fp8", "compiled")
TARGET = 0.85


def load_example():
    path = HERE.parent / "examples" / "decoder_block.py"
    spec = importlib.util.spec_from_file_location("fp8_backends_example_decoder_block", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def copy_bandwidth_gbs(device: str) -> float | None:
    """Device-to-device copy bandwidth (GB/s, bytes read + written); None on the CPU."""
    if device != "cuda":
        return None
    from fp8_backends.tuning.timing import measure_copy_bandwidth

    return measure_copy_bandwidth(device)


def compile_block(block, backend: str, fullgraph: bool = True):
    """``torch.compile(dynamic=False)``; compilation itself happens at the first call."""
    return torch.compile(block, backend=backend, fullgraph=fullgraph, dynamic=False), fullgraph


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_size(ex, blocks, cfg, t: int, args, compiled: dict, log) -> dict:
    """Every variant at ``t`` tokens: correctness, then ``args.rounds`` interleaved timing rounds."""
    device, dtype = args.device, getattr(torch, args.dtype)
    hidden, residual = ex.make_inputs(cfg, t, dtype, device)
    ref, _ = blocks["bf16"](hidden, residual.clone())
    row: dict = {"T": t, "variants": {}}
    calls, graphs = {}, {}
    outputs = {}
    for variant in VARIANTS:
        for mode in MODES:
            if mode not in args.modes:
                continue
            key = f"{variant}/{mode}"
            entry: dict = {}
            row["variants"][key] = entry
            try:
                if mode == "compiled":
                    if variant not in compiled:
                        compiled[variant] = compile_block(blocks[variant], args.compile_backend)
                    fn, fullgraph = compiled[variant]
                    entry["fullgraph"] = fullgraph
                else:
                    fn = blocks[variant]
                t0 = time.perf_counter()
                try:
                    y, _ = fn(hidden, residual.clone())
                except Exception as exc:
                    if mode != "compiled" or not entry["fullgraph"]:
                        raise
                    # a graph break (or a compile failure): note it, then measure with breaks allowed
                    entry["fullgraph_error"] = f"{type(exc).__name__}: {exc}"[:500]
                    log(f"  T={t} {key}: fullgraph compile failed ({entry['fullgraph_error'][:200]}); retrying")
                    compiled[variant] = compile_block(blocks[variant], args.compile_backend, fullgraph=False)
                    fn, entry["fullgraph"] = compiled[variant]
                    y, _ = fn(hidden, residual.clone())
                call = functools.partial(fn, hidden, residual.clone())  # lib blocks update it in place
                if device == "cuda":
                    torch.cuda.synchronize()
                entry["first_call_s"] = round(time.perf_counter() - t0, 3)  # includes compilation
                if y.dtype != dtype:
                    raise RuntimeError(f"output dtype {y.dtype}, expected {dtype}")
                entry["relerr_vs_bf16"] = ex.relerr(y, ref)
                outputs[key] = y
                calls[key] = call
                if device == "cuda" and args.graph:
                    graphs[key] = ex.capture_graph(call, args.graph_reps)
            except Exception as exc:  # keep going: one broken variant must not lose the others
                entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
                log(f"  T={t} {key}: ERROR {entry['error']}")
                logging.debug(traceback.format_exc())
    base = outputs.get("/".join(BASELINE))
    for key, y in outputs.items():
        if base is not None:
            row["variants"][key]["relerr_vs_plain_compiled"] = ex.relerr(y, base)
    samples: dict[str, dict[str, list[float]]] = {key: {"call": [], "graph": []} for key in calls}
    for _ in range(args.rounds):
        # the calls interleaved variant by variant (the GPU's clocks move within a round at large T); a variant that
        # fails is dropped, the others go on
        errors: dict[str, Exception] = {}
        for key, us in ex.time_interleaved_us(calls, device, iters=args.iters, errors=errors).items():
            samples[key]["call"].append(us)
        for key, exc in errors.items():
            row["variants"][key]["error"] = f"timing: {type(exc).__name__}: {exc}"[:500]
            calls.pop(key)
        for key in calls:
            try:
                if key in graphs:
                    g = graphs[key]
                    samples[key]["graph"].append(ex.time_eager_us(g.replay, device, iters=args.iters)
                                                 / args.graph_reps)
            except Exception as exc:
                row["variants"][key]["error"] = f"timing: {type(exc).__name__}: {exc}"[:500]
    for key, s in samples.items():
        for kind in ("call", "graph"):
            if s[kind]:
                row["variants"][key][f"{kind}_us"] = summarize(s[kind])
    graphs.clear()
    del calls, outputs
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    add_ratios(row)
    return row


def add_ratios(row: dict) -> None:
    base = row["variants"].get("/".join(BASELINE), {})
    for entry in row["variants"].values():
        for kind in ("call", "graph"):
            if f"{kind}_us" in entry and f"{kind}_us" in base:
                entry[f"{kind}_ratio_vs_plain_compiled"] = entry[f"{kind}_us"]["median"] / base[f"{kind}_us"]["median"]


# ------------------------------------------------------------------------------------------ report
def _fmt(entry: dict, kind: str) -> str:
    if "error" in entry and f"{kind}_us" not in entry:
        return "error"
    v = entry.get(f"{kind}_us")
    return "-" if v is None else f"{v['median']:.1f}"


def render_markdown(merged: dict) -> str:
    rows = sorted(merged["rows"], key=lambda r: r["T"])
    meta = merged["meta"]
    keys = [f"{v}/{m}" for v in VARIANTS for m in MODES]
    lines = [
        "# Decoder block (Llama-3-8B linear sizes): bf16 vs plain FP8 vs fp8_backends",
        "",
        f"{meta.get('device_name', '?')}, torch {meta.get('torch')}, dtype {meta.get('dtype')}, "
        f"block hidden {meta['config']['hidden']} / heads {meta['config']['heads']}/{meta['config']['kv_heads']} / "
        f"intermediate {meta['config']['intermediate']}; FP8 weights {meta['fp8_weight_bytes'] / 1e6:.1f} MB.",
        "Copy bandwidth (read+write) in the run(s): "
        + (", ".join(f"{b:.0f}" for b in meta.get("copy_gbs", []) if b) or "n/a") + " GB/s.",
        "",
        "µs per block, median over rounds. `graph`: inside a CUDA graph (GPU time); `call`: one call timed with",
        "CUDA events (includes host time), the variants' calls interleaved one by one within each round. Ratios are",
        "against `plain_fp8/compiled` in the same mode and run.",
        "",
    ]
    for kind in ("graph", "call"):
        lines += [f"## {kind} µs", "", "| T | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for r in rows:
            lines.append(f"| {r['T']} | " + " | ".join(_fmt(r["variants"].get(k, {}), kind) for k in keys) + " |")
        lines += ["", f"### {kind}: ratio to plain_fp8/compiled (target for lib_fused: <= {TARGET})", "",
                  "| T | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for r in rows:
            cells = []
            for k in keys:
                ratio = r["variants"].get(k, {}).get(f"{kind}_ratio_vs_plain_compiled")
                cells.append("-" if ratio is None else f"{ratio:.2f}")
            lines.append(f"| {r['T']} | " + " | ".join(cells) + " |")
        lines.append("")
    one = next((r for r in rows if r["T"] == 1), None)
    if one is not None and one.get("floor_us"):
        lines += [f"## % of the FP8 weight-read floor at 1 token (floor {one['floor_us']:.1f} µs, graph time)", "",
                  "| variant | graph µs | % of floor |", "|---|---|---|"]
        for k in keys:
            e = one["variants"].get(k, {})
            if "graph_us" in e and not k.startswith("bf16"):
                us = e["graph_us"]["median"]
                lines.append(f"| {k} | {us:.1f} | {100 * one['floor_us'] / us:.0f}% |")
        lines.append("")
    lines += ["## Spread (min-max over rounds, graph µs) and accuracy", "",
              "| T | variant | graph min-max | call min-max | relerr vs bf16 | relerr vs plain compiled "
              "| first call s |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        for k in keys:
            e = r["variants"].get(k)
            if not e:
                continue
            g, c = e.get("graph_us"), e.get("call_us")
            g_range = f"{g['min']:.1f}-{g['max']:.1f}" if g else "-"
            c_range = f"{c['min']:.1f}-{c['max']:.1f}" if c else "-"
            lines.append(
                f"| {r['T']} | {k} | {g_range} | {c_range} | {e.get('relerr_vs_bf16', float('nan')):.4f} | "
                f"{e.get('relerr_vs_plain_compiled', float('nan')):.4f} | {e.get('first_call_s', '-')} |"
                + (f" error: {e['error'][:120]}" if "error" in e else "")
            )
    lines += ["", "## Providers (library variants)", ""]
    for variant, provs in meta.get("providers", {}).items():
        lines.append(f"- {variant}: " + ", ".join(f"{k}={v}" for k, v in provs.items()))
    if merged.get("skipped"):
        lines += ["", f"Skipped (time budget): T = {', '.join(str(t) for t in merged['skipped'])}"]
    return "\n".join(lines) + "\n"


def compact_table(merged: dict) -> str:
    keys = [f"{v}/{m}" for v in VARIANTS for m in MODES]
    short = {k: k.replace("plain_fp8", "plain").replace("lib_", "").replace("/eager", "/e").replace("/compiled", "/c")
             for k in keys}
    out = ["graph µs per block (c = compiled, e = eager); last two columns: lib fused / plain compiled (graph)"]
    out.append(f"{'T':>5} " + " ".join(f"{short[k]:>11}" for k in keys) + f" {'fused/e':>8} {'fused/c':>8}")
    for r in sorted(merged["rows"], key=lambda r: r["T"]):
        cells = [_fmt(r["variants"].get(k, {}), "graph") for k in keys]
        ratios = []
        for k in ("lib_fused/eager", "lib_fused/compiled"):
            x = r["variants"].get(k, {}).get("graph_ratio_vs_plain_compiled")
            ratios.append("-" if x is None else f"{x:.2f}{'*' if x <= TARGET else ''}")
        out.append(f"{r['T']:>5} " + " ".join(f"{c:>11}" for c in cells) + " " + " ".join(f"{x:>8}" for x in ratios))
    out.append(f"(* = meets the <= {TARGET}x target)")
    return "\n".join(out)


def merge(out_dir: Path, meta: dict, skipped: list[int]) -> dict:
    rows, copy = {}, []
    for path in sorted(out_dir.glob("decoder_block_T*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rows[data["row"]["T"]] = data["row"]
        copy += [b for b in data["meta"].get("copy_gbs", []) if b]
    meta = dict(meta, copy_gbs=copy or meta.get("copy_gbs", []))
    return {"meta": meta, "rows": list(rows.values()), "skipped": [t for t in skipped if t not in rows]}


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    """Command-line entry; restores the grad mode and the fp8_backends log level it changes."""
    logger = logging.getLogger("fp8_backends")
    level, grad = logger.level, torch.is_grad_enabled()
    try:
        return _main(argv)
    finally:
        logger.setLevel(level)
        torch.set_grad_enabled(grad)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the JSON and markdown results")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--small", action="store_true", help="small block (CPU smoke test)")
    ap.add_argument("--backend", default=None, help="GEMM provider for the library (default: env or auto)")
    ap.add_argument("--norm-backend", default=None, help="norm-quant provider (default: env or auto)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--compile-backend", default=None, help="default: inductor (cuda), aot_eager (cpu)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--graph-reps", type=int, default=8)
    ap.add_argument("--no-graph", dest="graph", action="store_false")
    ap.add_argument("--budget-s", type=float, default=540.0,
                    help="start no new size after this many seconds (results so far are kept)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device; use --device cpu --small for a smoke test")
    args.compile_backend = args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager")
    args.graph = args.graph and args.device == "cuda"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("fp8_backends").setLevel(logging.INFO)
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    torch.set_grad_enabled(False)
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 32))  # one compile per T
    ex = load_example()
    cfg = ex.SMALL if args.small else ex.LLAMA3_8B
    dtype = getattr(torch, args.dtype)
    log(f"building blocks ({'small' if args.small else 'Llama-3-8B'}, {args.dtype}, {args.device})")
    blocks = ex.build_blocks(cfg, dtype, args.device, backend=args.backend, norm_backend=args.norm_backend)
    providers = {v: blocks[v].providers() for v in ("lib_unfused", "lib_fused")}
    for v, p in providers.items():
        log(f"providers {v}: " + ", ".join(f"{k}={x}" for k, x in p.items()))
    copy_start = copy_bandwidth_gbs(args.device)
    if copy_start:
        log(f"copy bandwidth {copy_start:.0f} GB/s (read + write)")
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "config": {"hidden": cfg.hidden, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                   "intermediate": cfg.intermediate},
        "fp8_weight_bytes": cfg.fp8_weight_bytes(),
        "providers": providers,
        "args": {k: v for k, v in vars(args).items()},
        "copy_gbs": [copy_start],
        "env": {k: v for k, v in os.environ.items() if k.startswith("FP8_")},
    }
    compiled: dict = {}
    skipped: list[int] = []
    last_size_s = 0.0

    def write_merged() -> dict:
        merged = merge(out_dir, meta, skipped)
        (out_dir / "decoder_block.json").write_text(json.dumps(merged, indent=1))
        (out_dir / "decoder_block.md").write_text(render_markdown(merged))
        return merged

    for t in args.tokens:
        elapsed = time.perf_counter() - t_start
        if elapsed + 1.2 * last_size_s > args.budget_s:  # the next size would likely overrun the budget
            log(f"T={t}: skipped ({elapsed:.0f} s elapsed, last size took {last_size_s:.0f} s, "
                f"budget {args.budget_s:.0f} s)")
            skipped.append(t)
            continue
        log(f"T={t}: running")
        t_size = time.perf_counter()
        row = run_size(ex, blocks, cfg, t, args, compiled, log)
        last_size_s = time.perf_counter() - t_size
        row["seconds"] = round(last_size_s, 1)
        if t == 1 and copy_start:
            row["floor_us"] = cfg.fp8_weight_bytes() / (copy_start * 1e9) * 1e6
        (out_dir / f"decoder_block_T{t}.json").write_text(json.dumps({"meta": meta, "row": row}, indent=1))
        write_merged()  # after every size: a run killed later still leaves complete files
        brief = ", ".join(f"{k} {_fmt(e, 'graph' if args.graph else 'call')}" for k, e in row["variants"].items())
        log(f"T={t} ({last_size_s:.0f} s): {brief}")
    copy_end = copy_bandwidth_gbs(args.device)
    if copy_end:
        meta["copy_gbs"].append(copy_end)
        log(f"copy bandwidth at the end {copy_end:.0f} GB/s")
    merged = write_merged()
    print()
    print(compact_table(merged) if args.graph else render_markdown(merged))
    log(f"wrote {out_dir / 'decoder_block.json'} and {out_dir / 'decoder_block.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
