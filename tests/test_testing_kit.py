"""The conformance kit itself (``fp8_backends.testing``): it fails deliberately broken providers where it
should, passes the README-style test plugin through a subclass and through ``python -m fp8_backends.testing``,
and its comparisons reject the usual bugs."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fp8_backends.core import reference
from fp8_backends.testing import assert_codes_close, assert_gemm_close, assert_residual_close, provider_from_spec
from fp8_backends.testing.compare import relative_error

torch = pytest.importorskip("torch")

DATA = Path(__file__).parent / "data"
MUTANTS = DATA / "kit_mutants"


def _pytest(args: list[str], cwd: Path, extra_path: list[str] | None = None, timeout: int = 900):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8_")}
    env["FP8_BACKENDS_LOCKFILE"] = "off"
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join([*extra_path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _outcomes(junit: Path) -> dict[str, dict[str, set[str]]]:
    """class -> {"failed": test names, "passed": ..., "skipped": ...} from a junit XML report."""
    out: dict[str, dict[str, set[str]]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "").split("[")[0]
        kinds = {child.tag for child in case}
        state = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        out.setdefault(cls, {"failed": set(), "passed": set(), "skipped": set()})[state].add(name)
    return out


def _expected_failures() -> dict[str, set[str]]:
    tree = ast.parse((MUTANTS / "test_mutants.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.AnnAssign | ast.Assign)
                and "EXPECTED_FAILURES" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target))
    return ast.literal_eval(node.value)


def test_kit_fails_each_broken_provider_where_it_should(tmp_path):
    junit = tmp_path / "mutants.xml"
    done = _pytest(["-q", "-p", "fp8_backends.testing.plugin", "--rootdir", str(MUTANTS), "--confcutdir",
                    str(MUTANTS), "-c", os.devnull,
                    f"--junitxml={junit}", "test_mutants.py"], cwd=MUTANTS, extra_path=[str(MUTANTS)])
    assert junit.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    outcomes = _outcomes(junit)
    expected = _expected_failures()
    assert set(outcomes) == set(expected), sorted(set(outcomes) ^ set(expected))
    for cls, want in expected.items():
        got = outcomes[cls]["failed"]
        assert got == want, f"{cls}: failed {sorted(got)}, expected {sorted(want)}"
        assert outcomes[cls]["passed"], f"{cls}: nothing passed"
    # the correct providers exercise every test of their contract
    assert {"test_matches_reference", "test_edge_shapes", "test_scales_are_applied",
            "test_bad_inputs_raise_library_errors", "test_undeclared_is_refused_before_any_kernel",
            "test_fake_tensor_shapes", "test_torch_compile_fullgraph", "test_declaration",
            "test_module_is_import_light"} <= outcomes["TestGoodGemm"]["passed"]
    assert {"test_rmsnorm_quant_matches_reference", "test_fused_add_matches_reference", "test_scale_magnitudes",
            "test_writes_stay_inside_out_and_residual", "test_fake_tensor_shapes",
            "test_undeclared_is_refused_before_any_kernel"} <= outcomes["TestGoodNorm"]["passed"]


def test_plugin_written_from_the_readme_passes_its_own_conformance_tests(plugin_site, tmp_path):
    junit = tmp_path / "plugin.xml"
    plugin_dir = DATA / "thirdparty_plugin"  # its own rootdir: this repository's pytest settings stay out
    done = _pytest(["-q", "--rootdir", str(plugin_dir), "--confcutdir", str(plugin_dir), "-c", os.devnull,
                    f"--junitxml={junit}", "tests"], cwd=plugin_dir, extra_path=[plugin_site])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    outcomes = _outcomes(junit)
    for cls in ("TestToyGemm", "TestToySpicyGemm", "TestToyNormQuant"):
        assert not outcomes[cls]["failed"] and len(outcomes[cls]["passed"]) >= 10, (cls, outcomes[cls])


def test_kit_runs_against_a_registered_provider_named_on_the_command_line(plugin_site, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8_")}
    env["PYTHONPATH"] = plugin_site
    env["FP8_BACKENDS_LOCKFILE"] = "off"
    done = subprocess.run([sys.executable, "-m", "fp8_backends.testing", "fp8-backends-testplugin:toy_norm",
                           "fp8-backends-testplugin:toy", "--", "-v", "-p", "no:cacheprovider"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    # toy_norm is a norm-quant provider only, toy a GEMM provider only: one contract each
    assert "TestNormQuant0::test_fused_add_matches_reference" in done.stdout
    assert "TestGemm1::test_matches_reference" in done.stdout
    assert "TestGemm0::" not in done.stdout and "TestNormQuant1::" not in done.stdout
    bad = subprocess.run([sys.executable, "-m", "fp8_backends.testing", "fp8-backends-testplugin:broken", "--", "-q",
                          "-p", "no:cacheprovider"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=900)
    assert bad.returncode != 0 and "fp8_backends_testplugin_missing_dependency" in bad.stdout, bad.stdout[-3000:]
    usage = subprocess.run([sys.executable, "-m", "fp8_backends.testing"], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "DIST:NAME" in usage.stderr


def test_provider_from_spec(thirdparty_plugin):
    toy = provider_from_spec("gemm", "fp8_backends_testplugin:toy_alias@flavour=spicy")
    assert toy.name == "toy" and toy.config == {"flavour": "spicy"}
    assert type(provider_from_spec("gemm", "fp8-backends:torch_scaled_mm")).__name__ == "TorchScaledMMBackend"
    from fp8_backends import AmbiguousBackendError, BackendUnavailableError, UnknownBackendError

    with pytest.raises(AmbiguousBackendError, match="qualify it as DIST:NAME"):
        provider_from_spec("gemm", "torch_scaled_mm")
    with pytest.raises(UnknownBackendError):
        provider_from_spec("norm_quant", "toy")
    with pytest.raises(BackendUnavailableError, match="failed"):
        provider_from_spec("gemm", "broken")


# --------------------------------------------------------------------------- the comparisons bite
def _norm_inputs(seed: int = 7):
    from fp8_backends.core.types import OutDtype
    from fp8_backends.testing.norm_quant import norm_inputs

    return norm_inputs(3, 256, OutDtype.BF16, "cpu", seed=seed)


def test_code_comparison_catches_the_usual_bugs():
    """What assert_codes_close must reject: the reference itself with one thing wrong."""
    x, r, w = _norm_inputs()
    s = torch.tensor([0.01])
    good = reference.rmsnorm_quant(x, w, s)
    good_add = reference.fused_add_rmsnorm_quant(x, r, w, s)[0]
    tiny = x * 1e-3  # mean(x²) ~ 1e-6, comparable to eps
    pairs = {
        "no weight": (reference.rmsnorm_quant(x, torch.ones_like(w), s), good),
        "scale multiplied, not divided": (reference.quantize_static(reference.rmsnorm(x, w), 1 / s), good),
        "scale off by 2%": (reference.rmsnorm_quant(x, w, s * 1.02), good),
        "residual not added": (good, good_add),
        "last column not stored": (torch.cat([good[:, :-1], torch.zeros_like(good[:, -1:])], 1), good),
        "eps 1e-6 instead of 1e-5": (reference.rmsnorm_quant(tiny, w, s, 1e-6),
                                     reference.rmsnorm_quant(tiny, w, s, 1e-5)),
        "mean over H + 1": (reference.quantize_static(reference.rmsnorm(x, w) * (257 / 256) ** 0.5, s), good),
    }
    for name, (bad, ref) in pairs.items():
        with pytest.raises(AssertionError):
            assert_codes_close(bad, ref)
            pytest.fail(f"assert_codes_close missed: {name}")
    assert_codes_close(good, good.clone())


def test_gemm_comparison_catches_one_wrong_element_and_accepts_rounding():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(257, 96, generator=g) * 10
    assert_gemm_close(ref.to(torch.bfloat16), ref, torch.bfloat16)  # rounding to the output dtype passes
    assert_gemm_close(ref.half(), ref, torch.float16)
    wrong = ref.clone()
    wrong[256, 95] += 0.1 * ref.abs().max()  # one element of 24672: within the norm tolerance, caught element-wise
    assert relative_error(wrong, ref) < 1e-2
    with pytest.raises(AssertionError, match=r"worst at \[256, 95\]"):
        assert_gemm_close(wrong.to(torch.bfloat16), ref, torch.bfloat16)
    with pytest.raises(AssertionError, match="dtype"):
        assert_gemm_close(ref.half(), ref, torch.bfloat16)
    with pytest.raises(AssertionError, match="shape"):
        assert_gemm_close(ref[:-1].bfloat16(), ref, torch.bfloat16)
    assert_gemm_close(torch.empty(0, 96, dtype=torch.bfloat16), torch.empty(0, 96), torch.bfloat16)
    nan = ref.clone()
    nan[3, 3] = float("nan")
    with pytest.raises(AssertionError, match="non-finite"):
        assert_gemm_close(nan.bfloat16(), ref, torch.bfloat16)


def test_residual_comparison():
    r = torch.randn(4, 64).bfloat16()
    assert_residual_close(r, r.clone())
    nudged = (r.float() * (1 + 2**-8)).bfloat16()
    with pytest.raises(AssertionError, match="residual differs"):
        assert_residual_close(nudged, r)
    assert_residual_close(nudged, r, max_ulps=2)


def test_kit_package_imports_without_torch():
    code = ("import sys, fp8_backends.testing, fp8_backends.testing.plugin;"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("specs", [["fp8-backends:torch_scaled_mmm"], ["fp8-backends:torch_scaled_mm", "nope:typo"],
                                   ["auto"]])
def test_the_command_line_refuses_a_spec_that_names_no_provider(specs, capsys):
    from fp8_backends.testing.__main__ import main

    assert main([*specs, "--", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: UnknownBackendError") and repr(specs[-1]) in err and "registered:" in err


def test_collecting_the_conformance_module_fails_on_an_unknown_spec():
    from fp8_backends.core.errors import UnknownBackendError
    from fp8_backends.testing._base import check_specs

    check_specs(["fp8-backends:torch_scaled_mm", "torch"])
    with pytest.raises(UnknownBackendError, match="'nope:typo'"):
        check_specs(["torch", "nope:typo"])
