"""Benchmark: where the decoder block's time goes, kernel by kernel (torch.profiler, CUDA graph replay).

For each token count and each block variant (``plain_fp8`` and the library's ``lib_fused`` / ``lib_unfused``
of ``examples/decoder_block.py``, compiled with Inductor), one CUDA graph of ``--reps`` block calls is
replayed under ``torch.profiler``. The table lists every kernel of one block call in launch order with its
mean GPU µs, then the sum of kernel time against the graph time per block: the difference is what the
block loses between kernels (launch gaps, ramp-up and tail of each kernel).

With ``--host``, each compiled variant is also timed as the host sees it without a CUDA graph: the mean
enqueue time of back-to-back calls (:func:`bench.host_cost.sample_us`), and a cProfile of those calls
(the functions with the most own time), which says where a compiled model that is not captured in a graph
spends its host time.

    python -m bench.block_profile --out bench/results/block_profile --tokens 1 16 [--host]
    python -m bench.block_profile --out /tmp/bp --device cpu --small --tokens 1   # smoke test (no kernels)
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from bench.decoder_block import load_example

VARIANTS = ("plain_fp8", "lib_unfused", "lib_fused")


def _kernel_events(prof) -> list:
    """The profiler's GPU kernel events, in start order."""
    out = []
    for ev in prof.events():
        dev_type = getattr(ev, "device_type", None)
        if dev_type is not None and dev_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            out.append(ev)
    out.sort(key=lambda e: e.time_range.start)
    return out


def profile_graph(ex, call, reps: int, replays: int) -> dict:
    """Per-kernel mean µs of one call, from ``replays`` replays of a graph of ``reps`` calls."""
    graph = ex.capture_graph(call, reps)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    events = _kernel_events(prof)
    out: dict = {"graph_us": statistics.median(times)}
    try:
        kernels = per_call_kernels([(ev.name, ev.device_time_total) for ev in events], reps * replays)
    except ValueError as exc:
        return dict(out, error=str(exc))
    return dict(out, kernels=kernels, kernel_sum_us=sum(k["us"] for k in kernels))


def per_call_kernels(events: list[tuple[str, float]], calls: int) -> list[dict]:
    """``(name, µs)`` of every kernel of ``calls`` identical calls, in launch order -> one call's kernels with
    their mean µs. Raises ValueError when the events do not split into ``calls`` equal sequences."""
    if not events or len(events) % calls:
        raise ValueError(f"{len(events)} kernel events for {calls} calls")
    per_call = len(events) // calls
    durations: dict[int, list[float]] = defaultdict(list)
    for i, (name, us) in enumerate(events):
        if name != events[i % per_call][0]:
            raise ValueError(f"kernel {i} is {name}, but position {i % per_call} of the first call is "
                             f"{events[i % per_call][0]}: the calls launch different kernels")
        durations[i % per_call].append(us)
    return [{"name": events[i][0], "us": statistics.mean(durations[i])} for i in range(per_call)]


def host_profile(call, calls: int) -> dict:
    """Host µs per compiled call (enqueue, no graph; the median of 5 samples of ``calls`` back-to-back calls)
    and a cProfile text of ``calls`` calls."""
    import threading

    from bench.host_cost import profile_text, sample_us

    samples = [sample_us(call, calls) for _ in range(5)]
    return {"host_us": statistics.median(samples), "host_min_us": min(samples),
            "threads": sorted(t.name for t in threading.enumerate()),  # other Python threads compete for the GIL
            "cprofile": profile_text(call, calls, top=30)}


def render(rows: list[dict]) -> str:
    lines = ["# Decoder block, kernel by kernel (compiled, inside a CUDA graph)", ""]
    hosted = [r for r in rows if "host" in r]
    if hosted:
        lines += ["## Host µs per compiled call (no CUDA graph; median and min of 5 samples of back-to-back calls)",
                  "", "| T | variant | host µs | min | graph µs |", "|---|---|---|---|---|"]
        lines += [f"| {r['T']} | {r['variant']} | {r['host']['host_us']:.1f} | {r['host']['host_min_us']:.1f} | "
                  f"{r['profile'].get('graph_us', float('nan')):.1f} |" for r in hosted]
        lines.append("")
    for r in rows:
        lines += [f"## T = {r['T']}, {r['variant']}", ""]
        if "error" in r["profile"]:
            lines += [f"error: {r['profile']['error']}", ""]
            continue
        p = r["profile"]
        lines += ["| # | kernel | µs |", "|---|---|---|"]
        for i, k in enumerate(p["kernels"]):
            lines.append(f"| {i} | `{k['name'][:90]}` | {k['us']:.2f} |")
        gap = p["graph_us"] - p["kernel_sum_us"]
        lines += ["", f"{len(p['kernels'])} kernels, kernel sum {p['kernel_sum_us']:.1f} µs, "
                  f"graph {p['graph_us']:.1f} µs per block, between kernels {gap:.1f} µs", ""]
        if "host" in r:
            lines += ["Host profile of the compiled call (cProfile, own time):", "", "```",
                      r["host"]["cprofile"].strip(), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--norm-backend", default=None)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--host", action="store_true", help="also time and cProfile the compiled calls without a graph")
    ap.add_argument("--host-calls", type=int, default=100)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ex = load_example()
    cfg = ex.SMALL if args.small else ex.LLAMA3_8B
    torch.set_grad_enabled(False)
    blocks = ex.build_blocks(cfg, torch.bfloat16, args.device, backend=args.backend, norm_backend=args.norm_backend)
    rows = []
    for variant in args.variants:
        fn = torch.compile(blocks[variant], fullgraph=True, dynamic=False,
                           backend="inductor" if args.device == "cuda" else "aot_eager")
        for t in args.tokens:
            hidden, residual = ex.make_inputs(cfg, t, torch.bfloat16, args.device)
            res = residual.clone()
            fn(hidden, res)

            def call(fn=fn, hidden=hidden, res=res):
                return fn(hidden, res)

            if args.device == "cuda":
                prof = profile_graph(ex, call, args.reps, args.replays)
            else:
                call()
                prof = {"error": "no GPU: nothing to profile"}
            row = {"T": t, "variant": variant, "providers": blocks[variant].providers()
                   if hasattr(blocks[variant], "providers") else {}, "profile": prof}
            if args.host and args.device == "cuda":
                row["host"] = host_profile(call, args.host_calls)
                print(f"T={t} {variant}: host {row['host']['host_us']:.1f} µs per compiled call; Python threads: "
                      f"{row['host']['threads']}", flush=True)
            rows.append(row)
            print(f"T={t} {variant}: graph {prof.get('graph_us', float('nan')):.1f} µs, "
                  f"kernels {prof.get('kernel_sum_us', float('nan')):.1f} µs, {len(prof.get('kernels', []))} kernels",
                  flush=True)
        torch._dynamo.reset()
    (out / "block_profile.json").write_text(json.dumps(rows, indent=1))
    (out / "block_profile.md").write_text(render(rows))
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
