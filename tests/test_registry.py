"""Discovery through real entry points (built-ins and an installed third-party distribution) and resolution."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys

import pytest

from fp8_backends import (
    AmbiguousBackendError,
    BackendOptionError,
    BackendUnavailableError,
    Fp8BackendError,
    GemmProblem,
    InvalidInputError,
    NormQuantProblem,
    UnknownBackendError,
    UnsupportedProblemError,
    resolve_gemm_backend,
    resolve_norm_quant_backend,
)
from fp8_backends.registry import discovery, resolution
from fp8_backends.registry.platform import cpu_platform, simulate_platform


def _entry(kind, name, dist=None):
    found = [e for e in discovery.discover(kind) if e.name == name and (dist is None or e.dist == dist)]
    assert len(found) == 1, found
    return found[0]


def test_builtins_discovered_through_entry_points():
    gemm = _entry("gemm", "torch_scaled_mm")
    assert gemm.builtin and gemm.status == "loaded" and gemm.dist == "fp8-backends"
    assert gemm.target == "fp8_backends.providers.torch_scaled_mm:TorchScaledMMBackend"
    assert "torch" in gemm.aliases
    norm = _entry("norm_quant", "torch")
    assert norm.builtin and norm.availability().ok


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown provider kind"):
        discovery.discover("conv")


# --------------------------------------------------------------------------- third-party plugin
def test_plugin_providers_listed_with_status(thirdparty_plugin):
    toy = _entry("gemm", "toy")
    assert toy.status == "loaded" and not toy.builtin
    assert toy.dist == "fp8-backends-testplugin" and toy.dist_version == "1.2.3"
    broken = _entry("gemm", "broken")
    assert broken.status == "failed" and "fp8_backends_testplugin_missing_dependency" in broken.error
    assert not broken.availability().ok
    raising = _entry("gemm", "raising")
    assert raising.status == "loaded"
    assert "availability() raised RuntimeError: probe exploded" in raising.unusable_reason()
    notaclass = _entry("gemm", "notaclass")
    assert notaclass.status == "failed" and "not name a Fp8GemmBackend subclass" in notaclass.error
    assert _entry("norm_quant", "toy_norm").availability().ok


def test_auto_picks_highest_priority_plugin(thirdparty_plugin, caplog):
    problem = GemmProblem(n=64, k=32, m=4, device="cpu")
    with caplog.at_level(logging.DEBUG, logger="fp8_backends"):
        backend = resolve_gemm_backend("auto", problem=problem)
    assert backend.name == "toy"
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "toy" in infos[0].getMessage() and "(priority)" in infos[0].getMessage()
    assert any(r.levelno == logging.DEBUG and "broken" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fp8_backends"):
        resolve_gemm_backend("auto", problem=problem)
    assert not [r for r in caplog.records if r.levelno == logging.INFO]  # logged once


def test_alias_and_options_of_plugin(thirdparty_plugin):
    b = resolve_gemm_backend("toy_alias@flavour=spicy", problem=GemmProblem(n=8, k=8, device="cpu"))
    assert b.name == "toy" and b.config == {"flavour": "spicy"} and b.label == "toy[flavour=spicy]"
    with pytest.raises(InvalidInputError, match="flavour='salty' not one of plain, spicy"):
        resolve_gemm_backend("toy@flavour=salty", problem=GemmProblem(n=8, k=8, device="cpu"))
    with pytest.raises(InvalidInputError, match="unknown option 'colour'"):
        resolve_gemm_backend("toy@colour=red", problem=GemmProblem(n=8, k=8, device="cpu"))


def test_name_clash_needs_qualification(thirdparty_plugin):
    problem = GemmProblem(n=64, k=32, device="cpu")
    with pytest.raises(AmbiguousBackendError) as info:
        resolve_gemm_backend("torch_scaled_mm", problem=problem)
    msg = str(info.value)
    assert "fp8-backends" in msg and "fp8-backends-testplugin" in msg and "DIST:NAME" not in msg
    assert "select one as" in msg
    assert "fp8-backends:torch_scaled_mm" in msg and "fp8-backends-testplugin:torch_scaled_mm" in msg
    assert resolve_gemm_backend("fp8-backends:torch_scaled_mm", problem=problem).name == "torch_scaled_mm"
    theirs = resolve_gemm_backend("fp8_backends_testplugin:torch_scaled_mm", problem=problem)  # normalised dist
    assert type(theirs).__name__ == "ClashingGemmBackend"
    # the alias stays unambiguous: only the built-in carries it
    assert type(resolve_gemm_backend("torch", problem=problem)).__name__ == "TorchScaledMMBackend"


def test_auto_ranks_a_name_clash_and_warns_once(thirdparty_plugin, monkeypatch, caplog):
    """A plugin registering a built-in's name must not stop `auto` (an engine started with the default flag):
    it ranks both entries like any others and logs one WARNING saying how to pin or disable one."""
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "toy")  # else `toy` (priority 100) wins and hides the clash
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        first = resolve_gemm_backend("auto", problem=GemmProblem(n=64, k=32, device="cpu"))
        resolve_gemm_backend("auto", problem=GemmProblem(n=128, k=32, device="cpu"))
        resolve_norm_quant_backend("auto", problem=NormQuantProblem(hidden=64, device="cpu"))
    assert type(first).__name__ == "TorchScaledMMBackend"  # the built-in's priority 10 beats the plugin's 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "failed to load" not in r.getMessage()]  # the plugin's deliberately broken provider says so
    assert len(warnings) == 1, warnings
    msg = warnings[0]
    assert "'torch_scaled_mm' is registered by several distributions" in msg
    assert "fp8-backends:torch_scaled_mm or fp8-backends-testplugin:torch_scaled_mm" in msg
    assert "FP8_BACKENDS_DISABLED=gemm:fp8-backends-testplugin:torch_scaled_mm" in msg


@pytest.mark.parametrize("priority, winner", [(10, "TorchScaledMMBackend"), (11, "ClashingGemmBackend")])
def test_auto_ranks_clashing_entries_by_priority_built_ins_first_on_a_tie(thirdparty_plugin, monkeypatch,
                                                                          priority, winner):
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "toy")
    theirs = _entry("gemm", "torch_scaled_mm", dist="fp8-backends-testplugin").cls
    monkeypatch.setattr(theirs, "capabilities", dataclasses.replace(theirs.capabilities, priority=priority))
    backend = resolve_gemm_backend("auto", problem=GemmProblem(n=64, k=32, device="cpu"))
    assert type(backend).__name__ == winner


@pytest.mark.parametrize("how", ["disabled", "blocked"])
def test_disabled_or_blocked_entries_take_no_part_in_a_clash(thirdparty_plugin, monkeypatch, caplog, how):
    if how == "disabled":
        monkeypatch.setenv("FP8_BACKENDS_DISABLED", "toy,fp8_backends_testplugin:torch_scaled_mm")
    else:
        monkeypatch.setenv("FP8_BACKENDS_PLUGINS", "")
    problem = GemmProblem(n=64, k=32, device="cpu")
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        assert type(resolve_gemm_backend("auto", problem=problem)).__name__ == "TorchScaledMMBackend"
        explicit = resolve_gemm_backend("torch_scaled_mm", problem=problem)  # no longer ambiguous
    assert type(explicit).__name__ == "TorchScaledMMBackend"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "failed to load" not in r.getMessage()]


def test_explicit_request_for_two_disabled_entries_names_both(thirdparty_plugin, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "torch_scaled_mm")
    with pytest.raises(BackendUnavailableError) as info:
        resolve_gemm_backend("torch_scaled_mm", problem=GemmProblem(n=64, k=32, device="cpu"))
    msg = str(info.value)
    assert "fp8-backends:torch_scaled_mm: disabled" in msg
    assert "fp8-backends-testplugin:torch_scaled_mm: disabled" in msg


def test_failed_plugin_explicit_choice(thirdparty_plugin):
    with pytest.raises(BackendUnavailableError, match="broken.*failed to load.*No module named"):
        resolve_gemm_backend("broken", problem=GemmProblem(n=64, k=32, device="cpu"))
    with pytest.raises(BackendUnavailableError, match="probe exploded"):
        resolve_gemm_backend("raising", problem=GemmProblem(n=64, k=32, device="cpu"))


def test_plugin_allow_list_blocks_before_import(thirdparty_plugin, monkeypatch):
    import sys

    sys.modules.pop("fp8_backends_testplugin.toy", None)
    monkeypatch.setenv("FP8_BACKENDS_PLUGINS", "some-other-dist")
    toy = _entry("gemm", "toy")
    assert toy.status == "blocked" and "FP8_BACKENDS_PLUGINS" in toy.error
    assert "fp8_backends_testplugin.toy" not in sys.modules  # never imported
    assert _entry("gemm", "torch_scaled_mm", dist="fp8-backends").status == "loaded"  # built-ins always load
    with pytest.raises(BackendUnavailableError, match="blocked"):
        resolve_gemm_backend("toy", problem=GemmProblem(n=8, k=8, device="cpu"))
    assert resolve_gemm_backend(problem=GemmProblem(n=16, k=16, device="cpu")).name == "torch_scaled_mm"
    monkeypatch.setenv("FP8_BACKENDS_PLUGINS", "fp8_backends_testplugin")
    assert _entry("gemm", "toy").status == "loaded"


# --------------------------------------------------------------------------- resolution rules
def test_unknown_name_lists_valid_ones():
    with pytest.raises(UnknownBackendError) as info:
        resolve_gemm_backend("nope")
    msg = str(info.value)
    assert "unknown GEMM backend 'nope'" in msg and "auto" in msg and "torch_scaled_mm" in msg and "torch" in msg
    assert isinstance(info.value, Fp8BackendError) and isinstance(info.value, LookupError)


@pytest.mark.parametrize("sm, expect_ok", [("8.0", False), ("8.9", True), ("9.0", True), ("10.0", True),
                                           ("12.0", True)])
def test_resolution_on_simulated_platforms(sm, expect_ok):
    problem = GemmProblem(n=4096, k=4096, m=256)  # above the measured defaults' decode bucket: static priorities
    platform = simulate_platform(sm)
    if expect_ok:
        assert resolve_gemm_backend(problem=problem, platform=platform).name == "torch_scaled_mm"
    else:
        with pytest.raises(UnsupportedProblemError, match="needs SM >= 8.9; this GPU is SM 8.0"):
            resolve_gemm_backend(problem=problem, platform=platform)
        with pytest.raises(UnsupportedProblemError) as info:
            resolve_gemm_backend("torch", problem=problem, platform=platform)
        assert info.value.reasons and info.value.alternatives == []
        assert isinstance(info.value, ValueError)


def test_explicit_choice_never_falls_back():
    problem = GemmProblem(n=4096, k=4096, m=16, out_dtype="float16", act_scale="per_token",
                          weight_scale="per_channel")
    with pytest.raises(UnsupportedProblemError, match="row-wise FP8 kernel writes bfloat16 only"):
        resolve_gemm_backend("torch_scaled_mm", problem=problem, platform=simulate_platform("9.0"))


def test_odd_k_served_by_padding_and_refused_block_wise():
    """cuBLASLt's FP8 GEMM needs 16-byte aligned rows: torch_scaled_mm pads a per-tensor / per-channel weight on CUDA
    (served), refuses a block-wise one with the reason; torch's CPU _scaled_mm takes any K."""
    sm90 = simulate_platform("9.0")
    assert resolve_gemm_backend("torch", problem=GemmProblem(n=32, k=17), platform=sm90).name == "torch_scaled_mm"
    block = GemmProblem(n=256, k=136, act_scale="per_token_group", weight_scale="block")
    with pytest.raises(UnsupportedProblemError,
                       match=r"K=136 is not a multiple of 16 \(cuBLASLt.s block-scaled FP8 GEMM needs 16-byte"):
        resolve_gemm_backend("torch", problem=block, platform=sm90)
    assert resolve_gemm_backend("torch", problem=GemmProblem(n=30, k=17, device="cpu")).name == "torch_scaled_mm"


def test_env_vars_select_and_disable(monkeypatch):
    problem = GemmProblem(n=32, k=32, device="cpu")
    monkeypatch.setenv("FP8_GEMM_BACKEND", "torch")
    res = resolution.explain("gemm", problem=problem)
    assert res.source == "env" and res.backend.name == "torch_scaled_mm"
    monkeypatch.setenv("FP8_GEMM_BACKEND", "nope")
    with pytest.raises(UnknownBackendError):
        resolve_gemm_backend(problem=problem)
    monkeypatch.delenv("FP8_GEMM_BACKEND")
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "torch_scaled_mm")
    with pytest.raises(BackendUnavailableError, match="disabled by FP8_BACKENDS_DISABLED"):
        resolve_gemm_backend("torch", problem=problem)
    with pytest.raises(UnsupportedProblemError, match="disabled"):
        resolve_gemm_backend("auto", problem=problem)
    monkeypatch.setenv("FP8_NORM_QUANT_BACKEND", "reference")
    assert resolve_norm_quant_backend(problem=NormQuantProblem(hidden=64, device="cpu")).name == "torch"


def test_instances_are_cached_per_options():
    a = resolve_gemm_backend("torch", problem=GemmProblem(n=32, k=32, device="cpu"))
    b = resolve_gemm_backend("torch_scaled_mm")
    c = resolve_gemm_backend("torch@fast_accum=true")
    assert a is b and c is not a and c.config["fast_accum"] == "true"


def test_bad_option_syntax():
    with pytest.raises(BackendOptionError, match="option") as info:
        resolve_gemm_backend("torch@fast_accum")
    assert isinstance(info.value, LookupError) and isinstance(info.value, ValueError)  # as before, and a ValueError


def test_selection_policy_hook_wins_and_is_reported():
    problem = GemmProblem(n=32, k=32, m=8, device="cpu")

    def policy(kind, prob, platform, serving):
        if kind != "gemm":
            return None
        entry = next(c.entry for c in serving if c.entry.name == "torch_scaled_mm")
        return entry, {"fast_accum": "true"}, "test policy says so"

    resolution.register_selection_policy("test", policy)
    try:
        res = resolution.explain("gemm", "auto", problem=problem)
        assert res.source == "test" and res.note == "test policy says so"
        assert res.backend.config["fast_accum"] == "true"
    finally:
        resolution.unregister_selection_policy("test")


def test_broken_policy_falls_back_with_warning(caplog):
    def policy(*_):
        raise RuntimeError("bad lockfile")

    resolution.register_selection_policy("bad", policy)
    try:
        with caplog.at_level(logging.WARNING, logger="fp8_backends"):
            b = resolve_gemm_backend("auto", problem=GemmProblem(n=32, k=32, device="cpu"))
        assert b.name == "torch_scaled_mm" and "bad lockfile" in caplog.text
    finally:
        resolution.unregister_selection_policy("bad")


def test_resolution_without_problem_uses_platform_only():
    assert resolve_gemm_backend(platform=cpu_platform()).name == "torch_scaled_mm"
    # on a (simulated) SM 9.0 GPU: the highest-priority norm-quant provider installed here (flashinfer is not)
    expected = "triton" if importlib.util.find_spec("triton") else "torch"
    assert resolve_norm_quant_backend(platform=simulate_platform("9.0")).name == expected


def test_disabled_accepts_any_spelling_of_the_distribution(monkeypatch):
    from fp8_backends.registry import discovery

    entry = next(e for e in discovery.discover("gemm") if e.name == "torch_scaled_mm")
    for value in ("torch_scaled_mm", "torch", "fp8-backends:torch_scaled_mm", "FP8_Backends:torch_scaled_mm",
                  "x,fp8_backends:torch"):
        monkeypatch.setenv("FP8_BACKENDS_DISABLED", value)
        assert entry.disabled, value
    for value in ("otherdist:torch_scaled_mm", "torch_scaled", "cutlass"):
        monkeypatch.setenv("FP8_BACKENDS_DISABLED", value)
        assert not entry.disabled, value


# --------------------------------------------------------------------------- measured defaults
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed")


@pytest.fixture
def no_shipped_data(monkeypatch):
    """The measured defaults serve GPUs without shipped selection data: turn the SM 9.0 data off."""
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", "off")


@needs_triton
def test_measured_default_prefers_triton_for_decode_on_sm90(monkeypatch, no_shipped_data):
    sm90 = simulate_platform("9.0")
    for m in (1, 16):
        res = resolution.explain("gemm", problem=GemmProblem(n=4096, k=4096, m=m), platform=sm90)
        assert res.backend.name == "triton" and res.source == "measured-default", (m, res.source)
        assert "M <= 16" in res.note
    for m, platform in ((17, sm90), (4096, sm90), (1, simulate_platform("8.9")), (1, simulate_platform("10.0")),
                        (None, sm90)):
        res = resolution.explain("gemm", problem=GemmProblem(n=4096, k=4096, m=m), platform=platform)
        assert res.backend.name == "torch_scaled_mm" and res.source == "priority", (m, platform.arch)
    monkeypatch.setenv("FP8_BACKENDS_DEFAULTS", "0")
    assert resolve_gemm_backend(problem=GemmProblem(n=4096, k=4096, m=1), platform=sm90).name == "torch_scaled_mm"
    monkeypatch.setenv("FP8_BACKENDS_DEFAULTS", "1")
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "triton")  # preferred but not serving: static priorities decide
    assert resolve_gemm_backend(problem=GemmProblem(n=4096, k=4096, m=1), platform=sm90).name == "torch_scaled_mm"


@needs_triton
def test_measured_default_buckets_for_layers(no_shipped_data):
    from fp8_backends.registry import defaults

    sm90 = simulate_platform("9.0")
    assert defaults.buckets("gemm", sm90) == [16, 17]
    assert defaults.buckets("gemm", simulate_platform("10.0")) == [] and defaults.buckets("norm_quant", sm90) == []
    table = resolution.resolve_gemm_buckets(problem=GemmProblem(n=4096, k=4096), platform=sm90)
    assert [(b, p.name) for b, p in table] == [(16, "triton"), (17, "torch_scaled_mm")]
    assert resolution.resolve_gemm_buckets("torch", problem=GemmProblem(n=4096, k=4096), platform=sm90) == []


def test_measured_default_names_only_builtin_providers(no_shipped_data):
    from types import SimpleNamespace

    from fp8_backends.registry import defaults

    sm90 = simulate_platform("9.0")
    problem = GemmProblem(n=4096, k=4096, m=1)

    def cand(name, builtin):
        return SimpleNamespace(entry=SimpleNamespace(name=name, builtin=builtin))

    third_party = cand("triton", False)
    assert defaults.measured_default_policy("gemm", problem, sm90, [third_party]) is None
    ours = cand("triton", True)
    entry, options, note = defaults.measured_default_policy("gemm", problem, sm90, [third_party, ours])
    assert entry is ours.entry and options == {} and "H200" in note
    assert defaults.measured_default_policy("gemm", GemmProblem(n=4096, k=4096, m=64), sm90, [ours]) is None


def test_describe_buckets_states_what_the_last_bucket_serves():
    assert resolution.describe_buckets([(16, "triton"), (17, "torch_scaled_mm")]) == "M<=16:triton,M>16:torch_scaled_mm"
    assert resolution.describe_buckets([(1, "a"), (16, "b"), (256, "c")]) == "M<=1:a,M<=16:b,M>16:c"
    assert resolution.describe_buckets([(8, "a")]) == "a" and resolution.describe_buckets([]) == ""


@needs_triton
def test_measured_default_buckets_are_logged_as_ranges(caplog, no_shipped_data):
    import logging

    sm90 = simulate_platform("9.0")
    with caplog.at_level(logging.INFO, logger="fp8_backends"):
        resolution.resolve_gemm_buckets(problem=GemmProblem(n=1024, k=2048), platform=sm90)
    line = next(r.getMessage() for r in caplog.records if "by M bucket" in r.getMessage())
    assert line.endswith("M<=16:triton[config=auto],M>16:torch_scaled_mm[fast_accum=false]"), line


def test_lockfile_is_asked_before_the_measured_defaults_whatever_the_import_order():
    """The measured defaults registering after the lockfile policy (their module imported later) must not
    shadow a tuned lockfile: ranks, not registration order, decide."""
    from fp8_backends.registry import defaults, lockfile_policy, policy

    resolution.load_builtin_policies()
    saved = list(policy._registered)
    try:
        resolution.register_selection_policy(defaults.POLICY)
        resolution.register_selection_policy("third-party", lambda *_: None)  # rank 0: between the two
        names = [p.name for p in resolution.selection_policies()]
        assert names.index(lockfile_policy.POLICY_NAME) < names.index("third-party") < names.index(defaults.POLICY_NAME)
        resolution.register_selection_policy(lockfile_policy.POLICY)
        names = [p.name for p in resolution.selection_policies()]
        assert names.index(lockfile_policy.POLICY_NAME) == 0 and names[-1] == defaults.POLICY_NAME
        # the bare-callable form of before still registers (wrapped: it distinguishes no buckets)
        wrapped = resolution.register_selection_policy(defaults.POLICY_NAME, defaults.measured_default_policy,
                                                       rank=-100)
        assert isinstance(wrapped, resolution.CallablePolicy) and wrapped.rank == -100
        assert resolution.selection_policies()[-1] is wrapped
        assert wrapped.buckets("gemm", GemmProblem(n=4096, k=4096), simulate_platform("9.0")) == []
    finally:
        policy._registered[:] = saved


def test_a_provider_whose_preload_fails_is_reported_unavailable_by_name():
    import torch

    from fp8_backends.layers import Fp8Linear
    from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend

    class BrokenPreload(TorchScaledMMBackend):
        name = "broken_preload"

        def preload(self) -> None:
            raise ImportError("kernel module missing")

    backend = BrokenPreload()
    w_q = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(BackendUnavailableError, match="broken_preload.*preload\\(\\) failed.*kernel module missing"):
        backend.prepare_weight(w_q, torch.ones(1))
    layer = Fp8Linear(64, 32, act_scale="per_tensor_dynamic", backend=backend)
    layer.load_weights(w_q, torch.ones(1))
    with pytest.raises(Fp8BackendError, match=r"(?s)broken_preload.*preload\(\) failed"):  # now unavailable
        layer.process_weights_after_loading()
    calls = []
    ok = TorchScaledMMBackend()
    ok.preload = lambda: calls.append(1)
    ok.ensure_preloaded()
    ok.ensure_preloaded()
    assert calls == [1]  # once per instance


def test_auto_skips_a_plugin_whose_preload_fails_and_lists_it_unavailable(monkeypatch, caplog):
    """A third-party provider that outranks the built-ins but cannot load its kernels: ``auto`` warns and
    moves on, the listing then reports it unavailable with the reason, and naming it fails loudly."""
    from fake_provider import install_preload_failure

    entry = install_preload_failure(monkeypatch, "eager_to_load",
                                    OSError("libkernels.so: cannot open shared object file"), "plugin-dist")
    problem = GemmProblem(n=32, k=64, m=4, device="cpu")
    assert resolution.explain("gemm", problem=problem).backend.name == "eager_to_load"  # outranks the built-ins
    try:
        with caplog.at_level(logging.WARNING, logger="fp8_backends"):
            assert resolve_gemm_backend(problem=problem).name == "torch_scaled_mm"
        assert "eager_to_load" in caplog.text and "cannot open shared object" in caplog.text
        res = resolution.explain("gemm", problem=problem)
        reasons = next(c.reasons for c in res.candidates if c.entry is entry)
        assert reasons and "preload() failed" in reasons[0]
        with pytest.raises(BackendUnavailableError, match="preload\\(\\) failed"):
            resolve_gemm_backend("eager_to_load", problem=problem)
    finally:
        from fp8_backends.core.backend import clear_availability_cache

        clear_availability_cache()


# --------------------------------------------------------------------------- FP8_BACKENDS_DISABLED by kind
@pytest.mark.parametrize(
    "text, item",
    [
        ("torch", (None, None, "torch")),
        ("gemm:torch", ("gemm", None, "torch")),
        ("norm_quant:torch", ("norm_quant", None, "torch")),
        ("norm-quant:torch", ("norm_quant", None, "torch")),
        ("FP8_Backends:torch_scaled_mm", (None, "fp8-backends", "torch_scaled_mm")),
        ("gemm:acme.fp8:torch_scaled_mm", ("gemm", "acme-fp8", "torch_scaled_mm")),
        ("gemm:gemm:x", ("gemm", "gemm", "x")),  # a distribution literally called gemm
    ],
)
def test_disabled_item_syntax(text, item):
    from fp8_backends.core import settings

    assert tuple(settings.parse_disabled_item(text)) == item


def test_disabled_scoped_by_kind(monkeypatch):
    gemm, norm = _entry("gemm", "torch_scaled_mm"), _entry("norm_quant", "torch")
    cases = {  # value -> (GEMM torch_scaled_mm disabled, norm-quant torch disabled)
        "torch": (True, True),  # a plain name keeps its meaning: every provider answering to it
        "gemm:torch": (True, False),
        "norm_quant:torch": (False, True),
        "norm-quant:fp8-backends:reference": (False, True),
        "gemm:fp8_backends:torch": (True, False),
        "gemm:otherdist:torch": (False, False),
        "norm_quant:torch_scaled_mm": (False, False),
    }
    for value, expected in cases.items():
        monkeypatch.setenv("FP8_BACKENDS_DISABLED", value)
        assert (gemm.disabled, norm.disabled) == expected, value
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "gemm:torch")
    # the CPU keeps its norm-quant provider when only the GEMM one is disabled
    assert resolve_norm_quant_backend(problem=NormQuantProblem(hidden=64, device="cpu")).name == "torch"
    with pytest.raises(UnsupportedProblemError, match="disabled"):
        resolve_gemm_backend(problem=GemmProblem(n=32, k=32, device="cpu"))


def test_empty_plugin_allow_list_blocks_every_plugin_and_keeps_the_built_ins(thirdparty_plugin, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_PLUGINS", "")
    for kind in ("gemm", "norm_quant"):
        entries = discovery.discover(kind)
        assert {e.status for e in entries if not e.builtin} == {"blocked"}
        assert {e.status for e in entries if e.builtin} == {"loaded"}


# --------------------------------------------------------------------------- reasons people read
def test_cpu_machine_reasons_never_ask_to_install_gpu_only_extras(monkeypatch):
    from fp8_backends import list as listing
    from fp8_backends.providers.flashinfer import common

    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "flashinfer" else real(name))
    for problem in (None, GemmProblem(n=64, k=64, device="cpu")):
        res = resolution.explain("gemm", problem=problem, platform=cpu_platform())
        flashinfer = next(c for c in res.candidates if c.entry.name == "flashinfer_bmm")
        assert flashinfer.reasons and not any("install" in r for r in flashinfer.reasons), flashinfer.reasons
        assert any("cuda" in r for r in flashinfer.reasons)
    data = listing.collect(cpu_platform())
    cuda_only = [p for p in data["providers"] if p["capabilities"].get("devices") == ["cuda"]]
    assert cuda_only and all(p["reasons"] for p in cuda_only)
    assert not [r for p in cuda_only for r in p["reasons"] if "install" in r], cuda_only
    # on a GPU where the provider could run, the install hint is the useful answer
    sm90 = resolution.explain("gemm", problem=GemmProblem(n=64, k=64), platform=simulate_platform("9.0"))
    flashinfer = next(c for c in sm90.candidates if c.entry.name == "flashinfer_bmm")
    assert flashinfer.reasons == ["missing Python module(s): flashinfer (install: pip install fp8-backends[flashinfer])"
                                  ]


def test_simulated_sm_shows_architecture_reasons_of_providers_not_installed_here(monkeypatch):
    from fp8_backends.providers.flashinfer import common

    real = common._find_spec
    monkeypatch.setattr(common, "_find_spec", lambda name: None if name == "flashinfer" else real(name))
    res = resolution.explain("gemm", problem=GemmProblem(n=64, k=64), platform=simulate_platform("8.0"))
    flashinfer = next(c for c in res.candidates if c.entry.name == "flashinfer_bmm")
    assert flashinfer.reasons[0] == "needs SM >= 8.9; this GPU is SM 8.0"
    assert flashinfer.reasons[1] == "also unavailable in this process: missing Python module(s): flashinfer"


def test_simulated_sm_says_what_it_can_about_a_provider_that_failed_to_load(thirdparty_plugin):
    res = resolution.explain("gemm", problem=GemmProblem(n=64, k=64), platform=simulate_platform("9.0"))
    broken = next(c for c in res.candidates if c.entry.name == "broken")
    assert "failed to load" in broken.reasons[0] and "architectures are unknown" in broken.reasons[1]


def test_errors_name_clashing_providers_with_their_distribution(thirdparty_plugin, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "toy")
    with pytest.raises(UnsupportedProblemError) as info:  # CUDA tensors on the CPU: nobody can serve
        resolve_gemm_backend(problem=GemmProblem(n=64, k=32, device="cuda"), platform=cpu_platform())
    msg = str(info.value)
    assert "- fp8-backends:torch_scaled_mm:" in msg and "- fp8-backends-testplugin:torch_scaled_mm:" in msg
    assert "- torch_scaled_mm:" not in msg and "- cutlass:" in msg  # unique names stay short
    assert any(r.startswith("fp8-backends-testplugin:torch_scaled_mm: ") for r in info.value.reasons)
    with pytest.raises(BackendUnavailableError, match="providers that can serve: .*fp8-backends:torch_scaled_mm"):
        resolve_gemm_backend("toy", problem=GemmProblem(n=64, k=32, device="cpu"))


def test_a_provider_whose_support_check_raises_is_never_usable(thirdparty_plugin):
    res = resolution.explain("gemm", problem=GemmProblem(n=64, k=32, device="cpu"))
    bad = next(c for c in res.candidates if c.entry.name == "badcheck")
    assert not bad.ok and bad.reasons == ["support check raised ZeroDivisionError: support check exploded"]
    assert res.backend.name == "toy"


_BROKEN_RECORDS = '''
from typing import ClassVar

from fp8_backends.core.capabilities import GemmCapabilities, NormQuantCapabilities
from fp8_backends.core.types import DeviceKind
from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend


class _Raises:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError("capabilities exploded")


class PriorityText(TorchScaledMMBackend):
    name: ClassVar[str] = "priority_text"
    aliases: ClassVar[tuple[str, ...]] = ()
    capabilities = GemmCapabilities(devices=frozenset({DeviceKind.CPU}), priority="high")


class RecordRaises(TorchScaledMMBackend):
    name: ClassVar[str] = "record_raises"
    aliases: ClassVar[tuple[str, ...]] = ()
    capabilities = _Raises()


class NormRecord(TorchScaledMMBackend):
    name: ClassVar[str] = "norm_record"
    aliases: ClassVar[tuple[str, ...]] = ()
    capabilities = NormQuantCapabilities(devices=frozenset({DeviceKind.CPU}))
'''


def test_a_plugin_with_a_broken_capability_record_is_listed_failed_and_breaks_nothing(tmp_path, monkeypatch, capsys):
    """A capability record that is not one (a priority as text, attributes that raise, a norm-quant record on a GEMM
    provider): the entry point is listed failed with the reason; the listing and ``auto`` go on; registering such a
    class in-process is refused."""
    from fp8_backends import list as listing
    from fp8_backends.core.errors import InvalidTypeError
    from fp8_backends.core.types import GemmProblem
    from fp8_backends.registry import discovery
    from fp8_backends.registry.registration import register_provider
    from fp8_backends.registry.resolution import resolve_gemm_backend

    (tmp_path / "broken_records.py").write_text(_BROKEN_RECORDS)
    info = tmp_path / "broken_records-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-records\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fp8_backends.gemm]\npriority_text = broken_records:PriorityText\n"
                                           "record_raises = broken_records:RecordRaises\n"
                                           "norm_record = broken_records:NormRecord\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    discovery.refresh()
    try:
        found = {e.name: e for e in discovery.discover("gemm")}
        want = {"priority_text": "priority must be an int", "record_raises": "raised RuntimeError",
                "norm_record": "must be a GemmCapabilities"}
        for name, reason in want.items():
            assert found[name].status == discovery.FAILED and reason in found[name].error, found[name]
        assert listing.main([]) == 0 and "priority_text" in capsys.readouterr().out
        assert resolve_gemm_backend("auto", problem=GemmProblem(n=64, k=64, device="cpu")).name != "priority_text"
        import broken_records

        with pytest.raises(InvalidTypeError, match="priority must be an int"):
            register_provider(broken_records.PriorityText, dist="broken-records-2")
    finally:
        sys.modules.pop("broken_records", None)
        discovery.refresh()


def test_the_plugin_allowlist_blocks_each_distribution_of_a_shared_entry_point(tmp_path, monkeypatch):
    """Two distributions registering the same entry point (name and target): ``FP8_BACKENDS_PLUGINS`` allowing one
    leaves the other's entry blocked (the allowlist is per distribution, not per entry point)."""
    from fp8_backends.registry import discovery

    (tmp_path / "shared_ep.py").write_text(
        "from typing import ClassVar\n"
        "from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend\n\n\n"
        "class SharedMM(TorchScaledMMBackend):\n"
        "    name: ClassVar[str] = 'shared_mm'\n"
        "    aliases: ClassVar[tuple[str, ...]] = ()\n")
    for dist in ("dist-a", "dist-b"):
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("[fp8_backends.gemm]\nshared_mm = shared_ep:SharedMM\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        for allowed, blocked in (("dist-a", "dist-b"), ("dist-b", "dist-a")):
            monkeypatch.setenv("FP8_BACKENDS_PLUGINS", allowed)
            discovery.refresh()
            status = {e.dist: e.status for e in discovery.discover("gemm") if e.name == "shared_mm"}
            assert status == {allowed: discovery.LOADED, blocked: discovery.BLOCKED}, status
    finally:
        sys.modules.pop("shared_ep", None)
        discovery.refresh()
