"""Benchmark: a Hugging Face ``transformers`` model in bf16, torchao float8 and fp8-backends, on the path users run.

Models are built from configs at real layer sizes with random weights (nothing is downloaded):

- ``llama``: Llama-3-8B layers (hidden 4096, intermediate 14336, 32 query / 8 KV heads), ``--layers`` of them;
- ``qwen2``: Qwen2.5-7B layers (hidden 3584, intermediate 18944, 28 query / 4 KV heads, q/k/v biases).

Both use a 32000-token vocabulary (the output head is the same bf16 GEMM for every variant). Variants, each a
deep copy of one bf16 model:

- ``bf16``: as built;
- ``torchao``: ``torchao.quantization.quantize_(layers, Float8DynamicActivationFloat8WeightConfig(PerTensor()))``
  (only when torchao imports);
- ``fp8_dynamic``: ``fp8_backends.quantize_model(model, act_scale="per_tensor_dynamic")``: per-tensor dynamic
  activations, per-tensor weights, provider ``auto``;
- ``fp8_channel``: ``quantize_model(model, weight_scale="per_channel", act_scale="per_token")``: the default scheme;
- ``fp8_static``: ``quantize_model(model, act_scale="per_tensor_static", calibration=[one 512-token batch])``;
- ``fp8_dynamic_sl``, ``fp8_static_sl``: the same with ``static_launch=True`` (Inductor's static launcher for the
  library's Triton kernels). The setting is global to a process, so these and the plain FP8 variants can only be
  measured in one run with ``--parallel-compile``.

``lm_head`` stays bf16 in every variant. Workloads: prefill of ``T`` tokens (``--prefill``, batch 1, logits of
the last position only, as ``generate()`` asks) and one-token decode with a ``StaticCache`` (position ``--context``
after a prefill of that many tokens). Modes:

- ``eager``;
- ``compiled``: ``torch.compile(model, dynamic=False)`` (Inductor, default mode), one call per step; with
  ``--compile-scope layers`` each decoder layer is compiled instead (regional compilation: one compile serves every
  layer of a prefill, the embedding, final norm and head run eagerly; with a ``StaticCache`` each layer's cache index
  is a constant of its graph, so decode compiles once per layer);
- ``graph`` (decode only): the compiled step captured in a CUDA graph (``torch.cuda.graph``, as serving engines
  capture their compiled decode step) and replayed.

Each (workload, mode) times every variant in ``--rounds`` interleaved rounds of ``--iters`` calls (CUDA events
around each call: host time the GPU waits for is included); medians reported, with the ratio to bf16 and to
torchao from the same rounds. Also measured: host µs per call of one ``Fp8Linear(K, N)`` against ``nn.Linear``
(dynamic and static activations, M = 1 and 512; the calls are enqueued in a loop while the GPU is kept busy, so
the time is the host's alone), and the logits of the FP8 variants against bf16 (relative error, top-1 agreement)
on a ``--check-tokens`` prefill.

``--parallel-compile`` runs each variant in its own process (``bench/hf_workers.py``): the processes build, compile
and capture at the same time (a whole-model compile takes minutes), wait for each other, then take turns on the GPU
in the same interleaved rounds a single process would run (one process times while the others wait), so the ratios
still come from the same rounds. The logits check and the host table run in the parent afterwards.

Writes ``hf_model_<model>.json`` and ``hf_model_<model>.md`` (+ ``hf_model_<model>.png``) into ``--out``.

    python -m bench.hf_model --model llama --layers 8 --out bench/results/<date>-h200/hf
    python -m bench.hf_model --device cpu --small --out /tmp/hf        # smoke test on the CPU
    python -m bench.hf_model --model llama --layers 8 --modes compiled graph --prefill --parallel-compile \
        --variants bf16 torchao fp8_static fp8_static_sl --out DIR     # whole-model compiles in parallel
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any

import torch

from bench import hf_workers
from bench.hf_bench import (
    MODELS,
    STATIC_LAUNCH_VARIANTS,
    VARIANTS,
    Bench,
    check_variant,
    is_fp8,
    log,
    time_steps,
    variant_base,
)


def parse_args(argv: list[str] | None) -> Any:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="llama")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=check_variant,
                   help="also BASE+backend=NAME / BASE+objective=NAME for the FP8 ones")
    p.add_argument("--prefill", nargs="*", type=int, default=[128, 512, 4096])
    p.add_argument("--context", type=int, default=512, help="decode position (tokens already in the cache)")
    p.add_argument("--modes", nargs="+", default=["eager", "compiled", "graph"], choices=["eager", "compiled", "graph"])
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--compile-scope", choices=["layers", "model"], default="model",
                   help="torch.compile the whole model (default) or each decoder layer (regional compilation)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--host-rounds", type=int, default=7, help="0: no host table")
    p.add_argument("--host-calls", type=int, default=200)
    p.add_argument("--step-host-calls", type=int, default=3, help="calls per host-time sample of a model step")
    p.add_argument("--profile", action="store_true", help="also list the kernels of one compiled/graph step")
    p.add_argument("--host-profile", action="store_true", help="also cProfile the layer calls of the host table")
    p.add_argument("--static-launch", choices=["on", "off"], default="off",
                   help="quantize_model(static_launch=...): Inductor's static launcher for the Triton kernels")
    p.add_argument("--step-profile", action="store_true",
                   help="also cProfile 20 calls of each compiled (no graph) step: where the host time goes")
    p.add_argument("--check-tokens", type=int, default=128, help="0: no logits check")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() before each row's timing (what serving engines do after CUDA-graph capture)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny layers (CPU smoke test)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parallel-compile", action="store_true",
                   help="one process per variant: compile in parallel, then take turns on the GPU (hf_workers.py)")
    p.add_argument("--turn-timeout", type=float, default=1800.0,
                   help="--parallel-compile: seconds a process waits for the others (compiles included)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # "I/N": one variant's process
    p.add_argument("--sync", type=Path, default=None, help=argparse.SUPPRESS)  # the processes' shared folder
    return p.parse_args(argv)


def check_args(args: Any) -> None:
    """Refuse what one process cannot measure: the static launcher is a global Inductor setting."""
    fp8 = [v for v in args.variants if is_fp8(v)]
    launches = {variant_base(v) in STATIC_LAUNCH_VARIANTS or args.static_launch == "on" for v in fp8}
    if len(launches) > 1 and not args.parallel_compile and args.worker is None:
        raise SystemExit("hf_model: FP8 variants with and without the static launcher need one process each: "
                         "add --parallel-compile")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    if args.worker is not None:
        return hf_workers.worker_main(args)
    if args.parallel_compile:
        return hf_workers.parent_main(args, argv)
    bench = Bench(args)
    bench.checks()
    bench.compile()
    for workload, mode in bench.rows():
        log(f"{workload} / {mode}")
        steps, rewinds = bench.steps(workload, mode)
        row = {"workload": workload, "mode": mode, **time_steps(steps, args, mode != "graph", rewinds)}
        us, host = row["us"], row["host_us"]
        bench.profiles(row, steps, rewinds)
        bench.result["rows"].append(row)
        log("  " + ", ".join(f"{k} {v:.0f} µs (host {host.get(k, 0):.0f})" for k, v in us.items()))
        del steps
        gc.collect()
        bench.write()  # keep what was measured so far
    bench.write(final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
