"""``flashinfer_block``: block-wise FP8 GEMM through flashinfer's ``fp8_blockscale_gemm_sm90`` (DeepGEMM, SM 9.0).

CPU part: registration, capabilities and refusal reasons, availability without flashinfer / CUDA / sources / nvcc,
the listing row, the DeepGEMM config rule and cache names, the build command without flashinfer, the op's host logic
against a stand-in runner (layouts, first-call compile log, capture refusal, warm-up), the fake implementation and a
fullgraph trace over FakeTensors. GPU part (``gpu`` marker; flashinfer on an SM 9.0 GPU): numbers against
``fp8_backends.core.reference`` on DeepSeek-V3 shapes, every scale layout, bias, CUDA-graph capture, torch.compile,
and the config rule against the kernels DeepGEMM actually cached.
"""

from __future__ import annotations

import sys
import types

import pytest

from fp8_backends.core.errors import BuildError, InvalidInputError, UnsupportedProblemError
from fp8_backends.core.types import (
    ActScale,
    BiasMode,
    Fp8Dtype,
    GemmProblem,
    OutDtype,
    ScaleLayout,
    WeightScale,
)
from fp8_backends.providers.flashinfer import block_jit, common
from fp8_backends.providers.flashinfer.block import FlashinferBlockBackend
from fp8_backends.registry import discovery
from fp8_backends.registry.platform import cpu_platform, simulate_platform

SM90 = simulate_platform("9.0")
BLOCK = dict(act_scale="per_token_group", weight_scale="block")
H200_SMS = 132


@pytest.fixture(autouse=True)
def _fresh():
    common.reset_caches()
    yield
    common.reset_caches()


@pytest.fixture
def available(monkeypatch: pytest.MonkeyPatch):
    """Pretend flashinfer 0.7 with the block-scaled GEMM, its sources and an nvcc are here."""
    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: object() if name == "flashinfer" else real(name))
    monkeypatch.setattr(common, "cuda_present", lambda: True)
    monkeypatch.setattr(block_jit, "missing_sources", lambda: [])
    monkeypatch.setattr(block_jit, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    fake_fi = types.SimpleNamespace(gemm=types.SimpleNamespace(fp8_blockscale_gemm_sm90=None))
    monkeypatch.setattr(common, "import_flashinfer", lambda: (fake_fi, None))
    monkeypatch.setattr(block_jit, "feature_reason", lambda module: None)


def block_problem(**kw) -> GemmProblem:
    base = dict(n=2112, k=7168, m=16, **BLOCK)
    base.update(kw)
    return GemmProblem(**base)


# ------------------------------------------------------------------------------------ registration, capabilities
def test_entry_point_priority_and_capabilities():
    gemm = {e.name: e for e in discovery.discover("gemm")}
    assert gemm["flashinfer_block"].cls is FlashinferBlockBackend
    assert gemm["flashinfer_block"].priority < gemm["flashinfer_bmm"].priority
    caps = FlashinferBlockBackend.capabilities
    assert caps.block_scaled and caps.group_sizes == {128} and caps.weight_blocks == {(128, 128)}
    assert caps.group_scale_layout is ScaleLayout.M_MAJOR_TMA
    assert caps.act_scales == {ActScale.PER_TOKEN_GROUP} and caps.weight_scales == {WeightScale.BLOCK}
    assert caps.input_dtypes == {Fp8Dtype.E4M3FN} and caps.out_dtypes == {OutDtype.BF16}
    assert caps.bias is BiasMode.ADDED_AFTER and caps.archs == ("9.0a",)
    assert FlashinferBlockBackend().label == "flashinfer_block[warmup=decode]"
    with pytest.raises(InvalidInputError, match="warmup"):
        FlashinferBlockBackend(warmup="all")


def test_block_problems_served_and_refused_with_reasons(available):
    b = FlashinferBlockBackend()
    assert b.supports(block_problem(), SM90) == []
    assert b.supports(block_problem(has_bias=True, m=1), SM90) == []
    assert b.supports(block_problem(n=576, k=1536), SM90) == []  # N % 128 == 64: a half block, served
    k_bad = b.supports(block_problem(k=7168 + 64), SM90)
    assert len(k_bad) == 1 and "K=7232" in k_bad[0] and "128" in k_bad[0], k_bad
    n_bad = b.supports(block_problem(n=2112 + 32), SM90)
    assert len(n_bad) == 1 and "N=2144" in n_bad[0] and "64" in n_bad[0], n_bad
    for problem, word in [(block_problem(out_dtype="float16"), "float16"),
                          (block_problem(input_dtype="e5m2", weight_dtype="e5m2"), "e5m2"),
                          (block_problem(group_size=64, weight_block=(128, 128)), "group size 64"),
                          (GemmProblem(n=2112, k=7168, m=16), "per_tensor"),
                          (GemmProblem(n=2112, k=7168, m=16, act_scale="per_token", weight_scale="per_channel"),
                           "per_channel")]:
        reasons = b.supports(problem, SM90)
        assert any(word in r for r in reasons), (problem.describe(), reasons)
    for sm in ("8.9", "10.0", "12.0"):
        reasons = b.supports(block_problem(), simulate_platform(sm))
        assert reasons and "9.0a" in reasons[0], reasons
    assert b.supports(None, SM90) == [] and b.supports(None, simulate_platform("10.0"))


def test_block_reasons_hook_states_the_kernel_rules(available):
    b = FlashinferBlockBackend()
    assert b.block_reasons(block_problem()) == []
    reasons = b.block_reasons(block_problem(n=100, k=200))
    assert len(reasons) == 2 and reasons[0].startswith("K=200") and reasons[1].startswith("N=100")


def test_resolving_a_block_problem_never_imports_flashinfer(available, monkeypatch: pytest.MonkeyPatch, tmp_path):
    """Every GEMM resolution asks each provider about the problem: where flashinfer is not imported yet, the feature
    check reads its version and the readiness check looks for a built module on disk (importing flashinfer costs
    2-4 s, paid only where its module is loaded)."""
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)

    def no_import(*_a, **_k):
        raise AssertionError("flashinfer imported")

    monkeypatch.setattr(common, "import_flashinfer", no_import)
    monkeypatch.setattr(block_jit, "module_spec", no_import)
    b = FlashinferBlockBackend()
    monkeypatch.setattr(common, "flashinfer_version", lambda: "0.7.2.post1")
    assert b.block_reasons(block_problem()) == []
    monkeypatch.setattr(common, "flashinfer_version", lambda: "0.5.3")
    (reason,) = b.block_reasons(block_problem())
    assert "0.5.3" in reason and "came with flashinfer 0.6" in reason
    assert block_jit.version_reason(None) is None and block_jit.version_reason("1.0.0rc1") is None
    # the release segment only: a pre-release of 0.5 is 0.5, not 0.51; a version it cannot read is left to the load
    assert "0.5rc1" in block_jit.version_reason("0.5rc1") and block_jit.version_reason("0.6.0.dev3") is None
    assert block_jit.version_reason("nightly") is None
    # not built anywhere: said without importing flashinfer
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    monkeypatch.setattr(block_jit, "csrc_dir", lambda: tmp_path / "pkg" / "data" / "csrc")
    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "flashinfer_jit_cache" else real(name))
    assert not block_jit.built_library_may_exist()
    note = b.first_use_build(block_problem(), SM90)
    assert note is not None and "not built" in note and "build ahead" in note
    # a library in the JIT cache (or among the AOT modules): flashinfer's own spec decides
    lib = tmp_path / ".cache" / "flashinfer" / "0.7.2" / "90a" / "cached_ops" / block_jit.MODULE_NAME
    lib.mkdir(parents=True)
    (lib / f"{block_jit.MODULE_NAME}.so").write_bytes(b"")
    assert block_jit.built_library_may_exist()
    monkeypatch.setattr(block_jit, "module_spec", lambda: types.SimpleNamespace(is_aot=False, is_compiled=True,
                                                                                 build_dir=str(lib)))
    assert b.first_use_build(block_problem(), SM90) is None


def test_the_flashinfer_version_is_read_once_per_process(monkeypatch: pytest.MonkeyPatch):
    """Resolving a model's block-wise layers asks for it at every problem: reading the metadata each time took 0.9 s
    of an 8-layer checkpoint load (bench/results/checkpoints/2026-12-03-h200-load-profile/)."""
    import importlib.metadata

    calls = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: calls.append(name) or "0.7.2.post1")
    common.reset_caches()
    assert [common.flashinfer_version() for _ in range(5)] == ["0.7.2.post1"] * 5 and calls == [common.DIST_NAME]
    common.reset_caches()

    def missing(name):
        calls.append(name)
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert common.flashinfer_version() is None and common.flashinfer_version() is None and len(calls) == 2


# ------------------------------------------------------------------------------------ availability
def test_unavailable_without_flashinfer(monkeypatch: pytest.MonkeyPatch):
    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "flashinfer" else real(name))
    avail = FlashinferBlockBackend.availability()
    assert not avail.ok and "flashinfer" in avail.reason and avail.install_hint == common.INSTALL_HINT
    entry = next(e for e in discovery.discover("gemm") if e.name == "flashinfer_block")
    assert common.INSTALL_HINT in entry.unusable_reason()
    assert block_jit.csrc_dir() is None and block_jit.missing_sources() == ["flashinfer/data/csrc"]


def test_unavailable_without_cuda_imports_nothing(monkeypatch: pytest.MonkeyPatch):
    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: object() if name == "flashinfer" else real(name))
    monkeypatch.setattr(common, "cuda_present", lambda: False)
    calls = []
    monkeypatch.setattr(common, "import_flashinfer", lambda: calls.append(1) or (None, "x"))
    avail = FlashinferBlockBackend.availability()
    assert not avail.ok and "CUDA" in avail.reason and calls == []


def test_unavailable_without_sources_nvcc_or_feature(monkeypatch: pytest.MonkeyPatch, available):
    assert FlashinferBlockBackend.availability().ok
    monkeypatch.setattr(block_jit, "missing_sources", lambda: ["fp8_blockscale_gemm_sm90_binding.cu", "a", "b", "c"])
    avail = FlashinferBlockBackend.availability()
    assert not avail.ok and "fp8_blockscale_gemm_sm90_binding.cu" in avail.reason and "1 more" in avail.reason
    monkeypatch.setattr(block_jit, "missing_sources", lambda: [])
    monkeypatch.setattr(block_jit, "find_nvcc", lambda: None)
    avail = FlashinferBlockBackend.availability()
    assert not avail.ok and "nvcc" in avail.reason and "CUDA_HOME" in avail.install_hint
    monkeypatch.setattr(block_jit, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(common, "import_flashinfer", lambda: (None, "import flashinfer failed: OSError: libcuda"))
    assert FlashinferBlockBackend.availability().ok  # imports nothing: the import's failure shows where it matters
    b = FlashinferBlockBackend()
    assert "libcuda" in b.supports(None, SM90)[0]  # the listing's general view imports flashinfer
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    assert b.supports(block_problem(), SM90) == []  # not imported yet: loading its module says why it cannot
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    assert "libcuda" in b.supports(block_problem(), SM90)[0]  # imported (by the process, or the listing): the reason
    assert not any("libcuda" in r for r in b.supports(GemmProblem(n=2112, k=7168, m=16), SM90))  # refused by its modes


def test_resolving_a_problem_that_is_not_block_wise_never_imports_flashinfer(monkeypatch: pytest.MonkeyPatch,
                                                                           available):
    """Every GEMM resolution asks each provider's availability: importing flashinfer there (2-4 s) made loading a
    model without block-wise layers seconds slower."""
    calls = []
    monkeypatch.setattr(common, "import_flashinfer", lambda: calls.append(1) or (None, "x"))
    b = FlashinferBlockBackend()
    assert FlashinferBlockBackend.availability().ok and calls == []
    assert b.supports(GemmProblem(n=4096, k=4096, m=1, act_scale="per_token", weight_scale="per_channel"), SM90)
    assert calls == []
    monkeypatch.delitem(sys.modules, "flashinfer", raising=False)
    b.supports(block_problem(), SM90)  # nor a block-wise problem while flashinfer is not imported
    assert calls == []
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    b.supports(block_problem(), SM90)  # once imported, the exact check
    assert calls == [1]


def test_feature_probe_names_what_is_missing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(common, "flashinfer_version", lambda: "0.5.3")
    reason = block_jit.feature_reason(types.SimpleNamespace(gemm=types.SimpleNamespace()))
    assert "0.5.3" in reason and "fp8_blockscale_gemm_sm90" in reason
    assert "fp8_blockscale_gemm_sm90" in block_jit.feature_reason(types.SimpleNamespace())


def test_missing_sources_reads_the_install_tree(monkeypatch: pytest.MonkeyPatch, tmp_path):
    root = tmp_path / "flashinfer"
    monkeypatch.setattr(common, "_find_spec", lambda name: types.SimpleNamespace(submodule_search_locations=[
        str(root)]) if name == "flashinfer" else None)
    assert block_jit.csrc_dir() == root / "data" / "csrc"
    wanted = [*block_jit.MODULE_SOURCES, *(f"{block_jit.DEEPGEMM_INCLUDE}/{h}" for h in block_jit.DEEPGEMM_HEADERS)]
    assert block_jit.missing_sources() == wanted
    for rel in wanted[1:]:
        path = root / "data" / "csrc" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("//")
    assert block_jit.missing_sources() == wanted[:1]


def test_nvcc_and_kernel_cache_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path):
    for var in ("TRTLLM_DG_NVCC_COMPILER", "CUDA_HOME", "TRTLLM_DG_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert block_jit.find_nvcc() is None
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert block_jit.find_nvcc() == str(nvcc)
    monkeypatch.setenv("TRTLLM_DG_NVCC_COMPILER", str(tmp_path / "missing-nvcc"))
    assert block_jit.find_nvcc() is None
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert block_jit.kernel_cache_dir() == tmp_path / "home" / ".tensorrt_llm" / "cache"
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path / "dg"))
    assert block_jit.kernel_cache_dir() == tmp_path / "dg" / "cache"


def test_listing_row(monkeypatch: pytest.MonkeyPatch):
    from fp8_backends import list as listing

    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "flashinfer" else real(name))
    data = listing.collect(cpu_platform())
    row = next(p for p in data["providers"] if (p["kind"], p["name"]) == ("gemm", "flashinfer_block"))
    assert row["available"] is False and row["install_hint"] == common.INSTALL_HINT
    assert row["options"]["warmup"] == ["decode", "off"]
    caps = row["capabilities"]
    assert caps["block_scaled"] is True and caps["group_scale_layout"] == "m_major_tma"
    assert caps["weight_blocks"] == [[128, 128]] and caps["group_sizes"] == [128]
    text = listing.render(data)
    line = next(line for line in text.splitlines() if "flashinfer_block" in line)
    assert "block 128x128 x group 128" in line


# ------------------------------------------------------------------------------------ the DeepGEMM config rule
def test_kernel_config_rule():
    cfg = block_jit.kernel_config
    decode = {cfg(m, 2112, 7168, H200_SMS) for m in range(1, 32)}
    assert len(decode) == 1 and next(iter(decode)) == (True, 128, 16, 8, 1, 152928)
    # wide N: 2 x 144 tiles of 16 tokens would take 3 waves, so M 17..24 / 25..31 take 24 / 32 token tiles
    wide = block_jit.configs_for(block_jit.decode_ms(), 18432, 7168, H200_SMS)
    assert [(c.block_n, m) for c, m in wide.items()] == [(16, 1), (24, 17), (32, 25)]
    assert next(iter(wide)).stages == 8 and list(wide)[1].stages == 6  # 128 % 24 != 0: 6 stages at most
    assert cfg(32, 2112, 7168, H200_SMS)[:3] == (False, 64, 16) and cfg(64, 2112, 7168, H200_SMS).block_m == 64
    assert cfg(65, 2112, 7168, H200_SMS).block_m == 128
    assert cfg(200, 2112, 7168, H200_SMS).block_n == 32  # 2 x 66 tiles: one full wave
    assert cfg(4096, 2112, 7168, H200_SMS).multicast == 1  # 2112 % (2 x BLOCK_N) != 0
    big = cfg(4096, 7168, 7168, H200_SMS)
    assert big.multicast == 2 and not big.swap_ab
    for m in (1, 17, 31, 32, 100, 1000, 5000):
        for n, k in ((576, 7168), (7168, 16384), (24576, 1536), (64, 128)):
            c = cfg(m, n, k, H200_SMS)
            assert 4 <= c.stages <= 8 and 0 < c.smem_bytes <= 232448 and 16 <= c.block_n <= 128


def test_kernel_names_and_disk_cache(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path))
    swap = block_jit.kernel_config(1, 2112, 7168, H200_SMS)
    assert block_jit.kernel_name(swap, 2112, 7168) == "gemm_swapAB_2112_7168_128_16_128_1_81_8_1_Normal"
    normal = block_jit.kernel_config(4096, 7168, 7168, H200_SMS)
    assert block_jit.kernel_name(normal, 7168, 7168).startswith("gemm_7168_7168_128_")
    assert block_jit.kernel_name(normal, 7168, 7168).endswith("_2_Normal")
    assert not block_jit.kernel_cached_on_disk(swap, 2112, 7168)
    folder = tmp_path / "cache" / block_jit.kernel_name(swap, 2112, 7168)
    folder.mkdir(parents=True)
    (folder / "nvcc_kernel.cubin").write_bytes(b"\0")
    assert block_jit.kernel_cached_on_disk(swap, 2112, 7168)
    assert swap.describe() == "swap-AB 128x16 tile, 8 stages"
    assert "2-CTA multicast" in normal.describe()


def test_shape_rules_and_m_lists():
    assert block_jit.shape_reasons(576, 1536) == []
    assert len(block_jit.shape_reasons(96, 200)) == 2
    assert block_jit.parse_ms("1-3, 8,16-17") == [1, 2, 3, 8, 16, 17]
    for bad in ("", "0", "5-2", "x"):
        with pytest.raises(ValueError):
            block_jit.parse_ms(bad)
    assert list(block_jit.decode_ms()) == list(range(1, 32))
    assert block_jit.config_rule_known("0.7.2.post1") and not block_jit.config_rule_known("0.8.0")
    assert not block_jit.config_rule_known(None)


# ------------------------------------------------------------------------------------ the build command
def test_build_command_without_flashinfer(monkeypatch: pytest.MonkeyPatch, capsys):
    from fp8_backends import build

    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "flashinfer" else real(name))
    assert build.main(["flashinfer_block"]) == 2
    assert "flashinfer is not installed" in capsys.readouterr().err
    assert build.main(["flashinfer_block", "--shapes", "7168x7000"]) == 2
    assert "K=7000" in capsys.readouterr().err
    assert build.main(["flashinfer_block", "--shapes", "7168"]) == 2
    assert build.main(["flashinfer_block", "--m", "9-2"]) == 2
    assert "flashinfer_block" in build.BUILDERS


def test_build_command_stops_at_missing_sources_and_nvcc(monkeypatch: pytest.MonkeyPatch, capsys):
    from fp8_backends import build

    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: object() if name == "flashinfer" else real(name))
    monkeypatch.setattr(block_jit, "missing_sources", lambda: ["fp8_blockscale_gemm_sm90_binding.cu"])
    assert build.main(["flashinfer_block"]) == 2
    assert "fp8_blockscale_gemm_sm90_binding.cu" in capsys.readouterr().err
    monkeypatch.setattr(block_jit, "missing_sources", lambda: [])
    monkeypatch.setattr(block_jit, "find_nvcc", lambda: None)
    assert build.main(["flashinfer_block"]) == 2
    assert "nvcc" in capsys.readouterr().err


def test_module_build_is_logged_once_with_its_folder(monkeypatch: pytest.MonkeyPatch, caplog, tmp_path):
    calls = []

    class Spec:
        build_dir = tmp_path / "fp8_blockscale_gemm_90"
        is_aot = False

        def __init__(self, built):
            self.is_compiled = built

        def build_and_load(self):
            calls.append("load")
            return "module"

        def build(self, need_lock=False):
            calls.append(("build", need_lock))

    monkeypatch.setattr(block_jit, "module_spec", lambda: Spec(False))
    with caplog.at_level("INFO", logger="fp8_backends"):
        assert block_jit.build_module() == "module"
        assert block_jit.build_module(load=False) is None
    lines = [r.getMessage() for r in caplog.records]
    assert sum("building flashinfer's fp8_blockscale_gemm_sm90 module (about 2 minutes" in m for m in lines) == 2
    assert all(str(tmp_path) in m for m in lines) and sum(m.startswith("built ") for m in lines) == 2
    assert calls == ["load", ("build", True)]
    caplog.clear()
    monkeypatch.setattr(block_jit, "module_spec", lambda: Spec(True))
    with caplog.at_level("INFO", logger="fp8_backends"):
        assert block_jit.build_module() == "module"
    assert caplog.records == [], "a built module loads silently"


# ------------------------------------------------------------------------------------ the op's host logic (CPU)
torch = pytest.importorskip("torch")


class _FakeDevice:
    """Stands in for block_ops.BlockDevice on the CPU: a runner that checks what the binding assumes and computes
    the reference product."""

    def __init__(self, predictable=True, fail=False):
        self.index, self.num_sms, self.jit, self.predictable, self.kind = -1, H200_SMS, True, predictable, "direct"
        self.calls, self.fail = [], fail

    def run(self, x, w, out, x_scale, w_scale):
        from fp8_backends.core import group_scales, reference

        if self.fail:
            raise RuntimeError("Assertion failed: !cubin.empty() || isPathValid(path_)")
        m, k = x.shape
        assert x.is_contiguous() and w.is_contiguous() and out.is_contiguous() and out.dtype == torch.bfloat16
        assert group_scales.is_layout(x_scale, ScaleLayout.M_MAJOR_TMA) and x_scale.data_ptr() % 16 == 0
        self.calls.append(m)
        out.copy_(reference.fp8_gemm(x, w, x_scale, w_scale, torch.bfloat16))


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch, tmp_path):
    from fp8_backends.providers.flashinfer import _support, block_ops

    monkeypatch.setattr(_support, "capturing", lambda: False)
    monkeypatch.setenv("TRTLLM_DG_CACHE_DIR", str(tmp_path))
    block_ops.reset()

    def install(**kw):
        state = _FakeDevice(**kw)
        monkeypatch.setitem(block_ops._DEVICES, -1, state)
        return state

    yield install
    block_ops.reset()


def _operands(m, n=192, k=256, seed=0):
    from fp8_backends.core import reference

    g = torch.Generator().manual_seed(seed)
    w_q, w_s = reference.quantize_block(torch.randn(n, k, generator=g) / k**0.5)  # the same weight for every M
    x_q, x_s = reference.quantize_per_token_group(torch.randn(m, k, generator=g))
    return x_q, w_q, x_s, w_s, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)


@pytest.mark.parametrize("layout", ["row_major", "m_major", "m_major_tma"])
def test_op_takes_any_scale_layout_and_runs_once_per_shape(fake_device, layout):
    from fp8_backends.core.group_scales import to_layout
    from fp8_backends.providers.flashinfer import block_ops

    state = fake_device()
    x_q, w_q, x_s, w_s, ref = _operands(7)
    y = block_ops._gemm_impl(x_q, w_q, to_layout(x_s, ScaleLayout(layout)), w_s, torch.bfloat16)
    torch.testing.assert_close(y, ref)
    block_ops._gemm_impl(x_q, w_q, x_s, w_s, torch.bfloat16)
    assert state.calls == [7, 7] and list(block_ops.shapes_run()) == ["cuda:-1 M=7 N=192 K=256"]
    assert block_ops._gemm_impl(x_q[:0], w_q, x_s[:0], w_s, torch.bfloat16).shape == (0, 192)
    assert state.calls == [7, 7], "M=0 runs nothing"
    strided = torch.empty(7, 512, dtype=torch.float8_e4m3fn)[:, :256]
    strided.copy_(x_q)
    torch.testing.assert_close(block_ops._gemm_impl(strided, w_q, x_s, w_s, torch.bfloat16), ref)


def test_op_refuses_what_the_kernel_cannot_read(fake_device):
    from fp8_backends.providers.flashinfer import block_ops

    fake_device()
    x_q, w_q, x_s, w_s, _ = _operands(5)
    bad = [
        ((x_q, w_q, x_s, w_s, torch.float16), "bfloat16"),
        ((x_q, w_q, x_s[:, :1], w_s, torch.bfloat16), "x_scale"),
        ((x_q, w_q, x_s.double(), w_s, torch.bfloat16), "x_scale"),
        ((x_q, w_q, x_s, w_s.t(), torch.bfloat16), "w_scale"),
        ((x_q, w_q.t().contiguous().t(), x_s, w_s, torch.bfloat16), "row-major"),
        ((x_q.view(torch.float8_e5m2), w_q, x_s, w_s, torch.bfloat16), "e4m3fn"),
        ((x_q[:, :128].contiguous(), w_q[:96, :128].contiguous(), x_s[:, :1], w_s[:1, :1], torch.bfloat16), "N=96"),
    ]
    for args, match in bad:
        with pytest.raises(InvalidInputError, match=match):
            block_ops._gemm_impl(*args)


def test_first_call_logs_a_compile_and_later_configs_reuse_it(fake_device, caplog, tmp_path):
    from fp8_backends.providers.flashinfer import block_ops

    fake_device()
    x_q, w_q, x_s, w_s, _ = _operands(9)
    with caplog.at_level("INFO", logger="fp8_backends"):
        block_ops._gemm_impl(x_q, w_q, x_s, w_s, torch.bfloat16)
    text = caplog.text
    assert "compiling a DeepGEMM kernel for M=9 N=192 K=256 (swap-AB" in text and str(tmp_path) in text
    assert "compiled the DeepGEMM kernel for M=9" in text
    caplog.clear()
    x_q2, _, x_s2, _, _ = _operands(3)  # same swap-AB config: nothing compiles
    with caplog.at_level("INFO", logger="fp8_backends"):
        block_ops._gemm_impl(x_q2, w_q, x_s2, w_s, torch.bfloat16)
    assert "compiling" not in caplog.text
    assert block_ops.kernel_ready(-1, 20, 192, 256) and not block_ops.kernel_ready(-1, 40, 192, 256)
    # a kernel another process compiled (in DeepGEMM's disk cache) loads without the compile log
    config = block_jit.kernel_config(40, 192, 256, H200_SMS)
    folder = tmp_path / "cache" / block_jit.kernel_name(config, 192, 256)
    folder.mkdir(parents=True)
    (folder / "nvcc_kernel.cubin").write_bytes(b"\0")
    x_q3, _, x_s3, _, _ = _operands(40)
    caplog.clear()
    with caplog.at_level("INFO", logger="fp8_backends"):
        block_ops._gemm_impl(x_q3, w_q, x_s3, w_s, torch.bfloat16)
    assert "compiling" not in caplog.text


def test_capture_refuses_a_kernel_not_run_yet(fake_device, monkeypatch: pytest.MonkeyPatch):
    from fp8_backends.providers.flashinfer import _support, block_ops

    state = fake_device()
    x_q, w_q, x_s, w_s, _ = _operands(1)
    block_ops._gemm_impl(x_q, w_q, x_s, w_s, torch.bfloat16)  # the swap-AB kernel, eagerly
    monkeypatch.setattr(_support, "capturing", lambda: True)
    x_q2, _, x_s2, _, ref2 = _operands(31)
    torch.testing.assert_close(block_ops._gemm_impl(x_q2, w_q, x_s2, w_s, torch.bfloat16), ref2)  # same kernel
    x_q3, _, x_s3, _, _ = _operands(64)
    with pytest.raises(UnsupportedProblemError, match="run this M once eagerly") as info:
        block_ops._gemm_impl(x_q3, w_q, x_s3, w_s, torch.bfloat16)
    assert "M=64 N=192 K=256 (normal 64x16 tile" in str(info.value)
    assert state.calls == [1, 31]
    # a flashinfer whose config rule is not known here: capture needs the exact shape
    block_ops.reset()
    state.predictable = False
    monkeypatch.setattr(_support, "capturing", lambda: False)
    block_ops._gemm_impl(x_q, w_q, x_s, w_s, torch.bfloat16)
    monkeypatch.setattr(_support, "capturing", lambda: True)
    with pytest.raises(UnsupportedProblemError):
        block_ops._gemm_impl(x_q2, w_q, x_s2, w_s, torch.bfloat16)
    block_ops._gemm_impl(x_q, w_q, x_s, w_s, torch.bfloat16)


def test_a_failed_compile_is_a_build_error(fake_device):
    from fp8_backends.providers.flashinfer import block_ops

    fake_device(fail=True)
    x_q, w_q, x_s, w_s, _ = _operands(4)
    with pytest.raises(BuildError, match="nvcc"):
        block_ops._gemm_impl(x_q, w_q, x_s, w_s, torch.bfloat16)
    assert block_ops.shapes_run() == {} and not block_ops.kernel_ready(-1, 4, 192, 256)


def test_warm_up_runs_one_m_per_new_kernel(fake_device, monkeypatch: pytest.MonkeyPatch):
    from fp8_backends.providers.flashinfer import block_ops

    state = fake_device()
    monkeypatch.setattr(block_ops, "device_state", lambda device: state)
    w_q = torch.zeros(18432, 128, dtype=torch.float8_e4m3fn)
    w_s = torch.ones(144, 1)
    ran = block_ops.warm_up(w_q, w_s, block_jit.decode_ms())
    assert [m for m, _, _ in ran] == [1, 17, 25] and state.calls == [1, 17, 25]
    assert ran[1][1] == "swap-AB 128x24 tile, 6 stages"
    assert block_ops.warm_up(w_q, w_s, range(1, 32)) == []
    state.predictable = False
    block_ops.reset()
    assert [m for m, _, _ in block_ops.warm_up(w_q, w_s, [1, 2, 2])] == [1, 2]


def test_prepare_weight_warms_the_decode_kernels(fake_device, monkeypatch: pytest.MonkeyPatch, available):
    from fp8_backends.providers.flashinfer import block_ops

    state = fake_device()
    monkeypatch.setattr(block_ops, "device_state", lambda device: state)
    monkeypatch.setattr(block_ops, "load_module", lambda: None)
    # CPU tensors stand in for the GPU's
    monkeypatch.setattr(FlashinferBlockBackend, "_require_device", lambda self, t, what: None)
    b = FlashinferBlockBackend()
    _, w_q, _, w_s, _ = _operands(1, n=2112, k=256)
    prepared = b.prepare_weight(w_q, w_s)
    assert prepared.block == (128, 128) and prepared.group_size == 128 and prepared.data is w_q
    assert prepared.scale.dtype == torch.float32 and prepared.scale.shape == (17, 2)
    assert state.calls == [1]
    b.prepare_weight(w_q, w_s)
    assert state.calls == [1], "a kernel run once is not warmed again"
    block_ops.reset()
    FlashinferBlockBackend(warmup="off").prepare_weight(w_q, w_s)
    assert state.calls == [1]
    with pytest.raises(InvalidInputError, match="K=320"):
        b.prepare_weight(torch.zeros(2112, 320, dtype=torch.float8_e4m3fn), torch.ones(17, 3))
    with pytest.raises(InvalidInputError, match="N=2080"):
        b.prepare_weight(torch.zeros(2080, 256, dtype=torch.float8_e4m3fn), torch.ones(17, 2))


@pytest.fixture
def fake_flashinfer_modules(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """A stand-in flashinfer (version, JIT env, a built module recording its include folders) for BlockModule."""
    import sys

    from fp8_backends.providers.flashinfer import _support, block_ops

    module = types.SimpleNamespace(includes=[])
    module.set_deepgemm_jit_include_dirs = module.includes.append
    fi = types.SimpleNamespace(gemm=types.SimpleNamespace(fp8_blockscale_gemm_sm90=None))
    jit = types.ModuleType("flashinfer.jit")
    jit.env = types.SimpleNamespace(FLASHINFER_CSRC_DIR=tmp_path / "csrc")
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.jit", jit)
    monkeypatch.setattr(_support, "require_flashinfer", lambda features: fi)
    monkeypatch.setattr(block_jit, "feature_reason", lambda m: None)
    monkeypatch.setattr(block_jit, "build_module", lambda load=True: module)
    monkeypatch.setattr(_support, "capturing", lambda: False)
    monkeypatch.setattr(block_ops, "_MODULE", [])
    return module


def test_module_load_points_deepgemm_at_flashinfers_headers(fake_flashinfer_modules, monkeypatch, caplog, tmp_path):
    from fp8_backends.providers.flashinfer import block_ops

    monkeypatch.setattr(common, "flashinfer_version", lambda: "0.7.2.post1")
    loaded = block_ops.load_module()
    assert loaded.direct and block_ops.load_module() is loaded
    assert fake_flashinfer_modules.includes == [[str(tmp_path / "csrc" / "nv_internal" / "tensorrt_llm")]]
    monkeypatch.setattr(block_ops, "_MODULE", [])
    monkeypatch.setattr(common, "flashinfer_version", lambda: "0.9.0")
    with caplog.at_level("WARNING", logger="fp8_backends"):
        assert not block_ops.load_module().direct
    assert "public function" in caplog.text


def test_a_failed_module_build_makes_the_provider_unavailable(fake_flashinfer_modules, monkeypatch):
    from fp8_backends.core.errors import BackendUnavailableError
    from fp8_backends.providers.flashinfer import block_ops

    def broken(load=True):
        raise RuntimeError("ninja: build stopped: subcommand failed")

    monkeypatch.setattr(block_jit, "build_module", broken)
    monkeypatch.setattr(block_jit, "module_spec", lambda: types.SimpleNamespace(
        is_aot=False, is_compiled=False, build_dir="/jit/fp8_blockscale_gemm_90"))
    with pytest.raises(BackendUnavailableError, match="ninja: build stopped") as info:
        block_ops.load_module()
    assert "/jit/fp8_blockscale_gemm_90" in str(info.value)
    b = FlashinferBlockBackend()
    with pytest.raises(BackendUnavailableError, match="ninja"):
        b.ensure_preloaded()
    assert not FlashinferBlockBackend.cached_availability().ok  # auto passes over it from now on


def test_fake_implementation_and_schema():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_backends.providers.flashinfer import block_ops

    with FakeTensorMode():
        x = torch.empty(5, 256, dtype=torch.float8_e4m3fn, device="cuda")
        w = torch.empty(192, 256, dtype=torch.float8_e4m3fn, device="cuda")
        y = block_ops.gemm_op(x, w, torch.empty(5, 2, device="cuda"), torch.empty(2, 2, device="cuda"),
                              torch.bfloat16)
        assert y.shape == (5, 192) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
    schema = str(block_ops.gemm_op._schema)
    assert schema.startswith("fp8_backends::flashinfer_block_gemm(Tensor x, Tensor w, Tensor x_scale")


def _traced(monkeypatch, call) -> str:
    """The code of the graph(s) ``torch.compile(fullgraph=True)`` makes of ``call(backend, x, prepared, s, bias)`` on
    FakeTensors (only fake implementations run)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_backends.core.types import PreparedWeight
    from fp8_backends.providers.flashinfer import block_ops

    monkeypatch.setattr(block_ops, "load_module", lambda: None)
    b = FlashinferBlockBackend()
    b.preload()
    b._finish_prepare(PreparedWeight(None, None, 1, 1, Fp8Dtype.E4M3FN, WeightScale.BLOCK, b.name))  # hot-path tables
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with FakeTensorMode():
            x = torch.empty(5, 256, dtype=torch.float8_e4m3fn, device="cuda")
            w = torch.empty(192, 256, dtype=torch.float8_e4m3fn, device="cuda")
            prepared = PreparedWeight(w, torch.empty(2, 2, device="cuda"), 192, 256, Fp8Dtype.E4M3FN,
                                      WeightScale.BLOCK, b.name, block=(128, 128), group_size=128)
            bias = torch.empty(192, dtype=torch.bfloat16, device="cuda")
            s = torch.empty_strided((5, 2), (1, 8), device="cuda")  # m_major_tma (slicing fake CUDA needs CUDA)
            y = torch.compile(lambda x, s, bias: call(b, x, prepared, s, bias), fullgraph=True,
                              backend=capture)(x, s, bias)
            assert y.shape == (5, 192) and y.dtype == torch.bfloat16
    finally:
        torch._dynamo.reset()
    return "\n".join(g.code for g in graphs)


def test_fullgraph_trace_of_gemm_impl_over_fake_tensors(monkeypatch: pytest.MonkeyPatch):
    """What a layer's traced plan calls (gemm_impl: the op, then the bias) traces into one graph."""
    code = _traced(monkeypatch, lambda b, x, p, s, bias: b.gemm_impl(x, p, s, torch.bfloat16, bias))
    assert "fp8_backends.flashinfer_block_gemm.default" in code


def test_fullgraph_trace_of_gemm_over_fake_tensors(monkeypatch: pytest.MonkeyPatch):
    """The public gemm (validation, the scale layout, the op, the bias) traces into one graph."""
    code = _traced(monkeypatch, lambda b, x, p, s, bias: b.gemm(x, p, s, bias=bias))
    assert "fp8_backends.flashinfer_block_gemm.default" in code


# ============================================================================================ GPU
# DeepSeek-V3 projections: q_a + kv_a fused (2112x7168), o_proj's K (7168x... as 7168x1536 here to stay quick), a
# ragged N (576 = 4.5 blocks of 128). Each new (N, K) and tile config compiles one DeepGEMM kernel (seconds), and
# the module's first build takes about 2 minutes: the tests share these few shapes.
GPU_SHAPES = [(2112, 7168), (7168, 1536), (576, 7168)]
GPU_MS = [1, 7, 31, 32, 33, 200]


def _gpu_backend(**options) -> FlashinferBlockBackend:
    pytest.importorskip("flashinfer")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"flashinfer's fp8_blockscale_gemm_sm90 needs SM 9.0; this GPU is "
                    f"{torch.cuda.get_device_capability()}")
    avail = FlashinferBlockBackend.availability()
    if not avail.ok:
        pytest.skip(avail.reason)
    missing = FlashinferBlockBackend.feature_reasons()
    if missing:
        pytest.skip(missing[0])
    return FlashinferBlockBackend(**options)


_GPU_WEIGHTS: dict = {}


def _gpu_weight(n: int, k: int):
    from fp8_backends.core import reference

    if (n, k) not in _GPU_WEIGHTS:
        g = torch.Generator(device="cuda").manual_seed(n * 31 + k)
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        _GPU_WEIGHTS[(n, k)] = reference.quantize_block(w)
    return _GPU_WEIGHTS[(n, k)]


def _gpu_act(m: int, k: int, seed: int = 0):
    from fp8_backends.core import reference

    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + m)
    return reference.quantize_per_token_group(torch.randn(m, k, device="cuda", generator=g))


def _rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("nk", GPU_SHAPES, ids=lambda nk: f"{nk[0]}x{nk[1]}")
def test_gpu_matches_reference(nk):
    from fp8_backends.core import reference

    b = _gpu_backend()
    n, k = nk
    w_q, w_s = _gpu_weight(n, k)
    prepared = b.prepare_weight(w_q, w_s)
    for m in GPU_MS:
        x_q, x_s = _gpu_act(m, k)
        y = b.gemm(x_q, prepared, x_s)
        ref = reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert _rel_err(y, ref) < 1e-2, f"M={m} N={n} K={k}: relerr {_rel_err(y, ref):.2e}"


@pytest.mark.gpu
def test_gpu_layouts_bias_and_direct_path():
    from fp8_backends.core import reference
    from fp8_backends.core.group_scales import is_layout, to_layout
    from fp8_backends.providers.flashinfer import block_ops

    b = _gpu_backend()
    n, k = GPU_SHAPES[0]
    w_q, w_s = _gpu_weight(n, k)
    prepared = b.prepare_weight(w_q, w_s.bfloat16())  # checkpoints' bf16 scales: made fp32 once
    x_q, x_s = _gpu_act(33, k, seed=1)  # 33 % 4 != 0: m_major and m_major_tma differ
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = reference.fp8_gemm(x_q, w_q, x_s, w_s.bfloat16().float(), torch.bfloat16, bias)
    for layout in ScaleLayout:
        s = to_layout(x_s, layout)
        assert is_layout(s, layout)
        y = b.gemm(x_q, prepared, s, bias=bias)
        assert _rel_err(y, ref) < 1e-2, f"{layout.value}: {_rel_err(y, ref):.2e}"
    assert set(block_ops.shapes_run().values()) == {"direct"}, block_ops.shapes_run()
    with pytest.raises(InvalidInputError):
        b.gemm(x_q, prepared, x_s, out_dtype="float16")
    with pytest.raises(InvalidInputError):
        b.gemm(x_q[:, :1024].contiguous(), prepared, x_s[:, :8])


@pytest.mark.gpu
def test_gpu_config_rule_names_the_kernels_deepgemm_built():
    """The config rule (kernel_config, kernel_name) against the cubins DeepGEMM's compiler cached on disk for the
    shapes the other tests ran: a mismatch would let a capture compile, or the warm-up miss kernels."""
    b = _gpu_backend()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n, k = GPU_SHAPES[0]
    w_q, w_s = _gpu_weight(n, k)
    prepared = b.prepare_weight(w_q, w_s)
    for m in GPU_MS + [1024]:
        x_q, x_s = _gpu_act(m, k)
        b.gemm(x_q, prepared, x_s)
        config = block_jit.kernel_config(m, n, k, sms)
        assert block_jit.kernel_cached_on_disk(config, n, k), (m, block_jit.kernel_name(config, n, k),
                                                               sorted(p.name for p in
                                                                      block_jit.kernel_cache_dir().glob(f"*_{n}_{k}_*")))


@pytest.mark.gpu
def test_gpu_cuda_graph_after_warm_up():
    from fp8_backends.core import reference

    b = _gpu_backend()
    n, k = GPU_SHAPES[1]
    w_q, w_s = _gpu_weight(n, k)
    prepared = b.prepare_weight(w_q, w_s)  # warms the decode kernels: any M < 32 captures without an eager call
    x_q, x_s = _gpu_act(5, k, seed=2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = b.gemm(x_q, prepared, x_s)
    g.replay()
    torch.cuda.synchronize()
    assert _rel_err(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16)) < 1e-2
    new_x, new_s = _gpu_act(5, k, seed=3)  # replay reads the captured buffers
    x_q.copy_(new_x)
    x_s.copy_(new_s)
    g.replay()
    torch.cuda.synchronize()
    assert _rel_err(y, reference.fp8_gemm(new_x, w_q, new_s, w_s, torch.bfloat16)) < 1e-2
    big_x, big_s = _gpu_act(3000, k, seed=4)  # a normal-family config no test ran on this weight
    g2 = torch.cuda.CUDAGraph()
    with pytest.raises(UnsupportedProblemError, match="eagerly"), torch.cuda.graph(g2):
        b.gemm(big_x, prepared, big_s)
    torch.cuda.synchronize()
    eager = b.gemm(big_x, prepared, big_s)  # eagerly it compiles, then a capture of it works
    g3 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g3):
        y3 = b.gemm(big_x, prepared, big_s)
    g3.replay()
    torch.cuda.synchronize()
    assert torch.equal(y3, eager)


@pytest.mark.gpu
def test_gpu_model_warm_up_lets_a_capture_run_kernels_built_at_first_call():
    """``fp8_backends.warm_up`` on a model whose layer runs flashinfer_block: a capture at an M >= 32 that never ran
    (its DeepGEMM kernel compiles at its first call; a weight shape no other test uses, so no disk cache has it) is
    refused with the advice, and works after ``warm_up``, giving the eager output."""
    from torch import nn

    from fp8_backends import warm_up
    from fp8_backends.layers import Fp8Linear

    _gpu_backend()
    n, k, m = 320, 1408, 96
    g = torch.Generator(device="cuda").manual_seed(5)
    lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, device="cuda", generator=g) / k**0.5)
    model = nn.Sequential(Fp8Linear.from_linear(lin, weight_scale="block", backend="flashinfer_block"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    with torch.no_grad():
        g1 = torch.cuda.CUDAGraph()
        with pytest.raises(UnsupportedProblemError, match="warm_up"), torch.cuda.graph(g1):
            model(x)
        torch.cuda.synchronize()
        assert warm_up(model, [m, 1]) == 2
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            y = model(x)
        g2.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, model(x))


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    from fp8_backends.core import reference
    from fp8_backends.core.group_scales import to_layout

    b = _gpu_backend()
    n, k = GPU_SHAPES[0]
    w_q, w_s = _gpu_weight(n, k)
    prepared = b.prepare_weight(w_q, w_s)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    # what a layer's traced plan runs: the quantizer's scales already in m_major_tma, then gemm_impl
    fn = torch.compile(lambda x, s: b.gemm_impl(x, prepared, s, torch.bfloat16, bias), fullgraph=True)
    for m in (7, 200):
        x_q, x_s = _gpu_act(m, k, seed=5)
        x_s = to_layout(x_s, ScaleLayout.M_MAJOR_TMA)
        y = fn(x_q, x_s)
        assert _rel_err(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16, bias)) < 1e-2
        assert torch.equal(y, b.gemm(x_q, prepared, x_s, bias=bias))
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_no_host_sync_after_the_first_call():
    b = _gpu_backend()
    n, k = GPU_SHAPES[0]
    w_q, w_s = _gpu_weight(n, k)
    prepared = b.prepare_weight(w_q, w_s)
    for m in (7, 200):
        x_q, x_s = _gpu_act(m, k, seed=6)
        b.gemm(x_q, prepared, x_s)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            b.gemm(x_q, prepared, x_s)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_build_command_lists_and_builds_kernels(tmp_path, capsys):
    """``python -m fp8_backends.build flashinfer_block``: the module (built by the tests before: no rebuild), the
    kernels of a shape for a list of M (one compile per distinct config), then the same list cached."""
    import json

    from fp8_backends import build

    _gpu_backend()
    n, k = GPU_SHAPES[0]
    assert build.main(["flashinfer_block", "--shapes", f"{n}x{k}", "--m", "1-40", "--list"]) == 0
    listed = capsys.readouterr().out
    assert f"N={n} K={k} from M=1:" in listed and f"N={n} K={k} from M=32:" in listed
    report = tmp_path / "r.json"
    assert build.main(["flashinfer_block", "--shapes", f"{n}x{k}", "--m", "1-40", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert all(kernel.get("ok", True) for kernel in data["kernels"])
    assert build.main(["flashinfer_block", "--shapes", f"{n}x{k}", "--m", "1-40", "--list"]) == 0
    assert "not built" not in capsys.readouterr().out
