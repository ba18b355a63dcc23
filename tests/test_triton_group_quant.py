"""The Triton per-token-group FP8 quantization (``providers/triton/group_quant_*.py``) against the reference
(``tests/block_reference.py``).

CPU part: the kernel on Triton's interpreter with exact float conversions (a module fixture), so codes and scales
must equal the reference bit for bit: bf16/fp16/fp32 inputs, e4m3fn and e5m2, G = 64 and 128, ragged K, every scale
layout, transposed / sliced / wide-row inputs, NaN groups, zero rows, empty inputs, the op and its fake. GPU part
(``gpu`` marker): real sizes (scales within an ulp: torch on CUDA divides by a reciprocal), CUDA graphs, PDL on and off,
``torch.compile`` launching the kernel itself.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import block_reference as R  # noqa: E402
from triton_kernel_support import DEVICE, ON_GPU, fp8_ordinal, needs_kernels  # noqa: E402

from fp8_backends.core.errors import InvalidInputError  # noqa: E402
from fp8_backends.providers.triton import group_quant_kernels as gk  # noqa: E402
from fp8_backends.providers.triton import group_quant_ops as gq  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")
FP8S = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _name(d) -> str:
    return str(d).removeprefix("torch.")


def _x(m, k, dtype=torch.bfloat16, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed * 1000 + m * 7 + k)
    x = torch.randn(m, k, generator=g) * 3
    x[:, ::9] *= 40  # loud columns: some groups saturate
    return x.to(dtype).to(device)


def assert_same(q, s, rq, rs):
    """CPU: equal bit for bit (NaN where the reference has NaN). GPU: scales within an fp32 ulp, codes within one
    step and rarely off (torch on CUDA divides by a reciprocal)."""
    assert q.shape == rq.shape and q.dtype == rq.dtype and s.shape == rs.shape and s.dtype == torch.float32
    q, s, rq, rs = q.cpu(), s.cpu(), rq.cpu(), rs.cpu()
    nan_q, nan_s = torch.isnan(rq.float()), torch.isnan(rs)
    assert torch.equal(torch.isnan(q.float()), nan_q) and torch.equal(torch.isnan(s), nan_s)
    if not ON_GPU:
        assert torch.equal(s[~nan_s], rs[~nan_s])
        assert torch.equal(q.view(torch.uint8)[~nan_q], rq.view(torch.uint8)[~nan_q])
    else:
        torch.testing.assert_close(s[~nan_s], rs[~nan_s], rtol=2.4e-7, atol=0)
        diff = (fp8_ordinal(q) - fp8_ordinal(rq)).abs()[~nan_q]
        assert (int(diff.max()) if diff.numel() else 0) <= 1 and int((diff > 0).sum()) <= max(1, diff.numel() // 100)


# ------------------------------------------------------------------------------------ numerics
@needs_kernels
@pytest.mark.parametrize("fp8", FP8S, ids=_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize(("m", "k", "group"), [(1, 128, 128), (5, 1000, 128), (3, 200, 64), (17, 96, 128)])
def test_matches_reference(m, k, group, dtype, fp8):
    x = _x(m, k, dtype)
    q, s = gq.quant_per_token_group(x, group, fp8)
    rq, rs = R.quantize_per_token_group(x, group, fp8)
    assert q.is_contiguous() and s.stride() == (s.shape[1], 1)
    assert_same(q, s, rq, rs)


@needs_kernels
@pytest.mark.parametrize("layout", gk.SCALE_LAYOUTS)
@pytest.mark.parametrize(("m", "k"), [(1, 300), (6, 512), (7, 130)])
def test_every_scale_layout(layout, m, k):
    x = _x(m, k, seed=1)
    q, s = gq.quant_per_token_group(x, 128, scale_layout=layout)
    assert gk.scale_layout_of(s) == layout or m == 1
    if layout != "row_major" and m > 1:
        assert s.stride(0) == 1 and s.stride(1) == (m if layout == "m_major" else -(-m // 4) * 4)
    assert_same(q, s, *R.quantize_per_token_group(x, 128))


@needs_kernels
@pytest.mark.parametrize("view", ["sliced", "column_stride_2"])
def test_strided_inputs(view):
    base = _x(40, 300, seed=2)
    x = {"sliced": base[3:9, 17:290],  # row stride > K, offset start
         "column_stride_2": base[:, ::2]}[view]
    q, s = gq.quant_per_token_group(x, 64, scale_layout="m_major")
    assert_same(q, s, *R.quantize_per_token_group(x, 64))


@needs_kernels
def test_transposed_input():
    x = _x(256, 24, seed=3).t()  # [24, 256], strides (1, 24)
    assert x.stride() == (1, 24)
    assert_same(*gq.quant_per_token_group(x, 128), *R.quantize_per_token_group(x, 128))


@needs_kernels
@pytest.mark.parametrize("fp8", FP8S, ids=_name)
def test_nan_group_and_zero_row(fp8):
    """A NaN makes its group's scale and codes NaN and nothing else; an all-zero row gets the 1e-12 floor."""
    x = _x(4, 384, torch.float32, seed=4)
    x[1, 130] = float("nan")
    x[2].zero_()
    q, s = gq.quant_per_token_group(x, 128, fp8)
    rq, rs = R.quantize_per_token_group(x, 128, fp8)
    assert torch.isnan(s[1, 1]) and not torch.isnan(s[1, 0]) and not torch.isnan(s[1, 2])
    assert torch.isnan(q[1, 128:256].float()).all() and not torch.isnan(q[1, :128].float()).any()
    assert torch.all(s[2] == 1e-12) and torch.all(q[2].float() == 0)
    assert_same(q, s, rq, rs)


@needs_kernels
def test_outputs_given_and_empty_inputs():
    x = _x(3, 256)
    q_out = torch.empty(3, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    s_buf = torch.empty(2, 8, device=DEVICE)
    s_out = s_buf[:, 1:4].t()  # an unusual layout: [3, 2] with strides (1, 8)
    q, s = gq.quant_per_token_group(x, 128, q_out=q_out, scale_out=s_out)
    assert q is q_out and s is s_out
    assert_same(q, s, *R.quantize_per_token_group(x, 128))
    q0, s0 = gq.quant_per_token_group(_x(0, 256), 128)
    assert q0.shape == (0, 256) and s0.shape == (0, 2)
    q1, s1 = gq.quant_per_token_group(torch.empty(3, 0, device=DEVICE), 128)
    assert q1.shape == (3, 0) and s1.shape == (3, 0)


def test_bad_arguments():
    x = torch.zeros(2, 64)
    with pytest.raises(InvalidInputError, match="fp8_dtype"):
        gq.quant_per_token_group(x, 64, torch.int8)
    with pytest.raises(InvalidInputError, match="group_size"):
        gq.quant_per_token_group(x, 96)
    with pytest.raises(InvalidInputError, match="scale_layout"):
        gq.quant_per_token_group(x, 64, scale_layout="k_major")
    with pytest.raises(InvalidInputError, match="2-D"):
        gq.quant_per_token_group(torch.zeros(64), 64)
    with pytest.raises(InvalidInputError, match="scale_out"):
        gq.quant_per_token_group(x, 64, scale_out=torch.zeros(2, 2))


def test_group_config_wastes_few_groups():
    assert gk.group_config(7168, 128) == gk.GroupConfig(4, 8, gk.TILE_WARPS)  # 56 groups: 7 x 8
    assert gk.group_config(4096, 128).groups == 32
    assert gk.group_config(4096, 64).groups == 64
    assert gk.group_config(200, 128) == gk.GroupConfig(16, 2, gk.TILE_WARPS)
    for k in (1, 100, 1000, 6840, 18432):
        cfg = gk.group_config(k, 128)
        assert cfg.rows * cfg.groups * 128 <= max(gk.TILE, 128)


def test_scale_layout_of():
    like = torch.empty(1)
    for layout in gk.SCALE_LAYOUTS:
        assert gk.scale_layout_of(gk.group_scale_empty(6, 3, layout, like)) == layout
    assert gk.scale_layout_of(torch.empty(8, 6)[:, ::2]) is None


@needs_kernels
def test_op_and_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = gq.load_op()
    x = _x(5, 256)
    q, s = op(x, 128, torch.float8_e4m3fn, "m_major_tma")
    assert s.stride() == (1, 8)
    assert_same(q, s, *R.quantize_per_token_group(x, 128))
    with FakeTensorMode():
        fx = torch.empty(5, 300, dtype=torch.bfloat16, device=DEVICE)
        fq, fs = gq.triton_quant_per_token_group(fx, 128, torch.float8_e5m2, "m_major")
    assert fq.shape == (5, 300) and fq.dtype == torch.float8_e5m2
    assert fs.shape == (5, 3) and fs.stride() == (1, 5)
    traced = gq.quant_impl.traced  # what compiled layers quantize with (fp8_backends.quant.traced_group_kernel)
    traced.load()
    tq, ts = traced(x, 128, "m_major_tma", torch.float8_e4m3fn)
    assert ts.stride() == (1, 8) and torch.equal(ts, s) and torch.equal(tq.view(torch.uint8), q.view(torch.uint8))


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("layout", gk.SCALE_LAYOUTS)
@pytest.mark.parametrize(("m", "k", "group"), [(1, 7168, 128), (33, 4096, 64), (4096, 7168, 128), (257, 6840, 128)])
def test_gpu_real_sizes(m, k, group, layout):
    x = _x(m, k)
    assert_same(*gq.quant_per_token_group(x, group, scale_layout=layout), *R.quantize_per_token_group(x, group))


@pytest.mark.gpu
def test_gpu_graph_capture_and_pdl_agree(monkeypatch):
    x = _x(64, 7168)
    ref = gq.quant_per_token_group(x, 128, scale_layout="m_major_tma")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = gq.quant_per_token_group(x, 128, scale_layout="m_major_tma")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q.view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(s, ref[1])
    monkeypatch.setenv("FP8_BACKENDS_PDL", "0")
    q2, s2 = gq.quant_per_token_group(x, 128, scale_layout="m_major_tma")
    assert torch.equal(q2.view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(s2, ref[1])


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernel_itself():
    from torch._inductor.utils import run_and_get_code

    gq.load_op()
    x = _x(16, 4096)

    def f(a):
        return gq.triton_quant_per_token_group(torch.nn.functional.silu(a), 128, torch.float8_e4m3fn, "m_major")

    (q, s), codes = run_and_get_code(torch.compile(f, fullgraph=True), x)
    rq, rs = gq.quant_per_token_group(torch.nn.functional.silu(x), 128, scale_layout="m_major")
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert "_group_quant_kernel" in "\n".join(codes)


@pytest.mark.gpu
def test_gpu_compiled_op_with_a_dynamic_m_is_one_launch_in_any_layout():
    """Compiled with a dynamic M after a producer: the producer's kernel and the op's one launch, the scale written in
    its layout (padded m_major_tma included: the kernel writes the scale's buffer, so Inductor adds no copies)."""
    gq.load_op()
    for layout in gk.SCALE_LAYOUTS:
        torch._dynamo.reset()

        def f(a, layout=layout):
            return gq.triton_quant_per_token_group(a * 2, 128, torch.float8_e4m3fn, layout)

        compiled = torch.compile(f, fullgraph=True, dynamic=True)
        for m in (6, 130, 256):
            x = _x(m, 4096)
            compiled(x)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                q, s = compiled(x)
                torch.cuda.synchronize()
            launched = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            assert len(launched) == 2 and "_group_quant_kernel" in launched, (layout, m, launched)
            rq, rs = gq.quant_per_token_group(x * 2, 128, scale_layout=layout)
            assert s.stride() == rs.stride()
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
