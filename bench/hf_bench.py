"""The machinery of ``python -m bench.hf_model`` (what it measures and how to run it: :mod:`bench.hf_model`): the
variants and their models, the steps of each workload and mode, their timing and profiles, the logits check, the host
table, the tables and the plot, and :class:`Bench` (one process's models and compiled steps), which the single process
and the ``--parallel-compile`` processes (:mod:`bench.hf_workers`) share.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import importlib.util
import json
import logging
import os
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import common
from bench.common import host_per_call_us  # noqa: F401 - also hf_workers' (hf.host_per_call_us)
from fp8_backends.core.settings import HOST_CONTEXT_ENV

VARIANTS = ("bf16", "torchao", "fp8_dynamic", "fp8_static", "fp8_dynamic_sl", "fp8_static_sl", "fp8_block",
            "fp8_channel")
#: fp8_block: block-wise FP8 (quantize_model(weight_scale="block"): 128x128 weight blocks, groups of 128);
#: fp8_channel: per-channel weights with dynamic per-token activations (the FP8_DYNAMIC checkpoint scheme)
FP8_VARIANTS = ("fp8_dynamic", "fp8_static", "fp8_dynamic_sl", "fp8_static_sl", "fp8_block", "fp8_channel")
#: variants quantized with ``quantize_model(static_launch=True)`` (a global Inductor setting: ``--parallel-compile``)
STATIC_LAUNCH_VARIANTS = ("fp8_dynamic_sl", "fp8_static_sl")


def variant_base(name: str) -> str:
    """``"fp8_static_sl+backend=triton"`` -> ``"fp8_static_sl"``: an FP8 variant may carry ``+key=value``
    arguments of :func:`fp8_backends.quantize_model` (``backend``, ``objective``), to compare choices in one run, and
    ``+plan=general``: compiled calls trace the general path instead of each layer's traced plan (an A/B of
    :mod:`fp8_backends.layers.traced_plan`); ``+host_context=US``: the layers are resolved with
    ``FP8_SELECTION_HOST_CONTEXT_US=US`` (an A/B of the host objective's context, ``0``: only the provider's own
    host time);
    ``+fuse=0``: ``quantize_model(fuse=False)``, every linear its own GEMM (an A/B of fused q/k/v and gate/up)."""
    return name.split("+", 1)[0]


def variant_kwargs(name: str) -> dict[str, str]:
    """The ``+key=value`` arguments of a variant name (see :func:`variant_base`)."""
    out = {}
    for part in name.split("+")[1:]:
        key, sep, value = part.partition("=")
        if not sep or key not in ("backend", "objective", "plan", "host_context", "fuse") or \
                (key == "plan" and value != "general") or (key == "fuse" and value not in ("0", "1")):
            raise ValueError(f"variant {name!r}: expected +backend=NAME, +objective=NAME, +plan=general, "
                             f"+host_context=US or +fuse=0|1, got {part!r}")
        out[key] = value
    return out


def is_fp8(name: str) -> bool:
    return variant_base(name) in FP8_VARIANTS


def check_variant(name: str) -> str:
    """argparse type of ``--variants``: a known variant, FP8 ones with optional ``+key=value`` arguments."""
    if variant_base(name) not in VARIANTS or ("+" in name and not is_fp8(name)):
        raise argparse.ArgumentTypeError(f"unknown variant {name!r} (known: {', '.join(VARIANTS)}; FP8 variants take "
                                         "+backend=NAME / +objective=NAME / +plan=general / +host_context=US / "
                                         "+fuse=0|1)")
    try:
        variant_kwargs(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name

#: model configs at real layer sizes; vocabulary cut to 32000 for every model (the head is not what is compared)
MODELS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "LlamaForCausalLM", "config": "LlamaConfig", "hidden_size": 4096, "intermediate_size": 14336,
              "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0, "rms_norm_eps": 1e-5},
    "qwen2": {"arch": "Qwen2ForCausalLM", "config": "Qwen2Config", "hidden_size": 3584, "intermediate_size": 18944,
              "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    # Qwen3-8B layer sizes (the block-wise FP8 checkpoints Qwen3-*-FP8 ship): q/k norms, head_dim 128
    "qwen3": {"arch": "Qwen3ForCausalLM", "config": "Qwen3Config", "hidden_size": 4096, "intermediate_size": 12288,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
              "rms_norm_eps": 1e-6},
    # Qwen3-30B-A3B layer sizes (a MoE model shipped as a block-wise FP8 checkpoint): 128 experts, 8 routed a token
    "qwen3_moe": {"arch": "Qwen3MoeForCausalLM", "config": "Qwen3MoeConfig", "hidden_size": 2048,
                  "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                  "num_experts_per_tok": 8, "norm_topk_prob": True, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
#: what ``--small`` also shrinks of a MoE model
SMALL_MOE = {"moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
VOCAB = 32000


def log(msg: str) -> None:
    print(msg, flush=True)


def install_finegrained_fp8(path: Path | str) -> str:
    """Serve ``transformers``' FP8 integration (``FineGrainedFP8``: its ``FP8Linear`` layers, the Hugging Face ``fp8``
    and block checkpoints) with the ``finegrained_fp8`` kernel package found at ``path`` (the package folder, or one
    holding it), the package ``transformers`` otherwise downloads from the hub (``kernels-community/finegrained-fp8``,
    through the ``kernels`` package) at its first FP8 call: a GPU machine without the network has no other way to run
    that path. The package is the kernel repository's ``torch-ext/finegrained_fp8`` folder with the ``_ops`` module its
    build generates (``ops``: the ``torch.ops`` namespace its triton ops register in, and
    ``add_op_namespace_prefix(name) -> "<namespace>::<name>"``). Nothing of it is part of this project; a ``SOURCE``
    file beside it (one line: where it was taken from) is reported. Returns that line (or the folder)."""
    import sys

    folder = Path(path).resolve()
    package = folder if (folder / "__init__.py").is_file() else folder / "finegrained_fp8"
    if not (package / "__init__.py").is_file():
        raise FileNotFoundError(f"no finegrained_fp8 package at {path}")
    kernel = sys.modules.get("finegrained_fp8")
    if kernel is None:  # the package under its own name (its modules import each other relatively)
        spec = importlib.util.spec_from_file_location("finegrained_fp8", package / "__init__.py",
                                                      submodule_search_locations=[str(package)])
        kernel = importlib.util.module_from_spec(spec)
        sys.modules["finegrained_fp8"] = kernel
        spec.loader.exec_module(kernel)
    from transformers.integrations import finegrained_fp8 as integration

    integration._FINEGRAINED_FP8 = integration.FineGrainedFP8(
        matmul=kernel.matmul_2d, batched_matmul=kernel.matmul_batched, grouped_matmul=kernel.matmul_grouped)
    source = package / "SOURCE"
    return source.read_text(encoding="utf-8").strip() if source.is_file() else str(package)


# ------------------------------------------------------------------------------------------------ models
def build_model(name: str, layers: int, device: str, small: bool, max_positions: int) -> Any:
    import transformers

    spec = dict(MODELS[name])
    arch, cfg_name = spec.pop("arch"), spec.pop("config")
    if small:
        spec.update(SMALL)
        spec.update({k: v for k, v in SMALL_MOE.items() if k in spec})
        if "head_dim" in spec:
            spec["head_dim"] = 16
    config = getattr(transformers, cfg_name)(num_hidden_layers=layers, vocab_size=VOCAB if not small else 256,
                                             max_position_embeddings=max_positions, tie_word_embeddings=False, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, arch)(config).to(torch.bfloat16).eval()
    return model


def make_variants(base: Any, names: list[str], calib_ids: torch.Tensor,
                  static_launch: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({variant: model}, {variant: notes})``; a variant that cannot be built is left out with its reason."""
    from fp8_backends import quantize_model

    models: dict[str, Any] = {}
    notes: dict[str, Any] = {}
    for name in names:
        context = saved_context = None
        try:
            if name == "bf16":
                models[name] = base
                continue
            model = copy.deepcopy(base)
            launch = static_launch or variant_base(name) in STATIC_LAUNCH_VARIANTS
            kind = variant_base(name).removesuffix("_sl")
            extra = variant_kwargs(name)
            general = extra.pop("plan", None) == "general"
            context = extra.pop("host_context", None)
            if "fuse" in extra:
                extra["fuse"] = extra["fuse"] == "1"  # type: ignore[assignment]
            saved_context = os.environ.get(HOST_CONTEXT_ENV)
            if context is not None:
                os.environ[HOST_CONTEXT_ENV] = context
            if name == "torchao":
                from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerTensor, quantize_

                quantize_(model.model.layers, Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()))
                notes[name] = {"config": "Float8DynamicActivationFloat8WeightConfig(PerTensor())"}
            elif kind == "fp8_dynamic":
                summary = quantize_model(model, act_scale="per_tensor_dynamic", static_launch=launch, **extra)
                notes[name] = {"swapped": summary.count, "gemms": summary.gemms, "providers": summary.providers(),
                               "bytes_saved": summary.bytes_saved}
            elif kind in ("fp8_block", "fp8_channel"):
                scheme = ({"weight_scale": "block"} if kind == "fp8_block"
                          else {"weight_scale": "per_channel", "act_scale": "per_token"})
                summary = quantize_model(model, static_launch=launch, **scheme, **extra)
                notes[name] = {"swapped": summary.count, "gemms": summary.gemms, "providers": summary.providers(),
                               "bytes_saved": summary.bytes_saved}
            elif kind == "fp8_static":
                summary = quantize_model(model, act_scale="per_tensor_static", calibration=[calib_ids],
                                         static_launch=launch, **extra)
                notes[name] = {"swapped": summary.count, "gemms": summary.gemms, "providers": summary.providers(),
                               "bytes_saved": summary.bytes_saved}
            if general:
                _drop_traced_plans(model)
                notes[name]["plan"] = "general"
            if context is not None:
                notes[name]["host_context_us"] = float(context)
            models[name] = model
        except Exception as exc:  # keep going: report the variant as missing
            notes[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            log(f"variant {name}: {notes[name]['error']}")
        finally:
            if context is not None:
                if saved_context is None:
                    os.environ.pop(HOST_CONTEXT_ENV, None)
                else:
                    os.environ[HOST_CONTEXT_ENV] = saved_context
    return models, notes


def _drop_traced_plans(model: Any) -> None:
    """Make every ``Fp8Linear`` of ``model`` trace the general path under ``torch.compile`` (``+plan=general``)."""
    from fp8_backends.layers import Fp8Linear

    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module._traced = None


# ------------------------------------------------------------------------------------------------ timing
def cuda_time_us(fn: Callable[[], Any], iters: int, device: str) -> float:
    """Median µs of one call, CUDA events around each call (host time the GPU waits for included)."""
    if device != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def compile_model(model: Any, scope: str) -> Any:
    """``scope="model"``: ``torch.compile(model, dynamic=False)``. ``scope="layers"``: regional compilation (what
    ``transformers`` recommends to cut compile time): every decoder layer is compiled in place (one compiled graph
    serves all layers of a class), the rest of the model runs eagerly; returns a compiled copy of the model.

    The layers of every variant share one code object (the layer class's ``forward``), and Dynamo guards on the
    integer ``layer_idx`` the KV cache indexes its list of layers with: decode compiles once per layer and variant,
    and past Dynamo's recompile limit (8) a variant's layers silently run eagerly (seen on the H200: the FP8 variant
    measured after bf16 was never compiled). The limits are raised to hold every layer of every variant.

    ``scope="model"`` raises them too: the variants share the model's code objects, so three variants at three
    prefill lengths are nine compilations of one frame, past the limit of 8 (H200, 2026-12-01: the ninth ran eagerly,
    ``bench/results/hf_model/2026-12-01-h200-host-context-first/``)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    if scope == "model":
        return torch.compile(model, dynamic=False)
    regional = copy.deepcopy(model)  # the eager variant stays as it is
    for layer in regional.model.layers:
        layer.compile(dynamic=False)
    return regional


def prefill_step(model: Any, compiled: Any, ids: torch.Tensor, mode: str) -> Callable[[], Any]:
    target = compiled if mode == "compiled" else model

    def step() -> Any:
        with torch.no_grad():
            return target(ids, use_cache=False, logits_to_keep=1).logits

    return step


class DecodeState:
    """A StaticCache filled by a prefill of ``context`` tokens and the static buffers of a one-token step."""

    def __init__(self, model: Any, context: int, max_len: int, device: str) -> None:
        import transformers

        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
        g = torch.Generator(device="cpu").manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (1, context), generator=g).to(device)
        with torch.no_grad():
            model(ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=g).to(device)
        self.pos = torch.full((1, 1), context, dtype=torch.long, device=device)

        self.context = context
        self.lengths = [layer.cumulative_length for layer in self.cache.layers]  # the cache's write positions

    def rewind(self) -> None:
        """Put every layer's write position back at ``context`` (each step appends one token: a step timed many
        times would run past the cache's end). Called outside the timed calls."""
        for length in self.lengths:
            length.fill_(self.context)

    def step(self, target: Any) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return target(self.ids, cache=self.cache, position_ids=self.pos, use_cache=True).logits

        return run


def capture(fn: Callable[[], Any], warmup: int = 3) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph (after ``warmup`` calls on a side stream); returns the replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def build_steps(models: dict[str, Any], compiled: dict[str, Any], workload: str, mode: str, args: Any,
                decode: dict[str, DecodeState], errors: dict[str, str],
                rewinds: dict[str, Callable[[], None]]) -> dict[str, Callable[[], Any]]:
    """``{variant: step}`` ready to time (compiled, warmed up, captured); decode steps leave their cache rewinder
    in ``rewinds``."""
    steps: dict[str, Callable[[], Any]] = {}
    for name, model in models.items():
        key = f"{name}/{workload}/{mode}"
        try:
            t0 = time.perf_counter()
            if workload == "decode":
                state = decode[name]
                fn = state.step(compiled[name] if mode in ("compiled", "graph") else model)
                for _ in range(2):  # compile (first call) and settle outside capture
                    fn()
                state.rewind()
                if mode == "graph":
                    fn = capture(fn)
                state.rewind()
                rewinds[name] = state.rewind
            else:
                t = int(workload.removeprefix("prefill"))
                ids = torch.randint(0, model.config.vocab_size, (1, t), device=args.device)
                fn = prefill_step(model, compiled[name], ids, mode)
                for _ in range(2):
                    fn()
            if args.device == "cuda":
                torch.cuda.synchronize()
            log(f"  {key}: ready in {time.perf_counter() - t0:.1f} s")
            steps[name] = fn
        except Exception as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"  {key}: ERROR {errors[key]}")
            logging.debug(traceback.format_exc())
    return steps


def time_steps(steps: dict[str, Callable[[], Any]], args: Any, host: bool,
               rewinds: dict[str, Callable[[], None]]) -> dict[str, Any]:
    """A result row's timings (:func:`timed_row`): ``args.rounds`` interleaved rounds, the order rotated each round;
    the host time (``host``: not for graph replays) is the time one call takes to return after a sync
    (``--step-host-calls`` calls, averaged): the host's cost where the GPU is faster, the GPU's where a step waits for
    it (a compiled prefill at large T, or any sync inside the step)."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    hosts: dict[str, list[float]] = {name: [] for name in steps}
    if getattr(args, "gc_freeze", False):  # as serving engines do after capture: the cyclic collector then skips
        gc.collect()  # every object that exists now (models, compiled code, caches) in the timed steps
        gc.freeze()
    for r in range(args.rounds):
        order = list(steps)
        order = order[r % len(order):] + order[:r % len(order)]
        for name in order:
            rewind = rewinds.get(name, _nothing)
            rewind()
            samples[name].append(cuda_time_us(steps[name], args.iters, args.device))
            if host:
                rewind()
                hosts[name].append(host_per_call_us(steps[name], args.step_host_calls, args.device, busy=False))
    return timed_row(samples, hosts)


def timed_row(samples: dict[str, list[float]], hosts: dict[str, list[float]]) -> dict[str, Any]:
    """``{"us": median µs, "host_us": median host µs, "us_rounds": every round's µs}`` per variant, from per-round
    samples (``samples[variant][r]``: round ``r``; every variant timed once per round, so index ``r`` of two
    variants is one round)."""
    return {"us": {name: statistics.median(v) for name, v in samples.items() if v},
            "host_us": {name: statistics.median(v) for name, v in hosts.items() if v},
            "us_rounds": {name: list(v) for name, v in samples.items() if v}}


def round_ratios(row: dict[str, Any], variant: str, base: str) -> tuple[float, float, float] | None:
    """``(median, min, max)`` over rounds of ``variant``'s µs over ``base``'s in the same round, from a row's
    ``us_rounds``; None where either was not timed in every round (or the row predates per-round samples)."""
    rounds = row.get("us_rounds") or {}
    a, b = rounds.get(variant), rounds.get(base)
    if not a or not b or len(a) != len(b):
        return None
    values = [x / y for x, y in zip(a, b) if y]
    return (statistics.median(values), min(values), max(values)) if values else None


def row_ratio(row: dict[str, Any], variant: str, base: str) -> float | None:
    """``variant`` over ``base`` in a row: the median of the per-round ratios, else the ratio of the medians."""
    per_round = round_ratios(row, variant, base)
    return per_round[0] if per_round is not None else ratio(row["us"].get(variant), row["us"].get(base))


def ratio_cell(row: dict[str, Any], variant: str, base: str) -> str:
    """A report's ratio cell: the median of the per-round ratios with their range, ``0.874 (0.80-0.95)``; the ratio
    of the medians where the row has no per-round samples."""
    per_round = round_ratios(row, variant, base)
    if per_round is None:
        return common.fmt(ratio(row["us"].get(variant), row["us"].get(base)), ".3f")
    mid, low, high = per_round
    return f"{mid:.3f} ({low:.2f}-{high:.2f})"


def _nothing() -> None:
    return None


def kernel_profile(fn: Callable[[], Any], device: str) -> dict[str, Any] | None:
    """Kernels one call launches (count, summed GPU µs, the 8 largest by total time, and in ``all`` every kernel by
    name), from torch.profiler; memsets and copies are counted apart (``memsets``: launches all the same)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    memsets = 0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if "memcpy" in ev.name.lower() or "memset" in ev.name.lower():
            memsets += 1
            continue
        kernels.setdefault(ev.name, []).append(ev.device_time_total if hasattr(ev, "device_time_total")
                                               else ev.cuda_time_total)
    total = sum(sum(v) for v in kernels.values())
    ranked = sorted(((sum(v), len(v), k) for k, v in kernels.items()), reverse=True)
    return {"kernels": sum(len(v) for v in kernels.values()), "kernel_us": total, "memsets": memsets,
            "top": [{"name": k[:90], "count": c, "us": us} for us, c, k in ranked[:8]],
            "all": [{"name": k[:160], "count": c, "us": round(us, 1)} for us, c, k in ranked]}


# ------------------------------------------------------------------------------------------------ host cost
def host_cost(args: Any) -> tuple[list[dict[str, Any]], list[str]]:
    from fp8_backends.layers import Fp8Linear

    k, n = (64, 64) if args.small else (4096, 4096)
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False, device=args.device, dtype=torch.bfloat16)
    layers = {"nn.Linear": lin,
              "Fp8Linear dynamic": Fp8Linear.from_linear(lin, act_scale="per_tensor_dynamic"),
              "Fp8Linear static": Fp8Linear.from_linear(lin, act_scale="per_tensor_static", input_scale=0.02),
              "Fp8Linear block": Fp8Linear.from_linear(lin, weight_scale="block")}
    rows: list[dict[str, Any]] = []
    prof_rows: list[str] = []
    with torch.no_grad():
        for m in (1, 512):
            x = torch.randn(m, k, device=args.device, dtype=torch.bfloat16)
            for layer in layers.values():
                for _ in range(5):
                    layer(x)  # compile kernels, fill launch caches
            samples: dict[str, list[float]] = {name: [] for name in layers}
            for _ in range(args.host_rounds):
                for name, layer in layers.items():
                    call = functools.partial(layer, x)
                    samples[name].append(host_per_call_us(call, args.host_calls, args.device))
            if args.host_profile:
                for name, layer in layers.items():
                    prof_rows.append(f"### {name}, M = {m}\n\n```\n{cprofile_text(functools.partial(layer, x))}```")
            base = statistics.median(samples["nn.Linear"])
            for name, values in samples.items():
                us = statistics.median(values)
                rows.append({"layer": name, "M": m, "K": k, "N": n, "host_us": us, "ratio_nn_linear": us / base,
                             "backend": getattr(layers[name], "backends_text", "-")})
    return rows, prof_rows


def cprofile_text(fn: Callable[[], Any], calls: int = 300) -> str:
    """The 20 functions with the most own time over ``calls`` calls of ``fn`` (cProfile), blank lines dropped."""
    from bench.host_cost import profile_text

    text = profile_text(fn, calls, top=20)
    return "\n".join(line for line in text.splitlines() if line.strip()) + "\n"


def _inductor_static_launch() -> Any:
    try:
        from torch._inductor import config

        return getattr(config, "static_launch_user_defined_triton_kernels", None)
    except ImportError:
        return None


def step_profile_text(fn: Callable[[], Any], calls: int = 20) -> str:
    """cProfile of ``calls`` calls of a model step (after 10 warm-up calls; a decode step appends one token per
    call, so the caller rewinds its cache around this): the 30 functions with the most own time."""
    from bench.host_cost import profile_text

    return "\n".join(line for line in profile_text(fn, calls, top=30).splitlines() if line.strip()) + "\n"


# ------------------------------------------------------------------------------------------------ accuracy
def accuracy(models: dict[str, Any], tokens: int, device: str) -> dict[str, dict[str, float]]:
    if "bf16" not in models:
        return {}
    ids = torch.randint(0, models["bf16"].config.vocab_size, (1, tokens), device=device)
    with torch.no_grad():
        ref = models["bf16"](ids, use_cache=False).logits.float()
        out: dict[str, dict[str, float]] = {}
        for name, model in models.items():
            if name == "bf16":
                continue
            got = model(ids, use_cache=False).logits.float()
            out[name] = {"rel_err": ((got - ref).norm() / ref.norm()).item(),
                         "top1_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    return out


# ------------------------------------------------------------------------------------------------ report
def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def render(result: dict[str, Any]) -> list[str]:
    lines = common.header_markdown(result["header"], f"Hugging Face {result['model']} ({result['layers']} layers)")
    lines += ["", "µs per forward (median of interleaved rounds; CUDA events around each call), with the time one "
              "call takes to return in parentheses (after a sync: the host's cost when the GPU keeps up). Ratios "
              "are to bf16 and torchao float8 measured in the same rounds: the median of the rounds' ratios, "
              "their range in parentheses; < 1 is faster.", ""]
    names = list(dict.fromkeys(v for row in result["rows"] for v in row["us"]))
    names.sort(key=lambda v: (VARIANTS.index(variant_base(v)), v))
    header = ["workload", "mode", *names]
    for v in names:
        if v not in ("bf16",):
            header.append(f"{v}/bf16")
    for v in names:
        if is_fp8(v) and "torchao" in names:
            header.append(f"{v}/torchao")
    rows = []
    for row in result["rows"]:
        us = row["us"]
        cells = [row["workload"], row["mode"], *[common.fmt(us.get(v), ".0f") for v in names]]
        host = row.get("host_us") or {}
        cells[2:] = [c + (f" (host {host[v]:.0f})" if v in host else "") for c, v in zip(cells[2:], names)]
        cells += [ratio_cell(row, v, "bf16") for v in names if v != "bf16"]
        cells += [ratio_cell(row, v, "torchao") for v in names if is_fp8(v) and "torchao" in names]
        rows.append(cells)
    lines += common.md_table(header, rows)
    profiled = [r for r in result["rows"] if r.get("profile")]
    if profiled:
        lines += ["", "Kernels per step (torch.profiler, one call): count / summed GPU µs:", ""]
        lines += common.md_table(["workload", "mode", *names],
                                 [[r["workload"], r["mode"], *[
                                     (f"{p['kernels']} / {p['kernel_us']:.0f}" if (p := r["profile"].get(v)) else "-")
                                     for v in names]] for r in profiled])
    if result.get("host"):
        lines += ["", "Host µs per call of one linear layer (calls enqueued while the GPU is busy), median of rounds:",
                  ""]
        lines += common.md_table(["layer", "M", "K x N", "host µs", "ratio to nn.Linear", "provider"],
                                 [[h["layer"], h["M"], f"{h['K']}x{h['N']}", common.fmt(h["host_us"], ".1f"),
                                   common.fmt(h["ratio_nn_linear"], ".2f"), h["backend"]] for h in result["host"]])
    if result.get("host_profile"):
        lines += ["", "cProfile of the layer calls (300 calls, by own time):", "", *result["host_profile"]]
    for row in result["rows"]:
        for v, text in (row.get("step_profile") or {}).items():
            title = f"### cProfile of 20 `{row['workload']}` / {row['mode']} steps: `{v}`"
            lines += ["", title, "", "```", text, "```"]
    if result.get("accuracy"):
        lines += ["", f"Logits against bf16 ({result['check_tokens']}-token prefill, every position):", ""]
        lines += common.md_table(["variant", "relative error", "top-1 agreement"],
                                 [[v, common.fmt(a["rel_err"], ".4f"), common.fmt(a["top1_agree"], ".3f")]
                                  for v, a in result["accuracy"].items()])
    if result.get("notes"):
        lines += ["", "Variants:", ""] + [f"- `{v}`: {json.dumps(n)}" for v, n in result["notes"].items()]
    if result.get("errors"):
        lines += ["", "Errors:", ""] + [f"- `{k}`: {e}" for k, e in result["errors"].items()]
    return lines


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in result["rows"] if "bf16" in r["us"]]
    variants = [v for v in dict.fromkeys(v for r in rows for v in r["us"]) if v != "bf16"]
    if not rows or not variants:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        ax.bar([j + i * width for j in range(len(rows))],
               [row_ratio(r, v, "bf16") or 0 for r in rows], width, label=v)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['workload']}\n{r['mode']}" for r in rows], fontsize=8)
    ax.set_ylabel("time / bf16 (lower is faster)")
    ax.set_title(f"{result['model']}, {result['layers']} layers, {result['header']['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class Bench:
    """One process's models, compiled copies and decode states (every variant, or one with ``--worker``)."""

    def __init__(self, args: Any) -> None:
        from fp8_backends.registry.platform import detect_platform

        self.args = args
        args.out.mkdir(parents=True, exist_ok=True)
        self.header = common.run_header(detect_platform(args.device), args.device)
        for dist in ("transformers", "torchao"):
            self.header["versions"][dist] = common.dist_version(dist)
        self.names = [v for v in args.variants if v != "torchao" or importlib.util.find_spec("torchao") is not None]
        self.modes = [m for m in args.modes if m != "graph" or args.device == "cuda"]
        self.max_len = max([*args.prefill, args.context + 64, args.check_tokens]) + 16  # decode: rewound every <= 48
        self.base = build_model(args.model, args.layers, args.device, args.small, self.max_len)
        calib = torch.randint(0, self.base.config.vocab_size, (1, 512 if not args.small else 16), device=args.device)
        self.models, notes = make_variants(self.base, self.names, calib, args.static_launch == "on")
        self.header["inductor_static_launch_user_kernels"] = _inductor_static_launch()
        self.header["gc_freeze"] = bool(args.gc_freeze)
        self.result: dict[str, Any] = {"header": self.header, "model": args.model, "layers": args.layers,
                                       "small": args.small, "rows": [], "notes": notes, "errors": {},
                                       "check_tokens": args.check_tokens}
        log(f"variants: {', '.join(self.models)}; modes: {', '.join(self.modes)}")

    def checks(self) -> None:
        """The logits check and the host table (before any compile)."""
        args = self.args
        self.result["accuracy"] = accuracy(self.models, args.check_tokens, args.device) if args.check_tokens else {}
        self.result["host"], self.result["host_profile"] = host_cost(args) if args.host_rounds else ([], [])

    def compile(self) -> None:
        args = self.args
        self.compiled = {name: compile_model(model, args.compile_scope) for name, model in self.models.items()}
        self.decode = {} if args.no_decode else {
            name: DecodeState(model, args.context, self.max_len, args.device) for name, model in self.models.items()}

    def rows(self) -> list[tuple[str, str]]:
        """``(workload, mode)`` in measuring order."""
        workloads = ([] if self.args.no_decode else ["decode"]) + [f"prefill{t}" for t in self.args.prefill]
        return [(w, m) for w in workloads for m in self.modes if m != "graph" or w == "decode"]

    def steps(self, workload: str, mode: str) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], None]]]:
        rewinds: dict[str, Callable[[], None]] = {}
        steps = build_steps(self.models, self.compiled, workload, mode, self.args, self.decode,
                            self.result["errors"], rewinds)
        return steps, rewinds

    def profiles(self, row: dict[str, Any], steps: dict[str, Callable[[], Any]],
                 rewinds: dict[str, Callable[[], None]]) -> None:
        """``--profile`` / ``--step-profile`` of this row's steps, into ``row``."""
        args, mode = self.args, row["mode"]
        if args.profile and mode != "eager":
            row.setdefault("profile", {})
            for name, fn in steps.items():
                rewinds.get(name, _nothing)()
                row["profile"][name] = kernel_profile(fn, args.device)
        if args.step_profile and mode == "compiled":
            row.setdefault("step_profile", {})
            for name, fn in steps.items():
                rewinds.get(name, _nothing)()
                row["step_profile"][name] = step_profile_text(fn)
                rewinds.get(name, _nothing)()

    def write(self, final: bool = False) -> None:
        out_base = self.args.out / f"hf_model_{self.args.model}"
        common.write_json(out_base.with_suffix(".json"), self.result)
        if final:
            common.write_markdown(out_base.with_suffix(".md"), render(self.result))  # written and printed
            plot(self.result, out_base.with_suffix(".png"))
        else:  # a run cut by its time limit keeps its table too (printed once, at the end)
            out_base.with_suffix(".md").write_text("\n".join(render(self.result)) + "\n", encoding="utf-8")
