"""What the property-based tests share (``tests/test_fuzz.py``, ``tests/test_fuzz_views.py``): the session seed and
scale, hypothesis' settings, and the providers they fuzz (a :class:`Target` per provider and device;
:data:`NORM_TARGETS`, the norm-quant providers both fuzz).

- ``FP8_FUZZ_SEED`` (default 20261130) seeds every fuzz test; a failure prints it with hypothesis'
  ``@reproduce_failure`` blob.
- ``FP8_FUZZ_SCALE`` multiplies the example counts (``0.1`` for a quick run).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, seed, settings

SEED = int(os.environ.get("FP8_FUZZ_SEED", "20261130"))
SCALE = float(os.environ.get("FP8_FUZZ_SCALE", "1"))


def fuzz(examples: int):
    """Hypothesis settings for one fuzz test: ``examples`` × FP8_FUZZ_SCALE examples, the session seed, no example
    database (CI is stateless: the seed and the printed blob reproduce a failure), no deadline."""

    def wrap(fn):
        fn = settings(max_examples=max(1, round(examples * SCALE)), deadline=None, database=None, print_blob=True,
                      suppress_health_check=list(HealthCheck))(fn)
        return seed(SEED)(fn)

    return wrap


@dataclass(frozen=True)
class Target:
    kind: str  # "gemm" or "norm_quant"
    spec: str  # a registry request
    device: str
    label: str

    @property
    def gpu(self) -> bool:
        return self.device == "cuda"


def target(kind: str, spec: str, device: str, *marks) -> object:
    """A ``pytest.param`` of one provider on one device (``gpu``-marked on CUDA), labelled for the case counts."""
    label = f"{kind}:{spec.split('@')[0]}@{device}" + ("-interpreter" if device == "cpu" and "triton" in spec else "")
    gpu = (pytest.mark.gpu,) if device == "cuda" else ()
    return pytest.param(Target(kind, spec, device, label), marks=(*gpu, *marks), id=label)



#: every norm-quant provider, on the CPU (Triton's under the interpreter) and on CUDA: both fuzz files run them all
NORM_TARGETS = [target("norm_quant", spec, device) for spec, device in (
    ("torch", "cpu"), ("triton", "cpu"), ("torch", "cuda"), ("triton", "cuda"), ("flashinfer", "cuda"))]

def provider(target: Target):
    """The provider instance, or a skip with the registry's reason."""
    from fp8_backends.core.errors import Fp8BackendError
    from fp8_backends.core.types import GemmProblem, NormQuantProblem
    from fp8_backends.registry.resolution import resolve_gemm_backend, resolve_norm_quant_backend

    if target.device == "cpu" and "triton" in target.spec and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton providers run on the CPU only under TRITON_INTERPRET=1 (conftest sets it)")
    try:
        if target.kind == "gemm":
            return resolve_gemm_backend(target.spec, problem=GemmProblem(n=64, k=64, m=8, device=target.device))
        return resolve_norm_quant_backend(target.spec, problem=NormQuantProblem(hidden=64, device=target.device))
    except Fp8BackendError as exc:
        pytest.skip(f"{target.spec} on {target.device}: {exc}")
