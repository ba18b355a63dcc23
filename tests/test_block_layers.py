"""Block-wise FP8 in the layers: ``Fp8Linear(weight_scale="block")``, fused block shards, ``RMSNormFp8Quant`` handing
group-quantized activations, ``quantize_model(weight_scale="block")``; eager, general path and ``torch.compile``."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from fp8_backends import QuantizedActivation, quantize_model
from fp8_backends.core import group_scales, reference
from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.types import ActScale, ScaleLayout, WeightScale
from fp8_backends.layers import Fp8Linear, RMSNormFp8Quant
from fp8_backends.layers.general_path import apply_fp8_linear
from fp8_backends.registry import policy, resolution


def _linear(n=208, k=304, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.mul_(4)
    return lin


def _reference(layer: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's output by the reference: the input quantized per token group, the block GEMM in fp32."""
    x2 = x.reshape(-1, layer.in_features)
    xq, xs = reference.quantize_per_token_group(x2, layer.group_size)
    bias = None if layer.bias is None else layer.bias.float()
    y = reference.fp8_gemm(xq, layer.weight, xs, layer.weight_scale, torch.float32, bias, group_size=layer.group_size,
                           weight_block=layer.weight_block)
    return y.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("n,k", [(208, 304), (256, 128), (96, 48)])
def test_block_linear_eager_general_and_compiled_match_the_reference(n, k):
    layer = Fp8Linear.from_linear(_linear(n, k), weight_scale="block")
    assert layer.act_scale is ActScale.PER_TOKEN_GROUP and layer.weight_scale_mode is WeightScale.BLOCK
    assert tuple(layer.weight_scale.shape) == (-(-n // 128), -(-k // 128)) and "w=block" in repr(layer)
    x = torch.randn(3, 5, k, dtype=torch.bfloat16)
    ref = _reference(layer, x)
    y = layer(x)
    assert y.shape == (3, 5, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    general = apply_fp8_linear(x, layer.kernel, act_scale=layer.act_scale, bias=layer.bias, out_dtype=layer.out_dtype)
    assert torch.equal(general, y)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)(x)
    torch.testing.assert_close(compiled.float(), y.float(), rtol=1e-2, atol=1e-2)


def test_block_linear_takes_a_group_quantized_activation_in_any_layout():
    layer = Fp8Linear.from_linear(_linear(), weight_scale="block")
    x = torch.randn(7, 304, dtype=torch.bfloat16)
    y = layer(x)
    for layout in ScaleLayout:
        xq, xs = reference.quantize_per_token_group(x)
        qa = QuantizedActivation(xq, group_scales.to_layout(xs, layout), torch.bfloat16, ActScale.PER_TOKEN_GROUP)
        assert torch.equal(layer(qa), y)
    with pytest.raises(InvalidInputError, match="per-token-group scale"):
        layer(QuantizedActivation(xq, torch.ones(7, 1), torch.bfloat16, ActScale.PER_TOKEN_GROUP))
    with pytest.raises(InvalidInputError, match="never re-quantizes"):
        layer(QuantizedActivation(xq, torch.ones(7, 1), torch.bfloat16, ActScale.PER_TOKEN))


def test_block_linear_loads_checkpoint_scales_in_bf16_and_refuses_bad_ones():
    w_q, w_s = reference.quantize_block(torch.randn(208, 304) * 0.05)
    layer = Fp8Linear(304, 208, weight_scale="block")
    layer.load_weights(w_q, w_s.bfloat16())
    layer.process_weights_after_loading()
    assert layer.weight_scale.dtype == torch.float32
    with pytest.raises(InvalidInputError, match=r"\[ceil\(N/128\), ceil\(K/128\)\] = \[2, 3\]"):
        Fp8Linear(304, 208, weight_scale="block").load_weights(w_q, w_s[:, :2])
    bad = Fp8Linear(304, 208, weight_scale="block")
    bad.load_weights(w_q, w_s * float("nan"))
    with pytest.raises(InvalidInputError, match="NaN"):
        bad.process_weights_after_loading()
    with pytest.raises(InvalidInputError, match="pair"):
        Fp8Linear(304, 208, weight_scale="block", act_scale="per_token")
    with pytest.raises(InvalidInputError, match="pair"):
        Fp8Linear(304, 208, act_scale="per_token_group")


def test_fused_block_shards_keep_their_blocks():
    """q/k/v checkpoints with their own block scales: each shard's blocks go to its rows (no requantization)."""
    sizes = [256, 128, 128]
    shards = [reference.quantize_block(torch.randn(rows, 192) * 0.05) for rows in sizes]
    layer = Fp8Linear(192, sum(sizes), weight_scale="block", shard_sizes=sizes)
    for i, (w_q, w_s) in enumerate(shards):
        layer.load_shard(i, w_q, w_s)
    layer.process_weights_after_loading()
    assert torch.equal(layer.weight_scale, torch.cat([s for _, s in shards]))
    x = torch.randn(4, 192, dtype=torch.bfloat16)
    y = layer(x)
    for i, (w_q, w_s) in enumerate(shards):
        xq, xs = reference.quantize_per_token_group(x)
        part = reference.fp8_gemm(xq, w_q, xs, w_s, torch.float32)
        start = sum(sizes[:i])
        torch.testing.assert_close(y[:, start:start + sizes[i]].float(), part, rtol=1e-2, atol=1e-2)
    with pytest.raises(InvalidInputError, match="straddle"):
        Fp8Linear(192, 200, weight_scale="block", shard_sizes=[100, 100])


@pytest.mark.parametrize("residual", [False, True])
def test_norm_hands_a_block_linear_group_scales(residual):
    torch.manual_seed(1)
    lin = Fp8Linear.from_linear(_linear(256, 320), weight_scale="block")
    norm = RMSNormFp8Quant(320, quant_linear=lin)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(320) + 0.5)
    norm.process_weights_after_loading()
    assert norm.emits_quantized
    x = torch.randn(2, 3, 320, dtype=torch.bfloat16)
    res = torch.randn(2, 3, 320, dtype=torch.bfloat16) if residual else None
    res_in = None if res is None else res.clone()
    out = norm(x, res) if residual else norm(x)
    qa = out[0] if residual else out
    assert isinstance(qa, QuantizedActivation) and qa.mode is ActScale.PER_TOKEN_GROUP
    want_layout = lin.gemm_backend.capabilities.group_scale_layout
    assert group_scales.is_layout(qa.scale, want_layout)
    q, s, total = reference.rmsnorm_quant_dynamic(x.reshape(-1, 320), norm.weight, norm.eps,
                                                  act_scale="per_token_group",
                                                  residual=None if res_in is None else res_in.reshape(-1, 320))
    assert torch.equal(qa.scale, s)
    assert torch.equal(qa.data.reshape(-1, 320).view(torch.uint8), q.view(torch.uint8))
    if residual:
        assert torch.equal(res.reshape(-1, 320), total)
    y = lin(qa)
    assert y.shape == (2, 3, 256)


def test_compiled_block_linear_quantizes_for_each_buckets_provider_in_its_layout(monkeypatch):
    """A per-M block layer over two providers that read different activation-scale layouts (M <= 8: a provider
    reading ``m_major_tma``; above: ``torch_scaled_mm``, ``m_major``): each compiled bucket quantizes with the scale
    written in its provider's layout (no relayout in the call), with dynamic M, and the outputs are the eager ones."""
    import dataclasses

    import fake_provider

    from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend

    seen: list[tuple[str, ScaleLayout]] = []

    class PaddedScales(TorchScaledMMBackend):
        name = "fake_mm"
        capabilities = dataclasses.replace(TorchScaledMMBackend.capabilities, priority=1,
                                           group_scale_layout=ScaleLayout.M_MAJOR_TMA)

    for cls in (PaddedScales, TorchScaledMMBackend):
        real = cls.gemm_impl

        def recording(self, x_q, prepared, x_scale, out_dtype, bias, _real=real):
            layout = self.capabilities.group_scale_layout
            assert group_scales.is_layout(x_scale, layout), (self.name, x_scale.shape, x_scale.stride())
            seen.append((self.name, layout))
            return _real(self, x_q, prepared, x_scale, out_dtype, bias)

        monkeypatch.setattr(cls, "gemm_impl", recording)
    fake_provider.install(monkeypatch, PaddedScales)
    resolution.load_builtin_policies()
    monkeypatch.setattr(policy, "_registered", list(policy._registered))
    resolution.register_selection_policy(fake_provider.SplitAt8())
    layer = Fp8Linear.from_linear(_linear(256, 384, bias=False), weight_scale="block")
    assert [r.backend.name for r in layer.kernel.rows] == ["fake_mm", "torch_scaled_mm"]
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for m in (3, 6, 13, 130):
        x = torch.randn(m, 384, dtype=torch.bfloat16)
        seen.clear()
        want = layer(x)
        assert torch.equal(compiled(x), want) or _rel(compiled(x), want) < 1e-3, m
        assert {name for name, _ in seen} == {"fake_mm" if m <= 8 else "torch_scaled_mm"}


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_block_linear_quantizes_a_dynamic_m_with_the_traced_group_kernel(monkeypatch, dynamic):
    """A per-token-group implementation's ``traced`` callable (what the Triton one names: its ``triton_op``) is what a
    compiled layer quantizes more than one token with (static or dynamic M); one token (a size Dynamo always
    specializes) goes through the torch ops Inductor fuses into the producer."""
    from fp8_backends import quant

    traced_ms: list[object] = []

    def traced(x, group_size, scale_layout, fp8_dtype):
        traced_ms.append(x.shape[0])  # runs while Dynamo traces: records the (symbolic) M it was traced for
        return quant.traced_quantize_groups(x, group_size, fp8_dtype, 448.0, ScaleLayout(scale_layout))

    def impl(x, group_size, scale_layout, fp8_dtype):
        return quant.quantize_per_token_group(x, group_size, fp8_dtype, scale_layout)

    impl.traced = traced
    previous = quant.register_quant_impl("per_token_group", "cpu", impl)
    try:
        assert quant.traced_group_kernel("cpu") is traced
        layer = Fp8Linear.from_linear(_linear(256, 384, bias=False), weight_scale="block")
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic)
        for m in (1, 5, 12):
            x = torch.randn(m, 384, dtype=torch.bfloat16)
            assert _rel(compiled(x), _reference(layer, x)) < 1e-2
    finally:
        quant.register_quant_impl("per_token_group", "cpu", previous)
    assert traced_ms == [5, 12]  # traced (once per M bucket: a recompile each) for M = 5 and 12, never for M = 1
    assert quant.traced_group_kernel("cpu") is None  # the reference torch code names none


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1: conftest.py sets it)")
def test_compiled_block_linear_hands_one_token_to_a_provider_that_quantizes_in_its_launch(monkeypatch):
    """The ``triton`` provider quantizes one token inside its block GEMV (``traced_fused_quant_max_m`` = 1): a
    compiled layer on it hands M = 1 over unquantized (the fused op), quantizes M > 1 itself, and gives a quantized
    activation the quantized path at any M; outputs as the eager layer's (whose M = 1 call is the same fused
    launch); a bad one-token input still gets the library's error."""
    from fp8_backends.providers.triton.gemm import TritonGemmBackend

    fused_ms: list[object] = []
    real = TritonGemmBackend.traced_fused_quant_gemm_impl

    def recording(self, x, prepared, act_scale, input_scale, out_dtype, bias):
        fused_ms.append(x.shape[0])  # while Dynamo traces
        return real(self, x, prepared, act_scale, input_scale, out_dtype, bias)

    monkeypatch.setattr(TritonGemmBackend, "traced_fused_quant_gemm_impl", recording)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: Triton's interpreter (conftest.py sets it)
    layer = Fp8Linear.from_linear(_linear(256, 384).to(dev), weight_scale="block", backend="triton")
    assert layer.kernel.backend.traced_fused_quant_max_m(layer.kernel.prepared, ActScale.PER_TOKEN_GROUP) == 1
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    for shape in ((1, 384), (1, 1, 384), (3, 384)):
        x = torch.randn(*shape, dtype=torch.bfloat16, device=dev) * 4
        fused_ms.clear()
        assert torch.equal(compiled(x), layer(x)), shape
        assert fused_ms == ([1] if shape[-2] == 1 else []), shape
        xq, xs = reference.quantize_per_token_group(x.reshape(-1, 384))
        qa = QuantizedActivation(xq.reshape(x.shape), xs, torch.bfloat16, ActScale.PER_TOKEN_GROUP)
        fused_ms.clear()
        assert _rel(compiled(qa), layer(qa)) < 1e-3 and fused_ms == [], shape
    for bad, message in [(torch.randn(1, 256, dtype=torch.bfloat16, device=dev), "K=384"),
                         (torch.randn(1, 384, dtype=torch.float16, device=dev), "prepared for torch.bfloat16")]:
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(layer, fullgraph=True)(bad)
        assert message in str(info.value)


def test_traced_plan_fuses_the_buckets_a_provider_quantizes_in_its_launch():
    """Which M of each bucket a plan hands over unquantized: the whole bucket where the provider's bound covers it,
    up to that bound in the bucket that straddles it (the last bucket included), nowhere past it."""
    from types import SimpleNamespace

    from fp8_backends.layers.traced_plan import _fused_bounds

    def row(bucket, upto):
        return SimpleNamespace(bucket=bucket, prepared=None,
                               backend=SimpleNamespace(traced_fused_quant_max_m=lambda prepared, mode: upto))

    mode = ActScale.PER_TOKEN_GROUP
    assert _fused_bounds([row(1, 1), row(16, 1), row(1 << 62, 1)], mode) == [-1, None, None]
    assert _fused_bounds([row(4, 8), row(16, 8), row(1 << 62, 8)], mode) == [-1, 8, None]
    assert _fused_bounds([row(1 << 62, 1)], mode) == [1]
    assert _fused_bounds([row(1, 0), row(1 << 62, 0)], mode) == [None, None]
    assert _fused_bounds([row(1, 0), row(1 << 62, 1)], mode) == [None, None]  # its bucket starts past its bound


def test_compiled_block_linear_refuses_bad_inputs_with_the_library_error():
    """The compiled block plan picks its M bucket before the input is checked: whatever bucket a bad input lands in,
    its check raises the library's message (wrong K, wrong dtype, a quantized activation in another mode)."""
    layer = Fp8Linear.from_linear(_linear(256, 384, bias=False), weight_scale="block")
    for bad, message in [(torch.randn(3, 256, dtype=torch.bfloat16), "K=384"),
                         (torch.randn(3, 384, dtype=torch.float16), "prepared for torch.bfloat16"),
                         (QuantizedActivation(torch.zeros(3, 384).to(torch.float8_e4m3fn), torch.ones(3, 1),
                                              torch.bfloat16, "per_token"), "never re-quantizes")]:
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(layer, fullgraph=True)(bad)
        assert message in str(info.value)


def test_quantize_model_block_on_a_transformers_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        want = model(ids).logits.float()
    summary = quantize_model(model, weight_scale="block")
    assert summary.weight_scale == "block" and summary.act_scale == "per_token_group" and summary.fused
    with torch.no_grad():
        got = model(ids).logits.float()
    assert (got - want).norm() / want.norm() < 0.1
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 15)
    with pytest.raises(InvalidInputError, match="pair"):
        quantize_model(nn.Sequential(nn.Linear(128, 128)), weight_scale="block", act_scale="per_token")


class _Attention(nn.Module):
    def __init__(self, q: int, kv: int, k: int = 256) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(k, n, bias=False).to(torch.bfloat16) for n in (q, kv, kv))


def test_quantize_model_block_fuses_siblings_only_on_whole_blocks():
    """q/k/v of 200/72/72 rows would share a 128-row block between q and k: quantized one by one, and the summary
    says why; 256/128/128 fuse, and each sibling's weight_scale is its own rows of blocks."""
    torch.manual_seed(0)
    ragged = nn.Sequential(_Attention(200, 72))
    summary = quantize_model(ragged, weight_scale="block")
    assert not summary.fused and summary.count == 3
    assert [names for names, _ in summary.not_fused] == ["0.q_proj+0.k_proj+0.v_proj"]
    assert "straddle" in summary.not_fused[0][1] and "not fused 1:" in str(summary)
    assert all(isinstance(m, Fp8Linear) for m in ragged[0].children())
    aligned = nn.Sequential(_Attention(256, 128))
    original = {name: lin.weight.detach().float().clone() for name, lin in aligned[0].named_children()}
    summary = quantize_model(aligned, weight_scale="block")
    assert len(summary.fused) == 1 and not summary.not_fused
    for name, piece in aligned[0].named_children():
        assert tuple(piece.weight_scale.shape) == (-(-piece.out_features // 128), 2), name
        w = reference.dequantize_block(piece.weight, piece.weight_scale)
        assert ((w - original[name]).norm() / original[name].norm()).item() < 0.05, name


def test_blocks_straddle_shards_where_a_shard_but_the_last_is_ragged():
    from fp8_backends.core.validation import blocks_straddle_shards

    assert not blocks_straddle_shards([1536, 576], 128)  # DeepSeek-V3's q_a + kv_a: the ragged one last
    assert not blocks_straddle_shards([256, 128, 72], 128) and not blocks_straddle_shards([200], 128)
    assert blocks_straddle_shards([576, 1536], 128) and blocks_straddle_shards([200, 72, 72], 128)
    assert not blocks_straddle_shards([192, 160], 64)


def _tiny_deepseek_v3(transformers, q_lora_rank: int) -> nn.Module:
    """Two dense DeepSeek-V3 layers (MLA: q_a_proj [q_lora_rank, 256], kv_a_proj_with_mqa [128 + 32, 256])."""
    cfg = transformers.DeepseekV3Config(
        hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()


def test_quantize_model_block_runs_mla_down_projections_as_one_gemm():
    """DeepSeek-V3's q_a_proj and kv_a_proj_with_mqa read the same hidden states: one fused GEMM (as engines run
    them) whose logits are those of the two layers quantized apart (their blocks are the same); where q_lora_rank
    is not whole 128-row blocks they stay apart and the summary says why."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV3Config"):
        pytest.skip("this transformers has no DeepSeek-V3")
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(3))
    fused, apart = _tiny_deepseek_v3(transformers, 256), _tiny_deepseek_v3(transformers, 256)
    summary = quantize_model(fused, weight_scale="block")
    quantize_model(apart, weight_scale="block", fuse=False)
    groups = [(parent, names) for parent, names, _ in summary.fused]
    assert ("model.layers.0.self_attn", ("q_a_proj", "kv_a_proj_with_mqa")) in groups
    attn = fused.model.layers[0].self_attn
    assert (attn.q_a_proj.fused.out_features, attn.kv_a_proj_with_mqa.start) == (256 + 160, 256)
    with torch.no_grad():
        got, want = fused(ids).logits.float(), apart(ids).logits.float()
    assert ((got - want).norm() / want.norm()).item() < 1e-3  # the same blocks: summation order aside
    ragged = _tiny_deepseek_v3(transformers, 192)
    summary = quantize_model(ragged, weight_scale="block")
    assert "model.layers.0.self_attn.q_a_proj+model.layers.0.self_attn.kv_a_proj_with_mqa" in [
        names for names, _ in summary.not_fused]
    assert isinstance(ragged.model.layers[0].self_attn.kv_a_proj_with_mqa, Fp8Linear)


def test_quantize_model_raises_where_the_environment_names_a_backend_that_cannot_serve(monkeypatch):
    """FP8_GEMM_BACKEND is an explicit choice, as a backend= argument is: no layer is skipped in silence."""
    import dataclasses

    from fp8_backends.core.errors import UnsupportedProblemError
    from fp8_backends.core.types import DeviceKind
    from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend
    from fp8_backends.registry.registration import register_provider

    class CudaOnlyBlock(TorchScaledMMBackend):  # serves block-wise FP8, but on CUDA tensors only
        name = "cuda_only_block"
        aliases = ()
        capabilities = dataclasses.replace(TorchScaledMMBackend.capabilities, devices=frozenset({DeviceKind.CUDA}))

    monkeypatch.setenv("FP8_GEMM_BACKEND", "cuda_only_block")
    model = nn.Sequential(nn.Linear(256, 128).to(torch.bfloat16))
    with register_provider(CudaOnlyBlock, dist="fp8-backends-tests"), pytest.raises(UnsupportedProblemError,
                                                                                   match="cuda_only_block"):
        quantize_model(model, weight_scale="block")
    assert type(model[0]) is nn.Linear


def test_fp8_linear_with_a_block_weight_defaults_to_groups_and_refuses_other_modes_first(monkeypatch):
    """The functional call with a block-scaled weight: per-token-group activations by default (the one mode it pairs
    with); another mode is refused before the activation is quantized."""
    from fp8_backends import GemmProblem, fp8_linear, resolve_gemm_backend
    from fp8_backends.layers import general_path

    w_q, w_s = reference.quantize_block(torch.randn(200, 256) * 0.05)
    backend = resolve_gemm_backend("auto", problem=GemmProblem(n=200, k=256, act_scale="per_token_group",
                                                               weight_scale="block", device="cpu"))
    prepared = backend.prepare_weight(w_q, w_s)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    xq, xs = reference.quantize_per_token_group(x)
    want = reference.fp8_gemm(xq, w_q, xs, w_s, torch.float32)
    torch.testing.assert_close(fp8_linear(x, prepared, backend=backend).float(), want, rtol=2e-2, atol=2e-2)
    calls = []
    monkeypatch.setattr(general_path.quant, "quantize_checked", lambda *a, **k: calls.append(a))
    with pytest.raises(InvalidInputError, match="block weight scales do not pair with per_tensor_dynamic"):
        fp8_linear(x, prepared, backend=backend, act_scale="per_tensor_dynamic")
    assert calls == []


# ------------------------------------------------------------------------------------------------ GPU
def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error: elementwise bounds fail on FP8 rounding ties (a group's code one step apart where
    the GPU's scale and the reference's differ in the last bit moves a K = 7168 output by ~0.03)."""
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "torch_scaled_mm", "triton", "flashinfer_block", "cutlass"])
def test_gpu_block_linear_eager_compiled_and_graph(backend):
    """A block-wise layer on each GPU provider that serves it (skipped with the registry's reason otherwise): eager,
    compiled and replayed in a CUDA graph, against the reference, at decode and prefill M."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible to torch)")
    from fp8_backends.core.errors import Fp8BackendError

    lin = _linear(2112, 7168, bias=False).cuda()
    try:
        layer = Fp8Linear.from_linear(lin, weight_scale="block", backend=backend)
    except Fp8BackendError as exc:
        pytest.skip(f"{backend}: {exc}")
    for m in (1, 7, 64, 300):
        x = torch.randn(m, 7168, dtype=torch.bfloat16, device="cuda")
        ref = _reference(layer, x)
        y = layer(x)
        assert _rel(y, ref) < 1e-2, (backend, m, _rel(y, ref))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(16, 7168, dtype=torch.bfloat16, device="cuda")
    assert _rel(compiled(x), _reference(layer, x)) < 1e-2
    static = x.clone()
    layer(static)  # warm the shape outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static)
    static.copy_(torch.randn_like(static))
    graph.replay()
    assert _rel(out, _reference(layer, static)) < 1e-2


@pytest.mark.gpu
def test_gpu_compiled_torch_scaled_mm_block_layer_calls_scaled_mm_itself():
    """Where this torch's meta function serves block scales (asked at load time), a compiled block layer on
    ``torch_scaled_mm`` traces ``torch._scaled_mm`` itself (Inductor calls it: no opaque op and its Python body), at
    an M that is a multiple of 4 and one that is not (padded by torch ops); the outputs are the eager ones."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible to torch)")
    from torch._inductor.utils import run_and_get_code

    from fp8_backends.core.errors import Fp8BackendError
    from fp8_backends.providers import torch_block

    try:
        layer = Fp8Linear.from_linear(_linear(512, 1024, bias=True).cuda(), weight_scale="block",
                                      backend="torch_scaled_mm")
    except Fp8BackendError as exc:
        pytest.skip(f"torch_scaled_mm: {exc}")
    if not torch_block.traced_support(False) and not torch_block.traced_support(True):
        pytest.skip("this torch's _scaled_mm meta function knows no block scales: the op is traced")
    for m in (8, 13):
        torch._dynamo.reset()
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        y, codes = run_and_get_code(torch.compile(layer, fullgraph=True), x)
        assert torch.equal(y, layer(x)) or _rel(y, layer(x)) < 1e-3, m
        code = "\n".join(codes)
        assert "_scaled_mm" in code and "scaled_mm_block" not in code, m


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1: conftest.py sets it)")
@pytest.mark.parametrize("m", [1, 4])
def test_an_op_provider_s_layer_refuses_a_backward_too(m):
    """An op provider's kernel writes the output outside autograd (it never requires grad), so the layer ties it to
    its input: a backward through a ``triton`` layer (the fused one-token GEMV and the quantize-then-GEMM path) and
    through ``fp8_linear`` raises the library's error, never a gradient without the layer's share."""
    import fp8_backends

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = Fp8Linear.from_linear(_linear(256, 384).to(dev), weight_scale="block", backend="triton")
    x = torch.randn(m, 384, dtype=torch.bfloat16, device=dev, requires_grad=True)
    y = layer(x)
    assert y.requires_grad
    with pytest.raises(InvalidInputError, match="FP8 layers have no backward"):
        (y.float().sum() + x.float().sum()).backward()
    y2 = fp8_backends.fp8_linear(x, layer.prepared, backend=layer.gemm_backend, act_scale="per_token_group")
    with pytest.raises(InvalidInputError, match="FP8 layers have no backward"):
        y2.float().sum().backward()
    with torch.no_grad():
        assert not layer(x).requires_grad


def test_a_norm_processed_before_its_block_consumer_and_a_weight_not_the_problem_s():
    """The norm feeding a block layer resolves before that layer is processed (its layout is read at the forward,
    which refuses an unprocessed consumer); ``init_fp8_gemm`` refuses a weight that is not the problem's (N, K, or
    its scale mode) instead of preparing it in the problem's place."""
    import fp8_backends
    from fp8_backends.core.types import GemmProblem

    lin = Fp8Linear(320, 192, weight_scale="block", backend="torch")
    norm = RMSNormFp8Quant(320, quant_linear=lin)
    norm.process_weights_after_loading()
    with pytest.raises(InvalidInputError, match="quant_linear is not processed"):
        norm(torch.randn(2, 320, dtype=torch.bfloat16))
    w_q, w_s = reference.quantize_block(torch.randn(256, 384))
    block = dict(act_scale="per_token_group", weight_scale="block", weight_block=(128, 128), group_size=128,
                 device="cpu")
    for problem, message in ((GemmProblem(n=1000, k=384, **block), "N=1000, K=384"),
                             (GemmProblem(n=256, k=384, device="cpu"), "per-tensor"),
                             (GemmProblem(n=256, k=384, act_scale="per_token", weight_scale="per_channel",
                                          device="cpu"), "per-channel")):
        with pytest.raises(InvalidInputError, match=message):
            fp8_backends.init_fp8_gemm(w_q, w_s, problem=problem, backend="torch")


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs a GPU or Triton's interpreter (TRITON_INTERPRET=1: conftest.py sets it)")
def test_an_activation_type_the_provider_cannot_pair_is_refused_before_quantizing(monkeypatch):
    import fp8_backends
    from fp8_backends import quant

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backend = fp8_backends.resolve_gemm_backend("triton")
    w_q, w_s = reference.quantize_block(torch.randn(256, 384))
    prepared = backend.prepare_weight(w_q.to(dev), w_s.to(dev), block=(128, 128))
    calls = []
    real = quant.quantize_checked
    monkeypatch.setattr(quant, "quantize_checked", lambda *a, **k: calls.append(1) or real(*a, **k))
    with pytest.raises(InvalidInputError, match="same FP8 type"):
        fp8_backends.fp8_linear(torch.randn(3, 384, device=dev), prepared, backend=backend,
                                act_scale="per_token_group", input_dtype="e5m2")
    assert calls == []
