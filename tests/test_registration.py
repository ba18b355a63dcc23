"""In-process registration (``fp8_backends.register_provider``): a registered provider is discovered, listed,
ranked by ``auto`` and named exactly like an entry point of its distribution, under the same environment rules
(``FP8_BACKENDS_DISABLED``, ``FP8_BACKENDS_PLUGINS``), until it is unregistered; and it can supply the activation-
quant kernels through the provider hook."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import ClassVar

import pytest

torch = pytest.importorskip("torch")

from fake_provider import FAKE_DIST, FakeMM  # noqa: E402

import fp8_backends  # noqa: E402
from fp8_backends import (  # noqa: E402
    ActScale,
    AmbiguousBackendError,
    BackendUnavailableError,
    DeviceKind,
    GemmProblem,
    InvalidInputError,
    InvalidTypeError,
    NormQuantCapabilities,
    UnknownBackendError,
    quant,
    register_provider,
    registered_providers,
    resolve_gemm_backend,
    resolve_norm_quant_backend,
    unregister_provider,
)
from fp8_backends.core import reference  # noqa: E402
from fp8_backends.list import collect, render  # noqa: E402
from fp8_backends.providers.torch_norm_quant import TorchNormQuantBackend  # noqa: E402
from fp8_backends.registry import discovery, resolution  # noqa: E402
from fp8_backends.registry.platform import cpu_platform  # noqa: E402

PROBLEM = GemmProblem(n=32, k=64, m=4, device="cpu")


class TopMM(FakeMM):
    """FakeMM above every built-in (auto picks it on the CPU)."""

    name: ClassVar[str] = "top_mm"
    aliases: ClassVar[tuple[str, ...]] = ("top",)
    capabilities = dataclasses.replace(FakeMM.capabilities, priority=1000)


@pytest.fixture(autouse=True)
def _clean():
    """No registration leaks out of a test (each test unregisters what it registered; this checks it)."""
    before = dict(discovery.in_process)
    resolution.reset_caches()
    yield
    leaked = [e.qualified_name for k, e in discovery.in_process.items() if k not in before]
    discovery.in_process = before
    resolution.reset_caches()
    quant.reset_default_impls()
    assert not leaked, f"registrations left behind: {leaked}"


def _names(kind="gemm"):
    return [e.qualified_name for e in discovery.discover(kind)]


def test_registered_provider_is_discovered_listed_and_resolved_like_an_entry_point():
    builtins = _names()
    with register_provider(TopMM, dist=FAKE_DIST, version="2.0") as reg:
        assert reg.active and reg.entry in registered_providers("gemm")
        assert _names() == [*builtins, "fake-plugin:top_mm"]  # after the entry points
        entry = discovery.discover("gemm")[-1]
        assert (entry.origin, entry.status, entry.cls, entry.dist_version) == ("in_process", "loaded", TopMM, "2.0")
        assert entry.target == f"{TopMM.__module__}:TopMM" and not entry.builtin
        for request in ("top_mm", "top", "fake-plugin:top_mm", "fake_plugin:top_mm", "top_mm@variant=b"):
            assert isinstance(resolve_gemm_backend(request, problem=PROBLEM), TopMM), request
        assert resolve_gemm_backend(problem=PROBLEM).label == "top_mm[variant=auto]"  # auto: its priority wins
        assert resolve_gemm_backend("top@variant=a", problem=PROBLEM).config == {"variant": "a"}
        data = collect(cpu_platform(), gemm_problem=PROBLEM)
        listed = next(p for p in data["providers"] if p["name"] == "top_mm")
        assert listed["origin"] == "in_process" and listed["distribution"] == FAKE_DIST and listed["selected"]
        assert all(p["origin"] == "entry_point" for p in data["providers"] if p["name"] != "top_mm")
        assert "fake-plugin 2.0 (in-process)" in render(data)
        parser = argparse.ArgumentParser()
        fp8_backends.add_cli_args(parser)
        assert isinstance(fp8_backends.backends_from_args(
            parser.parse_args(["--fp8-gemm-backend", "top"]), gemm_problem=PROBLEM)[0], TopMM)
    assert not reg.active and _names() == builtins
    with pytest.raises(UnknownBackendError):
        resolve_gemm_backend("top_mm", problem=PROBLEM)
    assert resolve_gemm_backend(problem=PROBLEM).name == "torch_scaled_mm"


def test_the_instance_cache_follows_the_registration():
    class OtherTop(TopMM):
        pass

    with register_provider(TopMM, dist=FAKE_DIST):
        assert type(resolve_gemm_backend("top_mm", problem=PROBLEM)) is TopMM
        with pytest.raises(InvalidInputError, match="registered already"):
            register_provider(OtherTop, dist=FAKE_DIST)
        replacement = register_provider(OtherTop, dist=FAKE_DIST, replace=True)
        assert type(resolve_gemm_backend("top_mm", problem=PROBLEM)) is OtherTop
    # the replaced handle's exit left the newer registration alone
    assert [e.cls for e in registered_providers()] == [OtherTop] and replacement.active
    replacement.unregister()
    replacement.unregister()  # idempotent
    assert not registered_providers()
    with pytest.raises(UnknownBackendError):
        resolve_gemm_backend("top_mm", problem=PROBLEM)


@pytest.mark.parametrize("value", ["top_mm", "top", "fake-plugin:top_mm", "gemm:top_mm"])
def test_disabled_applies(monkeypatch, value):
    with register_provider(TopMM, dist=FAKE_DIST):
        monkeypatch.setenv("FP8_BACKENDS_DISABLED", value)
        assert resolve_gemm_backend(problem=PROBLEM).name == "torch_scaled_mm"
        with pytest.raises(BackendUnavailableError, match="FP8_BACKENDS_DISABLED"):
            resolve_gemm_backend("top_mm", problem=PROBLEM)
        monkeypatch.setenv("FP8_BACKENDS_DISABLED", "norm_quant:top_mm,otherdist:top_mm")
        assert resolve_gemm_backend(problem=PROBLEM).name == "top_mm"


def test_plugins_allowlist_applies(monkeypatch):
    with register_provider(TopMM, dist=FAKE_DIST):
        monkeypatch.setenv("FP8_BACKENDS_PLUGINS", "")
        first, again = discovery.discover("gemm")[-1], discovery.discover("gemm")[-1]
        assert first is again, "one blocked view per allowlist (the listing compares entries by identity)"
        assert (first.status, first.cls, first.origin) == ("blocked", None, "in_process")
        assert "FP8_BACKENDS_PLUGINS" in first.error
        assert resolve_gemm_backend(problem=PROBLEM).name == "torch_scaled_mm"
        with pytest.raises(BackendUnavailableError, match="blocked"):
            resolve_gemm_backend("top_mm", problem=PROBLEM)
        listed = next(p for p in collect(cpu_platform())["providers"] if p["name"] == "top_mm")
        assert listed["status"] == "blocked" and not listed["usable"]
        monkeypatch.setenv("FP8_BACKENDS_PLUGINS", "other-dist, Fake_Plugin")
        assert resolve_gemm_backend(problem=PROBLEM).name == "top_mm"


def test_a_name_two_distributions_register(caplog):
    with register_provider(TopMM, dist=FAKE_DIST), register_provider(TopMM, dist="other-plugin"):
        with pytest.raises(AmbiguousBackendError):
            resolve_gemm_backend("top_mm", problem=PROBLEM)
        assert resolve_gemm_backend("other-plugin:top_mm", problem=PROBLEM).name == "top_mm"
        with caplog.at_level(logging.WARNING, logger="fp8_backends"):
            assert resolve_gemm_backend(problem=PROBLEM).name == "top_mm"
        assert "registered by several" in caplog.text
        removed = unregister_provider("top", dist="other-plugin")  # by alias and distribution
        assert [e.dist for e in removed] == ["other-plugin"]
        assert [e.dist for e in registered_providers()] == [FAKE_DIST]
        unregister_provider(TopMM)


def test_a_norm_quant_provider():
    class CpuNorm(TorchNormQuantBackend):
        name: ClassVar[str] = "cpu_norm"
        aliases: ClassVar[tuple[str, ...]] = ()
        capabilities = dataclasses.replace(TorchNormQuantBackend.capabilities, priority=1000)

    with register_provider(CpuNorm, dist="norm-plugin") as reg:
        assert reg.entry.kind == "norm_quant" and registered_providers("gemm") == []
        assert resolve_norm_quant_backend(problem=fp8_backends.NormQuantProblem(hidden=64, device="cpu")).name \
            == "cpu_norm"
        assert unregister_provider("cpu_norm", kind="norm_quant")[0] is reg.entry


def test_refusals():
    with pytest.raises(InvalidTypeError):
        register_provider(object, dist="x")
    with pytest.raises(InvalidTypeError):
        register_provider(TopMM(), dist="x")
    for name in ("", "a:b", "a b", "auto", "x@y"):
        with pytest.raises(InvalidInputError, match="name"):
            register_provider(type("Bad", (FakeMM,), {"name": name}), dist="x")
    for dist in ("", "a:b", "a b"):
        with pytest.raises(InvalidInputError, match="dist"):
            register_provider(TopMM, dist=dist)
    for dist in ("fp8-backends", "FP8_Backends"):
        with pytest.raises(InvalidInputError, match="entry points"):
            register_provider(TopMM, dist=dist)
    with pytest.raises(UnknownBackendError, match="no in-process registration matches 'top_mm'"):
        unregister_provider("top_mm")
    with register_provider(TopMM, dist=FAKE_DIST):
        with pytest.raises(UnknownBackendError):
            unregister_provider(TopMM, kind="norm_quant")
        with pytest.raises(InvalidInputError):
            unregister_provider(TopMM, kind="attention")
        with pytest.raises(UnknownBackendError):
            unregister_provider(FakeMM)  # the class, not a name: another class
        unregister_provider(TopMM, dist="fake_plugin")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("min_sm", (9,), "min_sm must be None or a \\(major, minor\\) pair"),
    ("devices", frozenset({"cpu"}), "devices must be a frozenset of DeviceKind"),
    ("devices", None, "devices must be a frozenset of DeviceKind"),
    ("devices", frozenset(), "devices must name at least one DeviceKind"),
    ("archs", ("sm90",), "archs entry 'sm90' is not an SM"),
    ("k_align", 0, "k_align must be an int >= 1"),
    ("weight_blocks", frozenset({128}), "weight_blocks must be a frozenset of \\(BN, BK\\) pairs"),
    ("out_dtypes", frozenset({"bfloat16"}), "out_dtypes must be a frozenset of OutDtype"),
])
def test_a_malformed_capability_record_is_refused_and_never_listed(field, value, message):
    """A record whose fields have the wrong types would break every listing and ranking that reads it: refused by
    ``register_provider`` and marked failed by discovery (the same check), naming the field."""
    caps = dataclasses.replace(TopMM.capabilities, **{field: value})
    bad = type("BadCaps", (TopMM,), {"name": "bad_caps", "aliases": (), "capabilities": caps})
    with pytest.raises(InvalidTypeError, match=f"malformed capabilities: .*{message}"):
        register_provider(bad, dist="x")
    assert "malformed capabilities" in discovery._check_class("gemm", "bad_caps", bad)


def test_descriptions_reasons_and_reserved_names_of_plugins():
    """A description that is no string is refused (the listing prints it); ``supports()`` answering a lone string
    gives one reason, and anything but a list of strings (``None``: a missing return) a reason that says so, never
    "can serve"; ``auto`` in any case is reserved."""
    with pytest.raises(InvalidTypeError, match="description must be a str"):
        register_provider(type("Desc", (TopMM,), {"name": "desc_mm", "aliases": (), "description": {"a"}}), dist="x")
    for name in ("AUTO", "Auto"):
        with pytest.raises(InvalidInputError, match="name"):
            register_provider(type("Upper", (FakeMM,), {"name": name, "aliases": ()}), dist="x")
    with pytest.raises(InvalidInputError, match="alias"):
        register_provider(type("UpperAlias", (FakeMM,), {"name": "upper_alias", "aliases": ("Auto",)}), dist="x")

    class OneString(TopMM):
        name: ClassVar[str] = "one_string"
        aliases: ClassVar[tuple[str, ...]] = ()

        def supports(self, problem, platform=None):
            return "needs libfoo"

    class NoReturn(OneString):
        name: ClassVar[str] = "no_return"

        def supports(self, problem, platform=None):
            return None

    with register_provider(OneString, dist=FAKE_DIST), register_provider(NoReturn, dist=FAKE_DIST):
        with pytest.raises(fp8_backends.Fp8BackendError) as err:
            resolve_gemm_backend("one_string", problem=PROBLEM)
        assert "needs libfoo" in str(err.value) and "- n\n" not in str(err.value)
        with pytest.raises(fp8_backends.Fp8BackendError, match="supports\\(\\) returned None, not a list"):
            resolve_gemm_backend("no_return", problem=PROBLEM)
        with pytest.raises(fp8_backends.UnsupportedProblemError, match="supports\\(\\) returned None"):
            resolution.resolve_or_check("gemm", NoReturn(), PROBLEM)
        data = collect(cpu_platform())
        listed = {p["name"]: p for p in data["providers"] if p["kind"] == "gemm"}
        assert listed["one_string"]["reasons"] == ["needs libfoo"] and not listed["no_return"]["usable"]


def test_an_alias_never_takes_a_name_and_alias_clashes_are_reported(caplog):
    """A plugin's alias equal to a built-in's name or alias leaves requests for it to the built-in (with a warning);
    an alias two plugins declare is a clash: ambiguous, warned about and listed."""
    shadow = type("Shadow", (TopMM,), {"name": "shadow_mm", "aliases": ("torch", "cutlass", "shared")})
    twin = type("Twin", (TopMM,), {"name": "twin_mm", "aliases": ("shared",)})
    with register_provider(shadow, dist=FAKE_DIST), register_provider(twin, dist="other-plugin"):
        with caplog.at_level(logging.WARNING, logger="fp8_backends"):
            assert resolve_gemm_backend("torch", problem=PROBLEM).name == "torch_scaled_mm"
            with pytest.raises(fp8_backends.Fp8BackendError) as err:  # the built-in, which cannot run on the CPU
                resolve_gemm_backend("cutlass", problem=PROBLEM)
            assert not isinstance(err.value, AmbiguousBackendError)
            resolve_gemm_backend(problem=PROBLEM)
        assert "declares the alias 'torch', a name of fp8-backends:torch_scaled_mm" in caplog.text
        assert "declares the alias 'cutlass', a name of fp8-backends:cutlass" in caplog.text
        assert "'shared' is an alias of several providers" in caplog.text
        with pytest.raises(AmbiguousBackendError, match="'shared' is an alias of several providers"):
            resolve_gemm_backend("shared", problem=PROBLEM)
        assert resolve_gemm_backend("other-plugin:shared", problem=PROBLEM).name == "twin_mm"
        clashes = collect(cpu_platform())["clashes"]["gemm"]
        assert [c["name"] for c in clashes] == ["shared"]


def test_one_distribution_registering_a_name_twice_serves_the_first():
    """Two entry points of one distribution under one name (a setup.py list allows it): no qualified request could
    tell them apart, so the first serves and the other is listed, blocked, saying why."""
    first = discovery.ProviderEntry(kind="gemm", name="twice", target="pkg.m:A", dist="evil-fp8", dist_version="1",
                                    status=discovery.LOADED)
    second = dataclasses.replace(first, target="pkg.m:B")
    other = dataclasses.replace(first, dist="good-fp8")
    entries = [first, second, other]
    discovery._fail_repeats("gemm", entries)
    assert first.status == discovery.LOADED and other.status == discovery.LOADED
    assert second.status == discovery.BLOCKED and "registers gemm provider 'twice' twice" in second.error


def test_default_distribution_is_the_package_that_holds_the_class():
    import importlib.metadata

    housed = type("Housed", (TopMM,), {"__module__": "stevedore.example_kernels"})
    with register_provider(housed) as reg:
        assert (reg.entry.dist, reg.entry.dist_version) == ("stevedore", importlib.metadata.version("stevedore"))
    loose = type("Loose", (TopMM,), {"__module__": "my_engine_kernels.fp8"})
    with register_provider(loose) as reg:
        assert (reg.entry.dist, reg.entry.dist_version) == ("my_engine_kernels", None)


def test_registrations_survive_a_refresh():
    with register_provider(TopMM, dist=FAKE_DIST):
        discovery.refresh()
        assert "fake-plugin:top_mm" in _names()


# ------------------------------------------------------------------------- the activation-quant provider hook
def _scaled_static(x, scale, fp8_dtype):
    return reference.quantize_static(x, scale, fp8_dtype)


class QuantSupplier(TorchNormQuantBackend):
    """A norm-quant provider that also supplies CPU activation-quant kernels (the static mode only)."""

    name: ClassVar[str] = "quant_supplier"
    aliases: ClassVar[tuple[str, ...]] = ()
    activation_quant_devices: ClassVar[frozenset[str]] = frozenset({"cpu"})
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities(
        devices=frozenset({DeviceKind.CPU}), priority=-1)
    refuse: ClassVar[str] = ""

    @classmethod
    def activation_quant_kernels(cls, device_type):
        if cls.refuse:
            raise BackendUnavailableError(cls.refuse)
        return {ActScale.PER_TENSOR_STATIC: _scaled_static}


def test_a_provider_supplies_the_default_quant_kernels(monkeypatch, caplog):
    assert quant.default_quant_impl("per_tensor_static", "cpu") is quant._REFERENCE[ActScale.PER_TENSOR_STATIC]
    with register_provider(QuantSupplier, dist="quant-plugin"):  # registering forgets the decision
        assert quant.default_quant_impl("per_tensor_static", "cpu") is _scaled_static
        assert quant.default_quant_impl("per_token", "cpu") is quant._REFERENCE[ActScale.PER_TOKEN]  # left out
        x, s = torch.randn(4, 32), torch.tensor([0.05])
        assert torch.equal(quant.quantize_static(x, s).view(torch.uint8),
                           reference.quantize_static(x, s).view(torch.uint8))
        assert all(not r.startswith("quant_supplier") for r in quant._provider_kernels("cuda")[2])  # CPU only
        monkeypatch.setenv("FP8_BACKENDS_DISABLED", "quant_supplier")
        quant.reset_default_impls()
        with caplog.at_level(logging.INFO, logger="fp8_backends"):
            assert quant.default_quant_impl("per_tensor_static", "cpu") is quant._REFERENCE[
                ActScale.PER_TENSOR_STATIC]
        assert "CPU default is the reference" in caplog.text and "disabled by FP8_BACKENDS_DISABLED" in caplog.text
        monkeypatch.delenv("FP8_BACKENDS_DISABLED")
        monkeypatch.setattr(QuantSupplier, "refuse", "needs an AVX-512 CPU")
        kernels, who, reasons = quant._provider_kernels("cpu")
        assert kernels == {} and reasons == ["quant_supplier (quant-plugin): needs an AVX-512 CPU"]
    assert quant.default_quant_impl("per_tensor_static", "cpu") is quant._REFERENCE[ActScale.PER_TENSOR_STATIC]


def test_the_higher_priority_supplier_wins():
    class Second(QuantSupplier):
        name: ClassVar[str] = "second_supplier"
        capabilities = dataclasses.replace(QuantSupplier.capabilities, priority=5)

        @classmethod
        def activation_quant_kernels(cls, device_type):
            return {ActScale.PER_TENSOR_STATIC: reference.quantize_static}

    with register_provider(QuantSupplier, dist="quant-plugin"), register_provider(Second, dist="quant-plugin"):
        assert quant._provider_kernels("cpu")[1] == "second_supplier (quant-plugin)"
        assert quant.default_quant_impl("per_tensor_static", "cpu") is reference.quantize_static


def test_entry_point_names_unchanged():
    from importlib.metadata import entry_points

    def names(group):
        return {ep.name: ep.value for ep in entry_points(group=group) if ep.value.startswith("fp8_backends.")}

    assert names("fp8_backends.gemm") == {
        "torch_scaled_mm": "fp8_backends.providers.torch_scaled_mm:TorchScaledMMBackend",
        "cutlass": "fp8_backends.providers.cutlass.backend:CutlassSm90Backend",
        "flashinfer_bmm": "fp8_backends.providers.flashinfer.gemm:FlashinferBmmBackend",
        "flashinfer_block": "fp8_backends.providers.flashinfer.block:FlashinferBlockBackend",
        "triton": "fp8_backends.providers.triton.gemm:TritonGemmBackend",
    }
    assert names("fp8_backends.norm_quant") == {
        "torch": "fp8_backends.providers.torch_norm_quant:TorchNormQuantBackend",
        "flashinfer": "fp8_backends.providers.flashinfer.norm_quant:FlashinferNormQuantBackend",
        "triton": "fp8_backends.providers.triton.norm_quant:TritonNormQuantBackend",
    }
