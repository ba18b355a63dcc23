"""``quantize_model`` on a tiny ``transformers`` Llama / Qwen2 / Mistral (CPU), the eager plan of ``Fp8Linear``, and
the compiled paths: a model quantized in place matches the same model whose linears compute the reference semantics
(``fp8_backends.core.reference``), eager, under ``torch.compile`` (``aot_eager``) and through ``generate()``; no graph
break; the Triton ops trace into their kernel launches (``triton_op`` + ``wrap_triton``)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

import fp8_backends.layers  # noqa: E402
from fp8_backends import QuantizeSummary, quantize_model  # noqa: E402
from fp8_backends.core import reference  # noqa: E402
from fp8_backends.core.errors import InvalidInputError, UnsupportedProblemError  # noqa: E402
from fp8_backends.core.types import ActScale  # noqa: E402
from fp8_backends.layers import Fp8Linear  # noqa: E402
from fp8_backends.layers.shared_input import Fp8LinearSlice  # noqa: E402


def _tiny(arch: str = "llama", layers: int = 2, seed: int = 0, hidden: int = 64) -> nn.Module:
    kw = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": layers, "vocab_size": 128, "max_position_embeddings": 128}
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM")}[arch]
    if arch == "mistral":
        kw["sliding_window"] = 8  # Mistral's sliding-window attention, shorter than the test's sequences
    cfg = getattr(transformers, config_cls)(**kw)
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(cfg).to(torch.bfloat16).eval()


class RefFp8Linear(nn.Module):
    """The semantics an ``Fp8Linear`` must compute, written with :mod:`fp8_backends.core.reference` only."""

    def __init__(self, layer: Fp8Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lay = self.layer
        x2 = x.reshape(-1, lay.in_features)
        x_q, x_s = reference.quantize(x2, lay.act_scale, lay.input_scale)
        y = reference.fp8_gemm(x_q, lay.weight, x_s, lay.weight_scale, lay.dtype, lay.bias)
        return y.reshape(*x.shape[:-1], lay.out_features)


def _reference_twin(model: nn.Module) -> nn.Module:
    """A copy of a quantized model whose every Fp8Linear computes through the reference."""
    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, Fp8Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(twin.get_submodule(parent) if parent else twin, leaf, RefFp8Linear(module))
    return twin


def _relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("mode", ["per_tensor_dynamic", "per_token", "per_tensor_static"])
def test_quantize_model_matches_reference_twin(arch, mode):
    model = _tiny(arch)
    bf16 = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    calib = [ids] if mode == "per_tensor_static" else None
    summary = quantize_model(model, act_scale=mode, calibration=calib)
    assert isinstance(summary, QuantizeSummary)
    assert summary.count == 2 * 7  # q k v o gate up down per layer
    assert summary.gemms == 2 * 4  # q/k/v and gate/up fused: qkv o gate_up down
    assert ("lm_head", "matches skip") in summary.skipped
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Fp8LinearSlice) and isinstance(attn.q_proj.fused, Fp8Linear)
    assert attn.q_proj.fused.out_features == 64 + 32 + 32  # q + k + v (4 heads, 2 KV heads of 16)
    assert isinstance(attn.o_proj, Fp8Linear)
    assert type(model.lm_head) is nn.Linear
    assert summary.bytes_saved > 0 and summary.bytes_after < summary.bytes_before
    if arch == "qwen2":
        assert attn.q_proj.fused.bias is not None and attn.k_proj.bias.shape == (32,)  # Qwen2's q/k/v biases
    twin = _reference_twin(model)
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
        want = twin(ids, use_cache=False).logits
        ref_bf16 = bf16(ids, use_cache=False).logits
    assert _relerr(got, want) < 2e-2
    assert _relerr(got, ref_bf16) < 0.2  # FP8 of random weights: close to bf16, not equal


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_compiled_and_generate_match_the_reference_twin(arch):
    model = _tiny(arch)
    quantize_model(model, act_scale="per_tensor_dynamic")
    twin = _reference_twin(model)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        with torch.no_grad():
            got = compiled(ids, use_cache=False).logits
            eager = model(ids, use_cache=False).logits
            want = twin(ids, use_cache=False).logits
    finally:
        torch._dynamo.reset()
    assert _relerr(got, eager) < 1e-2 and _relerr(got, want) < 2e-2
    gen = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    a = model.generate(ids, **gen)
    b = twin.generate(ids, **gen)
    assert a.sequences.shape == (1, 12)
    for la, lb in zip(a.logits, b.logits):
        assert _relerr(la, lb) < 2e-2
    assert torch.equal(a.sequences, b.sequences)


def test_no_graph_break_in_a_quantized_model_or_layer():
    model = _tiny("llama")
    quantize_model(model, act_scale="per_token")
    ids = torch.randint(0, 128, (1, 6))
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(ids, use_cache=False)
    assert explained.graph_break_count == 0, explained.break_reasons
    layer = Fp8Linear.from_linear(nn.Linear(64, 32, dtype=torch.bfloat16), act_scale="per_tensor_static",
                                  input_scale=0.02)
    explained = torch._dynamo.explain(layer)(torch.randn(3, 64, dtype=torch.bfloat16))
    assert explained.graph_break_count == 0, explained.break_reasons


def test_compiled_quantization_is_traced_as_torch_ops():
    """Under torch.compile the layer's activation quantization is plain torch code (Inductor fuses it into the
    producer) and torch_scaled_mm is torch._scaled_mm itself: no fp8_backends op in the graph."""
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def capture(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: graphs.append(g) or g)

    for mode, scale in (("per_tensor_dynamic", None), ("per_token", None), ("per_tensor_static", 0.02)):
        layer = Fp8Linear.from_linear(nn.Linear(64, 32, dtype=torch.bfloat16), act_scale=mode, input_scale=scale,
                                      backend="torch_scaled_mm")
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        torch._dynamo.reset()
        try:
            y = torch.compile(layer, backend=capture, fullgraph=True)(x)
        finally:
            torch._dynamo.reset()
        assert _relerr(y, layer(x)) < 1e-2
        code = graphs[-1].code
        assert "fp8_backends" not in code and "_scaled_mm" in code, code
        assert ("amax" in code) == (mode != "per_tensor_static"), code


def test_skip_include_and_unservable_layers(monkeypatch):
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(64, 32, dtype=torch.bfloat16))
    model.add_module("odd", nn.Linear(10, 30, dtype=torch.bfloat16))  # K = 10, N = 30: torch's CPU _scaled_mm serves
    model.add_module("embed_out", nn.Linear(64, 32, dtype=torch.bfloat16))
    model.add_module("keep", nn.Linear(32, 16, dtype=torch.bfloat16))
    odd = copy.deepcopy(model.odd)
    summary = quantize_model(model, include=lambda name, lin: name != "keep")
    assert [s.name for s in summary.swapped] == ["proj", "odd"]
    x = torch.randn(3, 10, dtype=torch.bfloat16)
    assert _relerr(model.odd(x), odd(x)) < 0.1
    reasons = dict(summary.skipped)
    assert reasons["embed_out"] == "matches skip" and reasons["keep"] == "rejected by include"
    assert "2 nn.Linear -> Fp8Linear" in str(summary)
    # with no provider for the CPU, a layer stays as it is, with the reason
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "torch_scaled_mm")
    single = nn.Sequential(nn.Linear(10, 30, dtype=torch.bfloat16))
    assert "no provider can serve it" in dict(quantize_model(single).skipped)["0"]
    monkeypatch.delenv("FP8_BACKENDS_DISABLED")
    with pytest.raises(UnsupportedProblemError):  # an explicit provider that cannot serve a layer fails loudly
        quantize_model(nn.Sequential(nn.Linear(10, 32, dtype=torch.bfloat16)),
                       backend="torch_scaled_mm@fast_accum=true")


def test_static_needs_scales_and_explicit_scales_win():
    model = nn.Sequential(nn.Linear(64, 32, dtype=torch.bfloat16))
    with pytest.raises(InvalidInputError, match="calibration batches or input_scales"):
        quantize_model(copy.deepcopy(model), act_scale="per_tensor_static")
    with pytest.raises(InvalidInputError, match="per_tensor_static"):
        quantize_model(copy.deepcopy(model), calibration=[torch.randn(2, 64, dtype=torch.bfloat16)])
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 3
    calibrated = copy.deepcopy(model)
    quantize_model(calibrated, act_scale="per_tensor_static", calibration=[x, x[:2] * 2])
    want = max((x.float().abs().amax() / 448).item(), (x[:2].float().abs().amax() * 2 / 448).item())
    assert calibrated[0].input_scale.item() == pytest.approx(want, rel=1e-6)
    given = copy.deepcopy(model)
    quantize_model(given, act_scale="per_tensor_static", calibration=[x], input_scales={"0": 0.5})
    assert given[0].input_scale.item() == 0.5
    with pytest.raises(InvalidInputError, match="nn.Module"):
        quantize_model("not a model")


def test_eager_plan_takes_plain_calls_and_leaves_the_rest_to_the_general_path(monkeypatch):
    layer = Fp8Linear.from_linear(nn.Linear(64, 32, bias=True, dtype=torch.bfloat16), act_scale="per_tensor_dynamic")
    plan = layer._plan
    assert plan is not None
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = plan(x)
    assert y is not None and y.shape == (2, 3, 32)
    x_q, x_s = reference.quantize_dynamic_per_tensor(x.reshape(-1, 64))
    want = reference.fp8_gemm(x_q, layer.weight, x_s, layer.weight_scale, torch.bfloat16, layer.bias)
    assert _relerr(y.reshape(-1, 32), want) < 1e-2
    # what the plan refuses: the general path takes it (and explains errors)
    assert plan(x.float()) is None
    assert plan(torch.randn(2, 48, dtype=torch.bfloat16)) is None
    assert plan(torch.empty(0, 64, dtype=torch.bfloat16)) is None
    assert plan(torch.empty(2, 64, dtype=torch.bfloat16, device="meta")) is None
    assert layer(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
    # processing state changes drop the plan
    layer.load_bias(torch.zeros(32, dtype=torch.bfloat16))
    assert layer._plan is None
    with pytest.raises(InvalidInputError, match="process_weights_after_loading"):
        layer(x)
    layer.process_weights_after_loading()
    assert layer._plan is not None
    # a registered quant implementation still applies to plan calls
    from fp8_backends import quant

    seen = []

    def spy(x, fp8_dtype):
        seen.append(tuple(x.shape))
        return reference.quantize_dynamic_per_tensor(x, fp8_dtype)

    previous = quant.register_quant_impl(ActScale.PER_TENSOR_DYNAMIC, "cpu", spy)
    try:
        layer(x)
    finally:
        quant.register_quant_impl(ActScale.PER_TENSOR_DYNAMIC, "cpu", previous)
    assert seen == [(6, 64)]


def test_triton_ops_trace_into_their_kernels_without_the_interpreter(tmp_path):
    """Outside Triton's interpreter the triton GEMM and norm-quant ops are ``triton_op``\\ s: AOTAutograd
    decomposes them into ``triton_kernel_wrapper_functional`` calls of the kernels (what Inductor launches from its
    own code), with PDL off. Traced on the CPU with fake tensors; nothing runs."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from torch._functorch.aot_autograd import aot_module_simplified
        from fp8_backends.providers.triton import gemm_ops, norm_quant
        gemm_ops._OPS.preload(); norm_quant._OPS.preload()
        graphs = []
        class Stop(Exception):
            pass
        def fw(g, inputs):
            graphs.append(g.code)
            raise Stop
        def backend(gm, inputs):
            return aot_module_simplified(gm, inputs, fw_compiler=fw)
        gemm, nq = gemm_ops._OPS.call("triton_gemm"), norm_quant._OPS.call("triton_rmsnorm_quant")
        def f(h, w, xs, ws, nw):
            out = torch.empty_like(h, dtype=torch.float8_e4m3fn)
            nq(out, h, nw, xs, 1e-6)
            return gemm(out, w, xs, ws, None, torch.bfloat16, "auto")
        h = torch.randn(4, 64, dtype=torch.bfloat16)
        w = torch.randn(128, 64).to(torch.float8_e4m3fn)
        try:
            torch.compile(f, backend=backend, fullgraph=True)(h, w, torch.ones(1), torch.ones(1),
                                                              torch.ones(64, dtype=torch.bfloat16))
        except Exception as exc:
            assert "Stop" in repr(exc), exc
        print(graphs[0])
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    code = out.stdout
    assert code.count("triton_kernel_wrapper_functional(") == 2, code
    assert "fp8_backends" not in code, code
    assert "'USE_PDL': False" in code and "'ROWS': 64" in code and "'BLOCK_M': 16" in code, code


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
@pytest.mark.parametrize("mode", ["per_tensor_dynamic", "per_tensor_static"])
def test_gpu_quantized_model_compiled_and_graphed(mode):
    """On the GPU with ``auto`` (the triton decode kernels at small M): eager, Inductor, and the compiled decode
    step captured in a CUDA graph all match the reference twin."""
    model = _tiny("llama", hidden=256).cuda()  # wide enough that one flipped FP8 code moves little
    ids = torch.randint(0, 128, (1, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    quantize_model(model, act_scale=mode, calibration=[ids] if mode == "per_tensor_static" else None)
    twin = _reference_twin(model)
    torch._dynamo.reset()
    # One flipped FP8 code moves this small random model's logits by ~3%, so neither the eager model nor the
    # compiled one is bit-equal to the twin: on the H200 (2026-12-01) the eager model was 3.0e-2 from the twin at T=24
    # (its GEMM providers accumulate in another order), the compiled one 3.1e-2, the compiled twin 0. The compiled
    # model may be as far from the twin as the eager one (or 3e-2), with a quarter more, plus twice what Inductor
    # does to the twin itself (its fp32 division is not IEEE's and it keeps fused values in fp32).
    patch = torch._inductor.config.patch(emulate_precision_casts=True)
    try:
        patch.__enter__()
        compiled = torch.compile(model)  # fullgraph is checked on the CPU (test_no_graph_break_...)
        twin_compiled = torch.compile(twin)
        with torch.no_grad():
            bounds = {}
            for t in (1, 24):
                ref = twin(ids[:, :t], use_cache=False).logits
                noise = _relerr(twin_compiled(ids[:, :t], use_cache=False).logits, ref)
                eager = _relerr(model(ids[:, :t], use_cache=False).logits, ref)
                bounds[t] = 1.25 * max(eager, 3e-2) + 2 * noise
                got = _relerr(compiled(ids[:, :t], use_cache=False).logits, ref)
                assert got < bounds[t], f"compiled {got:.3g}, eager {eager:.3g}, compiled twin {noise:.3g} at T={t}"
            one = ids[:, :1].clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                compiled(one, use_cache=False)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = compiled(one, use_cache=False).logits
            one.copy_(ids[:, 5:6])
            graph.replay()
            assert _relerr(out, twin(one, use_cache=False).logits) < bounds[1]
    finally:
        patch.__exit__(None, None, None)
        torch._dynamo.reset()


def _saved_and_loaded(module: nn.Module) -> nn.Module:
    import io

    buf = io.BytesIO()
    torch.save(module, buf)  # plain pickle of an fp8 tensor fails inside torch itself (torch 2.13)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_a_copied_layer_binds_its_own_tensors():
    layer = Fp8Linear.from_linear(nn.Linear(64, 32, bias=False, dtype=torch.bfloat16), act_scale="per_tensor_dynamic")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = layer(x)
    for twin in (copy.deepcopy(layer), _saved_and_loaded(layer)):
        assert twin._plan is None
        with torch.no_grad():
            twin.weight.zero_()  # the copy's own weight: the original must not see it, the copy must
        twin.process_weights_after_loading()
        assert torch.count_nonzero(twin(x)) == 0
    assert torch.equal(layer(x), y)
    copied = copy.deepcopy(layer)
    assert torch.equal(copied(x), y)  # rebound at its first call, to its own (equal) tensors
    assert copied._plan is not None and copied._plan is not layer._plan


def test_hf_model_bench_smoke_runs_on_cpu(tmp_path):
    """bench/hf_model.py end to end on tiny layers: variants, eager and compiled, decode with its cache rewound,
    the report."""
    import importlib.util
    import json

    path = __import__("pathlib").Path(__file__).resolve().parents[1] / "bench" / "hf_model.py"
    spec = importlib.util.spec_from_file_location("hf_model_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parents[1]))
    try:
        spec.loader.exec_module(mod)
        assert mod.main(["--device", "cpu", "--small", "--layers", "1", "--out", str(tmp_path), "--prefill", "8",
                         "--context", "8", "--rounds", "1", "--iters", "3", "--host-rounds", "1", "--host-calls", "3",
                         "--check-tokens", "8", "--variants", "bf16", "fp8_dynamic", "--compile-scope", "layers"]) == 0
    finally:
        sys.path.remove(str(path.parents[1]))
    result = json.loads((tmp_path / "hf_model_llama.json").read_text())
    rows = {(r["workload"], r["mode"]): r["us"] for r in result["rows"]}
    assert set(rows) == {("decode", "eager"), ("decode", "compiled"), ("prefill8", "eager"), ("prefill8", "compiled")}
    assert all(set(us) == {"bf16", "fp8_dynamic"} for us in rows.values()), rows
    assert not result["errors"] and result["accuracy"]["fp8_dynamic"]["top1_agree"] > 0.5
    assert "| decode | eager |" in (tmp_path / "hf_model_llama.md").read_text()


def test_quantize_model_lets_inductor_launch_triton_ops_statically(monkeypatch):
    """quantize_model(static_launch=True) turns on Inductor's static launcher for user-defined Triton kernels (the
    library's triton_ops); by default it changes no Inductor setting, nor for a model with nothing to swap."""
    from torch._inductor import config

    from fp8_backends.layers.inductor_setup import static_launch_triton_ops

    monkeypatch.setenv("TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS", "")  # recorded: removed after
    monkeypatch.delenv("TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS")
    with config.patch(static_launch_user_defined_triton_kernels=False):  # (monkeypatch's undo hides a config entry)
        quantize_model(_tiny())
        assert config.static_launch_user_defined_triton_kernels is False
        quantize_model(nn.Sequential(nn.ReLU()), static_launch=True)
        assert config.static_launch_user_defined_triton_kernels is False, "nothing swapped: nothing to launch"
        quantize_model(_tiny(), static_launch=True)
        assert config.static_launch_user_defined_triton_kernels is True
        assert static_launch_triton_ops(False) is True and config.static_launch_user_defined_triton_kernels is False


def test_static_launch_reaches_inductors_compile_workers(monkeypatch):
    """The compile workers read the setting from the environment, not from the parent's config (torch 2.11): the
    variable is set with the config, and pools already started are shut down so the next compile restarts them."""
    import os
    import sys
    import types

    from torch._inductor import config

    from fp8_backends.layers import inductor_setup

    monkeypatch.setenv(inductor_setup.ENV, "")  # recorded, so the test's own settings are removed after it
    monkeypatch.delenv(inductor_setup.ENV)
    shut = []
    fake = types.SimpleNamespace(_pool_set={"pool"}, shutdown_compile_workers=lambda: shut.append(1))
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    with config.patch(static_launch_user_defined_triton_kernels=False):
        assert inductor_setup.static_launch_triton_ops(True) is False
        assert config.static_launch_user_defined_triton_kernels is True
        assert os.environ[inductor_setup.ENV] == "1" and shut == [1]
        assert inductor_setup.static_launch_triton_ops(True) is True and shut == [1], "unchanged: no restart"
        fake._pool_set = set()
        assert inductor_setup.static_launch_triton_ops(False) is True
        assert os.environ[inductor_setup.ENV] == "0" and shut == [1], "no pool started: nothing to shut down"


# ------------------------------------------------------------------------------------------------ general models
def test_a_linear_registered_under_two_names_becomes_one_fp8_layer_under_both():
    shared = nn.Linear(64, 64, dtype=torch.bfloat16)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x).float()
    summary = quantize_model(model, backend="torch")
    assert model[0] is model[2] and isinstance(model[0], Fp8Linear)
    assert [layer.name for layer in summary.swapped] == ["0"]
    with torch.no_grad():
        assert ((model(x).float() - want).norm() / want.norm()) < 0.1
    other = nn.Module()
    other.a = other.b = nn.Linear(64, 64, dtype=torch.bfloat16)
    summary = quantize_model(other, backend="torch", skip=["b"])  # a skip pattern on any of its names keeps it
    assert type(other.a) is nn.Linear and other.a is other.b and summary.skipped == [("a", "matches skip (as b)")]


def test_the_summary_counts_each_storage_once():
    """A head tied to the embedding and quantized (skip=[]): its bf16 storage stays held by the embedding, so the
    FP8 copy adds to the model instead of saving; two linears sharing one weight count it once."""
    embed = nn.Embedding(100, 64, dtype=torch.bfloat16)
    head = nn.Linear(64, 100, bias=False, dtype=torch.bfloat16)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head})
    summary = quantize_model(model, backend="torch", skip=[])
    assert summary.bytes_before == 100 * 64 * 2 and summary.bytes_saved < 0  # 6400 fp8 bytes and a scale more
    a, b = nn.Linear(64, 64, bias=False, dtype=torch.bfloat16), nn.Linear(64, 64, bias=False, dtype=torch.bfloat16)
    b.weight = a.weight
    summary = quantize_model(nn.ModuleDict({"a": a, "b": b}), backend="torch")
    assert summary.bytes_before == 64 * 64 * 2


def test_a_model_that_is_a_linear_and_misused_arguments_get_clear_errors():
    from fp8_backends.core.errors import InvalidTypeError

    with pytest.raises(InvalidInputError, match="Fp8Linear.from_linear"):
        quantize_model(nn.Linear(64, 64))
    model = nn.Sequential(nn.Linear(64, 64))
    x = torch.randn(2, 64)
    with pytest.raises(InvalidTypeError, match=r"wrap one batch in a list"):
        quantize_model(model, act_scale="per_tensor_static", calibration=x)
    with pytest.raises(InvalidTypeError, match=r"wrap one batch in a list"):
        quantize_model(model, act_scale="per_tensor_static", calibration={"input": x})
    with pytest.raises(InvalidInputError, match="names no module of the model: 0.typo"):
        quantize_model(model, act_scale="per_tensor_static", input_scales={"0": 0.1, "0.typo": 0.1})
    assert type(model[0]) is nn.Linear  # refused before any layer changed


def test_zero_size_linears_are_skipped_and_a_bad_weight_names_its_module():
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 0), nn.Linear(0, 16))
    summary = quantize_model(model, backend="torch")
    assert [name for name, why in summary.skipped if why.startswith("zero-size")] == ["1", "2"]
    bad = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with torch.no_grad():
        bad[1].weight[0, 0] = float("inf")
    with pytest.raises(InvalidInputError, match=r"^1: .*finite"):
        quantize_model(bad, backend="torch")
    with pytest.raises(InvalidInputError, match="meta"):
        quantize_model(nn.Sequential(nn.Linear(256, 256, device="meta")), weight_scale="block", backend="torch")


def test_siblings_that_do_not_fuse_are_listed_with_the_reason():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(64, 64, bias=True)
            self.k_proj = nn.Linear(64, 32, bias=False)
            self.v_proj = nn.Linear(64, 32, bias=False)

    summary = quantize_model(nn.Sequential(Attn()), backend="torch")
    assert summary.fused == [] and summary.not_fused == [
        ("0.q_proj+0.k_proj+0.v_proj", "in_features, dtype, device or bias presence differ")]


def test_transformers_conv1d_is_listed_as_kept():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=100, n_positions=32)
    summary = quantize_model(transformers.GPT2LMHeadModel(config), backend="torch")
    kept = dict(summary.skipped)
    assert "Conv1D" in kept["transformer.h.0.attn.c_attn"] and summary.count == 0


def test_moe_routers_and_gates_stay_in_the_model_dtype():
    """The default skip keeps MoE routers and gates (``gate``, ``*router*``, ``*_gate``) in the model dtype, as
    engines do: their expert choice must not move with FP8 rounding. A gated MLP's ``gate_proj`` is quantized."""
    mlp = nn.Module()
    mlp.gate = nn.Linear(64, 8, bias=False, dtype=torch.bfloat16)  # Mixtral / OLMoE router
    mlp.router = nn.Module()
    mlp.router.layer = nn.Linear(64, 8, bias=False, dtype=torch.bfloat16)  # JetMoE / DBRX
    mlp.shared_expert_gate = nn.Linear(64, 1, bias=False, dtype=torch.bfloat16)  # Qwen2-MoE
    mlp.gate_proj = nn.Linear(64, 128, bias=False, dtype=torch.bfloat16)
    model = nn.Sequential()
    model.add_module("mlp", mlp)
    summary = quantize_model(model)
    assert [s.name for s in summary.swapped] == ["mlp.gate_proj"]
    assert {name for name, why in summary.skipped if why == "matches skip"} == {
        "mlp.gate", "mlp.router.layer", "mlp.shared_expert_gate"}
    assert type(mlp.gate) is nn.Linear and type(mlp.router.layer) is nn.Linear


def test_a_replaced_weight_unprocesses_the_layer_and_a_bf16_state_dict_is_refused():
    """``tie_weights()`` (or any assignment) putting another tensor in place of a processed layer's weight: the
    next forward asks for processing instead of running the stale FP8 weight; a bf16 model's state dict loaded into
    the quantized one is refused (torch would cast its values into the FP8 buffer, unscaled)."""
    model = _tiny("llama")
    bf16_state = copy.deepcopy(model.state_dict())
    quantize_model(model)
    x = torch.randint(0, 128, (1, 6))
    model(x)
    q = model.model.layers[0].self_attn.o_proj
    assert q.is_processed
    q.weight = q.weight.clone()
    assert not q.is_processed
    with pytest.raises(InvalidInputError, match="process_weights_after_loading"):
        model(x)
    fp8_backends.layers.process_weights_after_loading(model)
    model(x)
    with pytest.raises(InvalidInputError, match=r"state dict entry model\.layers\.\d\.\S+\.weight must be float8"):
        model.load_state_dict(bf16_state, strict=False)
    tied = copy.deepcopy(model)
    tied.lm_head = fp8_backends.layers.Fp8Linear.from_linear(nn.Linear(64, 128, bias=False, dtype=torch.bfloat16))
    tied.lm_head.weight = tied.model.embed_tokens.weight  # what tie_weights() does
    with pytest.raises(InvalidInputError, match="process_weights_after_loading"):
        tied(x)
