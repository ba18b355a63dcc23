"""Every fault contained and reported (issue 18): one library error for every bad input, correct empty results for
valid edge cases, no silent fallback, probe faults, malformed lockfiles.

Each bad input must raise an :class:`~fp8_backends.core.errors.Fp8BackendError` that is also the builtin a generic
handler expects (``ValueError`` for bad values, ``TypeError`` for bad types, ``LookupError`` for malformed backend
requests as before).
"""

from __future__ import annotations

import pytest
import torch

from fp8_backends import (
    BackendOptionError,
    ConfigurationError,
    Fp8BackendError,
    GemmProblem,
    InvalidInputError,
    InvalidTypeError,
    NormQuantProblem,
    UnsupportedProblemError,
    quant,
    resolve_gemm_backend,
    resolve_norm_quant_backend,
    simulate_platform,
)
from fp8_backends.core import reference
from fp8_backends.functional import fp8_linear
from fp8_backends.layers import Fp8Linear, RMSNormFp8Quant
from fp8_backends.registry.platform import detect_platform

E4 = torch.float8_e4m3fn
CPU_GEMM = GemmProblem(n=32, k=32, device="cpu")
CPU_NORM = NormQuantProblem(hidden=32, device="cpu")
MODES = ("per_tensor_static", "per_tensor_dynamic", "per_token")


def raises_library(builtin: type | tuple[type, ...], fn, match: str | None = None) -> Fp8BackendError:
    """``fn()`` raises a library error that is also ``builtin``; returns it."""
    with pytest.raises(Fp8BackendError, match=match) as info:
        fn()
    assert isinstance(info.value, builtin), f"{type(info.value).__name__} is not a {builtin}"
    return info.value


# ------------------------------------------------------------------------------------------ problem constructors
@pytest.mark.parametrize(("field", "value", "builtin"), [
    ("n", 0, ValueError), ("n", -1, ValueError), ("k", 0, ValueError), ("m", -1, ValueError),
    ("n", "32", TypeError), ("n", 1.5, TypeError), ("n", None, TypeError), ("n", True, TypeError),
    ("k", 16.0, TypeError), ("m", "a", TypeError), ("m", 2.5, TypeError),
    ("act_scale", "bogus", ValueError), ("act_scale", ["per_token"], TypeError),
    ("weight_scale", "bogus", ValueError), ("out_dtype", "int32", ValueError), ("out_dtype", torch.int8, ValueError),
    ("input_dtype", "bogus", ValueError), ("weight_dtype", torch.float16, ValueError),
    ("has_bias", "yes", TypeError), ("has_bias", None, TypeError), ("device", "tpu", ValueError),
    ("device", "cuda:x", ValueError),
])
def test_gemm_problem_refuses_bad_fields(field, value, builtin):
    err = raises_library(builtin, lambda: GemmProblem(**{"n": 32, "k": 32, field: value}))
    assert isinstance(err, InvalidInputError)  # every problem error is an InvalidInputError (a ValueError)


@pytest.mark.parametrize(("field", "value", "builtin"), [
    ("hidden", 0, ValueError), ("hidden", -4, ValueError), ("hidden", "a", TypeError), ("hidden", 1.5, TypeError),
    ("tokens", -1, ValueError), ("tokens", "3", TypeError), ("in_dtype", "int32", ValueError),
    ("out_fp8", "bogus", ValueError), ("residual", "no", TypeError), ("device", "tpu", ValueError),
])
def test_norm_problem_refuses_bad_fields(field, value, builtin):
    raises_library(builtin, lambda: NormQuantProblem(**{"hidden": 32, field: value}))


def test_problems_normalise_integer_types():
    np = pytest.importorskip("numpy")
    p = GemmProblem(n=np.int64(32), k=32, m=np.int32(0), has_bias=np.True_, device="cuda:1")
    assert (type(p.n), p.m, p.has_bias) == (int, 0, True)
    assert NormQuantProblem(hidden=32, tokens=0).tokens == 0


# ------------------------------------------------------------------------------------------ resolve arguments
@pytest.mark.parametrize("resolve", [resolve_gemm_backend, resolve_norm_quant_backend])
@pytest.mark.parametrize("name", [123, 1.5, b"torch", ["torch"], {"name": "torch"}])
def test_resolve_refuses_a_non_string_name(resolve, name):
    raises_library(TypeError, lambda: resolve(name))


@pytest.mark.parametrize(("resolve", "problem"), [
    (resolve_gemm_backend, {"n": 32, "k": 32}), (resolve_gemm_backend, "problem"), (resolve_gemm_backend, CPU_NORM),
    (resolve_norm_quant_backend, (32,)), (resolve_norm_quant_backend, CPU_GEMM),
])
def test_resolve_refuses_a_problem_of_the_wrong_type(resolve, problem):
    raises_library(TypeError, lambda: resolve("auto", problem=problem), match="problem must be a")


@pytest.mark.parametrize("platform", ["9.0", 90, {"sm": "9.0"}])
def test_resolve_refuses_a_platform_of_the_wrong_type(platform):
    raises_library(TypeError, lambda: resolve_gemm_backend("auto", problem=CPU_GEMM, platform=platform))


@pytest.mark.parametrize(("request_text", "match"), [
    ("torch@fast_accum", "not key=value"), ("torch@=true", "not key=value"),
    ("torch@fast_accum=true,fast_accum=false", "given twice"), ("auto@fast_accum=true", "auto takes no options"),
    ("torch@", "no options"), ("auto@", "no options"), ("torch@fast_accum=maybe", "not one of"),
    ("torch@bogus=1", "unknown option"),
])
def test_option_syntax_errors(request_text, match, monkeypatch):
    err = raises_library((ValueError, LookupError), lambda: resolve_gemm_backend(request_text, problem=CPU_GEMM),
                         match=match)
    assert isinstance(err, BackendOptionError)
    monkeypatch.setenv("FP8_GEMM_BACKEND", request_text)  # the same from the environment
    raises_library(BackendOptionError, lambda: resolve_gemm_backend(problem=CPU_GEMM), match=match)
    with pytest.raises(BackendOptionError, match=match):  # and from a layer (syntax: at construction already)
        Fp8Linear.from_linear(torch.nn.Linear(32, 32), backend=request_text)
    if match not in ("not one of", "unknown option"):
        with pytest.raises(BackendOptionError, match=match):
            Fp8Linear(32, 32, backend=request_text)


def test_platform_arguments():
    raises_library(ValueError, lambda: simulate_platform("abc"))
    raises_library(TypeError, lambda: simulate_platform(None))
    raises_library(TypeError, lambda: simulate_platform((9,)))
    raises_library(ValueError, lambda: detect_platform("tpu"))
    raises_library(TypeError, lambda: detect_platform(1.5))
    assert simulate_platform((9, 0)).sm == (9, 0)


# ------------------------------------------------------------------------------------------ quantization, eps
@pytest.mark.parametrize("mode", ["bogus", 5, None, ["per_token"]])
def test_quantize_refuses_unknown_modes(mode):
    raises_library((ValueError, TypeError), lambda: quant.quantize(torch.randn(4, 32), mode))
    raises_library((ValueError, TypeError), lambda: reference.quantize(torch.randn(4, 32), mode))


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("eps", [float("inf"), float("nan"), -1e-6, 0.0, True, "1e-6", None])
def test_norm_quant_refuses_bad_eps(name, eps):
    nb = resolve_norm_quant_backend(name, problem=CPU_NORM)
    x, w, s = torch.randn(4, 32, dtype=torch.bfloat16), torch.ones(32, dtype=torch.bfloat16), torch.tensor([0.05])
    raises_library((ValueError, TypeError), lambda: nb.rmsnorm_quant(x, w, s, eps), match="eps must be")
    raises_library((ValueError, TypeError), lambda: nb.fused_add_rmsnorm_quant(x, x.clone(), w, s, eps))
    raises_library((ValueError, TypeError), lambda: RMSNormFp8Quant(32, eps))


# ------------------------------------------------------------------------------------------ empty edge cases
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(0, 32), (4, 0), (0, 0)])
def test_quantize_empty_inputs(mode, shape):
    scale = torch.tensor([0.5]) if mode == "per_tensor_static" else None
    qa = quant.quantize(torch.zeros(shape), mode, scale)
    assert qa.data.shape == shape and qa.data.dtype == E4
    if mode == "per_token":
        assert qa.scale.shape == (shape[0], 1)
    elif mode == "per_tensor_dynamic":
        assert qa.scale.shape == (1,)
    assert bool(torch.isfinite(qa.scale).all()) and bool((qa.scale > 0).all())


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("wmode", ["per_tensor", "per_channel"])
@pytest.mark.parametrize("xmode", ["per_tensor", "per_token"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gemm_with_m_zero(name, wmode, xmode, out_dtype):
    be = resolve_gemm_backend(name, problem=CPU_GEMM)
    w = torch.randn(32, 32)
    w_q, w_s = reference.quantize_dynamic_per_tensor(w) if wmode == "per_tensor" else reference.quantize_per_token(w)
    prepared = be.prepare_weight(w_q, w_s)
    x_q = torch.zeros(0, 32, dtype=E4)
    x_s = torch.ones(0, 1) if xmode == "per_token" else torch.ones(1)
    bias = torch.ones(32, dtype=out_dtype)
    for b in (None, bias):
        y = be.gemm(x_q, prepared, x_s, out_dtype=out_dtype, bias=b)
        assert y.shape == (0, 32) and y.dtype == out_dtype


def test_gemm_weight_with_no_rows_or_columns_is_refused():
    be = resolve_gemm_backend("torch", problem=CPU_GEMM)
    for shape in ((32, 0), (0, 32)):
        raises_library(ValueError, lambda shape=shape: be.prepare_weight(torch.zeros(shape, dtype=E4), torch.ones(1)),
                       match="N >= 1 and K >= 1")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("wmode", ["per_tensor", "per_channel"])
def test_linear_with_no_rows(backend, mode, wmode):
    lin = torch.nn.Linear(32, 48, bias=True).to(torch.bfloat16)
    kw = {"input_scale": 0.05} if mode == "per_tensor_static" else {}
    layer = Fp8Linear.from_linear(lin, act_scale=mode, weight_scale=wmode, backend=backend, **kw)
    for shape in ((0, 32), (2, 0, 32)):
        y = layer(torch.zeros(shape, dtype=torch.bfloat16))
        assert y.shape == (*shape[:-1], 48) and y.dtype == torch.bfloat16
    qa = quant.quantize(torch.zeros(0, 32, dtype=torch.bfloat16), mode, layer.input_scale if kw else None)
    assert layer(qa).shape == (0, 48)
    y = fp8_linear(torch.zeros(0, 32, dtype=torch.bfloat16), layer.prepared, backend=layer.gemm_backend,
                   act_scale=mode, input_scale=layer.input_scale, bias=layer.bias)
    assert y.shape == (0, 48)


@pytest.mark.parametrize("name", ["torch", "triton"])
def test_norm_quant_with_no_tokens_and_no_hidden(name):
    nb = resolve_norm_quant_backend(name, problem=CPU_NORM)
    w, s = torch.ones(32, dtype=torch.bfloat16), torch.tensor([0.05])
    x = torch.zeros(0, 32, dtype=torch.bfloat16)
    assert nb.rmsnorm_quant(x, w, s).data.shape == (0, 32)
    qa, r = nb.fused_add_rmsnorm_quant(x, x.clone(), w, s)
    assert qa.data.shape == (0, 32) and r.shape == (0, 32)
    raises_library(ValueError, lambda: nb.rmsnorm_quant(torch.zeros(4, 0, dtype=torch.bfloat16),
                                                        torch.ones(0, dtype=torch.bfloat16), s), match="H >= 1")


# ------------------------------------------------------------------------------------------ layers: bad arguments
@pytest.mark.parametrize("kw", [
    {"in_features": 0, "out_features": 4}, {"in_features": "a", "out_features": 4},
    {"in_features": 4.5, "out_features": 4}, {"in_features": 4, "out_features": 4, "act_scale": "bogus"},
    {"in_features": 4, "out_features": 4, "weight_scale": "bogus"}, {"in_features": 4, "out_features": 4,
                                                                    "backend": 123},
])
def test_fp8linear_refuses_bad_arguments(kw):
    raises_library((ValueError, TypeError), lambda: Fp8Linear(**kw))


# ------------------------------------------------------------------------------------------ options that do nothing
def test_fast_accum_is_refused_on_the_cpu():
    err = raises_library(ValueError, lambda: resolve_gemm_backend("torch@fast_accum=true", problem=CPU_GEMM),
                         match="no effect on the CPU")
    assert isinstance(err, UnsupportedProblemError)
    be = resolve_gemm_backend("torch@fast_accum=true")  # no problem given: refused when a CPU weight is prepared
    w_q, w_s = reference.quantize_dynamic_per_tensor(torch.randn(32, 32))
    raises_library(ValueError, lambda: be.prepare_weight(w_q, w_s), match="no effect on the CPU")
    assert resolve_gemm_backend("torch@fast_accum=false", problem=CPU_GEMM).config == {"fast_accum": "false"}


def test_forced_tma_config_refuses_misaligned_operands():
    from fp8_backends.providers.triton.gemm import TritonGemmBackend
    from fp8_backends.providers.triton.gemm_configs import CONFIGS

    tma = next(name for name, cfg in CONFIGS.items() if cfg.family == "tma")
    be = TritonGemmBackend(config=tma)
    w_q, w_s = reference.quantize_dynamic_per_tensor(torch.randn(32, 32))
    prepared = be.prepare_weight(w_q, w_s)
    x_q = torch.zeros(4 * 32 + 1, dtype=E4)[1:].view(4, 32)  # row-major, but one byte past an aligned base
    raises_library(ValueError, lambda: be.gemm(x_q, prepared, torch.ones(1)), match="not 16-byte aligned")
    # other configs take the instance's own gemm_impl as before (no check added to their hot path)
    assert "gemm_impl" not in TritonGemmBackend(config="auto").__dict__


# ------------------------------------------------------------------------------------------ environment variables
@pytest.mark.parametrize(("var", "value"), [
    ("FP8_BACKENDS_CHECK_SCALES", "2"), ("FP8_BACKENDS_CHECK_SCALES", "enable"), ("FP8_BACKENDS_PDL", "disable"),
    ("FP8_BACKENDS_TUNE", "enable"), ("FP8_BACKENDS_DEFAULTS", "disable"),
])
def test_boolean_variables_are_parsed_strictly(var, value, monkeypatch):
    from fp8_backends.core import settings

    getter = {"FP8_BACKENDS_CHECK_SCALES": settings.check_scales_at_call, "FP8_BACKENDS_PDL": settings.pdl_allowed,
              "FP8_BACKENDS_TUNE": settings.tune_at_first_use,
              "FP8_BACKENDS_DEFAULTS": settings.measured_defaults_enabled}[var]
    monkeypatch.setenv(var, value)
    err = raises_library(ValueError, getter, match=var)
    assert isinstance(err, ConfigurationError) and err.variable == var and "true" in err.accepted
    for good, expected in (("1", True), ("ON", True), (" no ", False), ("", var in ("FP8_BACKENDS_PDL",
                                                                                    "FP8_BACKENDS_DEFAULTS"))):
        monkeypatch.setenv(var, good)  # read when used: the new value applies at once
        assert getter() is expected


def test_check_scales_is_read_when_used(monkeypatch):
    from fp8_backends.core import validation as V

    assert V.device_scale_checks() is False
    monkeypatch.setenv("FP8_BACKENDS_CHECK_SCALES", "1")
    assert V.device_scale_checks() is True
    monkeypatch.setenv("FP8_BACKENDS_CHECK_SCALES", "2")
    raises_library(ValueError, lambda: V.check_scale_values(torch.ones(1), "s"), match="FP8_BACKENDS_CHECK_SCALES")
    V.set_check_device_scales(True)
    try:
        assert V.device_scale_checks() is True  # forced in code: the variable is not consulted
    finally:
        V.set_check_device_scales(None)


def test_env_variables_in_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8_BACKENDS_SIMULATE_SM", "abc")
    raises_library(ValueError, lambda: resolve_gemm_backend("auto", problem=GemmProblem(n=32, k=32, m=8)),
                   match="FP8_BACKENDS_SIMULATE_SM")
    monkeypatch.delenv("FP8_BACKENDS_SIMULATE_SM")
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(tmp_path / "lock.json"))
    monkeypatch.setenv("FP8_BACKENDS_TUNE", "enable")  # read by the lockfile policy: an error, not "off"
    raises_library(ConfigurationError, lambda: resolve_gemm_backend(
        "auto", problem=GemmProblem(n=32, k=32, m=8, device="cpu")), match="FP8_BACKENDS_TUNE")
    monkeypatch.delenv("FP8_BACKENDS_TUNE")
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")
    monkeypatch.setenv("FP8_BACKENDS_DEFAULTS", "disable")  # read by the measured-defaults policy
    raises_library(ConfigurationError, lambda: resolve_gemm_backend(
        "auto", problem=GemmProblem(n=32, k=32, m=8), platform=simulate_platform("9.0")), match="DEFAULTS")


@pytest.mark.parametrize("value", ["abc", "0", "-2", "1.5"])
def test_integer_variables_are_parsed_strictly(value, monkeypatch):
    from fp8_backends.core import settings

    monkeypatch.setenv("FP8_TEST_JOBS", value)
    raises_library(ValueError, lambda: settings.env_int("FP8_TEST_JOBS", 4), match="FP8_TEST_JOBS")
    monkeypatch.setenv("FP8_TEST_JOBS", " 3 ")
    assert settings.env_int("FP8_TEST_JOBS", 4) == 3
    monkeypatch.delenv("FP8_TEST_JOBS")
    assert settings.env_int("FP8_TEST_JOBS", 4) == 4


def test_flashinfer_autotune_variable(monkeypatch):
    from fp8_backends.providers.flashinfer import common

    monkeypatch.setenv("FP8_BACKENDS_FLASHINFER_AUTOTUNE", "sometimes")
    raises_library(ValueError, common.autotune_default, match="FP8_BACKENDS_FLASHINFER_AUTOTUNE")


def test_every_invalid_input_error_is_still_a_value_error():
    for cls in (InvalidTypeError, BackendOptionError, ConfigurationError):
        assert issubclass(cls, Fp8BackendError) and issubclass(cls, ValueError)
    assert issubclass(InvalidTypeError, TypeError) and issubclass(BackendOptionError, LookupError)


# ------------------------------------------------------------------------------------------ probe faults (item 4)
import json  # noqa: E402
import logging  # noqa: E402
from typing import ClassVar  # noqa: E402

from fake_provider import install  # noqa: E402

from fp8_backends.core.backend import Fp8GemmBackend  # noqa: E402
from fp8_backends.core.capabilities import GemmCapabilities  # noqa: E402
from fp8_backends.core.errors import BackendUnavailableError  # noqa: E402
from fp8_backends.core.types import DeviceKind  # noqa: E402
from fp8_backends.list import collect  # noqa: E402
from fp8_backends.registry import discovery, lockfile, resolution  # noqa: E402
from fp8_backends.registry.discovery import ProviderEntry  # noqa: E402
from fp8_backends.registry.platform import cpu_platform  # noqa: E402


class _Faulty(Fp8GemmBackend):
    """A top-priority CPU provider that breaks in the way ``fault`` says (the reference GEMM otherwise)."""

    fault: ClassVar[str] = ""
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(devices=frozenset({DeviceKind.CPU}), priority=99)

    def __init__(self, **options: str) -> None:
        super().__init__(**options)
        if self.fault == "init":
            raise RuntimeError("probe failed in __init__")

    def supports(self, problem=None, platform=None):
        if self.fault == "supports":
            raise KeyError("probe failed in supports")
        return super().supports(problem, platform)

    def preload(self) -> None:
        if self.fault == "preload":
            raise ImportError("kernel module missing")

    def prepare_weight_impl(self, w_q, w_scale, weight_scale):
        return self.prepare_k_major(w_q, w_scale, weight_scale)

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        return reference.fp8_gemm(x_q, prepared.data, x_scale, prepared.scale, out_dtype, bias)


def _install(monkeypatch, fault: str) -> ProviderEntry:
    cls = type(f"Faulty_{fault}", (_Faulty,), {"name": f"faulty_{fault}", "fault": fault})
    return install(monkeypatch, cls, dist="faulty-plugin")


@pytest.mark.parametrize("fault", ["init", "supports", "preload"])
def test_probe_faults_are_contained(fault, monkeypatch, caplog):
    entry = _install(monkeypatch, fault)
    problem = GemmProblem(n=32, k=32, m=4, device="cpu")
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        chosen = resolve_gemm_backend("auto", problem=problem)
    assert chosen.name == "torch_scaled_mm"  # auto passes over the faulty provider ...
    assert any(entry.name in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) or \
        fault == "supports"  # ... saying so (a support check that raises is a reason, per problem)
    # the listing marks exactly what auto resolves to
    data = collect(cpu_platform(), gemm_problem=problem)
    starred = [p["name"] for p in data["providers"] if p["kind"] == "gemm" and p["selected"]]
    assert starred == [chosen.name]
    listed = next(p for p in data["providers"] if p["name"] == entry.name)
    assert not listed["usable"] and any("failed" in r or "raised" in r for r in listed["reasons"])
    # naming it explicitly: BackendUnavailableError with the cause
    with pytest.raises(BackendUnavailableError) as info:
        resolve_gemm_backend(entry.name, problem=problem)
    cause = {"init": "probe failed in __init__", "supports": "probe failed in supports",
             "preload": "kernel module missing"}[fault]
    assert cause in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_availability_that_raises_is_unavailable_with_the_cause(monkeypatch):
    entry = _install(monkeypatch, "none")

    def boom(cls):
        raise OSError("driver probe crashed")

    monkeypatch.setattr(entry.cls, "availability", classmethod(boom))
    with pytest.raises(BackendUnavailableError, match="driver probe crashed"):
        resolve_gemm_backend(entry.name, problem=CPU_GEMM)
    assert resolve_gemm_backend("auto", problem=CPU_GEMM).name == "torch_scaled_mm"


# ------------------------------------------------------------------------------------------ warnings (item 3)
def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_disabled_item_matching_nothing_warns_once(monkeypatch, caplog):
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "torch,trtion,gemm:flashinfer")
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        for _ in range(3):
            resolution.explain("gemm", "auto", problem=CPU_GEMM)
            resolution.explain("norm_quant", "auto", problem=CPU_NORM)
    warned = _warnings(caplog)
    # 'trtion' is a typo; 'gemm:flashinfer' names the norm-quant provider's name under the wrong kind
    # (flashinfer is an alias of flashinfer_bmm, so it does match a GEMM provider) -> only the typo warns
    assert len(warned) == 1 and "'trtion'" in warned[0] and "FP8_BACKENDS_DISABLED" in warned[0]


def test_ignored_policy_picks_warn_once_per_policy_with_a_count(monkeypatch, caplog):
    real = [e for e in discovery.discover("gemm") if e.name == "cutlass"][0]  # cannot serve on the CPU

    def stubborn(kind, problem, platform, serving):
        return (real, {}, "always cutlass") if kind == "gemm" else None

    resolution.register_selection_policy("stubborn", stubborn, rank=1000)
    try:
        with caplog.at_level(logging.DEBUG, logger="fp8_backends"):
            for m in (1, 2, 3):
                res = resolution.explain("gemm", "auto", problem=GemmProblem(n=32, k=32, m=m, device="cpu"))
                assert res.backend.name == "torch_scaled_mm"
    finally:
        resolution.unregister_selection_policy("stubborn")
    warned = [m for m in _warnings(caplog) if "stubborn" in m]
    assert len(warned) == 1 and "cannot serve" in warned[0] and "so far: 1" in warned[0]
    assert resolution.ignored_picks["stubborn"] == 3


# ------------------------------------------------------------------------------------------ lockfile (items 3, 5)
@pytest.fixture
def lockpath(tmp_path, monkeypatch):
    path = tmp_path / "selection.lock.json"
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(path))
    lockfile.reset_state()
    yield path
    lockfile.reset_state()


def _write_lockfile(path, entries: dict, platform_key: dict | None = None) -> None:
    key = platform_key if platform_key is not None else lockfile.platform_key(cpu_platform())
    doc = lockfile.new_document()
    doc["sections"][lockfile.key_digest(key)] = {"platform": key, "entries": entries}
    path.write_text(json.dumps(doc))


def _entry(m=4, provider="torch_scaled_mm", options=None, **extra):
    fields = lockfile.problem_fields("gemm", GemmProblem(n=32, k=32, device="cpu"))
    entry = {"kind": "gemm", "problem": fields, "m": m,
             "choice": {"provider": provider, "distribution": "fp8-backends", "options": options or {}, "us": 1.0},
             "ranking": []}
    entry.update(extra)
    return lockfile.entry_key("gemm", fields, m if isinstance(m, int) else 0) + f"/{len(extra)}", entry


MALFORMED = {
    "m-string": {"m": "4"}, "m-float": {"m": 4.0}, "m-bool": {"m": True}, "kind": {"kind": 3},
    "problem-list": {"problem": [32, 32]}, "problem-n-string": {"problem": {"n": "32"}},
    "choice-string": {"choice": "torch"}, "options-list": {"choice": {"provider": "torch_scaled_mm",
                                                                      "options": ["fast_accum"]}},
    "distribution-int": {"choice": {"provider": "torch_scaled_mm", "distribution": 5}},
    "ranking-none": {"ranking": None}, "ranking-string": {"ranking": "torch"}, "ranking-items": {"ranking": [3, {}]},
    "tie-margin-string": {"tie_margin": "2%"}, "tie-break-string": {"tie_break": "yes"},
}


@pytest.mark.parametrize("damage", sorted(MALFORMED))
def test_malformed_lockfile_fields_are_recovered_with_one_warning(damage, lockpath, caplog):
    name_ok, good = _entry(m=8)
    name_bad, bad = _entry(m=4)
    change = MALFORMED[damage]
    if "problem" in change and isinstance(change["problem"], dict):
        bad["problem"] = {**bad["problem"], **change["problem"]}
    else:
        bad.update(change)
    _write_lockfile(lockpath, {name_ok: good, name_bad: bad})
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        for m in (4, 8, 8):
            res = resolution.explain("gemm", "auto", problem=GemmProblem(n=32, k=32, m=m, device="cpu"))
            assert res.error is None and res.backend.name == "torch_scaled_mm"
        layer = Fp8Linear.from_linear(torch.nn.Linear(32, 32).to(torch.bfloat16))
        assert layer(torch.randn(3, 32, dtype=torch.bfloat16)).shape == (3, 32)
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(lockpath) in warned[0], warned


@pytest.mark.parametrize("platform_damage", ["libraries-string", "libraries-numbers", "gpu-list", "not-object"])
def test_malformed_platform_key_is_recovered_with_one_warning(platform_damage, lockpath, caplog):
    key = lockfile.platform_key(cpu_platform())
    if platform_damage == "libraries-string":
        key["libraries"] = "torch==2.13"
    elif platform_damage == "libraries-numbers":
        key["libraries"] = {"torch": 2.13}
    elif platform_damage == "gpu-list":
        key["gpu"] = ["CPU"]
    else:
        key = "cpu"
    name, entry = _entry()
    doc = lockfile.new_document()
    doc["sections"]["x"] = {"platform": key, "entries": {name: entry}}
    lockpath.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        for _ in range(2):
            layer = Fp8Linear.from_linear(torch.nn.Linear(32, 32).to(torch.bfloat16))
            assert layer(torch.randn(4, 32, dtype=torch.bfloat16)).shape == (4, 32)
            assert resolution.explain("gemm", "auto", problem=GemmProblem(n=32, k=32, m=4, device="cpu")).error is None
        collect(cpu_platform())  # the listing too
    assert len(_warnings(caplog)) == 1, _warnings(caplog)


def test_lockfile_choices_not_installed_or_stale_warn_once_with_counts(lockpath, caplog):
    entries = dict([_entry(m=1, provider="not_installed_mm"), _entry(m=2, provider="not_installed_mm"),
                    _entry(m=4, options={"fast_accum": "maybe"}), _entry(m=8)])
    _write_lockfile(lockpath, entries)
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        for m in (1, 2, 4, 8, 1):
            res = resolution.explain("gemm", "auto", problem=GemmProblem(n=32, k=32, m=m, device="cpu"))
            assert res.error is None and res.backend.name == "torch_scaled_mm"
    warned = [w for w in _warnings(caplog) if "recorded choices" in w]
    assert len(warned) == 1
    assert "2 name not_installed_mm" in warned[0] and "1 carry options torch_scaled_mm[fast_accum=maybe]" in warned[0]


# ------------------------------------------------------------------------------------------ the fallback catalogue
def _lockfile_with(path, entries_by_m: dict[int, dict]) -> None:
    entries = {}
    for m, change in entries_by_m.items():
        name, entry = _entry(m=m)
        entry.update(change)
        entries[name] = entry
    _write_lockfile(path, entries)


def _auto(m: int = 4):
    return resolve_gemm_backend("auto", problem=GemmProblem(n=32, k=32, m=m, device="cpu"))


def _fb_plugin_import_failure(ctx):
    ctx.request.getfixturevalue("thirdparty_plugin")
    discovery.discover("gemm")


def _fb_preload_fails(ctx):
    _install(ctx.monkeypatch, "preload")
    _auto()


def _fb_construction_fails(ctx):
    _install(ctx.monkeypatch, "init")
    _auto()


def _fb_policy_raises(ctx):
    def broken(kind, problem, platform, serving):
        raise RuntimeError("policy bug")

    resolution.register_selection_policy("catalogue-broken", broken, rank=1000)
    ctx.cleanup.append(lambda: resolution.unregister_selection_policy("catalogue-broken"))
    _auto()


def _fb_policy_pick_cannot_serve(ctx):
    cutlass = next(e for e in discovery.discover("gemm") if e.name == "cutlass")
    resolution.register_selection_policy("catalogue-cutlass", lambda *a: (cutlass, {}, "x"), rank=1000)
    ctx.cleanup.append(lambda: resolution.unregister_selection_policy("catalogue-cutlass"))
    _auto()


def _fb_lockfile_other_platform(ctx):
    key = {**lockfile.platform_key(cpu_platform()), "gpu": "another machine"}
    _write_lockfile(ctx.lockpath, dict([_entry()]), key)
    _auto()


def _fb_lockfile_corrupt(ctx):
    ctx.lockpath.write_text("{ not json")
    _auto()


def _fb_lockfile_malformed_entry(ctx):
    _lockfile_with(ctx.lockpath, {4: {}, 8: {"m": "8"}})
    _auto()


def _fb_lockfile_choice_not_installed(ctx):
    _lockfile_with(ctx.lockpath, {4: {"choice": {"provider": "gone_mm", "options": {}}}})
    _auto()


def _fb_lockfile_no_choice_can_serve(ctx):
    _lockfile_with(ctx.lockpath, {4: {"choice": {"provider": "cutlass", "options": {}}}})
    _auto()


def _fb_lockfile_next_ranked(ctx):
    _lockfile_with(ctx.lockpath, {4: {"choice": {"provider": "cutlass", "options": {}},
                                      "ranking": [{"provider": "torch_scaled_mm", "options": {}}]}})
    _auto()


def _fb_shipped_other_sm(ctx):
    from fp8_backends.registry import shipped

    ctx.monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(shipped.packaged_dir() / "sm90-nvidia-h200.json"))
    resolve_gemm_backend("auto", problem=GemmProblem(n=4096, k=4096, m=4), platform=simulate_platform("10.0"))


def _fb_shipped_path_missing(ctx):
    ctx.monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(ctx.lockpath.parent / "no-such-data"))
    resolve_gemm_backend("auto", problem=GemmProblem(n=4096, k=4096, m=4), platform=simulate_platform("9.0"))


def _fb_shipped_unusable(ctx):
    bad = ctx.lockpath.parent / "sm90-broken.json"
    bad.write_text("{}")
    ctx.monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(bad))
    resolve_gemm_backend("auto", problem=GemmProblem(n=4096, k=4096, m=4), platform=simulate_platform("9.0"))


def _fb_name_clash(ctx):
    ctx.request.getfixturevalue("thirdparty_plugin")
    _auto()


def _fb_disabled_typo(ctx):
    ctx.monkeypatch.setenv("FP8_BACKENDS_DISABLED", "torch_scaled_mn")
    _auto()


def _fb_fused_layer_requantizes(ctx):
    from fp8_backends.core.types import ActScale, OutDtype, WeightScale

    class PerTensorOnly(_Faulty):
        name: ClassVar[str] = "per_tensor_only"
        fault: ClassVar[str] = ""
        capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
            devices=frozenset({DeviceKind.CPU}), act_scales=frozenset(ActScale), out_dtypes=frozenset(OutDtype),
            weight_scales=frozenset({WeightScale.PER_TENSOR}))

    shards = [(reference.quantize_dynamic_per_tensor(torch.randn(16, 32) * s)) for s in (1.0, 3.0)]
    Fp8Linear.from_fused_shards(shards, dtype=torch.float32, backend=PerTensorOnly())


def _fb_triton_tma_misaligned(ctx):
    from fp8_backends.providers.triton import gemm_ops
    from fp8_backends.providers.triton.gemm_configs import CONFIGS

    gemm_ops._pointer_tiles.cache_clear()
    gemm_ops._pointer_tiles(next(c for c in CONFIGS.values() if c.family == "tma"))


def _fb_cuda_quant_reference(ctx):
    quant.reset_default_impls()
    ctx.cleanup.append(quant.reset_default_impls)
    quant.default_quant_impl("per_token", "cuda")


#: every fallback the library still makes (where it runs something other than the obvious first choice), how to
#: trigger it on the CPU, the least level it logs at and what the message says. GPU-only fallbacks log as well
#: (flashinfer_bmm's runner -> bmm_fp8 API: WARNING; its heuristic, cuBLASLt algorithm query and the norm
#: module's direct call -> public API: INFO), but need flashinfer on a GPU to trigger.
FALLBACKS = {
    "a plugin that fails to import is left out": (_fb_plugin_import_failure, logging.WARNING, "failed to load"),
    "auto skips a provider whose preload fails": (_fb_preload_fails, logging.WARNING, "failed to load and is skipped"),
    "auto skips a provider whose construction raises": (_fb_construction_fails, logging.WARNING, "is unusable"),
    "auto skips a selection policy that raises": (_fb_policy_raises, logging.WARNING, "catalogue-broken failed"),
    "auto ignores a policy pick that cannot serve": (_fb_policy_pick_cannot_serve, logging.WARNING, "ignored"),
    "a lockfile tuned on another platform is ignored": (_fb_lockfile_other_platform, logging.WARNING,
                                                        "another platform"),
    "a corrupt lockfile is ignored": (_fb_lockfile_corrupt, logging.WARNING, "ignoring it"),
    "malformed lockfile entries are skipped": (_fb_lockfile_malformed_entry, logging.WARNING, "1 of 2 entries"),
    "lockfile choices of missing providers are passed over": (_fb_lockfile_choice_not_installed, logging.WARNING,
                                                              "not installed here"),
    "a lockfile entry no recorded choice of which can serve": (_fb_lockfile_no_choice_can_serve, logging.WARNING,
                                                              "static priorities decide"),
    "the next ranked lockfile choice serves": (_fb_lockfile_next_ranked, logging.INFO, "ranked #2"),
    "shipped data for another SM is ignored": (_fb_shipped_other_sm, logging.WARNING, "not SM 10.0"),
    "a missing FP8_BACKENDS_SHIPPED path disables the data": (_fb_shipped_path_missing, logging.WARNING,
                                                              "no such file"),
    "unusable shipped data is ignored": (_fb_shipped_unusable, logging.WARNING, "unusable and ignored"),
    "auto ranks clashing provider names": (_fb_name_clash, logging.WARNING, "registered by several"),
    "an FP8_BACKENDS_DISABLED item that matches nothing": (_fb_disabled_typo, logging.WARNING, "disables nothing"),
    "a fused layer requantizes shards to one scale": (_fb_fused_layer_requantizes, logging.INFO, "requantizes"),
    "an auto TMA config runs without TMA on misaligned operands": (_fb_triton_tma_misaligned, logging.INFO,
                                                                   "not 16-byte aligned"),
    "CUDA quantization uses the reference without the Triton kernels": (_fb_cuda_quant_reference, logging.INFO,
                                                                        "CUDA default is the reference"),
}


class _Ctx:
    def __init__(self, request, monkeypatch, lockpath):
        self.request, self.monkeypatch, self.lockpath = request, monkeypatch, lockpath
        self.cleanup: list = []


@pytest.mark.parametrize("name", sorted(FALLBACKS))
def test_every_fallback_logs(name, request, monkeypatch, lockpath, caplog):
    from fp8_backends.registry import shipped

    trigger, level, text = FALLBACKS[name]
    shipped.reset_state()
    ctx = _Ctx(request, monkeypatch, lockpath)
    try:
        with caplog.at_level(logging.DEBUG, logger="fp8_backends"):
            trigger(ctx)
    finally:
        for undo in ctx.cleanup:
            undo()
        shipped.reset_state()
    logged = [r for r in caplog.records if text in r.getMessage()]
    assert logged, f"{name}: nothing logged containing {text!r}: {[r.getMessage() for r in caplog.records]}"
    assert max(r.levelno for r in logged) >= level, f"{name}: logged below {logging.getLevelName(level)}"


# ------------------------------------------------------------------------------------------ more entry points
@pytest.mark.parametrize("kw", [
    {"act_scale": "bogus"}, {"weight_scale": "bogus"}, {"weight_scale": 5}, {"backend": 123},
    {"backend": "torch@fast_accum"}, {"backend": "auto@fast_accum=true"}, {"skip": 5}, {"skip": [1]},
    {"include": "yes"}, {"input_dtype": "bogus"},
    {"weight_dtype": "int8"}, {"calibration": 5}, {"act_scale": "per_tensor_static", "input_scales": 5},
    {"act_scale": "per_tensor_static", "input_scales": {"0": "a", "2": 1.0}},
    {"act_scale": "per_tensor_static", "input_scales": {"0": float("inf"), "2": 1.0}},
])
def test_quantize_model_refuses_bad_arguments(kw):
    from fp8_backends import quantize_model

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    raises_library((ValueError, TypeError), lambda: quantize_model(model, **kw))
    assert all(type(m) is not Fp8Linear for m in model.modules())  # refused before any layer was swapped


def test_quantize_model_takes_one_skip_pattern_as_a_string():
    from fp8_backends import quantize_model

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    summary = quantize_model(model, skip="0", backend="torch")
    assert [s.name for s in summary.swapped] == ["1"]


@pytest.mark.parametrize("kw", [{"device": "tpu"}, {"device": 1.5}, {"shard_sizes": "ab"}, {"shard_sizes": [2, 0]},
                                {"bias": "yes"}])
def test_layer_constructors_refuse_bad_arguments(kw):
    raises_library((ValueError, TypeError), lambda: Fp8Linear(4, 4, **kw))
    if "device" in kw:
        raises_library((ValueError, TypeError), lambda: RMSNormFp8Quant(4, **kw))


def test_cli_arguments():
    import argparse

    from fp8_backends import add_cli_args

    raises_library(TypeError, lambda: add_cli_args(None))
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    with pytest.raises(SystemExit):  # argparse reports the library's explanation and exits 2
        parser.parse_args(["--fp8-gemm-backend", "torch@fast_accum=true,fast_accum=false"])


def test_the_listing_shows_the_warnings_and_fails_on_a_bad_variable(monkeypatch, capsys):
    from fp8_backends.list import main

    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "trtion")
    assert main([]) == 0
    assert "warning: FP8_BACKENDS_DISABLED item 'trtion'" in capsys.readouterr().err
    monkeypatch.delenv("FP8_BACKENDS_DISABLED")
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")
    monkeypatch.setenv("FP8_BACKENDS_DEFAULTS", "disable")
    assert main(["--simulate-sm", "9.0", "--problem", "8,32,32"]) == 1
    assert "FP8_BACKENDS_DEFAULTS='disable'" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["abc", "0", "-2"])
def test_build_jobs_variable_is_strict(monkeypatch, value):
    """``FP8_BACKENDS_BUILD_JOBS=abc|0|-2`` used to become the CPU count silently."""
    from fp8_backends.core.errors import ConfigurationError
    from fp8_backends.providers.cutlass.build import JOBS_ENV, default_jobs

    monkeypatch.setenv(JOBS_ENV, value)
    with pytest.raises(ConfigurationError, match=JOBS_ENV):
        default_jobs(4)
    monkeypatch.setenv(JOBS_ENV, "3")
    assert default_jobs(4) == 3 and default_jobs(2) == 2
