"""Every fault contained and reported (issue 18): one library error for every bad input, correct empty results for
valid edge cases, no silent fallback, probe faults, malformed lockfiles.

Each bad input must raise an :class:`~fp8_backends.errors.Fp8BackendError` that is also the builtin a generic
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
    reference,
    resolve_gemm_backend,
    resolve_norm_quant_backend,
    simulate_platform,
)
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
    from fp8_backends.registry import settings

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
    from fp8_backends import validation as V

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
    from fp8_backends.registry import settings

    monkeypatch.setenv("FP8_TEST_JOBS", value)
    raises_library(ValueError, lambda: settings.env_int("FP8_TEST_JOBS", 4), match="FP8_TEST_JOBS")
    monkeypatch.setenv("FP8_TEST_JOBS", " 3 ")
    assert settings.env_int("FP8_TEST_JOBS", 4) == 3
    monkeypatch.delenv("FP8_TEST_JOBS")
    assert settings.env_int("FP8_TEST_JOBS", 4) == 4


def test_flashinfer_autotune_variable(monkeypatch):
    from fp8_backends.providers import _flashinfer_common as common

    monkeypatch.setenv("FP8_BACKENDS_FLASHINFER_AUTOTUNE", "sometimes")
    raises_library(ValueError, common.autotune_default, match="FP8_BACKENDS_FLASHINFER_AUTOTUNE")


def test_every_invalid_input_error_is_still_a_value_error():
    for cls in (InvalidTypeError, BackendOptionError, ConfigurationError):
        assert issubclass(cls, Fp8BackendError) and issubclass(cls, ValueError)
    assert issubclass(InvalidTypeError, TypeError) and issubclass(BackendOptionError, LookupError)
