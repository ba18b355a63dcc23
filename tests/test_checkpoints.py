"""Serving FP8 checkpoints (``fp8_backends.checkpoints``): tiny random checkpoints written by their producers
(``tests/checkpoint_producers.py``: compressed-tensors' compressor, nvidia-modelopt's HF export, ``transformers``'
``FP8Linear`` + ``Fp8Quantize``), loaded and served on the CPU (``torch_scaled_mm``), their logits against the
checkpoint's own tensors (the served semantics in bf16: tight; dequantized to fp32: the FP8 error), ``generate()``;
every bad checkpoint gives one :class:`~fp8_backends.core.errors.CheckpointError` naming the tensor and the file."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")

import checkpoint_producers as cp  # noqa: E402

from fp8_backends.checkpoints import load_fp8_state_dict, load_pretrained, swap_fp8_layers  # noqa: E402
from fp8_backends.checkpoints.loader import block_layer_served  # noqa: E402
from fp8_backends.core.errors import CheckpointError  # noqa: E402
from fp8_backends.layers import Fp8Linear  # noqa: E402
from fp8_backends.layers.shared_input import Fp8LinearSlice  # noqa: E402

HAS_CT = importlib.util.find_spec("compressed_tensors") is not None
HAS_MODELOPT = importlib.util.find_spec("modelopt") is not None
needs_ct = pytest.mark.skipif(not HAS_CT, reason="compressed-tensors is not installed (the test extra has it)")
needs_modelopt = pytest.mark.skipif(not HAS_MODELOPT, reason="nvidia-modelopt is not installed (the producers "
                                    "extra has it; the documented-layout writer's tests run without it)")
#: served logits against the checkpoint's semantics in bf16 (same math, summation order aside) and against the
#: checkpoint dequantized to fp32 with its activations quantized in fp32 (bf16 activations and FP8 rounding flips)
TIGHT = 1e-2
#: the GPU test's bound. These tiny random models amplify bf16 rounding: the same checkpoint's bf16 reference model
#: differs from its fp32 one by 0.047-0.048 in the logits (hf_dynamic, hf_block, on the CPU), so kernels that round
#: or sum in another order move the logits by a few percent. On the CPU the served model runs the reference's own
#: code (0.0 from it); on the H200 (2026-12-03) the served logits were 0.030-0.035 from the GPU bf16 reference model
GPU_BOUND = 5e-2
FP32_BOUND = 0.08
IDS = cp.calibration_ids(20)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """``ckpt(key)``: the checkpoint ``key`` (made once per session)."""
    made: dict[str, Path] = {}
    makers = {
        "ct_fp8": lambda p: cp.compressed_tensors_checkpoint(p, "FP8"),
        "ct_fp8_fp32_scales": lambda p: cp.compressed_tensors_checkpoint(p, "FP8", scale_dtype=torch.float32),
        "ct_dynamic": lambda p: cp.compressed_tensors_checkpoint(p, "FP8_DYNAMIC"),
        "ct_dynamic_qwen2": lambda p: cp.compressed_tensors_checkpoint(p, "FP8_DYNAMIC", arch="qwen2"),
        "ct_block": lambda p: cp.compressed_tensors_checkpoint(p, "FP8_BLOCK", intermediate=320),
        "mo_fp8": lambda p: cp.modelopt_checkpoint(p, "FP8"),
        "mo_channel_qwen3": lambda p: cp.modelopt_checkpoint(p, "FP8_PER_CHANNEL_PER_TOKEN", arch="qwen3"),
        "mo_pb_wo": lambda p: cp.modelopt_checkpoint(p, "FP8_PB_WO"),
        "layout_fp8": lambda p: cp.modelopt_layout_checkpoint(p, "FP8"),
        "layout_channel": lambda p: cp.modelopt_layout_checkpoint(p, "FP8_PER_CHANNEL_PER_TOKEN"),
        "hf_dynamic": lambda p: cp.hf_fp8_checkpoint(p, None, "dynamic"),
        "hf_static": lambda p: cp.hf_fp8_checkpoint(p, None, "static", arch="qwen3"),
        "hf_block": lambda p: cp.hf_fp8_checkpoint(p, (128, 128), "dynamic"),
    }

    def get(key: str) -> Path:
        if key not in made:
            made[key] = makers[key](tmp_path_factory.mktemp(key))
        return made[key]

    return get


def served_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def check_served(path: Path, act: str, **kwargs):
    model, summary = load_pretrained(path, device="cpu", **kwargs)
    got = served_logits(model)
    tight = cp.rel_err(got, cp.reference_logits(path, IDS, act, dtype=torch.bfloat16))
    ref32 = cp.reference_logits(path, IDS, act)
    assert tight < TIGHT, (tight, str(summary))
    assert cp.rel_err(got, ref32) < FP32_BOUND
    assert (got.argmax(-1) == ref32.argmax(-1)).float().mean() >= 0.9
    out = model.generate(IDS[:1, :6], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 9)
    return model, summary


# ------------------------------------------------------------------------------------------------ served, by producer
SERVED = [
    pytest.param("ct_fp8", "static", "weights per-tensor, activations static per-tensor", marks=needs_ct,
                 id="compressed-tensors-FP8-llama"),
    pytest.param("ct_fp8_fp32_scales", "static", "weights per-tensor, activations static per-tensor", marks=needs_ct,
                 id="compressed-tensors-FP8-fp32-scales"),
    pytest.param("ct_dynamic", "token", "weights per-channel, activations dynamic per-token", marks=needs_ct,
                 id="compressed-tensors-FP8_DYNAMIC-llama"),
    pytest.param("ct_dynamic_qwen2", "token", "weights per-channel, activations dynamic per-token", marks=needs_ct,
                 id="compressed-tensors-FP8_DYNAMIC-qwen2"),
    pytest.param("mo_fp8", "static", "weights per-tensor, activations static per-tensor", marks=needs_modelopt,
                 id="modelopt-FP8-llama"),
    pytest.param("mo_channel_qwen3", "token", "weights per-channel, activations dynamic per-token",
                 marks=needs_modelopt, id="modelopt-FP8_PER_CHANNEL_PER_TOKEN-qwen3"),
    pytest.param("layout_fp8", "static", "weights per-tensor, activations static per-tensor",
                 id="modelopt-layout-FP8-llama"),
    pytest.param("layout_channel", "token", "weights per-channel, activations dynamic per-token",
                 id="modelopt-layout-FP8_PER_CHANNEL_PER_TOKEN-llama"),
    pytest.param("hf_dynamic", "dynamic", "weights per-tensor, activations dynamic per-tensor",
                 id="hf-fp8-per-tensor-dynamic-llama"),
    pytest.param("hf_static", "static", "weights per-tensor, activations static per-tensor",
                 id="hf-fp8-per-tensor-static-qwen3"),
]


@pytest.mark.parametrize(("key", "act", "scheme"), SERVED)
def test_a_checkpoint_is_served_with_its_own_scales(ckpt, key, act, scheme):
    model, summary = check_served(ckpt(key), act)
    assert summary.schemes() == {scheme: 14}
    assert summary.gemms == 8 and len(summary.fused) == 4  # q/k/v and gate/up of both layers
    assert summary.requantized == []  # the CPU provider keeps differing shard scales per channel
    assert [name for name, _ in summary.kept] == ["lm_head"]
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8LinearSlice)
    assert isinstance(model.model.layers[0].self_attn.o_proj, Fp8Linear)
    assert not any(p.device.type == "meta" for p in model.parameters())
    assert "torch_scaled_mm" in str(summary)
    # where the load's time went: every phase, in order, adding up to the total
    assert list(summary.load_phases) == ["read headers", "build model", "plan", "scales", "weights", "process"]
    assert all(v >= 0 for v in summary.load_phases.values())
    assert sum(summary.load_phases.values()) == pytest.approx(summary.load_seconds, rel=1e-6)
    assert "(read headers " in str(summary)


@pytest.mark.parametrize("key", [pytest.param("ct_block", marks=needs_ct, id="compressed-tensors-FP8_BLOCK"),
                                 pytest.param("hf_block", id="hf-fp8-block-128")])
def test_a_block_checkpoint_is_served_or_refused_clearly(ckpt, key):
    path = ckpt(key)
    if not block_layer_served():
        with pytest.raises(CheckpointError, match="block-scaled FP8 .* not served by this version") as err:
            load_pretrained(path, device="cpu")
        assert err.value.tensor.endswith(("weight_scale", "weight_scale_inv")) and err.value.file.endswith(
            "model.safetensors")
        return
    _, summary = check_served(path, "group")
    assert set(summary.schemes()) == {"weights 128x128 blocks, activations dynamic per-token groups of 128"}


@pytest.mark.parametrize("block", [[128, 64], [64, 64], [128, 256], [256, 128]])
def test_a_block_size_no_provider_serves_is_refused_from_the_config(ckpt, tmp_path, block):
    """Only 128x128 weight blocks are served (every built-in provider's declaration): another size is refused from
    config.json, before a module of the model is swapped or a tensor read."""
    if not block_layer_served():
        pytest.skip("no block mode in this version's Fp8Linear")
    bad = cp.edit_checkpoint(ckpt("hf_block"), tmp_path / "b", config={"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}})
    with pytest.raises(CheckpointError, match=f"weight_block_size {block[0]}x{block[1]} .* no registered GEMM "
                       r"provider serves this block-wise mode \(served: .*128x128 blocks with groups of 128"):
        load_pretrained(bad, device="cpu")
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    state = {"0.weight": torch.zeros(128, 256, dtype=torch.float8_e4m3fn), "0.weight_scale_inv": torch.ones(1, 2)}
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    with pytest.raises(CheckpointError, match="no registered GEMM provider"):
        load_fp8_state_dict(model, state, qc, device="cpu")
    assert type(model[0]) is torch.nn.Linear  # left as it was


@needs_ct
def test_compressed_tensors_block_structure_as_a_string():
    """compressed-tensors reads ``block_structure: "128x128"`` (the string its earlier versions wrote) as [128, 128]:
    so does the loader; a size no provider serves is refused either way."""
    from fp8_backends.checkpoints.detect import detect_format

    def config(block):
        return {"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                        "config_groups": {"g": {"targets": ["Linear"], "weights": {
                                            "num_bits": 8, "type": "float", "strategy": "block",
                                            "block_structure": block}, "input_activations": {
                                            "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                                            "dynamic": True}}}}}

    scheme = detect_format(config("128x128")).scheme_for("model.layers.0.mlp.down_proj", ["Linear"])
    assert scheme is not None and scheme.block == (128, 128) and scheme.group_size == 128
    with pytest.raises(CheckpointError, match="block_structure must be two positive integers"):
        detect_format(config("128 by 128"))
    with pytest.raises(CheckpointError, match="no registered GEMM provider"):
        detect_format(config([64, 128]))


def test_a_backend_that_cannot_serve_is_refused_before_the_model_changes(monkeypatch):
    """``load_fp8_state_dict(backend=...)``: an unknown name, or a provider that does not run on the model's device,
    raises before any module is swapped."""
    from fp8_backends.core.errors import Fp8BackendError, UnknownBackendError, UnsupportedProblemError
    from fp8_backends.core.types import DeviceKind
    from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend
    from fp8_backends.registry.registration import register_provider

    class CudaOnly(TorchScaledMMBackend):
        name = "cuda_only_mm"
        aliases = ()
        capabilities = dataclasses.replace(TorchScaledMMBackend.capabilities, devices=frozenset({DeviceKind.CUDA}))

    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    state = {"0.weight": torch.zeros(32, 64, dtype=torch.float8_e4m3fn), "0.weight_scale": torch.ones(())}
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with register_provider(CudaOnly, dist="fp8-backends-tests"):
        for backend, error in (("no_such_backend", UnknownBackendError), ("cuda_only_mm", UnsupportedProblemError)):
            with pytest.raises(error) as err:
                load_fp8_state_dict(model, state, qc, backend=backend, device="cpu")
            assert isinstance(err.value, Fp8BackendError) and type(model[0]) is torch.nn.Linear, backend


def test_two_weight_scales_of_one_weight_are_ambiguous(ckpt, tmp_path):
    """An HF fp8 linear holding both ``weight_scale_inv`` and ``weight_scale``: which one scales it is not known."""
    from safetensors.torch import load_file

    path = ckpt("hf_block")
    state = load_file(str(path / "model.safetensors"))
    name = next(k for k in state if k.endswith(".weight_scale_inv"))
    twin = name.removesuffix("_inv")
    bad = cp.edit_checkpoint(path, tmp_path / "two", put={twin: state[name] * 2})
    with pytest.raises(CheckpointError, match="weight_scale_inv and weight_scale: which one scales its weight is "
                       "ambiguous") as err:
        load_pretrained(bad, device="cpu")
    assert err.value.tensor == name


# ------------------------------------------------------------------------------------------------ cross-checks
def test_transformers_own_loader_reads_the_hf_fp8_writer_output_alike(ckpt):
    """The format's own consumer: transformers loads the fp8 checkpoint (dequantized to bf16 on a CPU) and its logits
    are the checkpoint's fp32 dequantization up to bf16; the served model is within the FP8 bound of both."""
    import transformers

    for key in ("hf_dynamic", "hf_block"):
        path = ckpt(key)
        theirs = served_logits(transformers.AutoModelForCausalLM.from_pretrained(path))
        assert cp.rel_err(theirs, cp.reference_logits(path, IDS, "dynamic", quantize_activations=False)) < 0.02
        if key == "hf_dynamic":
            model, _ = load_pretrained(path, device="cpu")
            assert cp.rel_err(served_logits(model), theirs) < FP32_BOUND


@needs_ct
def test_transformers_compressed_tensors_path_agrees_with_the_served_model(ckpt):
    """compressed-tensors through transformers (decompressed at the first forward, activations fake-quantized per
    token) against the library serving the same checkpoint."""
    import transformers

    path = ckpt("ct_dynamic")
    theirs = served_logits(transformers.AutoModelForCausalLM.from_pretrained(path))
    model, _ = load_pretrained(path, device="cpu")
    assert cp.rel_err(served_logits(model), theirs) < 0.05


@needs_modelopt
def test_the_modelopt_layout_writer_matches_modelopt_s_export(ckpt):
    from safetensors import safe_open

    for mo, layout in (("mo_fp8", "layout_fp8"),):
        a, b = ckpt(mo), ckpt(layout)
        qa = json.loads((a / "hf_quant_config.json").read_text())["quantization"]
        qb = json.loads((b / "hf_quant_config.json").read_text())["quantization"]
        assert {k: qa[k] for k in ("quant_algo", "exclude_modules")} == {k: qb[k] for k in ("quant_algo",
                                                                                               "exclude_modules")}
        with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
            names = sorted(fa.keys())
            assert names == sorted(fb.keys())
            for name in names:
                ta, tb = fa.get_slice(name), fb.get_slice(name)
                assert (ta.get_dtype(), ta.get_shape()) == (tb.get_dtype(), tb.get_shape()), name


# ------------------------------------------------------------------------------------------------ other entry points
@needs_ct
def test_swap_of_a_compressed_tensors_model_transformers_loaded_keeps_its_tensors(ckpt):
    import transformers

    path = ckpt("ct_dynamic")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    q_weight = model.model.layers[0].self_attn.o_proj.weight
    summary = swap_fp8_layers(model)
    assert summary.count == 14 and summary.gemms == 8 and not hasattr(model, "ct_decompress_hook")
    assert model.model.layers[0].self_attn.o_proj.weight.data_ptr() != 0
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight.view(torch.uint8), q_weight.view(torch.uint8))
    served, _ = load_pretrained(path, device="cpu")
    assert cp.rel_err(served_logits(model), served_logits(served)) < 1e-6


def test_swap_of_transformers_fp8linear_modules(ckpt, monkeypatch):
    """transformers builds its FP8Linear on a GPU only; its environment check is skipped here so that the CPU test
    gets the modules a GPU load makes."""
    import transformers
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None)
    path = ckpt("hf_static")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert type(model.model.layers[0].self_attn.o_proj).__name__ == "FP8Linear"
    summary = swap_fp8_layers(model)
    assert summary.count == 14 and type(model.model.layers[0].self_attn.o_proj) is Fp8Linear
    served, _ = load_pretrained(path, device="cpu")
    assert cp.rel_err(served_logits(model), served_logits(served)) < 1e-6
    with pytest.raises(CheckpointError, match="no FP8 layers"):
        swap_fp8_layers(served)


@needs_ct
def test_load_fp8_state_dict_into_a_meta_skeleton(ckpt):
    import transformers
    from safetensors.torch import load_file

    from fp8_backends.checkpoints.pretrained import parameters_on_meta

    path = ckpt("ct_fp8")
    config = json.loads((path / "config.json").read_text())
    with parameters_on_meta():
        model = transformers.LlamaForCausalLM._from_config(transformers.AutoConfig.from_pretrained(path),
                                                           dtype=torch.bfloat16)
    summary = load_fp8_state_dict(model, load_file(str(path / "model.safetensors")), config["quantization_config"])
    assert summary.count == 14
    served, _ = load_pretrained(path, device="cpu")
    assert cp.rel_err(served_logits(model), served_logits(served)) < 1e-6


@needs_ct
def test_the_streaming_loader_takes_tensors_in_any_order(ckpt):
    """Weights before their scales (what a safetensors file's sorted names give): they wait for them."""
    import transformers
    from safetensors.torch import load_file

    from fp8_backends.checkpoints import Fp8CheckpointLoader
    from fp8_backends.checkpoints.detect import detect
    from fp8_backends.checkpoints.loader import fuse_patterns
    from fp8_backends.checkpoints.params import assign_params, linear_infos, plan_params
    from fp8_backends.checkpoints.plan import plan_linears
    from fp8_backends.checkpoints.pretrained import parameters_on_meta
    from fp8_backends.checkpoints.shards import read_index

    path = ckpt("ct_dynamic")
    with parameters_on_meta():
        model = transformers.LlamaForCausalLM._from_config(transformers.AutoConfig.from_pretrained(path),
                                                           dtype=torch.bfloat16)
    index = read_index(path)
    plan = plan_linears(detect(path), linear_infos(model), index.tensors, fuse_groups=fuse_patterns(True))
    targets = plan_params(model, plan, index.tensors)
    loader = Fp8CheckpointLoader(plan, dtype=torch.bfloat16, device="cpu")
    loader.create_weights(model)
    for name, t in sorted(load_file(str(path / "model.safetensors")).items()):
        if name in targets:
            assign_params(targets[name], t, "cpu")
        else:
            assert loader.weight_loader(name, t)
    summary = loader.process_weights_after_loading()
    served, _ = load_pretrained(path, device="cpu")
    assert summary.gemms == 8 and cp.rel_err(served_logits(model), served_logits(served)) < 1e-6


def test_fuse_false_and_forced_requantization_are_reported(ckpt, tmp_path):
    path = ckpt("layout_fp8")
    _, summary = check_served(path, "static", fuse=False)
    assert summary.gemms == 14 and summary.fused == []
    # differing static input scales of q/k/v: served with their maximum, and the summary says so
    name = "model.layers.0.self_attn.k_proj.input_scale"
    from safetensors.torch import load_file

    scale = load_file(str(path / "model.safetensors"))[name]
    edited = cp.edit_checkpoint(path, tmp_path / "e", put={name: scale * 0.5})
    model, summary = load_pretrained(edited, device="cpu", shard_scales="requantize")  # rescaled: FP8 bound only
    assert cp.rel_err(served_logits(model), cp.reference_logits(edited, IDS, "static")) < FP32_BOUND
    assert [g for g, _ in summary.merged_input_scales] == ["model.layers.0.self_attn.q_proj+k_proj+v_proj"]
    assert len(summary.requantized) == 4 and "largest" in str(summary)


@needs_ct
def test_ignored_modules_stay_in_the_model_dtype(tmp_path):
    path = cp.compressed_tensors_checkpoint(tmp_path / "c", "FP8_DYNAMIC")
    cfg = json.loads((path / "config.json").read_text())
    # a config that ignores every down_proj while the checkpoint stores them in FP8: refused, naming the tensor
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*down_proj"]
    bad = cp.edit_checkpoint(path, tmp_path / "bad", config={"quantization_config": cfg["quantization_config"]})
    with pytest.raises(CheckpointError, match="down_proj.weight.*float8 but the config keeps"):
        load_pretrained(bad, device="cpu")


def test_modules_the_model_keeps_unquantized_load_as_stored(ckpt, tmp_path, monkeypatch):
    """``transformers`` never quantizes a model's ``_keep_in_fp32_modules(_strict)`` (DeepSeek-V3.2's
    ``indexer.weights_proj``), so a checkpoint may store one in bf16 while its config covers it: kept then, with the
    reason in the summary, and the model's logits those of the stored tensors; the same checkpoint for a model
    without the list is refused naming the tensor. At float16 the listed modules' parameters are float32, as
    ``transformers`` loads them."""
    import transformers
    from safetensors.torch import load_file

    from fp8_backends.checkpoints.pretrained import build_skeleton

    path = ckpt("hf_block")
    down = "model.layers.0.mlp.down_proj"
    state = load_file(str(path / "model.safetensors"))
    dense = cp._dequantize(state[f"{down}.weight"], state[f"{down}.weight_scale_inv"].float()).to(torch.bfloat16)
    plain = cp.edit_checkpoint(path, tmp_path / "plain", drop=(f"{down}.weight_scale_inv",),
                               put={f"{down}.weight": dense})
    with pytest.raises(CheckpointError, match=f"{down}.weight: .*its weight is BF16"):
        load_pretrained(plain, device="cpu")
    monkeypatch.setattr(transformers.LlamaForCausalLM, "_keep_in_fp32_modules", ["layers.0.mlp.down_proj"])
    model, summary = load_pretrained(plain, device="cpu")
    assert dict(summary.kept)[down] == "the model keeps it unquantized (_keep_in_fp32_modules: layers.0.mlp.down_proj)"
    kept = model.get_submodule(down)
    assert type(kept) is torch.nn.Linear and kept.weight.dtype == torch.bfloat16
    assert isinstance(model.get_submodule("model.layers.1.mlp.down_proj"), Fp8Linear)
    got = served_logits(model)
    assert cp.rel_err(got, cp.reference_logits(plain, IDS, "group", dtype=torch.bfloat16)) < TIGHT
    skeleton = build_skeleton(plain, torch.float16)
    assert skeleton.get_submodule(down).weight.dtype == torch.float32
    assert skeleton.get_submodule("model.layers.1.mlp.down_proj").weight.dtype == torch.float16


# ------------------------------------------------------------------------------------------------ bad checkpoints
def _edits(path: Path) -> list[tuple[str, dict, str]]:
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    qc = json.loads((path / "config.json").read_text())
    hf = json.loads((path / "hf_quant_config.json").read_text())
    w = state[f"{q}.weight"]
    return [
        ("missing weight scale", {"drop": (f"{q}.weight_scale",)}, f"{q}.weight_scale: missing weight scale"),
        ("missing input scale", {"drop": (f"{q}.input_scale",)}, f"{q}.input_scale: missing static input scale"),
        ("weight shape", {"put": {f"{q}.weight": w[:-8]}}, f"{q}.weight: shape .* does not match"),
        ("scale shape", {"put": {f"{q}.weight_scale": torch.ones(3)}}, f"{q}.weight_scale: shape \\[3\\] does not"),
        ("NaN scale", {"put": {f"{q}.weight_scale": torch.tensor(float("nan"))}}, "finite and > 0; got \\[nan\\]"),
        ("zero scale", {"put": {f"{q}.input_scale": torch.tensor(0.0)}}, f"{q}.input_scale: scales must be finite"),
        ("negative scale", {"put": {f"{q}.weight_scale": torch.tensor(-0.1)}}, "finite and > 0; got \\[-0.1"),
        ("int scale", {"put": {f"{q}.weight_scale": torch.tensor(1, dtype=torch.int32)}}, "scale dtype I32"),
        ("e5m2", {"put": {f"{q}.weight": w.to(torch.float8_e5m2)}}, "float8_e5m2 weights are not served"),
        ("bf16 weight", {"put": {f"{q}.weight": w.to(torch.bfloat16)}}, "quantizes .* but its weight is BF16"),
        ("zero point", {"put": {f"{q}.weight_zero_point": torch.zeros(1)}}, f"{q}.weight_zero_point: unexpected"),
        ("no bias in model", {"put": {f"{q}.bias": torch.zeros(w.shape[0])}}, f"{q}.bias: the model's .* no bias"),
        ("unknown algo", {"quant_config": {"quantization": {**hf["quantization"], "quant_algo": "NVFP4"}}},
         "quant_algo 'NVFP4' is not an FP8 scheme"),
        ("block weight-only", {"quant_config": {"quantization": {**hf["quantization"], "quant_algo": "fp8_pb_wo"}}},
         "'FP8_PB_WO' is not an FP8 scheme"),
        ("malformed quant config", {"quant_config": {"quantization": ["FP8"]}}, "quantization section must be a JSON"),
        ("another format", {"config": {"quantization_config": {**qc.get("quantization_config", {}),
                                                               "quant_method": "gptq"}}},
         "hf_quant_config.json says ModelOpt but quantization_config.quant_method is 'gptq'"),
    ]


@pytest.mark.parametrize("case", range(16))
def test_a_bad_checkpoint_gives_one_checkpoint_error_naming_tensor_and_file(ckpt, tmp_path, case):
    path = ckpt("layout_fp8")
    label, edit, message = _edits(path)[case]
    bad = cp.edit_checkpoint(path, tmp_path / "bad", **edit)
    with pytest.raises(CheckpointError, match=message) as err:
        load_pretrained(bad, device="cpu")
    assert str(bad) in str(err.value), label  # the file
    assert isinstance(err.value, ValueError)


def test_configs_of_no_or_another_format_and_malformed_files(ckpt, tmp_path):
    base = ckpt("hf_dynamic")
    cases = [
        ({"config": {"quantization_config": None}}, "no quantization_config .* not an FP8 checkpoint"),
        ({"config": {"quantization_config": {"quant_method": "awq"}}}, "quant_method 'awq' is not an FP8 format"),
        ({"config": {"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}}, "fmt 'e5m2' is not served"),
        ({"config": {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}},
         "weight_block_size must be two positive integers"),
        ({"config": {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
            "input_activations": None}}, "format": "float-quantized"}}}, "weight-only .* not served"),
        ({"config": {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group"},
            "input_activations": None}}, "format": "pack-quantized"}}}, "format 'pack-quantized'"),
        ({"config": {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head", "re:model.layers.(0"], "format": "float-quantized"}}},
         "ignore entry 're:model.layers.\\(0' is not a valid pattern"),
        ({"config": {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": ["re:*proj"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "format": "float-quantized"}}}, "targets entry 're:\\*proj' is not a valid pattern"),
        ({"config": {"hidden_size": "64"}}, "transformers cannot read this config: .*hidden_size"),
        ({"config": {"num_attention_heads": 7}}, "transformers cannot (read this config|build .* from this config)"),
    ]
    for i, (edit, message) in enumerate(cases):
        bad = cp.edit_checkpoint(base, tmp_path / str(i), **edit)
        with pytest.raises(CheckpointError, match=message) as err:
            load_pretrained(bad, device="cpu")
        assert str(bad / "config.json") in str(err.value)
    broken = cp.edit_checkpoint(base, tmp_path / "json")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: cannot read it as JSON"):
        load_pretrained(broken, device="cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(empty, device="cpu")
    nofile = cp.edit_checkpoint(base, tmp_path / "nofile")
    (nofile / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors files"):
        load_pretrained(nofile, device="cpu")
    truncated = cp.edit_checkpoint(base, tmp_path / "trunc")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors: .*data offsets"):
        load_pretrained(truncated, device="cpu")


@needs_modelopt
def test_modelopt_s_weight_only_block_export_is_refused(ckpt):
    with pytest.raises(CheckpointError, match="hf_quant_config.json: quant_algo 'FP8_PB_WO' is not an FP8 scheme"):
        load_pretrained(ckpt("mo_pb_wo"), device="cpu")


@needs_ct
def test_a_failed_state_dict_load_leaves_the_model_unchanged(ckpt):
    import transformers
    from safetensors.torch import load_file

    path = ckpt("ct_fp8")
    config = json.loads((path / "config.json").read_text())
    model = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(path)).to(torch.bfloat16)
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight_scale"] = torch.tensor([0.0])
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(CheckpointError, match="down_proj.weight_scale: scales must be finite and > 0"):
        load_fp8_state_dict(model, state, config["quantization_config"])
    assert {n: type(m) for n, m in model.named_modules()} == before


# ------------------------------------------------------------------------------------------------ torch-free parts
def test_the_package_and_its_format_modules_import_no_torch():
    code = ("import sys, fp8_backends, fp8_backends.checkpoints as c\n"
            "from fp8_backends.checkpoints import detect, plan, shards, summary, loader, pretrained, swap, params\n"
            "assert callable(fp8_backends.__getattr__)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_module_matching_follows_each_format():
    from fp8_backends.checkpoints.detect import detect_format

    hf = detect_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                "modules_to_not_convert": ["model.layers.1", "mlp.gate", "re_x"]}})
    lin = ("Linear", "Module")
    assert hf.scheme_for("model.layers.1.mlp.up_proj", lin) is None  # prefix to a module boundary
    assert hf.scheme_for("model.layers.11.mlp.up_proj", lin) is not None
    assert hf.scheme_for("model.layers.0.mlp.gate", lin) is None and hf.scheme_for("model.layers.0.mlp.gate_proj",
                                                                                   lin) is not None
    ct = detect_format({"quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized",
                                                "ignore": ["lm_head", "re:.*mlp.gate$"], "config_groups": {
        "a": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
        "b": {"targets": ["re:.*o_proj"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}})
    assert ct.scheme_for("model.layers.0.self_attn.o_proj", lin).act == "static"  # a regex beats a class
    assert ct.scheme_for("model.layers.0.self_attn.q_proj", lin).act == "token"
    assert ct.scheme_for("lm_head", lin) is None and ct.scheme_for("model.layers.0.mlp.gate", lin) is None
    assert ct.scheme_for("model.layers.0.mlp.gate_proj", ("Conv1D", "Module")) is None
    mo = detect_format({}, {"quantization": {"quant_algo": "FP8", "exclude_modules": ["*self_attn*", "lm_head"]}})
    assert mo.scheme_for("model.layers.0.self_attn.q_proj", lin) is None
    assert mo.scheme_for("model.layers.0.mlp.up_proj", lin).describe() == \
        "weights per-tensor, activations static per-tensor"


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("key", [pytest.param("ct_dynamic", marks=needs_ct), "layout_fp8", "hf_dynamic",
                                 pytest.param("hf_block", id="hf_block (block mode)")])
def test_a_checkpoint_served_on_the_gpu_eager_and_compiled(ckpt, key):
    path = ckpt(key)
    if key == "hf_block" and not block_layer_served():
        pytest.skip("block-scaled FP8 is not served by this version yet")
    act = {"ct_dynamic": "token", "layout_fp8": "static", "hf_dynamic": "dynamic", "hf_block": "group"}[key]
    model, summary = load_pretrained(path, device="cuda")
    ids = IDS.cuda()
    ref = cp.reference_logits(path, IDS, act, dtype=torch.bfloat16, device="cuda")  # the GPU's own bf16 kernels
    with torch.no_grad():
        eager = model(ids).logits.float().cpu()
        compiled = torch.compile(model)(ids).logits.float().cpu()
    assert cp.rel_err(eager, ref) < GPU_BOUND, str(summary)
    assert cp.rel_err(compiled, ref) < GPU_BOUND
    assert model.generate(ids[:1, :6], max_new_tokens=3, do_sample=False).shape == (1, 9)
