"""Per-M selection is one composite provider (:class:`fp8_backends.registry.per_m.PerMGemm`), chosen once per weight:
``Fp8Linear`` holds one, and ``fp8_linear`` users get the same per-M choice from ``init_fp8_gemm``."""

from __future__ import annotations

import copy

import pytest
import torch
from fake_provider import FakeMM, install_split
from torch import nn

from fp8_backends import GemmProblem, InvalidInputError, PerMGemm, fp8_linear, init_fp8_gemm, quant
from fp8_backends.core import reference
from fp8_backends.layers import Fp8Linear
from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend
from fp8_backends.registry import resolution

N, K = 32, 64
PROBLEM = GemmProblem(n=N, k=K, act_scale="per_tensor_dynamic", device="cpu")


@pytest.fixture
def split(monkeypatch):
    """``fake_mm`` serves M <= 8, ``torch_scaled_mm`` larger M; both record which one ran."""
    install_split(monkeypatch)
    ran: list[str] = []
    for cls in (FakeMM, TorchScaledMMBackend):
        real = cls.gemm_impl
        monkeypatch.setattr(cls, "gemm_impl", lambda self, *a, _r=real: ran.append(self.name) or _r(self, *a))
    return ran


def _weight():
    return reference.quantize_dynamic_per_tensor(torch.randn(N, K))


def _relerr(y, want):
    return float((y.float() - want.float()).norm() / want.float().norm())


def test_init_fp8_gemm_prepares_once_per_provider_and_picks_by_m(split, monkeypatch):
    prepared = []
    for cls in (FakeMM, TorchScaledMMBackend):
        real = cls.prepare_weight
        monkeypatch.setattr(cls, "prepare_weight",
                            lambda self, w, s, _r=real: prepared.append(self.name) or _r(self, w, s))
    w_q, w_s = _weight()
    kernel = init_fp8_gemm(w_q, w_s, problem=PROBLEM)
    assert isinstance(kernel, PerMGemm) and kernel.per_m
    assert [(r.bucket, r.backend.name) for r in kernel.rows] == [(8, "fake_mm"), (9, "torch_scaled_mm")]
    assert kernel.backend.name == "torch_scaled_mm"  # M unknown: no policy decides, static priority
    assert sorted(prepared) == ["fake_mm", "torch_scaled_mm"]  # once per distinct provider
    assert kernel.describe() == "M<=8:fake_mm[variant=auto],M>8:torch_scaled_mm[fast_accum=false]"
    assert [kernel.pick(m).backend.name for m in (1, 8, 9, 10_000)] == ["fake_mm"] * 2 + ["torch_scaled_mm"] * 2
    for m in (1, 8, 9, 100):
        x = torch.randn(m, K, dtype=torch.bfloat16)
        y = fp8_linear(x, kernel)
        x_q, x_s = reference.quantize_dynamic_per_tensor(x)
        assert _relerr(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)) < 1e-2
    assert split == ["fake_mm", "fake_mm", "torch_scaled_mm", "torch_scaled_mm"]
    # the composite's own GEMM on quantized inputs
    x_q, x_s = reference.quantize_dynamic_per_tensor(torch.randn(3, K))
    split.clear()
    assert kernel.gemm(x_q, x_s, out_dtype=torch.bfloat16).shape == (3, N) and split == ["fake_mm"]


def test_one_row_for_an_explicit_choice_or_an_instance(split):
    w_q, w_s = _weight()
    for backend in ("torch_scaled_mm", TorchScaledMMBackend(), "fake_mm"):
        kernel = init_fp8_gemm(w_q, w_s, problem=PROBLEM, backend=backend)
        assert not kernel.per_m and len(kernel.rows) == 1 and kernel.describe() == kernel.backend.label
    given = TorchScaledMMBackend()
    assert init_fp8_gemm(w_q, w_s, problem=PROBLEM, backend=given).backend is given
    with pytest.raises(InvalidInputError, match="GemmProblem"):
        init_fp8_gemm(w_q, w_s, problem="32x64")


def test_fp8_linear_with_a_kernel_refuses_a_second_backend(split):
    w_q, w_s = _weight()
    kernel = init_fp8_gemm(w_q, w_s, problem=PROBLEM)
    with pytest.raises(InvalidInputError, match="from the kernel"):
        fp8_linear(torch.randn(2, K, dtype=torch.bfloat16), kernel, backend=kernel.backend)
    with pytest.raises(InvalidInputError, match="init_fp8_gemm"):
        fp8_linear(torch.randn(2, K, dtype=torch.bfloat16), w_q)


def test_fp8_linear_with_a_kernel_compiles_without_graph_breaks(split):
    w_q, w_s = _weight()
    kernel = init_fp8_gemm(w_q, w_s, problem=PROBLEM)

    def run(x):
        return fp8_linear(x, kernel)

    compiled = torch.compile(run, fullgraph=True, backend="aot_eager")
    for m in (2, 20):
        x = torch.randn(m, K, dtype=torch.bfloat16)
        split.clear()
        assert torch.equal(compiled(x), run(x))


def test_the_layer_holds_one_composite_and_binds_its_rows(split):
    lin = nn.Linear(K, N, bias=False, dtype=torch.bfloat16)  # fake_mm takes no bias
    layer = Fp8Linear.from_linear(lin, act_scale="per_tensor_dynamic")
    kernel = layer.kernel
    assert isinstance(kernel, PerMGemm) and kernel.per_m
    assert layer.gemm_backend is kernel.backend and layer.prepared is kernel.prepared
    assert len(layer._plan.rows) == len(kernel.rows)  # bound at load time, one closure per row
    assert layer.backends_text == kernel.describe() and "backends=M<=8:fake_mm[" in repr(layer)
    for m, want in ((4, "fake_mm"), (40, "torch_scaled_mm")):
        split.clear()
        layer(torch.randn(m, K, dtype=torch.bfloat16))  # eager plan
        assert split == [want]
        split.clear()
        qa = quant.quantize(torch.randn(m, K, dtype=torch.bfloat16), "per_tensor_dynamic", None)
        layer(qa)  # a QuantizedActivation takes the general path: the same composite
        assert split == [want]
    # the composite is no part of the state dict; loading one drops it until the layer is processed again
    state = layer.state_dict()
    assert set(state) == {"weight", "weight_scale"}
    layer.load_state_dict(state)
    assert layer.kernel is None and layer.gemm_backend is None and layer.prepared is None
    layer.process_weights_after_loading()
    twin = copy.deepcopy(layer)
    assert isinstance(twin.kernel, PerMGemm) and twin.kernel.per_m
    x = torch.randn(3, K, dtype=torch.bfloat16)
    assert torch.equal(twin(x), layer(x))


def test_resolve_gemm_buckets_still_returns_the_table(split):
    table = resolution.resolve_gemm_buckets(problem=GemmProblem(n=N, k=K, device="cpu"))
    assert [(b, p.name) for b, p in table] == [(8, "fake_mm"), (9, "torch_scaled_mm")]
