"""``OpGemmBackend``: a GEMM provider whose ``gemm_impl`` is one op call (the built-in ``triton``, ``cutlass`` and
``flashinfer_bmm`` providers, and third parties with a plain ``torch.library.custom_op``).

Both test providers (:mod:`op_gemm_provider`) pass the conformance kit (registered in-process for it), and the base's
contract is pinned: the op loads once, lazily, at preload; options become its trailing arguments; a fused bias is
passed to it, an added-after one applied by the base; strided vectors are refused where the kernel needs unit
stride; plain eager calls skip the dispatcher for ops of :mod:`fp8_backends.core.oplib` while tracing still sees the op.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fake_provider import install  # noqa: E402
from op_gemm_provider import OP_DIST, CustomOpGemm, LibraryOpGemm  # noqa: E402

from fp8_backends import BiasMode, InvalidInputError, OpGemmBackend  # noqa: E402
from fp8_backends.core import reference  # noqa: E402
from fp8_backends.testing import GemmProviderContract, assert_gemm_close  # noqa: E402


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    """Both providers listed as distribution op-test-plugin (the kit checks that its provider is registered)."""
    for cls in (CustomOpGemm, LibraryOpGemm):
        install(monkeypatch, cls, dist=OP_DIST)


class TestCustomOpGemmContract(GemmProviderContract):
    def make_provider(self):
        return CustomOpGemm()


class TestCustomOpGemmFloat64Contract(GemmProviderContract):
    def make_provider(self):
        return CustomOpGemm(compute="float64")


class TestLibraryOpGemmContract(GemmProviderContract):
    def make_provider(self):
        return LibraryOpGemm()


def _operands(m=5, n=32, k=64):
    w_q, w_s = reference.quantize_dynamic_per_tensor(torch.randn(n, k))
    x_q, x_s = reference.quantize_per_token(torch.randn(m, k))
    return x_q, x_s, w_q, w_s


def test_the_op_loads_once_at_preload_not_at_construction():
    CustomOpGemm.loads.clear()
    backend = CustomOpGemm(compute="float64")
    assert CustomOpGemm.loads == [] and backend.op_args == ("float64",)
    x_q, x_s, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)  # preloads
    assert CustomOpGemm.loads == ["op_custom_gemm"]
    for _ in range(2):
        y = backend.gemm(x_q, prepared, x_s, out_dtype=torch.float32)
    assert CustomOpGemm.loads == ["op_custom_gemm"]
    assert_gemm_close(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32), torch.float32)


def test_an_instance_that_never_prepared_loads_the_op_at_its_first_call():
    x_q, x_s, w_q, w_s = _operands()
    prepared = CustomOpGemm().prepare_weight(w_q, w_s)
    other = CustomOpGemm()
    assert other._op is None
    y = other.gemm(x_q, prepared, x_s, out_dtype=torch.bfloat16)
    assert other._op is not None and y.dtype is torch.bfloat16


@pytest.mark.parametrize("cls", [CustomOpGemm, LibraryOpGemm])
def test_bias_fused_or_added_after(cls):
    x_q, x_s, w_q, w_s = _operands()
    bias = torch.randn(32)
    backend = cls()
    y = backend.gemm(x_q, backend.prepare_weight(w_q, w_s), x_s, out_dtype=torch.float32, bias=bias)
    assert_gemm_close(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32, bias), torch.float32)


def test_library_op_runs_its_implementation_directly_in_eager_and_the_op_under_tracing():
    import op_gemm_ops
    from torch._subclasses.fake_tensor import FakeTensorMode

    backend = LibraryOpGemm()
    x_q, x_s, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)
    assert backend._op.op is op_gemm_ops.library_op()  # the eager_fast callable over the OpOverload
    op_gemm_ops.impl_calls.clear()
    backend.gemm(x_q, prepared, x_s, out_dtype=torch.float32)
    assert op_gemm_ops.impl_calls == [(5, 64)]
    with FakeTensorMode() as mode:  # a dispatch mode: the op (its fake) runs, not the implementation
        fx, fs = mode.from_tensor(x_q), mode.from_tensor(x_s)
        fprep = type(prepared)(mode.from_tensor(prepared.data), mode.from_tensor(prepared.scale), prepared.n,
                               prepared.k, prepared.dtype, prepared.weight_scale, prepared.backend)
        y = backend.gemm_impl(fx, fprep, fs, torch.float32, None)
    assert tuple(y.shape) == (5, 32) and op_gemm_ops.impl_calls == [(5, 64)]


def test_compiled_graph_holds_the_op():
    backend = LibraryOpGemm()
    x_q, x_s, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    y = torch.compile(lambda x, s: backend.gemm(x, prepared, s, out_dtype=torch.float32), fullgraph=True,
                      backend=capture)(x_q, x_s)
    assert_gemm_close(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32), torch.float32)
    assert any("test_library_gemm" in str(n.target) for g in graphs for n in g.graph.nodes)


def test_contiguous_vectors_refuses_a_strided_per_token_scale():
    backend = LibraryOpGemm()
    x_q, x_s, w_q, w_s = _operands()
    prepared = backend.prepare_weight(w_q, w_s)
    strided = torch.cat([x_s, x_s], dim=1)[:, :1]  # [M, 1] with row stride 2
    with pytest.raises(InvalidInputError, match="contiguous per-token x_scale"):
        backend.gemm(x_q, prepared, strided, out_dtype=torch.float32)
    CustomOpGemm().gemm(x_q, CustomOpGemm().prepare_weight(w_q, w_s), strided, out_dtype=torch.float32)


def test_the_built_in_op_providers():
    """triton, cutlass and flashinfer_bmm are OpGemmBackends: their options are the op's trailing arguments and
    their load_op gives the library's op (defined without a GPU); torch_scaled_mm calls torch._scaled_mm itself."""
    from fp8_backends.providers.cutlass.backend import CutlassSm90Backend
    from fp8_backends.providers.flashinfer.gemm import FlashinferBmmBackend
    from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend
    from fp8_backends.providers.triton.gemm import TritonGemmBackend

    cases = [
        (TritonGemmBackend(config="auto"), ("auto",), "fp8_backends::triton_gemm"),
        (CutlassSm90Backend(fast_accum="false"), ("auto", False), "fp8_backends::cutlass_sm90_gemm"),
        (FlashinferBmmBackend(runner="cudnn", autotune="off"), ("cudnn/off",), "fp8_backends::flashinfer_bmm_fp8"),
    ]
    from fp8_backends.core.oplib import GEMM_ARGS

    for backend, args, op_name in cases:
        assert isinstance(backend, OpGemmBackend) and backend.op_args == args
        op = backend.load_op()
        assert op.name() == op_name
        if backend.capabilities.bias is BiasMode.FUSED:  # the library's GEMM call convention (oplib.gemm_schema)
            assert str(op._schema).startswith(f"{op_name}({GEMM_ARGS}, str config"), op._schema
    assert cases[2][0]._mode == "cudnn/off"  # the flashinfer tests and benchmarks read it
    assert not isinstance(TorchScaledMMBackend(), OpGemmBackend)
