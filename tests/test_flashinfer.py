"""The flashinfer providers: ``flashinfer_bmm`` (GEMM) and ``flashinfer`` (norm-quant).

CPU part: capability and refusal logic, options, the unavailable paths, the cache-path helper, the
fake implementations and a fullgraph torch.compile trace over FakeTensors. GPU part (``gpu``
marker; needs flashinfer): correctness against ``fp8_backends.core.reference`` for every runner usable
on SM90, CUDA-graph capture/replay, torch.compile(fullgraph=True), autotuning, norm-quant.
"""

from __future__ import annotations

import types

import pytest

from fp8_backends.core.errors import InvalidInputError, UnsupportedProblemError
from fp8_backends.core.types import (
    ActScale,
    Availability,
    BiasMode,
    Fp8Dtype,
    GemmProblem,
    NormQuantProblem,
    OutDtype,
    WeightScale,
)
from fp8_backends.providers.flashinfer import common
from fp8_backends.providers.flashinfer.gemm import FlashinferBmmBackend
from fp8_backends.providers.flashinfer.norm_quant import FlashinferNormQuantBackend, fused_add_smem_bytes
from fp8_backends.registry import discovery, resolution
from fp8_backends.registry.platform import cpu_platform, simulate_platform
from fp8_backends.testing import GemmProviderContract, NormQuantProviderContract

SM90 = simulate_platform("9.0")
SM100 = simulate_platform("10.0")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch):
    for var in (common.AUTOTUNE_ENV, common.CACHE_DIR_ENV):
        monkeypatch.delenv(var, raising=False)
    common.reset_caches()
    yield
    common.reset_caches()


@pytest.fixture
def available(monkeypatch: pytest.MonkeyPatch):
    """Pretend flashinfer (with the norm features and the cuDNN frontend) is installed."""
    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: object() if name in ("flashinfer", "cudnn") else real(name))
    monkeypatch.setattr(common, "cuda_present", lambda: True)
    fake_fi = types.SimpleNamespace(rmsnorm_quant=None, fused_add_rmsnorm_quant=None, bmm_fp8=None)
    monkeypatch.setattr(common, "import_flashinfer", lambda: (fake_fi, None))


def gemm_problem(**kw) -> GemmProblem:
    base = dict(n=4096, k=4096, m=16)
    base.update(kw)
    return GemmProblem(**base)


# ------------------------------------------------------------------------------------ registration
def test_entry_points_and_priorities():
    gemm = {e.name: e for e in discovery.discover("gemm")}
    norm = {e.name: e for e in discovery.discover("norm_quant")}
    assert gemm["flashinfer_bmm"].cls is FlashinferBmmBackend
    assert "flashinfer" in gemm["flashinfer_bmm"].aliases
    assert norm["flashinfer"].cls is FlashinferNormQuantBackend
    assert gemm["flashinfer_bmm"].priority < gemm["torch_scaled_mm"].priority
    assert norm["flashinfer"].priority > norm["torch"].priority
    assert FlashinferBmmBackend.capabilities.bias is BiasMode.ADDED_AFTER


# ------------------------------------------------------------------------------------ capabilities
def test_per_token_and_per_channel_refused_with_reason(available):
    b = FlashinferBmmBackend()
    tok = b.supports(gemm_problem(act_scale=ActScale.PER_TOKEN), SM90)
    assert any("per_token" in r for r in tok), tok
    chan = b.supports(gemm_problem(weight_scale=WeightScale.PER_CHANNEL), SM90)
    assert any("per_channel" in r for r in chan), chan
    assert b.supports(gemm_problem(act_scale=ActScale.PER_TENSOR_STATIC), SM90) == []
    assert b.supports(gemm_problem(act_scale=ActScale.PER_TENSOR_DYNAMIC, has_bias=True), SM90) == []


def test_fp32_output_refused(available):
    reasons = FlashinferBmmBackend().supports(gemm_problem(out_dtype=OutDtype.FP32), SM90)
    assert any("float32" in r for r in reasons), reasons
    assert FlashinferBmmBackend().supports(gemm_problem(out_dtype=OutDtype.FP16), SM90) == []


def test_cutlass_runner_refused_on_sm90_accepted_on_sm100(available):
    b = FlashinferBmmBackend(runner="cutlass")
    reasons = b.supports(gemm_problem(), SM90)
    assert len(reasons) == 1 and "cutlass" in reasons[0] and "9.0" in reasons[0], reasons
    assert b.supports(None, SM90), "platform-level listing must show the refusal too"
    assert b.supports(gemm_problem(), SM100) == []
    assert b.supports(None, SM100) == []
    e5m2 = b.supports(gemm_problem(input_dtype=Fp8Dtype.E5M2), SM100)
    assert any("e4m3fn" in r for r in e5m2), e5m2


@pytest.mark.parametrize("runner", ["cublas", "cudnn", "auto"])
def test_sm90_runners_accepted(available, runner):
    assert FlashinferBmmBackend(runner=runner).supports(gemm_problem(), SM90) == []


def test_sm_outside_flashinfer_table_refused(available):
    assert FlashinferBmmBackend().supports(gemm_problem(), simulate_platform("8.6"))  # min_sm 8.9
    reasons = FlashinferBmmBackend().supports(gemm_problem(), simulate_platform("13.0"))
    assert any("cublas" in r and "13.0" in r for r in reasons), reasons


def test_fp8_type_combinations(available):
    b = FlashinferBmmBackend()
    both = b.supports(gemm_problem(input_dtype=Fp8Dtype.E5M2, weight_dtype=Fp8Dtype.E5M2), SM90)
    assert any("e5m2 x e5m2" in r for r in both), both
    assert b.supports(gemm_problem(input_dtype=Fp8Dtype.E5M2), SM90) == []  # mixed: cuBLASLt has it


def test_cudnn_runner_needs_frontend(monkeypatch: pytest.MonkeyPatch, available):
    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "cudnn" else real(name))
    reasons = FlashinferBmmBackend(runner="cudnn").supports(gemm_problem(), SM90)
    assert any("cuDNN frontend" in r for r in reasons), reasons


# ------------------------------------------------------------------------------------ options
def test_options_and_label():
    b = FlashinferBmmBackend()
    assert b.config == {"runner": "cublas", "autotune": "off"}
    assert b.label == "flashinfer_bmm[runner=cublas,autotune=off]"
    assert FlashinferBmmBackend(runner="cudnn").describe_config() == "runner=cudnn,autotune=off"


def test_bad_option_values():
    with pytest.raises(InvalidInputError, match="runner"):
        FlashinferBmmBackend(runner="tensorrt")
    with pytest.raises(InvalidInputError, match="autotune"):
        FlashinferBmmBackend(autotune="always")
    with pytest.raises(InvalidInputError, match="unknown option"):
        FlashinferBmmBackend(backend="cublas")


def test_autotune_env_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(common.AUTOTUNE_ENV, "cache")
    assert FlashinferBmmBackend().config["autotune"] == "cache"
    assert FlashinferBmmBackend(autotune="off").config["autotune"] == "off"  # the option wins
    monkeypatch.setenv(common.AUTOTUNE_ENV, "sometimes")
    with pytest.raises(InvalidInputError, match=common.AUTOTUNE_ENV):
        FlashinferBmmBackend()


def test_option_syntax_through_resolution(available, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_DEFAULTS", "0")  # static priorities only (registry/defaults.py off)
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")  # and no shipped selection data
    res = resolution.resolve("gemm", "flashinfer@runner=cudnn", problem=gemm_problem(), platform=SM90)
    assert isinstance(res, FlashinferBmmBackend)
    assert res.label == "flashinfer_bmm[runner=cudnn,autotune=off]"
    with pytest.raises(UnsupportedProblemError) as info:
        resolution.resolve("gemm", "flashinfer_bmm@runner=cutlass", problem=gemm_problem(), platform=SM90)
    assert any("cutlass" in r for r in info.value.reasons)
    ok = resolution.resolve("gemm", "flashinfer_bmm@runner=cutlass", problem=gemm_problem(), platform=SM100)
    assert ok.config["runner"] == "cutlass"
    auto = resolution.resolve("gemm", "auto", problem=gemm_problem(), platform=SM90)
    assert auto.name == "torch_scaled_mm"  # static priority: 10 beats 5


# ------------------------------------------------------------------------------------ availability
def test_unavailable_without_flashinfer(monkeypatch: pytest.MonkeyPatch):
    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "flashinfer" else real(name))
    for cls in (FlashinferBmmBackend, FlashinferNormQuantBackend):
        avail = cls.availability()
        assert not avail.ok
        assert "flashinfer" in avail.reason
        assert avail.install_hint == "pip install fp8-backends[flashinfer]"
    entry = next(e for e in discovery.discover("gemm") if e.name == "flashinfer_bmm")
    assert "pip install fp8-backends[flashinfer]" in entry.unusable_reason()
    reasons = FlashinferBmmBackend().supports(gemm_problem(), SM90)
    assert len(reasons) == 1 and "install" in reasons[0]


def test_unavailable_without_cuda(monkeypatch: pytest.MonkeyPatch):
    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: object() if name == "flashinfer" else real(name))
    monkeypatch.setattr(common, "cuda_present", lambda: False)
    probe_calls = []
    monkeypatch.setattr(common, "import_flashinfer", lambda: probe_calls.append(1) or (None, "x"))
    for cls in (FlashinferBmmBackend, FlashinferNormQuantBackend):
        avail = cls.availability()
        assert not avail.ok and "CUDA" in avail.reason
    assert probe_calls == [], "no flashinfer import without a CUDA device"


def test_simulated_sm_counts_as_cuda(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FP8_BACKENDS_SIMULATE_SM", "9.0")
    assert common.cuda_present()


def test_norm_feature_probe(monkeypatch: pytest.MonkeyPatch, available):
    assert FlashinferNormQuantBackend.availability().ok
    common.reset_caches()
    old = types.SimpleNamespace(rmsnorm_quant=None)  # a flashinfer without fused_add_rmsnorm_quant
    monkeypatch.setattr(common, "import_flashinfer", lambda: (old, None))
    avail = FlashinferNormQuantBackend.availability()
    assert not avail.ok and "fused_add_rmsnorm_quant" in avail.reason
    common.reset_caches()
    monkeypatch.setattr(common, "import_flashinfer", lambda: (None, "import flashinfer failed: OSError: libcuda"))
    avail = FlashinferNormQuantBackend.availability()
    assert not avail.ok and "libcuda" in avail.reason


def test_feature_probe_cached(monkeypatch: pytest.MonkeyPatch):
    calls = []
    module = types.SimpleNamespace(rmsnorm_quant=None)

    def fake_import():
        calls.append(1)
        return module, None

    monkeypatch.setattr(common, "import_flashinfer", fake_import)
    assert common.missing_features(("rmsnorm_quant", "x")) == ("x",)
    assert common.missing_features(("rmsnorm_quant", "x")) == ("x",)
    assert len(calls) == 2  # import_flashinfer itself caches; the feature answer is cached per names
    assert ("rmsnorm_quant", "x") in common._feature_cache


def test_listing_shows_flashinfer_unavailable(monkeypatch: pytest.MonkeyPatch):
    from fp8_backends import list as listing

    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "flashinfer" else real(name))
    data = listing.collect(cpu_platform())
    rows = {(p["kind"], p["name"]): p for p in data["providers"]}
    for key in (("gemm", "flashinfer_bmm"), ("norm_quant", "flashinfer")):
        assert rows[key]["available"] is False
        assert rows[key]["install_hint"] == "pip install fp8-backends[flashinfer]"
    assert rows[("gemm", "flashinfer_bmm")]["options"]["runner"] == ["cublas", "cudnn", "cutlass", "auto"]


# ------------------------------------------------------------------------------------ norm reasons
def test_norm_capabilities_and_smem_limit(available):
    nq = FlashinferNormQuantBackend()
    assert fused_add_smem_bytes(4096) == (16 + 4096) * 4
    assert nq.supports(NormQuantProblem(hidden=4096, residual=True), SM90) == []
    big = NormQuantProblem(hidden=32768, residual=True)
    assert nq.supports(big, SM90) == []
    reasons = nq.supports(big, simulate_platform("8.9"))
    assert any("shared memory" in r for r in reasons), reasons
    assert nq.supports(NormQuantProblem(hidden=32768), simulate_platform("8.9")) == []
    fp32 = nq.supports(NormQuantProblem(hidden=4096, in_dtype="float32"), SM90)
    assert any("float32" in r for r in fp32)
    assert nq.capabilities.pdl


# ------------------------------------------------------------------------------------ cache paths
def test_cache_dir_helper(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert common.cache_dir() == tmp_path / "home" / ".cache" / "fp8_backends"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert common.cache_dir() == tmp_path / "xdg" / "fp8_backends"
    monkeypatch.setenv(common.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert common.cache_dir() == tmp_path / "mine"
    monkeypatch.setattr(common, "flashinfer_version", lambda: "0.7.2.post1")
    path = common.autotune_cache_path((9, 0))
    assert path == tmp_path / "mine" / "flashinfer" / "autotune-0.7.2.post1-sm90.json"
    assert not path.parent.exists(), "the helper only names the path"


# ------------------------------------------------------------------------------------ fake impls
torch = pytest.importorskip("torch")


def _fake_inputs(mode):
    x = torch.empty(16, 64, dtype=torch.float8_e4m3fn, device="cuda")
    w = torch.empty(32, 64, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty((1,), device="cuda")
    return x, w, s


def test_fake_implementations():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_backends.providers.flashinfer import gemm_ops as ops
    from fp8_backends.providers.flashinfer import norm_ops

    with FakeTensorMode():
        x, w, s = _fake_inputs(None)
        y = ops.gemm_op(x, w.unsqueeze(0).transpose(1, 2), s, s.reshape(()), torch.float16, "cudnn/off")
        assert y.shape == (16, 32) and y.dtype == torch.float16 and y.device.type == "cuda"
        h = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(8, 64, dtype=torch.float8_e4m3fn, device="cuda")
        wt = torch.empty(64, dtype=torch.bfloat16, device="cuda")
        r = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
        assert norm_ops.rmsnorm_quant_op(out, h, wt, s, 1e-6) is None
        assert norm_ops.fused_add_rmsnorm_quant_op(out, h, r, wt, s, 1e-6) is None
    for name in (ops.BMM_OP, norm_ops.NORM_OP, norm_ops.ADD_NORM_OP):
        schema = str(getattr(torch.ops.fp8_backends, name).default._schema)
        assert schema.startswith(f"fp8_backends::{name}(")
    assert "Tensor(a!) out" in str(norm_ops.rmsnorm_quant_op._schema)
    assert "Tensor(b!) residual" in str(norm_ops.fused_add_rmsnorm_quant_op._schema)


def test_fullgraph_trace_over_fake_tensors():
    """torch.compile(fullgraph=True) traces backend.gemm / the norm ops into one graph each (run on
    FakeTensors here, so only the fake implementations execute)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_backends.core.types import PreparedWeight

    gemm, nq = FlashinferBmmBackend(), FlashinferNormQuantBackend()
    gemm.preload()  # what prepare_weight (ensure_preloaded) sets up
    nq._loaded_ops()  # what the first norm call sets up
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with FakeTensorMode():
        x, w, s = _fake_inputs(None)
        prepared = PreparedWeight(w.unsqueeze(0).transpose(1, 2), s.reshape(()), 32, 64, Fp8Dtype.E4M3FN,
                                  WeightScale.PER_TENSOR, gemm.name)
        bias = torch.empty(32, dtype=torch.bfloat16, device="cuda")
        y = torch.compile(lambda x, s, b: gemm.gemm(x, prepared, s, bias=b), fullgraph=True, backend=capture)(
            x, s, bias
        )
        assert y.shape == (16, 32) and y.dtype == torch.bfloat16
        h = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
        r = torch.empty(8, 64, dtype=torch.bfloat16, device="cuda")
        wt = torch.empty(64, dtype=torch.bfloat16, device="cuda")

        def norm(h, r, wt, s):
            q, r2 = nq.fused_add_rmsnorm_quant(h, r, wt, s)
            return q.data, nq.rmsnorm_quant(h, wt, s).data, r2

        q, q2, r2 = torch.compile(norm, fullgraph=True, backend=capture)(h, r, wt, s)
        assert q.dtype == torch.float8_e4m3fn and q2.shape == (8, 64)
    torch._dynamo.reset()
    code = "\n".join(g.code for g in graphs)
    assert "fp8_backends.flashinfer_bmm_fp8.default" in code and "'cublas/off'" in code
    assert "flashinfer_fused_add_rmsnorm_quant.default" in code and "flashinfer_rmsnorm_quant.default" in code


def test_e5m2_pair_refused_before_the_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_backends.core.types import PreparedWeight

    b = FlashinferBmmBackend()
    with FakeTensorMode():
        x = torch.empty(16, 64, dtype=torch.float8_e5m2, device="cuda")
        w = torch.empty(32, 64, dtype=torch.float8_e5m2, device="cuda")
        s = torch.empty((1,), device="cuda")
        prepared = PreparedWeight(w.unsqueeze(0).transpose(1, 2), s.reshape(()), 32, 64, Fp8Dtype.E5M2,
                                  WeightScale.PER_TENSOR, b.name)
        with pytest.raises(InvalidInputError, match="e5m2 x e5m2"):
            b.gemm(x, prepared, s)
        with pytest.raises(InvalidInputError, match="float32"):
            b.gemm(x, prepared, s, out_dtype="float32")
        with pytest.raises(InvalidInputError, match="per-token"):
            b.gemm(x, prepared, torch.empty((16, 1), device="cuda"))


def test_availability_result_shape():
    avail = FlashinferBmmBackend.availability()
    assert isinstance(avail, Availability)


# ============================================================================================ GPU
LLAMA_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = [1, 16, 256, 1024, 4096]
SM90_RUNNERS = ["cublas", "cudnn", "auto"]


def _gpu_ready():
    pytest.importorskip("flashinfer")
    if not FlashinferBmmBackend.availability().ok:
        pytest.skip(FlashinferBmmBackend.availability().reason)


def _rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


_WEIGHTS: dict = {}


def _weight(n, k, dtype=None):
    from fp8_backends.core import reference

    key = (n, k, dtype)
    if key not in _WEIGHTS:
        g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        _WEIGHTS[key] = reference.quantize_dynamic_per_tensor(w, dtype or "e4m3fn")
    return _WEIGHTS[key]


def _act(m, k, dtype="e4m3fn", seed=0):
    from fp8_backends.core import reference

    g = torch.Generator(device="cuda").manual_seed(seed + m)
    return reference.quantize_dynamic_per_tensor(torch.randn(m, k, device="cuda", generator=g), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("runner", SM90_RUNNERS)
@pytest.mark.parametrize("nk", LLAMA_SHAPES, ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_gemm_matches_reference(runner, nk):
    _gpu_ready()
    from fp8_backends.core import reference
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    n, k = nk
    b = FlashinferBmmBackend(runner=runner)
    w_q, w_s = _weight(n, k)
    prepared = b.prepare_weight(w_q, w_s)
    for m in MS:
        x_q, x_s = _act(m, k)
        y = b.gemm(x_q, prepared, x_s)
        ref = reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        err = _rel_err(y, ref)
        assert err < 1e-2, f"{runner} M={m} N={n} K={k}: relerr {err:.2e}"
        kind = ops.bmm_plan_for(x_q, prepared.data, x_s, prepared.scale, torch.bfloat16, b._mode)
        assert not kind.startswith("api"), f"{runner} M={m}: fell back to flashinfer's Python path ({kind})"
        if runner != "cudnn":
            assert kind.startswith("cublas"), kind  # SM90: auto without tuning is cuBLASLt
        else:
            assert kind.startswith("cudnn"), kind


@pytest.mark.gpu
def test_fast_path_agrees_with_full_validation():
    """The base class's one-pass hot-path check accepts what full validation accepts and routes
    everything else to it."""
    _gpu_ready()
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    b = FlashinferBmmBackend()
    w_q, w_s = _weight(4096, 4096)
    prepared = b.prepare_weight(w_q, w_s)
    x_q, x_s = _act(16, 4096)
    assert b._accept_common_case(x_q, prepared, x_s, "bfloat16", None) is torch.bfloat16
    fast = b.gemm(x_q, prepared, x_s)
    b.validate_gemm_inputs(x_q, prepared, x_s, "bfloat16", None)
    full = b.gemm_impl(x_q, prepared, x_s, torch.bfloat16, None)  # what the full path runs
    assert torch.equal(fast, full)
    # the heuristic bmm_fp8 path and the cached-algorithm path pick the same kernel
    state = ops.gemm_device(x_q.device)
    out3 = torch.empty((1, 16, 4096), dtype=torch.bfloat16, device="cuda")
    state.bmm(x_q.unsqueeze(0), prepared.data, out3, x_s, prepared.scale, state.workspace)
    torch.testing.assert_close(out3[0], fast, rtol=1e-2, atol=1e-2)
    bad = [
        (x_q.float(), x_s, "bfloat16", InvalidInputError),  # not fp8
        (x_q.t().contiguous().t(), x_s, "bfloat16", InvalidInputError),  # column-major
        (x_q, x_s.double(), "bfloat16", InvalidInputError),  # fp64 scale
        (x_q, torch.ones(16, 1, device="cuda"), "bfloat16", InvalidInputError),  # per-token
        (x_q, x_s, "float32", InvalidInputError),  # fp32 out
        (x_q[:, :2048].contiguous(), x_s, "bfloat16", InvalidInputError),  # wrong K
        (x_q.cpu(), x_s, "bfloat16", InvalidInputError),  # wrong device
    ]
    for x, s, out_dtype, err in bad:
        assert b._accept_common_case(x, prepared, s, out_dtype, None) is None
        with pytest.raises(err):
            b.gemm(x, prepared, s, out_dtype=out_dtype)
    x5, s5 = _act(16, 4096, "e5m2")
    assert b._accept_common_case(x5, prepared, s5, "bfloat16", None) is None  # mixed FP8: the full way (works)
    assert b.gemm(x5, prepared, s5).shape == (16, 4096)


@pytest.mark.gpu
def test_autotune_cache_mode_without_file(monkeypatch: pytest.MonkeyPatch, tmp_path, caplog):
    _gpu_ready()
    from fp8_backends.core import reference
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    monkeypatch.setenv(common.CACHE_DIR_ENV, str(tmp_path))
    w_q, w_s = _weight(2048, 1024)
    x_q, x_s = _act(24, 1024)
    b = FlashinferBmmBackend(runner="auto", autotune="cache")
    prepared = b.prepare_weight(w_q, w_s)
    with caplog.at_level("WARNING", logger="fp8_backends"):
        y = b.gemm(x_q, prepared, x_s)
    assert _rel_err(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)) < 1e-2
    assert "does not exist" in caplog.text
    kind = ops.bmm_plan_for(x_q, prepared.data, x_s, prepared.scale, torch.bfloat16, b._mode)
    assert kind.startswith("cublas"), kind  # untuned auto on SM90 = cuBLASLt
    assert not any(tmp_path.rglob("*.json")), "cache mode never writes"


@pytest.mark.gpu
def test_autotune_tune_then_cache(monkeypatch: pytest.MonkeyPatch, tmp_path):
    _gpu_ready()
    from fp8_backends.core import reference
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    monkeypatch.setenv(common.CACHE_DIR_ENV, str(tmp_path))
    w_q, w_s = _weight(2048, 1024)
    x_q, x_s = _act(8, 1024)
    ref = reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)
    tuner = FlashinferBmmBackend(runner="cublas", autotune="tune")
    prepared = tuner.prepare_weight(w_q, w_s)
    assert _rel_err(tuner.gemm(x_q, prepared, x_s), ref) < 1e-2  # right even if profiling failed
    path = common.autotune_cache_path(torch.cuda.get_device_capability())
    if not path.is_file():
        try:  # flashinfer's profiler launches a delay kernel from its trtllm_utils JIT module
            from flashinfer.tllm_utils import get_trtllm_utils_module

            get_trtllm_utils_module()
        except Exception as exc:
            pytest.skip(f"flashinfer's AutoTuner cannot profile in this install (trtllm_utils: {exc})"[:300])
    assert path.is_file(), list(tmp_path.rglob("*"))
    ops.reset_plans()
    cached = FlashinferBmmBackend(runner="cublas", autotune="cache")
    prepared = cached.prepare_weight(w_q, w_s)
    assert _rel_err(cached.gemm(x_q, prepared, x_s), ref) < 1e-2
    kind = ops.bmm_plan_for(x_q, prepared.data, x_s, prepared.scale, torch.bfloat16, cached._mode)
    assert kind.startswith("cublas"), kind


# ------------------------------------------------------------------------------------ norm-quant
NORM_TOKENS = [1, 16, 256, 4096]


def _code_mismatch(q, ref) -> float:
    return float((q.view(torch.uint8) != ref.view(torch.uint8)).float().mean())


@pytest.mark.gpu
def test_norm_quant_runs_flashinfers_compiled_module():
    """Numerics, graphs and compile are the kit's (TestFlashinferNormQuantContract); here: the calls go through
    flashinfer's compiled norm module directly, not its Python API."""
    _gpu_ready()
    if not FlashinferNormQuantBackend.availability().ok:
        pytest.skip(FlashinferNormQuantBackend.availability().reason)
    from fp8_backends.providers.flashinfer import norm_ops as ops

    nq = FlashinferNormQuantBackend()
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    nq.rmsnorm_quant(x, torch.ones(4096, device="cuda", dtype=torch.bfloat16), torch.tensor([0.02], device="cuda"))
    assert ops.norm_device(x.device).kind == "direct", "expected the compiled norm module, not the public API"


@pytest.mark.gpu
def test_norm_fast_path_routes_bad_input_to_full_validation():
    _gpu_ready()
    nq = FlashinferNormQuantBackend()
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([0.05], device="cuda")
    nq.rmsnorm_quant(x, w, s)
    assert nq._accept_common_case(x, w, s, 1e-6)
    for args in [(x.float(), w.float(), s), (x, w.half(), s), (x, w, torch.ones(2, device="cuda")),
                 (x, w[:2048], s), (x.t(), w, s)]:
        assert not nq._accept_common_case(*args, 1e-6)
        with pytest.raises(InvalidInputError):
            nq.rmsnorm_quant(*args)
    with pytest.raises(InvalidInputError):
        nq.fused_add_rmsnorm_quant(x, x[:4].clone(), w, s)
    with pytest.raises(InvalidInputError):
        nq.rmsnorm_quant(x, w, s, eps=-1.0)


# ------------------------------------------------------------------------------------ the conformance kit
# On a CPU machine flashinfer is not installed: the kit checks the declarations, the entry points, the
# import cost and that CPU tensors are refused; the rest skips with the reason. On the GPU: everything.
class TestFlashinferBmmContract(GemmProviderContract):
    """The default runner (cuBLASLt)."""

    gpu_shapes = tuple((m, n, k) for n, k in LLAMA_SHAPES for m in (1, 256))

    def make_provider(self):
        return FlashinferBmmBackend()


class TestFlashinferBmmCudnnContract(GemmProviderContract):
    """The cuDNN runner (a plan per M, built at the first eager call of each M)."""

    gpu_shapes = ((16, 4096, 4096), (1024, 6144, 4096))

    def make_provider(self):
        return FlashinferBmmBackend(runner="cudnn")


class TestFlashinferNormQuantContract(NormQuantProviderContract):
    compiled_matches_eager_exactly = True  # opaque ops: Inductor cannot change the codes
    gpu_hidden_sizes = (4096, 8192)
    gpu_token_values = (1, 16, 256, 4096)

    def make_provider(self):
        return FlashinferNormQuantBackend()


@pytest.mark.gpu
def test_unplanned_shape_refused_during_capture():
    """Last GPU test: a cuDNN plan is never built under capture; the error says to warm up."""
    _gpu_ready()
    b = FlashinferBmmBackend(runner="cudnn")
    w_q, w_s = _weight(4096, 4096)
    prepared = b.prepare_weight(w_q, w_s)
    x_q, x_s = _act(77, 4096)  # an M no other test planned
    g = torch.cuda.CUDAGraph()
    with pytest.raises(UnsupportedProblemError, match="eagerly"), torch.cuda.graph(g):
        b.gemm(x_q, prepared, x_s)
    torch.cuda.synchronize()
    assert b.gemm(x_q, prepared, x_s).shape == (77, 4096)  # and eagerly it works afterwards
    # the default cublas runner only asks cuBLASLt for an algorithm (host-only): a new M may be captured
    from fp8_backends.core import reference

    cb = FlashinferBmmBackend()
    prepared = cb.prepare_weight(w_q, w_s)
    x_q, x_s = _act(93, 4096)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = cb.gemm(x_q, prepared, x_s)
    g.replay()
    torch.cuda.synchronize()
    assert _rel_err(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)) < 1e-2


# ------------------------------------------------------------------------------------ plan logic
class _FakeGemmState:
    """Stands in for GemmDevice on the CPU: a "compiled" bmm that computes the reference product."""

    def __init__(self, sm=(9, 0), bmm_fails=False):
        self.sm, self.index = sm, -1
        self.workspace = torch.empty(64, dtype=torch.uint8)
        self.api_calls, self.bmm_calls = [], []
        self.fi = types.SimpleNamespace(bmm_fp8=self._api)
        self.gb = types.SimpleNamespace(CUDNN_AVAILABLE=False)
        self.bmm = self._bmm_failing if bmm_fails else self._bmm
        self.get_algos = self.run_with_algo = None

    @staticmethod
    def _product(a3, b3, sa, sb, out3):
        out3.copy_(((a3.float() * sa.float()) @ (b3.float() * sb.float())).to(out3.dtype))

    def _bmm(self, a3, b3, out3, sa, sb, ws):
        assert a3.dim() == b3.dim() == out3.dim() == 3 and ws is self.workspace
        self.bmm_calls.append(a3.shape[1])
        self._product(a3, b3, sa, sb, out3)

    def _bmm_failing(self, *args):
        raise RuntimeError("simulated tvm-ffi signature mismatch")

    def _api(self, a3, b3, sa, sb, dtype, out=None, backend="cublas"):
        assert out.dtype == dtype
        self.api_calls.append(backend)
        self._product(a3, b3, sa, sb, out)


@pytest.fixture
def fake_state(monkeypatch: pytest.MonkeyPatch):
    from fp8_backends.providers.flashinfer import _support
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    monkeypatch.setattr(_support, "capturing", lambda: False)
    ops.reset_plans()

    def install(**kw):
        state = _FakeGemmState(**kw)
        monkeypatch.setitem(ops._GEMM_DEVICES, -1, state)
        return state

    yield install
    ops.reset_plans()


def _cpu_problem(m=5, n=32, k=64):
    from fp8_backends.core import reference

    w_q, w_s = reference.quantize_dynamic_per_tensor(torch.randn(n, k))
    x_q, x_s = reference.quantize_dynamic_per_tensor(torch.randn(m, k))
    return x_q, w_q, x_s, w_s, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)


@pytest.mark.parametrize("mode", ["cublas/off", "auto/off"])
def test_impl_direct_paths(fake_state, mode):
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    state = fake_state()
    x_q, w_q, x_s, w_s, ref = _cpu_problem()
    w3 = w_q.unsqueeze(0).transpose(1, 2)
    y = ops._bmm_impl(x_q, w3, x_s, w_s.reshape(()), torch.bfloat16, mode)
    torch.testing.assert_close(y, ref)
    assert state.bmm_calls == [5] and state.api_calls == []
    assert ops.bmm_plan_for(x_q, w3, x_s, w_s, torch.bfloat16, mode) == "cublas"
    assert ops._bmm_impl(x_q[:0], w3, x_s, w_s, torch.bfloat16, mode).shape == (0, 32)
    assert state.bmm_calls == [5], "M=0 launches nothing"


def test_impl_cached_algorithm_path(fake_state, caplog):
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    state = fake_state()
    seen = []

    def get_algos(a3, b3, out3, sa, sb, ws, buf):
        assert buf.device.type == "cpu" and buf.numel() == 100 * 64
        buf[:64].fill_(7)
        buf[64:128].fill_(9)
        return 2

    def run_with_algo(a3, b3, out3, sa, sb, ws, buf, idx):
        assert buf.numel() == 64 and idx == 0
        seen.append(int(buf[0]))
        state._product(a3, b3, sa, sb, out3)

    state.get_algos, state.run_with_algo = get_algos, run_with_algo
    x_q, w_q, x_s, w_s, ref = _cpu_problem()
    w3 = w_q.unsqueeze(0).transpose(1, 2)
    torch.testing.assert_close(ops._bmm_impl(x_q, w3, x_s, w_s, torch.bfloat16, "cublas/off"), ref)
    assert seen == [7] and state.bmm_calls == []  # the heuristic's first algorithm, no per-call heuristic
    assert ops.bmm_plan_for(x_q, w3, x_s, w_s, torch.bfloat16, "cublas/off") == "cublas-algo0"

    ops.reset_plans()

    def broken(*args):
        raise TypeError("bmm_fp8_run_with_algo() takes 7 arguments")

    state.run_with_algo = broken
    with caplog.at_level("WARNING", logger="fp8_backends"):
        torch.testing.assert_close(ops._bmm_impl(x_q, w3, x_s, w_s, torch.bfloat16, "cublas/off"), ref)
    assert state.bmm_calls == [5] and "cublas-algo0 path failed" in caplog.text
    assert list(ops.plan_kinds().values()) == ["cublas"]


def test_impl_falls_back_to_the_public_api(fake_state, caplog):
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    state = fake_state(bmm_fails=True)
    x_q, w_q, x_s, w_s, ref = _cpu_problem()
    w3 = w_q.unsqueeze(0).transpose(1, 2)
    with caplog.at_level("WARNING", logger="fp8_backends"):
        y = ops._bmm_impl(x_q, w3, x_s, w_s, torch.bfloat16, "auto/off")
    torch.testing.assert_close(y, ref)
    assert state.api_calls == ["cublas"]
    assert "failed on its first call" in caplog.text
    assert list(ops.plan_kinds().values()) == ["api:cublas"]
    ops._bmm_impl(x_q, w3, x_s, w_s, torch.bfloat16, "auto/off")
    assert state.api_calls == ["cublas", "cublas"], "the fallback plan is cached"


def test_impl_cutlass_without_runner_factory_uses_api(fake_state):
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    state = fake_state(sm=(10, 0))
    x_q, w_q, x_s, w_s, ref = _cpu_problem()
    y = ops._bmm_impl(x_q, w_q.unsqueeze(0).transpose(1, 2), x_s, w_s, torch.bfloat16, "cutlass/off")
    torch.testing.assert_close(y, ref)
    assert state.api_calls == ["cutlass"]


def test_impl_refuses_misaligned_x(fake_state):
    from fp8_backends.providers.flashinfer import gemm_ops as ops

    fake_state()
    _, w_q, x_s, w_s, _ = _cpu_problem()
    raw = torch.zeros(5 * 64 + 1, dtype=torch.uint8)
    x_q = raw[1:].view(torch.float8_e4m3fn).view(5, 64)
    with pytest.raises(InvalidInputError, match="16-byte"):
        ops._bmm_impl(x_q, w_q.unsqueeze(0).transpose(1, 2), x_s, w_s, torch.bfloat16, "cublas/off")
