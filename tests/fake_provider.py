"""A third-party GEMM provider for the registry, tuner and shipped-data tests (imported by the test modules:
``tests/`` is on ``sys.path`` under pytest's default import mode).

:class:`FakeMM` computes through :func:`fp8_backends.reference.fp8_gemm` on the CPU and on a simulated CUDA
device, with a tunable option whose values change nothing; :func:`install_fake` lists it beside the real GEMM
providers as distribution ``fake-plugin 1.0``, for one test, through :func:`fp8_backends.register_provider`
(:func:`install` does the same for any provider class).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fp8_backends import reference
from fp8_backends.backend import Fp8GemmBackend
from fp8_backends.capabilities import GemmCapabilities
from fp8_backends.registry import discovery
from fp8_backends.registry.discovery import ProviderEntry
from fp8_backends.registry.registration import register_provider
from fp8_backends.types import DeviceKind, Fp8Dtype, PreparedWeight

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


def install_fake(monkeypatch: Any, cls: type[Fp8GemmBackend] = FakeMM) -> ProviderEntry:
    """List ``cls`` beside the real GEMM providers as distribution ``fake-plugin 1.0``, for one test."""
    return install(monkeypatch, cls)
