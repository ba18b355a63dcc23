"""Broken or odd third-party providers installed through entry points: each is reported unusable (failed, with its
reason) and never breaks discovery, resolution, the listing or ``add_cli_args``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from fp8_backends import Availability
from fp8_backends.registry import discovery

PROVIDER_SRC = '''
from fp8_backends import DeviceKind, Fp8GemmBackend, GemmCapabilities, OutDtype


class Good(Fp8GemmBackend):
    name = NAME
    capabilities = GemmCapabilities(devices=frozenset({DeviceKind.CPU}),
                                    out_dtypes=frozenset({OutDtype.BF16, OutDtype.FP32}), priority=PRIO)

    def prepare_weight_impl(self, w_q, w_scale, weight_scale):
        return self.prepare_k_major(w_q, w_scale, weight_scale)

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        x = x_q.float() * x_scale.reshape(-1, 1)
        w = prepared.data.float() * prepared.scale.reshape(-1, 1)
        return (x @ w.t()).to(out_dtype)
'''


def write_plugin(site: Path, dist: str, ep_name: str, *, name: str | None = None, prio: int = 0, pre: str = "",
                 post: str = "") -> str:
    """Write an installed distribution ``dist`` (dist-info and module) into ``site`` whose entry point ``ep_name``
    names a CPU GEMM provider called ``name`` (default ``ep_name``); ``pre`` / ``post`` run before / after the class
    is defined. Returns the module's name."""
    module = dist.replace("-", "_")
    info = site / f"{module}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[fp8_backends.gemm]\n{ep_name} = {module}:Good\n")
    (site / module).mkdir()
    source = PROVIDER_SRC.replace("NAME", repr(ep_name if name is None else name)).replace("PRIO", str(prio))
    (site / module / "__init__.py").write_text(textwrap.dedent(pre) + source + textwrap.dedent(post))
    return module


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., str]:
    """``install(dist, ep_name, **kw)``: install a fake plugin (:func:`write_plugin`) on ``sys.path`` for one test."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    modules: list[str] = []

    def install(dist: str, ep_name: str, **kw: object) -> str:
        modules.append(write_plugin(site, dist, ep_name, **kw))
        discovery.refresh()
        return str(site)

    yield install
    for module in modules:
        sys.modules.pop(module, None)
    discovery.refresh()


def entry_of(kind: str, dist: str) -> discovery.ProviderEntry:
    """The discovered entry of distribution ``dist``."""
    return next(e for e in discovery.discover(kind) if e.dist == dist)


def run_python(site: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run this interpreter with ``site`` on ``PYTHONPATH``."""
    import os

    env = dict(os.environ, PYTHONPATH=site)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------- re-entrant discovery
def test_a_plugin_that_discovers_while_imported_fails_to_load_instead_of_hanging(plugins):
    site = plugins("reent-plugin", "reent", pre="from fp8_backends.registry import discovery\n"
                                              "discovery.discover('norm_quant')\n")
    code = ("import fp8_backends\nfrom fp8_backends.registry import discovery\n"
            "print(fp8_backends.resolve_gemm_backend('auto').name)\n"
            "e = next(e for e in discovery.discover('gemm') if e.name == 'reent')\nprint(e.status, e.error)")
    done = run_python(site, "-c", code, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "torch_scaled_mm"
    assert lines[1].startswith("failed") and "discovery was called while providers are being imported" in lines[1]


def test_a_plugin_that_resolves_while_imported_fails_in_process(plugins):
    plugins("reent-resolve", "reent_resolve", pre="import fp8_backends\nfp8_backends.resolve_gemm_backend('torch')\n")
    entry = entry_of("gemm", "reent-resolve")
    assert entry.status == discovery.FAILED
    assert "BackendUnavailableError" in entry.error and "being imported" in entry.error
    assert discovery.discover("gemm")  # the lock is free again and the scan is over


def test_threads_discovering_at_once_see_one_registry(plugins):
    import threading

    plugins("slow-plugin", "slow_plugin", pre="import time\ntime.sleep(0.2)\n")
    discovery.refresh()
    seen: list[list[discovery.ProviderEntry]] = []
    threads = [threading.Thread(target=lambda: seen.append(discovery.discover("gemm"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(seen) == 4 and all(found is seen[0] for found in seen)  # one scan, its list shared
    assert entry_of("gemm", "slow-plugin").status == discovery.LOADED


# ------------------------------------------------------------------------------------- names, aliases, options
def _listing_and_flags_work() -> None:
    """The listing, the flags and a resolution of a built-in still work."""
    import argparse

    import fp8_backends
    from fp8_backends import list as listing
    from fp8_backends.registry.platform import cpu_platform

    assert fp8_backends.resolve_gemm_backend("torch").name == "torch_scaled_mm"
    data = listing.collect(cpu_platform())
    listing.render(data)
    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser)
    parser.format_help()


@pytest.mark.parametrize("aliases", ["5", "'xyz'", "('', 'fine')", "('auto',)", "('a:b',)", "(None,)"])
def test_a_plugin_with_malformed_aliases_fails_to_load(plugins, aliases):
    plugins("alias-bad", "alias_bad", post=f"Good.aliases = {aliases}\n")
    entry = entry_of("gemm", "alias-bad")
    assert entry.status == discovery.FAILED and "alias" in entry.error
    assert entry.aliases == ()
    _listing_and_flags_work()
    from fp8_backends import UnknownBackendError, resolve_gemm_backend

    for name in ("x", "", "fine"):
        with pytest.raises(UnknownBackendError):
            resolve_gemm_backend(name)


def test_valid_aliases_in_a_list_are_accepted(plugins):
    plugins("alias-list", "alias_list", post="Good.aliases = ['al_one', 'al_two']\n")
    entry = entry_of("gemm", "alias-list")
    assert entry.status == discovery.LOADED and entry.aliases == ("al_one", "al_two")


@pytest.mark.parametrize("aliases", [5, "xyz", ("", "fine"), ("auto",), ("a b",)])
def test_register_provider_refuses_malformed_aliases(monkeypatch, aliases):
    from fake_provider import FakeMM

    from fp8_backends import register_provider
    from fp8_backends.core.errors import InvalidInputError

    monkeypatch.setattr(discovery, "in_process", discovery.in_process)
    cls = type("AliasedMM", (FakeMM,), {"aliases": aliases})
    with pytest.raises(InvalidInputError, match="alias"):
        register_provider(cls, dist="alias-engine")


@pytest.mark.parametrize("options", ["'abc'", "{'runner': 'ab'}", "{'runner': ()}", "{'runner': (1, 2)}",
                                     "{5: ('a',)}"])
def test_a_plugin_whose_options_are_malformed_fails_and_the_listing_still_prints(plugins, options):
    plugins("opts-bad", "opts_bad", post=f"Good.options = {options}\n")
    entry = entry_of("gemm", "opts-bad")
    assert entry.status == discovery.FAILED and "option" in entry.error
    _listing_and_flags_work()


def test_register_provider_refuses_options_that_are_no_mapping(monkeypatch):
    from fake_provider import FakeMM

    from fp8_backends import register_provider
    from fp8_backends.core.errors import InvalidTypeError

    monkeypatch.setattr(discovery, "in_process", discovery.in_process)
    with pytest.raises(InvalidTypeError, match="options must be a mapping"):
        register_provider(type("OptsMM", (FakeMM,), {"options": "abc"}), dist="opts-engine")


def test_the_listing_survives_options_broken_after_loading(monkeypatch):
    from fake_provider import FakeMM, install

    from fp8_backends import list as listing
    from fp8_backends.registry.platform import cpu_platform

    cls = type("LaterMM", (FakeMM,), {})
    install(monkeypatch, cls, dist="later-engine")
    monkeypatch.setattr(cls, "options", "abc")
    row = next(p for p in listing.collect(cpu_platform())["providers"] if p["distribution"] == "later-engine")
    assert row["options"] == {}


@pytest.mark.parametrize("ep_name", ["bad@name", "bad:name", "auto", "bad,name"])
def test_an_entry_point_under_a_name_requests_cannot_give_fails_to_load(plugins, ep_name):
    plugins("nm-bad", ep_name)
    entry = entry_of("gemm", "nm-bad")
    assert entry.status == discovery.FAILED and "not a valid provider name" in entry.error
    from fp8_backends import cli

    assert ep_name not in cli.backend_choices("gemm")[1:]
    _listing_and_flags_work()


def test_one_name_rule_for_entry_points_and_registrations():
    for name in ("bad@name", "bad:name", "auto", "", "a b", "a=b", None, 5):
        assert discovery.name_problem(name) is not None
    for name in ("fine", "fast%gemm", "a-b.c_d"):
        assert discovery.name_problem(name) is None


def test_a_percent_in_a_provider_name_leaves_the_engine_help_intact(plugins):
    import argparse

    import fp8_backends

    plugins("nm-pct", "fast%gemm", post="Good.aliases = ('pct%alias',)\n")
    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser)
    text = " ".join(parser.format_help().split())
    assert "fast%gemm" in text and "pct%alias" in text
    assert parser.parse_args(["--fp8-gemm-backend", "fast%gemm"]).fp8_gemm_backend == "fast%gemm"


# ------------------------------------------------------------------------------------- malformed hook results
@pytest.mark.parametrize("made", [Availability.no(None), Availability(1, "x"), Availability.no("x", 5),
                                  Availability.yes(["fine"])])
def test_a_malformed_availability_makes_only_that_provider_unusable(monkeypatch, made):
    from fake_provider import FakeMM, install

    import fp8_backends
    from fp8_backends import list as listing
    from fp8_backends.core.errors import BackendUnavailableError
    from fp8_backends.registry.platform import cpu_platform

    cls = type("BadAvailMM", (FakeMM,), {"name": "bad_avail", "availability": classmethod(lambda c: made)})
    entry = install(monkeypatch, cls, dist="avail-engine")
    assert "malformed Availability" in entry.unusable_reason()
    assert fp8_backends.resolve_gemm_backend("auto").name != "bad_avail"
    with pytest.raises(BackendUnavailableError, match="malformed Availability"):
        fp8_backends.resolve_gemm_backend("bad_avail")
    row = next(p for p in listing.collect(cpu_platform())["providers"] if p["name"] == "bad_avail")
    assert not row["usable"] and "malformed Availability" in row["reasons"][0]


def test_a_lone_string_from_extra_reasons_is_one_reason(monkeypatch):
    from fake_provider import FakeMM, install

    from fp8_backends.registry.platform import cpu_platform

    cls = type("StrReasonMM", (FakeMM,), {"name": "str_reason", "extra_reasons": lambda self, p, pl: "needs K<=64"})
    install(monkeypatch, cls, dist="reason-engine")
    assert cls().supports(None, cpu_platform()) == ["needs K<=64"]
    odd = type("OddReasonMM", (FakeMM,), {"name": "odd_reason", "extra_reasons": lambda self, p, pl: 5})
    assert odd().supports(None, cpu_platform()) == ["extra_reasons() returned 5, not a list of reasons"]


def test_a_lone_string_in_requires_is_one_module(monkeypatch):
    from fake_provider import FakeMM

    from fp8_backends.core.backend import clear_availability_cache

    cls = type("StrRequiresMM", (FakeMM,), {"name": "str_requires", "requires": "no_such_module_xyz"})
    clear_availability_cache()
    assert cls.cached_availability().reason == "missing Python module(s): no_such_module_xyz"
    assert type("TorchMM", (FakeMM,), {"requires": "torch"}).availability().ok


# ------------------------------------------------------------------------------------- one verdict on a failed preload
@pytest.fixture
def failing_preload(monkeypatch):
    """A provider that outranks the built-ins on the CPU but whose preload fails, registered for one test."""
    from fake_provider import install_preload_failure

    from fp8_backends.core.backend import clear_availability_cache

    yield install_preload_failure(monkeypatch, "preload_fails", RuntimeError("preload boom"), "preload-engine")
    clear_availability_cache()


def test_the_flags_help_and_the_listing_agree_on_a_provider_whose_preload_fails(failing_preload):
    import argparse

    import fp8_backends
    from fp8_backends import list as listing
    from fp8_backends.registry.platform import detect_platform

    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser, norm_quant=False)
    # the listing loads auto's choice (its preload fails); the help, which loads nothing, then knows it
    row = next(p for p in listing.collect(detect_platform(None))["providers"] if p["name"] == "preload_fails")
    assert not row["usable"] and "preload() failed" in row["reasons"][0]
    here = " ".join(parser.format_help().split()).split("Here:")[1]
    assert "preload_fails (unavailable)" in here and "torch_scaled_mm," in here


def _install_refuser(monkeypatch):
    """A provider usable on the CPU that refuses every problem: naming it raises UnsupportedProblemError with the
    alternatives, on any machine (a built-in such as cutlass is unavailable, not unsupported, where nvcc is not)."""
    from fake_provider import install

    from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend

    class RefusesAll(TorchScaledMMBackend):
        name = "refuses_all"

        def extra_reasons(self, problem, platform):
            return ["refuses every problem"]

    install(monkeypatch, RefusesAll, dist="refuser-engine")


def test_errors_never_offer_a_provider_whose_preload_fails(failing_preload, monkeypatch):
    from fp8_backends import BackendUnavailableError, GemmProblem, UnsupportedProblemError, resolve_gemm_backend

    with pytest.raises(BackendUnavailableError, match="preload"):  # its preload fails once, at its first resolution
        resolve_gemm_backend("preload_fails", problem=GemmProblem(n=32, k=64, m=4, device="cpu"))
    _install_refuser(monkeypatch)
    with pytest.raises(UnsupportedProblemError) as info:
        resolve_gemm_backend("refuses_all", problem=GemmProblem(n=32, k=64, m=4, device="cpu"))
    assert "preload_fails" not in info.value.alternatives and "torch_scaled_mm" in info.value.alternatives
    assert "preload() failed" in failing_preload.unusable_reason()


def test_adding_the_flags_evaluates_no_provider(monkeypatch):
    import argparse

    import fp8_backends
    from fp8_backends.registry import resolution

    def refuse(*args, **kwargs):
        raise AssertionError("add_cli_args evaluated the providers")

    monkeypatch.setattr(resolution, "explain", refuse)
    monkeypatch.setattr(resolution, "explain_loaded", refuse)
    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser)
    assert parser.parse_args(["--fp8-gemm-backend", "torch"]).fp8_gemm_backend == "torch"
    assert parser.parse_args([]).fp8_norm_quant_backend is None


def test_an_unknown_name_error_lists_no_name_that_failed_the_name_rule(plugins):
    from fp8_backends import UnknownBackendError, resolve_gemm_backend

    plugins("nm-auto", "auto")
    plugins("nm-at", "bad@name")
    with pytest.raises(UnknownBackendError) as info:
        resolve_gemm_backend("nope")
    assert "auto" not in info.value.valid and "bad@name" not in info.value.valid
    assert "torch_scaled_mm" in info.value.valid and str(info.value).count("auto") == 1


def test_an_error_loads_no_provider_it_offers(monkeypatch):
    """Not even ``auto``'s choice: an error may be caught by its caller, and a preload may build a kernel library."""
    import dataclasses

    from fake_provider import install

    from fp8_backends import GemmProblem, UnsupportedProblemError, resolve_gemm_backend
    from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend

    loaded: list[str] = []

    class CountsLoads(TorchScaledMMBackend):
        name = "counts_loads"
        capabilities = dataclasses.replace(TorchScaledMMBackend.capabilities, priority=10_000)  # auto's choice

        def preload(self) -> None:
            loaded.append(self.name)

    install(monkeypatch, CountsLoads, dist="loads-engine")
    _install_refuser(monkeypatch)
    with pytest.raises(UnsupportedProblemError) as info:
        resolve_gemm_backend("refuses_all", problem=GemmProblem(n=32, k=64, m=4, device="cpu"))
    assert "counts_loads" in info.value.alternatives and loaded == []  # offered, never loaded
