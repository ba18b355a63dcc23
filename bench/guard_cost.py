"""Benchmark: the guards a compiled model checks on the host at every call, bf16 against the library's FP8 layers.

Dynamo guards every Python value a traced call reads and checks those guards before the compiled graph runs, at every
call, on the host. This counts them (by kind) for a ``transformers`` Llama built from a small config, compiled whole
(``torch.compile(model, backend="eager", dynamic=False)``: the guards do not depend on the backend), and times one
check of the model's guard tree through ``torch._dynamo``'s guard manager:

- ``warm``: the median over back-to-back checks (the guard objects stay in the CPU's caches);
- ``cold``: the median over checks each preceded by a pass over 64 MiB of memory, as a model step's other host work
  (kernel launches, the allocator, the wrapper code) evicts the guard objects between two calls.

Variants: ``bf16`` (as built), ``fp8_static`` / ``fp8_dynamic`` (``quantize_model`` with static or dynamic
per-tensor activations, fused siblings) and ``fp8_static_unfused`` (``fuse=False``). Runs on the CPU.

    python -m bench.guard_cost --out bench/results/<date>-cpu-guards [--layers 8]

Writes ``guard_cost.json`` and ``guard_cost.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any

import torch

VARIANTS = ("bf16", "fp8_static", "fp8_dynamic", "fp8_static_unfused")
_GUARD = re.compile(r"\+- ([A-Z_]+):")  # a guard line of a printed guard tree ("+- GuardManager: ..." is not one)


def guard_kinds(tree: str) -> collections.Counter:
    """``{kind: count}`` of the guards in a printed Dynamo guard tree (``str(guard_manager)``)."""
    return collections.Counter(m.group(1) for m in _GUARD.finditer(tree))


def build(layers: int) -> tuple[Any, torch.Tensor]:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=layers, vocab_size=1000)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype=torch.bfloat16).eval()
    return model, torch.randint(0, 1000, (1, 16))


def quantized(base: Any, ids: torch.Tensor, variant: str) -> Any:
    from fp8_backends import quantize_model

    model = copy.deepcopy(base)
    if variant == "fp8_static":
        quantize_model(model, act_scale="per_tensor_static", calibration=[ids])
    elif variant == "fp8_dynamic":
        quantize_model(model, act_scale="per_tensor_dynamic")
    elif variant == "fp8_static_unfused":
        quantize_model(model, act_scale="per_tensor_static", calibration=[ids], fuse=False)
    return model


def frame_locals(model: Any, ids: torch.Tensor) -> dict[str, Any]:
    """The locals of the frame Dynamo compiled: ``transformers`` wraps ``forward`` (``*args, **kwargs`` and the
    wrapper's closure variables)."""
    fn = type(model).forward
    out: dict[str, Any] = {"args": (model, ids), "kwargs": {}}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        out[name] = cell.cell_contents
    return out


def measure(model: Any, ids: torch.Tensor, warm_checks: int, cold_checks: int) -> dict[str, Any]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with torch.no_grad():
        compiled(ids)
    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    manager = entries[0].guard_manager
    kinds = guard_kinds(str(manager))
    f_locals = frame_locals(model, ids)
    with torch.no_grad():  # the grad mode is part of the guarded global state
        return _time_checks(manager, f_locals, kinds, warm_checks, cold_checks)


def _time_checks(manager: Any, f_locals: dict[str, Any], kinds: collections.Counter, warm_checks: int,
                 cold_checks: int) -> dict[str, Any]:
    if not manager.check(f_locals):
        raise RuntimeError("the guards do not pass on the frame's locals: the measurement would time a failing check")
    for _ in range(20):
        manager.check(f_locals)
    t0 = time.perf_counter()
    for _ in range(warm_checks):
        manager.check(f_locals)
    warm = (time.perf_counter() - t0) / warm_checks * 1e6
    junk = torch.ones(64 * 1024 * 1024 // 4)
    cold = []
    for _ in range(cold_checks):
        junk.add_(1.0)
        t0 = time.perf_counter()
        manager.check(f_locals)
        cold.append((time.perf_counter() - t0) * 1e6)
    return {"guards": sum(kinds.values()), "kinds": dict(kinds.most_common()), "warm_us": warm,
            "cold_us": statistics.median(cold), "lambda_guards": kinds.get("LAMBDA_GUARD", 0)}


def render(result: dict[str, Any]) -> str:
    base = result["variants"]["bf16"]
    lines = ["# Guards of a compiled model: bf16 against the library's FP8 layers", "",
             f"- date: {result['date']}; torch {result['torch']}; CPU: {result['cpu']}",
             f"- model: transformers Llama, {result['layers']} layers, hidden 256 (the guards do not depend on sizes)",
             "- warm: back-to-back checks; cold: each check after a 64 MiB pass over memory (median)", "",
             "| variant | guards | over bf16 | LAMBDA (Python) | warm µs | cold µs |", "|---|---|---|---|---|---|"]
    for name, r in result["variants"].items():
        lines.append(f"| {name} | {r['guards']} | {r['guards'] - base['guards']:+d} | {r['lambda_guards']} | "
                     f"{r['warm_us']:.1f} | {r['cold_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.guard_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--warm-checks", type=int, default=3000)
    ap.add_argument("--cold-checks", type=int, default=200)
    args = ap.parse_args(argv)
    base, ids = build(args.layers)
    variants = ["bf16", *(v for v in args.variants if v != "bf16")]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
                              "cpu": platform.processor() or platform.machine(), "layers": args.layers,
                              "variants": {}}
    for name in variants:
        model = base if name == "bf16" else quantized(base, ids, name)
        r = result["variants"][name] = measure(model, ids, args.warm_checks, args.cold_checks)
        print(f"{name}: {r['guards']} guards, {r['warm_us']:.1f} µs warm, {r['cold_us']:.1f} µs cold", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "guard_cost.json").write_text(json.dumps(result, indent=1))
    text = render(result)
    (args.out / "guard_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
