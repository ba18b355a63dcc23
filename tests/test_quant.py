"""fp8_backends.quant: the static / dynamic / per-token FP8 quant ops (CPU here; CUDA under @gpu)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fp8_backends import ActScale, InvalidInputError, QuantizedActivation, quant
from fp8_backends.core import reference

FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def _restore_quant_state():
    saved = dict(quant._impls)
    mode = quant.set_compile_mode("inline")
    yield
    quant._impls.clear()
    quant._impls.update(saved)
    quant.set_compile_mode(mode)
    torch._dynamo.reset()


def _x(m=6, k=32, dtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 3).to(dtype=dtype, device=device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ------------------------------------------------------------------------------------------ semantics
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fp8", ["e4m3fn", "e5m2"])
def test_static_matches_reference(dtype, fp8):
    x, s = _x(dtype=dtype), torch.tensor([0.02])
    q = quant.quantize_static(x, s, fp8)
    assert q.dtype == getattr(torch, f"float8_{fp8}") and q.shape == x.shape
    assert torch.equal(_bits(q), _bits(reference.quantize_static(x, s, fp8)))


def test_static_saturates_instead_of_overflowing():
    x = torch.tensor([[1e4, -1e4, 1.0, 0.0]], dtype=torch.bfloat16)
    q = quant.quantize_static(x, torch.tensor(1.0))
    assert q.float().tolist() == [[448.0, -448.0, 1.0, 0.0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dynamic_per_tensor(dtype):
    x = _x(dtype=dtype)
    q, s = quant.quantize_dynamic(x)
    assert s.shape == (1,) and s.dtype == torch.float32
    assert s.item() == pytest.approx(x.float().abs().max().item() / 448, rel=1e-6)
    assert q.float().abs().max().item() == 448.0  # the largest element maps to the top of the range
    rq, rs = reference.quantize_dynamic_per_tensor(x)
    assert torch.equal(s, rs) and torch.equal(_bits(q), _bits(rq))


def test_per_token():
    x = _x(m=5)
    x[2] *= 100  # one loud row must not flatten the others
    q, s = quant.quantize_per_token(x)
    assert s.shape == (5, 1) and s.dtype == torch.float32
    assert torch.allclose(s[:, 0], x.float().abs().amax(-1) / 448)
    assert torch.equal(q.float().abs().amax(-1), torch.full((5,), 448.0))
    rq, rs = reference.quantize_per_token(x)
    assert torch.equal(s, rs) and torch.equal(_bits(q), _bits(rq))


def test_zero_input_gets_min_scale_not_zero():
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    _, s = quant.quantize_dynamic(x)
    _, st = quant.quantize_per_token(x)
    assert s.item() == pytest.approx(reference.MIN_DYNAMIC_SCALE)
    assert torch.all(st > 0)


def test_quantize_wraps_a_quantized_activation():
    x, s = _x(dtype=torch.float16), torch.tensor([0.05])
    qa = quant.quantize(x, "per_tensor_static", s)
    assert isinstance(qa, QuantizedActivation)
    assert qa.scale is s and qa.orig_dtype == torch.float16 and qa.mode is ActScale.PER_TENSOR_STATIC
    qa = quant.quantize(x, ActScale.PER_TOKEN)
    assert qa.scale.shape == (x.shape[0], 1) and qa.mode is ActScale.PER_TOKEN


def test_non_contiguous_input():
    x = _x(m=8, k=32).t()  # [32, 8] view with strides (1, 32)
    q, s = quant.quantize_per_token(x)
    rq, rs = reference.quantize_per_token(x.contiguous())
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(s, rs)


# ------------------------------------------------------------------------------------------ the ops
def test_ops_are_registered_lazily():
    code = (
        "import torch, fp8_backends, fp8_backends.quant as q\n"
        "assert not hasattr(torch.ops.fp8_backends, 'quant_static')\n"
        "q.quantize_static(torch.ones(2, 16), torch.ones(1))\n"
        "assert hasattr(torch.ops.fp8_backends, 'quant_static')\n"
        "assert hasattr(torch.ops.fp8_backends, 'quant_per_token')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_op_mode_first_call_may_be_inside_torch_compile():
    """``set_compile_mode("op")`` defines the ops then (load time): a mode's first call may be traced (Dynamo cannot
    trace their definition), with no eager warm-up call."""
    code = (
        "import torch, fp8_backends.quant as q\n"
        "q.set_compile_mode('op')\n"
        "x = torch.randn(4, 256)\n"
        "for mode in ('per_token', 'per_tensor_dynamic', 'per_token_group'):\n"
        "    f = torch.compile(lambda x, mode=mode: q.quantize(x, mode), backend='aot_eager', fullgraph=True)\n"
        "    got, want = f(x), q.quantize(x, mode)\n"
        "    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), mode\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("mode", list(ActScale))
def test_opcheck(mode):
    """Schema, fake (meta) implementation and dispatch agree with the real one."""
    op = quant.quant_op(mode)
    x = _x(m=4, k=16)
    args = (x, torch.tensor([0.1]), FP8) if mode is ActScale.PER_TENSOR_STATIC else (x, FP8)
    if mode is ActScale.PER_TOKEN_GROUP:
        x = _x(m=5, k=200)
        for layout in ("row_major", "m_major", "m_major_tma"):
            torch.library.opcheck(op, (x, 128, layout, FP8), test_utils=("test_schema", "test_faketensor"))
        return
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_registered_impl_is_used_and_removable():
    calls = []

    def fake_kernel(x, scale, fp8_dtype):
        calls.append(x.shape)
        return (x.float() / scale).clamp(-448, 448).to(fp8_dtype)

    assert quant.registered_quant_impl("per_tensor_static", "cpu") is None
    quant.register_quant_impl("per_tensor_static", "cpu", fake_kernel)
    x, s = _x(), torch.tensor([0.02])
    q = quant.quantize_static(x, s)
    assert calls == [x.shape]
    assert torch.equal(_bits(q), _bits(reference.quantize_static(x, s)))
    previous = quant.register_quant_impl("per_tensor_static", "cpu", None)
    assert previous is fake_kernel
    quant.quantize_static(x, s)
    assert len(calls) == 1  # back to the reference


def test_registered_impl_only_for_its_device():
    quant.register_quant_impl("per_token", "cuda", lambda x, d: (_ for _ in ()).throw(AssertionError("cuda impl")))
    q, s = quant.quantize_per_token(_x())  # CPU tensor: the CUDA entry is not consulted
    assert q.dtype == FP8


def _graph_targets(fn, *args):
    """Compile ``fn`` (fullgraph, no codegen) and return the call targets of its FX graph."""
    targets: list[str] = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return targets, out


@pytest.mark.parametrize("mode", list(ActScale))
def test_compile_op_mode_keeps_the_library_op(mode):
    quant.set_compile_mode("op")
    x, s = _x(), torch.tensor([0.02])

    def fn(x):
        return quant.quantize(x * 2, mode, s if mode is ActScale.PER_TENSOR_STATIC else None)

    eager = fn(x)  # the op is defined at its first eager call (never inside tracing)
    targets, out = _graph_targets(fn, x)
    assert any(f"fp8_backends.{quant._OP_NAMES[mode]}" in t for t in targets), targets
    assert torch.equal(_bits(out.data), _bits(eager.data)) and torch.equal(out.scale, eager.scale)


def test_compile_inline_mode_traces_fusable_torch_ops():
    x = _x()

    def fn(x):
        return quant.quantize_dynamic(x * 2)

    targets, (q, s) = _graph_targets(fn, x)
    assert not any("fp8_backends" in t for t in targets), targets
    rq, rs = quant.quantize_dynamic(x * 2)
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(s, rs)


def test_compile_dynamic_shapes_through_fake_impl():
    quant.set_compile_mode("op")
    fn = torch.compile(lambda x: quant.quantize_per_token(x), backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (3, 7):
        q, s = fn(_x(m=m))
        assert q.shape == (m, 32) and s.shape == (m, 1)


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: quant.quantize_static(torch.ones(2, 4, dtype=torch.int32), torch.ones(1)), "bfloat16, float16"),
        (lambda: quant.quantize_static(torch.ones(2, 4, dtype=FP8), torch.ones(1)), "bfloat16, float16"),
        (lambda: quant.quantize_static(torch.ones(2, 2, 4), torch.ones(1)), "2-D"),
        (lambda: quant.quantize_static(torch.ones(2, 4), torch.ones(1, dtype=torch.bfloat16)), "float32"),
        (lambda: quant.quantize_static(torch.ones(2, 4), torch.ones(2)), "one value"),
        (lambda: quant.quantize_static(torch.ones(2, 4), 0.5), "torch.Tensor"),
        (lambda: quant.quantize_static(torch.ones(2, 4), torch.tensor([float("nan")])), "finite and > 0"),
        (lambda: quant.quantize_static(torch.ones(2, 4), torch.tensor([0.0])), "finite and > 0"),
        (lambda: quant.quantize_static(torch.ones(2, 4), torch.tensor([float("inf")])), "finite and > 0"),
        (lambda: quant.quantize_static(torch.ones(2, 4), torch.ones(1), "int8"), "e4m3fn or e5m2"),
        (lambda: quant.quantize_dynamic(torch.ones(4)), "2-D"),
        (lambda: quant.quantize(torch.ones(2, 4), "per_tensor_static"), "needs a scale"),
        (lambda: quant.quantize(torch.ones(2, 4), "per_token", torch.ones(1)), "computes its own scale"),
        (lambda: quant.register_quant_impl("per_token", "cpu", 3), "callable"),
        (lambda: quant.set_compile_mode("fast"), "inline"),
        (lambda: quant.quantize_per_token_group(torch.ones(2, 128), 64.0), "group_size must be one of"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(InvalidInputError, match=match):
        call()


def test_unknown_mode_is_a_value_error():
    with pytest.raises(ValueError):
        quant.quantize(torch.ones(2, 4), "per_block")


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(ActScale))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_matches_reference_and_captures_without_sync(mode, dtype):
    x = _x(m=64, k=4096, dtype=dtype, device="cuda")
    s = torch.tensor([0.03], device="cuda")
    static = mode is ActScale.PER_TENSOR_STATIC

    def run():
        return quant.quantize(x, mode, s if static else None)

    eager = run()
    ref_q, ref_s = reference.quantize(x, mode, s if static else None)
    torch.testing.assert_close(eager.scale, ref_s, rtol=1e-6, atol=0)
    # a registered kernel may round a value at a code boundary the other way: adjacent codes only, rarely
    codes = (eager.data.view(torch.uint8).int() - ref_q.view(torch.uint8).int()).abs()
    assert codes.max().item() <= 1 and (codes > 0).float().mean().item() < 1e-3
    graph = torch.cuda.CUDAGraph()
    run()  # warm up outside capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            captured = run()
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(captured.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert torch.equal(captured.scale, eager.scale)
