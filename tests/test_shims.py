"""Modules that moved stay importable at their old paths (deprecation shims re-exporting the new ones)."""

from __future__ import annotations

import importlib
import sys

import pytest


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_registry_settings_shim():
    from fp8_backends import settings

    with pytest.warns(DeprecationWarning, match="fp8_backends.settings"):
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
    from fp8_backends import bucket_tables

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
