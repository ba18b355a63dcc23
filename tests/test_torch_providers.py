"""Numerics of the reference providers against fp8_backends.reference, and every input error path."""

from __future__ import annotations

import math

import pytest
import torch

from fp8_backends import (
    Fp8BackendError,
    GemmProblem,
    InvalidInputError,
    NormQuantProblem,
    QuantizedActivation,
    reference,
    resolve_gemm_backend,
    resolve_norm_quant_backend,
)
from fp8_backends.types import ActScale

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


def _relerr(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("m", [1, 17, 128])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_per_tensor_matches_reference(gemm, m, out_dtype, bias):
    n, k = 48, 64
    w_q, w_s = _weights(n, k)
    x_q, x_s = reference.quantize_dynamic_per_tensor(torch.randn(m, k))
    b = torch.randn(n).to(out_dtype) if bias else None
    prepared = gemm.prepare_weight(w_q, w_s)
    y = gemm.gemm(x_q, prepared, x_s, out_dtype=out_dtype, bias=b)
    ref = reference.fp8_gemm(x_q, w_q, x_s, w_s, out_dtype, b)
    assert y.shape == (m, n) and y.dtype == out_dtype
    tol = 1e-6 if out_dtype == torch.float32 else 1e-2
    assert _relerr(y, ref) < tol


@pytest.mark.parametrize("m", [1, 17, 128])
@pytest.mark.parametrize("w_per_channel", [False, True])
@pytest.mark.parametrize("x_per_token", [False, True])
def test_rowwise_scales_match_reference(gemm, m, w_per_channel, x_per_token):
    n, k = 32, 48
    w_q, w_s = _weights(n, k, per_channel=w_per_channel, seed=1)
    x = torch.randn(m, k) * torch.linspace(0.1, 3, m)[:, None]
    x_q, x_s = reference.quantize_per_token(x) if x_per_token else reference.quantize_dynamic_per_tensor(x)
    prepared = gemm.prepare_weight(w_q, w_s)
    y = gemm.gemm(x_q, prepared, x_s, out_dtype=torch.float32)
    ref = reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32)
    assert _relerr(y, ref) < 1e-5


def test_weight_prepared_once_as_column_major_view(gemm):
    w_q, w_s = _weights(32, 64)
    prepared = gemm.prepare_weight(w_q, w_s)
    assert prepared.data.shape == (64, 32) and prepared.data.stride() == (1, 64)
    assert prepared.data.data_ptr() == w_q.data_ptr()  # a view, no copy


def test_reference_quant_semantics():
    x = torch.tensor([[1000.0, -1000.0, 0.5, float("inf")]])
    q = reference.quantize_static(x, torch.tensor([1.0]))
    assert q.float().tolist() == [[448.0, -448.0, 0.5, 448.0]]
    q, s = reference.quantize_dynamic_per_tensor(torch.zeros(2, 4))
    assert s.item() == pytest.approx(1e-12) and q.float().abs().sum() == 0
    q, s = reference.quantize_per_token(torch.tensor([[1.0, -2.0], [4.0, 0.5]]))
    assert s.shape == (2, 1) and s.flatten().tolist() == pytest.approx([2 / 448, 4 / 448])


# --------------------------------------------------------------------------- bad input
def _bad(gemm, **over):
    w_q, w_s = _weights(32, 32)
    prepared = gemm.prepare_weight(w_q, w_s)
    args = {"x_q": torch.randn(4, 32).to(FP8), "prepared": prepared, "x_scale": torch.tensor([0.1]),
            "out_dtype": torch.bfloat16, "bias": None}
    args.update(over)
    return lambda: gemm.gemm(args["x_q"], args["prepared"], args["x_scale"], out_dtype=args["out_dtype"],
                             bias=args["bias"])


@pytest.mark.parametrize(
    "over, message",
    [
        ({"x_q": torch.randn(4, 32)}, "x_q must be float8_e4m3fn or float8_e5m2, got torch.float32"),
        ({"x_q": torch.randn(4, 16).to(FP8)}, "x_q has K=16 but the weight has K=32"),
        ({"x_q": torch.randn(2, 4, 32).to(FP8)}, "x_q must be 2-D"),
        ({"x_q": torch.randn(32, 4).to(FP8).t()}, "row-major contiguous"),
        ({"x_scale": torch.tensor([0.1], dtype=torch.bfloat16)}, "x_scale must be a float32 tensor"),
        ({"x_scale": 0.1}, "x_scale must be a torch.Tensor"),
        ({"x_scale": torch.ones(3, 1)}, r"shape \[M, 1\] = \[4, 1\]"),
        ({"x_scale": torch.tensor([float("nan")])}, "finite and > 0"),
        ({"x_scale": torch.tensor([0.0])}, "finite and > 0"),
        ({"out_dtype": torch.int8}, "unsupported output dtype"),
        ({"bias": torch.randn(31).bfloat16()}, r"bias must have shape \[N\] = \[32\]"),
        ({"bias": torch.randn(32)}, "bias must be bfloat16"),
        ({"prepared": object()}, "needs a weight prepared by torch_scaled_mm.prepare_weight"),
    ],
)
def test_gemm_bad_input(gemm, over, message):
    with pytest.raises(InvalidInputError, match=message) as info:
        _bad(gemm, **over)()
    assert isinstance(info.value, Fp8BackendError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "w_q, w_s, message",
    [
        (torch.randn(32, 32), torch.tensor([1.0]), "w_q must be float8"),
        (torch.randn(32, 24).to(FP8), torch.tensor([1.0]), "K % 16 == 0"),
        (torch.randn(24, 32).to(FP8), torch.tensor([1.0]), "N % 16 == 0"),
        (torch.randn(32, 32).to(FP8).t(), torch.tensor([1.0]), "row-major"),
        (torch.randn(32, 32).to(FP8), torch.ones(5), "one value .per-tensor. or N=32 values"),
        (torch.randn(32, 32).to(FP8), torch.tensor([float("inf")]), "finite and > 0"),
        (torch.randn(32, 32).to(FP8), torch.tensor([-1.0]), "finite and > 0"),
        (torch.randn(32, 32).to(FP8), torch.tensor([1.0], dtype=torch.float64), "float32"),
    ],
)
def test_prepare_weight_bad_input(gemm, w_q, w_s, message):
    with pytest.raises(InvalidInputError, match=message):
        gemm.prepare_weight(w_q, w_s)


def test_prepared_weight_belongs_to_its_provider(thirdparty_plugin):
    toy = resolve_gemm_backend("toy")
    torch_mm = resolve_gemm_backend("torch")
    w_q, w_s = _weights(32, 32)
    prepared = toy.prepare_weight(w_q, w_s)
    with pytest.raises(InvalidInputError, match="prepared by torch_scaled_mm"):
        torch_mm.gemm(torch.randn(2, 32).to(FP8), prepared, torch.tensor([1.0]))


def test_cuda_only_provider_refuses_cpu_tensors():
    from fp8_backends import DeviceKind, Fp8GemmBackend, GemmCapabilities, PreparedWeight

    class CudaOnly(Fp8GemmBackend):
        name = "cuda_only"
        capabilities = GemmCapabilities(devices=frozenset({DeviceKind.CUDA}))

        def prepare_weight_impl(self, w_q, w_scale, weight_scale):  # pragma: no cover - never reached
            return PreparedWeight(w_q, w_scale, 0, 0, None, weight_scale, self.name)

        def gemm_impl(self, *a):  # pragma: no cover - never reached
            raise AssertionError("kernel must not run")

    with pytest.raises(InvalidInputError, match="cuda_only runs on cuda tensors; w_q is on cpu"):
        CudaOnly().prepare_weight(torch.randn(32, 32).to(FP8), torch.tensor([1.0]))


# --------------------------------------------------------------------------- norm-quant
@pytest.fixture
def norm():
    return resolve_norm_quant_backend("torch", problem=NormQuantProblem(hidden=64, device="cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quant_matches_reference(norm, dtype):
    x = (torch.randn(5, 64) * 3).to(dtype)
    w = (1 + 0.1 * torch.randn(64)).to(dtype)
    s = torch.tensor([0.01])
    qa = norm.rmsnorm_quant(x, w, s, 1e-6)
    assert isinstance(qa, QuantizedActivation) and qa.orig_dtype == dtype and qa.mode is ActScale.PER_TENSOR_STATIC
    assert qa.data.dtype == FP8 and qa.scale is s
    ref = reference.rmsnorm_quant(x, w, s, 1e-6)
    assert torch.equal(qa.data.view(torch.uint8), ref.view(torch.uint8))
    deq = qa.data.float() * s
    assert _relerr(deq, reference.rmsnorm(x, w)) < 0.05


def test_fused_add_updates_residual_in_place(norm):
    x = torch.randn(3, 64).bfloat16()
    r = torch.randn(3, 64).bfloat16()
    expected_q, expected_r = reference.fused_add_rmsnorm_quant(x, r.clone(), torch.ones(64).bfloat16(),
                                                               torch.tensor([0.02]))
    qa, r_out = norm.fused_add_rmsnorm_quant(x, r, torch.ones(64).bfloat16(), torch.tensor([0.02]))
    assert r_out is r and torch.equal(r, expected_r)
    assert torch.equal(qa.data.view(torch.uint8), expected_q.view(torch.uint8))


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"x": torch.randn(4, 64).to(FP8)}, "x must be bfloat16, float16 or float32"),
        ({"weight": torch.ones(32).bfloat16()}, r"weight must have shape \[H\] = \[64\]"),
        ({"weight": torch.ones(64)}, "weight must have x's dtype"),
        ({"scale": torch.tensor([1.0, 2.0])}, "scale must hold one value"),
        ({"scale": torch.tensor([math.inf])}, "finite and > 0"),
        ({"eps": -1.0}, "eps must be a positive float"),
    ],
)
def test_norm_bad_input(norm, kw, message):
    args = {"x": torch.randn(4, 64).bfloat16(), "weight": torch.ones(64).bfloat16(), "scale": torch.tensor([0.1]),
            "eps": 1e-6}
    args.update(kw)
    with pytest.raises(InvalidInputError, match=message):
        norm.rmsnorm_quant(args["x"], args["weight"], args["scale"], args["eps"])


def test_norm_residual_mismatch(norm):
    with pytest.raises(InvalidInputError, match="residual must match x"):
        norm.fused_add_rmsnorm_quant(torch.randn(4, 64).bfloat16(), torch.randn(4, 64).half(),
                                     torch.ones(64).bfloat16(), torch.tensor([0.1]))
