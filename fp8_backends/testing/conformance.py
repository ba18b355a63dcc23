"""Runs the contracts against providers named on the command line (no test file of your own needed)::

    pytest -p fp8_backends.testing.plugin --pyargs fp8_backends.testing.conformance \
        --fp8-provider my-fp8-kernels:my_gemm

or, the same, ``python -m fp8_backends.testing my-fp8-kernels:my_gemm``. Each ``DIST:NAME`` is looked up
among the discovered GEMM and norm-quant providers; the contract of each kind that has it runs (a kind
without it is skipped with that reason).
"""

from __future__ import annotations

from typing import Any

from fp8_backends.testing._base import check_specs, provider_from_spec, registered_in
from fp8_backends.testing.gemm import GemmProviderContract
from fp8_backends.testing.norm_quant import NormQuantProviderContract
from fp8_backends.testing.plugin import requested_providers


def _contract_for(base: type, spec: str) -> type:
    kind = base.kind

    class Contract(base):  # type: ignore[misc, valid-type]
        provider_spec = spec

        def make_provider(self) -> Any:
            if not registered_in(kind, spec):
                import pytest

                pytest.skip(f"{spec} is not a registered {kind} provider")
            return provider_from_spec(kind, spec)

    return Contract


def _define() -> dict[str, type]:
    classes: dict[str, type] = {}
    specs = requested_providers()
    check_specs(specs)  # collecting this module fails with the error
    for i, spec in enumerate(specs):
        suffix = "" if len(specs) == 1 else str(i)
        for base, label in ((GemmProviderContract, "Gemm"), (NormQuantProviderContract, "NormQuant")):
            if registered_in(base.kind, spec):
                cls = _contract_for(base, spec)
                cls.__name__ = cls.__qualname__ = f"Test{label}{suffix}"
                classes[cls.__name__] = cls
    return classes


globals().update(_define())
