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
    """Every M bucket of an unaligned shape has a server (triton's masked kernels, torch_scaled_mm's padding); the
    providers that need aligned rows are refused with their reasons."""
    for m in (1, 16, 256, 4096):
        res = explain("gemm", "auto", problem=GemmProblem(n=n, k=k, m=m), platform=simulate_platform(sm))
        assert res.error is None and res.chosen.entry.name in ("triton", "torch_scaled_mm"), (m, res.error)
        ok = {c.entry.name for c in res.candidates if c.ok}
        assert {"triton", "torch_scaled_mm"} <= ok
        reasons = {c.entry.name: " ".join(c.reasons) for c in res.candidates if not c.ok}
        assert "not a multiple of 16" in reasons["cutlass"]


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
    assert "-> triton" in out or "-> torch_scaled_mm" in out
    assert "N=6840 is not a multiple of 16 (the CUTLASS kernels load tiles through TMA" in out


@pytest.fixture
def cuda_padding(monkeypatch):
    """torch_scaled_mm pads the weight on the CPU as it does on CUDA (where cuBLASLt needs 16-byte rows), so that the
    padded path (weight, activation written padded by the quantizer, output view, bias) runs here."""
    from fp8_backends.providers import torch_scaled_mm

    monkeypatch.setattr(torch_scaled_mm, "pads_rows", lambda device_type: True)


@pytest.mark.parametrize("mode, wscale", [("per_tensor_static", "per_tensor"), ("per_tensor_dynamic", "per_tensor"),
                                          ("per_token", "per_channel"), ("per_tensor_dynamic", "per_channel")])
@pytest.mark.parametrize("n, k", [(37, 71), (48, 40), (40, 48)])
def test_torch_scaled_mm_pads_unaligned_weights(cuda_padding, mode, wscale, n, k):
    """The padded path: a [N16, K16] weight, the activation quantized straight into K16 columns by the eager plan,
    the output an [M, N] view; right eagerly, compiled, with a bias, for 2-D and 3-D inputs and on the general path
    (an already quantized activation of K columns, padded per call)."""
    from fp8_backends import quant
    from fp8_backends.core.types import QuantizedActivation

    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=True).to(torch.bfloat16)
    layer = Fp8Linear.from_linear(lin, act_scale=mode, weight_scale=wscale, backend="torch_scaled_mm",
                                  input_scale=0.02 if mode == "per_tensor_static" else None)
    prepared = layer.prepared
    k16 = -(-k // 16) * 16
    assert prepared.data.shape == (k16, -(-n // 16) * 16) and prepared.k_pad == (k16 if k % 16 else None)
    for x in (torch.randn(5, k, dtype=torch.bfloat16), torch.randn(2, 3, k, dtype=torch.bfloat16),
              torch.randn(k, 4, dtype=torch.bfloat16).t()):
        want = lin(x)
        y = layer(x)
        assert y.shape == want.shape and _relerr(y, want) < 0.1
        torch._dynamo.reset()
        assert _relerr(torch.compile(layer, fullgraph=True)(x), want) < 0.1
    x = torch.randn(6, k, dtype=torch.bfloat16)
    q, s = quant.quantize_per_token(x) if mode == "per_token" else quant.quantize_dynamic(x)
    if mode != "per_tensor_static":
        assert _relerr(layer(QuantizedActivation(q, s, x.dtype, mode)), lin(x)) < 0.1


def test_torch_scaled_mm_pads_large_dims_to_tile_multiples(cuda_padding):
    """From 2048 on a dimension pads to a multiple of 128 (the aligned neighbour's GEMM), and the answer is right."""
    torch.manual_seed(0)
    lin = nn.Linear(2060, 2050, bias=True).to(torch.bfloat16)
    layer = Fp8Linear.from_linear(lin, act_scale="per_token", weight_scale="per_channel", backend="torch_scaled_mm")
    assert layer.prepared.data.shape == (2176, 2176) and layer.prepared.k_pad == 2176
    x = torch.randn(3, 2060, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (3, 2050) and y.stride() == (2176, 1) and _relerr(y, lin(x)) < 0.1


def test_padded_sizes():
    """16-aligned sizes stay; others round up to 16, or to 128 from 2048 on (the aligned neighbour's GEMM)."""
    from fp8_backends.core.padding import padded_size

    assert [padded_size(v) for v in (16, 17, 71, 2047, 2048, 3420, 6840, 6912)] == [16, 32, 80, 2048, 2048, 3456,
                                                                                     6912, 6912]


def test_padded_quantizer_writes_zeros_beyond_k():
    """Codes padded to k_pad columns: through a kernel that writes them so (pads_output), or padded after one that
    does not (the reference); the same codes and scales as the unpadded quantization."""
    from fp8_backends import quant
    from fp8_backends.core import reference
    from fp8_backends.core.types import ActScale

    x = torch.randn(7, 30, dtype=torch.bfloat16)
    calls = []

    def padding_impl(x, fp8_dtype, *, k_out=None):
        calls.append(k_out)
        q, s = reference.quantize_per_token(x, fp8_dtype)
        return torch.nn.functional.pad(q.view(torch.uint8), (0, k_out - q.shape[1])).view(q.dtype), s

    padding_impl.pads_output = True
    want_q, want_s = quant.quantize_per_token(x)
    for impl in (None, padding_impl):
        previous = quant.register_quant_impl("per_token", "cpu", impl)
        try:
            q, s = quant.padded_quantizer(ActScale.PER_TOKEN, torch.float8_e4m3fn, None, 32)(x)
        finally:
            quant.register_quant_impl("per_token", "cpu", previous)
        assert q.shape == (7, 32) and torch.equal(q[:, :30].view(torch.uint8), want_q.view(torch.uint8))
        assert not q[:, 30:].view(torch.uint8).any() and torch.equal(s, want_s)
    assert calls == [32]


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


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch_scaled_mm", "triton"])
@pytest.mark.parametrize("mode", MODES)
def test_gpu_padding_providers_unaligned(backend, mode):
    """Each padding provider named explicitly, with a bias: eager (the activation quantized into the padded width),
    compiled and replayed in a CUDA graph, and an activation already quantized to K columns (padded per call)."""
    from fp8_backends import quant

    torch.manual_seed(0)
    for n, k in ((3420, 6840), (6840, 3420), (37, 71)):
        lin = nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
        layer = Fp8Linear.from_linear(lin, act_scale=mode, backend=backend,
                                      input_scale=0.02 if mode == "per_tensor_static" else None)
        torch._dynamo.reset()
        compiled = torch.compile(layer, dynamic=False) if n == 3420 else None  # (one shape: compiles are slow)
        for m in (1, 16, 300):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = lin(x)
            assert _relerr(layer(x), want) < 0.05, (n, k, m, "eager")
            if compiled is not None and m != 16:
                assert _relerr(compiled(x), want) < 0.05, (n, k, m, "compiled")
            static_x = x.clone()
            graph = torch.cuda.CUDAGraph()
            layer(static_x)
            with torch.cuda.graph(graph):
                out = layer(static_x)
            static_x.copy_(torch.randn_like(x))
            graph.replay()
            assert _relerr(out, lin(static_x)) < 0.05, (n, k, m, "graph")
            if mode != "per_tensor_static":
                y = layer(quant.quantize(x, mode))
                assert _relerr(y, want) < 0.05, (n, k, m, "quantized input")


def test_a_k_padded_weight_skips_the_fused_launch():
    """A provider's fused quantize+GEMM launch reads the unpadded K with masked loads: a K-padded weight runs the
    padded quantization, then the GEMM on aligned rows."""
    from types import SimpleNamespace

    from fp8_backends.core.backend import Fp8GemmBackend
    from fp8_backends.core.types import ActScale
    from fp8_backends.layers.eager_plan import bind_linear

    calls = []

    class Backend:
        fused_act_quant = frozenset({ActScale.PER_TENSOR_DYNAMIC})
        fused_act_quant_in_graphs = None
        fuses_act_quant = Fp8GemmBackend.fuses_act_quant
        fuses_act_quant_for = Fp8GemmBackend.fuses_act_quant_for

        def bind_fused_quant_gemm(self, *args):
            calls.append("fused")
            return lambda x: "fused"

        def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
            calls.append(("gemm", tuple(x_q.shape)))
            return "gemm"

    def quantize(x):
        return torch.zeros(x.shape[0], 32, dtype=torch.float8_e4m3fn), torch.ones(1)

    data = torch.zeros(8, 32, dtype=torch.float8_e4m3fn)
    for k_pad, want in ((None, "fused"), (32, "gemm")):
        calls.clear()
        prepared = SimpleNamespace(data=data, k_pad=k_pad)
        linear = bind_linear(Backend(), prepared, torch.bfloat16, None, quantize, ActScale.PER_TENSOR_DYNAMIC, None,
                             torch.float8_e4m3fn)
        assert linear(torch.zeros(2, 30)) == want
        assert ("fused" in calls) == (want == "fused")


def test_captured_calls_skip_a_fused_launch_the_provider_keeps_out_of_graphs(monkeypatch):
    """A provider whose fused quantize+GEMM launch loses inside a CUDA graph for some modes (triton's dynamic modes:
    every program recomputes the scale) lists the others in ``fused_act_quant_in_graphs``: captured calls of the
    left-out modes quantize, then run the GEMM; eager calls keep the fused launch; a mode fused in both needs no second
    binding."""
    from types import SimpleNamespace

    from fp8_backends.core.backend import Fp8GemmBackend
    from fp8_backends.core.types import ActScale
    from fp8_backends.layers import eager_plan

    calls = []
    modes = frozenset({ActScale.PER_TENSOR_DYNAMIC, ActScale.PER_TOKEN, ActScale.PER_TENSOR_STATIC})

    class Backend:
        fused_act_quant = modes
        fused_act_quant_in_graphs = frozenset({ActScale.PER_TENSOR_STATIC})
        fuses_act_quant = Fp8GemmBackend.fuses_act_quant
        fuses_act_quant_for = Fp8GemmBackend.fuses_act_quant_for
        capabilities = SimpleNamespace(group_scale_layout=None)

        def bind_fused_quant_gemm(self, *args):
            def fused(x):
                calls.append("fused")
                return torch.zeros(x.shape[0], 8, dtype=torch.bfloat16)
            return fused

        def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
            calls.append("gemm")
            return torch.zeros(x_q.shape[0], 8, dtype=torch.bfloat16)

    monkeypatch.setattr(eager_plan, "bind_quantizer", lambda *a: lambda x: (x.to(torch.float8_e4m3fn), torch.ones(1)))
    prepared = SimpleNamespace(data=torch.zeros(8, 32, dtype=torch.float8_e4m3fn), k_pad=None, group_size=None)
    row = SimpleNamespace(backend=Backend(), prepared=prepared, bucket=16)
    kernel = SimpleNamespace(rows=(row,), graph_rows=(row,), split=False)
    for mode in modes:
        plan = eager_plan.bind_per_m(kernel, k=32, n=8, dtype=torch.bfloat16, device=torch.device("cpu"), bias=None,
                                     mode=mode, input_scale=torch.ones(1), fp8_dtype=torch.float8_e4m3fn)
        assert (plan.graph_rows is None) == (mode is ActScale.PER_TENSOR_STATIC), mode
        for capturing in (False, True):
            plan.capturing = lambda capturing=capturing: capturing
            calls.clear()
            plan(torch.zeros(2, 32, dtype=torch.bfloat16))
            dynamic = mode is not ActScale.PER_TENSOR_STATIC
            assert calls == (["gemm"] if capturing and dynamic else ["fused"]), (mode, capturing)


def test_unaligned_shapes_read_the_shipped_data_of_their_padded_neighbour():
    """The shipped data holds no unaligned shape; the providers that serve one run (or mask) the padded neighbour's
    GEMM, so auto asks the data about the padded shape (3420 x 6840 -> 3456 x 6912) and says so in its note."""
    h200 = simulate_platform("9.0")
    for m in (1, 16, 256, 4096):
        for mode in ("per_tensor_dynamic", "per_token"):
            weight = "per_tensor" if mode == "per_tensor_dynamic" else "per_channel"
            got = explain("gemm", "auto", problem=GemmProblem(n=3420, k=6840, m=m, act_scale=mode,
                                                             weight_scale=weight, device="cuda"), platform=h200)
            near = explain("gemm", "auto", problem=GemmProblem(n=3456, k=6912, m=m, act_scale=mode,
                                                              weight_scale=weight, device="cuda"), platform=h200)
            assert got.source.startswith("shipped") and "looked up as 3456x6912 (padded)" in got.note, got.note
            assert "padded" not in near.note
            if near.backend.name in ("torch_scaled_mm", "triton"):  # the neighbour's choice serves unaligned N, K
                assert got.backend.label == near.backend.label, (m, mode, got.note, near.note)
