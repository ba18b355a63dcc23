"""A provider considered for a problem: the verdict record (:class:`Candidate`), the shared provider instance per
options (:func:`provider_instance`) and ``auto``'s order of providers (:func:`rank_key`).

What resolution (:mod:`.resolution`), the selection policies (:mod:`.policy` and the built-ins) and the tuner share
about candidates, below all of them: the policies answer from the candidates resolution hands them, and resolution
loads the built-in policies, so neither may import the other for these.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .discovery import ProviderEntry

logger = logging.getLogger("fp8_backends")


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


def pending_build(cand: Candidate, problem: Any, platform: Any) -> str | None:
    """What the candidate's first call would build for minutes (its provider's
    :meth:`~fp8_backends.core.backend.ProviderBase.first_use_build`, default options), or None: ready. A probe that
    raises counts as ready (the call itself then says what is wrong)."""
    try:
        backend = provider_instance(cand.entry)
        check = getattr(backend, "first_use_build", None)
        return check(problem, platform) if check is not None else None
    except Exception as exc:  # noqa: BLE001 - a provider's probe must not break auto
        logger.debug("first-use build check of %s failed: %s: %s", cand.entry.name, type(exc).__name__, exc)
        return None


__all__ = ["Candidate", "forget_instances", "pending_build", "provider_instance", "rank_key"]
