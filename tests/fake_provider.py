"""A third-party GEMM provider for the registry, tuner and shipped-data tests (imported by the test modules:
``tests/`` is on ``sys.path`` under pytest's default import mode).

:class:`FakeMM` computes through :func:`fp8_backends.core.reference.fp8_gemm` on the CPU and on a simulated CUDA
device, with a tunable option whose values change nothing; :func:`install_fake` lists it beside the real GEMM
providers as distribution ``fake-plugin 1.0``, for one test, through :func:`fp8_backends.register_provider`
(:func:`install` does the same for any provider class). :class:`SplitAt8` is a selection policy that splits M
between ``fake_mm`` and ``torch_scaled_mm`` (per-M tests on the CPU, without a lockfile or shipped data).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fp8_backends.core import reference
from fp8_backends.core.backend import Fp8GemmBackend
from fp8_backends.core.capabilities import GemmCapabilities
from fp8_backends.core.types import DeviceKind, Fp8Dtype, PreparedWeight
from fp8_backends.registry import discovery, policy, resolution
from fp8_backends.registry.discovery import ProviderEntry
from fp8_backends.registry.registration import register_provider

FAKE_DIST = "fake-plugin"


class FakeMM(Fp8GemmBackend):
    """The reference GEMM under the name ``fake_mm``; ``variant`` a / b are the same computation."""

    name: ClassVar[str] = "fake_mm"
    options: ClassVar[dict[str, tuple[str, ...]]] = {"variant": ("auto", "a", "b")}
    tunable_options: ClassVar[tuple[str, ...]] = ("variant",)
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CUDA, DeviceKind.CPU}), priority=1)

    def prepare_weight_impl(self, w_q, w_scale, weight_scale):
        n, k = w_q.shape
        return PreparedWeight(w_q, w_scale, n, k, Fp8Dtype.of(w_q.dtype), weight_scale, self.name)

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        return reference.fp8_gemm(x_q, prepared.data, x_scale, prepared.scale, out_dtype, bias)


def install(monkeypatch: Any, cls: type, dist: str = FAKE_DIST, version: str | None = "1.0") -> ProviderEntry:
    """Register ``cls`` in-process as ``dist`` (:func:`fp8_backends.register_provider`) for one test: ``monkeypatch``
    puts the registry's in-process table back at teardown (registering already forgot the resolved instances)."""
    monkeypatch.setattr(discovery, "in_process", discovery.in_process)  # the table before: restored at teardown
    return register_provider(cls, dist=dist, version=version).entry


def install_preload_failure(monkeypatch: Any, name: str, error: BaseException, dist: str) -> ProviderEntry:
    """A ``torch_scaled_mm`` copy named ``name`` that outranks every built-in and whose ``preload()`` raises
    ``error``, registered as ``dist`` for one test."""
    import dataclasses

    from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend

    def preload(self: Any) -> None:
        raise error

    cls = type(f"PreloadFails_{name}", (TorchScaledMMBackend,),
               {"name": name, "preload": preload,
                "capabilities": dataclasses.replace(TorchScaledMMBackend.capabilities, priority=10_000)})
    return install(monkeypatch, cls, dist=dist)


def install_fake(monkeypatch: Any, cls: type[Fp8GemmBackend] = FakeMM) -> ProviderEntry:
    """List ``cls`` beside the real GEMM providers as distribution ``fake-plugin 1.0``, for one test."""
    return install(monkeypatch, cls)


class SplitAt8(resolution.SelectionPolicy):
    """``fake_mm`` for M <= 8, ``torch_scaled_mm`` above (rank 1000: before every built-in); its M buckets are 8 and
    9. Needs :func:`install_fake`; :func:`install_split` registers it for one test."""

    name = "split-at-8"
    rank = 1000

    def pick(self, kind, problem, platform, serving):
        m = getattr(problem, "m", None)
        if kind != "gemm" or m is None:
            return None
        want = "fake_mm" if m <= 8 else "torch_scaled_mm"
        entry = next((c.entry for c in serving if c.entry.name == want), None)
        return None if entry is None else resolution.PolicyPick(entry, {}, f"{want} for M={m}")

    def buckets(self, kind, problem, platform):
        return [8, 9] if kind == "gemm" else []


def install_split(monkeypatch: Any) -> SplitAt8:
    """:func:`install_fake`, and :class:`SplitAt8` registered until the test ends (the register is restored)."""
    install_fake(monkeypatch)
    resolution.load_builtin_policies()  # first, so that they register into the register that stays
    monkeypatch.setattr(policy, "_registered", list(policy._registered))
    return resolution.register_selection_policy(SplitAt8())
