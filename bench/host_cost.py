"""Host cost to enqueue one call, per provider (device benchmark).

    python -m bench.host_cost --out DIR [--calls 300] [--shapes 4096x4096,...] [--ms 1,16] [--tokens 1,32]

GEMM: every usable GEMM provider's ``gemm`` (validation + custom op + launch) and ``torch._scaled_mm``
called directly, per-tensor scales, bf16 out. Norm-quant: every usable norm-quant provider's
``rmsnorm_quant`` and ``fused_add_rmsnorm_quant`` at H = 4096, bf16. Also the library's quant ops
(static, dynamic, per-token) as dispatched on this device.

host µs = wall time to enqueue one call: mean over ``--calls`` back-to-back calls after a warm-up, no
synchronisation inside the loop (the GPU queue never fills at these sizes), the best of three such loops.
Writes ``host_cost.json`` and ``host_cost.md`` (and ``host_profile.txt`` with ``--profile``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def host_us(fn: Any, calls: int) -> float:
    import torch

    best = float("inf")
    for _ in range(3):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) * 1e6 / calls)
    return best


def triton_breakdown(calls: int, device: str) -> dict[str, float]:
    """Where the triton GEMM provider's host time goes (M=16, 4096x4096), outside in: the whole ``gemm``
    call; the op as the provider calls it (:func:`fp8_backends.oplib.eager_fast`: the implementation
    directly in eager); the op through torch's dispatcher; the op's implementation; ``run_config`` into a
    preallocated output; the cached-kernel launch alone; its specialization key alone; ``torch.empty``."""
    import torch

    from fp8_backends.providers.triton import gemm_ops, launcher
    from fp8_backends.providers.triton.gemm import TritonGemmBackend

    x = torch.ones(16, 4096, device=device).to(torch.float8_e4m3fn)
    w = torch.ones(4096, 4096, device=device).to(torch.float8_e4m3fn)
    s = torch.ones(1, device=device)
    b = TritonGemmBackend()
    p = b.prepare_weight(w, s)
    out = torch.empty(16, 4096, device=device, dtype=torch.bfloat16)
    cfg = gemm_ops.pick_config("auto", 16, 4096, 4096)
    op = gemm_ops._register()
    result = {
        "provider.gemm": host_us(lambda: b.gemm(x, p, s), calls),
        "op (eager fast path)": host_us(lambda: gemm_ops.triton_gemm(x, w, s, p.scale, None, torch.bfloat16, "auto"),
                                        calls),
        "op (torch dispatcher)": host_us(lambda: op(x, w, s, p.scale, None, torch.bfloat16, "auto"), calls),
        "op implementation": host_us(lambda: gemm_ops.launch(x, w, s, p.scale, None, torch.bfloat16, "auto"), calls),
        "run_config (cached-kernel launch)": host_us(lambda: gemm_ops.run_config(cfg, x, w, s, p.scale, None, out),
                                                     calls),
    }
    if cfg.family != "tma":
        grid, args = gemm_ops.pointer_kernel_args(cfg, x, w, s, p.scale, None, out, True)
        lau = launcher.launcher_for(gemm_ops._kernel(cfg.family))
        result["KernelLauncher call"] = host_us(
            lambda: lau(grid, args, num_warps=cfg.warps, num_stages=cfg.stages, pdl=True, device_index=0), calls)
        result["specialization key"] = host_us(lambda: lau.key(args), calls)
    result["torch.empty output"] = host_us(lambda: torch.empty(16, 4096, device=device, dtype=torch.bfloat16), calls)
    return result


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
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--shapes", default="4096x4096,28672x4096")
    parser.add_argument("--ms", default="1,16,1024")
    parser.add_argument("--tokens", default="1,32")
    parser.add_argument("--skip", default="", help="provider names to leave out (e.g. cutlass when not built)")
    parser.add_argument("--profile", action="store_true", help="also write host_profile.txt (cProfile of the triton "
                        "GEMM and norm-quant calls)")
    args = parser.parse_args(argv)

    import torch

    from bench.common import header_markdown, md_table, run_header, write_json
    from fp8_backends import quant
    from fp8_backends.registry.discovery import discover
    from fp8_backends.registry.platform import detect_platform
    from fp8_backends.types import GemmProblem, NormQuantProblem

    device = "cuda"
    skip = {v.strip() for v in args.skip.split(",") if v.strip()}
    platform = detect_platform(device)
    header = run_header(platform, device)
    rows: list[list[Any]] = []
    data: dict[str, Any] = {"header": header, "gemm": [], "norm_quant": [], "quant": []}
    fp8 = torch.float8_e4m3fn
    s = torch.tensor([0.02], device=device)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = (torch.randn(n, k, device=device) * 2).to(fp8)
        for m in (int(v) for v in args.ms.split(",")):
            x = (torch.randn(m, k, device=device) * 2).to(fp8)
            problem = GemmProblem(n=n, k=k, m=m, device="cuda")
            calls = {"torch._scaled_mm (direct)": lambda x=x, w=w: torch._scaled_mm(
                x, w.t(), scale_a=s.reshape(()), scale_b=s.reshape(()), out_dtype=torch.bfloat16)}
            for entry in discover("gemm"):
                if entry.unusable_reason() or entry.name in skip:
                    continue
                backend = entry.cls()
                if backend.supports(problem, platform):
                    continue
                prepared = backend.prepare_weight(w, s)
                calls[entry.name] = lambda b=backend, p=prepared, x=x: b.gemm(x, p, s)
            for label, fn in calls.items():
                try:
                    us = host_us(fn, args.calls)
                except Exception as exc:  # recorded, the run goes on
                    print(f"{label} {n}x{k} M={m}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                data["gemm"].append({"n": n, "k": k, "m": m, "label": label, "host_us": us})
                rows.append(["gemm", f"{n}x{k}", m, label, f"{us:.1f}"])
                print(rows[-1], flush=True)
    data["triton_breakdown"] = triton_breakdown(args.calls, device)
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
    for label, us in data["triton_breakdown"].items():
        rows.append(["gemm breakdown", "4096x4096", 16, label, f"{us:.1f}"])
        print(rows[-1], flush=True)
    h = 4096
    weight = torch.rand(h, device=device, dtype=torch.bfloat16) + 0.5
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        res = torch.randn(t, h, device=device, dtype=torch.bfloat16)
        problem = NormQuantProblem(hidden=h, tokens=t, device="cuda")
        for entry in discover("norm_quant"):
            if entry.unusable_reason() or entry.name in skip:
                continue
            nq = entry.cls()
            if nq.supports(problem, platform):
                continue
            for op, fn in (("rmsnorm_quant", lambda nq=nq, x=x: nq.rmsnorm_quant(x, weight, s)),
                           ("fused_add_rmsnorm_quant", lambda nq=nq, x=x, r=res: nq.fused_add_rmsnorm_quant(
                               x, r, weight, s))):
                us = host_us(fn, args.calls)
                data["norm_quant"].append({"tokens": t, "hidden": h, "label": entry.name, "op": op, "host_us": us})
                rows.append(["norm_quant", f"T={t} H={h}", op, entry.name, f"{us:.1f}"])
                print(rows[-1], flush=True)
        for mode, fn in (("static", lambda x=x: quant.quantize_static(x, s)),
                         ("dynamic", lambda x=x: quant.quantize_dynamic(x)),
                         ("per_token", lambda x=x: quant.quantize_per_token(x))):
            us = host_us(fn, args.calls)
            impl = quant.registered_quant_impl(f"per_tensor_{mode}" if mode != "per_token" else "per_token", "cuda")
            data["quant"].append({"tokens": t, "mode": mode, "host_us": us, "impl": repr(impl)})
            rows.append(["quant", f"T={t} H={h}", mode, repr(impl)[:60], f"{us:.1f}"])
            print(rows[-1], flush=True)
    out = Path(args.out)
    write_json(out / "host_cost.json", data)
    md = header_markdown(header, "Host cost per call (µs to enqueue; mean of back-to-back calls, best of 3 loops)")
    md += md_table(["kind", "problem", "M / op", "provider", "host µs"], rows)
    (out / "host_cost.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
