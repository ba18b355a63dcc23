"""The cutlass provider's block-scaled FP8 GEMM (1x128 activation groups, 128x128 weight blocks).

CPU: the configs and their refusals, the M-bucket table, the library specs, cache keys and builds through a fake nvcc,
the C ABI against the source, the CLI, the scale-layout handling of the op, its schema and fake implementation.
GPU (``-m gpu``, SM 9.0): every config against an fp64 dequantized reference on ragged shapes, output dtypes, bias,
scale layouts, a CUDA graph and ``torch.compile``. The real nvcc build of one config is in tests/test_cutlass.py
(marker ``build``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_cutlass import _C_TO_CTYPES, _c_params, _calls, fake_env  # noqa: F401  (fake_env is a fixture)

from fp8_backends.core.errors import BuildError, InvalidInputError
from fp8_backends.core.types import ActScale, GemmProblem, ScaleLayout, WeightScale
from fp8_backends.providers.cutlass import block_configs, build
from fp8_backends.providers.cutlass.backend import CutlassSm90Backend
from fp8_backends.providers.cutlass.block_configs import (
    BLOCK_CONFIGS,
    DEFAULT_BLOCK_TABLE,
    BlockDispatchTable,
    BlockKernelConfig,
)
from fp8_backends.registry.platform import simulate_platform

BSPEC = build.BlockLibrarySpec("bw_sk128x16_swap")


# ------------------------------------------------------------------------------------ configs and dispatch
def test_every_block_config_is_valid_and_named_uniquely():
    names = block_configs.BLOCK_CONFIG_NAMES
    assert len(names) == len(set(names)) >= 5 and all(n.startswith("bw_") for n in names)
    assert not set(names) & set(build.CONFIGS), "block and per-tensor config names must not collide"
    for cfg in block_configs.BLOCK_CONFIG_LIST:
        d = cfg.defines()
        assert d["FP8B_TILE_K"] == "128" and d["FP8B_SCHEDULE"] in {"1", "2"}
        assert (cfg.tile[0] if cfg.swap_ab else cfg.tile[1]) % 128 == 0
    assert any(c.swap_ab and c.tile[1] <= 16 for c in block_configs.BLOCK_CONFIG_LIST), "needs a decode config"
    assert any(c.stream_k for c in block_configs.BLOCK_CONFIG_LIST)
    assert any(c.tile == (128, 128, 128) and c.schedule == "cooperative" and not c.swap_ab
               for c in block_configs.BLOCK_CONFIG_LIST)


def test_activation_scale_load_path_follows_the_tile():
    # CUTLASS 4.2 loads a scale operand with TMA when 32 or more of its values share one tile side
    assert not BLOCK_CONFIGS["bw_sk128x16_swap"].act_scale_tma
    assert BLOCK_CONFIGS["bw_sk128x32_swap"].act_scale_tma
    assert BLOCK_CONFIGS["bw_pp64x128"].act_scale_tma and BLOCK_CONFIGS["bw_coop128x128_c1x2"].act_scale_tma
    assert "cp.async" in BLOCK_CONFIGS["bw_sk128x16_swap"].describe()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tile": (128, 128, 64)}, "tile K must be 128"),
        ({"schedule": "cooperative", "tile": (64, 128, 128)}, "tile M >= 128"),
        ({"schedule": "pingpong", "tile": (128, 128, 128), "stream_k": True}, "stream-K"),
        ({"schedule": "ws", "tile": (128, 128, 128)}, "no plain warp-specialised"),
        ({"tile": (128, 64, 128)}, "whole 128-row weight blocks"),
        ({"tile": (64, 16, 128), "schedule": "pingpong", "swap_ab": True}, "whole 128-row weight blocks"),
        ({"tile": (128, 12, 128), "swap_ab": True}, "wgmma"),
    ],
)
def test_invalid_block_configs_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockKernelConfig("bw_bad", **kwargs)
    with pytest.raises(ValueError, match="bw_"):
        BlockKernelConfig("bad", (128, 128, 128))


def test_default_block_table_picks_by_m_bucket_and_long_k():
    t = DEFAULT_BLOCK_TABLE
    assert t.config_names() <= set(BLOCK_CONFIGS)
    for buckets in (t.default, t.long_k):
        assert all(bound is not None for bound, _ in buckets[:-1]) and buckets[-1][0] is None
    n, k = 4096, 4096
    assert t.buckets_for(n, k) == t.default
    assert t.buckets_for(2112, 7168) == t.long_k  # K >= 3N: the stream-K buckets
    assert t.buckets_for(7168, 2048) == t.default
    assert BLOCK_CONFIGS[t.pick(1, n, k)].swap_ab and not BLOCK_CONFIGS[t.pick(8192, n, k)].swap_ab
    assert BLOCK_CONFIGS[t.pick(256, 2112, 7168)].stream_k
    assert t.pick(16, n, k) == "bw_sk128x16_swap" and t.pick(17, n, k) != "bw_sk128x16_swap"


def test_block_table_shapes_json_round_trip_and_refusals():
    table = BlockDispatchTable(
        default=((64, "bw_sk128x64_swap"), (None, "bw_coop128x128_c1x2")),
        shapes={(2112, 7168): ((16, "bw_sk128x16_swap"), (None, "bw_sk128x128"))},
        long_k=((None, "bw_sk128x128"),),
        source="test",
    )
    assert table.pick(8, 2112, 7168) == "bw_sk128x16_swap"  # a listed shape wins over the K >= 3N rule
    assert table.pick(8, 1024, 7168) == "bw_sk128x128"
    assert table.pick(8, 4096, 4096) == "bw_sk128x64_swap"
    again = BlockDispatchTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.to_json() == table.to_json() and again.config_names() == table.config_names()
    no_long_k = BlockDispatchTable(default=((None, "bw_pp64x128"),))
    assert no_long_k.long_k == no_long_k.default and no_long_k.pick(1, 128, 8192) == "bw_pp64x128"
    with pytest.raises(ValueError, match="unknown config"):
        BlockDispatchTable(default=((None, "ws64x16_swap"),))  # a per-tensor config is not a block config
    with pytest.raises(ValueError, match="unsupported table format"):
        BlockDispatchTable.from_json({"format": "fp8_backends.cutlass_table/1", "default": [[None, "bw_pp64x128"]]})


# ------------------------------------------------------------------------------------ library specs / ABI
def test_block_spec_defines_and_names():
    spec = build.BlockLibrarySpec("bw_sk128x64_swap", "float32")
    d = spec.defines()
    assert d["FP8B_OUT"] == "2" and d["FP8B_SWAP_AB"] == "1" and d["FP8B_STREAM_K"] == "1"
    assert d["FP8B_SCHEDULE"] == "2" and d["FP8B_TILE_N"] == "64" and d["FP8B_CONFIG_NAME"] == '"bw_sk128x64_swap"'
    assert "FP8B_EPILOGUE" not in d and "FP8B_FAST_ACCUM" not in d
    assert spec.name == "fp8b_sm90a_bw_sk128x64_swap_fp32"
    assert spec.describe_expected() == "bw_sk128x64_swap;swap=1;out=2"
    assert spec.source_files == build.BLOCK_SOURCE_FILES and spec.abi == build.BLOCK_ABI_VERSION
    assert build.LibrarySpec("ws64x16_swap").source_files == build.SOURCE_FILES
    with pytest.raises(ValueError, match="SM100"):
        build.BlockLibrarySpec("bw_sk128x16_swap", arch="100a")
    with pytest.raises(ValueError, match="unknown CUTLASS block config"):
        build.BlockLibrarySpec("ws64x16_swap")
    with pytest.raises(ValueError, match="out_dtype"):
        build.BlockLibrarySpec("bw_sk128x16_swap", "float8")
    assert build.block_specs_for(["bw_pp64x128"], ["bfloat16", "float16"]) == [
        build.BlockLibrarySpec("bw_pp64x128"), build.BlockLibrarySpec("bw_pp64x128", "float16")]


def _block_source() -> str:
    return (build.HERE / build.BLOCK_SOURCE_FILES[0]).read_text()


def test_block_source_uses_every_macro_the_specs_define():
    src = _block_source()
    for macro in BSPEC.defines():
        assert f"defined({macro})" in src, macro


def test_block_ctypes_signature_matches_the_c_source():
    src = _block_source()
    gemm = _c_params(src, "fp8b_block_gemm")
    assert [_C_TO_CTYPES[t] for t in gemm] == list(build.BLOCK_GEMM_ARGTYPES)
    assert re.search(r"FP8B_EXPORT int fp8b_block_gemm\(", src)
    ws = _c_params(src, "fp8b_block_workspace_size")
    assert [_C_TO_CTYPES[t] for t in ws] == list(build.WORKSPACE_ARGTYPES)
    assert f"#define FP8B_BLOCK_ABI_VERSION {build.BLOCK_ABI_VERSION}" in src
    codes = dict(re.findall(r"FP8B_ERR_\w+ = (\d+),\s*// (.*)", src))
    assert {int(k) for k in codes} == set(build.BLOCK_RETURN_CODES)
    for name in ("fp8b_block_abi_version", "fp8b_block_describe", "fp8b_block_act_scale_tma"):
        assert re.search(rf"FP8B_EXPORT [\w ]+\*? ?{name}\(void\)", src), name


def test_block_source_ships_as_package_data():
    repo = Path(__file__).resolve().parents[1]
    assert (repo / "providers" / "cutlass" / build.BLOCK_SOURCE_FILES[0]).read_bytes() == _block_source().encode()


# ------------------------------------------------------------------------------------ cache keys
def test_each_kernel_source_keys_only_its_own_libraries(monkeypatch, tmp_path):
    base = {"nvcc_ver": "13.0.88", "cutlass_ver": "4.2.0"}
    tensor = build.LibrarySpec("ws64x16_swap")

    def keys():
        return (build.library_key(tensor, src_hash=build.source_hash(tensor.source_files), **base),
                build.library_key(BSPEC, src_hash=build.source_hash(BSPEC.source_files), **base))

    k_tensor, k_block = keys()
    assert k_tensor != k_block
    assert build.source_hash() == build.source_hash(build.SOURCE_FILES)  # the per-tensor keys are unchanged
    for name in (*build.SOURCE_FILES, *build.BLOCK_SOURCE_FILES):
        (tmp_path / name).write_bytes((build.HERE / name).read_bytes())
    (tmp_path / build.BLOCK_SOURCE_FILES[0]).write_text(_block_source() + "\n// changed\n")
    monkeypatch.setattr(build, "HERE", tmp_path)
    k_tensor2, k_block2 = keys()
    assert k_tensor2 == k_tensor and k_block2 != k_block
    assert build.key_material(BSPEC, src_hash="x", nvcc_ver=None, cutlass_ver=None)["abi"] == build.BLOCK_ABI_VERSION


def test_block_compile_command(fake_env):  # noqa: F811 (the fixture imported above)
    tc = build.get_toolchain()
    cmd = build.compile_command(build.BlockLibrarySpec("bw_coop128x128_c1x2", "float16"), tc, Path("/tmp/x.so"))
    assert cmd[0] == str(fake_env["nvcc"])
    for flag in ("-gencode=arch=compute_90a,code=sm_90a", "-O3", "-DFP8B_OUT=1", "-DFP8B_CLUSTER_N=2",
                 '-DFP8B_CONFIG_NAME="bw_coop128x128_c1x2"'):
        assert flag in cmd, flag
    assert cmd[-3].endswith(build.BLOCK_SOURCE_FILES[0]) and cmd[-2:] == ["-o", "/tmp/x.so"]


# ------------------------------------------------------------------------------------ builds (fake nvcc)
def test_block_build_once_then_reuse_and_status(fake_env):  # noqa: F811 (the fixture imported above)
    st = build.status([BSPEC])
    assert st.ok and st.missing == [BSPEC.name] and "not built yet" in st.reason
    path = build.build_library(BSPEC)
    assert path.is_file() and path.name == f"lib{BSPEC.name}.so" and _calls(fake_env["counter"]) == 1
    assert build.build_library(BSPEC) == path and _calls(fake_env["counter"]) == 1
    assert build.locate(BSPEC) == path and build.find_prebuilt(BSPEC) == path
    manifest = json.loads((path.parent / "manifest.json").read_text())
    assert manifest["material"]["abi"] == build.BLOCK_ABI_VERSION
    assert build.BLOCK_SOURCE_FILES[0] in (path.parent / "build.log").read_text()
    assert build.status([BSPEC]).built == 1


def test_a_failed_block_build_spares_the_per_tensor_kernels(fake_env, monkeypatch):  # noqa: F811 (the fixture imported above)
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    with pytest.raises(BuildError, match="fake compiler failure"):
        build.get_library(BSPEC)
    assert not build.status([BSPEC]).ok
    tensor = build.status([build.LibrarySpec("ws64x16_swap")])
    assert tensor.ok, tensor.reason


def test_unloadable_block_library_is_a_build_error(fake_env):  # noqa: F811 (the fixture imported above)
    with pytest.raises(BuildError, match="cannot load"):
        build.get_library(BSPEC)


def test_first_use_build_is_announced_and_shows_progress(fake_env, monkeypatch, caplog):  # noqa: F811 (the fixture imported above)
    monkeypatch.setenv("FAKE_NVCC_SLEEP", "0.5")
    monkeypatch.setattr(build, "PROGRESS_EVERY_S", 0.1)
    with caplog.at_level(logging.INFO, logger="fp8_backends"), pytest.raises(BuildError, match="cannot load"):
        build.get_library(BSPEC, also=[build.BlockLibrarySpec("bw_pp64x128")])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("building 2 kernel libraries at first use" in w and "python -m fp8_backends.build cutlass" in w
               for w in warnings), warnings
    assert any("first-use build finished: 2 of 2 libraries built" in w for w in warnings), warnings
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(re.search(r"building 2 libraries: \d of 2 done, \d+ s elapsed", m) for m in infos), infos
    assert any("built fp8b_sm90a_bw_pp64x128_bf16" in m for m in infos), infos
    assert _calls(fake_env["counter"]) == 2


def test_cli_builds_block_libraries(fake_env, tmp_path):  # noqa: F811 (the fixture imported above)
    env = {**os.environ}
    run = lambda *a: subprocess.run([sys.executable, "-m", "fp8_backends.build", *a], capture_output=True,  # noqa: E731
                                    text=True, env=env, cwd="/")
    assert run("cutlass", "--epilogue", "block", "--block-config", "nope").returncode == 2
    report = tmp_path / "r.json"
    ok = run("cutlass", "--epilogue", "block", "--block-config", "bw_sk128x16_swap,bw_pp64x128", "--out-dtype",
             "bf16", "--native", "no", "--json", str(report))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert _calls(fake_env["counter"]) == 2
    names = [lib["name"] for lib in json.loads(report.read_text())["libraries"]]
    assert names == ["fp8b_sm90a_bw_sk128x16_swap_bf16", "fp8b_sm90a_bw_pp64x128_bf16"]
    table = run("cutlass", "--epilogue", "block", "--block-config", "table", "--list", "--native", "no")
    assert table.returncode == 0
    assert {f"fp8b_sm90a_{c}_bf16" for c in DEFAULT_BLOCK_TABLE.config_names()} <= set(
        re.findall(r"(fp8b_sm90a_bw_\w+)", table.stdout))
    tensor_only = run("cutlass", "--config", "ws64x16_swap", "--epilogue", "tensor", "--list", "--native", "no")
    assert "bw_" not in tensor_only.stdout
    everything = run("cutlass", "--list", "--native", "no")
    assert all(f"fp8b_sm90a_{c}_bf16" in everything.stdout for c in BLOCK_CONFIGS)
    listed = tmp_path / "listed.json"
    assert run("cutlass", "--epilogue", "block", "--block-config", "bw_sk128x16_swap,bw_sk128x128", "--list",
               "--native", "no", "--json", str(listed)).returncode == 0
    libraries = json.loads(listed.read_text())["libraries"]  # the --list run builds nothing and says what is cached
    assert [(lib["name"], lib["cached"]) for lib in libraries] == [("fp8b_sm90a_bw_sk128x16_swap_bf16", True),
                                                                   ("fp8b_sm90a_bw_sk128x128_bf16", False)]
    assert _calls(fake_env["counter"]) == 2


# ------------------------------------------------------------------------------------ the op (CPU parts)
def _m_major(torch, m, kb, pad4=True, fill=None):
    rows = -(-m // 4) * 4 if pad4 else m
    buf = torch.arange(kb * rows, dtype=torch.float32).reshape(kb, rows) if fill is None else fill
    return buf[:, :m].t()


def test_act_scale_operand_passes_served_layouts_through():
    torch = pytest.importorskip("torch")
    from fp8_backends.providers.cutlass.block_ops import act_scale_operand

    for m, kb in ((1, 1), (3, 5), (8, 56), (1001, 3)):
        padded = _m_major(torch, m, kb)
        for tma in (False, True):
            t, ld = act_scale_operand(padded, m, kb, tma)
            assert t is padded and (kb == 1 or ld == padded.stride(1))
        tight = _m_major(torch, m, kb, pad4=False)
        t, ld = act_scale_operand(tight, m, kb, tma=False)  # cp.async configs read any M-major stride
        assert t is tight


@pytest.mark.parametrize("layout", ["row_major", "m_major_unpadded", "m_major_overlapping"])
def test_act_scale_operand_copies_other_layouts_into_the_padded_one(layout):
    torch = pytest.importorskip("torch")
    from fp8_backends.providers.cutlass.block_ops import act_scale_operand

    m, kb = 5, 3
    dense = torch.rand(m, kb)
    if layout == "row_major":
        xs, tma = dense.clone(), False
    elif layout == "m_major_unpadded":
        xs, tma = dense.t().contiguous().t(), True  # strides (1, 5): M-major, ld 5 not a multiple of 4
    else:
        xs, tma = torch.as_strided(dense.t().contiguous(), (m, kb), (1, 2)), False
    t, ld = act_scale_operand(xs, m, kb, tma)
    assert t is not xs and ld == 8 and tuple(t.shape) == (kb, 8)
    got = torch.as_strided(t, (m, kb), (1, ld))
    assert torch.equal(got, xs)


def test_prepare_block_scale_converts_once_and_checks_the_shape():
    torch = pytest.importorskip("torch")
    from fp8_backends.providers.cutlass.block_ops import prepare_block_scale

    s = torch.rand(3, 2)
    assert prepare_block_scale(s, 300, 200) is s  # fp32 contiguous [ceil(300/128), ceil(200/128)]: kept
    b = prepare_block_scale(s.to(torch.bfloat16), 300, 200)
    assert b.dtype == torch.float32 and b.is_contiguous() and torch.equal(b, s.to(torch.bfloat16).float())
    t = prepare_block_scale(torch.rand(2, 3).t(), 300, 200)
    assert t.is_contiguous()
    with pytest.raises(InvalidInputError, match=r"\[3, 2\]"):
        prepare_block_scale(torch.rand(2, 2), 300, 200)
    with pytest.raises(InvalidInputError, match="fp32"):
        prepare_block_scale(torch.ones(3, 2, dtype=torch.int32), 300, 200)


def test_block_op_schema_and_fake_implementation():
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8_backends.providers.cutlass import block_ops

    block_ops.load_op()
    schema = str(torch.ops.fp8_backends.cutlass_sm90_block_gemm.default._schema)
    assert "Tensor? bias" in schema and "ScalarType out_dtype" in schema and "str config" in schema
    with FakeTensorMode():
        x = torch.empty(5, 256, dtype=torch.float8_e4m3fn, device="cuda")
        w = torch.empty(384, 256, dtype=torch.float8_e4m3fn, device="cuda")
        xs = torch.empty(5, 2, device="cuda")
        ws = torch.empty(3, 2, device="cuda")
        y = block_ops.cutlass_block_gemm(x, w, xs, ws, None, torch.float16, "auto")
    assert tuple(y.shape) == (5, 384) and y.dtype == torch.float16 and y.device.type == "cuda"


def test_block_library_for_picks_config_and_builds_the_family_once(monkeypatch):
    torch = pytest.importorskip("torch")
    from fp8_backends.providers.cutlass import block_ops

    calls = []
    fake_loaded: dict = {}

    def fake_get(spec, also=()):
        calls.append((spec, list(also)))
        fake_loaded[spec] = f"lib:{spec.name}"
        return fake_loaded[spec]

    monkeypatch.setattr(build, "loaded", lambda spec: fake_loaded.get(spec))
    monkeypatch.setattr(build, "get_library", fake_get)
    spec, lib = block_ops.block_library_for(1, 2112, 7168, torch.bfloat16, "auto")
    assert spec == build.BlockLibrarySpec(DEFAULT_BLOCK_TABLE.pick(1, 2112, 7168))
    assert lib == f"lib:{spec.name}" and len(calls) == 1
    assert {s.config for s in calls[0][1]} == DEFAULT_BLOCK_TABLE.config_names()
    assert block_ops.block_library_for(1, 2112, 7168, torch.bfloat16, "auto") == (spec, lib)
    assert len(calls) == 1  # loaded: no second get_library
    spec2, _ = block_ops.block_library_for(300, 4096, 4096, torch.float32, "bw_pp64x128")
    assert spec2 == build.BlockLibrarySpec("bw_pp64x128", "float32") and calls[-1][1] == []
    with pytest.raises(InvalidInputError, match="not a block-scaled config"):
        block_ops.block_library_for(1, 4096, 4096, torch.bfloat16, "ws64x16_swap")


def test_bench_summary_builds_a_loadable_block_table(monkeypatch):
    """bench/cutlass_block_configs.py turns measurements into a table BlockDispatchTable accepts (synthetic numbers):
    per shape, ``default`` from the shapes with K < 3N, ``long_k`` from the others; wrong results never win."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    import importlib

    bc = importlib.import_module("bench.cutlass_block_configs")
    names = list(block_configs.BLOCK_CONFIG_NAMES)
    shapes, ms = [(4096, 4096), (2112, 7168)], [1, 64, 4096]
    rows = []
    for n, k in shapes:
        for m in ms:
            res = {bc.BF16: {"median_us": 10.0, "error": None, "relerr": None}}
            res.update({bc.PREFIX + c: {"median_us": 8.0, "error": None, "relerr": 2e-3} for c in names})
            fastest = names[(m + n) % (len(names) - 1)]
            res[bc.PREFIX + fastest]["median_us"] = 4.0
            res[bc.PREFIX + names[-1]].update(median_us=1.0, relerr=0.5)  # wrong: never picked
            rows.append({"n": n, "k": k, "m": m, "results": res})
    summary = bc.summarize(rows, names, ms, shapes)
    assert summary["table_valid"] is True
    table = BlockDispatchTable.from_json(summary["table"])
    for n, k in shapes:
        for m in ms:
            assert table.pick(m, n, k) == names[(m + n) % (len(names) - 1)]
    assert table.buckets_for(4096, 8192) == table.default and table.buckets_for(1000, 7168) == table.long_k
    assert table.default[-1][0] is None and all(b[0] in (8, 512) for b in table.default[:-1])
    assert all(r["best_over_bf16"] == 2.5 for r in summary["best_vs_bf16"])


# ------------------------------------------------------------------------------------ the provider's wiring
BLOCK_PROBLEM = {"act_scale": "per_token_group", "weight_scale": "block"}


def test_config_families_refuse_each_other():
    h100 = simulate_platform("9.0")
    plain = GemmProblem(n=4096, k=4096, m=16)
    block = GemmProblem(n=2112, k=7168, m=4, **BLOCK_PROBLEM)
    bw = CutlassSm90Backend(config="bw_sk128x16_swap")
    assert any("block-scaled kernel" in r for r in bw.extra_reasons(plain, h100))
    assert bw.extra_reasons(block, h100) == [] and bw.block_reasons(block) == []
    tensor_cfg = CutlassSm90Backend(config="ws64x16_swap")
    assert tensor_cfg.extra_reasons(plain, h100) == []
    assert any("per-tensor / row-wise kernel" in r for r in tensor_cfg.block_reasons(block))
    assert CutlassSm90Backend().block_reasons(block) == [] and CutlassSm90Backend().extra_reasons(plain, h100) == []
    assert bw.op_arguments()[0] == "auto" and bw.block_config == "bw_sk128x16_swap"
    assert tensor_cfg.block_config == "auto"
    # the block op has a C++ form too: its host cost follows the op that will serve, as the other family's
    for config in ("bw_sk128x16_swap", "auto"):
        assert CutlassSm90Backend.host_us_for(16, 2112, 7168, {"config": config}) == \
            CutlassSm90Backend.host_us_for(16, 4096, 4096, {"config": "auto"})


def test_capabilities_declare_block_wise_fp8():
    caps = CutlassSm90Backend.capabilities
    assert caps.act_scales == {ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC, ActScale.PER_TOKEN,
                               ActScale.PER_TOKEN_GROUP}
    assert caps.weight_scales == {WeightScale.PER_TENSOR, WeightScale.PER_CHANNEL, WeightScale.BLOCK}
    assert caps.block_scaled and caps.group_sizes == {128} and caps.weight_blocks == {(128, 128)}
    assert caps.group_scale_layout is ScaleLayout.M_MAJOR_TMA
    assert caps.group_scale_layout.value == block_configs.ACT_SCALE_LAYOUT
    assert "block 128x128 x group 128 (m_major_tma scales)" in caps.scale_summary()
    h100 = simulate_platform("9.0")
    assert caps.check(GemmProblem(n=2112, k=7168, **BLOCK_PROBLEM), h100) == []
    ragged = GemmProblem(n=208, k=1008, m=5, **BLOCK_PROBLEM)  # N and K not multiples of 128: served
    assert caps.check(ragged, h100) == []
    assert any("K=1000" in r for r in caps.check(GemmProblem(n=208, k=1000, **BLOCK_PROBLEM), h100))
    g64 = GemmProblem(n=2112, k=7168, group_size=64, **BLOCK_PROBLEM)
    assert any("group size 64" in r for r in caps.check(g64, h100))
    b64 = GemmProblem(n=2112, k=7168, weight_block=(64, 128), **BLOCK_PROBLEM)
    assert any("weight block 64x128" in r for r in caps.check(b64, h100))
    assert any("9.0a" in r for r in caps.check(GemmProblem(n=2112, k=7168, **BLOCK_PROBLEM), simulate_platform("10.0")))


def test_availability_notes_the_block_kernels(fake_env):  # noqa: F811 (the fixture imported above)
    avail = CutlassSm90Backend.availability()
    assert avail.ok and "block-scaled 128x128 / 1x128 kernels" in avail.reason and "not built yet" in avail.reason
    assert _calls(fake_env["counter"]) == 0


# =========================================================================================== GPU
GROUP = 128


def _quant_groups(torch, x, group=GROUP):
    """Per-token-group quantization as the contract states it: scale = max(amax / 448, 1e-12) per 1x128 group."""
    m, k = x.shape
    kb = -(-k // group)
    xp = torch.nn.functional.pad(x.float(), (0, kb * group - k)).view(m, kb, group)
    scale = (xp.abs().amax(-1) / 448.0).clamp_min(1e-12)
    q = (xp / scale[..., None]).clamp(-448, 448).view(m, kb * group)[:, :k].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def _quant_blocks(torch, w, block=(GROUP, GROUP)):
    n, k = w.shape
    nb, kb = -(-n // block[0]), -(-k // block[1])
    wp = torch.nn.functional.pad(w.float(), (0, kb * block[1] - k, 0, nb * block[0] - n))
    wp = wp.view(nb, block[0], kb, block[1])
    scale = (wp.abs().amax((1, 3)) / 448.0).clamp_min(1e-12)
    q = (wp / scale[:, None, :, None]).clamp(-448, 448).view(nb * block[0], kb * block[1])[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def _expand(torch, scale, rows, cols, rb, cb):
    return scale.repeat_interleave(rb, 0)[:rows].repeat_interleave(cb, 1)[:, :cols]


def block_reference(x_q, x_scale, w_q, w_scale, bias=None):
    """fp64 dequantize per group / block, then matmul (+ bias): the exact value the kernel approximates."""
    import torch

    m, k = x_q.shape
    n = w_q.shape[0]
    x = x_q.double() * _expand(torch, x_scale.double(), m, k, 1, GROUP)
    w = w_q.double() * _expand(torch, w_scale.double(), n, k, GROUP, GROUP)
    y = x @ w.t()
    return y if bias is None else y + bias.double()


def _padded_m_major(torch, scale):
    """The contract's m_major layout padded to 4 rows: a [Kb, round_up(M, 4)] buffer seen as [M, Kb]."""
    m, kb = scale.shape
    buf = torch.zeros(kb, -(-m // 4) * 4, device=scale.device)
    buf[:, :m] = scale.t()
    return buf[:, :m].t()


def _block_data(m, n, k, seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g) * (1 + torch.rand(m, 1, device="cuda", generator=g) * 4)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    x_q, xs = _quant_groups(torch, x)
    w_q, ws = _quant_blocks(torch, w)
    return x_q, _padded_m_major(torch, xs), w_q, ws.contiguous()


def _relerr(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


_TOL = {"bfloat16": 5e-3, "float16": 2e-3, "float32": 1e-3}
# shapes (N, K): DeepSeek-V3 (kv_a 576 = 4.5 blocks, q_a 1536, fused q_a+kv_a 2112, o 7168x16384 split, dense
# gate_up 2x18432 split), Qwen3-8B (qkv 6144, o 4096, gate_up 2x12288, down K = 12288), and ragged N / K blocks
SHAPES = [(576, 7168), (2112, 7168), (7168, 2048), (6144, 4096), (4096, 12288), (208, 1008), (1000, 176)]
MS = [1, 3, 16, 17, 33, 64, 100, 257, 1000, 2048]


@pytest.fixture(scope="module")
def block_built():
    """Build (in parallel) every block library the GPU tests use, once."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cutlass provider runs on SM 9.0 only")
    specs = build.block_specs_for(block_configs.BLOCK_CONFIG_NAMES) + [
        build.BlockLibrarySpec("bw_coop128x128_c1x2", "float16"),
        build.BlockLibrarySpec("bw_sk128x16_swap", "float32"),
        build.BlockLibrarySpec("bw_pp64x128", "float32"),
    ]
    missing = [s for s in specs if build.locate(s) is None]
    failed = {s.name: r for s, r in build.build_many(missing).items() if isinstance(r, BuildError)}
    assert not failed, failed
    return True


def _check(m, n, k, config="auto", out_dtype="bfloat16", bias=False, seed=0):
    import torch

    from fp8_backends.providers.cutlass.block_ops import cutlass_block_gemm

    dtype = getattr(torch, out_dtype)
    x_q, xs, w_q, ws = _block_data(m, n, k, seed)
    b = (torch.randn(n, device="cuda") * 0.5).to(dtype) if bias else None
    y = cutlass_block_gemm(x_q, w_q, xs, ws, b, dtype, config)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = block_reference(x_q, xs, w_q, ws, b)
    err = _relerr(y, ref)
    assert torch.isfinite(y.float()).all() and err < _TOL[out_dtype], (config, m, n, k, out_dtype, err)
    return y


def _config_cases():
    # every config on every M, rotating over the shapes
    for i, name in enumerate(block_configs.BLOCK_CONFIG_NAMES):
        for j, m in enumerate(MS):
            n, k = SHAPES[(i + j) % len(SHAPES)]
            yield pytest.param(name, m, n, k, id=f"{name}-M{m}-{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("config, m, n, k", list(_config_cases()))
def test_every_block_config_matches_the_reference(block_built, config, m, n, k):
    _check(m, n, k, config)


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 5, 16, 64, 129, 1000, 4096])
def test_auto_on_model_and_ragged_shapes(block_built, m, n, k):
    _check(m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("config, out_dtype", [("bw_coop128x128_c1x2", "float16"), ("bw_sk128x16_swap", "float32"),
                                               ("bw_pp64x128", "float32")])
def test_other_output_dtypes(block_built, config, out_dtype):
    for m in (1, 7, 300):
        _check(m, 2112, 7168, config, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["bw_sk128x16_swap", "bw_pp64x128", "bw_coop128x128_c1x2"])
def test_bias_is_fused(block_built, config):
    for m in (3, 200):
        _check(m, 576, 7168, config, bias=True)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["bw_sk128x16_swap", "bw_sk128x64_swap", "bw_coop128x128_c1x2"])
def test_every_activation_scale_layout_gives_the_same_bits(block_built, config):
    import torch

    from fp8_backends.providers.cutlass.block_ops import cutlass_block_gemm

    m, n, k = 13, 2112, 7168
    x_q, xs, w_q, ws = _block_data(m, n, k)
    want = cutlass_block_gemm(x_q, w_q, xs, ws, None, torch.bfloat16, config)
    dense = xs.contiguous()  # row-major [M, Kb]
    tight = dense.t().contiguous().t()  # M-major, ld = 13 (not padded)
    for layout in (dense, tight):
        assert torch.equal(cutlass_block_gemm(x_q, w_q, layout, ws, None, torch.bfloat16, config), want)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(block_built):
    import torch

    from fp8_backends.providers.cutlass.block_ops import cutlass_block_gemm

    for config, m in (("bw_sk128x16_swap", 4), ("bw_sk128x64_swap", 40), ("bw_coop128x128_c1x2", 1000)):
        x_q, xs, w_q, ws = _block_data(m, 2112, 7168)
        cutlass_block_gemm(x_q, w_q, xs, ws, None, torch.bfloat16, config)  # loaded before capture
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            y = cutlass_block_gemm(x_q, w_q, xs, ws, None, torch.bfloat16, config)
        torch.cuda.current_stream().wait_stream(stream)
        x2, xs2, _, _ = _block_data(m, 2112, 7168, seed=1)
        x_q.copy_(x2)
        xs.copy_(xs2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, cutlass_block_gemm(x_q, w_q, xs, ws, None, torch.bfloat16, config)), config
        assert _relerr(y, block_reference(x_q, xs, w_q, ws)) < _TOL["bfloat16"]


@pytest.mark.gpu
def test_torch_compile_traces_the_op(block_built):
    import torch

    from fp8_backends.providers.cutlass.block_ops import cutlass_block_gemm

    def f(x_q, w_q, xs, ws):
        return cutlass_block_gemm(x_q, w_q, xs, ws, None, torch.bfloat16, "auto") * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for m in (3, 70):
        x_q, xs, w_q, ws = _block_data(m, 576, 7168)
        assert torch.equal(compiled(x_q, w_q, xs, ws), f(x_q, w_q, xs, ws))


@pytest.mark.gpu
def test_bad_inputs_give_one_library_error(block_built):
    import torch

    from fp8_backends.providers.cutlass.block_ops import cutlass_block_gemm

    x_q, xs, w_q, ws = _block_data(4, 256, 512)
    big = torch.zeros(2 * 512 * 4 + 8, dtype=torch.uint8, device="cuda")
    odd = big[8:8 + 4 * 512].view(torch.float8_e4m3fn).view(4, 512)
    with pytest.raises(InvalidInputError, match="16-byte aligned"):
        cutlass_block_gemm(odd, w_q, xs, ws)
    with pytest.raises(InvalidInputError, match=r"x_scale must be \[M, ceil\(K/128\)\]"):
        cutlass_block_gemm(x_q, w_q, xs[:, :1], ws)
    with pytest.raises(InvalidInputError, match=r"w_scale"):
        cutlass_block_gemm(x_q, w_q, xs, ws[:1])
    with pytest.raises(InvalidInputError, match="both scales fp32"):
        cutlass_block_gemm(x_q, w_q, xs, ws.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["auto", "bw_sk128x16_swap", "bw_coop128x128_c1x2"])
def test_provider_prepares_block_weights_once_and_serves_block_gemms(block_built, config):
    import torch

    b = CutlassSm90Backend(config=config)
    for m, n, k in ((1, 2112, 7168), (33, 576, 7168), (300, 208, 1008)):
        x_q, xs, w_q, ws = _block_data(m, n, k)
        prepared = b.prepare_weight(w_q, ws.to(torch.bfloat16))  # checkpoints may store bf16 block scales
        assert prepared.weight_scale is WeightScale.BLOCK and prepared.scale.dtype == torch.float32
        assert prepared.block == (128, 128) and prepared.group_size == 128
        assert prepared.data is w_q
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        y = b.gemm(x_q, prepared, xs, out_dtype=torch.bfloat16, bias=bias)
        ref = block_reference(x_q, xs, w_q, prepared.scale, bias)
        assert _relerr(y, ref) < _TOL["bfloat16"], (config, m, n, k)


def _native_backend():
    """``(the loaded C++ op, a cutlass provider whose ops are loaded)``; skipped where the C++ op is switched off."""
    from fp8_backends.providers.cutlass import native_op

    if not native_op.enabled():
        pytest.skip("FP8_BACKENDS_CUTLASS_NATIVE=0")
    native = native_op.load("cuda")
    b = CutlassSm90Backend()
    b._loaded_op()
    return native, b


@pytest.mark.gpu
def test_native_block_op_serves_the_provider_with_the_python_ops_bits(block_built):
    """Where the C++ op loads, the provider's block GEMM is its ``cutlass_sm90_block_gemm_native``: the first call of
    a shape and bucket goes through the Python op (which registers the library), the next ones are served in C++ with
    the same bits, eager, compiled and in a CUDA graph; a scale layout the kernel cannot read is handed to the Python
    op (which copies it), and a bad input still raises the library's error."""
    import torch

    from fp8_backends.core import group_scales
    from fp8_backends.providers.cutlass.block_ops import cutlass_block_gemm

    native, b = _native_backend()
    assert b._block_op is native.block_op
    for m, n, k in ((1, 2112, 7168), (37, 576, 7168), (300, 208, 1008), (1000, 6144, 4096)):
        x_q, xs, w_q, ws = _block_data(m, n, k)
        prepared = b.prepare_weight(w_q, ws)
        tma = group_scales.to_layout(xs.contiguous(), ScaleLayout.M_MAJOR_TMA)
        want = cutlass_block_gemm(x_q, w_q, tma, prepared.scale, None, torch.bfloat16, "auto")  # the Python op
        b.gemm(x_q, prepared, tma)  # registers the shape's bucket
        served, handed = native.calls()
        got = b.gemm(x_q, prepared, tma)
        assert native.calls() == (served + 1, handed), (m, n, k, native.calls(), served, handed)
        assert torch.equal(got, want), (m, n, k)
        row_major = xs.contiguous()  # the kernel reads M-major scales: handed over (M > 1), copied, same bits
        got = native.block_op(x_q, w_q, row_major, prepared.scale, None, torch.bfloat16, "auto")
        assert torch.equal(got, want) and native.calls()[1] == handed + (m > 1), (m, native.calls(), handed)
    compiled = torch.compile(lambda x, s: b.gemm(x, prepared, s), fullgraph=True)
    served = native.calls()[0]
    assert torch.equal(compiled(x_q, tma), want) and native.calls()[0] > served
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = b.gemm(x_q, prepared, tma)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
    with pytest.raises(InvalidInputError, match="both scales fp32"):
        native.block_op(x_q, w_q, tma.to(torch.bfloat16), prepared.scale, None, torch.bfloat16, "auto")


@pytest.mark.gpu
def test_provider_takes_every_scale_layout_and_refuses_the_wrong_config_family(block_built):
    import torch

    from fp8_backends.core import group_scales

    b = CutlassSm90Backend()
    x_q, xs, w_q, ws = _block_data(37, 576, 7168)
    prepared = b.prepare_weight(w_q, ws)
    want = b.gemm(x_q, prepared, xs)
    for layout in ScaleLayout:
        assert torch.equal(b.gemm(x_q, prepared, group_scales.to_layout(xs.contiguous(), layout)), want), layout
    with pytest.raises(InvalidInputError, match="per-tensor / row-wise kernel"):
        CutlassSm90Backend(config="ws64x16_swap").prepare_weight(w_q, ws)
    with pytest.raises(InvalidInputError):
        CutlassSm90Backend(config="bw_pp64x128").prepare_weight(w_q, torch.ones(1, device="cuda"))


def test_fused_block_linear_hooks_follow_the_cpp_op(monkeypatch):
    """The provider hands block weights' unquantized activations to its C++ block linear op (groups of 128, eager and
    compiled, M up to its bound) where that op loaded, and declines without it or above the bound; ``auto``'s host
    model counts the fused call where the C++ op is expected."""
    from types import SimpleNamespace

    import torch

    from fp8_backends.providers.cutlass import native_op
    from fp8_backends.providers.cutlass.backend import FUSED_BLOCK_MAX_M

    b = CutlassSm90Backend()
    block = SimpleNamespace(weight_scale=WeightScale.BLOCK, group_size=128, data="w", scale="s")
    group = ActScale.PER_TOKEN_GROUP
    assert b.traced_fused_quant_max_m(block, group) == 0  # no C++ op loaded
    assert b.bind_fused_quant_gemm(block, group, None, torch.bfloat16, None)("x") is None
    calls = []
    b._block_linear_op = lambda *args: calls.append(args) or "served"
    b._linear_op = object()
    assert b.traced_fused_quant_max_m(block, group) == FUSED_BLOCK_MAX_M
    b.fused_act_quant = frozenset(CutlassSm90Backend.fused_act_quant | {group, ActScale.PER_TOKEN})
    assert b.fuses_act_quant(group, False) and not b.fuses_act_quant(group, True)  # graphs: the Triton kernel first
    assert b.fuses_act_quant(ActScale.PER_TOKEN, True)
    assert b.traced_fused_quant_max_m(block, ActScale.PER_TOKEN) == 0
    assert b.traced_fused_quant_max_m(SimpleNamespace(**{**vars(block), "group_size": 64}), group) == 0
    assert b.traced_fused_quant_max_m(SimpleNamespace(**{**vars(block), "weight_scale": WeightScale.PER_CHANNEL}),
                                      group) == 0
    assert b.traced_fused_quant_gemm_impl("x", block, group, None, torch.bfloat16, "bias") == "served"
    assert calls[-1] == ("x", "w", "s", "bias", torch.bfloat16, "auto")
    x2 = torch.zeros(FUSED_BLOCK_MAX_M, 8)
    assert b.fused_quant_gemm_impl(x2, block, group, None, torch.float16, None) == "served"
    assert calls[-1] == (x2, "w", "s", None, torch.float16, "auto")
    # above the bound the eager call declines (the library's quantization, then the GEMM)
    assert b.fused_quant_gemm_impl(torch.zeros(FUSED_BLOCK_MAX_M + 1, 8), block, group, None, torch.float16,
                                   None) is None
    assert CutlassSm90Backend(config="bw_pp64x128").bind_fused_quant_gemm(block, group, None, torch.bfloat16,
                                                                          None)("x") is None  # no op on that one
    monkeypatch.setattr(native_op, "expected", lambda: True)
    assert CutlassSm90Backend.block_fused_host_us_for(512, {"config": "auto"}) == CutlassSm90Backend.block_fused_host_us
    assert CutlassSm90Backend.block_fused_host_us_for(1, {"config": "bw_pp64x128"}) is not None
    assert CutlassSm90Backend.block_fused_host_us_for(1, {"config": "ws64x16_swap"}) is None
    assert CutlassSm90Backend.block_fused_host_us_for(FUSED_BLOCK_MAX_M + 1, {"config": "auto"}) is None
    assert CutlassSm90Backend.block_fused_host_us_for(1, {"config": "auto", "fused_quant": "false"}) is None
    monkeypatch.setattr(native_op, "expected", lambda: False)
    assert CutlassSm90Backend.block_fused_host_us_for(512, {"config": "auto"}) is None


@pytest.fixture(scope="module")
def table_built():
    """The block libraries the default table picks, bf16 outputs (what a bf16 model runs), built once."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cutlass provider runs on SM 9.0 only")
    specs = build.block_specs_for(sorted(block_configs.active_block_table().config_names()))
    failed = {s.name: r for s, r in build.build_many([s for s in specs if build.locate(s) is None]).items()
              if isinstance(r, BuildError)}
    assert not failed, failed
    return True


@pytest.mark.gpu
def test_native_block_linear_op_quantizes_as_the_reference_then_runs_the_same_gemm(table_built):
    """``cutlass_sm90_block_linear_native`` on the unquantized activation gives the bits of the library's group
    quantization (:func:`fp8_backends.quant.quantize`: correctly rounded divisions, as this op's kernel) followed by
    the block GEMM (same codes and scales, same kernel), for bf16 / fp16 / fp32 inputs of any strides and ragged K,
    within the GEMM's bound of the torch reference (whose CUDA division by a Python scalar multiplies by the
    reciprocal: a scale one bit apart, a code one step apart at a rounding tie); a processed layer runs it as one call
    eager, compiled (Inductor calls the op) and in a CUDA graph."""
    import torch

    from fp8_backends import quant
    from fp8_backends.core import group_scales, reference
    from fp8_backends.layers import Fp8Linear

    native, b = _native_backend()
    assert b._block_linear_op is native.block_linear_op
    f8 = torch.float8_e4m3fn
    for m, n, k, dtype in ((1, 2112, 7168, torch.bfloat16), (37, 576, 7168, torch.float16),
                           (300, 208, 1008, torch.float32), (1000, 6144, 4096, torch.bfloat16)):
        _, _, w_q, ws = _block_data(m, n, k)
        prepared = b.prepare_weight(w_q, ws)
        wide = torch.randn(m, k + 24, device="cuda", dtype=dtype) * 3
        for x in (wide[:, :k].contiguous(), wide[:, :k], wide[:, :k].t().contiguous().t()):
            qa = quant.quantize(x.contiguous(), ActScale.PER_TOKEN_GROUP, group_size=128,
                                scale_layout=ScaleLayout.M_MAJOR_TMA)
            want = b.gemm(qa.data, prepared, qa.scale)
            got = native.block_linear_op(x, w_q, prepared.scale, None, torch.bfloat16, "auto")
            assert torch.equal(got, want), (m, n, k, dtype, x.stride())
            x_q, xs = reference.quantize_groups(x.contiguous(), 128, f8, 448.0)
            ref = b.gemm(x_q, prepared, group_scales.to_layout(xs, ScaleLayout.M_MAJOR_TMA))
            assert _relerr(got, ref) < _TOL["bfloat16"], (m, n, k, dtype, _relerr(got, ref))
    served = native.calls()[0]
    native.block_linear_op(x, w_q, prepared.scale, None, torch.bfloat16, "auto")
    assert native.calls()[0] == served + 1  # served in C++ (quantization and GEMM), not handed to Python

    linear = torch.nn.Linear(4096, 6144, bias=True, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear, weight_scale="block", backend="cutlass")
    x = torch.randn(2, 129, 4096, device="cuda", dtype=torch.bfloat16)
    want = layer(x)
    served, handed = native.calls()
    assert torch.equal(layer(x), want) and native.calls() == (served + 1, handed)  # one C++ call, no quant op
    compiled = torch.compile(layer, fullgraph=True)
    from torch._inductor.utils import run_and_get_code

    got, codes = run_and_get_code(compiled, x)
    assert torch.equal(got, want) and any("cutlass_sm90_block_linear_native" in c for c in codes)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        y = layer(x)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, layer(x))
