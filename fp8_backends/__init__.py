"""fp8_backends: one registry of FP8 GEMM and fused RMSNorm+FP8-quant providers.

Quick use::

    from fp8_backends import GemmProblem, resolve_gemm_backend
    backend = resolve_gemm_backend("auto", problem=GemmProblem(n=4096, k=4096, device="cuda"))
    prepared = backend.prepare_weight(w_q, w_scale)          # once, at load time
    y = backend.gemm(x_q, prepared, x_scale, out_dtype=torch.bfloat16)

Importing this package is cheap: torch, stevedore and kernel libraries load only when used.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

logging.getLogger("fp8_backends").addHandler(logging.NullHandler())

# public name -> module that defines it (imported on first attribute access)
_EXPORTS = {
    "Fp8GemmBackend": "fp8_backends.core.backend",
    "NormQuantBackend": "fp8_backends.core.backend",
    "ProviderBase": "fp8_backends.core.backend",
    "OpGemmBackend": "fp8_backends.core.backend",
    "OpNormQuantBackend": "fp8_backends.core.backend",
    "Capabilities": "fp8_backends.core.capabilities",
    "GemmCapabilities": "fp8_backends.core.capabilities",
    "NormQuantCapabilities": "fp8_backends.core.capabilities",
    "ActScale": "fp8_backends.core.types",
    "Availability": "fp8_backends.core.types",
    "BiasMode": "fp8_backends.core.types",
    "DeviceKind": "fp8_backends.core.types",
    "Fp8Dtype": "fp8_backends.core.types",
    "GemmProblem": "fp8_backends.core.types",
    "NormQuantProblem": "fp8_backends.core.types",
    "OutDtype": "fp8_backends.core.types",
    "PreparedWeight": "fp8_backends.core.types",
    "QuantizedActivation": "fp8_backends.core.types",
    "WeightScale": "fp8_backends.core.types",
    "SelectionObjective": "fp8_backends.core.objective",
    "Fp8BackendError": "fp8_backends.core.errors",
    "UnknownBackendError": "fp8_backends.core.errors",
    "AmbiguousBackendError": "fp8_backends.core.errors",
    "BackendUnavailableError": "fp8_backends.core.errors",
    "UnsupportedProblemError": "fp8_backends.core.errors",
    "InvalidInputError": "fp8_backends.core.errors",
    "InvalidTypeError": "fp8_backends.core.errors",
    "BackendOptionError": "fp8_backends.core.errors",
    "ConfigurationError": "fp8_backends.core.errors",
    "BuildError": "fp8_backends.core.errors",
    "DataFileError": "fp8_backends.core.errors",
    "ProviderOutputError": "fp8_backends.core.errors",
    "CheckpointError": "fp8_backends.core.errors",
    "resolve_gemm_backend": "fp8_backends.registry.resolution",
    "resolve_norm_quant_backend": "fp8_backends.registry.resolution",
    "init_fp8_gemm": "fp8_backends.registry.per_m",
    "PerMGemm": "fp8_backends.registry.per_m",
    "Platform": "fp8_backends.registry.platform",
    "detect_platform": "fp8_backends.registry.platform",
    "simulate_platform": "fp8_backends.registry.platform",
    "list_platforms": "fp8_backends.registry.platform",
    "register_provider": "fp8_backends.registry.registration",
    "unregister_provider": "fp8_backends.registry.registration",
    "registered_providers": "fp8_backends.registry.registration",
    "Registration": "fp8_backends.registry.registration",
    "add_cli_args": "fp8_backends.cli",
    "fp8_linear": "fp8_backends.functional",
    "quantize_model": "fp8_backends.convert",
    "Fp8LinearSlice": "fp8_backends.layers.shared_input",
    "QuantizeSummary": "fp8_backends.convert",
    "static_launch_triton_ops": "fp8_backends.layers.inductor_setup",
    "warm_up": "fp8_backends.layers.warm_up",
    "backends_from_args": "fp8_backends.cli",
    "load_pretrained": "fp8_backends.checkpoints.pretrained",
    "swap_fp8_layers": "fp8_backends.checkpoints.swap",
    "load_fp8_state_dict": "fp8_backends.checkpoints.loader",
    "CheckpointSummary": "fp8_backends.checkpoints.summary",
}

__all__ = sorted(_EXPORTS)


def _lazy_exports(namespace: dict[str, Any], exports: Mapping[str, str]) -> tuple[Callable[[str], Any],
                                                                                Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a package whose public names (``exports``: name -> the module defining it) are
    imported on first attribute access (PEP 562) and then kept in ``namespace``, the package's globals. This package,
    :mod:`fp8_backends.layers` and :mod:`fp8_backends.testing` export their names so."""
    package = namespace["__name__"]

    def get(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(module), name)
        return value

    def names() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return get, names


__getattr__, __dir__ = _lazy_exports(globals(), _EXPORTS)


if TYPE_CHECKING:
    from .checkpoints.loader import load_fp8_state_dict
    from .checkpoints.pretrained import load_pretrained
    from .checkpoints.summary import CheckpointSummary
    from .checkpoints.swap import swap_fp8_layers
    from .cli import add_cli_args, backends_from_args
    from .convert import QuantizeSummary, quantize_model
    from .core.backend import Fp8GemmBackend, NormQuantBackend, OpGemmBackend, OpNormQuantBackend, ProviderBase
    from .core.capabilities import Capabilities, GemmCapabilities, NormQuantCapabilities
    from .core.errors import (
        AmbiguousBackendError,
        BackendOptionError,
        BackendUnavailableError,
        BuildError,
        CheckpointError,
        ConfigurationError,
        DataFileError,
        Fp8BackendError,
        InvalidInputError,
        InvalidTypeError,
        ProviderOutputError,
        UnknownBackendError,
        UnsupportedProblemError,
    )
    from .core.objective import SelectionObjective
    from .core.types import (
        ActScale,
        Availability,
        BiasMode,
        DeviceKind,
        Fp8Dtype,
        GemmProblem,
        NormQuantProblem,
        OutDtype,
        PreparedWeight,
        QuantizedActivation,
        WeightScale,
    )
    from .functional import fp8_linear
    from .layers.shared_input import Fp8LinearSlice
    from .registry.per_m import PerMGemm, init_fp8_gemm
    from .registry.platform import Platform, detect_platform, list_platforms, simulate_platform
    from .registry.registration import Registration, register_provider, registered_providers, unregister_provider
    from .registry.resolution import resolve_gemm_backend, resolve_norm_quant_backend
