"""The provider output contract: a provider whose result has the wrong shape, dtype, type or device is stopped with a
``ProviderOutputError`` naming it and its distribution before the caller sees the result — through
``backend.gemm``, ``fp8_linear``, ``Fp8Linear``'s bound eager plan, fake tensors and ``torch.compile`` — and the
tuner rejects such candidates, saying so.

The broken providers are registered in-process as a third-party distribution (``broken-plugin 0.1``), the way
tests/test_tuning.py registers its ``FakeMM``.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
from fake_provider import install

from fp8_backends import fp8_linear
from fp8_backends.core import reference
from fp8_backends.core.backend import Fp8GemmBackend, NormQuantBackend
from fp8_backends.core.capabilities import GemmCapabilities, NormQuantCapabilities
from fp8_backends.core.errors import Fp8BackendError, ProviderOutputError
from fp8_backends.core.types import ActScale, DeviceKind, GemmProblem, OutDtype, WeightScale
from fp8_backends.layers import Fp8Linear
from fp8_backends.registry import lockfile
from fp8_backends.registry.platform import cpu_platform
from fp8_backends.tuning import engine as tuner
from fp8_backends.tuning.timing import Measurement

torch = pytest.importorskip("torch")

DIST = "broken-plugin"
FAULTS = ("none", "transposed", "fp32", "bf16", "no_tensor", "extra_row", "fake_transposed")


@torch.library.custom_op("fp8_backends_tests::contract_gemm", mutates_args=())
def _contract_gemm(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype, fault: str) -> torch.Tensor:
    y = reference.fp8_gemm(x_q, w_q, x_scale, w_scale, out_dtype)
    if fault == "transposed":
        return y.t().contiguous()
    if fault == "fp32":
        return y.float()
    if fault == "bf16":
        return y.to(torch.bfloat16)
    if fault == "extra_row":
        return torch.cat([y, y[:1]])
    return y


@_contract_gemm.register_fake
def _(x_q, w_q, x_scale, w_scale, out_dtype, fault):
    m, n = x_q.shape[0], w_q.shape[0]
    if fault in ("transposed", "fake_transposed"):  # "fake_transposed": right eager result, wrong fake shape
        return x_q.new_empty((n, m), dtype=out_dtype)
    if fault == "fp32":
        return x_q.new_empty((m, n), dtype=torch.float32)
    return x_q.new_empty((m, n), dtype=out_dtype)


class BrokenGemm(Fp8GemmBackend):
    """A CPU GEMM provider with a chosen fault (option ``fault``); ``none`` is correct."""

    name: ClassVar[str] = "broken_gemm"
    options: ClassVar[dict[str, tuple[str, ...]]] = {"fault": FAULTS}
    tunable_options: ClassVar[tuple[str, ...]] = ("fault",)
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU, DeviceKind.CUDA}), act_scales=frozenset(ActScale),
        weight_scales=frozenset(WeightScale), out_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16, OutDtype.FP32}),
        priority=-5)

    def prepare_weight_impl(self, w_q, w_scale, weight_scale):
        return self.prepare_k_major(w_q, w_scale, weight_scale)

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        if self.config["fault"] == "no_tensor":
            return None
        return _contract_gemm(x_q, prepared.data, x_scale, prepared.scale, out_dtype, self.config["fault"])


class ReturnsNewTensorNorm(NormQuantBackend):
    """A norm-quant provider that returns its result instead of writing ``out``."""

    name: ClassVar[str] = "returns_new_norm"
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities(devices=frozenset({DeviceKind.CPU}))

    def rmsnorm_quant_impl(self, out, x, weight, scale, eps):
        return reference.rmsnorm_quant(x, weight, scale, eps)

    def fused_add_rmsnorm_quant_impl(self, out, x, residual, weight, scale, eps):
        residual.add_(x)
        return reference.rmsnorm_quant(residual, weight, scale, eps)


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    """Both broken providers registered beside the real ones, as distribution broken-plugin 0.1."""
    from fp8_backends.core import output_contract

    for cls in (BrokenGemm, ReturnsNewTensorNorm):
        install(monkeypatch, cls, dist=DIST, version="0.1")
    lockfile.reset_state()
    yield
    output_contract.distribution_of.cache_clear()
    lockfile.reset_state()


def _operands(m=5, n=32, k=64, per_token=False):
    w_q, w_s = reference.quantize_dynamic_per_tensor(torch.randn(n, k))
    x = torch.randn(m, k)
    x_q, x_s = reference.quantize_per_token(x) if per_token else reference.quantize_dynamic_per_tensor(x)
    return x_q, x_s, w_q, w_s


def _assert_names_the_provider(exc: BaseException, fault_text: str) -> None:
    text = str(exc)
    assert "broken_gemm" in text and f"distribution {DIST} 0.1" in text and fault_text in text, text
    assert "output contract" in text


# ------------------------------------------------------------------------------------------ eager calls
@pytest.mark.parametrize(("fault", "text"), [("transposed", "shape [32, 5] instead of [M, N] = [5, 32]"),
                                             ("extra_row", "shape [6, 32]"),
                                             ("fp32", "dtype torch.float32 instead of torch.bfloat16"),
                                             ("no_tensor", "returned NoneType")])
def test_gemm_catches_a_wrong_output(fault, text):
    backend = BrokenGemm(fault=fault)
    x_q, x_s, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)
    with pytest.raises(ProviderOutputError) as info:
        backend.gemm(x_q, prepared, x_s, out_dtype=torch.bfloat16)
    _assert_names_the_provider(info.value, text)
    assert isinstance(info.value, Fp8BackendError) and isinstance(info.value, RuntimeError)
    assert info.value.provider == "broken_gemm" and info.value.distribution == f"{DIST} 0.1"


def test_a_correct_provider_and_the_builtins_pass():
    x_q, x_s, w_q, w_s = _operands(per_token=True)
    for backend in (BrokenGemm(fault="none"), BrokenGemm(fault="fake_transposed")):
        y = backend.gemm(x_q, backend.prepare_weight(w_q, w_s), x_s, out_dtype=torch.float16)
        assert y.shape == (5, 32) and y.dtype == torch.float16


def test_fp8_linear_catches_a_wrong_output():
    backend = BrokenGemm(fault="fp32")
    _, _, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)
    with pytest.raises(ProviderOutputError) as info:
        fp8_linear(torch.randn(2, 3, 64, dtype=torch.bfloat16), prepared, backend=backend)
    _assert_names_the_provider(info.value, "dtype torch.float32")


@pytest.mark.parametrize("fault", ["transposed", "fp32", "bf16"])
def test_fp8_linear_layer_eager_plan_catches_a_wrong_output(fault):
    """The processed layer's bound eager plan (no per-call validation) checks the output too; a transposed result
    of a square layer has the right shape and is the reference check's business (test_tuner_*)."""
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32, bias=False, dtype=torch.float16),
                                  backend=BrokenGemm(fault=fault))
    assert layer._plan is not None
    x = torch.randn(2, 5, 64, dtype=torch.float16)
    with pytest.raises(ProviderOutputError) as info:
        layer(x)
    _assert_names_the_provider(info.value, "instead of")
    assert any(entry.path.name == "eager_plan.py" for entry in info.traceback)  # caught by the plan itself
    with pytest.raises(ProviderOutputError):
        layer(x.reshape(-1, 64))


def test_layer_plan_passes_a_correct_provider():
    layer = Fp8Linear.from_linear(torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16), backend=BrokenGemm())
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    y = layer(x)
    ref = torch.nn.functional.linear(x.float(), layer.weight.float() * layer.weight_scale.float())
    assert y.shape == (3, 32) and y.dtype == torch.bfloat16
    assert (y.float() - ref).norm() / ref.norm() < 0.1


# ------------------------------------------------------------------------------------------ fake tensors, compile
def test_fake_tensor_mode_catches_a_wrong_fake_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    backend = BrokenGemm(fault="fake_transposed")
    x_q, x_s, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)
    mode = FakeTensorMode()
    with mode:
        fx, fs = mode.from_tensor(x_q), mode.from_tensor(x_s)
        fw = type(prepared)(**{**prepared.__dict__, "data": mode.from_tensor(prepared.data),
                               "scale": mode.from_tensor(prepared.scale)})
        with pytest.raises(ProviderOutputError) as info:
            backend.gemm(fx, fw, fs, out_dtype=torch.bfloat16)
    _assert_names_the_provider(info.value, "shape [32, 5]")


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize("fault", ["fake_transposed", "fp32"])
def test_torch_compile_refuses_a_wrong_fake_output(fullgraph, fault):
    """A wrong fake output fails tracing with the library error as the cause — also without fullgraph, where a
    plain exception would make Dynamo fall back to eager silently."""
    backend = BrokenGemm(fault=fault)
    _, _, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)

    def f(x):
        return fp8_linear(x, prepared, backend=backend) * 2

    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as info:
            torch.compile(f, fullgraph=fullgraph, backend="aot_eager")(torch.randn(5, 64, dtype=torch.bfloat16))
    finally:
        torch._dynamo.reset()
    chain, exc = [], info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert any(isinstance(e, ProviderOutputError) for e in chain) or "ProviderOutputError" in str(info.value), (
        repr(info.value))
    assert "broken_gemm" in str(info.value) and "output contract" in str(info.value)


def test_torch_compile_of_a_correct_provider_still_works():
    backend = BrokenGemm()
    _, _, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    try:
        y = torch.compile(lambda t: fp8_linear(t, prepared, backend=backend), fullgraph=True, backend="aot_eager")(x)
    finally:
        torch._dynamo.reset()
    assert torch.equal(y, fp8_linear(x, prepared, backend=backend))


# ------------------------------------------------------------------------------------------ norm-quant
def test_norm_quant_that_returns_instead_of_writing_out_is_caught():
    backend = ReturnsNewTensorNorm()
    x, w = torch.randn(4, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16)
    scale = torch.tensor([0.05])
    with pytest.raises(ProviderOutputError, match=rf"returns_new_norm.*{DIST} 0.1.*rmsnorm_quant_impl returned"):
        backend.rmsnorm_quant(x, w, scale)
    with pytest.raises(ProviderOutputError, match="fused_add_rmsnorm_quant_impl returned a Tensor"):
        backend.fused_add_rmsnorm_quant(x, x.clone(), w, scale)


# ------------------------------------------------------------------------------------------ the tuner
def _timer(runs):
    out = {}
    for label, run in runs.items():
        run.fn(0)
        out[label] = Measurement.of([50.0 if "none" in label else 10.0] * 3, "fake")  # broken ones "faster"
    return out


def test_tuner_rejects_candidates_that_break_the_contract_or_the_reference(tmp_path, caplog):
    """Square (N = K = M) so that a transposed output has the right shape: the reference check rejects it; the
    others break the contract. The broken candidates are reported "faster" and still never win."""
    problem = GemmProblem(n=32, k=32, out_dtype="float16", device="cpu")
    with caplog.at_level(logging.INFO, logger="fp8_backends"):
        report = tuner.tune([problem], m_buckets=[5, 32], platform=cpu_platform(), timer=_timer,
                            lockfile=tmp_path / "sel.lock.json", progress=False, providers=["broken_gemm"])
    by_m = {pr.m: {r.label: r for r in pr.results} for pr in report.problems}
    for m, results in by_m.items():
        assert results["broken_gemm[fault=none]"].ok
        winner = next(pr.winner for pr in report.problems if pr.m == m)
        assert winner.label in ("broken_gemm[fault=none]", "broken_gemm[fault=fake_transposed]")
        for fault in ("fp32", "bf16", "no_tensor", "extra_row"):
            r = results[f"broken_gemm[fault={fault}]"]
            assert not r.ok and "output contract" in r.reason, (m, fault, r.reason)
        transposed = results["broken_gemm[fault=transposed]"]
        assert not transposed.ok
        assert ("output contract" if m != 32 else "against the reference") in transposed.reason, transposed.reason
    summary, rejections = tuner.format_summary(report), tuner.format_rejections(report)
    assert "output contract" in summary and "ProviderOutputError" in rejections
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "output contract" in r.getMessage()]
    assert warned and all("broken_gemm" in r.getMessage() for r in warned)
