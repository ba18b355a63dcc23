"""Programmatic dependent launch (PDL) in a chain of layers, inside a CUDA graph (device benchmark).

    python -m bench.pdl_chain --out DIR [--tokens 1,16,128] [--layers 8] [--hidden 4096] [--quick]

Each "layer" is the norm -> quant -> GEMM hand-off of a decoder block, on the ``triton`` providers:

- ``norm_quant>gemm``: fused RMSNorm + static FP8 quant (norm-quant provider ``triton``) -> FP8 GEMM
  ``[T, H] x [H, H]`` (GEMM provider ``triton``, ``config=auto``), whose bf16 output is the next layer's input;
- ``quant>gemm``: static FP8 quant of the previous output (the library's quant op, which runs the Triton
  kernel on CUDA) -> the same GEMM.

Every layer has its own weight; weight sets rotate past 4x L2. Each chain is captured twice, once with PDL
(the default on SM >= 9.0) and once with ``FP8_BACKENDS_PDL=0`` (the launches are recorded into the graph,
so the setting at capture time is what replays), and the two are timed interleaved
(:class:`fp8_backends.tuning.timing.CudaGraphTimer`). Reported: µs per layer and the saving per layer. The
outputs of both captures are compared (they must be bit-identical: PDL changes scheduling, not math).
Writes ``pdl_chain.json`` and ``pdl_chain.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def _pdl(enabled: bool):
    old = os.environ.get("FP8_BACKENDS_PDL")
    os.environ["FP8_BACKENDS_PDL"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FP8_BACKENDS_PDL", None)
        else:
            os.environ["FP8_BACKENDS_PDL"] = old


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from bench.common import header_markdown, md_table, run_header, write_json, write_markdown
    from fp8_backends import quant
    from fp8_backends.providers.triton import _support
    from fp8_backends.providers.triton.gemm import TritonGemmBackend
    from fp8_backends.providers.triton.norm_quant import TritonNormQuantBackend
    from fp8_backends.registry.platform import detect_platform
    from fp8_backends.tuning.timing import CudaGraphTimer, Run, TimerConfig, l2_cache_bytes, rotation_count

    device = "cuda"
    header = run_header(detect_platform(device), device)
    header["pdl_supported"] = _support.pdl_enabled(torch.device(device))
    h, layers = args.hidden, args.layers
    gemm, norm = TritonGemmBackend(), TritonNormQuantBackend()
    n_sets = rotation_count(layers * h * h, l2_cache_bytes(device))
    s_w = torch.tensor([0.01], device=device)
    weights = [[gemm.prepare_weight((torch.randn(h, h, device=device) * 2).to(torch.float8_e4m3fn), s_w)
                for _ in range(layers)] for _ in range(n_sets)]
    norm_w = torch.rand(h, device=device, dtype=torch.bfloat16) + 0.5
    s_x = torch.tensor([0.05], device=device)
    timer = CudaGraphTimer(TimerConfig(rounds=3, replays=3) if args.quick else TimerConfig(rounds=7, replays=5),
                           device)
    rows: list[dict[str, Any]] = []
    for t in (int(v) for v in args.tokens.split(",")):
        x0 = torch.randn(t, h, device=device, dtype=torch.bfloat16)

        def chain(kind: str, i: int, x0: torch.Tensor = x0) -> torch.Tensor:
            y = x0
            for layer in range(layers):
                if kind == "norm_quant>gemm":
                    qa = norm.rmsnorm_quant(y, norm_w, s_x)
                    xq = qa.data
                else:
                    xq = quant.quantize_static(y, s_x)
                y = gemm.gemm(xq, weights[i][layer], s_x)
            return y

        def run(kind: str, pdl: bool) -> Run:
            def fn(i: int) -> torch.Tensor:
                with _pdl(pdl):
                    return chain(kind, i)

            return Run(fn, n_sets)

        kinds = ("norm_quant>gemm", "quant>gemm")
        runs = {f"{kind} {'pdl' if pdl else 'no-pdl'}": run(kind, pdl) for kind in kinds for pdl in (True, False)}
        same = {}
        for kind in kinds:  # PDL changes scheduling only: eager outputs must agree bit for bit
            with _pdl(True):
                a = chain(kind, 0)
            with _pdl(False):
                b = chain(kind, 0)
            same[kind] = bool(torch.equal(a, b))
        res = timer(runs)
        for kind in kinds:
            on, off = res[f"{kind} pdl"], res[f"{kind} no-pdl"]
            row = {"tokens": t, "chain": kind, "layers": layers, "hidden": h, "identical_outputs": same[kind],
                   "pdl_us_per_layer": on.median_us / layers if on.ok else None,
                   "nopdl_us_per_layer": off.median_us / layers if off.ok else None,
                   "pdl": on.to_json(), "nopdl": off.to_json()}
            rows.append(row)
            print({k: v for k, v in row.items() if k not in ("pdl", "nopdl")}, flush=True)
    out = Path(args.out)
    write_json(out / "pdl_chain.json", {"header": header, "rows": rows})
    table = []
    for r in rows:
        a, b = r["pdl_us_per_layer"], r["nopdl_us_per_layer"]
        table.append([r["tokens"], r["chain"], f"{b:.2f}" if b else "-", f"{a:.2f}" if a else "-",
                      f"{b - a:.2f}" if a and b else "-", f"{100 * (b - a) / b:.1f}%" if a and b else "-",
                      r["identical_outputs"]])
    md = header_markdown(header, f"PDL in a {layers}-layer chain inside a CUDA graph (H = {h}, triton providers)")
    md += ["µs per layer: median graph replay over interleaved rounds / layers; weights rotated past 4x L2.", ""]
    md += md_table(["T", "chain", "no PDL µs/layer", "PDL µs/layer", "saved µs/layer", "saved %",
                    "outputs identical"], table)
    write_markdown(out / "pdl_chain.md", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
