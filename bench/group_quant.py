"""``python -m bench.group_quant``: per-token-group FP8 quantization kernels (groups of 128, scales M-major with the
column stride rounded up to 4 tokens, the layout the cutlass and Triton block GEMMs read) on the GPU.

Two kernels that write the same codes and scales, timed from the profiler's kernel records in one process, in
interleaved rounds (median over rounds of the per-call mean):

- ``triton``: the library's quantization op (:func:`fp8_backends.quant.quantize`, ``per_token_group``), the kernel a
  block-wise linear runs before any provider's GEMM that does not quantize in its own call;
- ``cutlass_op``: the quantization kernel of the cutlass provider's fused block linear op
  (``fp8_backends::cutlass_sm90_block_linear_native``, called with a 128-row weight so that its GEMM stays small; only
  the quantization kernel's time is counted).

Every shape's codes and scales are compared bit for bit between the two first. Ceiling: bytes moved (bf16 read, fp8
and fp32 scales written) at the device-to-device copy bandwidth measured in the same run. Writes ``group_quant.json``
and ``.md`` under ``--out``.

    python -m bench.group_quant --out bench/results/group_quant/<date>-h200
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from . import common

SHAPES = ((1, 4096), (1, 12288), (128, 4096), (512, 4096), (512, 12288), (2048, 4096), (2048, 12288), (8192, 4096))
CPP_KERNEL = "quant_group_kernel"
TRITON_KERNEL = "_group_quant_kernel"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.group_quant", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="M x K pairs, 'M:K,M:K' (default: decode and prefill of Qwen3-8B)")
    ap.add_argument("--calls", type=int, default=20, help="calls per round and kernel")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    return ap


def kernel_us(fn: Any, calls: int, name: str) -> float:
    """Mean µs per call of the kernels whose name contains ``name``, over ``calls`` calls under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if name in e.key)
    return total / calls


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from fp8_backends import quant
    from fp8_backends.core.types import ActScale, ScaleLayout
    from fp8_backends.providers.cutlass import native_op
    from fp8_backends.providers.cutlass.backend import CutlassSm90Backend
    from fp8_backends.registry.platform import detect_platform

    if not torch.cuda.is_available():
        raise SystemExit("bench.group_quant needs a CUDA GPU")
    shapes = SHAPES if not args.shapes else tuple(tuple(int(v) for v in p.split(":")) for p in args.shapes.split(","))
    native = native_op.load("cuda")
    backend = CutlassSm90Backend()
    backend._loaded_op()
    header = common.run_header(detect_platform("cuda"), "cuda")
    copy_gbps = common.copy_ceiling("cuda")
    seen: list[tuple[Any, Any]] = []

    def record(x: Any, w: Any, xs: Any, ws: Any, bias: Any, out_dtype: Any, config: str) -> Any:
        seen.append((x.clone(), xs.clone()))
        return torch.zeros(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)

    lib = torch.library.Library("fp8b_bench", "DEF")
    lib.define("record(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, ScalarType out_dtype, "
               "str config) -> Tensor")
    lib.impl("record", record, "CUDA")
    rows = []
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        kb = -(-k // 128)
        w = torch.zeros(128, k, device="cuda", dtype=torch.float8_e4m3fn)
        prepared = backend.prepare_weight(w, torch.ones(1, kb, device="cuda"))
        qa = quant.quantize(x, ActScale.PER_TOKEN_GROUP, group_size=128, scale_layout=ScaleLayout.M_MAJOR_TMA)
        native.set_block_fallback("fp8b_bench::record")  # the op's own codes and scales, handed over as views
        native.block_linear_op(x, prepared.data, prepared.scale, None, torch.bfloat16, "not-a-config")
        native.set_block_fallback("fp8_backends::cutlass_sm90_block_gemm")
        codes, scales = seen[-1]
        same = bool(torch.equal(codes.view(torch.uint8), qa.data.view(torch.uint8))
                    and torch.equal(scales, qa.scale))

        def triton_call(x: Any = x) -> Any:
            return quant.quantize(x, ActScale.PER_TOKEN_GROUP, group_size=128, scale_layout=ScaleLayout.M_MAJOR_TMA)

        def cpp_call(x: Any = x, prepared: Any = prepared) -> Any:
            return native.block_linear_op(x, prepared.data, prepared.scale, None, torch.bfloat16, "auto")

        per: dict[str, list[float]] = {"triton": [], "cutlass_op": []}
        for r in range(args.rounds):
            order = [("triton", triton_call, TRITON_KERNEL), ("cutlass_op", cpp_call, CPP_KERNEL)]
            for name, fn, kernel in order if r % 2 == 0 else order[::-1]:
                per[name].append(kernel_us(fn, args.calls, kernel))
        us = {name: statistics.median(v) for name, v in per.items()}
        nbytes = m * k * 2 + m * k + 4 * kb * m
        floor = nbytes / (copy_gbps * 1e3) if copy_gbps else None
        rows.append({"m": m, "k": k, "us": us, "same_bits": same, "floor_us": floor,
                     "pct_floor": {n: 100 * floor / v for n, v in us.items() if floor and v} if floor else {}})
        common.write_json(args.out / "group_quant.json", {"header": header, "copy_gbps": copy_gbps, "rows": rows})
    lines = common.header_markdown(header, "Per-token-group FP8 quantization kernels (groups of 128, M-major scales)")
    lines += [f"Copy bandwidth in this run: {common.fmt(copy_gbps, '.0f')} GB/s. µs per call (kernel time, median of "
              f"{args.rounds} interleaved rounds of {args.calls} calls); % of the copy-bandwidth floor for the bytes "
              "moved (bf16 read, codes and scales written).", ""]
    lines += common.md_table(
        ["M", "K", "triton µs", "cutlass op µs", "cutlass op / triton", "% floor triton", "% floor cutlass op",
         "same bits"],
        [[r["m"], r["k"], common.fmt(r["us"]["triton"]), common.fmt(r["us"]["cutlass_op"]),
          common.fmt(r["us"]["cutlass_op"] / r["us"]["triton"], ".3f"),
          common.fmt(r["pct_floor"].get("triton"), ".0f"), common.fmt(r["pct_floor"].get("cutlass_op"), ".0f"),
          "yes" if r["same_bits"] else "NO"] for r in rows])
    common.write_markdown(args.out / "group_quant.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
