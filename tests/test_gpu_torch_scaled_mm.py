"""GPU checks of the built-in torch_scaled_mm provider on a real CUDA device (skipped on CPU machines).

They verify the capability record against what torch's CUDA kernels actually accept: per-tensor scales with
bf16/fp16/fp32 out and bias, row-wise scales (bf16 out), mixed e4m3 x e5m2, CUDA-graph capture, torch.compile.
"""

from __future__ import annotations

import pytest
import torch

from fp8_backends import GemmProblem, InvalidInputError, reference, resolve_gemm_backend
from fp8_backends.registry.platform import detect_platform

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def _relerr(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def backend():
    return resolve_gemm_backend("torch_scaled_mm", problem=GemmProblem(n=4096, k=4096, device="cuda"))


def _quant_weight(n, k, per_channel=False):
    w = torch.randn(n, k, device="cuda") * 0.05
    if per_channel:
        s = w.abs().amax(dim=1) / 448
        return (w / s[:, None]).to(FP8), s.float()
    return reference.quantize_dynamic_per_tensor(w)


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 256, 1024])
def test_llama_shapes_per_tensor(backend, n, k, m):
    w_q, w_s = _quant_weight(n, k)
    x_q, x_s = reference.quantize_dynamic_per_tensor(torch.randn(m, k, device="cuda"))
    prepared = backend.prepare_weight(w_q, w_s)
    y = backend.gemm(x_q, prepared, x_s, out_dtype=torch.bfloat16)
    assert _relerr(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32)) < 1e-2


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 33])
def test_out_dtypes_and_bias(backend, out_dtype, bias, m):
    n, k = 256, 512
    w_q, w_s = _quant_weight(n, k)
    x_q, x_s = reference.quantize_dynamic_per_tensor(torch.randn(m, k, device="cuda"))
    b = torch.randn(n, device="cuda").to(out_dtype) if bias else None
    y = backend.gemm(x_q, backend.prepare_weight(w_q, w_s), x_s, out_dtype=out_dtype, bias=b)
    assert y.dtype == out_dtype
    assert _relerr(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32, b)) < 1e-2


@pytest.mark.parametrize("w_per_channel, x_per_token", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_rowwise(backend, w_per_channel, x_per_token, bias):
    n, k, m = 512, 1024, 48
    w_q, w_s = _quant_weight(n, k, per_channel=w_per_channel)
    x = torch.randn(m, k, device="cuda") * torch.linspace(0.1, 4, m, device="cuda")[:, None]
    x_q, x_s = reference.quantize_per_token(x) if x_per_token else reference.quantize_dynamic_per_tensor(x)
    b = torch.randn(n, device="cuda").bfloat16() if bias else None
    y = backend.gemm(x_q, backend.prepare_weight(w_q, w_s), x_s, out_dtype=torch.bfloat16, bias=b)
    assert _relerr(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32, b)) < 1e-2


def test_rowwise_fp16_is_refused_by_capabilities():
    problem = GemmProblem(n=512, k=1024, out_dtype="float16", act_scale="per_token", weight_scale="per_channel")
    reasons = resolve_gemm_backend("torch").supports(problem, detect_platform("cuda"))
    assert any("bfloat16 only" in r for r in reasons)


def test_mixed_e4m3_e5m2(backend):
    n, k, m = 256, 512, 16
    w_q, w_s = reference.quantize_dynamic_per_tensor(torch.randn(n, k, device="cuda"), "e5m2")
    x_q, x_s = reference.quantize_dynamic_per_tensor(torch.randn(m, k, device="cuda"))
    y = backend.gemm(x_q, backend.prepare_weight(w_q, w_s), x_s, out_dtype=torch.bfloat16)
    assert _relerr(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32)) < 2e-2


def test_cpu_scale_with_cuda_tensors_refused(backend):
    w_q, w_s = _quant_weight(256, 256)
    prepared = backend.prepare_weight(w_q, w_s)
    with pytest.raises(InvalidInputError, match="x_scale is on cpu"):
        backend.gemm(torch.zeros(4, 256, device="cuda").to(FP8), prepared, torch.tensor([1.0]))


def test_cuda_graph_capture_and_replay(backend):
    n, k, m = 1024, 2048, 16
    w_q, w_s = _quant_weight(n, k)
    prepared = backend.prepare_weight(w_q, w_s)
    x_q, x_s = reference.quantize_dynamic_per_tensor(torch.randn(m, k, device="cuda"))
    eager = backend.gemm(x_q, prepared, x_s, out_dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.gemm(x_q, prepared, x_s, out_dtype=torch.bfloat16)  # warm-up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = backend.gemm(x_q, prepared, x_s, out_dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_torch_compile_fullgraph(backend):
    n, k = 512, 1024
    w_q, w_s = _quant_weight(n, k)
    prepared = backend.prepare_weight(w_q, w_s)

    def fn(x):
        x_q, x_s = reference.quantize_dynamic_per_tensor(x)
        return backend.gemm(x_q, prepared, x_s, out_dtype=torch.bfloat16)

    x = torch.randn(32, k, device="cuda")
    compiled = torch.compile(fn, fullgraph=True)
    assert _relerr(compiled(x), fn(x)) < 1e-2
