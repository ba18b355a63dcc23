"""A provider considered for a problem: the verdict record (:class:`Candidate`), the shared provider instance per
options (:func:`provider_instance`) and ``auto``'s order of providers (:func:`rank_key`).

What resolution (:mod:`.resolution`), the selection policies (:mod:`.policy` and the built-ins) and the tuner share
about candidates, below all of them: the policies answer from the candidates resolution hands them, and resolution
loads the built-in policies, so neither may import the other for these.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .discovery import ProviderEntry


@dataclass
class Candidate:
    """One provider considered during resolution and why it can or cannot serve."""

    entry: ProviderEntry
    reasons: list[str] = field(default_factory=list)
    #: why ``auto`` passes over a provider that could serve (it serves only when named), or None
    explicit_only: str | None = None
    #: the exception the provider's construction or support check raised (a fault, not a reason), or None
    fault: BaseException | None = None

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def auto_ok(self) -> bool:
        return not self.reasons and self.explicit_only is None


_instances: dict[tuple[str, str, tuple[tuple[str, str], ...]], Any] = {}
_lock = threading.Lock()


def provider_instance(entry: ProviderEntry, options: Sequence[tuple[str, str]] = ()) -> Any:
    """The provider instance of ``entry`` with ``options`` (``(key, value)`` pairs), made once per process and
    reused (resolution, the policies and the tuner share it). Bad options raise
    :class:`~fp8_backends.core.errors.InvalidInputError`; whatever else the provider's constructor raises propagates."""
    key = (entry.kind, entry.qualified_name, tuple(sorted(options)))
    with _lock:
        if key not in _instances:
            _instances[key] = entry.cls(**dict(options))  # bad options raise InvalidInputError
        return _instances[key]


def forget_instances() -> None:
    """Forget every provider instance (:func:`.resolution.reset_caches`)."""
    with _lock:
        _instances.clear()


def rank_key(entry: ProviderEntry) -> tuple:
    """``auto``'s order of providers of one kind: higher priority first, built-ins before plugins on a tie, then
    name and distribution."""
    return (-entry.priority, not entry.builtin, entry.name, entry.dist or "")


__all__ = ["Candidate", "forget_instances", "provider_instance", "rank_key"]
