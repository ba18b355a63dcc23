"""The Triton fused RMSNorm (+ residual add) + dynamic FP8 quantization, per token group and per token
(``providers/triton/norm_dynamic_*.py``), against the reference (``tests/block_reference.py``).

CPU part: the kernels on Triton's interpreter with exact float conversions (a module fixture): hidden sizes that are
not multiples of the group (33, 200, 1000) and real ones (4096), G = 64 and 128, both modes with and without the
residual, row-strided inputs, every scale layout, e5m2, NaN rows, the chunked path for large hidden sizes (reached at
small H), the ops and their fakes. The normalized row's sum of squares runs in another order than torch's, so a scale
may sit an fp32 ulp away and a code one step away, rarely. GPU part: real sizes, CUDA graphs, PDL on and off,
``torch.compile`` launching the kernels itself.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import block_reference as R  # noqa: E402
from triton_kernel_support import DEVICE, fp8_ordinal, needs_kernels  # noqa: E402

from fp8_backends.core.errors import InvalidInputError  # noqa: E402
from fp8_backends.providers.triton import norm_dynamic_kernels as nk  # noqa: E402
from fp8_backends.providers.triton import norm_dynamic_ops as nd  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")
EPS = 1e-6
MODES = {"group": nd.PER_TOKEN_GROUP, "token": nd.PER_TOKEN}


def _inputs(t, h, dtype=torch.bfloat16, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed * 1000 + t * 7 + h)
    x = torch.randn(t, h, generator=g)
    x[:, ::11] *= 20  # loud columns: group scales differ from the row's
    r = torch.randn(t, h, generator=g)
    w = 1 + 0.25 * torch.randn(h, generator=g)
    return x.to(dtype).to(device), r.to(dtype).to(device), w.to(dtype).to(device)


def assert_close(q, s, rq, rs, max_fraction=5e-3):
    assert q.shape == rq.shape and q.dtype == rq.dtype and s.shape == rs.shape
    q, s, rq, rs = q.cpu(), s.cpu(), rq.cpu(), rs.cpu()
    nan_q, nan_s = torch.isnan(rq.float()), torch.isnan(rs)
    assert torch.equal(torch.isnan(q.float()), nan_q) and torch.equal(torch.isnan(s), nan_s)
    # a few fp32 ulps: the kernel sums the squares in its own order (4.3e-7 seen at T = 333, H = 7168 on the H200)
    torch.testing.assert_close(s[~nan_s], rs[~nan_s], rtol=1e-6, atol=0)
    diff = (fp8_ordinal(q) - fp8_ordinal(rq)).abs()[~nan_q]
    assert (int(diff.max()) if diff.numel() else 0) <= 1, "a code is more than one fp8 step from the reference"
    assert int((diff > 0).sum()) <= max(2, int(max_fraction * diff.numel()))


def _run_and_check(t, h, mode, residual, *, group=128, dtype=torch.bfloat16, layout="row_major",
                   fp8=torch.float8_e4m3fn, x_view=None, config=None, seed=0):
    x, r, w = _inputs(t, h, dtype, seed)
    if x_view is not None:
        x = x_view(x)
    res = r.clone() if residual else None
    q, s, new_r = nd.rmsnorm_quant_dynamic(x, w, EPS, res, act_scale=MODES[mode], group_size=group,
                                           scale_layout=layout, fp8_dtype=fp8, config=config)
    rq, rs, rr = R.rmsnorm_quant_dynamic(x, w, EPS, r if residual else None, mode == "token", group, fp8)
    assert_close(q, s, rq, rs)
    if residual:
        assert new_r is res and torch.equal(res, rr)
    else:
        assert new_r is None
    return q, s


# ------------------------------------------------------------------------------------ numerics
@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("t", "h", "group"), [(1, 33, 128), (3, 200, 128), (5, 1000, 64), (2, 4096, 128),
                                               (9, 96, 64), (3, 7168, 128)])
def test_matches_reference(t, h, group, mode, residual):
    q, s = _run_and_check(t, h, mode, residual, group=group)
    assert s.shape == ((t, 1) if mode == "token" else (t, -(-h // group)))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("mode", list(MODES))
def test_input_dtypes(dtype, mode):
    _run_and_check(3, 384, mode, True, dtype=dtype)


@needs_kernels
@pytest.mark.parametrize("layout", ["row_major", "m_major", "m_major_tma"])
def test_group_scale_layouts(layout):
    q, s = _run_and_check(5, 640, "group", False, layout=layout)
    if layout != "row_major":
        assert s.stride(0) == 1 and s.stride(1) == (5 if layout == "m_major" else 8)


@needs_kernels
@pytest.mark.parametrize("mode", list(MODES))
def test_row_strided_input(mode):
    """``x[:, :H]`` of a wider buffer (row stride > H)."""
    _run_and_check(4, 300, mode, True, x_view=lambda x: torch.cat([x, x[:, :50]], dim=1)[:, :300])


@needs_kernels
@pytest.mark.parametrize("mode", list(MODES))
def test_e5m2(mode):
    _run_and_check(3, 256, mode, False, fp8=torch.float8_e5m2)


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("h", "group", "loop_block"), [(1000, 128, 256), (700, 64, 128), (4096, 128, 1024)])
def test_chunked_path(h, group, loop_block, mode, residual):
    """The path of hidden sizes past 32768, reached at small H by lowering the one-pass limit; the tail chunk is
    partial in the first two cases."""
    cfg = nk.dyn_config(3, h, residual, group, mode == "token", single_pass_max=64, loop_block=loop_block)
    assert cfg.path == "loop" and cfg.ng * cfg.gb == loop_block
    _run_and_check(3, h, mode, residual, group=group, config=cfg)


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("t", "h", "group", "rows"), [(7, 640, 128, 3), (5, 200, 64, 3), (4, 96, 64, 2),
                                                       (2, 5120, 128, 3)])
def test_packed_path(t, h, group, rows, mode, residual):
    """Rows packed group after group into one block: T not a multiple of the rows per program (the last program's
    rows past T), a short last group (200 = 3 x 64 + 8), a row of 2 groups, one program holding every row."""
    cfg = nk.DynConfig("packed", rows, -(-h // group), group, 4)
    _run_and_check(t, h, mode, residual, group=group, config=cfg)


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("h", "group"), [(640, 128), (200, 64), (896, 128), (1900, 128), (1024, 128)])
def test_parts_path(h, group, mode, residual):
    """A row as up to three power-of-two blocks of groups: 5 = 4 + 1 groups, 4 = 2 + 1 + 1 with a short last group
    (200 = 3 x 64 + 8), 7 = 4 + 2 + 1, 15 = 8 + 4 + (3 rounded up to 4, one slot idle) with a short last group, and
    a power of two (one part)."""
    cfg = nk.DynConfig("parts", 1, -(-h // group), group, 4)
    _run_and_check(3, h, mode, residual, group=group, config=cfg)


def test_row_parts():
    assert nk.row_parts(40) == (32, 8, 0) and nk.row_parts(56) == (32, 16, 8) and nk.row_parts(64) == (64, 0, 0)
    assert nk.row_parts(120) == (64, 32, 32) and nk.row_parts(1) == (1, 0, 0) and nk.row_parts(7) == (4, 2, 1)


#: the packed and parts launches of 384-column rows (3 groups of 128): 3 rows in one packed program, 2 + 1 parts
_ONE_PROGRAM_CONFIGS = {"packed": nk.DynConfig("packed", 3, 3, 128, 4), "parts": nk.DynConfig("parts", 1, 3, 128, 4)}


@needs_kernels
@pytest.mark.parametrize("path", ["block", "loop", "packed", "parts"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_nan_row_is_nan_and_alone(mode, path):
    x, r, w = _inputs(4, 384, torch.float32, seed=3)
    x[2, 5] = float("nan")
    cfg = {"block": None, **_ONE_PROGRAM_CONFIGS,
           "loop": nk.dyn_config(4, 384, False, 128, mode == "token", single_pass_max=64, loop_block=128)}[path]
    q, s, _ = nd.rmsnorm_quant_dynamic(x, w, EPS, act_scale=MODES[mode], config=cfg)
    rq, rs, _ = R.rmsnorm_quant_dynamic(x, w, EPS, None, mode == "token")
    assert torch.isnan(s[2]).all() and torch.isnan(q[2].float()).all()
    assert not torch.isnan(s[[0, 1, 3]]).any()
    assert_close(q, s, rq, rs)


@pytest.mark.parametrize("path", ["block", "packed", "parts"])
@needs_kernels
@pytest.mark.parametrize("mode", list(MODES))
def test_an_inf_matches_the_reference(mode, path):
    """An inf makes its row's sum of squares inf (rsqrt 0): the reference's 0 · inf is NaN in that group (whole row
    per token), zeros elsewhere; the kernels, which scale the maxima of ``x · w`` by the rsqrt, give the same."""
    x, r, w = _inputs(3, 384, torch.float32, seed=4)
    x[1, 200] = float("inf")
    cfg = {"block": None, **_ONE_PROGRAM_CONFIGS}[path]
    q, s, _ = nd.rmsnorm_quant_dynamic(x, w, EPS, act_scale=MODES[mode], config=cfg)
    rq, rs, _ = R.rmsnorm_quant_dynamic(x, w, EPS, None, mode == "token")
    assert torch.isnan(rs[1]).any() and not torch.isnan(rs[[0, 2]]).any()
    assert_close(q, s, rq, rs)


def test_large_launches_run_without_pdl(monkeypatch):
    """PDL where the device allows it, below PDL_MAX_ELEMENTS elements only (measured: it slowed large launches)."""
    seen = []

    def fake_args(cfg, x, residual, weight, q, scale, eps, per_token, use_pdl, scale_buffer=None):
        seen.append(use_pdl)
        return None, (1,), ()

    monkeypatch.setattr(nd._support, "pdl_on", lambda index: True)
    monkeypatch.setattr(nd, "kernel_args", fake_args)
    monkeypatch.setattr(nd, "launcher_for", lambda kernel: lambda grid, args, **options: None)
    h = 4096
    for t in (2, nk.PDL_MAX_ELEMENTS // h - 1, nk.PDL_MAX_ELEMENTS // h):
        x = torch.empty(t, h, dtype=torch.bfloat16)
        nd.rmsnorm_quant_dynamic(x, torch.ones(h, dtype=torch.bfloat16), EPS)
    assert seen == [True, True, False]


@needs_kernels
def test_outputs_given_and_empty():
    x, r, w = _inputs(3, 256)
    q_out = torch.empty(3, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    s_out = torch.empty(2, 3, device=DEVICE).t()
    q, s, _ = nd.rmsnorm_quant_dynamic(x, w, EPS, q_out=q_out, scale_out=s_out)
    assert q is q_out and s is s_out
    assert_close(q, s, *R.rmsnorm_quant_dynamic(x, w, EPS)[:2])
    q0, s0, _ = nd.rmsnorm_quant_dynamic(x[:0], w, EPS)
    assert q0.shape == (0, 256) and s0.shape == (0, 2)


def test_bad_arguments():
    x = torch.zeros(2, 64)
    w = torch.ones(64)
    with pytest.raises(InvalidInputError, match="act_scale"):
        nd.rmsnorm_quant_dynamic(x, w, EPS, act_scale="per_tensor_static")
    with pytest.raises(InvalidInputError, match="group_size"):
        nd.rmsnorm_quant_dynamic(x, w, EPS, group_size=100)
    with pytest.raises(InvalidInputError, match="fp8_dtype"):
        nd.rmsnorm_quant_dynamic(x, w, EPS, fp8_dtype=torch.int8)
    with pytest.raises(InvalidInputError, match="scale_layout"):
        nd.rmsnorm_quant_dynamic(x, w, EPS, scale_layout="nope")
    with pytest.raises(InvalidInputError, match="unit column stride"):
        nd.rmsnorm_quant_dynamic(torch.zeros(64, 2).t(), w, EPS)
    with pytest.raises(InvalidInputError, match="weight must be"):
        nd.rmsnorm_quant_dynamic(x, torch.ones(60), EPS)
    with pytest.raises(InvalidInputError, match="residual must be"):
        nd.rmsnorm_quant_dynamic(x, w, EPS, torch.zeros(2, 60))


@pytest.mark.parametrize(("cfg", "mode", "match"), [
    (nk.DynConfig("block", 1, 8, 128, 4), "token", "as one group"),  # per token: one group spans the row
    (nk.DynConfig("block", 1, 16, 64, 4), "group", "not the group size 128"),
    (nk.DynConfig("loop", 1, 4, 64, 4), "group", "not the group size 128"),
    (nk.DynConfig("block", 1, 2, 128, 4), "group", "does not hold a row of 640"),
    (nk.DynConfig("parts", 1, 4, 128, 4), "group", "has 5 groups of 128"),
    (nk.DynConfig("rows", 1, 5, 128, 4), "group", "not a launch shape"),
])
def test_a_launch_shape_that_does_not_compute_the_problem_is_refused(cfg, mode, match):
    """``config=`` (tests, benchmarks) is checked against the problem: a shape that would compute other groups (or
    write past the scales) raises before any launch."""
    x = torch.zeros(3, 640)
    with pytest.raises(InvalidInputError, match=match):
        nd.rmsnorm_quant_dynamic(x, torch.ones(640), EPS, act_scale=MODES[mode], config=cfg)


def test_dyn_config():
    # real hidden sizes: one pass, group blocks of G (per token: one block of the row)
    cfg = nk.dyn_config(4096, 7168, True, 128, False)
    assert cfg.path == "block" and cfg.ng * cfg.gb == 8192 and cfg.gb == 128
    assert nk.dyn_config(4096, 7168, True, 128, True) == nk.DynConfig("block", cfg.rows, 1, 8192, cfg.num_warps)
    # large launches: one row per program; 4 warps without the residual add (the static table's), 8 with it
    assert nk.dyn_config(16384, 7168, False, 128, False).num_warps == 4
    assert nk.dyn_config(16384, 7168, True, 128, False).num_warps == 8
    assert nk.dyn_config(16384, 4096, False, 128, False).rows == 1
    # H = 5120: 40 groups fill 40 of 64 slots of the one-row block; large launches take the row as 32 + 8 groups in
    # every mode (per token: parts of 128 columns whatever group size is passed)
    assert nk.dyn_config(4096, 5120, False, 128, False) == nk.DynConfig("parts", 1, 40, 128, 4)
    assert nk.dyn_config(4096, 5120, True, 128, True) == nk.DynConfig("parts", 1, 40, 128, 4)
    assert nk.dyn_config(4096, 5120, False, 64, True) == nk.DynConfig("parts", 1, 40, 128, 4)
    assert nk.dyn_config(4096, 5120, False, 64, False) == nk.DynConfig("parts", 1, 80, 64, 4)
    # a row of three parts (88 = 64 + 16 + 8 groups) keeps the packed kernel, per token without the residual the block
    assert nk.dyn_config(4096, 11264, True, 128, False) == nk.DynConfig("packed", 1, 88, 128, 4)
    assert nk.dyn_config(4096, 11264, False, 128, True).path == "block"
    assert nk.dyn_config(16, 5120, False, 128, False).path == "block"
    assert nk.dyn_config(4096, 7168, False, 128, False).path == "block"
    small = nk.dyn_config(64, 96, False, 128, False)
    assert small.path == "block" and small.rows > 1 and small.ng * small.gb >= 96
    big = nk.dyn_config(8, 65536, False, 128, False)
    assert big.path == "loop" and big.ng * big.gb == 16384


@needs_kernels
def test_ops_and_fakes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    norm_op, add_op = nd.load_ops()
    assert "Tensor(a!) residual" in str(add_op._schema)
    x, r, w = _inputs(3, 256)
    res = r.clone()
    q, s = add_op(x, res, w, EPS, 128, "m_major", torch.float8_e4m3fn)
    rq, rs, rr = R.rmsnorm_quant_dynamic(x, w, EPS, r)
    assert_close(q, s, rq, rs) and torch.equal(res, rr)
    q, s = nd.triton_rmsnorm_quant_dynamic(x, w, EPS, None, 0)
    assert s.shape == (3, 1)
    assert_close(q, s, *R.rmsnorm_quant_dynamic(x, w, EPS, None, True)[:2])
    with FakeTensorMode():
        fx = torch.empty(5, 300, dtype=torch.bfloat16, device=DEVICE)
        fw = torch.empty(300, dtype=torch.bfloat16, device=DEVICE)
        fq, fs = norm_op(fx, fw, EPS, 128, "m_major_tma", torch.float8_e4m3fn)
    assert fq.shape == (5, 300) and fs.shape == (5, 3) and fs.stride() == (1, 8)


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("t", "h"), [(1, 7168), (16, 4096), (4096, 5120), (333, 7168), (2, 40960)])
def test_gpu_real_sizes(t, h, mode, residual):
    _run_and_check(t, h, mode, residual, layout="m_major_tma")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
def test_gpu_graph_capture_and_pdl_agree(mode, monkeypatch):
    x, r, w = _inputs(256, 7168)
    res_a, res_b = r.clone(), r.clone()
    q_a, s_a, _ = nd.rmsnorm_quant_dynamic(x, w, EPS, res_a, act_scale=MODES[mode])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_b, s_b, _ = nd.rmsnorm_quant_dynamic(x, w, EPS, res_b, act_scale=MODES[mode])
    res_b.copy_(r)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q_a.view(torch.uint8), q_b.view(torch.uint8)) and torch.equal(s_a, s_b)
    assert torch.equal(res_a, res_b)
    monkeypatch.setenv("FP8_BACKENDS_PDL", "0")
    q_c, s_c, _ = nd.rmsnorm_quant_dynamic(x, w, EPS, r.clone(), act_scale=MODES[mode])
    assert torch.equal(q_a.view(torch.uint8), q_c.view(torch.uint8)) and torch.equal(s_a, s_c)


@pytest.mark.gpu
def test_gpu_inductor_launches_the_kernels_itself():
    from torch._inductor.utils import run_and_get_code

    nd.load_ops()
    x, r, w = _inputs(32, 4096)

    def f(a, res):
        return nd.triton_rmsnorm_quant_dynamic(a * 2, w, EPS, res, 128, "m_major_tma")

    res_c, res_e = r.clone(), r.clone()
    (q, s), codes = run_and_get_code(torch.compile(f, fullgraph=True), x, res_c)
    q_e, s_e, _ = nd.rmsnorm_quant_dynamic(x * 2, w, EPS, res_e, scale_layout="m_major_tma")
    assert torch.equal(q.view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(s, s_e)
    assert torch.equal(res_c, res_e)
    assert "_norm_dyn_block_kernel" in "\n".join(codes)


@pytest.mark.gpu
def test_gpu_compiled_group_mode_with_a_dynamic_m_adds_no_scale_copies():
    """A padded ``m_major_tma`` scale at token counts not a multiple of 4, compiled with a dynamic M: the producer's
    kernel and the op's one launch (its kernel writes the scale's buffer: no copy in or back)."""
    nd.load_ops()
    torch._dynamo.reset()
    w = _inputs(4, 4096)[2]

    def f(a, res):
        return nd.triton_rmsnorm_quant_dynamic(a * 2, w, EPS, res, 128, "m_major_tma")

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for t in (6, 130):
        x, r, _ = _inputs(t, 4096)
        compiled(x, r.clone())
        res_c, res_e = r.clone(), r.clone()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            q, s = compiled(x, res_c)
            torch.cuda.synchronize()
        launched = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(launched) == 2, (t, launched)
        q_e, s_e, _ = nd.rmsnorm_quant_dynamic(x * 2, w, EPS, res_e, scale_layout="m_major_tma")
        assert s.stride() == s_e.stride() and torch.equal(s, s_e)
        assert torch.equal(q.view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(res_c, res_e)


def test_a_row_narrower_than_a_group_keeps_the_program_small():
    """``H`` below the group size: the block takes one group's columns, and fewer rows keep a program's elements
    those of the per-token launch (a [3, 1] input took 4096 rows x 128 columns a program)."""
    for h in (1, 7, 16, 100):
        group = nk.dyn_config(3, h, False, 128, per_token=False)
        token = nk.dyn_config(3, h, False, 128, per_token=True)
        assert group.rows * group.ng * group.gb <= max(token.rows * token.ng * token.gb, 128), (h, group, token)


@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_norm_calls_refuse_what_they_would_ignore(provider):
    """The fused add without a residual, ``out=`` in a dynamic mode (never written), an ``out`` that is no tensor,
    and an eps float32 flushes to zero: one library error each, before any kernel runs."""
    import fp8_backends
    from fp8_backends.core.errors import Fp8BackendError

    if provider == "triton" and DEVICE == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs a GPU or Triton's interpreter")
    norm = fp8_backends.resolve_norm_quant_backend(provider)
    x = torch.randn(3, 256, dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    scale = torch.ones(1, device=DEVICE)
    for mode, s in (("per_tensor_static", scale), ("per_token", None), ("per_token_group", None)):
        with pytest.raises(InvalidInputError, match="needs a residual"):
            norm.fused_add_rmsnorm_quant(x, None, w, s, act_scale=mode)
    buf = torch.empty(3, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    for mode in ("per_token", "per_token_group"):
        with pytest.raises(InvalidInputError, match="out is not taken in the dynamic modes"):
            norm.rmsnorm_quant(x, w, None, act_scale=mode, out=buf)
        with pytest.raises(InvalidInputError, match="out is not taken in the dynamic modes"):
            norm.fused_add_rmsnorm_quant(x, x.clone(), w, None, act_scale=mode, out=buf)
    with pytest.raises(Fp8BackendError, match="out"):
        norm.rmsnorm_quant(x, w, scale, out=[1])
    with pytest.raises(InvalidInputError, match="smallest normal float32"):
        norm.rmsnorm_quant(x, w, scale, 1e-44)
    with pytest.raises(InvalidInputError, match="smallest normal float32"):
        norm.rmsnorm_quant(x, w, None, 1e-44, act_scale="per_token")
