"""Benchmark: where a compiled decoder block's host time goes (no CUDA graph).

At a token count where the block is host-bound (its kernels take less time than enqueuing them), a compiled call
costs what its host path costs: Dynamo's guards, AOTAutograd's runtime wrapper, Inductor's generated ``call`` and
every launch in it. This times that path per block variant of ``examples/decoder_block.py`` and splits it:

- host µs per compiled call: ``--calls`` back-to-back calls enqueued while the GPU is kept busy (so no call waits
  for it), every variant once per round in an order rotated each round, median over ``--rounds`` rounds, with the
  ratio to ``plain_fp8`` from the same round;
- a cProfile of the compiled calls in µs per block call: the functions with the most own time, and the cumulative
  time of the layers (Dynamo's frame, the runtime wrapper, Inductor's ``call``);
- the extern GEMM calls alone at the block's linear shapes and M = T: ``torch._scaled_mm`` (how Inductor calls
  it for ``plain_fp8`` and ``torch_scaled_mm``) against the ``cutlass`` provider's C++ op through its
  ``OpOverload`` (how Inductor calls it) and through the overload's C++ entry.

Variants: ``plain_fp8``, ``lib_unfused``, ``lib_fused`` (resolved providers) and ``lib_fused@<provider>`` for
each ``--backends`` name (every linear on that provider).

    python -m bench.block_host --out DIR --tokens 256 [--backends torch_scaled_mm cutlass] [--rounds 9] [--pin-cpu 3]
    python -m bench.block_host --out /tmp/bh --device cpu --small --tokens 4 --rounds 2   # smoke test

Writes ``block_host.json`` and ``block_host.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import common
from bench.decoder_block import load_example

BASE_VARIANTS = ("plain_fp8", "lib_unfused", "lib_fused")

#: cumulative-time rows of the cProfile table: (label, filename part, function name)
LAYERS = (
    ("Dynamo frame (guards + all below)", "eval_frame.py", "__call__"),
    ("AOT runtime wrapper", "runtime_wrappers.py", "runtime_wrapper"),
    ("Inductor call", "output_code.py", "__call__"),
)


def log(msg: str) -> None:
    print(msg, flush=True)


def build_variants(ex: Any, cfg: Any, device: str, names: list[str]) -> dict[str, torch.nn.Module]:
    """``{variant: block}``; ``lib_fused@p`` builds the library block with every linear on provider ``p``."""
    out: dict[str, torch.nn.Module] = {}
    base = ex.build_blocks(cfg, torch.bfloat16, device)
    for name in names:
        if "@" in name:
            kind, backend = name.split("@", 1)
            out[name] = ex.build_blocks(cfg, torch.bfloat16, device, backend=backend)[kind]
        else:
            out[name] = base[name]
    return out


def pin(cpu: int | None) -> set[int] | None:
    """Pin this process to ``cpu`` (None: leave it); returns the affinity to restore, or None."""
    if cpu is None:
        return None
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    return previous


def profile_us(fn: Callable[[], Any], calls: int, device: str, top: int) -> dict[str, Any]:
    """cProfile of ``calls`` calls (GPU kept busy): the ``top`` functions by own time and the cumulative time of
    :data:`LAYERS`, both in µs per call."""
    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e8))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if device == "cuda":
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = []
    layers = {label: 0.0 for label, _, _ in LAYERS}
    for (filename, line, func), (_cc, nc, tt, ct, _callers) in stats.items():
        where = func if filename == "~" else f"{Path(filename).name}:{line}({func})"
        rows.append({"fn": where, "calls": nc / calls, "own_us": tt * 1e6 / calls, "cum_us": ct * 1e6 / calls})
        for label, part, name in LAYERS:
            if part in filename and func == name:
                layers[label] = max(layers[label], ct * 1e6 / calls)
    rows.sort(key=lambda r: -r["own_us"])
    total = sum(r["own_us"] for r in rows)
    return {"total_us": total, "layers": layers, "top": rows[:top]}


def extern_gemm_us(shapes: dict[str, tuple[int, int]], m: int, calls: int, rounds: int) -> list[dict[str, Any]]:
    """Host µs per call of the GEMM alone at each ``(N, K)`` and M = ``m``: ``torch._scaled_mm`` against the cutlass
    C++ op (through its OpOverload, and through the overload's C++ entry), GPU kept busy, rotated rounds."""
    fp8 = torch.float8_e4m3fn
    one = torch.ones((), device="cuda")
    rows = []
    op = getattr(getattr(torch.ops, "fp8_backends", None), "cutlass_sm90_gemm_native", None)
    overload = op.default if op is not None else None
    for name, (n, k) in shapes.items():
        x = torch.randn(m, k, device="cuda").to(fp8)
        w = torch.randn(n, k, device="cuda").to(fp8)
        fns: dict[str, Callable[[], Any]] = {
            "torch._scaled_mm": lambda x=x, w=w: torch._scaled_mm(x, w.t(), one, one, None, None, torch.bfloat16,
                                                                  True),
        }
        if overload is not None:
            fns["cutlass op (OpOverload)"] = lambda x=x, w=w: overload(x, w, one, one, None, torch.bfloat16, "auto",
                                                                      True)
            fns["cutlass op (C++ entry)"] = lambda x=x, w=w: overload._op(x, w, one, one, None, torch.bfloat16,
                                                                         "auto", True)
        samples, _ = common.rotated_host_us(fns, rounds, calls, "cuda")
        for key, got in samples.items():
            rows.append({"linear": name, "N": n, "K": k, "M": m, "call": key, "host_us": statistics.median(got),
                         "host_us_min": min(got)})
            log(f"extern {name} ({n}x{k}) M={m} {key}: {statistics.median(got):.2f} µs")
    return rows


def render(header: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = common.header_markdown(header, "Host time of a compiled decoder block (no CUDA graph)")
    lines += ["", "Enqueue µs per compiled call while the GPU is kept busy: median over rotated interleaved rounds, "
              "min, the median ratio to `plain_fp8` in the same round, and the ratio of the minima (the device's "
              "host runs in phases of different speed: the minima compare the code, not the phase). Then, per "
              "variant, a cProfile of the calls "
              "in µs per block call (cProfile's own cost inflates Python frames: compare variants, not totals).", ""]
    for res in results:
        t = res["T"]
        lines += [f"## T = {t}", ""]
        lines += common.md_table(
            ["variant", "host µs", "min", "/ plain_fp8", "min / plain_fp8 min",
             *[label for label, _, _ in LAYERS], "providers"],
            [[v, common.fmt(r["host_us"], ".1f"), common.fmt(r["host_us_min"], ".1f"),
              common.fmt(r.get("ratio_plain"), ".3f"), common.fmt(r.get("ratio_plain_min"), ".3f"),
              *[common.fmt(r["profile"]["layers"][label], ".1f") for label, _, _ in LAYERS], r.get("providers", "")]
             for v, r in res["variants"].items()])
        for v, r in res["variants"].items():
            lines += ["", f"### T = {t}, {v}: cProfile, µs per block call (own time, top "
                      f"{len(r['profile']['top'])}; total own {r['profile']['total_us']:.1f})", ""]
            lines += common.md_table(["function", "calls", "own µs", "cum µs"],
                                     [[f"`{row['fn'][:110]}`", common.fmt(row["calls"], ".1f"),
                                       common.fmt(row["own_us"], ".2f"), common.fmt(row["cum_us"], ".2f")]
                                      for row in r["profile"]["top"]])
        if res.get("extern"):
            lines += ["", f"### T = {t}: the GEMM call alone (host µs, GPU busy, median of rounds)", ""]
            lines += common.md_table(["linear", "N x K", "call", "host µs", "min"],
                                     [[e["linear"], f"{e['N']}x{e['K']}", e["call"], common.fmt(e["host_us"], ".2f"),
                                       common.fmt(e["host_us_min"], ".2f")] for e in res["extern"]])
        lines.append("")
    return "\n".join(lines) + "\n"


def measure(res: dict[str, Any], fns: dict[str, Callable[[], Any]], blocks: dict[str, torch.nn.Module], cfg: Any,
            t: int, args: argparse.Namespace) -> None:
    """Fill ``res["variants"]`` (host µs over rotated rounds, ratios to ``plain_fp8``, the cProfile) and, on the GPU,
    ``res["extern"]`` (the GEMM call alone at M = ``t``)."""
    samples, ratios = common.rotated_host_us(fns, args.rounds, args.calls, args.device, ref="plain_fp8")
    plain_min = min(samples["plain_fp8"]) if samples.get("plain_fp8") else None
    for v, fn in fns.items():
        block = blocks[v]
        res["variants"][v] = {
            "host_us": statistics.median(samples[v]), "host_us_min": min(samples[v]),
            "ratio_plain": statistics.median(ratios[v]) if ratios[v] else None,
            "ratio_plain_min": min(samples[v]) / plain_min if plain_min else None,
            "providers": "; ".join(f"{k}={p}" for k, p in block.providers().items())
            if hasattr(block, "providers") else "",
            "profile": profile_us(fn, args.profile_calls, args.device, args.top),
        }
        log(f"T={t} {v}: host {res['variants'][v]['host_us']:.1f} µs "
            f"({res['variants'][v]['ratio_plain'] or 0:.3f}x plain_fp8)")
    if args.device == "cuda":
        res["extern"] = extern_gemm_us(cfg.linear_shapes(), t, 50, max(3, args.rounds // 2))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256])
    ap.add_argument("--variants", nargs="+", default=list(BASE_VARIANTS), choices=BASE_VARIANTS)
    ap.add_argument("--backends", nargs="*", default=["torch_scaled_mm", "cutlass"],
                    help="also lib_fused with every linear on each of these providers")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--profile-calls", type=int, default=30, help="calls under cProfile per variant")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="the SMALL block, aot_eager (CPU smoke test)")
    ap.add_argument("--pin-cpu", type=int, default=None,
                    help="time with this process pinned to this CPU core (after compiling): fewer host-speed phases")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    from fp8_backends.registry.platform import detect_platform

    torch.set_grad_enabled(False)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    ex = load_example()
    cfg = ex.SMALL if args.small else ex.LLAMA3_8B
    compile_backend = "aot_eager" if args.device == "cpu" else "inductor"
    names = [*args.variants, *[f"lib_fused@{b}" for b in args.backends]]
    blocks = build_variants(ex, cfg, args.device, names)
    header = common.run_header(detect_platform(args.device), args.device)
    results = []
    for t in args.tokens:
        fns: dict[str, Callable[[], Any]] = {}
        res: dict[str, Any] = {"T": t, "variants": {}, "errors": {}}
        for name, block in blocks.items():
            hidden, residual = ex.make_inputs(cfg, t, torch.bfloat16, args.device)
            try:
                fn = torch.compile(block, fullgraph=True, dynamic=False, backend=compile_backend)
                fn(hidden, residual)
            except Exception as exc:  # a provider that cannot serve here is reported, not fatal
                res["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
                log(f"T={t} {name}: ERROR {res['errors'][name]}")
                continue
            fns[name] = lambda fn=fn, h=hidden, r=residual: fn(h, r)
        affinity = pin(args.pin_cpu)
        try:
            measure(res, fns, blocks, cfg, t, args)
        finally:
            if affinity is not None:
                os.sched_setaffinity(0, affinity)
                res["pinned_cpu"] = args.pin_cpu
        results.append(res)
    (args.out / "block_host.json").write_text(json.dumps({"header": header, "results": results}, indent=1))
    text = render(header, results)
    (args.out / "block_host.md").write_text(text)
    log(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
