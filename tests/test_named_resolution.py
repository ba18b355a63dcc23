"""An explicit name evaluates only the entries it names (stevedore's ``named`` loads only what was named): the
other providers are neither constructed nor probed, unless an error has to list the ones that could serve."""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
from fake_provider import FakeMM, install_fake

from fp8_backends import (
    BackendOptionError,
    BackendUnavailableError,
    GemmProblem,
    UnknownBackendError,
    UnsupportedProblemError,
)
from fp8_backends.core.types import Availability
from fp8_backends.registry import resolution

CPU = GemmProblem(n=32, k=32, m=4, device="cpu")


class Touched(FakeMM):
    """A provider that records every evaluation of it: availability, construction, support check."""

    name: ClassVar[str] = "fake_mm"
    calls: ClassVar[list[str]] = []

    @classmethod
    def availability(cls) -> Availability:
        cls.calls.append("availability")
        return super().availability()

    def __init__(self, **options: str) -> None:
        type(self).calls.append("construct")
        super().__init__(**options)

    def supports(self, problem=None, platform=None) -> list[str]:
        type(self).calls.append("supports")
        return super().supports(problem, platform)


class Exploding(FakeMM):
    """A provider whose every evaluation raises: touching it would log a WARNING and mark it unusable."""

    name: ClassVar[str] = "fake_mm"

    def __init__(self, **options: str) -> None:
        raise RuntimeError("constructed although another provider was named")


@pytest.fixture
def touched(monkeypatch):
    Touched.calls = []
    install_fake(monkeypatch, Touched)
    return Touched.calls


@pytest.mark.parametrize("request_text", ["torch_scaled_mm", "torch", "fp8-backends:torch_scaled_mm",
                                          "torch_scaled_mm@fast_accum=false", None])
def test_an_explicit_name_evaluates_no_other_provider(touched, monkeypatch, request_text):
    if request_text is None:  # a name from the environment is an explicit name too
        monkeypatch.setenv("FP8_GEMM_BACKEND", "torch")
    backend = resolution.resolve("gemm", request_text, problem=CPU)
    assert backend.name == "torch_scaled_mm"
    assert touched == []


def test_an_explicit_name_never_constructs_a_broken_neighbour(monkeypatch, caplog):
    entry = install_fake(monkeypatch, Exploding)
    with caplog.at_level(logging.DEBUG, logger="fp8_backends"):
        assert resolution.resolve_gemm_backend("torch_scaled_mm", problem=CPU).name == "torch_scaled_mm"
    assert "constructed although" not in caplog.text
    assert entry.availability().ok  # not marked unusable: it was never constructed
    # auto does evaluate it, and passes over it with the cause
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        res = resolution.explain("gemm", "auto", problem=CPU)
    assert res.backend.name == "torch_scaled_mm"
    assert "constructed although" in next(c for c in res.candidates if c.entry is entry).reasons[0]


def test_unknown_names_and_bad_options_evaluate_nothing(touched):
    with pytest.raises(UnknownBackendError):
        resolution.resolve_gemm_backend("no_such_provider", problem=CPU)
    with pytest.raises(BackendOptionError):
        resolution.resolve_gemm_backend("torch_scaled_mm@no_such_option=1", problem=CPU)
    assert touched == []


def test_the_others_are_evaluated_when_the_error_lists_alternatives(touched):
    # fast accumulation does nothing on the CPU: refused, and the error names who could serve instead
    with pytest.raises(UnsupportedProblemError) as info:
        resolution.resolve_gemm_backend("torch_scaled_mm@fast_accum=true", problem=CPU)
    assert "fake_mm" in info.value.alternatives and "supports" in touched
    touched.clear()
    # cutlass cannot run here (no GPU): unavailable without nvcc or the CUTLASS headers, unsupported (CUDA tensors
    # only) where both are installed; either way with the alternatives
    with pytest.raises((BackendUnavailableError, UnsupportedProblemError),
                       match="providers that can(?: serve)?: .*fake_mm"):
        resolution.resolve_gemm_backend("cutlass", problem=CPU)
    assert "supports" in touched


def test_auto_and_the_listing_still_see_every_provider(touched):
    res = resolution.explain("gemm", "torch_scaled_mm", problem=CPU)
    assert res.backend.name == "torch_scaled_mm" and touched == []
    assert [c.entry.name for c in res.evaluated] == ["torch_scaled_mm"]
    names = [c.entry.name for c in res.candidates]  # what the listing reads: every provider, evaluated now
    assert "fake_mm" in names and "supports" in touched
    touched.clear()
    assert resolution.resolve_gemm_backend("auto", problem=CPU).name == "torch_scaled_mm"
    assert "supports" in touched
