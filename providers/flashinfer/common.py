"""What the flashinfer providers share and can decide without importing torch or flashinfer.

- :func:`base_availability`: flashinfer and torch importable (``find_spec`` only) and a CUDA device
  present (a real one, or one simulated through ``FP8_BACKENDS_SIMULATE_SM``).
- :func:`import_flashinfer` / :func:`missing_features`: the lazy import and the ``hasattr`` feature
  probe, each done once per process (results cached; :func:`reset_caches` forgets them for tests).
- The support tables of flashinfer 0.7's ``bmm_fp8`` runners (``supported_compute_capability`` of
  its ``_cublas/_cudnn/_cutlass_bmm_fp8_requirement``), as data: :func:`runner_reasons`.
- :func:`cache_dir` / :func:`autotune_cache_path`: where flashinfer's autotuning results live
  (:func:`fp8_backends.core.settings.cache_dir`: ``$FP8_BACKENDS_CACHE_DIR``, else ``$XDG_CACHE_HOME/fp8_backends``,
  else ``~/.cache/fp8_backends``), beside the project's own tuning data.

Nothing here imports torch or flashinfer at module level: stevedore imports the provider modules
(and so this one) during discovery.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import threading
from pathlib import Path
from typing import Any

from fp8_backends.core import settings
from fp8_backends.core.types import Availability, Fp8Dtype

logger = logging.getLogger("fp8_backends")

INSTALL_HINT = "pip install fp8-backends[flashinfer]"
DIST_NAME = "flashinfer-python"

#: default of the GEMM provider's ``autotune`` option when the option is not given
AUTOTUNE_ENV = settings.FLASHINFER_AUTOTUNE_ENV
AUTOTUNE_MODES = settings.FLASHINFER_AUTOTUNE_MODES
CACHE_DIR_ENV = settings.CACHE_DIR_ENV

RUNNERS = ("cublas", "cudnn", "cutlass", "auto")

# flashinfer 0.7.2 gemm_base.py: @supported_compute_capability on the bmm_fp8 requirement checks
_CUBLAS_CUDNN_SMS = frozenset({(8, 9), (9, 0), (10, 0), (10, 3), (10, 7), (11, 0), (12, 0), (12, 1)})
_CUTLASS_SMS = frozenset({(10, 0), (10, 3), (10, 7), (11, 0), (12, 0), (12, 1)})
RUNNER_SMS = {"cublas": _CUBLAS_CUDNN_SMS, "cudnn": _CUBLAS_CUDNN_SMS, "cutlass": _CUTLASS_SMS,
              "auto": _CUBLAS_CUDNN_SMS}


def _find_spec(name: str) -> Any:
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _sm_text(sms: frozenset[tuple[int, int]]) -> str:
    return ", ".join(f"{a}.{b}" for a, b in sorted(sms))


def cuda_present() -> bool:
    """A CUDA device is visible (asked through the driver, torch is not imported), or one is simulated."""
    from fp8_backends.registry.platform import list_platforms

    if settings.simulated_sm():
        return True
    return any(p.is_cuda for p in list_platforms())


def base_availability() -> Availability:
    """torch and flashinfer importable (not imported) and CUDA present; never raises."""
    missing = [m for m in ("torch", "flashinfer") if _find_spec(m) is None]
    if missing:
        return Availability.no(f"missing Python module(s): {', '.join(missing)}", INSTALL_HINT)
    try:
        if not cuda_present():
            return Availability.no("no CUDA device here (flashinfer's kernels need one)")
    except Exception as exc:  # never let a driver query break discovery
        return Availability.no(f"CUDA detection failed: {type(exc).__name__}: {exc}")
    return Availability.yes()


_lock = threading.Lock()
_import_result: tuple[Any, str | None] | None = None
_version_result: tuple[str | None] | None = None
_feature_cache: dict[tuple[str, ...], tuple[str, ...]] = {}


def import_flashinfer() -> tuple[Any, str | None]:
    """``(module, None)`` or ``(None, reason)``. Imports flashinfer once per process (1.3-1.5 s after torch on the H200
    machine, byte-compiled; about 3.5 s without bytecode)."""
    global _import_result
    with _lock:
        if _import_result is None:
            try:
                import flashinfer

                _import_result = (flashinfer, None)
            except Exception as exc:  # ImportError, missing CUDA libraries, JIT setup errors
                _import_result = (None, f"import flashinfer failed: {type(exc).__name__}: {exc}")
                logger.debug("flashinfer import failed: %s", exc)
        return _import_result


def missing_features(names: tuple[str, ...]) -> tuple[str, ...] | str:
    """Which of ``names`` the imported flashinfer lacks (``()`` when it has them all), or the
    import failure's reason as a string. Cached per ``names``."""
    module, reason = import_flashinfer()
    if module is None:
        return reason or "import flashinfer failed"
    with _lock:
        if names not in _feature_cache:
            _feature_cache[names] = tuple(n for n in names if not hasattr(module, n))
        return _feature_cache[names]


def flashinfer_version() -> str | None:
    """The installed flashinfer distribution's version (``None``: not installed), read from its metadata once per
    process: parsing it takes about 1 ms, and resolving a model's layers asks for every block-wise problem."""
    global _version_result
    with _lock:
        if _version_result is None:
            try:
                _version_result = (importlib.metadata.version(DIST_NAME),)
            except importlib.metadata.PackageNotFoundError:
                _version_result = (None,)
        return _version_result[0]


def reset_caches() -> None:
    """For tests: forget the import result, the version and feature probes."""
    global _import_result, _version_result
    with _lock:
        _import_result = None
        _version_result = None
        _feature_cache.clear()


def runner_reasons(
    runner: str,
    sm: tuple[int, int] | None,
    input_dtype: Fp8Dtype | None = None,
    weight_dtype: Fp8Dtype | None = None,
) -> list[str]:
    """Why flashinfer's bmm_fp8 ``runner`` cannot run on SM ``sm`` with these FP8 types.

    ``sm=None`` (CPU, unknown) skips the SM check (the capability record reports it). The tables
    are flashinfer 0.7.2's own: cuBLASLt/cuDNN on SM 8.9-12.1, its CUTLASS runner on SM >= 10.0
    only and e4m3fn only; cuBLASLt/cuDNN have no e5m2 x e5m2 kernel.
    """
    reasons: list[str] = []
    if runner not in RUNNER_SMS:
        return [f"unknown runner {runner!r} (runners: {', '.join(RUNNERS)})"]
    sms = RUNNER_SMS[runner]
    if sm is not None and tuple(sm) not in sms:
        reasons.append(
            f"runner {runner}: flashinfer's bmm_fp8 {runner} runner supports SM {_sm_text(sms)}; "
            f"this GPU is SM {sm[0]}.{sm[1]}"
            + (" (use runner=cublas, cudnn or auto)" if runner == "cutlass" else "")
        )
    e5m2 = [d for d in (input_dtype, weight_dtype) if d is Fp8Dtype.E5M2]
    if runner == "cutlass" and e5m2:
        reasons.append("runner cutlass: flashinfer's CUTLASS bmm_fp8 takes e4m3fn inputs only")
    if len(e5m2) == 2:
        reasons.append("cuBLASLt and cuDNN have no e5m2 x e5m2 FP8 GEMM (flashinfer refuses it)")
    if runner == "cudnn" and _find_spec("cudnn") is None:
        reasons.append("runner cudnn needs the cuDNN frontend (pip install nvidia-cudnn-frontend)")
    return reasons


#: the per-user cache folder of fp8_backends (not created here)
cache_dir = settings.cache_dir


def autotune_cache_path(sm: tuple[int, int] | None) -> Path:
    """flashinfer autotuner cache file for this flashinfer version and SM, e.g.
    ``~/.cache/fp8_backends/flashinfer/autotune-0.7.2.post1-sm90.json``. flashinfer also stamps
    the file with its CUDA/cuBLAS/cuDNN versions and GPU and ignores it when they differ."""
    version = flashinfer_version() or "unknown"
    arch = "unknown" if sm is None else f"{sm[0]}{sm[1]}"
    return cache_dir() / "flashinfer" / f"autotune-{version}-sm{arch}.json"


def autotune_default() -> str:
    """The ``autotune`` mode from :data:`AUTOTUNE_ENV` (``off`` when unset). Raises
    :class:`~fp8_backends.core.errors.ConfigurationError` (a ``ValueError``) for a value that is not a mode."""
    value = os.environ.get(AUTOTUNE_ENV, "").strip().lower()
    if not value:
        return "off"
    if value not in AUTOTUNE_MODES:
        from fp8_backends.core.errors import ConfigurationError

        raise ConfigurationError(AUTOTUNE_ENV, os.environ.get(AUTOTUNE_ENV, ""),
                                 f"{', '.join(AUTOTUNE_MODES)} (unset or empty: off)")
    return value
