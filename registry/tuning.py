"""Deprecated: split into :mod:`.lockfile` (the file: format, keys, locking, writing, reading) and
:mod:`.lockfile_policy` (the ``auto`` policy); tuning at first use is :mod:`fp8_backends.tuning.first_use`. Every
name of those two modules is still importable here."""

from __future__ import annotations

import warnings
from typing import Any

from . import lockfile as _lockfile
from . import lockfile_policy as _policy
from .lockfile import *  # noqa: F403
from .lockfile_policy import *  # noqa: F403

warnings.warn("fp8_backends.registry.tuning was split into fp8_backends.registry.lockfile and "
              "fp8_backends.registry.lockfile_policy", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    for module in (_policy, _lockfile):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
