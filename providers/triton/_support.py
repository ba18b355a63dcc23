"""What every Triton module of this package shares.

- :func:`interpreting`: Triton runs kernels on the CPU (``TRITON_INTERPRET=1``, read once when the
  kernels are defined). The providers then also accept CPU tensors: that is how CPU-only CI tests them.
- :func:`pdl_enabled`: launch with programmatic dependent launch (PDL) on this device? Yes on
  SM >= 9.0 unless ``FP8_BACKENDS_PDL=0`` or the interpreter runs (it cannot execute ``griddepcontrol``).
  Kernels take a ``USE_PDL: tl.constexpr`` and call ``gdc_wait()`` / ``gdc_launch_dependents()`` only
  when it is set; the launch passes ``launch_pdl=USE_PDL``.
- :data:`DEVICES`: the device kinds the providers declare (CUDA; plus CPU under the interpreter).
- :data:`GRID_Y_MAX`: the most programs along a launch grid's second (and third) axis.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

from fp8_backends.core import settings
from fp8_backends.core.types import DeviceKind

T = TypeVar("T")

REQUIRES: tuple[str, ...] = ("torch", "triton")
INSTALL_HINT = "pip install 'fp8-backends[triton]'"
MIN_SM: tuple[int, int] = (8, 9)  # FP8 tensor-core MMA (Ada and newer)
#: CUDA's limit on a grid's second and third axes (programs)
GRID_Y_MAX = 65535


def interpreting() -> bool:
    """True when Triton runs kernels with its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "yes", "on"}


DEVICES: frozenset[DeviceKind] = (
    frozenset({DeviceKind.CUDA, DeviceKind.CPU}) if interpreting() else frozenset({DeviceKind.CUDA})
)


@functools.lru_cache(maxsize=64)
def _device_sm(index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def pdl_enabled(device: object) -> bool:
    """Whether kernels on ``device`` (a torch.device) launch with PDL: SM >= 9.0, not interpreting,
    and not switched off with ``FP8_BACKENDS_PDL=0`` (:func:`pdl_on` for a device index). No host-device sync."""
    if getattr(device, "type", None) != "cuda":
        return False
    index = device.index
    return pdl_on(current_device() if index is None else index)


_pdl_memo: dict[tuple[object, int], bool] = {}


def pdl_on(index: int) -> bool:
    """:func:`pdl_enabled` for a device index (``x.get_device()``: -1 for CPU tensors), for the hot path:
    memoized per value of ``FP8_BACKENDS_PDL`` and device, so a call costs one environment lookup."""
    if index < 0:
        return False
    key = (settings.env_token(settings.PDL_ENV), index)
    on = _pdl_memo.get(key)
    if on is None:
        on = _pdl_memo[key] = not interpreting() and settings.pdl_allowed() and _device_sm(index) >= (9, 0)
    return on


@functools.lru_cache(maxsize=64)
def _sm_count_of(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return 4  # the interpreter: a few programs exercise the split-K and persistent loops
    import torch

    return torch.cuda.get_device_properties(index if index is not None else current_device()).multi_processor_count


def sm_count(device: Any) -> int:
    """The streaming multiprocessors of ``device`` (a torch.device; 4 for the interpreter's CPU tensors, so that a
    few programs exercise the persistent and split-K loops); memoized."""
    return _sm_count_of(device.type, device.index)


def current_device() -> int:
    """torch's current CUDA device index (what Triton launches on), without ``torch.cuda``'s Python layer."""
    import torch

    return torch._C._cuda_getDevice()


def on_device(index: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` with CUDA device ``index`` current (Triton launches on the current device); no switch when
    it already is current or ``index < 0`` (a CPU tensor's ``get_device()``, under the interpreter)."""
    if index >= 0 and index != current_device():
        import torch

        with torch.cuda.device(index):
            return fn(*args)
    return fn(*args)


INTERPRETER_ONLY = (
    "runs on the CPU only through Triton's interpreter (TRITON_INTERPRET=1), which is for testing: "
    "auto does not pick it; name the provider to use it"
)


def explicit_only_on_cpu(problem: object, platform: object) -> str | None:
    """The providers' :meth:`explicit_only_reason`: CPU problems (the interpreter) are served only when named."""
    device = getattr(problem, "device", None)
    on_cpu = getattr(device, "value", device) == "cpu" if problem is not None else not getattr(platform, "is_cuda", 1)
    return INTERPRETER_ONLY if on_cpu else None


def reset_caches() -> None:
    _device_sm.cache_clear()
    _sm_count_of.cache_clear()
    _pdl_memo.clear()


__all__ = [
    "DEVICES",
    "INSTALL_HINT",
    "INTERPRETER_ONLY",
    "MIN_SM",
    "REQUIRES",
    "current_device",
    "explicit_only_on_cpu",
    "interpreting",
    "on_device",
    "pdl_enabled",
    "pdl_on",
    "reset_caches",
    "sm_count",
]
