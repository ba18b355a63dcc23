"""Host cost to enqueue one call, per provider (device benchmark).

    python -m bench.host_cost --out DIR [--calls 200] [--rounds 9] [--shapes 4096x4096,...] [--ms 1,16]
        [--tokens 1,32] [--skip cutlass] [--profile]

GEMM: every usable GEMM provider's ``gemm`` (validation + custom op + launch) and ``torch._scaled_mm``
called directly, per-tensor scales, bf16 out. Norm-quant: every usable norm-quant provider's
``rmsnorm_quant`` and ``fused_add_rmsnorm_quant`` at H = 4096, bf16, with ``torch._scaled_mm`` at
M = T, N = K = 4096 as the same-run yardstick. Also the library's quant ops (static, dynamic, per-token),
and a breakdown of the triton GEMM's call, including the compiled kernel's launcher given tensors
against given data pointers.

One sample = wall time to enqueue ``--calls`` back-to-back calls (after a warm-up, no synchronisation
inside the loop: the GPU queue never fills at these sizes) divided by ``--calls``. Host timings on the
device machine drift by up to ±30% from minute to minute, so every call is sampled once per round,
``--rounds`` rounds, in an order rotated each round, and the tables give the median over rounds (and the
min), plus the median over rounds of the ratio to ``torch._scaled_mm`` sampled in the same round.
Writes ``host_cost.json`` and ``host_cost.md`` (and ``host_profile.txt`` with ``--profile``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def sample_us(fn: Callable[[], Any], calls: int) -> float:
    """Mean µs per call over ``calls`` back-to-back calls (a few warm-up calls first)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6 / calls


@dataclass
class Timed:
    """One call to time: its table row labels, the function and the yardstick it is compared with."""

    kind: str
    problem: str
    what: str
    label: str
    fn: Callable[[], Any]
    yardstick: str | None = None  # the ``key`` of the torch._scaled_mm entry of the same size
    samples: list[float] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.kind}|{self.problem}|{self.what}|{self.label}"


def run_rounds(entries: list[Timed], calls: int, rounds: int,
               sample: Callable[[Callable[[], Any], int], float] = sample_us) -> None:
    """Sample every entry once per round; round ``r`` starts at entry ``r`` (rotated order), so a slow
    stretch of the host does not land on the same entries every round. Failing entries are dropped."""
    n = len(entries)
    for r in range(rounds):
        for i in range(n):
            entry = entries[(r + i) % n]
            if entry.fn is None:
                continue
            try:
                entry.samples.append(sample(entry.fn, calls))
            except Exception as exc:  # recorded, the run goes on
                print(f"{entry.key}: {type(exc).__name__}: {exc}", flush=True)
                entry.fn = None  # type: ignore[assignment]


def summarize(entries: list[Timed]) -> list[dict[str, Any]]:
    """Per entry: median and min µs over rounds, and the median over rounds of the ratio to its yardstick
    sampled in the same round (``None`` without one)."""
    by_key = {e.key: e for e in entries}
    out = []
    for e in entries:
        if not e.samples:
            continue
        ratio = None
        ref = by_key.get(e.yardstick) if e.yardstick else None
        if ref is not None and len(ref.samples) == len(e.samples):
            ratio = statistics.median(a / b for a, b in zip(e.samples, ref.samples))
        out.append({"kind": e.kind, "problem": e.problem, "what": e.what, "label": e.label,
                    "median_us": statistics.median(e.samples), "min_us": min(e.samples), "rounds": len(e.samples),
                    "ratio_to_torch": ratio, "samples_us": e.samples})
    return out


def triton_breakdown(device: str) -> list[Timed]:
    """Where the triton GEMM provider's host time goes (M=16, 4096x4096), outside in: the whole ``gemm``
    call; the op as the provider calls it (:func:`fp8_backends.core.oplib.eager_fast`: the implementation
    directly in eager); the op through torch's dispatcher; the op's implementation; ``run_config`` into a
    preallocated output; the cached-kernel launch alone; its specialization key alone; the compiled
    kernel's own launcher given the tensors against given their data pointers (what the launcher passes);
    ``torch.empty``."""
    import torch

    from fp8_backends.providers.triton import gemm_args, gemm_ops, launcher
    from fp8_backends.providers.triton.gemm import TritonGemmBackend

    x = torch.ones(16, 4096, device=device).to(torch.float8_e4m3fn)
    w = torch.ones(4096, 4096, device=device).to(torch.float8_e4m3fn)
    s = torch.ones(1, device=device)
    b = TritonGemmBackend()
    p = b.prepare_weight(w, s)
    out = torch.empty(16, 4096, device=device, dtype=torch.bfloat16)
    cfg = gemm_args.pick_config("auto", 16, 4096, 4096)
    op = gemm_ops.load_op()
    problem = "4096x4096"

    def row(what: str, fn: Callable[[], Any]) -> Timed:
        return Timed("gemm breakdown", problem, "16", what, fn)

    rows = [
        row("provider.gemm", lambda: b.gemm(x, p, s)),
        row("op (eager fast path)", lambda: gemm_ops.triton_gemm(x, w, s, p.scale, None, torch.bfloat16, "auto")),
        row("op (torch dispatcher)", lambda: op(x, w, s, p.scale, None, torch.bfloat16, "auto")),
        row("op implementation", lambda: gemm_ops.launch(x, w, s, p.scale, None, torch.bfloat16, "auto")),
        row("run_config (cached-kernel launch)", lambda: gemm_ops.run_config(cfg, x, w, s, p.scale, None, out)),
    ]
    if cfg.family != "tma":
        pdl = gemm_ops._support.pdl_on(0)
        grid, args = gemm_args.pointer_kernel_args(cfg, x, w, s, p.scale, None, out, pdl)
        lau = launcher.launcher_for(gemm_args.kernel_of(cfg.family))
        rows.append(row("KernelLauncher call", lambda: lau(grid, args, num_warps=cfg.warps, num_stages=cfg.stages,
                                                           pdl=pdl, device_index=0)))
        rows.append(row("specialization key + run args", lambda: lau.plan(args)))
        lau(grid, args, num_warps=cfg.warps, num_stages=cfg.stages, pdl=pdl, device_index=0)  # compiled now
        entry = lau._compiled.get((cfg.warps, cfg.stages, pdl, 0, lau.key(args)))
        if entry is not None and entry.run is not None:
            stream = torch.cuda.current_stream().cuda_stream
            g = (*grid, 1, 1)[:3]
            run_args = lau.plan(args)[1]
            rows.append(row("compiled launcher, tensor args", lambda: entry.run(
                *g, stream, entry.function, entry.packed, None, None, None, *args)))
            rows.append(row("compiled launcher, data-pointer args", lambda: entry.run(
                *g, stream, entry.function, entry.packed, None, None, None, *run_args)))
    rows.append(row("torch.empty output", lambda: torch.empty(16, 4096, device=device, dtype=torch.bfloat16)))
    return rows


def profile_text(fn: Any, calls: int, top: int = 25) -> str:
    """cProfile of ``calls`` calls of ``fn`` (after a warm-up): the ``top`` functions by own time."""
    import cProfile
    import io
    import pstats

    for _ in range(10):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--shapes", default="4096x4096,28672x4096")
    parser.add_argument("--ms", default="1,16,1024")
    parser.add_argument("--tokens", default="1,32")
    parser.add_argument("--skip", default="", help="provider names to leave out (e.g. cutlass when not built)")
    parser.add_argument("--profile", action="store_true", help="also write host_profile.txt (cProfile of the triton "
                        "GEMM and norm-quant calls)")
    args = parser.parse_args(argv)

    import torch

    from bench.common import header_markdown, md_table, run_header, write_json, write_markdown
    from fp8_backends import quant
    from fp8_backends.core.types import GemmProblem, NormQuantProblem
    from fp8_backends.registry.discovery import discover
    from fp8_backends.registry.platform import detect_platform

    device = "cuda"
    skip = {v.strip() for v in args.skip.split(",") if v.strip()}
    platform = detect_platform(device)
    header = run_header(platform, device)
    fp8 = torch.float8_e4m3fn
    s = torch.tensor([0.02], device=device)
    entries: list[Timed] = []

    def torch_mm(m: int, n: int, k: int) -> str:
        """The ``torch._scaled_mm`` entry for M x N x K (added once); returns its key."""
        entry = Timed("gemm", f"{n}x{k}", str(m), "torch._scaled_mm (direct)", None)  # type: ignore[arg-type]
        if not any(e.key == entry.key for e in entries):
            x = (torch.randn(m, k, device=device) * 2).to(fp8)
            w = (torch.randn(n, k, device=device) * 2).to(fp8)
            entry.fn = lambda: torch._scaled_mm(x, w.t(), scale_a=s.reshape(()), scale_b=s.reshape(()),
                                                out_dtype=torch.bfloat16)
            entries.append(entry)
        return entry.key

    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = (torch.randn(n, k, device=device) * 2).to(fp8)
        for m in (int(v) for v in args.ms.split(",")):
            x = (torch.randn(m, k, device=device) * 2).to(fp8)
            ref = torch_mm(m, n, k)
            problem = GemmProblem(n=n, k=k, m=m, device="cuda")
            for entry in discover("gemm"):
                if entry.unusable_reason() or entry.name in skip:
                    continue
                backend = entry.cls()
                if backend.supports(problem, platform):
                    continue
                prepared = backend.prepare_weight(w, s)
                entries.append(Timed("gemm", f"{n}x{k}", str(m), entry.name,
                                     lambda b=backend, p=prepared, x=x: b.gemm(x, p, s), ref))
    breakdown = triton_breakdown(device)
    ref16 = torch_mm(16, 4096, 4096)
    for e in breakdown:
        e.yardstick = ref16
    entries += breakdown
    h = 4096
    weight = torch.rand(h, device=device, dtype=torch.bfloat16) + 0.5
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        res = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        ref = torch_mm(t, h, h)
        problem = NormQuantProblem(hidden=h, tokens=t, device="cuda")
        for entry in discover("norm_quant"):
            if entry.unusable_reason() or entry.name in skip:
                continue
            nq = entry.cls()
            if nq.supports(problem, platform):
                continue
            entries.append(Timed("norm_quant", f"T={t} H={h}", "rmsnorm_quant", entry.name,
                                 lambda nq=nq, x=x: nq.rmsnorm_quant(x, weight, s), ref))
            entries.append(Timed("norm_quant", f"T={t} H={h}", "fused_add_rmsnorm_quant", entry.name,
                                 lambda nq=nq, x=x, r=res: nq.fused_add_rmsnorm_quant(x, r, weight, s), ref))
        for mode, fn in (("static", lambda x=x: quant.quantize_static(x, s)),
                         ("dynamic", lambda x=x: quant.quantize_dynamic(x)),
                         ("per_token", lambda x=x: quant.quantize_per_token(x))):
            impl = quant.registered_quant_impl(f"per_tensor_{mode}" if mode != "per_token" else "per_token", "cuda")
            entries.append(Timed("quant", f"T={t} H={h}", mode, repr(impl)[:60], fn, ref))
    t0 = time.perf_counter()
    run_rounds(entries, args.calls, args.rounds)
    print(f"{len(entries)} calls x {args.rounds} rounds in {time.perf_counter() - t0:.1f} s", flush=True)
    results = summarize(entries)
    data: dict[str, Any] = {"header": header, "calls": args.calls, "rounds": args.rounds, "results": results}
    if args.profile:
        from fp8_backends.providers.triton.gemm import TritonGemmBackend
        from fp8_backends.providers.triton.norm_quant import TritonNormQuantBackend

        xq = torch.ones(16, 4096, device=device).to(torch.float8_e4m3fn)
        wq = torch.ones(4096, 4096, device=device).to(torch.float8_e4m3fn)
        one = torch.ones(1, device=device)
        tg = TritonGemmBackend()
        prepared = tg.prepare_weight(wq, one)
        tn = TritonNormQuantBackend()
        xb = torch.randn(16, 4096, device=device, dtype=torch.bfloat16)
        wb = torch.ones(4096, device=device, dtype=torch.bfloat16)
        text = ["# triton gemm, M=16 4096x4096", profile_text(lambda: tg.gemm(xq, prepared, one), args.calls),
                "# triton rmsnorm_quant, T=16 H=4096", profile_text(lambda: tn.rmsnorm_quant(xb, wb, one), args.calls)]
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_profile.txt").write_text("\n".join(text))
    out = Path(args.out)
    write_json(out / "host_cost.json", data)
    md = header_markdown(header, "Host cost per call (µs to enqueue)")
    md += ["", f"{args.rounds} interleaved rounds, each sample the mean of {args.calls} back-to-back calls. "
           "`ratio` = median over rounds of (this call / `torch._scaled_mm` of the same size, same round); the "
           "norm-quant and quant rows are compared with `torch._scaled_mm` at M = T, 4096x4096.", ""]
    md += md_table(["kind", "problem", "M / op", "provider", "median µs", "min µs", "ratio to torch._scaled_mm"],
                   [[r["kind"], r["problem"], r["what"], r["label"], f"{r['median_us']:.1f}", f"{r['min_us']:.1f}",
                     "-" if r["ratio_to_torch"] is None else f"{r['ratio_to_torch']:.2f}"] for r in results])
    write_markdown(out / "host_cost.md", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
