"""The ``cutlass`` provider: build cache, toolchain discovery, dispatch table, capabilities (CPU); one real
nvcc compile (``-m build --run-build``); correctness, scale modes, graphs, torch.compile and concurrent
builds on an SM90 GPU (``-m gpu``).

CPU tests drive the build logic with a fake nvcc (a small Python script) and fake CUTLASS headers, so they
need neither a CUDA toolkit nor the nvidia-cutlass wheel.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp8_backends.core.errors import BuildError, InvalidInputError
from fp8_backends.core.types import ActScale, GemmProblem, OutDtype, WeightScale
from fp8_backends.providers.cutlass import build, configs
from fp8_backends.providers.cutlass.backend import CutlassSm90Backend
from fp8_backends.providers.cutlass.configs import CONFIGS, DEFAULT_TABLE, DispatchTable, KernelConfig
from fp8_backends.registry.platform import simulate_platform
from fp8_backends.testing import GemmProviderContract

REPO = Path(__file__).resolve().parents[1]

FAKE_NVCC = textwrap.dedent(
    """\
    import os, sys, time, pathlib
    args = sys.argv[1:]
    if "--version" in args:
        print("nvcc: NVIDIA (R) Cuda compiler driver")
        print("Cuda compilation tools, release 12.8, V" + os.environ.get("FAKE_NVCC_VERSION", "12.8.93"))
        sys.exit(0)
    counter = os.environ.get("FAKE_NVCC_COUNTER")
    if counter:
        with open(counter, "a") as f:
            f.write(" ".join(a for a in args if a.startswith("-DFP8B_CONFIG_NAME")) + "\\n")
    time.sleep(float(os.environ.get("FAKE_NVCC_SLEEP", "0")))
    if os.environ.get("FAKE_NVCC_FAIL"):
        print("fp8_gemm_sm90.cu(42): error: fake compiler failure for the test", file=sys.stderr)
        sys.exit(2)
    pathlib.Path(args[args.index("-o") + 1]).write_bytes(b"not a real shared library")
    """
)


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    """A fake nvcc under $CUDA_HOME/bin, fake CUTLASS 4.2.0 headers, an empty cache; returns paths."""
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text(f"#!{sys.executable}\n" + FAKE_NVCC)
    nvcc.chmod(0o755)
    cut = tmp_path / "cutlass"
    (cut / "include" / "cutlass").mkdir(parents=True)
    (cut / "include" / "cutlass" / "cutlass.h").write_text("// fake\n")
    (cut / "include" / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n"
    )
    (cut / "tools" / "util" / "include" / "cutlass" / "util").mkdir(parents=True)
    (cut / "tools" / "util" / "include" / "cutlass" / "util" / "packed_stride.hpp").write_text("// fake\n")
    cache = tmp_path / "cache"
    counter = tmp_path / "nvcc_calls.txt"
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    monkeypatch.setenv(build.CUTLASS_DIR_ENV, str(cut))
    monkeypatch.setenv(build.CACHE_ENV, str(cache))
    monkeypatch.setenv("FAKE_NVCC_COUNTER", str(counter))
    monkeypatch.delenv("FAKE_NVCC_FAIL", raising=False)
    monkeypatch.delenv(configs.TABLE_ENV, raising=False)
    build.forget_failures()
    build._loaded.clear()
    yield {"nvcc": nvcc, "cutlass": cut, "cache": cache, "counter": counter, "tmp": tmp_path}
    build.forget_failures()
    build._loaded.clear()


def _calls(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


SPEC = build.LibrarySpec("ws64x16_swap")


# ------------------------------------------------------------------------------------ packaging
def test_both_kernel_sources_encode_tma_descriptors_through_the_cached_entry_point(monkeypatch, tmp_path):
    """CUTLASS looks the driver's cuTensorMapEncodeTiled up by name at every TMA descriptor it encodes (several per
    GEMM call) unless told to call it directly; ``tma_encode.cuh`` maps that direct call to one looked up once. Both
    kernel sources include it before any CUTLASS header, and it is part of both libraries' keys (a change to it
    rebuilds them)."""
    header = (build.HERE / "tma_encode.cuh").read_text()
    assert "#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL 1" in header
    assert "#define cuTensorMapEncodeTiled fp8b_encode_tiled" in header
    assert "static const fp8b_tma::EncodeTiledFn encode" in header  # looked up once
    for files in (build.SOURCE_FILES, build.BLOCK_SOURCE_FILES):
        assert files[0].endswith(".cu") and "tma_encode.cuh" in files[1:]  # nvcc compiles the first
        src = (build.HERE / files[0]).read_text()
        first_cutlass = min(src.index(h) for h in ('#include "cute/', '#include "cutlass/'))
        assert src.index('#include "tma_encode.cuh"') < first_cutlass, files[0]
    for name in {*build.SOURCE_FILES, *build.BLOCK_SOURCE_FILES}:
        (tmp_path / name).write_bytes((build.HERE / name).read_bytes())
    before = build.source_hash(build.SOURCE_FILES), build.source_hash(build.BLOCK_SOURCE_FILES)
    monkeypatch.setattr(build, "HERE", tmp_path)
    assert (build.source_hash(build.SOURCE_FILES), build.source_hash(build.BLOCK_SOURCE_FILES)) == before
    (tmp_path / "tma_encode.cuh").write_text(header + "\n// changed\n")
    after = build.source_hash(build.SOURCE_FILES), build.source_hash(build.BLOCK_SOURCE_FILES)
    assert after[0] != before[0] and after[1] != before[1]


def test_kernel_source_ships_as_package_data():
    src = REPO / "providers" / "cutlass" / "fp8_gemm_sm90.cu"
    assert (build.HERE / build.SOURCE_FILES[0]).read_bytes() == src.read_bytes()
    pyproject = (REPO / "pyproject.toml").read_text()
    assert '"**/*.cu"' in pyproject
    assert 'cutlass = "fp8_backends.providers.cutlass.backend:CutlassSm90Backend"' in pyproject


# ------------------------------------------------------------------------------------ configs and dispatch
def test_every_config_is_valid_and_named_uniquely():
    assert len(configs.CONFIG_NAMES) == len(set(configs.CONFIG_NAMES)) >= 6
    for cfg in configs.CONFIG_LIST:
        d = cfg.defines()
        assert d["FP8B_STREAM_K"] == "0" or cfg.schedule == "cooperative"
        assert cfg.schedule != "cooperative" or cfg.tile[0] >= 128
    assert any(c.swap_ab for c in configs.CONFIG_LIST), "needs small-M (swapped) configs"
    assert any(c.stream_k for c in configs.CONFIG_LIST)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"schedule": "cooperative", "tile": (64, 128, 128)}, "tile M >= 128"),
        ({"schedule": "pingpong", "tile": (128, 128, 128), "stream_k": True}, "stream-K"),
        ({"schedule": "warp", "tile": (128, 128, 128)}, "schedule"),
        ({"schedule": "ws", "tile": (64, 12, 128)}, "wgmma"),
    ],
)
def test_invalid_configs_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KernelConfig("bad", **kwargs)


def test_default_table_picks_by_m_bucket():
    t = DEFAULT_TABLE
    assert t.config_names() <= set(CONFIGS)
    for (n, k), buckets in [((8192, 8192), t.default), *t.shapes.items()]:
        assert t.buckets_for(n, k) == buckets
        for (bound, name), (_, next_name) in zip(buckets, buckets[1:]):
            assert t.pick(bound, n, k) == name  # bounds are inclusive
            assert t.pick(bound + 1, n, k) == next_name
        assert t.pick(0, n, k) == buckets[0][1]
        assert t.pick(10**7, n, k) == buckets[-1][1]
    # decode picks a swapped small-M config, prefill a non-swapped one
    assert CONFIGS[t.pick(1, 8192, 8192)].swap_ab and not CONFIGS[t.pick(8192, 8192, 8192)].swap_ab


def test_table_per_shape_override_and_json_round_trip(tmp_path, monkeypatch):
    table = DispatchTable(
        default=((64, "ws64x64_swap"), (None, "coop128x256_c2x1")),
        shapes={(4096, 14336): ((16, "sk128x16_swap"), (None, "pp128x128_c2x1"))},
        source="test",
    )
    assert table.pick(8, 4096, 14336) == "sk128x16_swap"
    assert table.pick(17, 4096, 14336) == "pp128x128_c2x1"
    assert table.pick(8, 4096, 4096) == "ws64x64_swap"
    assert table.pick(65, 6144, 4096) == "coop128x256_c2x1"
    again = DispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.to_json() == table.to_json()
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table.to_json()))
    monkeypatch.setenv(configs.TABLE_ENV, str(path))
    assert configs.active_table().pick(8, 4096, 14336) == "sk128x16_swap"
    monkeypatch.delenv(configs.TABLE_ENV)
    assert configs.active_table() is DEFAULT_TABLE


@pytest.mark.parametrize(
    "default, match",
    [
        ([[16, "nope"], [None, "ws64x16_swap"]], "unknown config"),
        ([[64, "ws64x16_swap"], [16, "ws64x64_swap"], [None, "ws64x64_swap"]], "increase"),
        ([[64, "ws64x16_swap"]], "last bucket"),
        ([[None, "ws64x16_swap"], [None, "ws64x64_swap"]], "only the last"),
    ],
)
def test_bad_tables_refused(default, match):
    with pytest.raises(ValueError, match=match):
        DispatchTable.from_json({"default": default})


def test_broken_table_file_makes_provider_unavailable(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text('{"default": [[1, "nope"]]}')
    monkeypatch.setenv(configs.TABLE_ENV, str(path))
    avail = CutlassSm90Backend.availability()
    assert not avail.ok and "invalid CUTLASS dispatch table" in avail.reason


# ------------------------------------------------------------------------------------ library specs / ABI
def test_spec_defines_and_names():
    spec = build.LibrarySpec("sk128x64_swap", "rowwise", "float32", False)
    d = spec.defines()
    assert d["FP8B_EPILOGUE"] == "1" and d["FP8B_OUT"] == "2" and d["FP8B_FAST_ACCUM"] == "0"
    assert d["FP8B_SWAP_AB"] == "1" and d["FP8B_STREAM_K"] == "1" and d["FP8B_SCHEDULE"] == "2"
    assert d["FP8B_CONFIG_NAME"] == '"sk128x64_swap"'
    assert spec.name == "fp8b_sm90a_sk128x64_swap_rowwise_fp32_precise"
    assert spec.describe_expected() == "sk128x64_swap;swap=1;epilogue=1;out=2;fast_accum=0"
    with pytest.raises(ValueError, match="SM100"):
        build.LibrarySpec("ws64x16_swap", arch="100a")
    with pytest.raises(ValueError, match="unknown CUTLASS config"):
        build.LibrarySpec("nope")


def test_source_uses_every_macro_the_specs_define():
    src = (build.HERE / build.SOURCE_FILES[0]).read_text()
    for macro in build.LibrarySpec("ws64x16_swap").defines():
        assert f"defined({macro})" in src, macro


_C_TO_CTYPES = {
    "const void*": ctypes.c_void_p,
    "void*": ctypes.c_void_p,
    "const float*": ctypes.c_void_p,
    "int64_t": ctypes.c_int64,
    "int": ctypes.c_int,
    "size_t": ctypes.c_size_t,
}


def _c_params(src: str, func: str) -> list[str]:
    match = re.search(rf"FP8B_EXPORT \w+ {func}\(([^)]*)\)", src)
    assert match, func
    params = [" ".join(p.split()) for p in match.group(1).split(",")]
    return [p.rsplit(" ", 1)[0].replace(" *", "*") for p in params]


def test_ctypes_signature_matches_the_c_source():
    src = (build.HERE / build.SOURCE_FILES[0]).read_text()
    gemm = _c_params(src, "fp8b_gemm")
    assert [_C_TO_CTYPES[t] for t in gemm] == list(build.GEMM_ARGTYPES)
    assert re.search(r"FP8B_EXPORT int fp8b_gemm\(", src) and build.GEMM_RESTYPE is ctypes.c_int
    ws = _c_params(src, "fp8b_workspace_size")
    assert [_C_TO_CTYPES[t] for t in ws] == list(build.WORKSPACE_ARGTYPES)
    assert re.search(r"FP8B_EXPORT size_t fp8b_workspace_size\(", src)
    assert f"#define FP8B_ABI_VERSION {build.ABI_VERSION}" in src
    codes = dict(re.findall(r"FP8B_ERR_\w+ = (\d+),\s*// (.*)", src))
    assert {int(k) for k in codes} == set(build.RETURN_CODES)


# ------------------------------------------------------------------------------------ toolchain discovery
def test_nvcc_found_through_cuda_home_then_path(fake_env, monkeypatch, tmp_path):
    assert build.find_nvcc() == str(fake_env["nvcc"])
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(fake_env["nvcc"].parent))
    assert build.find_nvcc() == str(fake_env["nvcc"])
    assert build.nvcc_version(str(fake_env["nvcc"])) == "12.8.93"


def test_nvcc_found_in_the_nvidia_wheel(monkeypatch, tmp_path):
    root = tmp_path / "site" / "nvidia"
    (root / "cuda_nvcc" / "bin").mkdir(parents=True)
    nvcc = root / "cuda_nvcc" / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(build, "_nvidia_wheel_roots", lambda: [root])
    assert build.find_nvcc() == str(nvcc)


def test_no_nvcc_makes_provider_unavailable(fake_env, monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(build, "_nvidia_wheel_roots", lambda: [])
    monkeypatch.setattr(build, "DEFAULT_NVCC", tmp_path / "none" / "nvcc")
    assert build.find_nvcc() is None
    avail = CutlassSm90Backend.availability()
    assert not avail.ok and "nvcc not found" in avail.reason and avail.install_hint
    with pytest.raises(BuildError, match="nvcc not found"):
        build.get_library(SPEC)
    assert _calls(fake_env["counter"]) == 0


def test_no_headers_makes_provider_unavailable(fake_env, monkeypatch, tmp_path):
    monkeypatch.setenv(build.CUTLASS_DIR_ENV, str(tmp_path / "nowhere"))
    monkeypatch.setattr(build, "_cutlass_library_roots", lambda: [])
    assert build.find_cutlass() is None
    avail = CutlassSm90Backend.availability()
    assert not avail.ok and "CUTLASS headers not found" in avail.reason
    with pytest.raises(BuildError, match="CUTLASS headers"):
        build.get_library(SPEC)


def test_a_cutlass_dir_without_headers_is_named_when_the_wheel_s_serve(monkeypatch, tmp_path, fake_env, caplog):
    """``FP8_BACKENDS_CUTLASS_DIR`` naming no CUTLASS tree while the wheel's headers are there: the build uses the
    wheel's, and says once that the user's folder was passed over."""
    import logging

    pkg = tmp_path / "site" / "cutlass_library"
    (pkg / "source").mkdir(parents=True)
    os.symlink(fake_env["cutlass"] / "include", pkg / "source" / "include")
    os.symlink(fake_env["cutlass"] / "tools", pkg / "source" / "tools")
    monkeypatch.setenv(build.CUTLASS_DIR_ENV, str(tmp_path / "typo"))
    monkeypatch.setattr(build, "_cutlass_library_roots", lambda: [pkg])
    monkeypatch.setattr(build, "_WARNED_DIRS", set())
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        assert build.find_cutlass()[0] == pkg / "source" / "include"
        build.find_cutlass()
    assert caplog.text.count(f"{build.CUTLASS_DIR_ENV}={tmp_path / 'typo'} holds no CUTLASS source tree") == 1


def test_headers_found_in_the_cutlass_wheel_layout(monkeypatch, tmp_path, fake_env):
    pkg = tmp_path / "site" / "cutlass_library"
    (pkg / "source").mkdir(parents=True)
    os.symlink(fake_env["cutlass"] / "include", pkg / "source" / "include")
    os.symlink(fake_env["cutlass"] / "tools", pkg / "source" / "tools")
    monkeypatch.delenv(build.CUTLASS_DIR_ENV)
    monkeypatch.setattr(build, "_cutlass_library_roots", lambda: [pkg])
    inc, util = build.find_cutlass()
    assert inc == pkg / "source" / "include" and build.cutlass_version(inc) == "4.2.0"


def test_availability_runs_nothing_and_says_not_built(fake_env):
    avail = CutlassSm90Backend.availability()
    assert avail.ok
    assert "not built yet" in avail.reason and "python -m fp8_backends.build cutlass" in avail.reason
    assert re.search(r"~\d+ s", avail.reason)
    assert _calls(fake_env["counter"]) == 0  # neither a compile nor nvcc --version
    assert not fake_env["cache"].exists()


# ------------------------------------------------------------------------------------ cache keys
def test_cache_key_depends_on_source_arch_nvcc_cutlass_and_config():
    base = {"src_hash": "a" * 64, "nvcc_ver": "13.0.88", "cutlass_ver": "4.2.0"}
    k0 = build.library_key(SPEC, **base)
    assert k0 == build.library_key(build.LibrarySpec("ws64x16_swap"), **base)
    assert k0 != build.library_key(SPEC, **{**base, "src_hash": "b" * 64})
    assert k0 != build.library_key(SPEC, **{**base, "nvcc_ver": "13.0.89"})
    assert k0 != build.library_key(SPEC, **{**base, "cutlass_ver": "4.3.0"})
    assert k0 != build.library_key(build.LibrarySpec("ws64x64_swap"), **base)
    assert k0 != build.library_key(build.LibrarySpec("ws64x16_swap", out_dtype="float16"), **base)
    assert k0 != build.library_key(build.LibrarySpec("ws64x16_swap", fast_accum=False), **base)
    material = build.key_material(SPEC, **base)
    assert material["arch"] == "90a" and "-gencode" not in " ".join(material["flags"])


def test_source_hash_tracks_the_kernel_source(monkeypatch, tmp_path):
    h0 = build.source_hash()
    for name in build.SOURCE_FILES:
        (tmp_path / name).write_bytes((build.HERE / name).read_bytes())
    copy = tmp_path / build.SOURCE_FILES[0]
    copy.write_bytes((build.HERE / build.SOURCE_FILES[0]).read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(build, "HERE", tmp_path)
    assert build.source_hash() != h0


def test_compile_command(fake_env):
    tc = build.get_toolchain()
    cmd = build.compile_command(build.LibrarySpec("coop128x256_c2x1", "rowwise"), tc, Path("/tmp/x.so"))
    assert cmd[0] == str(fake_env["nvcc"])
    for flag in ("-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3", "--expt-relaxed-constexpr",
                 "-shared", "--cudart=static", "-Xcompiler=-fPIC", "-DFP8B_EPILOGUE=1", "-DFP8B_TILE_N=256",
                 '-DFP8B_CONFIG_NAME="coop128x256_c2x1"', f"-I{fake_env['cutlass'] / 'include'}"):
        assert flag in cmd, flag
    assert cmd[-2:] == ["-o", "/tmp/x.so"]
    assert not any("torch" in part for part in cmd)


# ------------------------------------------------------------------------------------ builds (fake nvcc)
def test_build_once_then_reuse_the_cache(fake_env):
    path = build.build_library(SPEC)
    assert path.is_file() and path.parent.parent == fake_env["cache"]
    assert _calls(fake_env["counter"]) == 1
    assert build.build_library(SPEC) == path
    assert _calls(fake_env["counter"]) == 1  # no rebuild
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["material"]["nvcc"] == "12.8.93" and manifest["material"]["cutlass"] == "4.2.0"
    assert (path.parent / "build.log").read_text().startswith("$ ")
    assert build.locate(SPEC) == path
    assert build.build_library(SPEC, force=True) == path
    assert _calls(fake_env["counter"]) == 2


def test_new_nvcc_version_rebuilds(fake_env, monkeypatch):
    first = build.build_library(SPEC)
    monkeypatch.setenv("FAKE_NVCC_VERSION", "12.9.41")
    os.utime(fake_env["nvcc"], (1, 1))  # new mtime: the version cache re-runs nvcc --version
    second = build.build_library(SPEC)
    assert second != first and _calls(fake_env["counter"]) == 2


def test_prebuilt_library_used_without_nvcc(fake_env, monkeypatch, tmp_path):
    path = build.build_library(SPEC)
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(build, "_nvidia_wheel_roots", lambda: [])
    monkeypatch.setattr(build, "DEFAULT_NVCC", tmp_path / "none" / "nvcc")
    assert build.find_nvcc() is None
    assert build.locate(SPEC) == path
    st = build.status([SPEC])
    assert st.ok and st.built == 1 and not st.missing


def test_failed_build_reports_log_and_makes_provider_unavailable(fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(BuildError) as info:
        build.get_library(SPEC)
    log = info.value.log_path
    assert log and Path(log).is_file() and "fake compiler failure" in Path(log).read_text()
    assert "fake compiler failure" in str(info.value) and log in str(info.value)
    assert build.locate(SPEC) is None
    calls = _calls(fake_env["counter"])
    with pytest.raises(BuildError):  # remembered: no second compile in this process
        build.get_library(SPEC)
    assert _calls(fake_env["counter"]) == calls
    avail = CutlassSm90Backend.availability()
    assert not avail.ok and "failed" in avail.reason and log in avail.reason


def test_build_many_reports_each_failure(fake_env, monkeypatch):
    specs = build.specs_for(["ws64x16_swap", "ws64x64_swap"], ("tensor", "rowwise"))
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    results = build.build_many(specs, jobs=2)
    assert set(results) == set(specs) and all(isinstance(r, BuildError) for r in results.values())
    monkeypatch.delenv("FAKE_NVCC_FAIL")
    results = build.build_many(specs, jobs=2)
    assert all(isinstance(r, Path) and r.is_file() for r in results.values())
    assert _calls(fake_env["counter"]) == 8


def test_unloadable_library_is_a_build_error(fake_env):
    with pytest.raises(BuildError, match="cannot load"):
        build.get_library(SPEC)  # the fake compiler writes a file that is not a shared library


def test_parallel_processes_build_once(fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "1.5")
    code = (
        "from fp8_backends.providers.cutlass import build; "
        "print(build.build_library(build.LibrarySpec('ws64x16_swap')))"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd="/") for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o[0].strip() for o in outs}
    assert len(paths) == 1 and Path(paths.pop()).is_file()
    assert _calls(fake_env["counter"]) == 1


def test_cli_builds_lists_and_refuses_other_archs(fake_env, tmp_path):
    env = {**os.environ}
    run = lambda *a: subprocess.run([sys.executable, "-m", "fp8_backends.build", *a], capture_output=True,  # noqa: E731
                                    text=True, env=env, cwd="/")
    bad = run("cutlass", "--arch", "100a")
    assert bad.returncode == 2 and "SM100" in bad.stderr
    assert run("cutlass", "--config", "nope").returncode == 2
    assert run("nothing").returncode == 2
    report = tmp_path / "r.json"
    ok = run("cutlass", "--arch", "90a", "--config", "ws64x16_swap,ws64x64_swap", "--epilogue", "tensor",
             "--out-dtype", "bf16,fp32", "--jobs", "2", "--json", str(report))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert _calls(fake_env["counter"]) == 4
    data = json.loads(report.read_text())
    assert len(data["libraries"]) == 4 and all(lib["ok"] for lib in data["libraries"])
    listing = run("cutlass", "--config", "ws64x16_swap", "--epilogue", "tensor", "--list")
    assert listing.returncode == 0 and "cached" in listing.stdout
    env["FAKE_NVCC_FAIL"] = "1"
    failed = run("cutlass", "--config", "ws64x16_swap", "--epilogue", "rowwise")
    assert failed.returncode == 1 and "build.log" in failed.stdout


# ------------------------------------------------------------------------------------ capabilities
def test_capabilities_and_refusals():
    b = CutlassSm90Backend()
    h100 = simulate_platform("9.0")
    assert b.supports(GemmProblem(n=4096, k=4096, m=16), h100) == [] or not CutlassSm90Backend.availability().ok
    caps = CutlassSm90Backend.capabilities
    assert caps.check(GemmProblem(n=4096, k=4096, act_scale=ActScale.PER_TOKEN,
                                  weight_scale=WeightScale.PER_CHANNEL, out_dtype=OutDtype.FP32,
                                  has_bias=True), h100) == []
    for sm in ("8.9", "10.0", "12.0"):
        reasons = caps.check(GemmProblem(n=4096, k=4096), simulate_platform(sm))
        assert reasons and "9.0a" in reasons[0]
    assert any("e5m2" in r for r in caps.check(GemmProblem(n=64, k=64, input_dtype="e5m2",
                                                           weight_dtype="e5m2"), h100))
    assert any("N=40" in r for r in caps.check(GemmProblem(n=40, k=64), h100))
    assert any("K=24" in r for r in caps.check(GemmProblem(n=64, k=24), h100))
    assert caps.priority < 10  # below torch_scaled_mm until benchmarks say otherwise
    assert "SM100" in (CutlassSm90Backend.__doc__ or "") + (sys.modules[CutlassSm90Backend.__module__].__doc__ or "")


def test_options():
    assert CutlassSm90Backend().config == {"config": "auto", "fast_accum": "true", "fused_quant": "true"}
    b = CutlassSm90Backend(config="ws64x16_swap", fast_accum="false", fused_quant="false")
    assert b.label == "cutlass[config=ws64x16_swap,fast_accum=false,fused_quant=false]"
    with pytest.raises(InvalidInputError):
        CutlassSm90Backend(config="nope")
    from fp8_backends.providers.cutlass.block_configs import BLOCK_CONFIG_NAMES

    assert set(CutlassSm90Backend.options["config"]) == {"auto", *CONFIGS, *BLOCK_CONFIG_NAMES}
    from fp8_backends.tuning.workloads import option_combos

    # the tuner times every config by name; the block-scaled ones refuse the other problems (extra_reasons)
    assert option_combos(CutlassSm90Backend) == [{"config": name}
                                                 for name in (*configs.CONFIG_NAMES, *BLOCK_CONFIG_NAMES)]


def test_custom_op_schema_and_fake_implementation():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_backends.providers.cutlass import ops

    ops.load_op()
    schema = str(torch.ops.fp8_backends.cutlass_sm90_gemm.default._schema)
    assert "Tensor? bias" in schema and "ScalarType out_dtype" in schema and "str config" in schema
    with FakeTensorMode():
        x = torch.empty(5, 64, dtype=torch.float8_e4m3fn, device="cuda")
        w = torch.empty(32, 64, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(1, device="cuda")
        y = ops.cutlass_gemm(x, w, s, s, None, torch.float16, "auto", True)
    assert tuple(y.shape) == (5, 32) and y.dtype == torch.float16 and y.device.type == "cuda"


def test_bench_summary_builds_a_loadable_table(monkeypatch):
    """bench/cutlass_configs.py turns measurements into a table DispatchTable accepts (synthetic numbers)."""
    monkeypatch.syspath_prepend(str(REPO))  # bench/ is a folder of the repository, not an installed package
    bc = importlib.import_module("bench.cutlass_configs")
    names = list(configs.CONFIG_NAMES)
    rows = []
    for n, k in bc.SHAPES:
        for m in bc.MS:
            res = {label: {"median_us": 10.0, "error": None, "relerr": 2e-3}
                   for label in (bc.sweep.TORCH, bc.sweep.TORCH_FA, *(bc.PREFIX + c for c in names))}
            fastest = names[(m + n) % (len(names) - 1)]  # never names[-1], the wrong one
            res[bc.PREFIX + fastest]["median_us"] = 5.0
            res[bc.PREFIX + names[-1]]["relerr"] = 0.5  # a wrong result never wins
            res[bc.PREFIX + names[-1]]["median_us"] = 1.0
            rows.append({"n": n, "k": k, "m": m, "n_sets": 2, "results": res})
    summary = bc.summarize(rows, names, bc.MS, bc.SHAPES)
    table = DispatchTable.from_json(json.loads(bc._table_text(summary["table"])))
    for n, k in bc.SHAPES:
        for m in bc.MS:
            assert table.pick(m, n, k) == names[(m + n) % (len(names) - 1)]
    assert summary["ratio_best_per_point"]["M>=4096"]["geomean"] == 2.0


def test_library_for_picks_config_and_builds_the_family_once(monkeypatch):
    torch = pytest.importorskip("torch")
    from fp8_backends.providers.cutlass import ops

    calls = []
    fake_loaded: dict = {}

    def fake_get(spec, also=()):
        calls.append((spec, list(also)))
        fake_loaded[spec] = f"lib:{spec.name}"
        return fake_loaded[spec]

    monkeypatch.setattr(build, "loaded", lambda spec: fake_loaded.get(spec))
    monkeypatch.setattr(build, "get_library", fake_get)
    spec, lib = ops.library_for(1, 4096, 4096, False, torch.bfloat16, "auto", True)
    assert spec == build.LibrarySpec(DEFAULT_TABLE.pick(1, 4096, 4096), "tensor", "bfloat16", True)
    assert lib == f"lib:{spec.name}" and len(calls) == 1
    family = calls[0][1]
    assert {s.config for s in family} == DEFAULT_TABLE.config_names()
    assert all(s.epilogue == "tensor" and s.out_dtype == "bfloat16" and s.fast_accum for s in family)
    assert ops.library_for(1, 4096, 4096, False, torch.bfloat16, "auto", True) == (spec, lib)
    assert len(calls) == 1  # loaded: no second get_library
    spec2, _ = ops.library_for(300, 6144, 4096, True, torch.float32, "pp128x128_c2x1", False)
    assert spec2 == build.LibrarySpec("pp128x128_c2x1", "rowwise", "float32", False)
    assert calls[-1][1] == []  # a forced config builds only itself


@pytest.mark.build
def test_real_compile_of_one_config(tmp_path, monkeypatch):
    """One real nvcc build (minutes on 2 cores): the library is torch-free, exports the C ABI, loads."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    reason = build.missing_toolchain_reason()
    if reason:
        pytest.skip(reason)
    spec = build.LibrarySpec("ws64x16_swap", "tensor", "bfloat16")
    path = build.build_library(spec)
    assert path.is_file()
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True)
    if needed.returncode == 0:
        libs = re.findall(r"Shared library: \[(.+?)\]", needed.stdout)
        assert not any("torch" in lib or "c10" in lib or "cudart" in lib for lib in libs), libs
    lib = build.KernelLibrary(spec, path)
    assert lib._lib.fp8b_abi_version() == build.ABI_VERSION
    assert build.build_library(spec) == path  # cached now


@pytest.mark.build
def test_real_compile_of_one_block_config(tmp_path, monkeypatch):
    """One real nvcc build of a block-scaled config (minutes on 2 cores): the swapped stream-K decode tile, whose
    activation scales travel by cp.async; torch-free, exports the block C ABI, loads and describes itself."""
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    reason = build.missing_toolchain_reason()
    if reason:
        pytest.skip(reason)
    spec = build.BlockLibrarySpec("bw_sk128x16_swap")
    path = build.build_library(spec)
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True)
    if needed.returncode == 0:
        libs = re.findall(r"Shared library: \[(.+?)\]", needed.stdout)
        assert not any("torch" in lib or "c10" in lib or "cudart" in lib for lib in libs), libs
    lib = build.open_library(spec, path)
    assert isinstance(lib, build.BlockKernelLibrary) and lib.act_scale_tma is False
    assert lib._lib.fp8b_block_abi_version() == build.BLOCK_ABI_VERSION
    assert build.build_library(spec) == path  # cached now


# =========================================================================================== GPU
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
MS = [1, 16, 64, 256, 1024, 4096, 8192]
# the few (config, epilogue, out, accum) the scale-mode / dtype tests use besides the per-tensor bf16 family
EXTRA_SPECS = [
    build.LibrarySpec("ws64x16_swap", "rowwise"),
    build.LibrarySpec("pp128x128_c2x1", "rowwise"),
    build.LibrarySpec("sk128x64_swap", "rowwise"),
    build.LibrarySpec("pp128x128_c2x1", "tensor", "float16"),
    build.LibrarySpec("ws64x16_swap", "tensor", "float32"),
    build.LibrarySpec("sk128x64_swap", "rowwise", "float32"),
    build.LibrarySpec("pp64x128_c2x1", "rowwise", "float16"),
    build.LibrarySpec("coop128x256_c2x1", "tensor", "bfloat16", fast_accum=False),
]


@pytest.fixture(scope="module")
def gpu_built():
    """Build (in parallel) every library the GPU tests use, once."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cutlass provider runs on SM 9.0 only")
    specs = build.specs_for(configs.CONFIG_NAMES) + EXTRA_SPECS
    missing = [s for s in specs if build.locate(s) is None]
    failed = {s.name: r for s, r in build.build_many(missing).items() if isinstance(r, BuildError)}
    assert not failed, failed
    return True


def _relerr(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _data(m, n, k, per_token=False, per_channel=False, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    xs = (torch.rand(m, 1, device="cuda", generator=g) * 0.05 + 0.01) if per_token else torch.tensor(
        [0.03], device="cuda")
    ws = (torch.rand(n, device="cuda", generator=g) * 0.05 + 0.01) if per_channel else torch.tensor(
        [0.02], device="cuda")
    return x, w, xs, ws


def _check(backend, m, n, k, *, per_token=False, per_channel=False, out_dtype=None, bias=False, tol=1e-2):
    import torch

    from fp8_backends.core import reference

    out_dtype = out_dtype or torch.bfloat16
    x, w, xs, ws = _data(m, n, k, per_token, per_channel)
    b = (torch.randn(n, device="cuda") * 4).to(out_dtype) if bias else None
    prepared = backend.prepare_weight(w, ws)
    y = backend.gemm(x, prepared, xs, out_dtype=out_dtype, bias=b)
    assert y.shape == (m, n) and y.dtype == out_dtype
    ref = reference.fp8_gemm(x, w, xs, ws, torch.float32, b)
    err = _relerr(y, ref)
    assert torch.isfinite(y.float()).all() and err < tol, (backend.label, m, n, k, err)
    return y


def _sampled_cases():
    # every config on every M, rotating over the Llama-3-8B shapes (56 GEMMs instead of 224)
    for i, name in enumerate(configs.CONFIG_NAMES):
        for j, m in enumerate(MS):
            n, k = SHAPES[(i + j) % len(SHAPES)]
            yield pytest.param(name, m, n, k, id=f"{name}-M{m}-{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("name, m, n, k", list(_sampled_cases()))
def test_every_config_llama_shapes(gpu_built, name, m, n, k):
    _check(CutlassSm90Backend(config=name), m, n, k)


@pytest.mark.gpu
def test_precise_accumulation(gpu_built):
    _check(CutlassSm90Backend(config="coop128x256_c2x1", fast_accum="false"), 1024, 4096, 14336, tol=5e-3)


@pytest.mark.gpu
def test_misaligned_input_refused(gpu_built):
    import torch

    b = CutlassSm90Backend(config="ws64x16_swap")
    x, w, xs, ws = _data(4, 256, 512)
    prepared = b.prepare_weight(w, ws)
    big = torch.zeros(2 * 512 * 4 + 8, dtype=torch.uint8, device="cuda")
    odd = big[8:8 + 4 * 512].view(torch.float8_e4m3fn).view(4, 512)
    with pytest.raises(InvalidInputError, match="16-byte aligned"):
        b.gemm(odd, prepared, xs)


# ------------------------------------------------------------------------------------ the conformance kit
# Each (config, epilogue, output dtype, accumulation) is one library built with nvcc (minutes): the kit's
# classes below exercise only the combinations whose libraries the ``gpu_built`` fixture builds (every
# config for per-tensor scales with bf16 output, plus EXTRA_SPECS), so a GPU run builds nothing more. On a
# CPU machine the provider is unavailable (no CUDA toolkit): the kit checks its declaration, entry point,
# import cost and that CPU tensors are refused.
_BUILT = {(s.config, s.epilogue, s.out_dtype) for s in [*build.specs_for(configs.CONFIG_NAMES), *EXTRA_SPECS]
          if s.fast_accum}


class _CutlassContract(GemmProviderContract):
    cutlass_config = "auto"
    extra_heavy_modules = ("filelock", "cutlass_library")
    gpu_shapes = ((5, 1024, 2048), (300, 6144, 4096))

    @pytest.fixture(autouse=True)
    def _libraries_built(self, request):
        import torch

        if torch.cuda.is_available():
            request.getfixturevalue("gpu_built")

    def include_case(self, case):
        epilogue = "rowwise" if case.act == "token" or case.weight is WeightScale.PER_CHANNEL else "tensor"
        used = configs.CONFIG_NAMES if self.cutlass_config == "auto" else (self.cutlass_config,)
        return all((name, epilogue, case.out.value) in _BUILT for name in used)

    def make_provider(self):
        return CutlassSm90Backend(config=self.cutlass_config)


class TestCutlassContract(_CutlassContract):
    """``config=auto`` (the M-bucket table): per-tensor scales, bf16 output, with and without bias; on the
    GPU also odd M at 4096 x 4096 and Llama-3-8B shapes."""

    gpu_shapes = (*((m, 4096, 4096) for m in (1, 7, 33, 100, 257, 1001, 3000)),
                  (16, 6144, 4096), (1024, 28672, 4096), (256, 4096, 14336))


class TestCutlassWs64x16SwapContract(_CutlassContract):
    cutlass_config = "ws64x16_swap"  # per-tensor bf16 / fp32, row-wise bf16


class TestCutlassSk128x64SwapContract(_CutlassContract):
    cutlass_config = "sk128x64_swap"  # stream-K: per-tensor bf16, row-wise bf16 / fp32


class TestCutlassPp128x128Contract(_CutlassContract):
    cutlass_config = "pp128x128_c2x1"  # ping-pong: per-tensor bf16 / fp16, row-wise bf16


class TestCutlassPp64x128Contract(_CutlassContract):
    cutlass_config = "pp64x128_c2x1"  # ping-pong: per-tensor bf16, row-wise fp16


class TestCutlassSk128x16SwapContract(_CutlassContract):
    cutlass_config = "sk128x16_swap"  # per-tensor bf16 (graph capture of a stream-K decode config)
    gpu_shapes = ((8, 4096, 14336),)


class TestCutlassCoop128x256Contract(_CutlassContract):
    cutlass_config = "coop128x256_c2x1"  # per-tensor bf16 (graph capture of a cooperative prefill config)
    gpu_shapes = ((512, 6144, 4096),)


@pytest.mark.gpu
@pytest.mark.build
def test_two_processes_build_at_once(tmp_path):
    """Both processes ask for the same unbuilt library: one compiles, the other waits on the lock and
    loads the first one's build; both then run a correct GEMM."""
    reason = build.missing_toolchain_reason()
    if reason:
        pytest.skip(reason)
    code = textwrap.dedent(
        """
        import sys, time, torch
        from fp8_backends.core import reference
        from fp8_backends.providers.cutlass import build
        from fp8_backends.providers.cutlass.backend import CutlassSm90Backend
        t0 = time.time()
        spec = build.LibrarySpec("ws64x64_swap", "tensor", "float16")
        lib = build.get_library(spec)
        b = CutlassSm90Backend(config="ws64x64_swap")
        x = (torch.randn(40, 512, device="cuda") * 2).to(torch.float8_e4m3fn)
        w = (torch.randn(256, 512, device="cuda") * 2).to(torch.float8_e4m3fn)
        s = torch.tensor([0.05], device="cuda")
        y = b.gemm(x, b.prepare_weight(w, s), s, out_dtype=torch.float16)
        ref = reference.fp8_gemm(x, w, s, s, torch.float32)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        print(lib.path, err, round(time.time() - t0, 1))
        sys.exit(0 if err < 1e-2 else 3)
        """
    )
    env = {**os.environ, build.CACHE_ENV: str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd="/") for _ in range(2)]
    outs = [p.communicate(timeout=1500) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len({o[0].split()[0] for o in outs}) == 1
    assert len(list((tmp_path / "cache").glob("*/manifest.json"))) == 1
    assert len(list((tmp_path / "cache").glob("*/build.log"))) == 1


@pytest.mark.gpu
def test_native_op_serves_the_provider_after_one_python_call_per_bucket(gpu_built):
    """The provider's op is the C++ one (``native_op``): the first call of each M bucket goes through the Python op
    (which loads and registers the library), the next ones are served in C++, eager and compiled, with the same
    numbers."""
    import torch

    from fp8_backends.providers.cutlass import native_op

    if not native_op.enabled():
        pytest.skip("FP8_BACKENDS_CUTLASS_NATIVE=0")
    native = native_op.load("cuda")
    b = CutlassSm90Backend()
    assert b._loaded_op() is native.op
    served0, handed0 = native.calls()
    for m in (1, 100, 3000):
        first = _check(b, m, 4096, 4096)
        again = _check(b, m, 4096, 4096)
        torch.testing.assert_close(first, again, rtol=0, atol=0)
    served, handed = native.calls()
    assert served - served0 >= 3 and handed - handed0 <= 3, (served - served0, handed - handed0)
    x, w, xs, ws = _data(64, 4096, 4096)
    prepared = b.prepare_weight(w, ws)
    eager = b.gemm(x, prepared, xs)
    compiled = torch.compile(lambda x: b.gemm(x, prepared, xs), fullgraph=True)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    assert native.calls()[0] > served


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_tensor_static", "per_tensor_dynamic", "per_token"])
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16", "float32"])
def test_native_linear_quantizes_as_the_reference_bit_for_bit(gpu_built, mode, x_dtype):
    """The C++ linear op's quantization kernels give the library's FP8 codes and scales (its quantizer, which the
    unfused path runs: correctly rounded division, as the reference's semantics): its output equals the provider's
    GEMM on :func:`fp8_backends.quant.quantize`'s result exactly, for a row-strided input with an all-zero row (the
    1e-12 floor); a per-token NaN row comes out NaN throughout, as the reference's amax keeps the NaN."""
    import torch

    from fp8_backends import quant
    from fp8_backends.core.types import ActScale
    from fp8_backends.providers.cutlass import native_op

    if not native_op.enabled():
        pytest.skip("FP8_BACKENDS_CUTLASS_NATIVE=0")
    b = CutlassSm90Backend()
    b.preload()
    act = ActScale(mode)
    assert act in b.fused_act_quant
    dtype = getattr(torch, x_dtype)
    _, w, _, ws = _data(1, 4096, 4096)
    prepared = b.prepare_weight(w, ws)
    g = torch.Generator(device="cuda").manual_seed(5)
    # row strides of 4160 (16-byte rows: the vector kernels) and 4099 elements (the scalar ones); M = 2048 spreads
    # more row chunks than one cooperative launch has blocks
    for m, pad in ((1, 64), (7, 3), (300, 64), (300, 3), (2048, 64)):
        wide = torch.randn(m, 4096 + pad, device="cuda", generator=g, dtype=torch.float32).mul_(3).to(dtype)
        x = wide[:, :4096]
        if m > 1:
            x[1].zero_()
        if m > 2 and mode == "per_token":
            x[2, 7] = float("nan")
        s = torch.tensor([0.03], device="cuda") if act is ActScale.PER_TENSOR_STATIC else None
        y = b.fused_quant_gemm_impl(x, prepared, act, s, torch.bfloat16, None)
        x_q, x_scale = quant.quantize(x.contiguous(), act, s)[:2]  # the library's quantizer: the unfused path
        want = b.gemm_impl(x_q, prepared, x_scale, torch.bfloat16, None)
        assert y is not None and y.shape == want.shape
        nan_rows = x.isnan().any(dim=1)
        # a NaN row: NaN throughout, as the reference's amax keeps it (the triton quantizer's max drops it)
        assert bool(y[nan_rows].isnan().all()) and not bool(y[~nan_rows].isnan().any()), m
        torch.testing.assert_close(y[~nan_rows], want[~nan_rows], rtol=0, atol=0, msg=f"M={m}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["per_tensor_static", "per_tensor_dynamic", "per_token"])
def test_native_linear_in_a_cuda_graph_and_a_nan(gpu_built, mode):
    """The C++ linear op is captured in a CUDA graph (the dynamic mode's cooperative launch included) and its
    replays give the eager call's output for new inputs; a NaN in a dynamic input makes every output NaN (its scale is
    NaN), as quantize + GEMM does."""
    import torch

    from fp8_backends.core.types import ActScale
    from fp8_backends.providers.cutlass import native_op

    if not native_op.enabled():
        pytest.skip("FP8_BACKENDS_CUTLASS_NATIVE=0")
    b = CutlassSm90Backend()
    b.preload()
    act = ActScale(mode)
    _, w, _, ws = _data(1, 4096, 4096)
    prepared = b.prepare_weight(w, ws)
    s = torch.tensor([0.03], device="cuda") if act is ActScale.PER_TENSOR_STATIC else None
    fused = b.bind_fused_quant_gemm(prepared, act, s, torch.bfloat16, None)
    x = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    fused(x)  # the bucket's first call registers it (Python)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fused(x)
    for seed in (1, 2):
        x.copy_(torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16, generator=torch.Generator(
            device="cuda").manual_seed(seed)))
        graph.replay()
        torch.testing.assert_close(y, fused(x), rtol=0, atol=0)
    if act is ActScale.PER_TENSOR_DYNAMIC:
        x[17, 100] = float("nan")
        assert bool(fused(x).isnan().all())


@pytest.mark.gpu
def test_eager_layer_on_cutlass_takes_the_native_linear(gpu_built):
    """A processed Fp8Linear whose bucket is cutlass runs its eager calls through the C++ linear op (one dispatcher
    call: quantize + GEMM), and its output is the reference's."""
    import torch
    from torch import nn

    from fp8_backends.core import reference
    from fp8_backends.layers import Fp8Linear
    from fp8_backends.providers.cutlass import native_op

    if not native_op.enabled():
        pytest.skip("FP8_BACKENDS_CUTLASS_NATIVE=0")
    native = native_op.load("cuda")
    torch.manual_seed(0)
    lin = nn.Linear(4096, 4096, bias=True, device="cuda", dtype=torch.bfloat16)
    for act in ("per_tensor_static", "per_tensor_dynamic", "per_token"):
        layer = Fp8Linear.from_linear(lin, act_scale=act, input_scale=0.02 if act == "per_tensor_static" else None,
                                      backend="cutlass")
        x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
        layer(x)
        before = native.calls()[0]
        with torch.no_grad():
            y = layer(x)
        assert native.calls()[0] == before + 1, act  # served in C++, no Python fallback
        x_q, x_scale = reference.quantize(x, reference.ActScale(act),
                                          layer.input_scale if act == "per_tensor_static" else None)
        ref = reference.fp8_gemm(x_q, layer.weight, x_scale, layer.weight_scale, torch.float32, layer.bias)
        err = ((y.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (act, err)
