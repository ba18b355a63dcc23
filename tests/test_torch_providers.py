"""The built-in torch providers (``torch_scaled_mm``, norm-quant ``torch``): the conformance kit
(``fp8_backends.testing``) plus what is specific to them, and the reference's own semantics."""

from __future__ import annotations

import pytest
import torch

from fp8_backends import GemmProblem, resolve_gemm_backend
from fp8_backends.core import reference
from fp8_backends.testing import GemmProviderContract, NormQuantProviderContract

FP8 = torch.float8_e4m3fn


@pytest.fixture
def gemm():
    return resolve_gemm_backend("torch_scaled_mm", problem=GemmProblem(n=48, k=32, device="cpu"))


def _weights(n, k, per_channel=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.5
    if per_channel:
        scale = (w.abs().amax(dim=1) / 448).float()
        return (w / scale[:, None]).to(FP8), scale
    return reference.quantize_dynamic_per_tensor(w)


def test_weight_prepared_once_as_column_major_view(gemm):
    w_q, w_s = _weights(32, 64)
    prepared = gemm.prepare_weight(w_q, w_s)
    assert prepared.data.shape == (64, 32) and prepared.data.stride() == (1, 64)
    assert prepared.data.data_ptr() == w_q.data_ptr()  # a view, no copy


def test_cpu_rowwise_scales_are_refused_where_this_torch_has_none(monkeypatch):
    """torch 2.11's CPU ``_scaled_mm`` takes per-tensor scales only (an INTERNAL ASSERT for row-wise ones, seen on the
    H200 host): the provider says so at resolution, from a probe made once, instead of failing in the kernel."""
    from fp8_backends.core.errors import UnsupportedProblemError
    from fp8_backends.providers import torch_scaled_mm as tsm
    from fp8_backends.registry import resolution

    probed = tsm.cpu_rowwise_supported()
    try:  # the probe's answer is this torch's: a row-wise call either works or the provider refuses it
        y = torch._scaled_mm(torch.zeros(16, 16, dtype=FP8), torch.zeros(16, 16, dtype=FP8).t(),
                             scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
        assert probed and y.shape == (16, 16)
    except RuntimeError:
        assert not probed
    monkeypatch.setattr(tsm, "cpu_rowwise_supported", lambda: False)
    resolution.reset_caches()
    for act, wscale in (("per_token", "per_tensor"), ("per_tensor_static", "per_channel")):
        problem = GemmProblem(n=48, k=32, device="cpu", act_scale=act, weight_scale=wscale)
        with pytest.raises(UnsupportedProblemError, match="per-tensor scales only"):
            resolve_gemm_backend("torch_scaled_mm", problem=problem)
    assert resolve_gemm_backend("torch_scaled_mm", problem=GemmProblem(n=48, k=32, device="cpu")) is not None


def test_reference_quant_semantics():
    x = torch.tensor([[1000.0, -1000.0, 0.5, float("inf")]])
    q = reference.quantize_static(x, torch.tensor([1.0]))
    assert q.float().tolist() == [[448.0, -448.0, 0.5, 448.0]]
    q, s = reference.quantize_dynamic_per_tensor(torch.zeros(2, 4))
    assert s.item() == pytest.approx(1e-12) and q.float().abs().sum() == 0
    q, s = reference.quantize_per_token(torch.tensor([[1.0, -2.0], [4.0, 0.5]]))
    assert s.shape == (2, 1) and s.flatten().tolist() == pytest.approx([2 / 448, 4 / 448])


# --------------------------------------------------------------------------- the conformance kit
class TestTorchScaledMMContract(GemmProviderContract):
    """Every declared combination against the reference, edge shapes, refusals, bad inputs, tracing (CPU and,
    on a GPU machine, CUDA: graphs, Inductor, no host sync, Llama-3-8B shapes at M = 1, 16, 256, 1024)."""

    gpu_shapes = tuple((m, n, k) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
                       for m in (1, 16, 256, 1024))

    def make_provider(self):
        from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend

        return TorchScaledMMBackend()


class TestTorchScaledMMFastAccumContract(GemmProviderContract):
    provider_spec = "fp8-backends:torch_scaled_mm@fast_accum=true"
    gpu_shapes = ((16, 4096, 4096), (1024, 4096, 14336))
    run_on = ("cuda",)  # fast_accum=true does nothing on the CPU, so it is refused there


class TestTorchNormQuantContract(NormQuantProviderContract):
    """The unfused reference provider: its codes must equal the reference's exactly."""

    provider_spec = "fp8-backends:torch"
    max_code_fraction = 0.0
