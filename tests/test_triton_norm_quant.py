"""The ``triton`` norm-quant provider (``providers/triton/norm_quant.py`` + ``norm_kernels.py``).

The conformance kit (``TestTritonNormQuantContract``, ``fp8_backends.testing``) checks both calls against
``fp8_backends.core.reference``; this module adds the kernel paths the kit's sizes do not reach (two-pass and
two-row programs at small H), the ops and their fakes, the capability record, and GPU-only behaviour
(replayed launches, PDL on/off, the two-pass path at real sizes).

CPU part: the kernels run on Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py when no GPU
is visible) on CPU tensors, at small sizes. The interpreter's own float conversions are not exact (it
truncates fp32 -> bf16 and mis-rounds fp32 -> fp8 across a binade), so a module fixture swaps its conversion
helper for torch's casts: the comparisons can then be tight enough to catch real bugs (a missing weight, a
wrong eps, an inverted scale, an unmasked tail; see tests/test_testing_kit.py). Where a GPU is visible the
same small tests run on CUDA tensors.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fp8_backends import InvalidInputError, NormQuantProblem  # noqa: E402
from fp8_backends.core import reference  # noqa: E402
from fp8_backends.core.types import DeviceKind, OutDtype  # noqa: E402
from fp8_backends.providers.triton import _support  # noqa: E402
from fp8_backends.providers.triton.norm_quant import (  # noqa: E402
    ADD_NORM_OP,
    NORM_OP,
    TritonNormQuantBackend,
    load_ops,
)
from fp8_backends.testing import NormQuantProviderContract, assert_codes_close  # noqa: E402

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEVICE = "cpu" if _support.interpreting() else "cuda"
needs_kernels = pytest.mark.skipif(
    not _support.interpreting() and not torch.cuda.is_available(),
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1",
)
interpreter_only = pytest.mark.skipif(not _support.interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")


pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")  # tests/conftest.py


# ------------------------------------------------------------------------------------ helpers
def _inputs(t, h, dtype, device=DEVICE, seed=0, amplitude=1.0):
    g = torch.Generator().manual_seed(seed * 1000 + t * 7 + h)
    x = (torch.randn(t, h, generator=g) * amplitude).to(dtype)
    r = (torch.randn(t, h, generator=g) * amplitude).to(dtype)
    w = (1 + 0.25 * torch.randn(h, generator=g)).to(dtype)
    return x.to(device), r.to(device), w.to(device)


def _scale(value, device=DEVICE):
    return torch.tensor([value], dtype=torch.float32, device=device)


@pytest.fixture
def nq():
    return TritonNormQuantBackend()


# ------------------------------------------------------------------------------------ kernel paths (small)
@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("h, block", [(1000, 128), (4096, 1024), (33, 16)])
def test_two_pass_path_matches_reference(residual, h, block):
    """The chunked two-pass kernel (for hidden sizes past SINGLE_PASS_MAX), reached at small H by
    lowering the threshold; the tail chunk is partial in the first and last case."""
    from fp8_backends.providers.triton import quant_kernels

    cfg = quant_kernels.row_config(h, single_pass_max=block // 2, loop_block=block)
    assert cfg.path == "loop" and cfg.block == block
    _check_kernels_with_config(cfg, 3, h, residual, seed=4)


def _check_kernels_with_config(cfg, t: int, h: int, residual: bool, seed: int) -> None:
    """Run the norm kernel (with or without the residual add) on ``[t, h]`` bf16 rows with launch shape ``cfg``
    and compare codes (and the updated residual) with the reference."""
    from fp8_backends.providers.triton import norm_kernels

    x, r, w = _inputs(t, h, torch.bfloat16, seed=seed)
    s = _scale(0.01)
    out = torch.empty(t, h, dtype=FP8, device=DEVICE)
    if residual:
        ref_q, ref_r = reference.fused_add_rmsnorm_quant(x, r, w, s)
        norm_kernels.fused_add_rmsnorm_quant(out, x, r, w, s, 1e-6, config=cfg)
        assert torch.equal(r, ref_r)
    else:
        ref_q = reference.rmsnorm_quant(x, w, s)
        norm_kernels.rmsnorm_quant(out, x, w, s, 1e-6, config=cfg)
    assert_codes_close(out, ref_q)


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("h, block", [(1000, None), (1000, 128)], ids=["one-pass", "two-pass"])
def test_a_nan_row_quantizes_to_nan_codes(residual, h, block):
    """A NaN in a row makes its RMS, and so every code of that row, NaN (the reference's ``clamp`` keeps it; Triton's
    default ``tl.clamp`` would not); the other rows are unchanged."""
    from fp8_backends.providers.triton import norm_kernels, quant_kernels

    cfg = None if block is None else quant_kernels.row_config(h, single_pass_max=block // 2, loop_block=block)
    x, r, w = _inputs(3, h, torch.bfloat16, seed=9)
    x[1, 5] = float("nan")
    s = _scale(0.01)
    out = torch.empty(3, h, dtype=FP8, device=DEVICE)
    if residual:
        ref_q, _ = reference.fused_add_rmsnorm_quant(x, r.clone(), w, s)
        norm_kernels.fused_add_rmsnorm_quant(out, x, r, w, s, 1e-6, config=cfg)
    else:
        ref_q = reference.rmsnorm_quant(x, w, s)
        norm_kernels.rmsnorm_quant(out, x, w, s, 1e-6, config=cfg)
    assert bool(ref_q[1].float().isnan().all()) and bool(out[1].float().isnan().all())
    keep = [0, 2]
    assert not out[keep].float().isnan().any()
    assert_codes_close(out[keep], ref_q[keep])


# ------------------------------------------------------------------------------------ the comparison bites
@needs_kernels
def test_comparison_catches_a_wrong_scale_in_the_kernel(nq):
    x, _, w = _inputs(8, 512, torch.bfloat16, seed=8)
    s = _scale(0.01)
    qa = nq.rmsnorm_quant(x, w, s * 1.02)
    with pytest.raises(AssertionError):
        assert_codes_close(qa.data, reference.rmsnorm_quant(x, w, s))


# ------------------------------------------------------------------------------------ ops and fakes
def test_op_schemas():
    rq, arq = load_ops()
    assert str(rq._schema).startswith(f"fp8_backends::{NORM_OP}(Tensor(a!) out, Tensor x")
    assert "Tensor(b!) residual" in str(arq._schema) and ADD_NORM_OP in str(arq._schema)
    assert load_ops() == (rq, arq)


def test_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    rq, arq = load_ops()
    with FakeTensorMode():
        x = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
        r = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(64, dtype=torch.bfloat16, device="cuda")
        s = torch.empty((1,), device="cuda")
        out = torch.empty(8, 64, dtype=FP8, device="cuda")
        assert rq(out, x, w, s, 1e-6) is None
        assert arq(out, x, r, w, s, 1e-6) is None
        qa, r2 = TritonNormQuantBackend().fused_add_rmsnorm_quant(x, r, w, s)
        assert qa.data.shape == (8, 64) and qa.data.dtype == FP8 and r2 is r


@interpreter_only
def test_opcheck_on_cpu():
    rq, arq = load_ops()
    x, r, w = _inputs(3, 40, torch.bfloat16, device="cpu", seed=9)
    s = torch.tensor([0.02])
    out = torch.empty(3, 40, dtype=FP8)
    # test_schema compares tensors with arithmetic that CPU torch lacks for float8 ("mul_cpu_reduced_float"):
    # the mutation annotations are checked by test_op_schemas and the in-place tests instead
    tests = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(rq, (out, x, w, s, 1e-6), test_utils=tests)
    torch.library.opcheck(arq, (out, x, r, w, s, 1e-6), test_utils=tests)


@interpreter_only
def test_fullgraph_compile_keeps_the_ops(nq):
    """torch.compile(fullgraph=True) traces both calls into one graph with the two ops (CPU, interpreter)."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, r, w = _inputs(4, 64, torch.bfloat16, device="cpu", seed=10)
    s = torch.tensor([0.02])

    def f(x, r, w, s):
        qa, r2 = nq.fused_add_rmsnorm_quant(x, r, w, s)
        return qa.data, nq.rmsnorm_quant(r2, w, s).data

    torch._dynamo.reset()
    try:
        r_eager = r.clone()
        q1_e, q2_e = f(x, r_eager, w, s)
        r_comp = r.clone()
        q1, q2 = torch.compile(f, fullgraph=True, backend=capture)(x, r_comp, w, s)
    finally:
        torch._dynamo.reset()
    code = "\n".join(g.code for g in graphs)
    assert f"fp8_backends.{NORM_OP}" in code and f"fp8_backends.{ADD_NORM_OP}" in code
    assert torch.equal(r_comp, r_eager), "the in-place residual update must survive torch.compile"
    assert torch.equal(q1.view(torch.uint8), q1_e.view(torch.uint8))
    assert torch.equal(q2.view(torch.uint8), q2_e.view(torch.uint8))


# ------------------------------------------------------------------------------------ the provider record
def test_capabilities_and_identity():
    caps = TritonNormQuantBackend.capabilities
    assert TritonNormQuantBackend.name == "triton" and TritonNormQuantBackend.aliases == ()
    assert caps.devices == _support.DEVICES and caps.min_sm == _support.MIN_SM and caps.pdl
    assert caps.in_dtypes == frozenset({OutDtype.BF16, OutDtype.FP16, OutDtype.FP32})
    assert caps.residual and caps.hidden_align == 1 and caps.priority == 25
    assert TritonNormQuantBackend.requires == _support.REQUIRES
    assert TritonNormQuantBackend.install_hint == _support.INSTALL_HINT
    assert TritonNormQuantBackend.description
    from fp8_backends.providers.flashinfer.norm_quant import FlashinferNormQuantBackend

    assert caps.priority > FlashinferNormQuantBackend.capabilities.priority


def test_supports_any_hidden_size_on_sm89_not_sm80():
    from fp8_backends.registry.platform import simulate_platform

    nq = TritonNormQuantBackend()
    for hidden in (33, 5120, 65536):
        problem = NormQuantProblem(hidden=hidden, in_dtype="float32", residual=True)
        assert nq.supports(problem, simulate_platform("9.0")) == [], hidden
        assert nq.supports(problem, simulate_platform("8.9")) == [], hidden
    reasons = nq.supports(NormQuantProblem(hidden=4096), simulate_platform("8.0"))
    assert any("8.9" in r for r in reasons), reasons


def test_devices_without_the_interpreter():
    code = "from fp8_backends.providers.triton import _support as s; print(sorted(d.value for d in s.DEVICES))"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "['cuda']", done.stderr


def test_cpu_tensors_refused_when_not_interpreting(monkeypatch):
    caps = dataclasses.replace(TritonNormQuantBackend.capabilities, devices=frozenset({DeviceKind.CUDA}))
    monkeypatch.setattr(TritonNormQuantBackend, "capabilities", caps)
    nq = TritonNormQuantBackend()
    x, r, w = _inputs(2, 64, torch.bfloat16, device="cpu")
    with pytest.raises(InvalidInputError, match="triton runs on cuda tensors; x is on cpu"):
        nq.rmsnorm_quant(x, w, torch.tensor([0.1]))
    with pytest.raises(InvalidInputError, match="runs on cuda"):
        nq.fused_add_rmsnorm_quant(x, r, w, torch.tensor([0.1]))
    assert nq.supports(NormQuantProblem(hidden=64, device="cpu"))


# ============================================================================================ GPU
GPU_TOKENS = [1, 32, 4096, 16384]  # 16384: a large launch (fewer warps per row)
GPU_HIDDEN = [4096, 8192, 16384, 5120, 2048, 1500]


@pytest.mark.gpu
def test_gpu_replayed_launches_stay_correct_and_skip_the_general_path(general_launches):
    """The kernels' replays (norm_kernels._launch): from the second call of a key on, the launch bypasses
    KernelLauncher; each call's own pointers and eps reach the kernel (eps 1.0 changes the codes). Both
    variants, one-row, multi-row, two-row and two-pass paths, three dtypes; a misaligned x (a view 8 bytes
    in) always takes the general path. Every result is checked against the reference."""
    from fp8_backends.providers.triton import norm_kernels

    norm_kernels._block_replays.clear()
    norm_kernels._loop_replays.clear()
    general = general_launches
    nq = TritonNormQuantBackend()
    cases = [(1, 4096, torch.bfloat16), (32, 4096, torch.float16), (4096, 4096, torch.bfloat16),
             (64, 512, torch.float32), (8, 40000, torch.bfloat16)]
    for t, h, dtype in cases:
        for call, eps in enumerate((1e-6, 1.0, 1e-5)):
            x, r, w = _inputs(t, h, dtype, device="cuda", seed=20 + call)
            s = _scale(0.01, "cuda")
            before = len(general)
            assert_codes_close(nq.rmsnorm_quant(x, w, s, eps).data, reference.rmsnorm_quant(x, w, s, eps), 1e-3)
            ref_q, ref_r = reference.fused_add_rmsnorm_quant(x, r, w, s, eps)
            qa, _ = nq.fused_add_rmsnorm_quant(x, r, w, s, eps)
            assert torch.equal(r, ref_r)
            assert_codes_close(qa.data, ref_q, 1e-3)
            assert len(general) - before == (2 if call == 0 else 0), (t, h, dtype, call)
    x, r, w = _inputs(16, 4096, torch.bfloat16, device="cuda", seed=30)
    xm = torch.empty(16 * 4096 + 4, dtype=x.dtype, device="cuda")[4:].view(16, 4096)
    xm.copy_(x)
    s = _scale(0.01, "cuda")
    for _ in range(2):
        before = len(general)
        assert_codes_close(nq.rmsnorm_quant(xm, w, s).data, reference.rmsnorm_quant(x, w, s), 1e-3)
        assert len(general) - before == 1


@pytest.mark.gpu
@pytest.mark.parametrize("h", [40000, 65536])
def test_gpu_two_pass_path(h):
    from fp8_backends.providers.triton import quant_kernels

    assert quant_kernels.row_config(h).path == "loop"
    nq = TritonNormQuantBackend()
    x, r, w = _inputs(64, h, torch.bfloat16, device="cuda", seed=12)
    s = _scale(0.01, "cuda")
    assert_codes_close(nq.rmsnorm_quant(x, w, s).data, reference.rmsnorm_quant(x, w, s), 1e-3)
    ref_q, ref_r = reference.fused_add_rmsnorm_quant(x, r, w, s)
    qa, _ = nq.fused_add_rmsnorm_quant(x, r, w, s)
    assert torch.equal(r, ref_r)
    assert_codes_close(qa.data, ref_q, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [256, 4096, 5120, 32768, 65536])
def test_gpu_pdl_on_and_off_agree(monkeypatch, h):
    nq = TritonNormQuantBackend()
    x, r, w = _inputs(512, h, torch.bfloat16, device="cuda", seed=13)
    s = _scale(0.02, "cuda")
    results = []
    for pdl in ("1", "0"):
        monkeypatch.setenv("FP8_BACKENDS_PDL", pdl)
        assert _support.pdl_enabled(x.device) == (pdl == "1" and torch.cuda.get_device_capability() >= (9, 0))
        res = r.clone()
        q1 = nq.rmsnorm_quant(x, w, s).data
        q2, _ = nq.fused_add_rmsnorm_quant(x, res, w, s)
        torch.cuda.synchronize()
        results.append((q1.view(torch.uint8), q2.data.view(torch.uint8), res))
    for a, b in zip(*results):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ the conformance kit
class TestTritonNormQuantContract(NormQuantProviderContract):
    """Both calls against the reference for bf16/fp16/fp32 over T = 0, 1, 3, 17 and H = 33, 256, 1000, 4096,
    scales, eps, writes inside out/residual, refusals, bad inputs, fake tensors, torch.compile (CPU:
    Triton's interpreter); on a GPU also model sizes (up to H = 16384, T = 16384), graph replay up to the
    two-pass path (H = 65536), Inductor (bit-exact: the same kernels, launched by Inductor), no host sync. The
    module's pytestmark makes the interpreter's float conversions exact, so the comparisons stay tight."""

    compiled_matches_eager_exactly = True
    gpu_hidden_sizes = (4096, 8192, 16384, 5120, 2048, 1500)
    gpu_token_values = (1, 32, 4096, 16384)
    gpu_graph_hidden_sizes = (1024, 4096, 32768, 65536)

    def make_provider(self):
        return TritonNormQuantBackend()


@pytest.mark.gpu
def test_gpu_inductor_launches_the_norm_kernels_itself():
    """Transparent under torch.compile: both ops are triton_ops, so Inductor launches the norm kernels from its own
    code, bit-exact with the eager launches."""
    nq = TritonNormQuantBackend()
    x, r, w = _inputs(48, 4096, torch.bfloat16, device="cuda", seed=15)
    s = _scale(0.05, "cuda")

    def f(x, r, w, s):
        qa, r2 = nq.fused_add_rmsnorm_quant(x, r, w, s)
        return qa.data, nq.rmsnorm_quant(r2, w, s).data

    from torch._inductor.utils import run_and_get_code

    res_eager = r.clone()
    q1_e, q2_e = f(x, res_eager, w, s)
    torch._dynamo.reset()
    try:
        res_c = r.clone()
        (q1, q2), codes = run_and_get_code(torch.compile(f, fullgraph=True), x, res_c, w, s)
        plain = torch.compile(lambda x, w, s: nq.rmsnorm_quant(x, w, s).data, fullgraph=True)(x, w, s)
    finally:
        torch._dynamo.reset()
    code = "\n".join(line for line in "\n".join(codes).splitlines() if not line.lstrip().startswith("#"))
    # transparent: Inductor launches the norm kernels itself (no opaque op with a Python body)
    assert "_norm_quant_block_kernel" in code, code[-3000:]
    assert "torch.ops.fp8_backends" not in code, code[-3000:]
    assert torch.equal(res_c, res_eager), "the in-place residual update must survive torch.compile"
    assert torch.equal(q1.view(torch.uint8), q1_e.view(torch.uint8)), "fused add + norm + quant"
    assert torch.equal(q2.view(torch.uint8), q2_e.view(torch.uint8)), "norm + quant of the updated residual"
    assert torch.equal(plain.view(torch.uint8), nq.rmsnorm_quant(x, w, s).data.view(torch.uint8)), "plain norm"


def test_default_config_warps_rule_per_variant():
    from fp8_backends.providers.triton import norm_kernels, quant_kernels

    # one row per program: the plain kernel counts as a large launch from T*H = 2^22 (4 warps per row), the
    # add variant from 2^25
    assert quant_kernels.LARGE_LAUNCH_NORM < quant_kernels.LARGE_LAUNCH
    plain_small = norm_kernels.one_row_config(512, 4096, add=False)
    plain_large = norm_kernels.one_row_config(1024, 4096, add=False)
    add_mid = norm_kernels.one_row_config(4096, 4096, add=True)
    add_large = norm_kernels.one_row_config(8192, 4096, add=True)
    assert plain_large.num_warps < plain_small.num_warps and plain_large.num_warps == add_large.num_warps
    assert add_mid.num_warps == plain_small.num_warps
    assert all(c.path == "row" and c.block == 4096 for c in (plain_small, plain_large, add_mid, add_large))


def test_default_config_pairs_rows_only_for_large_plain_launches_of_short_rows():
    from fp8_backends.providers.triton import norm_kernels

    dc = norm_kernels.default_config
    assert dc(4096, 4096, add=False) == ("rows", 2, 4096, 8)
    assert dc(16384, 2048, add=False) == ("rows", 2, 2048, 4)
    assert dc(3000, 1500, add=False) == ("rows", 2, 2048, 4)  # T x H past 2^22, row padded to 2048
    assert dc(512, 4096, add=False) == norm_kernels.one_row_config(512, 4096, add=False)  # small launch
    for t, h, add in [(4096, 8192, False), (4096, 4096, True), (16384, 2048, True), (8192, 512, False)]:
        assert dc(t, h, add) == norm_kernels.one_row_config(t, h, add), (t, h, add)


@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("t, h", [(5, 2000), (2, 4096), (1, 1500)])
def test_two_row_programs_match_reference(residual, t, h):
    """Programs of two whole rows of up to 4096 elements (the shape ``default_config`` gives large plain
    launches), with an odd row count and a masked row tail."""
    from fp8_backends.providers.triton.quant_kernels import RowConfig

    block = 1 << (h - 1).bit_length()
    _check_kernels_with_config(RowConfig("rows", 2, block, max(4, block // 512)), t, h, residual, seed=6)


@interpreter_only
def test_interpreter_launches_take_the_general_path_every_time(general_launches):
    """Under the interpreter (CPU tensors) nothing is replayed: each call launches through KernelLauncher."""
    nq = TritonNormQuantBackend()
    x, r, w = _inputs(2, 64, torch.bfloat16, seed=3)
    s = _scale(0.02)
    for n in (1, 2):
        assert_codes_close(nq.rmsnorm_quant(x, w, s).data, reference.rmsnorm_quant(x, w, s))
        assert len(general_launches) == n


def test_norm_kernels_compile_with_inductors_argument_types():
    """Inductor types a Python float argument as fp64 when it launches a user kernel (eager Triton: fp32); with an
    fp64 ``eps`` the fp32 math turned fp64 and its cast to fp8 failed to lower ("Unsupported conversion from f64 to
    f8E4M3FN", seen on the H200 under torch.compile). Both norm kernels, with and without the residual, must compile
    for sm_90 with that signature (no GPU needed: Triton compiles for a target)."""
    script = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from fp8_backends.providers.triton import norm_kernels as nk

        ptrs = {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16", "s_ptr": "*fp32", "o_ptr": "*fp8e4nv"}
        strides = {n: "i32" for n in ("stride_x", "stride_r", "stride_o", "stride_w")}
        kernels = ((nk._norm_quant_block_kernel, {"T": "i32", "H": "i32"}, {"ROWS": 2, "BLOCK": 1024}),
                   (nk._norm_quant_loop_kernel, {"H": "i32"}, {"BLOCK": 1024}))
        for kernel, sizes, block in kernels:
            for add in (False, True):
                consts = {"FMAX": 448.0, **block, "ADD": add, "USE_PDL": False}
                sig = {**ptrs, **sizes, **strides, "eps": "fp64", **{n: "constexpr" for n in consts}}
                assert list(sig) == kernel.arg_names, (list(sig), kernel.arg_names)
                src = ASTSource(fn=kernel, signature=sig,
                                constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
                triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        print("compiled")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    if "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("this Triton has no ptxas to compile for sm_90")
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
