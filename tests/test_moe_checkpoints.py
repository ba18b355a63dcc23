"""MoE FP8 checkpoints as they ship (DeepSeek-V3, Qwen3-MoE: every routed expert's ``gate_proj`` / ``up_proj`` /
``down_proj`` its own block-scaled FP8 weight) loaded into ``transformers`` 5 models, whose experts module holds 3-D
``gate_up_proj`` / ``down_proj`` parameters: served one linear triple per expert
(:class:`~fp8_backends.layers.experts.PerExpertLinears`), against a reference that computes every routed token's
experts from the checkpoint's dequantized tensors, activations group-quantized as the served path does."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
torch = pytest.importorskip("torch")

import checkpoint_producers as cp  # noqa: E402

from fp8_backends.checkpoints import load_fp8_state_dict, load_pretrained  # noqa: E402
from fp8_backends.checkpoints.experts import expand_experts  # noqa: E402
from fp8_backends.checkpoints.shards import TensorMeta  # noqa: E402
from fp8_backends.core.errors import CheckpointError, InvalidInputError  # noqa: E402
from fp8_backends.layers import Fp8Linear, process_weights_after_loading  # noqa: E402
from fp8_backends.layers.experts import PerExpertLinears, unserved_layout  # noqa: E402
from fp8_backends.layers.shared_input import Fp8LinearSlice  # noqa: E402

HAS_FUSED_EXPERTS = hasattr(getattr(transformers, "Qwen3MoeConfig", None), "model_type") and int(
    transformers.__version__.split(".")[0]) >= 5
pytestmark = pytest.mark.skipif(not HAS_FUSED_EXPERTS, reason="transformers < 5 builds MoE experts as nn.Linear "
                                "modules (served as any other linear)")
IDS = cp.calibration_ids(20)
COMMON = {"hidden_size": 256, "intermediate_size": 384, "num_hidden_layers": 2, "vocab_size": cp.VOCAB,
          "max_position_embeddings": 256, "tie_word_embeddings": False}
#: the served model in fp32 against the fp32 reference, per token: the same math, summation order aside (median
#: 2e-7); a sum that lands on an FP8 rounding boundary flips one activation code, which moves its token by up to ~0.6%
FP32_MEDIAN = 1e-5
FP32_MAX = 1e-2
#: the served model in bf16 against the fp32 reference, per token (median): FP8 codes of bf16 activations and bf16
#: rounding through the MLA projections' chains (0.06-0.07 for the tiny DeepSeek-V3); a token whose router picks
#: another expert in bf16 lands far off (0.25-0.4), hence the median
BF16_MEDIAN = 0.1


def tiny_moe(arch: str, moe_intermediate: int = 128, q_lora_rank: int = 192) -> torch.nn.Module:
    if arch == "deepseek_v3":  # MLA attention, layer 0 dense, layer 1 MoE with a shared expert
        config = transformers.DeepseekV3Config(
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=128,
            qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, moe_intermediate_size=moe_intermediate,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
            topk_group=1,
            architectures=["DeepseekV3ForCausalLM"], **COMMON)
    else:
        config = transformers.Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                             moe_intermediate_size=moe_intermediate, num_experts=4,
                                             num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"], **COMMON)
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or (p.dim() == 2 and "embed" not in name):  # blocks get different scales
                p.mul_(torch.exp(torch.randn(*p.shape[:-1], 1) * 0.5).to(p.dtype))
    return model


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-block FP8 of ``w`` [N, K]: ``(w_q e4m3, scale [ceil(N/128), ceil(K/128)] fp32)``."""
    n, k = w.shape
    pad = torch.nn.functional.pad(w.float(), (0, -k % 128, 0, -n % 128))
    amax = pad.reshape(pad.shape[0] // 128, 128, pad.shape[1] // 128, 128).abs().amax((1, 3))
    scale = (amax / 448.0).clamp_min(1e-12)
    w_q = (w.float() / cp.expand_blocks(scale, n, k, (128, 128))).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w_q, scale


def per_expert_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict with every 3-D experts parameter split into the shipped per-expert weights."""
    state = {}
    for key, value in model.state_dict().items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "gate_up_proj" and value.dim() == 3:
            for e in range(value.shape[0]):
                gate, up = value[e].chunk(2, 0)
                state[f"{prefix}.{e}.gate_proj.weight"], state[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif leaf == "down_proj" and value.dim() == 3:
            for e in range(value.shape[0]):
                state[f"{prefix}.{e}.down_proj.weight"] = value[e]
        else:
            state[key] = value
    return state


def quantize_rows(w: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (``per_row``: scale ``[N, 1]``) or per-tensor (scale ``[]``) FP8 of ``w`` [N, K]."""
    amax = w.float().abs().amax(1, keepdim=True) if per_row else w.float().abs().amax()
    scale = (amax / 448.0).clamp_min(1e-12)
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def moe_checkpoint(path: Path, arch: str, *, keep: tuple[str, ...] = ("lm_head", "mlp.gate"),
                   moe_intermediate: int = 128, scheme: str = "block", q_lora_rank: int = 192) -> Path:
    """A tiny MoE model's FP8 checkpoint in the shipped per-expert layout: ``scheme="block"`` a Hugging Face ``fp8``
    block checkpoint (``weight_scale_inv``, as DeepSeek-V3 and Qwen3-FP8 ship), ``"tensor"`` the same format without
    blocks (one ``weight_scale_inv`` per weight), ``"channel"`` compressed-tensors per-channel weights with dynamic
    per-token activations (``FP8_DYNAMIC``, as the ``-FP8-dynamic`` MoE checkpoints ship). ``keep``: modules left in
    bf16."""
    from safetensors.torch import save_file

    model = tiny_moe(arch, moe_intermediate, q_lora_rank)
    out = {}
    for key, value in per_expert_state(model).items():
        module = key.rpartition(".")[0]
        kept = any(module.startswith(f"{k}.") or module.endswith(k) for k in keep)  # as the format matches
        quantized = key.endswith(".weight") and value.dim() == 2 and "embed" not in key and not kept
        if quantized and scheme == "block":
            out[key], out[f"{module}.weight_scale_inv"] = quantize_block(value)
        elif quantized:
            out[key], scale = quantize_rows(value, scheme == "channel")
            out[f"{module}.weight_scale" if scheme == "channel" else f"{module}.weight_scale_inv"] = scale
        else:
            out[key] = value.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    if scheme == "channel":
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                          "weights": {**fp8, "strategy": "channel", "dynamic": False},
                                          "input_activations": {**fp8, "strategy": "token", "dynamic": True}}},
            "ignore": [k if k == "lm_head" else f"re:.*{k}$" for k in keep]}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128] if scheme == "block" else None,
                                         "modules_to_not_convert": list(keep)}
    (path / "config.json").write_text(json.dumps(config))
    return path


def assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    per_token = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(per_token.median()) < FP32_MEDIAN and float(per_token.max()) < FP32_MAX, per_token


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """``x`` quantized per token in groups of 128 and dequantized (fp32)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    q, s = cp.quantize_groups(x2, 128)
    return (q.float() * cp.expand_blocks(s, *q.shape, (1, 128))).reshape(x.shape)


def reference_logits(path: Path) -> torch.Tensor:
    """The checkpoint's logits in fp32 from its own tensors: every FP8 weight ``w_q * scale``, every FP8 linear's
    input group-quantized; each MoE layer's routed experts computed token by token (``sum_j w_j * down_e(q(act(
    gate_e(q(x))) * up_e(q(x))))`` over the token's experts ``e``), the router and everything else the model's own."""
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(path)
    model = getattr(transformers, config.architectures[0])._from_config(config, dtype=torch.float32).eval()
    state = load_file(str(path / "model.safetensors"))
    dense = {}
    for name, t in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and t.dtype == torch.float8_e4m3fn:
            dense[name] = t.float() * cp.expand_blocks(state[f"{module}.weight_scale_inv"], *t.shape, (128, 128))
        elif t.is_floating_point() and t.dtype.itemsize >= 2:
            dense[name] = t.float()
    fp8_modules = {n.rpartition(".")[0] for n, t in state.items() if t.dtype == torch.float8_e4m3fn}
    for name, module in model.named_modules():
        if name in fp8_modules:
            module.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0]),))
        if getattr(module, "gate_up_proj", None) is not None and module.gate_up_proj.dim() == 3:
            experts = [(dense.pop(f"{name}.{e}.gate_proj.weight"), dense.pop(f"{name}.{e}.up_proj.weight"),
                        dense.pop(f"{name}.{e}.down_proj.weight")) for e in range(module.gate_up_proj.shape[0])]
            quant = f"{name}.0.gate_proj" in fp8_modules
            module.forward = _reference_experts(experts, module.act_fn, quant)
    model.load_state_dict(dense, strict=False)
    with torch.no_grad():
        return model(IDS).logits.float()


def _reference_experts(experts, act, quant):
    q = fake_quant if quant else (lambda x: x.float())

    def forward(hidden, top_k_index, top_k_weights):
        out = torch.zeros(hidden.shape, dtype=torch.float32)
        for t in range(hidden.shape[0]):
            for j in range(top_k_index.shape[1]):
                gate, up, down = experts[int(top_k_index[t, j])]
                x = q(hidden[t:t + 1])
                h = act(x @ gate.t()) * (x @ up.t())
                out[t] += float(top_k_weights[t, j]) * (q(h) @ down.t())[0]
        return out.to(hidden.dtype)

    return forward


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def get(arch: str, **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = moe_checkpoint(tmp_path_factory.mktemp(arch), arch, **kw)
        return made[key]

    return get


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_a_moe_checkpoint_is_served_one_fp8_linear_triple_per_expert(moe, arch):
    path = moe(arch)
    ref = reference_logits(path)
    model32, summary = load_pretrained(path, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        got32 = model32(IDS).logits.float()
    assert_matches(got32, ref)
    experts = model32.model.layers[1].mlp.experts
    assert isinstance(experts, PerExpertLinears) and experts.num_experts == 4
    assert isinstance(experts.expert(3).gate_proj, Fp8LinearSlice)  # gate/up: one GEMM per expert
    assert isinstance(experts.expert(3).down_proj, Fp8Linear)
    assert "model.layers.1.mlp.experts.3.gate_proj+up_proj" in [g for g, _ in summary.fused]
    layers = {"deepseek_v3": 1, "qwen3_moe": 2}[arch]  # DeepSeek-V3: layer 0 dense
    assert any(f"{layers} MoE layer(s) with experts stored one by one" in note for note in summary.notes)
    assert not any(p.device.type == "meta" for p in model32.parameters())
    model, _ = load_pretrained(path, device="cpu")  # bf16: the FP8 error, bf16 rounding and a few routing flips
    with torch.no_grad():
        got = model(IDS).logits.float()
    per_token = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(per_token.median()) < BF16_MEDIAN, per_token
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert model.generate(IDS[:1, :6], max_new_tokens=3, do_sample=False).shape == (1, 9)


def test_mla_down_projections_of_whole_blocks_load_as_one_gemm(moe):
    """DeepSeek-V3's q_a_proj (q_lora_rank 256: two 128-row blocks) and kv_a_proj_with_mqa (160 rows) from a block
    checkpoint: one fused GEMM over their blocks, the checkpoint's logits; at q_lora_rank 192 (a block would
    straddle them) they load apart, as the summary says."""
    path = moe("deepseek_v3", q_lora_rank=256)
    model, summary = load_pretrained(path, device="cpu", dtype=torch.float32)
    assert "model.layers.0.self_attn.q_a_proj+kv_a_proj_with_mqa" in [g for g, _ in summary.fused]
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa, Fp8LinearSlice) and attn.q_a_proj.fused.out_features == 256 + 160
    with torch.no_grad():
        got = model(IDS).logits.float()
    assert_matches(got, reference_logits(path))
    _, apart = load_pretrained(moe("deepseek_v3"), device="cpu", dtype=torch.float32)
    assert "model.layers.0.self_attn.q_a_proj+kv_a_proj_with_mqa" in [g for g, _ in apart.not_fused]


def test_experts_the_config_keeps_are_served_per_expert_in_the_model_dtype(moe):
    path = moe("qwen3_moe", keep=("lm_head", "mlp.gate", "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"))
    model, summary = load_pretrained(path, device="cpu", dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    assert type(experts.expert(0).gate_proj) is torch.nn.Linear
    assert "model.layers.0.mlp.experts.0.gate_proj" in [m for m, _ in summary.kept]
    with torch.no_grad():
        got = model(IDS).logits.float()
    assert_matches(got, reference_logits(path))


def test_ragged_experts_whose_gate_up_blocks_would_straddle_run_unfused(moe):
    """``moe_intermediate_size`` 96: gate and up are not whole 128-row blocks, so each runs its own GEMM."""
    path = moe("qwen3_moe", moe_intermediate=96)
    model, summary = load_pretrained(path, device="cpu", dtype=torch.float32)
    assert "model.layers.0.mlp.experts.1.gate_proj+up_proj" in [g for g, _ in summary.not_fused]
    with torch.no_grad():
        got = model(IDS).logits.float()
    assert_matches(got, reference_logits(path))


def test_a_moe_state_dict_loads_into_a_model_built_from_its_config(moe):
    from safetensors.torch import load_file

    path = moe("deepseek_v3")
    config = json.loads((path / "config.json").read_text())
    model = transformers.DeepseekV3ForCausalLM(transformers.AutoConfig.from_pretrained(path)).eval()
    summary = load_fp8_state_dict(model, load_file(str(path / "model.safetensors")), config,
                                  dtype=torch.float32, device="cpu")
    with torch.no_grad():
        got = model(IDS).logits.float()
    assert_matches(got, reference_logits(path))
    assert any("MoE" in note for note in summary.notes)


def test_a_missing_expert_or_a_layout_in_neither_form_is_a_checkpoint_error(moe, tmp_path):
    path = moe("qwen3_moe")
    missing = cp.edit_checkpoint(path, tmp_path / "missing", drop=("model.layers.1.mlp.experts.2.up_proj.weight",))
    with pytest.raises(CheckpointError, match="missing") as err:
        load_pretrained(missing, device="cpu")
    assert err.value.tensor == "model.layers.1.mlp.experts.2.up_proj.weight"
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    renamed = {k.replace("mlp.experts.", "mlp.moe_experts."): v for k, v in state.items()}
    other = cp.edit_checkpoint(path, tmp_path / "other", drop=tuple(state), put=renamed)
    with pytest.raises(CheckpointError, match="stores neither those nor per-expert") as err:
        load_pretrained(other, device="cpu")
    assert err.value.tensor == "model.layers.0.mlp.experts.gate_up_proj"


class _BiasedExperts(torch.nn.Module):
    """A 3-D experts module with biases (gpt-oss style): not served per expert."""

    has_bias = True

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))
        self.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 4))
        self.act_fn = torch.nn.SiLU()


def test_an_experts_layout_the_per_expert_form_cannot_serve_is_refused_before_the_model_changes():
    model = torch.nn.Module()
    model.experts = _BiasedExperts()
    assert "has_bias=True" in unserved_layout(model.experts)
    metas = {f"experts.0.{leaf}.weight": TensorMeta(f"experts.0.{leaf}.weight", "F8_E4M3", (4, 4), "f.safetensors")
             for leaf in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(CheckpointError, match="cannot be served per expert: its layout"):
        expand_experts(model, metas)
    assert isinstance(model.experts, _BiasedExperts)
    with pytest.raises(InvalidInputError, match="has_bias=True"):
        PerExpertLinears.from_fused(model.experts)
    # stored as the model holds it (3-D tensors): left alone, loaded as any other parameter
    fused = {"experts.gate_up_proj": TensorMeta("experts.gate_up_proj", "BF16", (2, 8, 4), "f.safetensors"),
             "experts.down_proj": TensorMeta("experts.down_proj", "BF16", (2, 4, 4), "f.safetensors")}
    assert expand_experts(model, fused)[0] == [] and isinstance(model.experts, _BiasedExperts)


def test_the_per_expert_forward_matches_transformers_experts_on_the_same_weights():
    """The per-expert module with plain fp32 linears against the replaced ``transformers`` module itself (its eager
    experts implementation); an expert-parallel sentinel id (== E) contributes nothing."""
    model = tiny_moe("qwen3_moe").float()
    original = model.model.layers[0].mlp.experts
    gate_up, down = original.gate_up_proj.detach().clone(), original.down_proj.detach().clone()
    torch.manual_seed(3)
    hidden = torch.randn(9, 256)
    index = torch.randint(0, 4, (9, 2))
    weights = torch.rand(9, 2)
    original.config._experts_implementation = "eager"
    with torch.no_grad():
        want = original(hidden, index, weights)
        per_expert = PerExpertLinears.from_fused(original)
        per_expert.to_empty(device="cpu")
        for e in range(4):
            mlp = per_expert.expert(e)
            mlp.gate_proj.weight.copy_(gate_up[e, :128])
            mlp.up_proj.weight.copy_(gate_up[e, 128:])
            mlp.down_proj.weight.copy_(down[e])
        got = per_expert(hidden, index, weights)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        sentinel = index.clone()
        sentinel[:, 1] = 4
        dropped = per_expert(hidden, index, weights * torch.tensor([1.0, 0.0]))
        torch.testing.assert_close(per_expert(hidden, sentinel, weights), dropped, rtol=1e-6, atol=1e-6)


def test_quantize_model_lists_3d_experts_it_keeps_in_the_model_dtype():
    from fp8_backends import quantize_model

    model = tiny_moe("qwen3_moe")
    with torch.no_grad():
        want = model(IDS).logits.float()
    summary = quantize_model(model, weight_scale="block", backend="torch")
    kept = {name: why for name, why in summary.skipped}
    assert "MoE experts held as 3-D parameters (4 experts)" in kept["model.layers.1.mlp.experts"]
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    with torch.no_grad():
        got = model(IDS).logits.float()
    assert cp.rel_err(got, want) < 0.15


def _experts_layers(model):
    return [m for m in model.modules() if isinstance(m, PerExpertLinears)]


def _grouped_on(model, on: bool = True, max_pairs: int = 64):
    """Ask every MoE layer for the grouped experts paths (on the CPU: under Triton's interpreter) and stack."""
    for m in _experts_layers(model):
        m.grouped = on
        m.grouped_max_pairs = max_pairs
    process_weights_after_loading(model)


needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or (not torch.cuda.is_available()
                                                   and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="the grouped experts GEMV is a Triton kernel: a GPU or Triton's interpreter")


@needs_interpreter
def test_stacked_experts_share_their_linears_storage_and_the_grouped_path_matches_the_loop(moe):
    """Stacking moves every expert's weights into one tensor per projection (the linears become views: no second
    copy); the grouped GEMV path (decode sizes) gives the per-expert loop's logits within the interpreter's FP8
    rounding (it rounds some fp32 -> fp8 casts differently from torch: a flipped code, not a wrong formula)."""
    model, summary = load_pretrained(moe("qwen3_moe"), device="cpu", dtype=torch.float32)
    assert any("without the grouped experts paths" in n and "grouped=True" in n for n in summary.notes)
    with torch.no_grad():
        loop = model(IDS).logits.float()
    _grouped_on(model, max_pairs=10**6)
    for experts in _experts_layers(model):
        st = experts.stacked
        assert st is not None and experts.grouped_reason is None
        assert tuple(st.gate_up.shape) == (4, 256, 256) and tuple(st.down.shape) == (4, 256, 128)
        fused = experts.expert(2).gate_proj.group.layer
        assert fused.weight._base is st.gate_up and fused.weight.data_ptr() == st.gate_up[2].data_ptr()
        assert experts.expert(3).down_proj.weight.data_ptr() == st.down[3].data_ptr()
        assert "grouped: stacked" in repr(experts)
    with torch.no_grad():
        grouped = model(IDS).logits.float()
    per_token = (grouped - loop).norm(dim=-1) / loop.norm(dim=-1)
    assert float(per_token.median()) < 0.05, per_token  # interpreter rounding (docstring): 0.03 here
    # the layer itself, exactly: each pair through the fused block GEMV (same interpreter) on the linears' tensors
    from fp8_backends.providers.triton.block_gemm_ops import fused_launch

    experts = _experts_layers(model)[0]
    torch.manual_seed(1)
    hidden, index, weights = torch.randn(3, 256), torch.tensor([[0, 3], [2, 3], [1, 4]]), torch.rand(3, 2)
    want = torch.zeros(3, 256)
    for t in range(3):
        for j in range(2):
            e = int(index[t, j])
            if e >= 4:  # an expert-parallel sentinel: nothing
                continue
            fused, down = experts.expert(e).gate_proj.group.layer, experts.expert(e).down_proj
            gu = fused_launch(hidden[t:t + 1], fused.weight, fused.weight_scale, None, torch.float32)
            h = experts._gate(gu)
            want[t] += fused_launch(h, down.weight, down.weight_scale, None, torch.float32)[0] * weights[t, j]
    with torch.no_grad():
        torch.testing.assert_close(experts(hidden, index, weights), want, rtol=1e-5, atol=1e-5)
        experts.grouped_max_pairs = 0  # the tiled GEMM: the same numbers, summation order aside
        torch.testing.assert_close(experts(hidden, index, weights), want, rtol=1e-4, atol=1e-4)
    for experts in _experts_layers(model):  # prefill sizes: the tiled experts GEMM
        experts.grouped_max_pairs = 0
    with torch.no_grad():
        tiled = model(IDS).logits.float()
    per_token = (tiled - loop).norm(dim=-1) / loop.norm(dim=-1)
    assert float(per_token.median()) < 0.05, per_token
    for experts in _experts_layers(model):  # back to the loop at once: the same linears, now views of the stack
        experts.grouped = False
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits.float(), loop, rtol=1e-5, atol=1e-5)


def test_experts_that_cannot_stack_say_why_and_keep_the_loop(moe):
    path = moe("qwen3_moe", moe_intermediate=96)  # gate/up of 96 rows: not whole blocks
    model, summary = load_pretrained(path, device="cpu", dtype=torch.float32)
    _grouped_on(model)
    experts = _experts_layers(model)[0]
    assert experts.stacked is None and "not a multiple of 128" in experts.grouped_reason
    model2, _ = load_pretrained(moe("qwen3_moe"), device="cpu", dtype=torch.float32, backend="torch")
    _grouped_on(model2)
    assert "explicit GEMM provider" in _experts_layers(model2)[0].grouped_reason
    model3, _ = load_pretrained(moe("qwen3_moe"), device="cpu", dtype=torch.float32)
    _grouped_on(model3, on=False)
    assert _experts_layers(model3)[0].grouped_reason == "switched off (grouped=False)"


def dequantized_logits(model) -> torch.Tensor:
    """``model``'s logits in fp32 with every FP8 linear's dequantized weight and unquantized inputs (each
    PerExpertLinears' experts through their dequantized linears): what FP8 activations approximate."""
    from fp8_backends.core import reference

    def dense(lin):
        w = lin.weight.float()
        s = lin.weight_scale.float()
        return reference.dequantize_block(lin.weight, s, lin.weight_block) if lin.weight_block else w * s.reshape(-1, 1)

    saved = {}
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            saved[m] = m.forward
            m.forward = (lambda w: (lambda x: (x.float() @ w.t()).to(x.dtype)))(dense(m))
        if isinstance(m, PerExpertLinears):
            saved[m] = m.grouped
            m.grouped = False
    try:
        with torch.no_grad():
            return model(IDS).logits.float()
    finally:
        for m, v in saved.items():
            if isinstance(m, PerExpertLinears):
                m.grouped = v
            else:
                m.forward = v


@needs_interpreter
@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_per_tensor_and_per_channel_experts_stack_with_a_scale_per_row(moe, scheme):
    """MoE checkpoints with per-tensor (Hugging Face ``fp8`` without blocks) or per-channel (compressed-tensors
    ``FP8_DYNAMIC``) expert weights stack too: one scale per output row (``[E, 2*I]``, ``[E, H]``), the linears views
    (a per-tensor one keeps its one value, a view of its first row's); the grouped paths quantize activations per
    group of 128 (finer than the checkpoint's per-token / per-tensor: no less accurate than the loop)."""
    model, summary = load_pretrained(moe("qwen3_moe", scheme=scheme), device="cpu", dtype=torch.float32)
    exact = dequantized_logits(model)
    with torch.no_grad():
        loop = model(IDS).logits.float()
    _grouped_on(model, max_pairs=0)  # the tiled GEMM for the model (the interpreter runs the GEMV's many programs
    for experts in _experts_layers(model):  # slowly: the GEMV is checked on one layer below)
        st = experts.stacked
        assert st is not None and experts.grouped_reason is None
        assert tuple(st.gate_up_scale.shape) == (4, 256) and tuple(st.down_scale.shape) == (4, 256)
        for e in range(4):
            fused, down = experts.expert(e).gate_proj.group.layer, experts.expert(e).down_proj
            assert experts.stacked.holds(fused) and experts.stacked.holds(down)
            assert down.weight_scale.numel() == (1 if scheme == "tensor" else 256)
            torch.testing.assert_close(st.down_scale[e], down.weight_scale.expand(256))
    with torch.no_grad():
        tiles = model(IDS).logits.float()

    def err(x, ref=exact):
        return float(((x - ref).norm(dim=-1) / ref.norm(dim=-1)).median())

    assert err(tiles) < 0.05 and err(tiles) <= 1.2 * err(loop), (err(tiles), err(loop))
    experts = _experts_layers(model)[0]  # the GEMV on one layer: the tiled GEMM's numbers up to the interpreter's
    torch.manual_seed(2)                 # rounding of the quantization inside its launch
    hidden, index, weights = torch.randn(3, 256), torch.tensor([[0, 3], [2, 3], [1, 1]]), torch.rand(3, 2)
    with torch.no_grad():
        tiled = experts(hidden, index, weights)
        experts.grouped_max_pairs = 64
        assert err(experts(hidden, index, weights), tiled) < 0.01


@needs_interpreter
def test_scales_processing_replaces_go_back_into_the_stack():
    """A fused gate/up of per-tensor shards is reduced to one scale (equal shards) or requantized to the larger one
    (in place, in the stack's rows) by processing: the stack's scales follow, so the stack dequantizes to what each
    linear does and the grouped paths stay near the loop (a stale scale would be off by the shards' 3x ratio)."""
    holder = _stacked_experts(weight_scale="per_tensor", fuse=True)
    experts = holder.experts
    st = experts.stacked
    for e in range(4):
        fused, down = experts.expert(e).gate_proj.group.layer, experts.expert(e).down_proj
        assert fused.weight_scale.numel() == 1 and st.holds(fused) and st.holds(down)
        torch.testing.assert_close(st.gate_up[e].float() * st.gate_up_scale[e][:, None],
                                   fused.weight.float() * fused.weight_scale, rtol=0, atol=0)
        torch.testing.assert_close(st.down[e].float() * st.down_scale[e][:, None],
                                   down.weight.float() * down.weight_scale, rtol=0, atol=0)
    torch.manual_seed(3)
    hidden, index, weights = torch.randn(5, 256), torch.randint(0, 4, (5, 2)), torch.rand(5, 2)
    with torch.no_grad():
        experts.grouped_max_pairs = 0
        grouped = experts(hidden, index, weights)
        experts.grouped = False
        loop = experts(hidden, index, weights)
    # the interpreter's fp32 -> fp8 rounding of the group-quantized activations adds ~0.1 here (on a GPU the two
    # agree as closely as their activation scales allow: bench/results/moe_experts)
    assert float((grouped - loop).norm() / loop.norm()) < 0.25


@needs_interpreter
def test_the_experts_gemv_and_gemm_compute_each_pair_against_its_own_expert():
    """GEMV: each (token, slot) pair's row equals the block GEMV of its token against its expert (same kernel body,
    bit for bit), times its routing weight; the tiled GEMM: the reference GEMM of the group-quantized token (ragged
    N and K, two tile heights); a sentinel id gives a zero row; bad operands: one library error."""
    from fp8_backends.providers.triton.block_gemm_ops import fused_launch
    from fp8_backends.providers.triton.experts_ops import experts_gemv

    torch.manual_seed(0)
    e_count, n, k, tokens, slots = 3, 200, 300, 3, 2  # ragged N and K
    blocks = [quantize_block(torch.randn(n, k)) for _ in range(e_count)]
    w, s = torch.stack([q for q, _ in blocks]), torch.stack([sc for _, sc in blocks])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w, s = w.to(dev), s.to(dev)
    x = torch.randn(tokens, k, dtype=torch.bfloat16, device=dev)
    ids = torch.tensor([0, 2, 1, 3, 2, 2], device=dev)
    rw = torch.rand(6, device=dev)
    got = experts_gemv(x, w, s, ids, rw, slots, torch.float32)
    for p in range(6):
        e = int(ids[p])
        if e >= e_count:
            assert not got[p].any()
            continue
        want = fused_launch(x[p // slots:p // slots + 1], w[e], s[e], None, torch.float32,
                            config="gemv_n16_g2_w2")[0] * rw[p]
        torch.testing.assert_close(got[p], want, rtol=1e-6, atol=1e-5)
    # the tiled GEMM on the same pairs: each row the reference GEMM of the group-quantized token and its expert
    from fp8_backends.core import reference
    from fp8_backends.providers.triton.experts_ops import experts_gemm
    from fp8_backends.providers.triton.group_quant_ops import triton_quant_per_token_group

    x_q, x_s = triton_quant_per_token_group(x, 128, torch.float8_e4m3fn, "row_major")
    for block_m in (16, 32):
        tiled = experts_gemm(x, w, s, ids, rw, slots, torch.float32, block_m=block_m)
        for p in range(6):
            e, t = int(ids[p]), p // slots
            want = (torch.zeros(n, device=dev) if e >= e_count else
                    reference.fp8_gemm(x_q[t:t + 1], w[e], x_s[t:t + 1], s[e], torch.float32)[0] * rw[p])
            torch.testing.assert_close(tiled[p], want, rtol=1e-5, atol=1e-4)
    # weight scales one per output row ([E, N]: per-channel checkpoints; per-tensor ones repeated): both kernels
    # against the dequantized rows (the GEMV quantizes in its launch, where the interpreter may round a code apart)
    rows = torch.rand(e_count, n, device=dev) * 0.02 + 0.001
    wq = w.float()
    deq_x = x_q.float() * x_s.repeat_interleave(128, dim=1)[:, :k]
    want_rows = torch.stack([torch.zeros(n, device=dev) if int(ids[p]) >= e_count else
                             (deq_x[p // slots] @ (wq[int(ids[p])] * rows[int(ids[p])][:, None]).T) * rw[p]
                             for p in range(6)])
    for got_rows in (experts_gemv(x, w, rows, ids, rw, slots, torch.float32),
                     experts_gemm(x, w, rows, ids, rw, slots, torch.float32, block_m=16)):
        assert not got_rows[3].any()
        torch.testing.assert_close(got_rows, want_rows, rtol=2e-2, atol=2e-2 * float(want_rows.abs().max()))
    torch.testing.assert_close(experts_gemm(x, w, rows, ids, rw, slots, torch.float32, block_m=16), want_rows,
                               rtol=1e-5, atol=1e-4)  # the GEMM takes the same quantized rows: exact up to order
    with pytest.raises(InvalidInputError, match="one per output row"):
        experts_gemv(x, w, rows[:, :10], ids, None, slots)
    with pytest.raises(InvalidInputError, match="routing weights"):
        experts_gemv(x, w, s, ids, rw[:3], slots)
    with pytest.raises(InvalidInputError, match="pairs need"):
        experts_gemv(x, w, s, ids, None, 1)
    with pytest.raises(InvalidInputError, match="scales must be float32"):
        experts_gemv(x, w, s[:, :1], ids, None, slots)
    with pytest.raises(InvalidInputError, match="3-D float8"):
        experts_gemv(x, w[0], s, ids, None, slots)


def _stacked_experts(dtype=torch.float32, weight_scale="block", fuse=False):
    """A stacked PerExpertLinears (4 experts, hidden 256, intermediate 128) built from a bf16 experts module and
    quantized by quantize_model (``weight_scale``), with grouped=True (the CPU: Triton's interpreter). ``fuse``:
    each expert's gate and up quantized on their own, then loaded as the shards of one fused layer (as a checkpoint
    loader does), per-tensor scales half the time equal (processing reduces them to one) and else requantized."""
    from fp8_backends import quantize_model
    from fp8_backends.layers.shared_input import SharedInputGroup

    original = tiny_moe("qwen3_moe").to(dtype).model.layers[0].mlp.experts
    gate_up, down = original.gate_up_proj.detach().clone(), original.down_proj.detach().clone()
    experts = PerExpertLinears.from_fused(original).to_empty(device="cuda" if torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        for e in range(4):
            experts.expert(e).gate_proj.weight.copy_(gate_up[e, :128])
            experts.expert(e).up_proj.weight.copy_(gate_up[e, 128:] * (1.0 if fuse and e % 2 else 3.0))
            experts.expert(e).down_proj.weight.copy_(down[e])
    holder = torch.nn.Module()
    holder.experts = experts
    quantize_model(holder, weight_scale=weight_scale, fuse=not fuse)
    if fuse:
        for e in range(4):
            ex = experts.expert(e)
            if e % 2:  # equal shard scales: processing keeps one value
                ex.up_proj.weight_scale.copy_(ex.gate_proj.weight_scale)
            fused = Fp8Linear.from_fused_shards([(lin.weight, lin.weight_scale) for lin in (ex.gate_proj, ex.up_proj)],
                                                act_scale=ex.gate_proj.act_scale, dtype=dtype,
                                                shard_scales="requantize", process=False)
            group = SharedInputGroup([128, 128], ["gate_proj", "up_proj"])
            ex.gate_proj, ex.up_proj = Fp8LinearSlice(group, 0, fused=fused), Fp8LinearSlice(group, 1)
    experts.grouped = True
    process_weights_after_loading(holder)
    assert experts.stacked is not None, experts.grouped_reason
    return holder


@needs_interpreter
def test_grouped_experts_edge_inputs_persistence_and_misuse(tmp_path):
    """Zero tokens, strided routing tensors, pickling, a state-dict load that replaces the linears' tensors, a
    backward, a move that changes nothing, and bad operands of the ops."""
    import io

    from fp8_backends.providers.triton.experts_ops import experts_gemm, experts_gemv

    holder = _stacked_experts()
    experts = holder.experts
    dev = experts.stacked.gate_up.device
    torch.manual_seed(0)
    hidden = torch.randn(3, 256, device=dev)
    index = torch.tensor([[0, 3], [2, 3], [1, 4]], device=dev)
    weights = torch.rand(3, 2, device=dev)
    with torch.no_grad():
        for max_pairs in (0, 64):  # tiles, GEMV (the default kept below)
            experts.grouped_max_pairs = max_pairs
            want = experts(hidden, index, weights)
            assert experts(hidden[:0], index[:0], weights[:0]).shape == (0, 256)
            wide_i = torch.stack((index, index), dim=2).reshape(3, 4)[:, ::2]  # strides (4, 2)
            wide_w = torch.stack((weights, weights), dim=2).reshape(3, 4)[:, ::2]
            torch.testing.assert_close(experts(hidden, wide_i, wide_w), want, rtol=0, atol=0)
        experts.grouped_max_pairs = 64
        buf = io.BytesIO()
        torch.save(holder, buf)
        buf.seek(0)
        restored = torch.load(buf, weights_only=False)
        torch.testing.assert_close(restored.experts(hidden, index, weights), want, rtol=0, atol=0)
        stack = experts.stacked
        holder.float()  # moves nothing: the stack stays
        assert experts.stacked is stack
        holder._apply(lambda t: t.clone())  # what a device move does: every tensor anew
        moved = experts.stacked
        assert moved is not None and moved.gate_up is not stack.gate_up
        assert all(moved.holds(lin) for lin in (experts.expert(2).gate_proj.group.layer, experts.expert(2).down_proj))
        torch.testing.assert_close(experts(hidden, index, weights), want, rtol=0, atol=0)
        state = {k: v.clone() for k, v in holder.state_dict().items()}
        state["experts.1.down_proj.weight_scale"] *= 2
        holder.load_state_dict(state, assign=True)
        assert experts.stacked is None
        process_weights_after_loading(holder)
        assert experts.stacked is not None and experts.stacked.holds(experts.expert(1).down_proj)
        doubled = experts(hidden, index, weights)
        assert not torch.allclose(doubled[2], want[2]) and torch.allclose(doubled[:2], want[:2])
    h = hidden.clone().requires_grad_()
    with pytest.raises(InvalidInputError, match="no backward"):
        experts(h, index, weights).sum().backward()
    st = experts.stacked
    ids = index.reshape(-1)
    for call, match in [
        (lambda: experts_gemv(hidden, st.down[:0], st.down_scale[:0], ids), "3-D float8"),
        (lambda: experts_gemv(hidden, st.gate_up, st.gate_up_scale, ids, None, 2, torch.int32), "out_dtype"),
        (lambda: experts_gemm(hidden, st.gate_up, st.gate_up_scale, ids, None, 2, block_m=24), "block_m"),
        (lambda: experts_gemv(hidden, st.gate_up, st.gate_up_scale, ids.tolist(), None, 2), "ids must be a tensor"),
        (lambda: experts_gemv(hidden, st.gate_up, st.gate_up_scale, (torch.arange(12, device=dev) % 4)[::2], None, 2),
         "contiguous"),
    ]:
        with pytest.raises(InvalidInputError, match=match):
            call()


def _route_many(ids: torch.Tensor, experts: int, block_m: int, chunk: int) -> tuple[torch.Tensor, ...]:
    """The routing over ``cdiv(P, chunk)`` programs (the count and place kernels) whatever P."""
    from fp8_backends.providers.triton import experts_ops
    from fp8_backends.providers.triton.experts_args import route_buffer_len, route_launches, route_sizes, route_views

    p = ids.shape[0]
    buf = ids.new_full((route_buffer_len(p, experts, block_m, chunk, 0),), -5, dtype=torch.int32)
    launches = route_launches(ids, experts, block_m, buf, chunk, 4, 0)
    assert len(launches) == 2 and launches[0][1] == (-(-p // chunk),)
    for kernel, grid, args, warps in launches:
        experts_ops._launch_on(kernel, grid, args, warps, 1, max(ids.get_device(), 0))
    return route_views(buf, p, route_sizes(p, experts, block_m)[0])[:4]


@needs_interpreter
@pytest.mark.parametrize("experts,pairs,block_m,form", [
    (4, 6, 16, "one"), (128, 64, 16, "one"), (256, 4096, 32, "one"), (5, 300, 64, "one"), (127, 2500, 16, "one"),
    (3, 1, 64, "one"), (4, 6, 16, "many"), (128, 700, 16, "many"), (5, 1000, 64, "many"), (3, 1, 64, "many"),
    (60, 9000, 32, "op")])
def test_the_routing_puts_every_pair_in_one_tile_of_its_expert(experts, pairs, block_m, form):
    """The routing sorts the pairs by expert and plans the tiles: the order is a permutation sorted by expert (ids
    outside [0, E) last, int32 or int64 ids alike); every pair lies in exactly one tile of its expert, or of the
    pairs without one (tile expert E); the unused tiles, all after the used ones, are marked > E. In one program
    (``one``), over many (``many``: 128 ids a program here), and as the op runs it past its one-program bound
    (``op``: two launches of 2048 ids a program)."""
    from fp8_backends.providers.triton import experts_ops
    from fp8_backends.providers.triton.experts_args import ROUTE_ONE_PROGRAM_MAX, route_chunks

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(pairs)
    ids = torch.randint(-2, experts + 2, (pairs,), device=dev)
    clean = torch.where((ids >= 0) & (ids < experts), ids, experts)

    def plan(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if form == "many":
            return _route_many(ids, experts, block_m, 128)
        assert (route_chunks(pairs) > 0) == (form == "op") == (pairs > ROUTE_ONE_PROGRAM_MAX)
        return experts_ops.tile_plan(ids, experts, block_m)

    order = _assert_plan(plan(ids), ids, experts, block_m)
    order32 = plan(ids.int())[0]
    assert torch.equal(clean[order32.long()], clean[order.long()])


def _assert_plan(plan: tuple[torch.Tensor, ...], ids: torch.Tensor, experts: int, block_m: int) -> torch.Tensor:
    """``plan`` is a routing of ``ids`` (module docstring of the experts kernels); returns its order."""
    from fp8_backends.providers.triton.experts_args import route_sizes

    order, tile_expert, tile_row0, tile_end = plan
    pairs = ids.shape[0]
    clean = torch.where((ids >= 0) & (ids < experts), ids, experts)
    assert sorted(order.tolist()) == list(range(pairs))
    assert bool((clean[order.long()].diff() >= 0).all())
    assert tile_expert.shape == (route_sizes(pairs, experts, block_m)[0],)
    used = (tile_expert <= experts).tolist()
    assert used == sorted(used, reverse=True)  # used tiles first
    covered = []
    for t in range(sum(used)):
        e, row0, end = int(tile_expert[t]), int(tile_row0[t]), int(tile_end[t])
        rows = order[row0:min(row0 + block_m, end)].long()
        assert rows.numel() and bool((clean[rows] == e).all()), (t, e, row0, end)
        covered += rows.tolist()
    assert sorted(covered) == list(range(pairs))
    return order


@needs_interpreter
@pytest.mark.parametrize("pairs", [300, 9000])
def test_the_routing_op_under_torch_compile_plans_both_forms(pairs):
    """``torch.compile`` of the routing (the ``triton_experts_route`` op: one launch, or past the one-program bound
    two) gives a right plan (Inductor on a GPU, AOT eager on Triton's interpreter)."""
    from fp8_backends.providers.triton import experts_ops

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(pairs)
    ids = torch.randint(-1, 34, (pairs,), device=dev)
    torch._dynamo.reset()
    try:
        route = torch.compile(lambda i: experts_ops.tile_plan(i, 32, 32), fullgraph=True,
                              backend="inductor" if dev == "cuda" else "aot_eager")
        _assert_plan(route(ids), ids, 32, 32)
    finally:
        torch._dynamo.reset()


@needs_interpreter
def test_the_tiled_experts_gemm_writes_every_row_itself(monkeypatch):
    """The tiled GEMM's output is not zero-filled first: the tiles of pairs without an expert write their zero rows,
    the others their results (outputs allocated with NaN here give the same answer)."""
    from fp8_backends.providers.triton.experts_ops import experts_gemm

    torch.manual_seed(1)
    e_count, n, k = 4, 160, 256
    blocks = [quantize_block(torch.randn(n, k)) for _ in range(e_count)]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = torch.stack([q for q, _ in blocks]).to(dev)
    s = torch.stack([sc for _, sc in blocks]).to(dev)
    x = torch.randn(40, k, dtype=torch.bfloat16, device=dev)
    ids = torch.randint(-1, e_count + 1, (80,), device=dev)
    ids[:3] = e_count  # some pairs without an expert, whatever the draw
    want = experts_gemm(x, w, s, ids, None, 2, torch.float32, block_m=16)
    empty = torch.Tensor.new_empty

    def poisoned(t: torch.Tensor, *args, **kwargs):
        out = empty(t, *args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    got = experts_gemm(x, w, s, ids, None, 2, torch.float32, block_m=16)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # either grid order (a tile's row blocks together, or a row block's tiles together): the same rows
    from fp8_backends.providers.triton.experts_ops import gemm_launch, tile_plan
    from fp8_backends.providers.triton.group_quant_ops import triton_quant_per_token_group

    x_q, x_s = triton_quant_per_token_group(x, 128, w.dtype, "row_major")
    for n_first in (True, False):
        by_order = gemm_launch(x_q, x_s, w, s, *tile_plan(ids, e_count, 16), None, 2, 16, torch.float32, n_first)
        assert not by_order.isnan().any()
        torch.testing.assert_close(by_order, want, rtol=0, atol=0)
    outside = (ids < 0) | (ids >= e_count)
    assert not got[outside].any() and got[~outside].abs().sum(dim=1).min() > 0


@pytest.mark.gpu
def test_a_moe_checkpoint_on_the_gpu_runs_grouped_in_cuda_graphs_and_the_loop_refuses_a_capture(moe):
    path = moe("deepseek_v3")
    ref = reference_logits(path)
    model, summary = load_pretrained(path, device="cuda")
    experts = _experts_layers(model)
    assert all(m.stacked is not None for m in experts), [m.grouped_reason for m in experts]
    assert not any("without the grouped experts paths" in n for n in summary.notes)
    ids = IDS.to("cuda")
    with torch.no_grad():
        for max_pairs, grouped in ((10**6, None), (0, None), (0, False)):  # experts GEMV, tiled GEMM, the loop
            for m in experts:
                m.grouped_max_pairs, m.grouped = max_pairs, grouped
            got = model(ids).logits.float().cpu()
            per_token = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert float(per_token.median()) < BF16_MEDIAN, (max_pairs, grouped, per_token)
        for m in experts:
            m.grouped, m.grouped_max_pairs = None, 64
        for step in (ids[:, -1:].clone(), ids.clone()):  # decode sizes (the GEMV) and prefill sizes (tiles)
            eager = model(step).logits
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                out = model(step).logits
            graph.replay()
            torch.testing.assert_close(out, eager, rtol=0, atol=0)
        for m in experts:
            m.grouped = False
        process_weights_after_loading(model)
        with pytest.raises(InvalidInputError, match="cannot be captured in a CUDA graph"), \
                torch.cuda.graph(torch.cuda.CUDAGraph()):
            model(step)


def test_a_moe_model_served_per_expert_compiles(moe):
    """``torch.compile`` (a graph break where the hit experts are read) gives the eager logits."""
    model, _ = load_pretrained(moe("deepseek_v3"), device="cpu")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            eager = model(IDS).logits.float()
            compiled = torch.compile(model, backend="aot_eager")(IDS).logits.float()
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_a_failed_moe_state_dict_load_leaves_the_model_unchanged(moe):
    from safetensors.torch import load_file

    path = moe("qwen3_moe")
    config = json.loads((path / "config.json").read_text())
    model = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.from_pretrained(path)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    experts = model.model.layers[1].mlp.experts
    state = load_file(str(path / "model.safetensors"))
    state["model.layers.1.mlp.experts.2.gate_proj.weight_scale_inv"].fill_(float("nan"))  # found before any change
    with pytest.raises(CheckpointError, match="finite"):
        load_fp8_state_dict(model, state, config, dtype=torch.float32, device="cpu")
    assert model.model.layers[1].mlp.experts is experts and experts.gate_up_proj.shape == (4, 256, 256)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


#: other transformers 5 MoE families with 3-D experts (Qwen2-MoE with its gated shared expert, OLMoE, GLM-4-MoE)
OTHER_MOE = {
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", {"moe_intermediate_size": 128, "num_experts": 4,
                                                "num_experts_per_tok": 2, "shared_expert_intermediate_size": 256}),
    "OlmoeForCausalLM": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2}),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", {"moe_intermediate_size": 128, "n_routed_experts": 4,
                                              "num_experts_per_tok": 2, "n_shared_experts": 1,
                                              "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                                              "head_dim": 64}),
}


@pytest.mark.parametrize("arch", sorted(OTHER_MOE))
def test_other_moe_families_are_served_per_expert(tmp_path, arch):
    from safetensors.torch import save_file

    config_name, extra = OTHER_MOE[arch]
    if not hasattr(transformers, config_name):
        pytest.skip(f"this transformers has no {config_name}")
    config = getattr(transformers, config_name)(num_attention_heads=4, num_key_value_heads=2, architectures=[arch],
                                                **COMMON, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.bfloat16).eval()
    keep = ("lm_head", "gate", "shared_expert_gate")
    out = {}
    for key, value in per_expert_state(model).items():
        module = key.rpartition(".")[0]
        leaf = module.rpartition(".")[2]
        if key.endswith(".weight") and value.dim() == 2 and "embed" not in key and leaf not in keep:
            out[key], out[f"{module}.weight_scale_inv"] = quantize_block(value)
        else:
            out[key] = value.contiguous()
    save_file(out, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    saved = model.config.to_dict()
    saved["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128], "modules_to_not_convert": list(keep)}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    served, summary = load_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert any("MoE layer(s) with experts stored one by one" in note for note in summary.notes)
    with torch.no_grad():
        got = served(IDS).logits.float()
    assert_matches(got, reference_logits(tmp_path))


#: Mixtral's checkpoints as they ship: the MoE block ``block_sparse_moe`` (the model's ``mlp``), the experts'
#: projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down); PhiMoE's also name the router ``gate`` (the model's
#: ``router``)
MIXTRAL_NAMES = [(r"\.mlp\.", ".block_sparse_moe."), (r"(experts\.\d+)\.gate_proj\.", r"\1.w1."),
                 (r"(experts\.\d+)\.up_proj\.", r"\1.w3."), (r"(experts\.\d+)\.down_proj\.", r"\1.w2.")]
RENAMED_MOE = {"MixtralForCausalLM": ("MixtralConfig", MIXTRAL_NAMES),
               "PhimoeForCausalLM": ("PhimoeConfig", [(r"\.mlp\.router\.", ".mlp.gate."), *MIXTRAL_NAMES])}


@pytest.mark.parametrize("arch", sorted(RENAMED_MOE))
def test_a_checkpoint_named_as_mixtral_ships_is_read_under_the_model_names(tmp_path, arch):
    """A checkpoint named as Mixtral's (PhiMoE's) ship (``block_sparse_moe.experts.<e>.w1`` ...) loads under the
    model's names (transformers' conversion mapping for the family), with its config's module names read as stored
    (``modules_to_not_convert`` naming one layer's experts by their stored name keeps them in bf16), and gives the
    logits of the same checkpoint under the model's names, from a folder and as a state dict."""
    import re

    from safetensors.torch import save_file

    config_name, names = RENAMED_MOE[arch]
    if not hasattr(transformers, config_name):
        pytest.skip(f"this transformers has no {config_name}")
    config = getattr(transformers, config_name)(num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                                num_experts_per_tok=2, architectures=[arch], **COMMON)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).to(torch.bfloat16).eval()
    kept_experts = "model.layers.1.mlp.experts."
    out = {}
    for key, value in per_expert_state(model).items():
        module = key.rpartition(".")[0]
        if (key.endswith(".weight") and value.dim() == 2 and ".experts." in key and not key.startswith(kept_experts)) \
                or (key.endswith(".weight") and "self_attn" in key):
            out[key], out[f"{module}.weight_scale_inv"] = quantize_block(value)
        else:
            out[key] = value.contiguous()
    saved = model.config.to_dict()
    folders = {}
    for form, renames in (("model", []), ("shipped", names)):
        folder = tmp_path / form
        folder.mkdir()
        named = {}
        for key, value in out.items():
            for pattern, repl in renames:
                key = re.sub(pattern, repl, key)
            named[key] = value
        save_file(named, str(folder / "model.safetensors"), metadata={"format": "pt"})
        skip = (["lm_head", "block_sparse_moe.gate", "model.layers.1.block_sparse_moe.experts"] if renames else
                ["lm_head", "mlp.router", "mlp.gate", kept_experts.rstrip(".")])  # the router: PhiMoE's is a Linear
        saved["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128], "modules_to_not_convert": skip}
        (folder / "config.json").write_text(json.dumps(saved))
        folders[form] = folder
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight_scale_inv" in load_file_keys(folders["shipped"])
    served, summary = load_pretrained(folders["shipped"], device="cpu", dtype=torch.float32)
    assert any("read under the model's names" in note and "w1 -> gate_proj" in note for note in summary.notes), \
        summary.notes
    assert not summary.ignored
    layer0, layer1 = _experts_layers(served)
    assert isinstance(layer0.expert(3).down_proj, Fp8Linear) and not isinstance(layer1.expert(3).down_proj, Fp8Linear)
    with torch.no_grad():
        got = served(IDS).logits.float()
    assert_matches(got, reference_logits(folders["model"]))
    # the same tensors as a state dict, into a model built from the config
    from safetensors.torch import load_file

    shipped_config = json.loads((folders["shipped"] / "config.json").read_text())
    built = getattr(transformers, arch)(transformers.AutoConfig.from_pretrained(folders["shipped"])).eval()
    summary = load_fp8_state_dict(built, load_file(str(folders["shipped"] / "model.safetensors")), shipped_config,
                                  dtype=torch.float32, device="cpu")
    assert any("read under the model's names" in note for note in summary.notes)
    with torch.no_grad():
        torch.testing.assert_close(built(IDS).logits.float(), got, rtol=0, atol=0)


def load_file_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())
