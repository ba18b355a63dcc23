"""The ``torch.compile`` path of ``Fp8Linear`` (:mod:`fp8_backends.layers.traced_plan`) on the CPU: it computes what the
general path does, refuses the same bad inputs at trace time, keeps the guards of a compiled model few (no aliasing
guard on the layer's tensors, the shared provider and enums guarded once) and is rebound by copies."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402

from fp8_backends import functional, quantize_model  # noqa: E402
from fp8_backends.core import reference  # noqa: E402
from fp8_backends.core.types import QuantizedActivation  # noqa: E402
from fp8_backends.layers import Fp8Linear, traced_plan  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_convert import _tiny  # noqa: E402

MODES = [("per_tensor_dynamic", None), ("per_token", None), ("per_tensor_static", 0.02)]


def _compiled(fn, *args):
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            return torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()


def _layer(mode, scale, bias=True):
    torch.manual_seed(0)
    return Fp8Linear.from_linear(nn.Linear(64, 48, bias=bias, dtype=torch.bfloat16), act_scale=mode,
                                 input_scale=scale)


@pytest.mark.parametrize("mode,scale", MODES)
@pytest.mark.parametrize("bias", [True, False])
def test_compiled_call_takes_the_traced_plan_and_matches_the_reference(monkeypatch, mode, scale, bias):
    layer = _layer(mode, scale, bias)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    want = layer(x)  # eager plan
    lay = layer
    x_q, x_s = reference.quantize(x.reshape(-1, 64), lay.act_scale, lay.input_scale)
    ref = reference.fp8_gemm(x_q, lay.weight, x_s, lay.weight_scale, lay.dtype, lay.bias).reshape(2, 5, 48)

    def general_path_called(*a, **k):
        raise AssertionError("the compiled call went through apply_fp8_linear")

    monkeypatch.setattr(functional, "apply_fp8_linear", general_path_called)
    monkeypatch.setattr(sys.modules["fp8_backends.layers.modules"], "apply_fp8_linear", general_path_called)
    got = _compiled(layer, x)
    assert got.shape == (2, 5, 48) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()) < 2e-2


def test_traced_plan_refuses_bad_inputs_at_trace_time():
    layer = _layer("per_tensor_static", 0.02)
    with pytest.raises(Exception) as info:
        _compiled(layer, torch.randn(3, 32, dtype=torch.bfloat16))  # K = 32, not 64
    assert "K=64" in str(info.value)
    with pytest.raises(Exception) as info:
        _compiled(layer, torch.randn(3, 64, dtype=torch.float16))
    assert "prepared for torch.bfloat16" in str(info.value)
    q = torch.randn(3, 64).to(torch.float8_e4m3fn)
    wrong_mode = QuantizedActivation(q, torch.ones(1), torch.bfloat16, "per_tensor_dynamic")
    with pytest.raises(Exception) as info:
        _compiled(layer, wrong_mode)
    assert "never re-quantizes" in str(info.value)
    wrong_dtype = QuantizedActivation(q, torch.full((1,), 0.02), torch.float16, "per_tensor_static")
    with pytest.raises(Exception) as info:
        _compiled(layer, wrong_dtype)
    assert "orig_dtype" in str(info.value)


def test_traced_plan_takes_a_quantized_activation():
    layer = _layer("per_token", None)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x_q, x_s = reference.quantize(x, layer.act_scale, None)
    qa = QuantizedActivation(x_q, x_s, torch.bfloat16, "per_token")
    assert torch.allclose(_compiled(layer, qa).float(), layer(qa).float(), rtol=1e-2, atol=1e-2)
    empty = _compiled(layer, torch.empty(0, 64, dtype=torch.bfloat16))
    assert empty.shape == (0, 48)


def test_plan_tensors_alias_the_prepared_weight_and_copies_rebind():
    layer = _layer("per_tensor_static", 0.02, bias=False)
    plan = layer._traced
    row = plan.rows[-1]
    data, scale = row.tensors["data"], row.tensors["scale"]
    assert type(data) is nn.Parameter and not data.requires_grad
    assert data.data_ptr() == layer.prepared.data.data_ptr() and data.stride() == layer.prepared.data.stride()
    assert scale.data_ptr() == layer.prepared.scale.data_ptr()
    assert plan.input_scale.data_ptr() == layer.input_scale.data_ptr()
    assert row.backend is layer.gemm_backend
    # the plan's code reads the provider from the shared table, and holds exactly these tensors in its closure
    assert any(traced_plan._SHARED[i] is layer.gemm_backend for i in range(len(traced_plan._SHARED)))
    closure = {id(c.cell_contents) for c in plan.__closure__}
    assert {id(data), id(scale), id(plan.input_scale)} <= closure
    # a per-tensor torch._scaled_mm problem never reads the row-wise scale: the plan does not hand it over
    assert "row_scale" not in row.tensors and len(closure) == 3
    twin = copy.deepcopy(layer)
    assert twin._traced is not None and twin._traced is not plan
    assert twin._traced.rows[-1].tensors["data"].data_ptr() == twin.prepared.data.data_ptr() != data.data_ptr()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        twin.weight.zero_()  # the copy's own storage: its traced plan must see it, the original's must not
    assert torch.count_nonzero(_compiled(twin, x)) == 0
    assert torch.count_nonzero(_compiled(layer, x)) > 0
    moved = _layer("per_tensor_dynamic", None).to("cpu")
    assert moved._traced is not None


def _guard_text(model, ids) -> str:
    guards = pytest.importorskip("torch._dynamo.guards")
    if not hasattr(guards, "guard_manager_testing_hook_fn"):
        pytest.skip("this torch has no guard_manager_testing_hook_fn")
    seen: list[str] = []
    old = guards.guard_manager_testing_hook_fn
    guards.guard_manager_testing_hook_fn = lambda manager, scope, builder: seen.append(str(manager))
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend="eager")(ids, use_cache=False)
    finally:
        guards.guard_manager_testing_hook_fn = old
        torch._dynamo.reset()
    return seen[0]


def test_a_compiled_model_guards_its_fp8_layers_cheaply():
    """Guards run on the host at every call of a compiled model. The general path made ~5 tensors per layer graph
    inputs with aliasing checks and reached the shared provider and enum members once per layer, each reach past
    the first an ``a is b`` guard (a Python call); the traced plan keeps both near bf16's."""
    base = _tiny("llama", layers=4, hidden=32)
    fused = copy.deepcopy(base)
    ids = torch.randint(0, 128, (1, 4))
    bf16 = _guard_text(base, ids)
    summary = quantize_model(fused, act_scale="per_tensor_static", calibration=[ids])
    quantize_model(base, act_scale="per_tensor_static", calibration=[ids], fuse=False)
    fp8 = _guard_text(base, ids)
    # fused siblings share one group object: one identity guard per sibling past the first (3 per Llama layer), each
    # far cheaper than the GEMM call it saves
    absorbed = summary.count - summary.gemms
    assert absorbed == 4 * 3
    extra = _guard_text(fused, ids).count("LAMBDA_GUARD") - fp8.count("LAMBDA_GUARD")
    assert extra <= absorbed, extra
    for m in base.modules():
        if isinstance(m, Fp8Linear):
            m._traced = None
    general = _guard_text(base, ids)
    assert fp8.count("NO_TENSOR_ALIASING") <= bf16.count("NO_TENSOR_ALIASING") + 1
    assert general.count("NO_TENSOR_ALIASING") > 4 * 7  # what the traced plan removes: one per layer tensor
    lambdas = fp8.count("LAMBDA_GUARD") - bf16.count("LAMBDA_GUARD")
    assert lambdas <= 8, lambdas  # none per layer (the general path: several per layer)
    assert general.count("LAMBDA_GUARD") - bf16.count("LAMBDA_GUARD") > 4 * 7
    # every guard, per linear, over nn.Linear's: the plan's code object and the two scale tensors of a static layer
    # (6 guards each); the layer's numbers are constants of its plan's code, which Dynamo does not guard
    linears = 4 * 7
    from bench.guard_cost import guard_kinds

    def count(text: str) -> int:
        return sum(guard_kinds(text).values())

    per_linear = (count(fp8) - count(bf16)) / linears
    assert per_linear <= 16, per_linear
    assert (count(general) - count(bf16)) / linears > 2 * per_linear


def test_guard_cost_bench_counts_and_times_the_guards_of_a_compiled_model(tmp_path):
    from bench import guard_cost

    assert guard_cost.main(["--out", str(tmp_path), "--layers", "1", "--variants", "fp8_static",
                            "--warm-checks", "5", "--cold-checks", "2"]) == 0
    result = json.loads((tmp_path / "guard_cost.json").read_text())
    bf16, fp8 = result["variants"]["bf16"], result["variants"]["fp8_static"]
    assert bf16["guards"] > 50 and fp8["guards"] > bf16["guards"]
    assert fp8["warm_us"] > 0 and fp8["cold_us"] > 0 and sum(fp8["kinds"].values()) == fp8["guards"]
    assert "| fp8_static |" in (tmp_path / "guard_cost.md").read_text()


def test_generated_plan_hands_gemm_impl_the_prepared_weight_and_extra_it_was_bound_with():
    """A third-party provider's prepared weight: ``extra`` with a non-tensor value and a non-string key, the
    provider's own ``traced_extra_keys`` dropping one entry; the traced call rebuilds the weight with the kept
    entries (the same objects) and the layer's numbers, on every M bucket."""
    from fp8_backends.core.types import ActScale, Fp8Dtype, PreparedWeight, WeightScale

    handle = object()
    seen = []

    class Backend:
        name = "fake"

        def traced_extra_keys(self, prepared, act_scale):
            assert act_scale is ActScale.PER_TENSOR_DYNAMIC
            return frozenset({"handle", 7})

        def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
            seen.append(prepared)
            return torch.zeros(x_q.shape[0], prepared.n, dtype=out_dtype)

    class Row:
        def __init__(self, bucket, prepared):
            self.bucket, self.backend, self.prepared = bucket, backend, prepared

    backend = Backend()
    weight = torch.zeros(8, 16).to(torch.float8_e4m3fn)
    rows = []
    for bucket in (4, 1 << 62):
        prepared = PreparedWeight(data=weight, scale=torch.ones(1), n=8, k=16, dtype=Fp8Dtype.E4M3FN,
                                  weight_scale=WeightScale.PER_TENSOR, backend="fake",
                                  extra={"handle": handle, 7: torch.ones(2), "dropped": torch.ones(3)})
        rows.append(Row(bucket, prepared))
    kernel = type("Kernel", (), {"rows": rows})()
    plan = traced_plan.bind_traced(kernel, k=16, n=8, dtype=torch.bfloat16, device=torch.device("cpu"), bias=None,
                                   mode=ActScale.PER_TENSOR_DYNAMIC, input_scale=None, fp8_dtype=torch.float8_e4m3fn)
    for m in (3, 9):
        y = plan(torch.randn(m, 16, dtype=torch.bfloat16))
        assert y.shape == (m, 8) and y.dtype == torch.bfloat16
    first, second = seen
    assert first.extra["handle"] is handle and set(first.extra) == {"handle", 7}
    assert torch.equal(first.extra[7], torch.ones(2)) and (first.n, first.k, first.backend) == (8, 16, "fake")
    assert first.data.data_ptr() == rows[0].prepared.data.data_ptr() and second.extra["handle"] is handle
    assert [r.bucket for r in plan.rows] == [4, 1 << 62]
