"""Benchmark: FP8 checkpoints served by the library against bf16 and against ``transformers``' own loading.

One Llama-3-8B-sized model (hidden 4096, intermediate 14336, 32 / 8 heads, ``--layers`` of them, vocabulary 32000,
random weights: nothing is downloaded; ``--model qwen3``: Qwen3-8B's layer sizes, the models that ship block-wise FP8
checkpoints; ``--model qwen3_moe``: Qwen3-30B-A3B's, a MoE model whose experts are written one by one as its FP8
checkpoint stores them, ``hf_block`` only) is written to ``--ckpt-dir`` (local disk) once in bf16 and once per format,
each file by file in shards of ``--shard-gib`` with an index, in the layout its producer writes:

- ``modelopt``: ModelOpt FP8 (``hf_quant_config.json``; per-tensor weights, static per-tensor input scales);
- ``ct_fp8``: compressed-tensors ``FP8`` (per-tensor weights, static input; bf16 scales as compressed-tensors stores);
- ``ct_dynamic``: compressed-tensors ``FP8_DYNAMIC`` (per-channel weights ``[N, 1]``, dynamic per-token input);
- ``ct_block``: compressed-tensors ``FP8_BLOCK`` (128x128 blocks, dynamic per-token groups of 128);
- ``hf_block``: Hugging Face ``fp8`` (``weight_block_size [128, 128]``, ``weight_scale_inv``).

Static input scales come from one calibration batch through the bf16 model. Variants, all in one process:

- ``bf16``: ``transformers.AutoModelForCausalLM.from_pretrained`` of the bf16 checkpoint;
- ``<format>/lib``: ``fp8_backends.load_pretrained`` of the format's checkpoint;
- ``<format>/hf``: ``transformers``' own loading of the same checkpoint where it has one (compressed-tensors, ``fp8``;
  not ModelOpt): what a user has without the library. Its ``fp8`` GEMM on a GPU is the hub kernel
  ``kernels-community/finegrained-fp8`` (the ``kernels`` package downloads it at first use): on a machine without
  the network that variant is reported as an error, unless ``--finegrained-fp8 DIR`` names a local copy of that
  package (:func:`bench.hf_bench.install_finegrained_fp8`; the copy is not part of this project).

Workloads and modes as ``bench/hf_model.py`` (its step builders and its interleaved rounds): prefill of ``T`` tokens
(``--prefill``) and one-token decode at ``--context``, eager, ``torch.compile`` and (decode) compiled in a CUDA graph.
Load time and peak host memory (``ru_maxrss``) of each loader are measured in a fresh process per load (``--load-runs``
runs, median), with the GPU memory the model holds: ``transformers`` loading the bf16 checkpoint is the reference.

    python -m bench.checkpoints --ckpt-dir /tmp/fp8ckpt --out bench/results/<date>-h200/checkpoints
    python -m bench.checkpoints --formats ct_dynamic --modes compiled graph --prefill 512 2048 --out DIR
    python -m bench.checkpoints --device cpu --small --modes eager --prefill 16 --out /tmp/ck   # CPU smoke test
    python -m bench.checkpoints --formats ct_dynamic --modes graph --no-decode --prefill --profile-load --out DIR
        # where a load spends its time: one more load per loader under cProfile, DIR/load-profile-<format>-<loader>.txt
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench import common
from bench import hf_bench as hf

FORMATS = ("modelopt", "ct_fp8", "ct_dynamic", "ct_block", "hf_block")
#: formats transformers loads itself (its compressed-tensors and fp8 integrations)
HF_LOADS = ("ct_fp8", "ct_dynamic", "ct_block", "hf_block")
SKIP = ("lm_head", "embed")
#: ``--model`` -> the model whose layer sizes it has (folder names and titles)
MODEL_NAMES = {"llama": "llama3-8b", "qwen3": "qwen3-8b", "qwen3_moe": "qwen3-30b-a3b"}
MODEL_TITLES = {"llama": "Llama-3-8B", "qwen3": "Qwen3-8B", "qwen3_moe": "Qwen3-30B-A3B"}
#: formats a MoE model is written in (its experts one by one, as the block-wise checkpoints ship them; the static
#: formats would need every expert's calibrated input scale)
MOE_FORMATS = ("hf_block",)


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------------------------ checkpoints
def write_shards(state: dict[str, torch.Tensor], folder: Path, shard_bytes: int) -> None:
    """``state`` as ``model-0000i-of-0000n.safetensors`` files of about ``shard_bytes`` each, with the index."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        t = state[name]
        n = t.numel() * t.element_size()
        if size and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous().cpu()
        size += n
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def _quantized(fmt: str, w: torch.Tensor, amax: float) -> dict[str, torch.Tensor]:
    """One linear's tensors (``weight`` first) in ``fmt``'s layout."""
    from fp8_backends.core import reference

    w = w.float()
    n, k = w.shape
    if fmt in ("ct_block", "hf_block"):
        pad = torch.nn.functional.pad(w, (0, -k % 128, 0, -n % 128))
        amax_b = pad.reshape(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128).abs().amax((1, 3))
        scale = (amax_b / 448.0).clamp_min(1e-12)
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        if fmt == "hf_block":
            return {"weight": q, "weight_scale_inv": scale}
        return {"weight": q, "weight_scale": scale.to(torch.bfloat16)}
    if fmt == "ct_dynamic":
        q, s = reference.quantize_per_token(w)
        return {"weight": q, "weight_scale": s.reshape(n, 1).to(torch.bfloat16)}
    q, s = reference.quantize_dynamic_per_tensor(w)
    x_s = torch.tensor([max(amax / 448.0, 1e-12)])
    if fmt == "modelopt":
        return {"weight": q, "weight_scale": s.reshape(()), "input_scale": x_s.reshape(())}
    return {"weight": q, "weight_scale": s.to(torch.bfloat16), "input_scale": x_s.to(torch.bfloat16)}


def _ct_args(strategy: str, dynamic: bool, **extra: Any) -> dict[str, Any]:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic,
            "group_size": None, **extra}


def quant_config(fmt: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``(config.json's quantization_config, hf_quant_config.json)`` of ``fmt``."""
    if fmt == "modelopt":
        return None, {"producer": {"name": "modelopt", "version": "layout"},
                      "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                       "exclude_modules": ["lm_head", "model.embed_tokens"]}}
    if fmt == "hf_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}, None
    weights, inputs = {
        "ct_fp8": (_ct_args("tensor", False), _ct_args("tensor", False)),
        "ct_dynamic": (_ct_args("channel", False), _ct_args("token", True)),
        "ct_block": (_ct_args("block", False, block_structure=[128, 128]), _ct_args("group", True, group_size=128)),
    }[fmt]
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}}, None


def build_model(args: Any) -> Any:
    """The bf16 ``--model`` of ``bench/hf_model.py`` (``--small``: a Llama of hidden 256, so that 128x128 blocks
    fit)."""
    import transformers

    if not args.small:
        return hf.build_model(args.model, args.layers, args.device, False, 4096)
    if args.model == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
                                             num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=64, num_hidden_layers=args.layers,
                                             vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)
        torch.manual_seed(0)
        with torch.device(args.device):
            return transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=384, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, num_hidden_layers=args.layers,
                                      vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(args.device):
        return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def write_checkpoints(args: Any) -> dict[str, Path]:
    """``{"bf16": folder, fmt: folder}``: written once (a folder with its ``config.json`` is reused)."""
    small = "small" if args.model == "llama" else f"small-{MODEL_NAMES[args.model]}"
    root = args.ckpt_dir / (small if args.small else f"{MODEL_NAMES[args.model]}-{args.layers}l")
    folders = {name: root / name for name in ("bf16", *args.formats)}
    if all((f / "config.json").is_file() for f in folders.values()):
        return folders
    model = build_model(args)
    amax: dict[str, float] = {}

    def hook(name: str) -> Any:
        def record(_m: Any, a: tuple) -> None:
            amax[name] = max(amax.get(name, 0.0), float(a[0].detach().abs().amax()))
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (1, 512 if not args.small else 16), device=args.device))
    for h in handles:
        h.remove()
    for q, k, v in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj", "up_proj")):  # siblings share input
        for name in list(amax):
            if name.endswith(q):
                group = [name[: -len(q)] + leaf for leaf in (q, k, v)]
                top = max(amax[g] for g in group)
                amax.update({g: top for g in group})
    state = model.state_dict()
    experts = per_expert_state(state)  # the layout the FP8 checkpoints of MoE models ship
    shard_bytes = int(args.shard_gib * 2**30)
    for name, folder in folders.items():
        if (folder / "config.json").is_file():
            continue
        t0 = time.perf_counter()
        if name == "bf16":
            out = state
        else:
            out = {}
            for key, t in experts.items():
                module = key.rpartition(".")[0]
                linear = module in amax or key not in state  # a Linear, or one expert's (only block formats)
                if key.endswith(".weight") and linear and not any(s in key for s in SKIP):
                    tensors = _quantized(name, t, amax.get(module, 0.0))
                    out.update({f"{module}.{leaf}": v for leaf, v in tensors.items()})
                else:
                    out[key] = t
        write_shards(out, folder, shard_bytes)
        config = model.config.to_dict()
        qc, hf_quant = ({}, None) if name == "bf16" else quant_config(name)
        if qc:
            config["quantization_config"] = qc
        config["architectures"] = [type(model).__name__]
        (folder / "config.json").write_text(json.dumps(config, indent=1, default=str))
        if hf_quant is not None:
            (folder / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=1))
        log(f"wrote {folder} in {time.perf_counter() - t0:.1f} s")
    del model, state
    gc.collect()
    return folders


def per_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each MoE layer's 3-D ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj``
    ``[E, H, I]`` split into ``experts.<e>.{gate,up,down}_proj.weight`` (unchanged for a dense model)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "gate_up_proj" and t.dim() == 3:
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, 0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
        elif leaf == "down_proj" and t.dim() == 3:
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[key] = t
    return out


# ------------------------------------------------------------------------------------------------ loading
def load(kind: str, folder: Path, device: str) -> tuple[Any, dict[str, Any]]:
    """``(model, notes)``: ``kind`` ``lib`` (load_pretrained), ``hf`` (transformers' own) or ``bf16``."""
    if kind == "lib":
        from fp8_backends import load_pretrained

        model, summary = load_pretrained(folder, device=device)
        return model, {"gemms": summary.gemms, "schemes": summary.schemes(), "providers": summary.providers(),
                       "requantized": len(summary.requantized), "kept": len(summary.kept),
                       "phases": {k: round(v, 4) for k, v in summary.load_phases.items()}}
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                              device_map=device).eval()
    return model, {"class": type(model.model.layers[0].self_attn.q_proj).__name__}


def measure_load(kind: str, folder: Path, device: str, profile: Path | None = None) -> dict[str, Any]:
    """One load in this process: seconds, peak host memory (``ru_maxrss``), GPU memory held after. ``profile``: also
    run the load under cProfile and write its costliest calls (45 by cumulative, 25 by own time) to that file."""
    import transformers

    import fp8_backends.checkpoints.pretrained  # noqa: F401 - imported before the clock starts, as an engine has it

    _ = transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # transformers' lazy modules, imported too

    if device == "cuda":
        torch.cuda.init()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    profiler = None
    if profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    t0 = time.perf_counter()
    model, notes = load(kind, folder, device)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(25)
        profile.parent.mkdir(parents=True, exist_ok=True)
        profile.write_text(f"{kind} load of {folder}: {seconds:.3f} s (profiled)\n" + text.getvalue(), encoding="utf-8")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = torch.cuda.memory_allocated() if device == "cuda" else None
    del model
    return {"seconds": seconds, "peak_rss_gib": peak / 2**20, "rss_before_gib": base / 2**20,
            "gpu_held_gib": None if held is None else held / 2**30, "phases": notes.get("phases")}


def load_table(args: Any, folders: dict[str, Path]) -> list[dict[str, Any]]:
    """Each loader in ``--load-runs`` fresh processes, in turns."""
    jobs = [("bf16", "hf", folders["bf16"])]
    for fmt in args.formats:
        jobs.append((fmt, "lib", folders[fmt]))
        if fmt in HF_LOADS and "hf" in args.loaders:
            jobs.append((fmt, "hf", folders[fmt]))
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(f, k): [] for f, k, _ in jobs}
    for _ in range(args.load_runs):
        for fmt, kind, folder in jobs:
            cmd = [sys.executable, "-m", "bench.checkpoints", "--measure-load", kind, str(folder), "--device",
                   args.device, "--out", str(args.out)]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
            line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
            if proc.returncode != 0 or line is None:
                runs[(fmt, kind)].append({"error": (proc.stderr or proc.stdout)[-400:]})
            else:
                runs[(fmt, kind)].append(json.loads(line))
    if args.profile_load:  # one more load per loader under cProfile, outside the timed runs
        for fmt, kind, folder in jobs:
            subprocess.run([sys.executable, "-m", "bench.checkpoints", "--measure-load", kind, str(folder), "--device",
                            args.device, "--out", str(args.out), "--profile-load",
                            str(args.out / f"load-profile-{fmt}-{kind}.txt")],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    rows = []
    for (fmt, kind), got in runs.items():
        ok = [r for r in got if "error" not in r]
        row: dict[str, Any] = {"format": fmt, "loader": kind, "runs": len(ok)}
        if ok:
            for key in ("seconds", "peak_rss_gib", "gpu_held_gib"):
                values = [r[key] for r in ok if r[key] is not None]
                row[key] = statistics.median(values) if values else None
            phases = [r["phases"] for r in ok if r.get("phases")]
            if phases:
                row["phases"] = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
        else:
            row["error"] = got[0]["error"] if got else "not run"
        rows.append(row)
    base = runs[("bf16", "hf")]
    for row in rows:  # per turn (the host's speed drifts between turns), then the median over turns
        ratios = [r["seconds"] / b["seconds"] for r, b in zip(runs[(row["format"], row["loader"])], base, strict=True)
                  if "error" not in r and "error" not in b]
        if ratios:
            row["seconds_vs_bf16"] = statistics.median(ratios)
    return rows


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> Any:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--loaders", nargs="+", default=["lib", "hf"], choices=["lib", "hf"],
                   help="hf: also transformers' own loading of the formats it reads")
    p.add_argument("--model", choices=sorted(MODEL_NAMES), default="llama",
                   help="layer sizes: Llama-3-8B (default), Qwen3-8B (the block-wise FP8 checkpoints' models) or "
                        "Qwen3-30B-A3B (a MoE model; hf_block only, its experts written one by one)")
    p.add_argument("--finegrained-fp8", type=Path, default=None, metavar="DIR",
                   help="a local copy of the hub kernel package transformers' fp8 path runs (finegrained_fp8), for a "
                        "machine without the network")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/fp8_backends_checkpoints"))
    p.add_argument("--shard-gib", type=float, default=2.0)
    p.add_argument("--prefill", nargs="*", type=int, default=[512, 2048])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--modes", nargs="+", default=["eager", "compiled", "graph"], choices=["eager", "compiled", "graph"])
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--compile-scope", choices=["layers", "model"], default="model")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--step-host-calls", type=int, default=3)
    p.add_argument("--load-runs", type=int, default=2, help="fresh processes per loader (0: no load table)")
    p.add_argument("--check-tokens", type=int, default=64, help="logits of each variant against bf16 (0: none)")
    p.add_argument("--gc-freeze", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="also list the kernels of one step per variant (compiled / graph rows; torch.profiler)")
    p.add_argument("--step-profile", action="store_true",
                   help="also profile the host side of 20 compiled steps per variant (cProfile, 30 costliest by own "
                        "time)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny layers (CPU smoke test)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--measure-load", nargs=2, metavar=("KIND", "FOLDER"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--profile-load", nargs="?", const=True, default=None,
                   help="profile one more load per loader (cProfile: 45 costliest calls by cumulative, 25 by own "
                        "time) into --out/load-profile-*.txt")
    args = p.parse_args(argv)
    if args.model == "qwen3_moe":
        extra = sorted(set(args.formats) - set(MOE_FORMATS))
        if extra and args.formats != list(FORMATS):
            p.error(f"--model {args.model} is written in {', '.join(MOE_FORMATS)} only, not {', '.join(extra)}")
        args.formats = [f for f in args.formats if f in MOE_FORMATS]
    return args


def render(result: dict[str, Any]) -> list[str]:
    model = MODEL_TITLES[result.get("model", "llama")]
    lines = common.header_markdown(result["header"], f"FP8 checkpoints, {model} layers x {result['layers']}")
    names = list(dict.fromkeys(v for row in result["rows"] for v in row["us"]))
    lines += ["", "µs per step (median of interleaved rounds; host µs in parentheses), ratio to bf16 and to "
              "transformers' own loading of the same checkpoint (`/hf`): the median of the rounds' ratios, their "
              "range in parentheses; < 1 is faster.", ""]
    header = ["workload", "mode", *names] + [f"{v}/bf16" for v in names if v != "bf16"] + \
        [f"{v}/{v.split('/')[0]}/hf" for v in names if v.endswith("/lib")]
    rows = []
    for row in result["rows"]:
        us, host = row["us"], row.get("host_us") or {}
        cells = [row["workload"], row["mode"]]
        cells += [common.fmt(us.get(v), ".0f") + (f" ({host[v]:.0f})" if v in host else "") for v in names]
        cells += [hf.ratio_cell(row, v, "bf16") for v in names if v != "bf16"]
        cells += [hf.ratio_cell(row, v, v.split("/")[0] + "/hf") for v in names if v.endswith("/lib")]
        rows.append(cells)
    lines += common.md_table(header, rows)
    for row in result["rows"]:
        for v, prof in (row.get("profile") or {}).items():
            if prof:
                lines += ["", f"Kernels of one `{row['workload']}` / {row['mode']} step of `{v}` (torch.profiler): "
                          f"{prof['kernels']} kernels, {prof['kernel_us']:.0f} µs; the largest by total time:", ""]
                lines += common.md_table(["kernel", "count", "µs"], [[k["name"], k["count"], f"{k['us']:.1f}"]
                                                                      for k in prof["all"][:15]])
    for row in result["rows"]:
        for v, text in (row.get("step_profile") or {}).items():
            lines += ["", f"Host side of 20 `{row['workload']}` / {row['mode']} steps of `{v}` (cProfile, by own "
                      "time):", "", "```", text.rstrip(), "```"]
    if result.get("load"):
        lines += ["", "Loading (a fresh process per load, loaders in turns, median of runs; `x bf16 load`: the median "
                  "over turns of the load's time over the bf16 load's in the same turn; peak host memory is the "
                  "process's maximum resident set):", ""]
        lines += common.md_table(["format", "loader", "seconds", "x bf16 load", "peak host GiB", "GPU GiB held",
                                  "phases (s)"],
                                 [[r["format"], r["loader"], common.fmt(r.get("seconds"), ".2f"),
                                   common.fmt(r.get("seconds_vs_bf16"), ".2f"),
                                   common.fmt(r.get("peak_rss_gib"), ".2f"), common.fmt(r.get("gpu_held_gib"), ".2f"),
                                   ", ".join(f"{k} {v:.2f}" for k, v in (r.get("phases") or {}).items()) or "-"]
                                  for r in result["load"]])
    if result.get("accuracy"):
        lines += ["", "Logits against bf16:", ""]
        lines += common.md_table(["variant", "relative error", "top-1 agreement"],
                                 [[v, common.fmt(a["rel_err"], ".4f"), common.fmt(a["top1_agree"], ".3f")]
                                  for v, a in result["accuracy"].items()])
    if result.get("notes"):
        lines += ["", "Variants:", ""] + [f"- `{v}`: {json.dumps(n)}" for v, n in result["notes"].items()]
    if result.get("errors"):
        lines += ["", "Errors:", ""] + [f"- `{k}`: {e}" for k, e in result["errors"].items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure_load is not None:
        kind, folder = args.measure_load
        profile = Path(args.profile_load) if isinstance(args.profile_load, str) else None
        print(json.dumps(measure_load(kind, Path(folder), args.device, profile)), flush=True)
        return 0
    from fp8_backends.registry.platform import detect_platform

    args.out.mkdir(parents=True, exist_ok=True)
    header = common.run_header(detect_platform(args.device), args.device)
    for dist in ("transformers", "compressed-tensors", "safetensors"):
        header["versions"][dist] = common.dist_version(dist)
    folders = write_checkpoints(args)
    result: dict[str, Any] = {"header": header, "model": args.model, "layers": args.layers, "small": args.small,
                              "rows": [], "notes": {}, "errors": {}}
    if args.finegrained_fp8 is not None:  # transformers' fp8 kernel: where the local copy came from
        header["versions"]["finegrained-fp8"] = hf.install_finegrained_fp8(args.finegrained_fp8)
    result["load"] = load_table(args, folders) if args.load_runs else []
    models: dict[str, Any] = {}
    for name, kind, folder in [("bf16", "hf", folders["bf16"])] + [
            (f"{fmt}/{kind}", kind, folders[fmt]) for fmt in args.formats for kind in args.loaders
            if kind == "lib" or fmt in HF_LOADS]:
        try:
            models[name], result["notes"][name] = load(kind, folder, args.device)
        except Exception as exc:  # keep going: the variant is reported missing
            result["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"{name}: {result['errors'][name]}")
    if args.check_tokens:
        result["accuracy"] = {}
        for name in list(models):
            if name == "bf16":
                continue
            try:
                result["accuracy"].update(hf.accuracy({"bf16": models["bf16"], name: models[name]}, args.check_tokens,
                                                      args.device))
            except Exception as exc:  # a variant that cannot run drops out of the timing too
                result["errors"][f"{name}/accuracy"] = f"{type(exc).__name__}: {exc}"[:500]
                del models[name]
    compiled = {name: hf.compile_model(m, args.compile_scope) for name, m in models.items()} \
        if {"compiled", "graph"} & set(args.modes) else {name: m for name, m in models.items()}
    modes = [m for m in args.modes if m != "graph" or args.device == "cuda"]
    max_len = max([*args.prefill, args.context + 64]) + 16
    decode: dict[str, Any] = {}
    for name in [] if args.no_decode else list(models):
        try:  # fills the cache with the context: the variant's first forward
            decode[name] = hf.DecodeState(models[name], args.context, max_len, args.device)
        except Exception as exc:  # a variant that cannot run (transformers' fp8 kernel offline) drops out
            result["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
            log(f"{name}: {result['errors'][name]}")
            del models[name]
            compiled.pop(name, None)
    workloads = ([] if args.no_decode else ["decode"]) + [f"prefill{t}" for t in args.prefill]
    out_base = args.out / "checkpoints"
    for workload in workloads:
        for mode in modes:
            if mode == "graph" and workload != "decode":
                continue
            log(f"{workload} / {mode}")
            rewinds: dict[str, Any] = {}
            steps = hf.build_steps(models, compiled, workload, mode, args, decode, result["errors"], rewinds)
            row = {"workload": workload, "mode": mode, **hf.time_steps(steps, args, mode != "graph", rewinds)}
            if args.profile and mode != "eager":
                row["profile"] = {}
                for name, fn in steps.items():
                    rewinds.get(name, lambda: None)()
                    row["profile"][name] = hf.kernel_profile(fn, args.device)
            if args.step_profile and mode == "compiled":
                row["step_profile"] = {}
                for name, fn in steps.items():
                    rewinds.get(name, lambda: None)()
                    row["step_profile"][name] = hf.step_profile_text(fn)
            result["rows"].append(row)
            us = row["us"]
            log("  " + ", ".join(f"{k} {v:.0f} µs" for k, v in us.items()))
            del steps
            gc.collect()
            common.write_json(out_base.with_suffix(".json"), result)
    common.write_json(out_base.with_suffix(".json"), result)
    common.write_markdown(out_base.with_suffix(".md"), render(result))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
