"""`python -m fp8_backends.list` (both formats, subprocess and in-process), the argparse flags, import cost."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

import fp8_backends
from fp8_backends import GemmProblem, UnsupportedProblemError
from fp8_backends import list as listing


def _run_list(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "fp8_backends.list", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_listing_text_subprocess_exit_zero():
    proc = _run_list()
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "FP8 GEMM providers" in out and "RMSNorm+FP8-quant providers" in out
    assert "torch_scaled_mm (torch)" in out and "fp8-backends" in out


def test_listing_json_schema_subprocess_with_simulation():
    proc = _run_list("--json", "--simulate-sm", "8.0", "--problem", "16,4096,4096")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["schema"] == "fp8_backends.list/1"
    assert data["platform"]["simulated"] and data["platform"]["sm"] == "8.0"
    gemm = [p for p in data["providers"] if p["kind"] == "gemm" and p["name"] == "torch_scaled_mm"][0]
    assert gemm["builtin"] and not gemm["usable"] and "needs SM >= 8.9" in gemm["reasons"][0]
    assert set(gemm["capabilities"]) >= {"devices", "arch", "pdl", "priority", "act_scales", "weight_scales",
                                         "input_dtypes", "out_dtypes", "bias", "k_align", "n_align"}
    res = data["resolution"]["gemm"]
    assert res["chosen"] is None and "UnsupportedProblemError" in res["error"]
    assert res["problem"].startswith("M=16 N=4096 K=4096")


def test_listing_shows_plugins_blocked_and_disabled(thirdparty_plugin, monkeypatch, capsys):
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "toy")
    assert listing.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by = {(p["name"], p["distribution"]): p for p in data["providers"]}
    assert by[("toy", "fp8-backends-testplugin")]["disabled"]
    assert by[("broken", "fp8-backends-testplugin")]["status"] == "failed"
    assert data["env"]["FP8_BACKENDS_DISABLED"] == "toy"
    # with `toy` disabled, two entries named torch_scaled_mm can serve on the CPU: auto ranks them (the
    # built-in wins on priority) and the listing names the clash
    res = data["resolution"]["gemm"]
    assert res["error"] is None and res["chosen"] == "torch_scaled_mm" and res["chosen_distribution"] == "fp8-backends"
    assert data["clashes"]["gemm"] == [{"name": "torch_scaled_mm",
                                        "distributions": ["fp8-backends", "fp8-backends-testplugin"],
                                        "qualified": ["fp8-backends:torch_scaled_mm",
                                                      "fp8-backends-testplugin:torch_scaled_mm"]}]
    monkeypatch.setenv("FP8_BACKENDS_PLUGINS", "")
    from fp8_backends.registry import discovery

    discovery.refresh()
    assert listing.main([]) == 0
    text = capsys.readouterr().out
    assert "blocked" in text and "toy" in text
    assert "-> torch_scaled_mm" in text


def test_listing_problem_explains_rejections(capsys):
    assert listing.main(["--simulate-sm", "9.0", "--problem", "16,4096,4096", "--out-dtype", "float16",
                         "--act-scale", "per_token", "--weight-scale", "per_channel"]) == 0
    out = capsys.readouterr().out
    assert "row-wise FP8 kernel writes bfloat16 only" in out


def test_listing_states_the_measured_defaults(capsys, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")  # the defaults serve GPUs without shipped data
    assert listing.main(["--simulate-sm", "9.0"]) == 0
    assert "measured default: M <= 16 -> triton" in capsys.readouterr().out
    assert listing.main(["--simulate-sm", "10.0"]) == 0
    assert "measured default" not in capsys.readouterr().out


def test_listing_exits_non_zero_when_an_explicit_choice_fails(capsys, monkeypatch):
    proc = _run_list("--gemm-backend", "nosuch")
    assert proc.returncode == 1, proc.stdout
    assert "FP8 GEMM providers" in proc.stdout  # the listing still prints, with the reason
    assert "unknown GEMM backend 'nosuch'" in proc.stderr
    assert listing.main(["--norm-quant-backend", "nosuch"]) == 1
    assert listing.main(["--gemm-backend", "torch", "--norm-quant-backend", "torch"]) == 0
    # e5m2 x e5m2: cuBLASLt has no such GEMM (torch's CPU _scaled_mm has)
    e5m2 = ["--input-dtype", "e5m2", "--weight-dtype", "e5m2", "--problem", "4,32,32"]
    assert listing.main(["--gemm-backend", "torch", *e5m2, "--simulate-sm", "9.0"]) == 1
    assert listing.main(["--gemm-backend", "torch", *e5m2, "--device", "cpu"]) == 0
    monkeypatch.setenv("FP8_GEMM_BACKEND", "nosuch")
    assert listing.main([]) == 1
    monkeypatch.delenv("FP8_GEMM_BACKEND")
    capsys.readouterr()
    assert listing.main(["--simulate-sm", "8.0"]) == 0  # auto finding nothing is information, not an error
    assert "needs SM >= 8.9" in capsys.readouterr().out


@pytest.mark.parametrize("var", ["FP8_BACKENDS_PDL", "FP8_BACKENDS_CHECK_SCALES", "FP8_BACKENDS_TUNE",
                                 "FP8_BACKENDS_DEFAULTS", "FP8_BACKENDS_FLASHINFER_AUTOTUNE",
                                 "FP8_BACKENDS_BUILD_JOBS"])
def test_listing_exits_non_zero_on_a_bad_environment_value(var, capsys, monkeypatch):
    """A variable the listing would not otherwise read (no kernel launched, no build, a simulated SM where the
    measured defaults apply) still fails it with the variable's name."""
    monkeypatch.setenv(var, "maybe")
    assert listing.main(["--simulate-sm", "9.0", "--problem", "16,4096,4096"]) == 1
    assert f"{var}='maybe' is not valid" in capsys.readouterr().err


def test_build_jobs_must_be_positive(capsys):
    from fp8_backends import build

    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as exit_:
            build.main(["cutlass", "--jobs", bad])
        assert exit_.value.code == 2 and "--jobs" in capsys.readouterr().err


def test_listing_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        listing.main(["--problem", "1,2"])
    assert info.value.code == 2


@pytest.mark.parametrize(("args", "named"), [
    (["--act-scale", "per_token_group", "--bias"], "--act-scale, --bias describe the problem of --problem"),
    (["--weight-scale", "block", "--norm-problem", "4,256"], "--weight-scale describes the problem of --problem"),
    (["--objective", "host"], "--objective describes the problem of --problem"),
    (["--residual", "--problem", "1,256,256"], "--residual describes the problem of --norm-problem"),
])
def test_a_problems_option_without_its_problem_is_refused_not_ignored(args, named, capsys):
    with pytest.raises(SystemExit) as info:
        listing.main(args)
    assert info.value.code == 2 and named in capsys.readouterr().err


def test_argparse_flag_choices_and_resolution(thirdparty_plugin):
    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser)
    help_text = " ".join(parser.format_help().split())
    assert "--fp8-gemm-backend" in help_text and "--fp8-norm-quant-backend" in help_text
    assert "toy" in help_text and "broken (unavailable)" in help_text
    args = parser.parse_args(["--fp8-gemm-backend", "torch", "--fp8-norm-quant-backend", "toy_norm"])
    gemm, norm = fp8_backends.backends_from_args(args, gemm_problem=GemmProblem(n=32, k=32, device="cpu"))
    assert gemm.name == "torch_scaled_mm" and norm.name == "toy_norm"
    args = parser.parse_args(["--fp8-gemm-backend", "toy@flavour=spicy"])
    assert fp8_backends.backends_from_args(args)[0].config == {"flavour": "spicy"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--fp8-gemm-backend", "nope"])
    args = parser.parse_args([])
    assert args.fp8_gemm_backend is None  # env var / auto decide at resolution time


def test_help_names_each_provider_once_with_its_distribution_where_names_clash(thirdparty_plugin, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps long lines at hyphens (fp8-backends-...)
    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser)
    help_text = " ".join(parser.format_help().split())
    here = help_text.split("Here: ")[1].split(". --fp8-norm-quant-backend")[0].split(", ")
    assert "fp8-backends:torch_scaled_mm" in here and "fp8-backends-testplugin:torch_scaled_mm" in here
    assert len([p for p in here if "torch_scaled_mm" in p]) == 2  # each once, qualified
    assert len(here) == len(set(here))
    # a provider whose support check raises, one that failed to load, one whose probe raises: not usable
    for name in ("badcheck", "broken", "raising"):
        assert f"{name} (unavailable)" in here, here
    assert "toy" in here
    choices = help_text.split("{")[1].split("}")[0].split(", ")
    assert choices.count("torch_scaled_mm") == 1


def test_help_marks_providers_that_cannot_run_on_this_machine():
    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser)
    help_text = " ".join(parser.format_help().split())
    import torch

    if not torch.cuda.is_available():
        assert "cutlass (unavailable)" in help_text and "flashinfer_bmm (unavailable)" in help_text


def test_flag_choice_that_cannot_serve_fails_loudly():
    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser)
    args = parser.parse_args(["--fp8-gemm-backend", "torch_scaled_mm"])
    with pytest.raises(UnsupportedProblemError, match="cuBLASLt has no e5m2 x e5m2 FP8 GEMM"):
        fp8_backends.backends_from_args(args, gemm_problem=GemmProblem(n=32, k=32, input_dtype="e5m2",
                                                                       weight_dtype="e5m2"),
                                        platform=fp8_backends.simulate_platform("9.0"))


def test_import_is_light():
    code = (
        "import sys, fp8_backends, fp8_backends.registry.discovery as d;"
        "from fp8_backends.providers import torch_scaled_mm, torch_norm_quant;"
        "d.discover('gemm'); d.discover('norm_quant');"
        "heavy=[m for m in ('torch','triton','flashinfer') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_one_registry_of_environment_variables(monkeypatch, capsys):
    """Every ``FP8_*`` variable the library's code names is in ``settings.ENV_VARS``, the docs' table names each,
    and the listing's ``env`` shows each one that is set."""
    import re
    from pathlib import Path

    from fp8_backends.core import settings

    root = Path(__file__).resolve().parents[1]
    names = {var.name for var in settings.ENV_VARS}
    assert len(names) == len(settings.ENV_VARS)
    for folder in ("fp8_backends", "registry", "providers"):
        for path in (root / folder).rglob("*.py"):
            for name in re.findall(r"""["'](FP8_[A-Z_]+)["']""", path.read_text()):
                assert name in names, f"{path}: {name} is not in fp8_backends.core.settings.ENV_VARS"
    table = (root / "docs" / "user-guide" / "environment.md").read_text()
    assert not [name for name in names if f"`{name}" not in table and f", `{name}`" not in table]
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(settings.TRITON_TABLE_ENV, "/nowhere/table.json")
    monkeypatch.setenv(settings.BUILD_JOBS_ENV, "2")
    assert listing.main(["--json"]) == 1  # a table that cannot be read fails auto (never passed over silently)
    data = json.loads(capsys.readouterr().out)
    assert data["env"] == {settings.TRITON_TABLE_ENV: "/nowhere/table.json", settings.BUILD_JOBS_ENV: "2"}
    assert data["resolution"]["gemm"]["error"].startswith("ConfigurationError: FP8_BACKENDS_TRITON_TABLE")
    from fp8_backends import GemmProblem, resolve_gemm_backend
    from fp8_backends.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="FP8_BACKENDS_TRITON_TABLE"):
        resolve_gemm_backend(problem=GemmProblem(n=64, k=64, m=4, device="cpu"))


def test_cache_dir_is_shared(monkeypatch, tmp_path):
    """One cache folder (``FP8_BACKENDS_CACHE_DIR``) for the lockfile, CUTLASS builds and flashinfer."""
    from fp8_backends.core import settings
    from fp8_backends.providers.cutlass import build
    from fp8_backends.providers.flashinfer import common as flashinfer_common
    from fp8_backends.registry import lockfile

    monkeypatch.delenv(settings.CUTLASS_CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(settings.CACHE_DIR_ENV, raising=False)
    home = tmp_path / "home" / ".cache" / "fp8_backends"
    assert (lockfile.default_lockfile_path(), build.cache_dir(), flashinfer_common.cache_dir()) == (
        home / "selection.lock.json", home / "cutlass", home)
    monkeypatch.setenv(settings.CACHE_DIR_ENV, str(tmp_path / "mine"))
    monkeypatch.setenv(settings.LOCKFILE_ENV, "")
    mine = tmp_path / "mine"
    assert (lockfile.lockfile_path(), build.cache_dir(), flashinfer_common.cache_dir()) == (
        mine / "selection.lock.json", mine / "cutlass", mine)
    monkeypatch.setenv(settings.CUTLASS_CACHE_ENV, str(tmp_path / "cut"))
    assert build.cache_dir() == tmp_path / "cut"


def test_text_table():
    from bench.common import console_table
    from fp8_backends.core.text_table import text_table

    assert console_table is text_table
    assert text_table(["a", "long"], [["xyz", 1], ["", None]]) == "a    long\n---  ----\nxyz  1\n     None"


@pytest.mark.parametrize("args", [["--simulate-sm", "9.0"], ["--simulate-sm", "10.0", "--json"]])
def test_listing_a_simulated_sm_loads_no_provider(args):
    """On a simulated GPU nothing is preloaded: the listing imports no torch or triton (the providers ``auto`` picks
    there define their ops on load)."""
    code = ("import sys, io, contextlib, fp8_backends.list as listing\n"
            f"with contextlib.redirect_stdout(io.StringIO()): rc = listing.main({args!r})\n"
            "print(rc, [m for m in ('torch', 'triton') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0 []"


def test_listing_exits_1_on_a_bad_simulated_sm_variable_and_2_on_a_bad_flag(capsys, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_SIMULATE_SM", "abc")
    assert listing.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ConfigurationError: FP8_BACKENDS_SIMULATE_SM='abc' is not valid")
    assert "usage" not in err
    monkeypatch.delenv("FP8_BACKENDS_SIMULATE_SM")
    with pytest.raises(SystemExit) as info:
        listing.main(["--simulate-sm", "abc"])
    assert info.value.code == 2


def test_a_cuda_platform_without_a_device_is_never_described_as_sm_cpu(capsys):
    from fp8_backends.core.platform import Platform
    from fp8_backends.core.types import DeviceKind

    absent = Platform(kind=DeviceKind.CUDA, name="no CUDA device")
    assert absent.arch == "none" and absent.describe() == "no CUDA device"
    data = listing.collect(absent)
    text = listing.render(data)
    assert text.splitlines()[0] == "platform: no CUDA device; PDL no" and "SM cpu" not in text
