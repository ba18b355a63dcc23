"""What the flashinfer providers' torch ops share: the lock, graph-capture guards, the checked import of
flashinfer, per-device state built once, the pointer-alignment check. Imports torch (the op modules import it
lazily).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from fp8_backends.core.errors import BackendUnavailableError, UnsupportedProblemError

from . import common

lock = threading.RLock()


def capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def refuse_in_capture(what: str) -> None:
    if capturing():
        raise UnsupportedProblemError(
            f"{what} must happen outside CUDA graph capture; call the op once eagerly with this shape "
            "(and runner) before capturing",
            reasons=[f"{what} during CUDA graph capture"],
        )


def require_flashinfer(features: tuple[str, ...]) -> Any:
    missing = common.missing_features(features)
    if isinstance(missing, str):
        raise BackendUnavailableError(f"flashinfer is not usable: {missing}")
    if missing:
        raise BackendUnavailableError(
            f"this flashinfer ({common.flashinfer_version()}) lacks {', '.join(missing)}"
        )
    module, _ = common.import_flashinfer()
    return module


def per_device(cache: dict[int, Any], factory: Callable[[torch.device], Any], device: torch.device, what: str) -> Any:
    """The state ``factory`` builds for ``device``, built once per device (never during graph capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    state = cache.get(index)
    if state is None:
        with lock:
            state = cache.get(index)
            if state is None:
                refuse_in_capture(what)
                state = cache[index] = factory(torch.device("cuda", index))
    return state


def misaligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes != 0
