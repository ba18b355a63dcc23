"""``python -m bench.op_host``: host µs per call of the cutlass provider's block-wise C++ ops, called from Python as
Inductor's generated code calls them, against ``torch.mm`` (a bf16 linear's extern call) in the same rounds.

A compiled step that the host, not the GPU, paces (``torch.compile`` without CUDA graphs, prefill up to ~1024
tokens on the H200's host) costs the sum of its calls' host time; a block-wise FP8 linear replaces ``torch.mm`` by one
call of ``fp8_backends::cutlass_sm90_block_linear_native`` (group quantization and block GEMM). This splits that
call's host time:

- ``torch.mm``: ``torch.mm(x, w.t(), out=y)`` in bf16, as Inductor's ``extern_kernels.mm``;
- ``torch.empty``: one output allocation from Python (the floor of any call that returns a new tensor);
- ``linear``: the fused op through its ``OpOverload`` (``torch.ops.fp8_backends.<op>.default``, Inductor's call);
- ``linear._op``: the same through the overload's C++ entry (one Python frame less; the eager plan's call);
- ``linear M=0``: the same op on an empty activation (the dispatcher's cost and one allocation: the op returns early);
- ``block_gemm``: the block GEMM op on an already quantized activation (no quantization launch);
- ``quantize``: the library's group quantization from Python (:func:`fp8_backends.quant.quantize`, the Triton
  kernel an unfused block linear launches first);
- ``flashinfer_block``: with ``--flashinfer``, the ``flashinfer_block`` provider's op
  (``torch.ops.fp8_backends.flashinfer_block_gemm``, DeepGEMM through flashinfer's module) on the quantized
  activation: with ``quantize``, what that provider's block linear costs the host.

One sample = the wall time to enqueue ``--calls`` calls while the GPU is kept busy (``torch.cuda._sleep`` ahead of
them), divided by ``--calls``; every variant once per round in a rotated order, ``--rounds`` rounds; medians, and
the median ratio to ``torch.mm`` of the same round. Writes ``op_host.json`` and ``.md`` under ``--out``.

    python -m bench.op_host --out bench/results/op_host/<date>-h200
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from . import common

#: Qwen3-8B's fused q/k/v, o, fused gate/up and down weights [N, K]
SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.op_host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="N x K pairs, 'N:K,N:K' (default: Qwen3-8B's four GEMMs)")
    ap.add_argument("--ms", default="128,512", help="activation rows, comma-separated")
    ap.add_argument("--calls", type=int, default=200, help="calls per sample")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--flashinfer", action="store_true",
                    help="also time the flashinfer_block provider's op (its module and kernels built ahead)")
    ap.add_argument("--out", type=Path, required=True)
    return ap


def variants(x: Any, w: Any, y: Any, qa: Any, wp: Any, ws: Any, linear: Any, block_gemm: Any) -> dict[str, Any]:
    """The calls timed (module docstring) on activation ``x [M, K]`` bf16, bf16 weight ``w`` and output ``y``, the
    quantized activation ``qa``, the provider's prepared block weight ``wp`` and scales ``ws``."""
    import torch

    from fp8_backends import quant
    from fp8_backends.core.types import ActScale, ScaleLayout

    bf16, (m, n), empty_x, op = torch.bfloat16, y.shape, x[:0], linear._op
    return {
        "torch.mm": lambda: torch.mm(x, w.t(), out=y),
        "torch.empty": lambda: torch.empty(m, n, device="cuda", dtype=bf16),
        "linear": lambda: linear(x, wp, ws, None, bf16, "auto"),
        "linear._op": lambda: op(x, wp, ws, None, bf16, "auto"),
        "linear M=0": lambda: linear(empty_x, wp, ws, None, bf16, "auto"),
        "block_gemm": lambda: block_gemm(qa.data, wp, qa.scale, ws, None, bf16, "auto"),
        "quantize": lambda: quant.quantize(x, ActScale.PER_TOKEN_GROUP, group_size=128,
                                           scale_layout=ScaleLayout.M_MAJOR_TMA),
    }


def markdown(header: dict[str, Any], rows: list[dict[str, Any]], rounds: int, calls: int) -> list[str]:
    """The table of ``op_host.md``: per shape and M, each variant's median µs and its ratio to ``torch.mm``."""
    keys = list(rows[0]["us"]) if rows else []
    lines = common.header_markdown(header, "Host µs per call of the block-wise GEMM ops against torch.mm")
    lines += [f"Median of {rounds} rotated rounds of {calls} calls enqueued while the GPU is busy; in parentheses "
              "the median ratio to `torch.mm` of the same round.", ""]
    lines += common.md_table(
        ["N x K", "M", *keys],
        [[f"{r['n']}x{r['k']}", r["m"], *(f"{common.fmt(r['us'][key], '.1f')} ({common.fmt(r['ratio'][key], '.2f')})"
                                         for key in keys)] for r in rows])
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from fp8_backends import quant
    from fp8_backends.core.types import ActScale, ScaleLayout
    from fp8_backends.providers.cutlass import native_op
    from fp8_backends.providers.cutlass.backend import CutlassSm90Backend
    from fp8_backends.registry.platform import detect_platform

    if not torch.cuda.is_available():
        raise SystemExit("bench.op_host needs a CUDA GPU")
    shapes = SHAPES if not args.shapes else tuple(tuple(int(v) for v in p.split(":")) for p in args.shapes.split(","))
    ms = [int(v) for v in args.ms.split(",") if v.strip()]
    native = native_op.load("cuda")
    backend = CutlassSm90Backend()
    backend._loaded_op()
    linear = torch.ops.fp8_backends.cutlass_sm90_block_linear_native.default
    block_gemm = torch.ops.fp8_backends.cutlass_sm90_block_gemm_native.default
    header = common.run_header(detect_platform("cuda"), "cuda")
    bf16 = torch.bfloat16
    rows: list[dict[str, Any]] = []
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", dtype=bf16) / k ** 0.5
        w_q = (w * 64).to(torch.float8_e4m3fn)
        w_s = torch.full((-(-n // 128), -(-k // 128)), 1 / 64, device="cuda")
        prepared = backend.prepare_weight(w_q, w_s)
        wp, ws = prepared.data, prepared.scale
        fi = None
        if args.flashinfer:
            from fp8_backends.providers.flashinfer.block import FlashinferBlockBackend

            fi_prepared = FlashinferBlockBackend().prepare_weight(w_q, w_s)
            fi = (torch.ops.fp8_backends.flashinfer_block_gemm.default, fi_prepared.data, fi_prepared.scale)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=bf16)
            y = torch.empty(m, n, device="cuda", dtype=bf16)
            qa = quant.quantize(x, ActScale.PER_TOKEN_GROUP, group_size=128, scale_layout=ScaleLayout.M_MAJOR_TMA)
            for _ in range(2):  # the first call of a shape and bucket registers its library (Python)
                linear(x, wp, ws, None, bf16, "auto")
                block_gemm(qa.data, wp, qa.scale, ws, None, bf16, "auto")
            torch.cuda.synchronize()
            served = native.calls()[0]
            linear(x, wp, ws, None, bf16, "auto")
            if native.calls()[0] != served + 1:
                raise SystemExit(f"{n}x{k} M={m}: the C++ op handed the call to Python; nothing to measure")
            fns = variants(x, w, y, qa, wp, ws, linear, block_gemm)
            if fi is not None:
                fi_op, fi_w, fi_ws = fi
                fi_op(qa.data, fi_w, qa.scale, fi_ws, bf16)  # the first call of a shape runs its kernel once
                fns["flashinfer_block"] = lambda op=fi_op, a=qa, b=fi_w, bs=fi_ws: op(a.data, b, a.scale, bs, bf16)
            samples, ratios = common.rotated_host_us(fns, args.rounds, args.calls, "cuda", ref="torch.mm")
            rows.append({"n": n, "k": k, "m": m,
                         "us": {key: statistics.median(v) for key, v in samples.items()},
                         "min_us": {key: min(v) for key, v in samples.items()},
                         "ratio": {key: statistics.median(v) for key, v in ratios.items()}})
            common.write_json(args.out / "op_host.json", {"header": header, "rows": rows})
    common.write_markdown(args.out / "op_host.md", markdown(header, rows, args.rounds, args.calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
