"""Modules that moved stay importable at their old paths (deprecation shims re-exporting the new ones)."""

from __future__ import annotations

import importlib
import sys

import pytest


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_registry_settings_shim():
    from fp8_backends.core import settings

    with pytest.warns(DeprecationWarning, match="fp8_backends.core.settings"):
        old = _fresh_import("fp8_backends.registry.settings")
    assert old.cache_dir is settings.cache_dir and old.env_flag is settings.env_flag
    assert old.LOCKFILE_ENV == settings.LOCKFILE_ENV and old.EnvFlag is settings.EnvFlag


@pytest.mark.parametrize(("old", "new", "names"), [
    ("fp8_backends.providers.flashinfer_bmm", "fp8_backends.providers.flashinfer.gemm", ["FlashinferBmmBackend"]),
    ("fp8_backends.providers.flashinfer_norm_quant", "fp8_backends.providers.flashinfer.norm_quant",
     ["FlashinferNormQuantBackend", "fused_add_smem_bytes"]),
    ("fp8_backends.providers._flashinfer_common", "fp8_backends.providers.flashinfer.common",
     ["cache_dir", "base_availability", "AUTOTUNE_ENV", "RUNNERS"]),
])
def test_flashinfer_provider_shims(old, new, names):
    module = importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=new):
        shim = _fresh_import(old)
    for name in names:
        assert getattr(shim, name) is getattr(module, name)


def test_flashinfer_ops_shim():
    pytest.importorskip("torch")
    from fp8_backends.providers.flashinfer import gemm_ops, norm_ops

    with pytest.warns(DeprecationWarning, match="gemm_ops"):
        shim = _fresh_import("fp8_backends.providers._flashinfer_ops")
    assert shim.gemm_op is gemm_ops.gemm_op and shim.rmsnorm_quant_op is norm_ops.rmsnorm_quant_op
    assert shim.fused_add_rmsnorm_quant_op is norm_ops.fused_add_rmsnorm_quant_op
    assert shim.reset_plans is gemm_ops.reset_plans


def test_entry_point_names_unchanged():
    from importlib.metadata import entry_points

    def names(group):
        return {ep.name: ep.value for ep in entry_points(group=group) if ep.value.startswith("fp8_backends.")}

    assert names("fp8_backends.gemm") == {
        "torch_scaled_mm": "fp8_backends.providers.torch_scaled_mm:TorchScaledMMBackend",
        "cutlass": "fp8_backends.providers.cutlass.backend:CutlassSm90Backend",
        "flashinfer_bmm": "fp8_backends.providers.flashinfer.gemm:FlashinferBmmBackend",
        "triton": "fp8_backends.providers.triton.gemm:TritonGemmBackend",
    }
    assert names("fp8_backends.norm_quant") == {
        "torch": "fp8_backends.providers.torch_norm_quant:TorchNormQuantBackend",
        "flashinfer": "fp8_backends.providers.flashinfer.norm_quant:FlashinferNormQuantBackend",
        "triton": "fp8_backends.providers.triton.norm_quant:TritonNormQuantBackend",
    }


def test_dispatch_shim():
    from fp8_backends.core import bucket_tables

    with pytest.warns(DeprecationWarning, match="bucket_tables"):
        old = _fresh_import("fp8_backends.dispatch")
    assert old.BucketTable is bucket_tables.BucketTable and old.TableSource is bucket_tables.TableSource


@pytest.mark.parametrize(("old", "new"), [
    ("fp8_backends.timing", "fp8_backends.tuning.timing"),
    ("fp8_backends.workloads", "fp8_backends.tuning.workloads"),
    ("fp8_backends.models", "fp8_backends.tuning.models"),
    ("fp8_backends.tune_plan", "fp8_backends.tuning.plan"),
    ("fp8_backends.grid", "fp8_backends.tuning.grid"),
])
def test_tuning_module_shims(old, new):
    """The moved tuning modules answer at their old names: the same module object."""
    module = importlib.import_module(new)
    with pytest.warns(DeprecationWarning, match=new):
        shim = _fresh_import(old)
    assert shim is module


def test_tune_cli_keeps_the_engine_names():
    from fp8_backends import tune
    from fp8_backends.tuning import engine, plan

    for name in ("tune", "measure_candidates", "select_winner", "CandidateResult", "ProblemResult", "TuneReport",
                 "format_summary", "format_rejections"):
        assert getattr(tune, name) is getattr(engine, name)
    assert tune.parse_m_list is plan.parse_m_list and tune.QUICK_M_BUCKETS == plan.QUICK_M_BUCKETS


def test_registry_tuning_shim():
    """The old lockfile-and-policy module answers with both halves' names."""
    from fp8_backends.registry import lockfile, lockfile_policy
    from fp8_backends.tuning import first_use

    with pytest.warns(DeprecationWarning, match="lockfile_policy"):
        old = _fresh_import("fp8_backends.registry.tuning")
    for name in ("SCHEMA", "DEFAULT_M_BUCKETS", "DEFAULT_TIE_MARGIN", "bucket_for", "default_lockfile_path",
                 "describe_lockfile", "entry_key", "lockfile_path", "platform_key", "problem_fields", "problem_key",
                 "read_document", "update_document", "validate_document", "write_entries", "SectionIndex",
                 "current_key", "reset_state", "covered_buckets", "new_document", "key_digest", "_store"):
        assert getattr(old, name) is getattr(lockfile, name), name
    for name in ("POLICY_NAME", "lockfile_policy", "pick_from_entry", "tune_at_first_use"):
        assert getattr(old, name) is getattr(lockfile_policy, name), name
    assert not first_use.active()


CORE_MOVED = ("types", "errors", "settings", "capabilities", "validation", "output_contract", "reference", "backend",
              "oplib", "bucket_tables", "text_table")


@pytest.mark.parametrize("name", CORE_MOVED)
def test_core_module_shims(name):
    """The contract modules moved to ``fp8_backends.core`` answer at their old names: the same module object, with a
    DeprecationWarning on the first import only."""
    module = importlib.import_module(f"fp8_backends.core.{name}")
    with pytest.warns(DeprecationWarning, match=f"fp8_backends.{name} moved to fp8_backends.core.{name}"):
        shim = _fresh_import(f"fp8_backends.{name}")
    assert shim is module
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(f"fp8_backends.{name}") is module  # once: the second import is silent


def test_core_shims_keep_identity():
    """Classes, enums and errors are the same objects at both paths: isinstance and ``except`` keep working."""
    from fp8_backends.core import backend, errors, types

    with pytest.warns(DeprecationWarning):
        old_types = _fresh_import("fp8_backends.types")
    with pytest.warns(DeprecationWarning):
        old_errors = _fresh_import("fp8_backends.errors")
    with pytest.warns(DeprecationWarning):
        old_backend = _fresh_import("fp8_backends.backend")
    assert old_types.GemmProblem is types.GemmProblem and old_types.Fp8Dtype is types.Fp8Dtype
    problem = old_types.GemmProblem(n=16, k=32)
    assert isinstance(problem, types.GemmProblem) and list(old_types.Fp8Dtype) == list(types.Fp8Dtype)
    assert old_backend.Fp8GemmBackend is backend.Fp8GemmBackend
    with pytest.raises(old_errors.UnknownBackendError):
        raise errors.UnknownBackendError("x", "gemm", ["torch"])
    with pytest.raises(errors.Fp8BackendError):
        raise old_errors.InvalidInputError("x")
    import fp8_backends

    assert fp8_backends.GemmProblem is types.GemmProblem and fp8_backends.Fp8BackendError is errors.Fp8BackendError


#: every deprecated module path (the shims); nothing but this file may import one
OLD_PATHS = (*(f"fp8_backends.{n}" for n in CORE_MOVED), "fp8_backends.dispatch", "fp8_backends.timing",
             "fp8_backends.workloads", "fp8_backends.models", "fp8_backends.tune_plan", "fp8_backends.grid",
             "fp8_backends.registry.settings", "fp8_backends.registry.tuning", "fp8_backends.providers.flashinfer_bmm",
             "fp8_backends.providers.flashinfer_norm_quant", "fp8_backends.providers._flashinfer_common",
             "fp8_backends.providers._flashinfer_ops")


def test_nothing_else_names_an_old_path():
    """The library, its tests, benchmarks, examples and README use the new paths (a shim names its own old path).
    The scripts archived with results under ``bench/results/`` stay as they were run (the shims keep them working)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dotted = re.compile(r"\b(" + "|".join(re.escape(p) for p in OLD_PATHS) + r")\b(?!\w)")
    leaves = {p.rpartition(".")[2] for p in OLD_PATHS if p.count(".") == 1}
    from_import = re.compile(r"^\s*from fp8_backends import \(?([^)\n]*(?:\n[^)\n]*)*?)\)?\s*$", re.M)
    files = [p for d in ("fp8_backends", "registry", "providers", "tests", "bench", "examples")
             for p in (root / d).rglob("*.py") if "__pycache__" not in p.parts
             and not p.relative_to(root).as_posix().startswith("bench/results/")]  # archived as they were run
    found = []
    for path in [*files, root / "README.md"]:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        if text.lstrip().startswith('"""Deprecated:'):
            continue  # a shim
        found += [f"{path.relative_to(root)}: {m.group(0)}" for m in dotted.finditer(text)
                  if not text[m.end():m.end() + 3].startswith(".py")]
        for m in from_import.finditer(text):
            names = {n.split(" as ")[0].strip() for n in re.split(r"[,\n]", re.sub(r"#[^\n]*", "", m.group(1)))}
            found += [f"{path.relative_to(root)}: from fp8_backends import {n}" for n in sorted(names & leaves)]
    assert not found, "old (deprecated) module paths in use:\n" + "\n".join(found)
