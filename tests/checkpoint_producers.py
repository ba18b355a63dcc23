"""Small random FP8 checkpoints for the tests, written by the libraries that write the real ones, and their fp32
reference.

- :func:`compressed_tensors_checkpoint`: compressed-tensors' own ``apply_quantization_config`` + ``ModelCompressor``
  (``float-quantized``), weight scales from its ``calculate_qparams`` over each weight's min/max (what an observer
  feeds it), static input scales from a calibration batch;
- :func:`modelopt_checkpoint`: ``nvidia-modelopt``'s ``mtq.quantize`` (calibrated on a batch) and
  ``export_hf_checkpoint`` (it runs on the CPU); :func:`modelopt_layout_checkpoint` writes the same documented layout
  without modelopt (for machines without it), and a test compares the two layouts where modelopt is installed;
- :func:`hf_fp8_checkpoint`: ``transformers``' own ``FP8Linear`` modules (``replace_with_fp8_linear``) filled by its
  ``Fp8Quantize`` op and written by ``save_pretrained`` (``transformers`` quantizes on the fly only on a GPU);
- :func:`reference_logits`: the checkpoint read back with ``safetensors`` and dequantized to fp32 (every weight
  ``w_q * scale``), activations fake-quantized as the scheme says (static scale, per token, per tensor, per group)
  unless ``quantize_activations=False``: what the served model must match.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

#: the tiny models: 2 layers, hidden 256 (two 128-blocks), head_dim 64 so that k/v are 128 rows
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}
VOCAB = 256
FUSE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def tiny_model(arch: str = "llama", intermediate: int = 384, seed: int = 0) -> torch.nn.Module:
    import transformers

    cfg_name, cls_name, extra = ARCHS[arch]
    config = getattr(transformers, cfg_name)(
        hidden_size=256, intermediate_size=intermediate, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False,
        architectures=[cls_name], **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).to(torch.bfloat16).eval()
    with torch.no_grad():  # spread the weights so that blocks and channels get different scales
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(torch.exp(torch.randn(p.shape[0], 1) * 0.5).to(p.dtype))
    return model


def calibration_ids(n: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------------ compressed-tensors
def compressed_tensors_checkpoint(path: Path, preset: str, arch: str = "llama", intermediate: int = 384,
                                  scale_dtype: torch.dtype | None = None) -> Path:
    """A compressed-tensors checkpoint of ``preset`` (``FP8``, ``FP8_DYNAMIC``, ``FP8_BLOCK``) written by its
    ``ModelCompressor``. ``scale_dtype``: store the scales in this dtype (default: the weights' bf16, as
    compressed-tensors does)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = tiny_model(arch, intermediate)
    amax = _input_amax(model)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for name, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None:
                continue
            w = module.weight.float()
            args = scheme.weights
            if args.strategy == "tensor":
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            elif args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            else:
                bn, bk = args.block_structure
                n, k = w.shape
                pad = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn))
                r = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk)
                lo, hi = r.amin((1, 3)), r.amax((1, 3))
            scale, _ = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.to(module.weight_scale.dtype))
            if hasattr(module, "input_scale"):
                x = torch.tensor([amax[name]])
                scale, _ = calculate_qparams(-x, x, scheme.input_activations)
                module.input_scale.copy_(scale.to(module.input_scale.dtype))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    if scale_dtype is not None:
        for module in model.modules():
            for attr in ("weight_scale", "input_scale"):
                p = getattr(module, attr, None)
                if p is not None:
                    p.data = p.data.to(scale_dtype)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return path


def _input_amax(model: torch.nn.Module) -> dict[str, float]:
    """``{linear name: amax(|input|)}`` over a calibration batch."""
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(_m, args, name=name):
                amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().amax()))
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(calibration_ids())
    for h in hooks:
        h.remove()
    return amax


# ------------------------------------------------------------------------------------------------ ModelOpt
def modelopt_checkpoint(path: Path, algo: str = "FP8", arch: str = "llama") -> Path:
    """A ModelOpt checkpoint written by ``nvidia-modelopt`` (``FP8``: ``FP8_DEFAULT_CFG``,
    ``FP8_PER_CHANNEL_PER_TOKEN``, ``FP8_PB_WO``: ``FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG``)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    cfg = {"FP8": "FP8_DEFAULT_CFG", "FP8_PER_CHANNEL_PER_TOKEN": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
           "FP8_PB_WO": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"}[algo]
    model = tiny_model(arch)
    ids = calibration_ids()
    mtq.quantize(model, copy.deepcopy(getattr(mtq, cfg)), lambda m: m(ids))
    export_hf_checkpoint(model, export_dir=str(path))
    return path


def modelopt_layout_checkpoint(path: Path, algo: str = "FP8", arch: str = "llama") -> Path:
    """The layout ModelOpt's HF export documents, written without modelopt: ``hf_quant_config.json``
    (``quant_algo``, ``exclude_modules``), float8_e4m3fn weights with fp32 ``weight_scale`` (a scalar, or ``[N]`` per
    channel) and, for ``FP8``, a static fp32 scalar ``input_scale`` from a calibration batch (one for the siblings
    that share an input, as ModelOpt's export makes them)."""
    from safetensors.torch import save_file

    from fp8_backends.core import reference

    model = tiny_model(arch)
    amax = _input_amax(model)
    for parent in {n.rpartition(".")[0] for n in amax}:  # siblings share their input quantizer
        for group in FUSE_GROUPS:
            names = [f"{parent}.{leaf}" for leaf in group if f"{parent}.{leaf}" in amax]
            if len(names) == len(group):
                top = max(amax[n] for n in names)
                amax.update({n: top for n in names})
    state: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        module = name.rpartition(".")[0]
        if name.endswith(".weight") and module in amax and module != "lm_head":
            if algo == "FP8":
                q, s = reference.quantize_dynamic_per_tensor(t.float())
                state[f"{module}.weight_scale"] = s.reshape(())
                state[f"{module}.input_scale"] = torch.tensor(amax[module] / 448.0)
            else:
                q, s = reference.quantize_per_token(t.float())
                state[f"{module}.weight_scale"] = s.reshape(-1)
            state[name] = q
        else:
            state[name] = t.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    (path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt-layout (tests)", "version": "0"},
        "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                         "exclude_modules": ["lm_head", "model.embed_tokens"]}}, indent=2))
    return path


# ------------------------------------------------------------------------------------------------ Hugging Face fp8
def hf_fp8_checkpoint(path: Path, block: tuple[int, int] | None = (128, 128), act: str = "dynamic",
                      arch: str = "llama") -> Path:
    """An ``fp8`` checkpoint of ``transformers``' own ``FP8Linear`` modules quantized by its ``Fp8Quantize`` op and
    written by ``save_pretrained``; ``act="static"`` sets each ``activation_scale`` from a calibration batch."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, replace_with_fp8_linear

    model = tiny_model(arch)
    amax = _input_amax(model) if act == "static" else {}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    qc = FineGrainedFP8Config(weight_block_size=block, activation_scheme=act, modules_to_not_convert=["lm_head"])

    class Quantizer:
        quantization_config = qc

    op = Fp8Quantize(Quantizer())
    replace_with_fp8_linear(model, modules_to_not_convert=["lm_head"], quantization_config=qc)
    model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    new: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        module = model.get_submodule(key.rpartition(".")[0])
        if type(module).__name__ == "FP8Linear" and key.endswith(".weight"):
            for k, v in op.convert({key: value}).items():
                new[k] = v.reshape(params[k].shape)
            if act == "static":
                new[key.replace(".weight", ".activation_scale")] = torch.tensor(amax[key[:-7]] / 448.0)
        else:
            new[key] = value
    model.load_state_dict(new, strict=True)
    model.config.quantization_config = qc
    model.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------------ edits
def edit_checkpoint(src: Path, dst: Path, *, drop: tuple[str, ...] = (), put: dict[str, torch.Tensor] | None = None,
                    config: dict | None = None, quant_config: dict | None = None) -> Path:
    """A copy of the one-file checkpoint ``src`` with tensors dropped or replaced (``put``) and ``config.json``'s /
    ``hf_quant_config.json``'s top-level keys replaced (a value None deletes the key)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    for name in drop:
        del state[name]
    state.update(put or {})
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for file, changes in (("config.json", config), ("hf_quant_config.json", quant_config)):
        if changes:
            data = json.loads((dst / file).read_text())
            for key, value in changes.items():
                if value is None:
                    data.pop(key, None)
                else:
                    data[key] = value
            (dst / file).write_text(json.dumps(data))
    return dst


# ------------------------------------------------------------------------------------------------ the reference
def reference_logits(path: Path, ids: torch.Tensor, act: str, *, group_size: int = 128,
                     quantize_activations: bool = True, dtype: torch.dtype = torch.float32,
                     device: str = "cpu") -> torch.Tensor:
    """Logits of the checkpoint at ``path`` computed from its tensors read back with ``safetensors`` (module
    docstring). ``act``: ``static``, ``dynamic`` (per tensor), ``token`` or ``group``.

    ``dtype=torch.float32``: every FP8 weight dequantized to fp32 (``w_q * scale``), activations fake-quantized in
    fp32 (or not, ``quantize_activations=False``). ``dtype=torch.bfloat16``: the model in bf16 with every FP8 linear
    computed by :func:`fp8_backends.core.reference.fp8_gemm` on the stored ``w_q`` and scales, activations quantized
    by the reference quantizers: the served semantics in the model dtype (what the library's layers must match up to
    summation order). Static input scales of siblings that share an input are their maximum (a fused layer's).
    ``device``: where the model runs (the GPU tests compare against the same kernels' bf16 model); the logits come
    back on the CPU."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0])._from_config(config, dtype=dtype).eval().to(device)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    dense: dict[str, torch.Tensor] = {}
    fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    input_scales: dict[str, float] = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dtype == torch.float8_e4m3fn:
            scale = state.get(f"{module}.weight_scale", state.get(f"{module}.weight_scale_inv")).float()
            fp8[module] = (t.to(device), scale.to(device))
            dense[name] = _dequantize(t, scale).to(dtype)
            for leaf_in in ("input_scale", "activation_scale"):
                if f"{module}.{leaf_in}" in state:
                    input_scales[module] = float(state[f"{module}.{leaf_in}"].float().reshape(()))
        elif t.is_floating_point() and t.dtype.itemsize >= 2:
            dense[name] = t.to(dtype)
    model.load_state_dict(dense, strict=False)
    for module in list(input_scales):  # fused siblings serve their largest input scale
        parent, _, leaf = module.rpartition(".")
        for group in FUSE_GROUPS:
            names = [f"{parent}.{g}" for g in group]
            if leaf in group and all(n in input_scales for n in names):
                input_scales[module] = max(input_scales[n] for n in names)
    for name, (w_q, scale) in fp8.items():
        linear = model.get_submodule(name)
        if dtype != torch.float32:
            linear.forward = _fp8_forward(linear, w_q, scale, act, input_scales.get(name), group_size)
        elif quantize_activations:
            linear.register_forward_pre_hook(_fake_quant(act, input_scales.get(name), group_size))
    with torch.no_grad():
        return model(ids.to(device)).logits.float().cpu()


def _dequantize(w_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = w_q.shape
    if scale.numel() == 1:
        return w_q.float() * scale.reshape(())
    if scale.numel() == n and scale.shape[-1] in (n, 1):
        return w_q.float() * scale.reshape(n, 1)
    return w_q.float() * expand_blocks(scale, n, k, (128, 128))


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """``[ceil(rows/BR), ceil(cols/BC)]`` scales spread to ``[rows, cols]`` (the block-wise FP8 contract)."""
    full = scale.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[:rows, :cols]


def quantize_groups(x2: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization (the block-wise contract): ``scale [M, ceil(K/G)] = max(amax / 448, 1e-12)``."""
    m, k = x2.shape
    pad = torch.nn.functional.pad(x2.float(), (0, -k % group_size))
    amax = pad.reshape(m, -1, group_size).abs().amax(-1)
    scale = (amax / 448.0).clamp_min(1e-12)
    q = (x2.float() / expand_blocks(scale, m, k, (1, group_size))).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def _quantize(x2: torch.Tensor, act: str, scale: float | None, group_size: int):
    from fp8_backends.core import reference

    if act == "static":
        s = torch.tensor([scale], device=x2.device)
        return reference.quantize_static(x2, s), s
    if act == "dynamic":
        return reference.quantize_dynamic_per_tensor(x2)
    if act == "token":
        return reference.quantize_per_token(x2)
    return quantize_groups(x2, group_size)


def _fake_quant(act: str, scale: float | None, group_size: int):
    def hook(_module, args):
        x = args[0]
        x2 = x.reshape(-1, x.shape[-1]).float()
        q, s = _quantize(x2, act, scale, group_size)
        deq = q.float() * (expand_blocks(s, *q.shape, (1, group_size)) if act == "group" else s)
        return (deq.reshape(x.shape),)

    return hook


def _fp8_forward(linear: torch.nn.Module, w_q: torch.Tensor, w_scale: torch.Tensor, act: str, scale: float | None,
                 group_size: int):
    def forward(x):
        x2 = x.reshape(-1, x.shape[-1])
        q, s = _quantize(x2, act, scale, group_size)
        xs = q.float() * (expand_blocks(s, *q.shape, (1, group_size)) if act == "group" else s)
        y = xs @ _dequantize(w_q, w_scale).t()
        if linear.bias is not None:
            y = y + linear.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)

    return forward


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref).norm() / ref.norm())
