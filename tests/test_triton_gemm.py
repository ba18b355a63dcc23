"""The ``triton`` GEMM provider: configs and dispatch, capabilities, and its kernels against the reference.

On the CPU the kernels run on Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py when no
GPU is visible) at small sizes; ``@pytest.mark.gpu`` tests run them compiled at Llama-3-8B sizes.
"""

from __future__ import annotations

import json

import pytest

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.types import ActScale, GemmProblem, OutDtype, WeightScale
from fp8_backends.providers.triton import _support, gemm_configs
from fp8_backends.providers.triton.gemm import TritonGemmBackend
from fp8_backends.providers.triton.gemm_configs import CONFIGS, DEFAULT_TABLE, TileConfig, TritonTable
from fp8_backends.registry.platform import simulate_platform
from fp8_backends.testing import GemmProviderContract

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
needs_kernels = pytest.mark.skipif(
    not ON_GPU and not _support.interpreting(), reason="needs a GPU or TRITON_INTERPRET=1 (conftest sets it)"
)

#: the activation modes of the per-tensor / per-token machinery (block-wise FP8 has its own tests)
PLAIN_ACT_SCALES = [m for m in ActScale if m is not ActScale.PER_TOKEN_GROUP]


# ------------------------------------------------------------------------------------ registration
def test_entry_point_registered_and_resolvable_by_name():
    from fp8_backends.registry import discovery
    from fp8_backends.registry.resolution import resolve_gemm_backend

    assert "triton" in {e.name for e in discovery.discover("gemm")}
    platform = simulate_platform("9.0")
    backend = resolve_gemm_backend("triton@config=swap_n64_m16_k256_s6_w4", problem=GemmProblem(n=64, k=64, m=4),
                                   platform=platform)
    assert isinstance(backend, TritonGemmBackend)
    assert backend.config == {"config": "swap_n64_m16_k256_s6_w4"}


# ------------------------------------------------------------------------------------ configs and table
def test_configs_are_valid_and_named_uniquely():
    assert len(CONFIGS) == len(gemm_configs.CONFIG_LIST)
    for name, cfg in CONFIGS.items():
        assert cfg.name == name and name.isidentifier()
    with pytest.raises(ValueError, match="power of two"):
        TileConfig("mm", 48, 64, 64, 3, 4)
    with pytest.raises(ValueError, match="family"):
        TileConfig("splitk", 16, 64, 64, 3, 4)
    with pytest.raises(ValueError, match="tensor-core"):
        TileConfig("swap", 8, 64, 64, 3, 4)


def test_default_table_covers_every_m_with_a_known_config():
    assert DEFAULT_TABLE.config_names() <= set(CONFIGS)
    for table in (DEFAULT_TABLE, TritonTable(default=DEFAULT_TABLE.default)):  # per-shape and default buckets
        for n, k in (*DEFAULT_TABLE.shapes, (5120, 5120)):
            families = {m: CONFIGS[table.pick(m, n, k)] for m in (0, 1, 2, 16, 17, 1 << 20)}
            assert families[1].family == "gemv"  # GEMV streams the weight once per token: M = 1 only
            assert all(families[m].family == "swap" and families[m].block_m >= m for m in (2, 16))
            assert families[1 << 20].family in ("mm", "tma")


def test_table_json_round_trip_and_env_override(tmp_path, monkeypatch):
    table = TritonTable(default=((16, "swap_n64_m16_k256_s6_w4"), (None, "tma_n256_m128_k128_s3_w8_g8_p1")),
                        shapes={(4096, 4096): ((1, "gemv_n2_k1024_w2"), (None, "mm_n128_m64_k128_s4_w4_g8"))},
                        source="test")
    again = TritonTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again == table and again.pick(1, 4096, 4096) == "gemv_n2_k1024_w2"
    assert again.pick(1, 6144, 4096) == "swap_n64_m16_k256_s6_w4"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table.to_json()))
    monkeypatch.setenv(gemm_configs.TABLE_ENV, str(path))
    assert gemm_configs.active_table() == table
    with pytest.raises(ValueError, match="unknown config"):
        TritonTable(default=((None, "ws64x16_swap"),))  # a CUTLASS name
    with pytest.raises(ValueError, match="format"):
        TritonTable.from_json({**table.to_json(), "format": "fp8_backends.cutlass_table/1"})


def test_broken_table_file_makes_provider_unavailable(tmp_path, monkeypatch):
    from fp8_backends.core.backend import clear_availability_cache

    path = tmp_path / "broken.json"
    path.write_text("{not json")
    monkeypatch.setenv(gemm_configs.TABLE_ENV, str(path))
    clear_availability_cache()
    avail = TritonGemmBackend.availability()
    assert not avail.ok and gemm_configs.TABLE_ENV in avail.reason


# ------------------------------------------------------------------------------------ capabilities
def test_capabilities_and_refusals():
    caps = TritonGemmBackend.capabilities
    for sm in ("8.9", "9.0", "10.0", "12.0"):
        assert caps.check(GemmProblem(n=4096, k=4096, act_scale=ActScale.PER_TOKEN,
                                      weight_scale=WeightScale.PER_CHANNEL, out_dtype=OutDtype.FP32,
                                      has_bias=True), simulate_platform(sm)) == []
    assert any("8.9" in r for r in caps.check(GemmProblem(n=64, k=64), simulate_platform("8.0")))
    h100 = simulate_platform("9.0")
    assert caps.check(GemmProblem(n=64, k=64, input_dtype="e5m2", weight_dtype="e5m2"), h100) == []
    assert any("mixed" in r for r in caps.check(GemmProblem(n=64, k=64, input_dtype="e5m2"), h100))
    # any N and K (masked pointer kernels): the TP splits of real models, vLLM's and flashinfer's 3420 / 6840
    for n, k in ((40, 64), (64, 24), (6840, 3420), (3420, 6840), (1, 1)):
        assert caps.check(GemmProblem(n=n, k=k), h100) == [], (n, k)
    assert caps.pdl


def test_forced_tma_configs_serve_unaligned_k():
    """Per-tensor / per-channel weights are K-padded at prepare_weight, so a forced TMA config serves K % 16 too."""
    h100 = simulate_platform("9.0")
    if not TritonGemmBackend.availability().ok:
        pytest.skip(TritonGemmBackend.availability().reason)
    tma = next(name for name, cfg in CONFIGS.items() if cfg.family == "tma")
    mm = next(name for name, cfg in CONFIGS.items() if cfg.family == "mm")
    for config in ("auto", mm, tma):
        assert TritonGemmBackend(config=config).supports(GemmProblem(n=6840, k=3420, m=2048), h100) == []


@pytest.mark.parametrize("k", [1, 6, 24, 71, 3420, 6840])
def test_pad_columns_pads_the_codes_with_zeros(k):
    """The activation pad (eager: as the widest integer dividing K; compiled: as bytes) keeps every code and adds
    zeros, for a row-major and a column-sliced input."""
    from fp8_backends.core.padding import pad_columns

    k_pad = -(-k // 16) * 16
    wide = (torch.randn(5, k + 3) * 10).to(torch.float8_e4m3fn)
    for x in (wide[:, :k].contiguous(), wide[:, 1:k + 1]):
        for fn in (pad_columns, torch.compile(pad_columns, fullgraph=True)):
            p = fn(x, k_pad)
            assert p.shape == (5, k_pad) and p.dtype == x.dtype and p.is_contiguous()
            assert torch.equal(p[:, :k].view(torch.uint8), x.contiguous().view(torch.uint8))
            assert not p[:, k:].view(torch.uint8).any()


@needs_kernels
def test_unaligned_k_weights_are_padded_once():
    """K = 71: the prepared weight is a zero-padded [N, 80] copy (16-byte rows); gemm pads the activation to match
    and gives the reference's answer; an aligned K keeps the weight itself (no copy)."""
    from fp8_backends.core import reference

    b = TritonGemmBackend()
    x, w, xs, ws = _data(3, 37, 71, per_token=True, per_channel=True)
    prepared = b.prepare_weight(w, ws)
    assert tuple(prepared.data.shape) == (37, 80) and prepared.k == 71
    assert torch.equal(prepared.data[:, :71].view(torch.uint8), w.view(torch.uint8))
    assert not prepared.data[:, 71:].view(torch.uint8).any()
    y = b.gemm(x, prepared, xs)
    assert _relerr(y, reference.fp8_gemm(x, w, xs, ws, torch.float32)) < 1e-2
    aligned = _data(3, 32, 64)[1]
    assert b.prepare_weight(aligned, torch.ones(1)).data is aligned


def test_forced_small_m_configs_refuse_large_m():
    h100 = simulate_platform("9.0")
    gemv = TritonGemmBackend(config="gemv_n2_k1024_w2")
    if not TritonGemmBackend.availability().ok:
        pytest.skip(TritonGemmBackend.availability().reason)
    assert gemv.supports(GemmProblem(n=4096, k=4096, m=1), h100) == []
    assert any("small-M" in r for r in gemv.supports(GemmProblem(n=4096, k=4096, m=64), h100))
    assert TritonGemmBackend().supports(GemmProblem(n=4096, k=4096, m=1 << 16), h100) == []


def test_options_and_tuner_candidates():
    from fp8_backends.tuning.workloads import option_combos

    assert TritonGemmBackend().config == {"config": "auto"}
    with pytest.raises(InvalidInputError):
        TritonGemmBackend(config="nope")
    # one option for both kernel families: a candidate serves the problems of its family (extra_reasons)
    from fp8_backends.providers.triton import block_gemm_configs

    assert option_combos(TritonGemmBackend) == [{"config": n} for n in (*gemm_configs.CONFIG_NAMES,
                                                                         *block_gemm_configs.CONFIG_NAMES)]


def test_pdl_policy(monkeypatch):
    cpu = torch.device("cpu")
    assert not _support.pdl_enabled(cpu)
    if ON_GPU:
        dev = torch.device("cuda", 0)
        expected = torch.cuda.get_device_capability(0) >= (9, 0)
        assert _support.pdl_enabled(dev) is expected
        monkeypatch.setenv("FP8_BACKENDS_PDL", "0")
        assert not _support.pdl_enabled(dev)


def test_custom_op_fake_implementation():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_backends.providers.triton import gemm_ops

    gemm_ops.load_op()
    schema = str(torch.ops.fp8_backends.triton_gemm.default._schema)
    assert "Tensor? bias" in schema and "str config" in schema
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.float8_e4m3fn, device="cuda")
        w = torch.empty(32, 64, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(1, device="cuda")
        y = gemm_ops.triton_gemm(x, w, s, s, None, torch.float16, "auto")
    assert tuple(y.shape) == (5, 32) and y.dtype == torch.float16 and y.device.type == "cuda"


def test_cpu_tensors_refused_without_the_interpreter(monkeypatch):
    from fp8_backends.core.types import DeviceKind

    caps = TritonGemmBackend.capabilities
    cuda_only = type(caps)(**{**caps.__dict__, "devices": frozenset({DeviceKind.CUDA})})
    monkeypatch.setattr(TritonGemmBackend, "capabilities", cuda_only)
    w = torch.zeros(64, 64).to(torch.float8_e4m3fn)
    with pytest.raises(InvalidInputError, match="cuda"):
        TritonGemmBackend().prepare_weight(w, torch.ones(1))


# ------------------------------------------------------------------------------------ numerics
DEVICE = "cuda" if ON_GPU else "cpu"


def _relerr(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _data(m, n, k, *, per_token=False, per_channel=False, fp8=torch.float8_e4m3fn, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = (torch.randn(m, k, device=DEVICE, generator=g) * 2).to(fp8)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * 2).to(fp8)
    xs = (torch.rand(m, 1, device=DEVICE, generator=g) * 0.05 + 0.01) if per_token else torch.tensor(
        [0.03], device=DEVICE)
    ws = (torch.rand(n, device=DEVICE, generator=g) * 0.05 + 0.01) if per_channel else torch.tensor(
        [0.02], device=DEVICE)
    return x, w, xs, ws


def _check(backend, m, n, k, *, per_token=False, per_channel=False, out_dtype=torch.bfloat16, bias=False,
           fp8=torch.float8_e4m3fn, tol=1e-2):
    from fp8_backends.core import reference

    x, w, xs, ws = _data(m, n, k, per_token=per_token, per_channel=per_channel, fp8=fp8)
    b = (torch.randn(n, device=DEVICE) * 4).to(out_dtype) if bias else None
    prepared = backend.prepare_weight(w, ws)
    y = backend.gemm(x, prepared, xs, out_dtype=out_dtype, bias=b)
    assert y.shape == (m, n) and y.dtype == out_dtype
    ref = reference.fp8_gemm(x, w, xs, ws, torch.float32, b)
    err = _relerr(y, ref)
    assert torch.isfinite(y.float()).all() and err < tol, (backend.label, m, n, k, err)
    return y


# one config per family, small tiles where the family allows (the interpreter's cost grows with programs x K steps)
SMALL = {
    "gemv": "gemv_n4_k512_w4",
    "swap": "swap_n64_m16_k256_s6_w4",
    "mm": "mm_n128_m64_k128_s4_w4_g8",
}


@needs_kernels
@pytest.mark.parametrize("persistent", [0, 1])
def test_tma_family(persistent):
    """TMA-fed tiles, plain and persistent (the interpreter emulates the descriptors), ragged edges."""
    from fp8_backends.core import reference
    from fp8_backends.providers.triton.gemm_ops import run_config

    cfg = TileConfig("tma", 64, 64, 64, 3, 4, persistent=persistent)
    for m, n, k, per in ((1, 48, 96, False), (130, 80, 272, True)):
        x, w, xs, ws = _data(m, n, k, per_token=per, per_channel=per)
        bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
        run_config(cfg, x, w, xs, ws, bias, out)
        assert _relerr(out, reference.fp8_gemm(x, w, xs, ws, torch.float32, bias)) < 1e-2


@needs_kernels
def test_tma_config_with_misaligned_operand_uses_pointer_loads():
    from fp8_backends.core import reference
    from fp8_backends.providers.triton.gemm_ops import run_config

    x, w, xs, ws = _data(4, 64, 64)
    big = torch.zeros(4 * 64 + 8, dtype=torch.uint8, device=DEVICE)
    odd = big[8:].view(torch.float8_e4m3fn).view(4, 64)
    odd.copy_(x)
    assert odd.data_ptr() % 16
    out = torch.empty(4, 64, dtype=torch.bfloat16, device=DEVICE)
    run_config(TileConfig("tma", 64, 64, 64, 3, 4), odd, w, xs, ws, None, out)
    assert _relerr(out, reference.fp8_gemm(x, w, xs, ws, torch.float32)) < 1e-2


@needs_kernels
@pytest.mark.parametrize("family", ["gemv", "swap", "mm", "tma"])
def test_unaligned_n_and_k(family):
    """N and K of any size (not multiples of 16: rows 16-byte misaligned, a ragged last K block) through each family;
    a TMA config runs its tiles as pointer kernels then (TMA needs 16-byte rows), with the same result."""
    from fp8_backends.core import reference
    from fp8_backends.providers.triton.gemm_ops import run_config

    cfg = TileConfig("tma", 64, 64, 64, 3, 4) if family == "tma" else CONFIGS[SMALL[family]]
    for m, n, k in ((1, 37, 71), (3, 40, 24), (19, 5, 137)):
        if family == "gemv" and m > 1:
            continue
        x, w, xs, ws = _data(m, n, k, per_token=m > 1, per_channel=m > 1)
        bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
        run_config(cfg, x, w, xs, ws, bias, out)
        assert _relerr(out, reference.fp8_gemm(x, w, xs, ws, torch.float32, bias)) < 1e-2, (family, m, n, k)


@needs_kernels
def test_unaligned_shapes_through_the_provider_and_fused_quantization(exact_interpreter_casts):
    """prepare_weight, gemm and the fused quantize+GEMM launch of a layer serve K = 71, N = 37 (TP-split sizes); the
    fused launch gives the unfused result bit for bit."""
    from fp8_backends import quant
    from fp8_backends.core import reference

    b = TritonGemmBackend()
    _check(b, 5, 37, 71, per_token=True, per_channel=True, bias=True)
    x = torch.randn(2, 71, device=DEVICE).to(torch.bfloat16)
    w, ws = _data(2, 37, 71)[1::2]
    prepared = b.prepare_weight(w, ws)
    fused = b.fused_quant_gemm_impl(x, prepared, ActScale.PER_TOKEN, None, torch.bfloat16, None)
    x_q, x_s = quant.quantize_per_token(x)
    unfused = b.gemm(x_q, prepared, x_s)
    assert fused is not None and torch.equal(fused, unfused)
    assert _relerr(unfused, reference.fp8_gemm(x_q, w, x_s, ws, torch.float32)) < 1e-2


# ------------------------------------------------------------------------------------ GPU, real sizes
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = [1, 16, 64, 256, 1024, 4096]


def _sampled_cases():
    for i, name in enumerate(gemm_configs.CONFIG_NAMES):
        fam = CONFIGS[name].family
        for j, m in enumerate(MS):
            if fam == "gemv" and m > 8 or fam == "swap" and m > 256:
                continue
            n, k = SHAPES[(i + j) % len(SHAPES)]
            yield pytest.param(name, m, n, k, id=f"{name}-M{m}-{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("name, m, n, k", list(_sampled_cases()))
def test_gpu_every_config_llama_shapes(name, m, n, k):
    _check(TritonGemmBackend(config=name), m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 5, 16, 77, 512, 2048])
@pytest.mark.parametrize("n, k", [(3420, 6840), (6840, 3420), (3456, 6912), (1000, 1001)])
def test_gpu_unaligned_shapes_auto(m, n, k):
    """N and K of vLLM's and flashinfer's unaligned cases (and their aligned neighbours) through config=auto: every M
    bucket's kernel (GEMV, swap-AB, tiled, TMA run as pointer tiles where K % 16)."""
    _check(TritonGemmBackend(), m, n, k, per_token=True, per_channel=True, bias=True)
    _check(TritonGemmBackend(), m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 2048])
def test_gpu_pdl_on_and_off_agree(m, monkeypatch):
    b = TritonGemmBackend()
    x, w, xs, ws = _data(m, 4096, 4096)
    prepared = b.prepare_weight(w, ws)
    y_pdl = b.gemm(x, prepared, xs)
    monkeypatch.setenv("FP8_BACKENDS_PDL", "0")
    y_plain = b.gemm(x, prepared, xs)
    assert torch.equal(y_pdl, y_plain)


# ------------------------------------------------------------------------------------ the conformance kit
class TestTritonGemmContract(GemmProviderContract):
    """``config=auto`` (the M-bucket table: GEMV at M = 1, swap-AB for small M, tiled above) through the kit:
    every declared combination, edge shapes, refusals, bad inputs, fake tensors, torch.compile; on a GPU also
    graphs, Inductor, no host sync and odd M at 4096 x 4096. On the CPU the kernels run on Triton's
    interpreter (conftest.py sets TRITON_INTERPRET=1)."""

    gpu_shapes = tuple((m, 4096, 4096) for m in (1, 7, 33, 100, 257, 1001, 3000))

    def make_provider(self):
        return TritonGemmBackend()


class TestTritonGemmGemvContract(GemmProviderContract):
    """The GEMV family forced (it refuses M > 8)."""

    m_values = (0, 1, 2, 7)
    gpu_shapes = ((1, 4096, 4096), (8, 14336, 4096))

    def make_provider(self):
        return TritonGemmBackend(config=SMALL["gemv"])


class TestTritonGemmSwapContract(GemmProviderContract):
    """The swap-AB family forced: M past its 16-token tile (17, 65) loops over token tiles."""

    gpu_shapes = ((16, 4096, 4096), (77, 1024, 2048), (300, 6144, 4096))

    def make_provider(self):
        return TritonGemmBackend(config=SMALL["swap"])


class TestTritonGemmTiledContract(GemmProviderContract):
    """The grouped tiled (prefill) family forced."""

    gpu_shapes = ((77, 1024, 2048), (1024, 4096, 4096))

    def make_provider(self):
        return TritonGemmBackend(config=SMALL["mm"])


@pytest.mark.gpu
@pytest.mark.parametrize("per_token", [False, True])
def test_gpu_inductor_launches_the_kernel_itself(per_token):
    """Transparent under torch.compile: the op is a triton_op, so Inductor launches the Triton kernel from its own
    generated code (no opaque op with a Python body), with the same result."""
    from torch._inductor.utils import run_and_get_code

    from fp8_backends.core import reference

    b = TritonGemmBackend()
    x, w, xs, ws = _data(9, 1024, 2048, per_token=per_token)
    prepared = b.prepare_weight(w, ws)

    def f(x, xs):
        return b.gemm(x, prepared, xs, out_dtype=torch.bfloat16) * 2

    torch._dynamo.reset()
    y, codes = run_and_get_code(torch.compile(f, fullgraph=True), x, xs)
    assert _relerr(y, 2 * reference.fp8_gemm(x, w, xs, ws, torch.float32)) < 1e-2
    code = "\n".join(line for line in "\n".join(codes).splitlines() if not line.lstrip().startswith("#"))
    assert "fp8_gemm_swap_kernel" in code, code[-3000:]
    assert "torch.ops.fp8_backends" not in code


@pytest.mark.gpu
def test_gpu_inductor_keeps_tma_configs_as_their_op():
    """At prefill sizes the table picks a persistent TMA config: the traced op calls the opaque TMA op."""
    from torch._inductor.utils import run_and_get_code

    from fp8_backends.core import reference

    b = TritonGemmBackend()
    x, w, xs, ws = _data(4096, 1024, 2048)
    prepared = b.prepare_weight(w, ws)
    assert gemm_configs.CONFIGS[gemm_configs.active_table().pick(4096, 1024, 2048)].family == "tma"
    torch._dynamo.reset()
    y, codes = run_and_get_code(torch.compile(lambda x, s: b.gemm(x, prepared, s, out_dtype=torch.bfloat16),
                                              fullgraph=True), x, xs)
    assert _relerr(y, reference.fp8_gemm(x, w, xs, ws, torch.float32)) < 1e-2
    assert "triton_gemm_tma" in "\n".join(codes)


# ------------------------------------------------------------------------------------ launcher
class _Param:
    def __init__(self, constexpr: bool) -> None:
        self.is_constexpr = constexpr


class _FakeCompiled:
    def __init__(self, log: list, key: tuple) -> None:
        self.log, self.key = log, key

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            self.log.append(("direct", self.key, (grid[0], grid[1], grid[2]), args, stream))  # as Triton's runner

        return runner


class _FakeJit:
    """Stands in for a @triton.jit function: ``fn[grid](*args, **options)`` 'compiles' and returns a kernel."""

    def __init__(self, constexpr_mask: tuple[bool, ...]) -> None:
        self.params = [_Param(c) for c in constexpr_mask]
        self.log: list = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            key = (args, tuple(sorted(options.items())))
            self.log.append(("jit", key, grid))
            return _FakeCompiled(self.log, key)

        return launch


def _launcher(fn):
    from fp8_backends.providers.triton.launcher import KernelLauncher

    launcher = KernelLauncher(fn)
    launcher.direct = True  # as on a GPU (the interpreter always takes Triton's JIT path)
    launcher._stream = lambda index: f"stream{index}"
    return launcher


def test_launcher_reuses_the_compiled_kernel_only_for_the_same_specialization():
    fn = _FakeJit((False, False, True))  # (tensor, M, BLOCK constexpr)
    launch = _launcher(fn)
    x = torch.empty(64)
    opts = {"num_warps": 4, "num_stages": 3, "pdl": False, "device_index": 0}
    launch((1,), (x, 32, 64), **opts)
    launch((2,), (x, 48, 64), **opts)  # M % 16 == 0 still: same kernel, launched directly
    assert [e[0] for e in fn.log] == ["jit", "direct"]
    assert fn.log[1][2] == (2, 1, 1) and fn.log[1][3] == (x, 48, 64) and fn.log[1][4] == "stream0"
    launch((1,), (x, 17, 64), **opts)  # M not divisible by 16: Triton specializes differently
    launch((1,), (x, 1, 64), **opts)  # M == 1 is its own specialization
    launch((1,), (x, 32, 128), **opts)  # another constexpr value
    launch((1,), (x[1:], 32, 64), **opts)  # a misaligned data pointer
    launch((1,), (x.half(), 32, 64), **opts)  # another dtype
    launch((1,), (x, 32, 64), **{**opts, "pdl": True})  # launch options are part of the key
    launch((1,), (x, 32, 64), **{**opts, "device_index": 1})
    assert [e[0] for e in fn.log] == ["jit", "direct"] + ["jit"] * 7
    launch((1,), (x, 17, 64), **opts)
    assert fn.log[-1][0] == "direct"
    assert ("launch_pdl", True) in fn.log[-3][1][1]


class _FakeRunnable(_FakeCompiled):
    """A compiled kernel with the attributes Triton's runner uses: the launcher calls ``run`` itself."""

    function = "fn-handle"
    packed_metadata = "packed"

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
        self.log.append(("run", self.key, (gx, gy, gz), args, stream, function, packed))


class _FakeJitRunnable(_FakeJit):
    def __getitem__(self, grid):
        launch = super().__getitem__(grid)

        def compile_and_launch(*args, **options):
            compiled = launch(*args, **options)
            return _FakeRunnable(compiled.log, compiled.key)

        return compile_and_launch


def test_launcher_calls_the_compiled_kernels_launcher_directly():
    fn = _FakeJitRunnable((False, False, True))
    launch = _launcher(fn)
    x = torch.empty(64)
    opts = {"num_warps": 4, "num_stages": 3, "pdl": False, "device_index": 0}
    launch((3,), (x, 32, 64), **opts)
    launch((5, 2), (x, 48, 64), **opts)
    assert [e[0] for e in fn.log] == ["jit", "run"]
    # the compiled kernel's launcher gets the data pointer read for the key, not the tensor (no second
    # data_ptr() call and no driver pointer check per tensor)
    assert fn.log[1][2:] == ((5, 2, 1), (x.data_ptr(), 48, 64), "stream0", "fn-handle", "packed")
    y = torch.empty(64)
    launch((1,), (y, 32, 64), **opts)
    assert fn.log[-1][3] == (y.data_ptr(), 32, 64)
    launch((1,), (torch.nn.Parameter(y), 32, 64), **opts)  # another tensor type: the generic path, tensors as given
    assert type(fn.log[-1][3][0]) is torch.nn.Parameter


def test_launcher_passes_launch_hooks_only_when_some_are_set():
    from fp8_backends.providers.triton import launcher as L

    class HookChain:  # the shape of Triton's knobs.runtime.launch_*_hook
        def __init__(self, calls):
            self.calls = calls

    assert L._no_hooks(None) and L._no_hooks(HookChain([]))
    assert not L._no_hooks(HookChain([print])) and not L._no_hooks(print)

    class _Knobs:
        launch_enter_hook = HookChain([print])
        launch_exit_hook = HookChain([])

    seen = []

    class _Hooked(_FakeRunnable):
        def run(self, gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
            seen.append((meta, enter, leave))

        def launch_metadata(self, grid, stream, *args):
            return {"grid": grid}

    class _Jit(_FakeJit):
        def __getitem__(self, grid):
            launch = super().__getitem__(grid)
            return lambda *a, **o: _Hooked(launch(*a, **o).log, None)

    launch = _launcher(_Jit((False,)))
    launch._knobs = _Knobs()
    opts = {"num_warps": 4, "num_stages": 3, "pdl": False, "device_index": 0}
    launch((2,), (torch.empty(4),), **opts)
    launch((2,), (torch.empty(4),), **opts)
    assert seen == [({"grid": (2, 1, 1)}, _Knobs.launch_enter_hook, _Knobs.launch_exit_hook)]
    _Knobs.launch_enter_hook = HookChain([])
    launch((2,), (torch.empty(4),), **opts)
    assert seen[-1] == (None, None, None)


@pytest.mark.parametrize(
    "args",
    [
        (torch.empty(8), 1, 16, 2**31, -(2**40), 2**63, True, None, 0.5, 7),
        (torch.empty(8, dtype=torch.float16)[1:], 17, 0, -1, 2**31 - 1, 2**64, False, None, 1.0, 7),
    ],
)
def test_generated_key_matches_the_generic_key(args):
    from fp8_backends.providers.triton.launcher import generic_key, make_key_fn

    constexpr = (False,) * 9 + (True,)
    plan = make_key_fn(args, constexpr)
    key, run_args = plan(args)
    assert key == generic_key(args, constexpr)
    assert run_args == (args[0].data_ptr(), *args[1:])  # tensors as their data pointers, the rest as given
    # other values of the same kinds: still the generic key; other kinds: None (the caller falls back)
    other = (torch.empty(4, dtype=torch.bfloat16), 2, 32, 5, 3, 1, False, None, 2.0, 9)
    assert plan(other)[0] == generic_key(other, constexpr)
    key = plan
    for i, swapped in [(0, 3), (1, torch.empty(2)), (6, None), (7, torch.empty(2)), (8, 1)]:
        changed = list(other)
        changed[i] = swapped
        assert key(tuple(changed)) is None
    assert key(other[:-1]) is None


def test_launcher_keys_a_call_with_other_argument_kinds_like_the_generic_path():
    fn = _FakeJit((False, False))
    launch = _launcher(fn)
    opts = {"num_warps": 4, "num_stages": 3, "pdl": False, "device_index": 0}
    x = torch.empty(64)
    launch((1,), (x, 32), **opts)
    launch((1,), (x, None), **opts)  # None where an int was: a new specialization (generic key)
    launch((1,), (x, None), **opts)
    launch((1,), (x, 48), **opts)
    assert [e[0] for e in fn.log] == ["jit", "jit", "direct", "direct"]


def test_launcher_takes_the_jit_path_under_the_interpreter():
    from fp8_backends.providers.triton.launcher import KernelLauncher

    fn = _FakeJit((False,))
    launcher = KernelLauncher(fn)
    assert launcher.direct is (not _support.interpreting())
    launcher.direct = False
    for _ in range(3):
        launcher((1,), (torch.empty(4),), num_warps=4, num_stages=1, pdl=False, device_index=0)
    assert [e[0] for e in fn.log] == ["jit"] * 3


@pytest.mark.gpu
def test_gpu_repeated_calls_through_the_cached_kernel_stay_correct():
    """Second and later calls launch the cached compiled kernel: every specialization change is seen."""
    b = TritonGemmBackend()
    for m in (16, 32, 17, 1, 16, 17, 1, 48):
        _check(b, m, 1024, 2048, per_token=m % 2 == 1, bias=m == 17)


@pytest.mark.gpu
def test_gpu_replayed_launches_stay_correct_and_skip_the_general_path(general_launches):
    """run_config's replays: from the second call of a key on, the launch bypasses KernelLauncher (replayed
    compiled kernel and grid), for each scale mode, bias, output dtype and M; a misaligned operand always
    takes the general path. Every output is checked against the reference."""
    from fp8_backends.providers.triton import gemm_ops

    gemm_ops._replays.clear()
    general = general_launches
    b = TritonGemmBackend()
    cases = [dict(m=16), dict(m=1), dict(m=17, bias=True), dict(m=16, per_token=True, per_channel=True),
             dict(m=16, out_dtype=torch.float16), dict(m=48, bias=True, per_channel=True)]
    for case in cases:
        for call in range(4):
            before = len(general)
            _check(b, n=1024, k=2048, **case)
            assert (len(general) - before) == (1 if call == 0 else 0), (case, call)
    assert len(gemm_ops._replays) == len(cases)
    x, w, xs, ws = _data(16, 1024, 2048)
    prepared = b.prepare_weight(w, ws)
    xm = torch.empty(16 * 2048 + 8, dtype=x.dtype, device=x.device)[8:].view(16, 2048)  # 8-byte aligned rows
    xm.copy_(x)
    for _ in range(3):
        before = len(general)
        y = b.gemm(xm, prepared, xs)
        assert len(general) - before == 1
        from fp8_backends.core import reference

        assert _relerr(y, reference.fp8_gemm(x, w, xs, ws, torch.float32, None)) < 1e-2


@pytest.mark.skipif(not _support.interpreting(), reason="needs TRITON_INTERPRET=1 (the CPU-only case)")
def test_auto_never_picks_the_interpreter_but_a_named_request_gets_it():
    from fp8_backends.core.types import NormQuantProblem
    from fp8_backends.registry import resolution

    for kind, problem in (("gemm", GemmProblem(n=64, k=64, m=4, device="cpu")),
                          ("norm_quant", NormQuantProblem(hidden=64, device="cpu"))):
        auto = resolution.explain(kind, "auto", problem=problem)
        assert auto.backend is not None and auto.backend.name != "triton"
        cand = next(c for c in auto.candidates if c.entry.name == "triton")
        assert cand.ok and "interpreter" in cand.explicit_only
        named = resolution.explain(kind, "triton", problem=problem)
        assert named.error is None and named.backend.name == "triton"
    on_gpu = resolution.explain("norm_quant", "auto", problem=NormQuantProblem(hidden=64),
                                platform=simulate_platform("9.0"))
    assert on_gpu.backend.name == "triton"  # highest priority where it runs compiled


def test_bench_sweep_summary_builds_a_loadable_triton_table(monkeypatch):
    """bench/triton_configs.py: synthetic timings -> a table TritonTable accepts, and the decode summary."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))  # bench/ is a repository folder
    bt = importlib.import_module("bench.triton_configs")
    sweep = importlib.import_module("bench.config_sweep")
    names = list(gemm_configs.CONFIG_NAMES)
    ms = [1, 16, 64, 1024]
    rows = []
    for n, k in sweep.SHAPES:
        for m in ms:
            eligible = [c for c in names if bt._eligible(CONFIGS[c], m)]
            res = {label: {"median_us": 10.0, "error": None, "relerr": 2e-3}
                   for label in (sweep.TORCH, sweep.TORCH_FA, *(bt.PREFIX + c for c in eligible))}
            fastest = eligible[(m + n) % len(eligible)]
            res[bt.PREFIX + fastest]["median_us"] = 5.0
            rows.append({"n": n, "k": k, "m": m, "n_sets": 2, "results": res,
                         "nopdl": {"config": fastest, "results": {bt.NOPDL + fastest: {
                             "median_us": 6.0, "error": None, "relerr": 2e-3}}}})
    summary = sweep.summarize(rows, names, ms, sweep.SHAPES, bt._spec(),
                              eligible=lambda name, m: bt._eligible(CONFIGS[name], m))
    table = TritonTable.from_json(json.loads(sweep.table_text(summary["table"])))
    for row in rows:
        best = min((r["median_us"], label) for label, r in row["results"].items() if label.startswith(bt.PREFIX))
        assert bt.PREFIX + table.pick(row["m"], row["n"], row["k"]) == best[1]
    decode = bt.decode_summary(rows, names, copy_gbps=4000.0)
    assert {p["m"] for p in decode["points"]} == {1, 16}
    point = decode["points"][0]
    assert point["best_us"] == 5.0 and point["nopdl_us"] == 6.0 and point["torch_us"] == 10.0
    assert abs(decode["M=1"]["best_floor_frac"] - 2 * decode["M=1"]["torch_floor_frac"]) < 1e-9
    summary["decode"] = decode
    report = {"header": {"date": "d", "gpu": "g", "sm": "9.0a", "driver": "-", "cuda_runtime": "-", "versions": {},
                         "command": "c", "copy_gbps": 4000.0, "pdl": True}, "rows": rows, "summary": summary}
    text = bt.markdown(report, names)
    assert "% of the weight-read floor" in text and "torch / best" in text


@pytest.mark.skipif(not _support.interpreting(), reason="needs TRITON_INTERPRET=1 (the CPU-only case)")
def test_tuner_does_not_time_interpreter_only_candidates():
    from fp8_backends.registry.platform import cpu_platform
    from fp8_backends.tuning.workloads import expand_candidates

    cands, skipped = expand_candidates("gemm", GemmProblem(n=64, k=64, m=4, device="cpu"), cpu_platform())
    assert cands and all(c.provider != "triton" for c in cands)
    assert any(label.startswith("triton") and "interpreter" in why for label, why in skipped)


def test_replay_for_returns_the_compiled_launcher_and_grid_only_after_a_direct_launch():
    fn = _FakeJitRunnable((False, False, True))
    launch = _launcher(fn)
    x = torch.empty(64)
    opts = {"num_warps": 4, "num_stages": 3, "pdl": False, "device_index": 0}
    assert launch.replay_for((3, 2), (x, 32, 64), **opts) is None  # nothing compiled yet
    launch((3, 2), (x, 32, 64), **opts)
    replay = launch.replay_for((3, 2), (x, 32, 64), **opts)
    assert (replay.function, replay.packed, replay.g0, replay.g1, replay.g2) == ("fn-handle", "packed", 3, 2, 1)
    assert launch.replay_for((3,), (x, 17, 64), **opts) is None  # another specialization: not compiled
    assert launch.replay_for((3,), (x, 32, 64), **{**opts, "pdl": True}) is None
    replay.run(replay.g0, replay.g1, replay.g2, "s", replay.function, replay.packed, None, None, None, 1, 2, 3)
    assert fn.log[-1][0] == "run" and fn.log[-1][3] == (1, 2, 3)
    launch.direct = False  # the interpreter / Triton's JIT path: no replays
    assert launch.replay_for((3, 2), (x, 32, 64), **opts) is None


def test_hooks_clear_sees_triton_launch_hooks():
    launch = _launcher(_FakeJitRunnable((False,)))

    class _Knobs:
        launch_enter_hook = None
        launch_exit_hook = None

    launch._knobs = _Knobs()
    assert launch.hooks_clear()
    _Knobs.launch_exit_hook = print  # e.g. a profiler's hook: replays would skip it
    assert not launch.hooks_clear()
    launch._knobs = None  # a Triton without knobs: never replay
    assert not launch.hooks_clear()


def test_replay_cache_keeps_the_tail_and_answers_only_without_hooks():
    from fp8_backends.providers.triton.launcher import ReplayCache

    fn = _FakeJitRunnable((False, False, True))
    launch = _launcher(fn)

    class _Knobs:
        launch_enter_hook = None
        launch_exit_hook = None

    launch._knobs = _Knobs()
    x = torch.empty(64)
    opts = {"num_warps": 4, "num_stages": 3, "pdl": False, "device_index": 0}
    cache = ReplayCache(head=1, maxsize=2)
    cache.record("a", launch, (2,), (x, 32, 64), **opts)  # nothing compiled yet: nothing kept
    assert cache.lookup("a") is None and len(cache) == 0
    launch((2,), (x, 32, 64), **opts)
    cache.record("a", launch, (2,), (x, 32, 64), **opts)
    replay, tail, owner = cache.lookup("a")
    assert tail == (32, 64) and owner is launch and (replay.g0, replay.g1) == (2, 1)
    _Knobs.launch_enter_hook = print
    assert cache.lookup("a") is None  # a hook is set: the caller takes the general path
    _Knobs.launch_enter_hook = None
    launch((2,), (x, 48, 64), **opts)
    cache.record("b", launch, (2,), (x, 48, 64), **opts)
    cache.record("c", launch, (2,), (x, 48, 64), **opts)  # full: emptied first
    assert len(cache) == 1 and cache.lookup("c") is not None and cache.lookup("a") is None


# ------------------------------------------------------------------------------------ fused activation quant
def _quantized(x, mode, static_scale):
    from fp8_backends import quant

    if mode is ActScale.PER_TENSOR_STATIC:
        return quant.quantize_static(x, static_scale), static_scale
    if mode is ActScale.PER_TENSOR_DYNAMIC:
        return quant.quantize_dynamic(x)
    return quant.quantize_per_token(x)


@needs_kernels
@pytest.mark.usefixtures("exact_interpreter_casts")
@pytest.mark.parametrize("mode", PLAIN_ACT_SCALES)
@pytest.mark.parametrize(("config", "m", "n", "k"), [
    ("auto", 1, 64, 96), ("auto", 5, 32, 64), ("auto", 40, 64, 128),  # gemv, swap, declined above FUSED_MAX_M
    ("mm_n128_m64_k128_s4_w4_g8", 8, 64, 128),  # declined: the mm kernels never fuse
    ("swap_n64_m16_k128_s8_w4", 3, 48, 256), ("swap_n64_m16_k128_s8_w4", 16, 128, 112),
    ("gemv_n4_k512_w4", 3, 48, 256),
])
def test_fused_activation_quant_is_the_unfused_path_bit_for_bit(mode, config, m, n, k):
    """The swap-AB and GEMV kernels quantize an unquantized activation themselves (one launch per eager linear):
    the same FP8 codes and the same products as quantize + GEMM, so the outputs are equal; per-channel weights and a
    bias included. Where the picked config is another family, the hook declines (None)."""
    be = TritonGemmBackend() if config == "auto" else TritonGemmBackend(config=config)
    g = torch.Generator(device=DEVICE).manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, device=DEVICE, generator=g) * 0.1).to(torch.float8_e4m3fn)
    prep = be.prepare_weight(w, torch.rand(n, device=DEVICE, generator=g) * 0.02 + 0.005)
    x = (torch.randn(m, k, device=DEVICE, generator=g) * 3).to(torch.bfloat16)
    x[0, 0] = 40.0  # a clear maximum: the dynamic scales are exact divisions of it
    bias = torch.randn(n, device=DEVICE, generator=g).to(torch.bfloat16)
    static = torch.tensor([0.05], device=DEVICE)
    y = be.fused_quant_gemm_impl(x, prep, mode, static if mode is ActScale.PER_TENSOR_STATIC else None,
                                 torch.bfloat16, bias)
    from fp8_backends.providers.triton.gemm_args import pick_config
    from fp8_backends.providers.triton.gemm_ops import FUSED_MAX_M

    family = CONFIGS[pick_config(be.config["config"], m, n, k).name].family
    if family not in ("swap", "gemv") or m > FUSED_MAX_M:
        assert y is None
        return
    x_q, x_scale = _quantized(x, mode, static)
    ref = be.gemm_impl(x_q, prep, x_scale, torch.bfloat16, bias)
    assert y is not None and y.shape == (m, n) and y.dtype == torch.bfloat16
    assert torch.equal(y, ref), (y.float() - ref.float()).abs().max()


@needs_kernels
@pytest.mark.usefixtures("exact_interpreter_casts")
@pytest.mark.parametrize("mode", PLAIN_ACT_SCALES)
@pytest.mark.parametrize(("config", "m"), [("gemv_n4_k512_w4", 3), ("swap_n64_m16_k128_s8_w4", 5)])
def test_fused_activation_quant_keeps_a_nan_as_the_unfused_path(mode, config, m):
    """A NaN in the activation: the fused kernels' amax and clamp propagate it as quantize + GEMM does (a NaN row per
    token and static, every output dynamic per tensor), and the other outputs are unchanged."""
    be = TritonGemmBackend(config=config)
    n, k = 48, 256
    g = torch.Generator(device=DEVICE).manual_seed(m + 7)
    prep = be.prepare_weight((torch.randn(n, k, device=DEVICE, generator=g) * 0.1).to(torch.float8_e4m3fn),
                             torch.tensor([0.01], device=DEVICE))
    x = (torch.randn(m, k, device=DEVICE, generator=g) * 3).to(torch.bfloat16)
    x[0, 0] = 40.0
    x[1, 17] = float("nan")
    static = torch.tensor([0.05], device=DEVICE)
    y = be.fused_quant_gemm_impl(x, prep, mode, static if mode is ActScale.PER_TENSOR_STATIC else None,
                                 torch.bfloat16, None)
    x_q, x_scale = _quantized(x, mode, static)
    ref = be.gemm_impl(x_q, prep, x_scale, torch.bfloat16, None)
    assert y is not None
    assert bool(ref[1].isnan().all()) and bool(y[1].isnan().all())
    torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (none visible to torch)")
@pytest.mark.parametrize("mode", PLAIN_ACT_SCALES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (1, 1024, 14336), (4, 6144, 4096), (16, 4096, 1008)])
def test_gpu_fused_activation_quant_matches_the_unfused_path(mode, m, n, k):
    """On the GPU at model sizes (the kernels auto picks there: GEMV at M = 1, swap-AB above), the fused launch gives
    the unfused path's output bit for bit (the same codes, products and epilogue)."""
    be = TritonGemmBackend()
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.1).to(torch.float8_e4m3fn)
    prep = be.prepare_weight(w, torch.rand(n, device="cuda", generator=g) * 0.02 + 0.005)
    x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
    static = torch.tensor([0.05], device="cuda")
    y = be.fused_quant_gemm_impl(x, prep, mode, static if mode is ActScale.PER_TENSOR_STATIC else None,
                                 torch.bfloat16, None)
    assert y is not None
    x_q, x_scale = _quantized(x, mode, static)
    ref = be.gemm_impl(x_q, prep, x_scale, torch.bfloat16, None)
    assert torch.equal(y, ref), (y.float() - ref.float()).abs().max()


@needs_kernels
def test_eager_layer_takes_the_fused_launch_and_matches_the_reference():
    """A processed Fp8Linear on the triton provider runs one fused launch per small-M eager call (no separate
    quantization kernel), and its output matches the reference within the usual FP8 tolerance."""
    from fp8_backends.core import reference
    from fp8_backends.layers import Fp8Linear
    from fp8_backends.providers.triton import gemm_ops

    lin = torch.nn.Linear(128, 64, bias=True, device=DEVICE, dtype=torch.bfloat16)
    for mode in ("per_tensor_dynamic", "per_token", "per_tensor_static"):
        layer = Fp8Linear.from_linear(lin, act_scale=mode, backend="triton",
                                      input_scale=0.02 if mode == "per_tensor_static" else None)
        calls: list[bool] = []
        real = gemm_ops.fused_launch

        def spy(*a, _real=real, _calls=calls, **kw):
            out = _real(*a, **kw)
            _calls.append(out is not None)
            return out

        x = torch.randn(2, 3, 128, device=DEVICE, dtype=torch.bfloat16)
        gemm_ops.fused_launch = spy  # bound into the eager plan when the layer binds it (below)
        try:
            layer._plan = None  # rebind with the spy
            y = layer(x)
        finally:
            gemm_ops.fused_launch = real
            layer._plan = None
        assert calls == [True], (mode, calls)
        x_q, x_scale = _quantized(x.reshape(-1, 128), ActScale(mode), layer.input_scale)
        ref = reference.fp8_gemm(x_q, layer.weight, x_scale, layer.weight_scale, torch.bfloat16, lin.bias)
        assert y.shape == (2, 3, 64)
        torch.testing.assert_close(y.reshape(-1, 64).float(), ref.float(), rtol=2e-2, atol=2e-2)
