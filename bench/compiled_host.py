"""Benchmark: host µs per call of one compiled ``Fp8Linear``, per GEMM provider, against a compiled ``nn.Linear``.

In a ``torch.compile`` step without CUDA graphs every op costs the host time its generated code spends to launch
it, and a decode step is host-bound: that time, not the kernel's, decides the step. This measures it per provider,
on the path users run (a module compiled with ``torch.compile(fullgraph=True, dynamic=False)``), and counts how the
step's kernels are launched (Inductor's static launcher, Triton's Python launcher, extern calls such as
``torch._scaled_mm``), from a cProfile of the compiled calls.

One sample = wall time to enqueue ``--calls`` back-to-back calls while the GPU is kept busy (``torch.cuda._sleep``
ahead of them, so the queue never drains and no call waits for the GPU) divided by ``--calls``; the variants are
sampled in ``--rounds`` interleaved rounds in a rotated order; medians reported, with the ratio to ``nn.Linear``
from the same round. Inductor's static launcher for user-defined Triton kernels
(``torch._inductor.config.static_launch_user_defined_triton_kernels``) is a process-wide setting: run once per
``--static-launch`` value (its Inductor cache in its own folder).

    python -m bench.compiled_host --out DIR [--ms 1 16 512] [--providers triton torch_scaled_mm ...]
        [--act per_tensor_static per_tensor_dynamic] [--static-launch on|off]
    python -m bench.compiled_host --device cpu --small --out /tmp/ch     # smoke test on the CPU (aot_eager)

Writes ``compiled_host_<tag>.json`` / ``.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import pstats
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import common

#: cProfile functions that mark one launch path per call
LAUNCH_MARKS = {
    "static": "static_triton_launcher.py",  # Inductor's static launcher: ``run``
    "triton": "nvidia/driver.py",  # Triton's Python launcher: ``CudaLauncher.__call__``
    "_scaled_mm": "torch._scaled_mm",
    "mm": "torch.mm",
}


def log(msg: str) -> None:
    print(msg, flush=True)


class BypassLog(logging.Handler):
    """Collects Inductor's reasons for not launching a kernel statically."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "Bypassing" in msg:
            self.reasons[msg[:200]] = self.reasons.get(msg[:200], 0) + 1


def build(variant: str, k: int, n: int, m_calib: int, device: str) -> torch.nn.Module:
    """``nn.Linear(k, n)`` in bf16, or its ``Fp8Linear`` for ``"<provider>/<act mode>"`` (static: calibrated)."""
    from fp8_backends import quantize_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(device=device, dtype=torch.bfloat16)
    if variant == "nn.Linear":
        return model
    provider, act = variant.split("/")
    calib = [torch.randn(m_calib, k, device=device, dtype=torch.bfloat16)] if act == "per_tensor_static" else None
    quantize_model(model, act_scale=act, backend=provider, calibration=calib, skip=())
    return model


def launch_counts(fn: Callable[[], Any], calls: int = 20) -> dict[str, float]:
    """Launches per call by path (cProfile of ``calls`` calls)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    out = dict.fromkeys(LAUNCH_MARKS, 0.0)
    for (filename, _line, func), (_cc, nc, _tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{filename}:{func}"
        if LAUNCH_MARKS["static"] in filename and func == "run":
            out["static"] += nc / calls
        elif LAUNCH_MARKS["triton"] in filename and func == "__call__":
            out["triton"] += nc / calls
        elif "_scaled_mm" in where and filename == "~":
            out["_scaled_mm"] += nc / calls
        elif func == "<built-in method torch.mm>":
            out["mm"] += nc / calls
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096"], help="NxK")
    p.add_argument("--ms", nargs="+", type=int, default=[1, 16, 512])
    p.add_argument("--providers", nargs="+", default=["triton", "torch_scaled_mm", "flashinfer_bmm", "cutlass"])
    p.add_argument("--act", nargs="+", default=["per_tensor_static"])
    p.add_argument("--static-launch", choices=["on", "off"], default="off")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny shapes, aot_eager (CPU smoke test)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from fp8_backends.layers.inductor_setup import static_launch_triton_ops
    from fp8_backends.registry.platform import detect_platform

    static_launch_triton_ops(args.static_launch == "on")
    bypass = BypassLog()
    logging.getLogger("torch._inductor.runtime.triton_heuristics").addHandler(bypass)
    logging.getLogger("torch._inductor.runtime.triton_heuristics").setLevel(logging.INFO)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 4096)
    header = common.run_header(detect_platform(args.device), args.device)
    header["static_launch_user_defined_triton_kernels"] = args.static_launch == "on"
    backend = "aot_eager" if args.small else "inductor"
    shapes = ["64x64"] if args.small else args.shapes
    variants = ["nn.Linear", *[f"{prov}/{act}" for prov in args.providers for act in args.act]]
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for shape in shapes:
        n, k = (int(v) for v in shape.split("x"))
        for m in args.ms:
            fns: dict[str, Callable[[], Any]] = {}
            x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)
            for v in variants:
                key = f"{shape}/M={m}/{v}"
                try:
                    mod = build(v, k, n, 512 if not args.small else 8, args.device)
                    compiled = torch.compile(mod, fullgraph=True, dynamic=False, backend=backend)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        compiled(x)
                    log(f"{key}: compiled in {time.perf_counter() - t0:.1f} s")

                    def fn(c: Any = compiled, inp: torch.Tensor = x) -> Any:
                        with torch.no_grad():
                            return c(inp)

                    fns[v] = fn
                except Exception as exc:  # a provider that cannot serve here: reported, not fatal
                    errors[key] = f"{type(exc).__name__}: {exc}"[:300]
                    log(f"{key}: ERROR {errors[key]}")
            samples, ratios = common.rotated_host_us(fns, args.rounds, args.calls, args.device, ref="nn.Linear")
            for v in fns:
                row = {"shape": shape, "M": m, "variant": v, "host_us": statistics.median(samples[v]),
                       "host_us_min": min(samples[v]),
                       "ratio_nn_linear": statistics.median(ratios[v]) if ratios[v] else None,
                       "launches": launch_counts(fns[v])}
                rows.append(row)
                log(f"{shape} M={m} {v}: {row['host_us']:.1f} µs "
                    f"({row['ratio_nn_linear'] or 0:.2f}x nn.Linear) launches {row['launches']}")
    tag = f"sl-{args.static_launch}"
    result = {"header": header, "rows": rows, "errors": errors, "static_launch_bypass": bypass.reasons}
    (args.out / f"compiled_host_{tag}.json").write_text(json.dumps(result, indent=1))
    title = f"Host µs per call of a compiled linear (static launcher {args.static_launch})"
    lines = common.header_markdown(header, title)
    lines += ["", "Enqueue time per call while the GPU is busy (median of rotated interleaved rounds), the ratio to "
              "the compiled `nn.Linear` of the same rounds, and the launches per call by path (static launcher, "
              "Triton's Python launcher, extern `torch._scaled_mm` / `torch.mm`).", ""]
    lines += common.md_table(
        ["N x K", "M", "variant", "host µs", "min", "/ nn.Linear", "static", "triton", "_scaled_mm", "mm"],
        [[r["shape"], r["M"], r["variant"], common.fmt(r["host_us"], ".1f"), common.fmt(r["host_us_min"], ".1f"),
          common.fmt(r["ratio_nn_linear"], ".2f"), *[common.fmt(r["launches"][k], ".0f") for k in LAUNCH_MARKS]]
         for r in rows])
    if bypass.reasons:
        lines += ["", "Inductor's reasons for not launching a kernel statically:", ""]
        lines += [f"- {n}x {msg}" for msg, n in bypass.reasons.items()]
    if errors:
        lines += ["", "Errors:", ""] + [f"- `{k}`: {e}" for k, e in errors.items()]
    (args.out / f"compiled_host_{tag}.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
