"""Sibling linears that read one input run as one GEMM (``quantize_model(fuse=...)``,
:mod:`fp8_backends.layers.shared_input`):
which siblings are fused, that every slice returns its own input's result whatever order and inputs the model
calls them with, and that a compiled model runs one GEMM per group (CPU)."""

from __future__ import annotations

import copy
import logging

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from fp8_backends import quantize_model  # noqa: E402
from fp8_backends.core import reference  # noqa: E402
from fp8_backends.core.errors import Fp8BackendError, InvalidInputError, InvalidTypeError  # noqa: E402
from fp8_backends.core.types import QuantizedActivation  # noqa: E402
from fp8_backends.layers import Fp8Linear  # noqa: E402
from fp8_backends.layers.shared_input import Fp8LinearSlice, SharedInputGroup  # noqa: E402

BF16 = torch.bfloat16


class Attn(nn.Module):
    """q from ``x``; k and v from ``kv`` (default ``x``: self-attention, else cross-attention)."""

    def __init__(self, k: int = 64, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(k, 32, bias=bias, dtype=BF16)
        self.k_proj = nn.Linear(k, 16, bias=bias, dtype=BF16)
        self.v_proj = nn.Linear(k, 16, bias=bias, dtype=BF16)
        self.o_proj = nn.Linear(32, k, bias=bias, dtype=BF16)

    def forward(self, x: torch.Tensor, kv: torch.Tensor | None = None) -> torch.Tensor:
        src = x if kv is None else kv
        q, k, v = self.q_proj(x), self.k_proj(src), self.v_proj(src)
        return self.o_proj(q * torch.cat([k, v], dim=-1))


def _model(seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(Attn(**kw), Attn(**kw)).eval()


def _x(rows: int = 5, k: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(BF16)


def _rows(attn: nn.Module, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return attn.q_proj.fused(x)[..., start:stop]


def test_default_fuses_qkv_into_one_layer_and_keeps_the_rest():
    model = _model(bias=True)
    summary = quantize_model(model, weight_scale="per_channel")
    attn = model[0]
    assert [type(attn.q_proj), type(attn.k_proj), type(attn.v_proj)] == [Fp8LinearSlice] * 3
    assert isinstance(attn.o_proj, Fp8Linear)
    fused = attn.q_proj.fused
    assert (fused.out_features, fused.in_features) == (64, 64)
    assert attn.k_proj.group is attn.q_proj.group and not hasattr(attn.k_proj, "fused")
    assert (attn.k_proj.start, attn.k_proj.out_features, attn.k_proj.in_features) == (32, 16, 64)
    assert attn.v_proj.weight.data_ptr() == fused.weight[48:].data_ptr()
    assert torch.equal(attn.v_proj.bias, fused.bias[48:64])
    assert summary.count == 8 and summary.gemms == 4
    assert summary.fused == [("0", ("q_proj", "k_proj", "v_proj"), "64x64"), ("1", ("q_proj", "k_proj", "v_proj"),
                                                                              "64x64")]
    assert {s.name: s.fused_with for s in summary.swapped}["0.k_proj"] == "q_proj+k_proj+v_proj"
    assert "2 fused group(s), 4 GEMMs for 8 layers" in str(summary)
    # the fused state dict holds the weight once, under the first sibling
    keys = [k for k in model.state_dict() if k.startswith("0.")]
    assert "0.q_proj.fused.weight" in keys and not any(k.startswith("0.k_proj") for k in keys)


def test_per_channel_fused_slices_equal_separate_layers():
    """Per-channel weight scales are the same numbers fused or not, so each slice computes what its own layer
    would."""
    fused, separate = _model(), _model()
    quantize_model(fused, weight_scale="per_channel", backend="torch_scaled_mm")
    quantize_model(separate, weight_scale="per_channel", backend="torch_scaled_mm", fuse=False)
    assert isinstance(separate[0].k_proj, Fp8Linear) and not any(isinstance(m, Fp8LinearSlice)
                                                                  for m in separate.modules())
    x = _x()
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            a = getattr(fused[0], name)(x)
            b = getattr(separate[0], name)(x)
            assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2), name
        assert torch.allclose(fused(x).float(), separate(x).float(), rtol=2e-2, atol=2e-2)


def test_a_slice_called_with_another_input_computes_from_that_input(caplog):
    model = _model()
    quantize_model(model)
    attn = model[0]
    x, enc = _x(seed=1), _x(seed=2)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="fp8_backends"):
        q = attn.q_proj(x)
        k = attn.k_proj(enc)  # cross-attention: another input than q's
        v = attn.v_proj(enc)
        model(x, )  # self-attention still served, no second warning
        model[1](x, kv=enc)
    assert torch.equal(q, _rows(attn, x, 0, 32))
    assert torch.equal(k, _rows(attn, enc, 32, 48)) and not torch.equal(k, _rows(attn, x, 32, 48))
    assert torch.equal(v, _rows(attn, enc, 48, 64))
    warnings = [r for r in caplog.records if "fuse=False" in r.getMessage()]
    assert len(warnings) == 2 and "q_proj+k_proj+v_proj" in warnings[0].getMessage()  # once per group


def test_an_input_modified_in_place_between_siblings_is_not_served_stale():
    model = _model()
    quantize_model(model)
    attn = model[0]
    x = _x()
    with torch.no_grad():
        attn.q_proj(x)
        x.mul_(2)
        k = attn.k_proj(x)
    assert torch.equal(k, _rows(attn, x, 32, 48))


def test_every_sibling_taken_clears_the_pending_result():
    model = _model()
    quantize_model(model)
    group = model[0].q_proj.group
    with torch.no_grad():
        model(_x())
    assert not group.has_pending and not group.warned
    with torch.no_grad():
        model[0].q_proj(_x())
    assert group.has_pending
    group.reset()
    assert not group.has_pending


def test_calibration_that_shows_different_inputs_keeps_the_siblings_apart(caplog):
    model = nn.Sequential(Attn(), Attn()).eval()

    class Cross(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner[1](self.inner[0](x), kv=x)  # layer 1: k/v read another tensor than q

    wrapped = Cross(model)
    with caplog.at_level(logging.INFO, logger="fp8_backends"):
        summary = quantize_model(wrapped, act_scale="per_tensor_static", calibration=[_x(), _x(seed=3)])
    assert [parent for parent, _, _ in summary.fused] == ["inner.0"]
    assert isinstance(model[0].k_proj, Fp8LinearSlice) and isinstance(model[1].k_proj, Fp8Linear)
    assert any("calibration batches gave them different inputs" in r.getMessage() for r in caplog.records)


def test_static_fused_input_scale_is_the_siblings_max():
    model = _model()
    scales = {f"{i}.{leaf}": s for i in ("0", "1")
              for leaf, s in (("q_proj", 0.1), ("k_proj", 0.3), ("v_proj", 0.2), ("o_proj", 0.05))}
    quantize_model(model, act_scale="per_tensor_static", input_scales=scales)
    assert model[0].q_proj.fused.input_scale.item() == pytest.approx(0.3)
    assert model[0].o_proj.input_scale.item() == pytest.approx(0.05)


def test_groups_need_matching_siblings_and_fuse_takes_custom_groups():
    model = nn.Module()
    model.a = nn.Linear(64, 32, dtype=BF16)
    model.b = nn.Linear(64, 48, dtype=BF16)
    model.q_proj = nn.Linear(64, 32, dtype=BF16)
    model.k_proj = nn.Linear(32, 32, dtype=BF16)  # another K: never fused with q_proj
    model.v_proj = nn.Linear(64, 32, dtype=BF16)
    summary = quantize_model(model, fuse=[("a", "b"), ("q_proj", "v_proj")])
    assert summary.fused == [("", ("a", "b"), "80x64"), ("", ("q_proj", "v_proj"), "64x64")]
    assert isinstance(model.k_proj, Fp8Linear) and isinstance(model.b, Fp8LinearSlice)
    x = _x(3)
    with torch.no_grad():
        assert torch.equal(model.b(x), model.a.fused(x)[:, 32:])
    default = nn.Module()
    default.q_proj, default.k_proj, default.v_proj = (nn.Linear(64, 32, dtype=BF16), nn.Linear(32, 32, dtype=BF16),
                                                      nn.Linear(64, 32, dtype=BF16))
    assert quantize_model(default).fused == []  # the default group needs all three alike
    mixed = nn.Module()
    mixed.gate_proj, mixed.up_proj = nn.Linear(64, 32, dtype=BF16), nn.Linear(64, 32, bias=False, dtype=BF16)
    assert quantize_model(mixed).fused == []  # bias on one sibling only


@pytest.mark.parametrize("fuse, error", [("qkv", InvalidInputError), (3, InvalidTypeError),
                                         ([("q_proj",)], InvalidInputError), ([("a", "a")], InvalidInputError)])
def test_bad_fuse_arguments_fail_before_any_layer_changes(fuse, error):
    model = _model()
    with pytest.raises(error):
        quantize_model(model, fuse=fuse)
    assert isinstance(model[0].q_proj, nn.Linear)


def test_a_copied_model_has_its_own_groups():
    model = _model()
    quantize_model(model)
    with torch.no_grad():
        model[0].q_proj(_x())  # a pending result is never copied
    twin = copy.deepcopy(model)
    group = twin[0].k_proj.group
    assert group is twin[0].q_proj.group and group is not model[0].q_proj.group
    assert group.owner is twin[0].q_proj and not group.has_pending
    x = _x(seed=4)
    with torch.no_grad():
        assert torch.equal(twin(x), model(x))


def test_compiled_model_runs_one_gemm_per_group():
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = []

    def capture(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: graphs.append(g) or g)

    model = _model()
    summary = quantize_model(model, backend="torch_scaled_mm")
    x = _x()
    with torch.no_grad():
        eager = model(x)
        torch._dynamo.reset()
        try:
            got = torch.compile(model, backend=capture, fullgraph=True)(x)
            cross = torch.compile(model[1], backend=capture, fullgraph=True)(x, _x(seed=2))
            want_cross = model[1](x, kv=_x(seed=2))
        finally:
            torch._dynamo.reset()
    assert torch.equal(got, eager) and torch.equal(cross, want_cross)
    assert graphs[0].code.count("aten._scaled_mm.default(") == summary.gemms == 4
    assert graphs[1].code.count("aten._scaled_mm.default(") == 3  # cross-attention: q's fused call and k/v's
    assert not model[0].q_proj.group.has_pending


def test_group_arguments_are_checked():
    with pytest.raises(InvalidInputError):
        SharedInputGroup([4], ["a"])
    group = SharedInputGroup([4, 4], ["a", "b"])
    with pytest.raises(InvalidInputError, match="first slice"):
        Fp8LinearSlice(group, 1)
    with pytest.raises(InvalidInputError, match="out of range"):
        Fp8LinearSlice(group, 2)


def test_slices_take_a_quantized_activation_and_reject_bad_input_with_the_librarys_error():
    model = _model()
    quantize_model(model, act_scale="per_tensor_static", input_scales={f"{i}.{leaf}": 0.05 for i in ("0", "1")
                                                                      for leaf in ("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj")})
    attn = model[0]
    x = _x()
    scale = attn.q_proj.fused.input_scale
    qa = QuantizedActivation(reference.quantize_static(x, scale), scale, x.dtype)
    with torch.no_grad():
        q, k = attn.q_proj(qa), attn.k_proj(qa)
        assert torch.equal(k, attn.q_proj.fused(x)[:, 32:48])
        assert torch.equal(q, attn.q_proj.fused(x)[:, :32])
        with pytest.raises(Fp8BackendError):
            attn.v_proj([1.0, 2.0])
        with pytest.raises(Fp8BackendError):
            attn.v_proj(torch.randn(5, 63, dtype=BF16))  # K does not match


def test_inference_mode_inputs_have_no_version_counter_and_are_served_by_identity():
    """vLLM and many servers run under ``torch.inference_mode()``, whose tensors track no version."""
    model = _model()
    quantize_model(model)
    attn = model[0]
    with torch.inference_mode():
        x = _x()
        q, k = attn.q_proj(x), attn.k_proj(x)
        v = attn.v_proj(_x(seed=9))  # another input: computed from it
        assert torch.equal(k, _rows(attn, x, 32, 48)) and torch.equal(q, _rows(attn, x, 0, 32))
        assert torch.equal(v, _rows(attn, _x(seed=9), 48, 64))
        assert model(x).shape == (5, 64)
    calibrated = _model()
    with torch.inference_mode():
        batch = _x()
    summary = quantize_model(calibrated, act_scale="per_tensor_static", calibration=[batch])
    assert len(summary.fused) == 2


@pytest.mark.parametrize("mode", ["eager", "inference", "compiled"])
def test_a_sibling_called_again_on_a_refilled_buffer_gets_a_fresh_gemm(mode):
    """A decode step that calls only ``q_proj`` on one static buffer refilled in place (``copy_``): the pending
    result of the previous step is never served again, eager, under ``inference_mode`` (no version counter) or
    compiled (identity resolved at trace time)."""
    model = _model()
    quantize_model(model, backend="torch")
    q = model[0].q_proj
    buf = _x()
    step = torch.compile(lambda t: q(t), backend="aot_eager", fullgraph=True) if mode == "compiled" else q
    context = torch.inference_mode() if mode == "inference" else torch.no_grad()
    torch._dynamo.reset()
    try:
        with context:
            buf = buf.clone()
            for seed in (3, 4, 5):
                buf.copy_(_x(seed=seed))
                got = step(buf)
                assert torch.equal(got, _rows(model[0], _x(seed=seed), 0, 32)), seed
    finally:
        torch._dynamo.reset()
