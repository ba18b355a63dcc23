"""N and K of any size (not multiples of 16: tensor-parallel splits, vLLM's and flashinfer's 3420 / 6840): a provider
serves them on the CPU and on SM 8.9+, ``auto`` picks it, ``Fp8Linear`` and ``quantize_model`` build such layers, and
the listing says which providers refuse them and why."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from fp8_backends import GemmProblem, quantize_model  # noqa: E402
from fp8_backends import list as listing  # noqa: E402
from fp8_backends.layers import Fp8Linear  # noqa: E402
from fp8_backends.registry.platform import simulate_platform  # noqa: E402
from fp8_backends.registry.resolution import explain, resolve_gemm_backend  # noqa: E402

UNALIGNED = ((3420, 6840), (6840, 3420), (3420, 4096), (4096, 6840))
MODES = ("per_tensor_static", "per_tensor_dynamic", "per_token")


def _relerr(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("n, k", UNALIGNED)
@pytest.mark.parametrize("sm", ["8.9", "9.0", "10.0"])
def test_auto_serves_unaligned_shapes_on_sm89_and_later(n, k, sm):
    """Every M bucket of an unaligned shape has a server (triton's masked kernels); the providers that need aligned
    rows are refused with their reasons."""
    for m in (1, 16, 256, 4096):
        res = explain("gemm", "auto", problem=GemmProblem(n=n, k=k, m=m), platform=simulate_platform(sm))
        assert res.error is None and res.chosen.entry.name == "triton", (m, res.error)
        reasons = {c.entry.name: " ".join(c.reasons) for c in res.candidates if not c.ok}
        assert "16-byte aligned rows" in reasons["torch_scaled_mm"]


def test_cpu_serves_unaligned_shapes():
    """torch's CPU _scaled_mm takes any N and K: a CPU user gets an answer in every mode (block-wise included)."""
    for act, wsc in (("per_tensor_dynamic", "per_tensor"), ("per_token", "per_channel"),
                     ("per_token_group", "block")):
        problem = GemmProblem(n=3420, k=6840, m=4, act_scale=act, weight_scale=wsc, device="cpu")
        assert resolve_gemm_backend("auto", problem=problem).name == "torch_scaled_mm"


@pytest.mark.parametrize("mode", MODES)
def test_fp8_linear_of_an_unaligned_shape_on_the_cpu(mode):
    torch.manual_seed(0)
    lin = nn.Linear(71, 37, bias=True).to(torch.bfloat16)
    layer = Fp8Linear.from_linear(lin, act_scale=mode, input_scale=0.02 if mode == "per_tensor_static" else None)
    x = torch.randn(5, 71, dtype=torch.bfloat16)
    assert layer.gemm_backend.name == "torch_scaled_mm"
    assert _relerr(layer(x), lin(x)) < 0.1
    torch._dynamo.reset()
    assert _relerr(torch.compile(layer, fullgraph=True)(x), lin(x)) < 0.1


def test_listing_names_the_refusals(capsys):
    assert listing.main(["--problem", "16,6840,3420", "--simulate-sm", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "-> triton" in out
    assert "K=3420 is not a multiple of 16 (cuBLASLt's FP8 GEMM behind torch._scaled_mm" in out
    assert "N=6840 is not a multiple of 16 (the CUTLASS kernels load tiles through TMA" in out


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n, k", UNALIGNED)
def test_gpu_fp8_linear_auto_unaligned(n, k, mode):
    """``Fp8Linear(backend="auto")`` of an unaligned shape: eager and compiled, every M bucket."""
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(lin, act_scale=mode, input_scale=0.02 if mode == "per_tensor_static" else None,
                                  backend="auto")
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    for m in (1, 5, 16, 77, 512, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = lin(x)
        assert _relerr(layer(x), want) < 0.05, (m, "eager")
        assert _relerr(compiled(x), want) < 0.05, (m, "compiled")


@pytest.mark.gpu
def test_gpu_quantize_model_builds_unaligned_layers():
    model = nn.Sequential(nn.Linear(4096, 6840), nn.SiLU(), nn.Linear(6840, 3420)).to("cuda", torch.bfloat16)
    ref = copy.deepcopy(model)
    summary = quantize_model(model)
    assert [s.name for s in summary.swapped] == ["0", "2"] and not summary.skipped
    x = torch.randn(33, 4096, device="cuda", dtype=torch.bfloat16)
    assert _relerr(model(x), ref(x)) < 0.1
