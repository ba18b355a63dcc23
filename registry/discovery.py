"""Find providers through stevedore entry points, without ever raising.

Groups: ``fp8_backends.gemm`` and ``fp8_backends.norm_quant``. Each entry point becomes a
:class:`ProviderEntry` whatever happens when it loads: a module that fails to import, raises, points
at the wrong kind of class, or belongs to a distribution that ``FP8_BACKENDS_PLUGINS`` does not allow
is listed with its status and error, never hidden and never fatal.
"""

from __future__ import annotations

import importlib.metadata
import logging
import threading
from dataclasses import dataclass
from typing import Any

from stevedore import ExtensionManager

from fp8_backends.types import Availability

from . import settings

logger = logging.getLogger("fp8_backends")

GROUPS = {"gemm": "fp8_backends.gemm", "norm_quant": "fp8_backends.norm_quant"}
BUILTIN_DIST = "fp8-backends"

LOADED, FAILED, BLOCKED = "loaded", "failed", "blocked"


@dataclass
class ProviderEntry:
    """One registered provider (one entry point of one distribution)."""

    kind: str
    name: str
    target: str
    dist: str | None
    dist_version: str | None
    status: str
    cls: type | None = None
    error: str | None = None

    @property
    def builtin(self) -> bool:
        return self.dist is not None and settings.canonical_dist(self.dist) == BUILTIN_DIST

    @property
    def qualified_name(self) -> str:
        return f"{self.dist or '?'}:{self.name}"

    @property
    def aliases(self) -> tuple[str, ...]:
        return tuple(getattr(self.cls, "aliases", ()) or ()) if self.cls is not None else ()

    @property
    def priority(self) -> int:
        caps = getattr(self.cls, "capabilities", None)
        return int(getattr(caps, "priority", 0)) if caps is not None else 0

    @property
    def disabled(self) -> bool:
        """Named in ``FP8_BACKENDS_DISABLED`` by name, alias or ``DIST:NAME`` (distribution names compared
        after PEP 503 normalisation: ``fp8_backends:triton`` and ``fp8-backends:triton`` are the same)."""
        off = settings.disabled_names()
        if not off:
            return False
        names = {self.name, *self.aliases}
        mine = settings.canonical_dist(self.dist) if self.dist else None
        for item in off:
            dist, sep, name = item.rpartition(":")
            if name in names and (not sep or settings.canonical_dist(dist) == mine):
                return True
        return False

    def matches(self, name: str, dist: str | None = None) -> bool:
        if dist is not None:
            mine = settings.canonical_dist(self.dist) if self.dist else None
            if mine != settings.canonical_dist(dist):
                return False
        return name == self.name or name in self.aliases

    def availability(self) -> Availability:
        """Whether the provider can run in this process. Cached; never raises."""
        if self.status == BLOCKED:
            return Availability.no(self.error or "blocked")
        if self.status != LOADED or self.cls is None:
            return Availability.no(f"failed to load: {self.error}")
        return self.cls.cached_availability()  # per class, per process (a failed preload updates it)

    def unusable_reason(self) -> str | None:
        """Why this entry can never be chosen here (blocked, failed, disabled, unavailable), or None."""
        if self.disabled:
            return f"disabled by {settings.DISABLED_ENV}"
        avail = self.availability()
        if not avail.ok:
            return avail.reason + (f" (install: {avail.install_hint})" if avail.install_hint else "")
        return None


class _Blocked(Exception):
    pass


class _LoadFailed(Exception):
    def __init__(self, original: BaseException) -> None:
        self.original = original
        super().__init__(f"{type(original).__name__}: {original}")


class _ProviderManager(ExtensionManager):
    """stevedore's manager with a gate before each import and every failure captured."""

    def __init__(self, namespace: str, dist_of: dict[tuple[str, str], list[Any]], allowed: set[str] | None):
        self._dist_of = dist_of
        self._allowed = allowed
        self.failures: dict[tuple[str, str], BaseException] = {}
        super().__init__(namespace, invoke_on_load=False, on_load_failure_callback=self._on_failure)

    def _load_one_plugin(self, ep, invoke_on_load, invoke_args, invoke_kwds):
        if self._allowed is not None:
            dists = self._dist_of.get((ep.name, ep.value), [])
            names = {settings.canonical_dist(d.metadata["Name"]) for d in dists if d is not None}
            if not names & ({BUILTIN_DIST} | self._allowed):
                raise _Blocked(
                    f"distribution {', '.join(sorted(names)) or '?'} not in {settings.PLUGINS_ENV}"
                )
        try:
            return super()._load_one_plugin(ep, invoke_on_load, invoke_args, invoke_kwds)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit/AssertionError from a plugin too
            raise _LoadFailed(exc) from exc

    @staticmethod
    def _on_failure(manager: _ProviderManager, ep, err: BaseException) -> None:
        manager.failures[(ep.name, ep.value)] = err


def _distributions_by_entry_point(group: str) -> dict[tuple[str, str], list[Any]]:
    out: dict[tuple[str, str], list[Any]] = {}
    for ep in importlib.metadata.entry_points(group=group):
        out.setdefault((ep.name, ep.value), []).append(ep.dist)
    return out


_lock = threading.Lock()
_cache: dict[tuple[str, frozenset[str] | None], list[ProviderEntry]] = {}


def discover(kind: str) -> list[ProviderEntry]:
    """Every provider registered for ``kind`` (``"gemm"`` or ``"norm_quant"``), in entry-point order.

    Cached per process (and per ``FP8_BACKENDS_PLUGINS`` value); :func:`refresh` forgets it.
    """
    if kind not in GROUPS:
        raise ValueError(f"unknown provider kind {kind!r} (expected one of {', '.join(GROUPS)})")
    allowed = settings.allowed_plugin_dists()
    key = (kind, None if allowed is None else frozenset(allowed))
    with _lock:
        if key not in _cache:
            _cache[key] = _scan(kind, allowed)
        return _cache[key]


def _scan(kind: str, allowed: set[str] | None) -> list[ProviderEntry]:
    group = GROUPS[kind]
    dist_of = _distributions_by_entry_point(group)
    manager = _ProviderManager(group, dist_of, allowed)
    loaded = {(ext.entry_point.name, ext.entry_point.value): ext.plugin for ext in manager.extensions}
    entries: list[ProviderEntry] = []
    for ep in manager.list_entry_points():
        dists = [d for d in dist_of.get((ep.name, ep.value), []) if d is not None] or [None]
        for dist in dists:
            dist_name = dist.metadata["Name"] if dist is not None else None
            dist_version = dist.version if dist is not None else None
            key = (ep.name, ep.value)
            entry = ProviderEntry(kind=kind, name=ep.name, target=ep.value, dist=dist_name,
                                  dist_version=dist_version, status=LOADED)
            if key in manager.failures:
                err = manager.failures[key]
                if isinstance(err, _Blocked):
                    entry.status, entry.error = BLOCKED, f"blocked: {err}"
                else:
                    entry.status, entry.error = FAILED, str(err)
                    logger.debug("provider %s (%s) failed to load: %s", ep.name, ep.value, err)
            else:
                entry.cls = loaded.get(key)
                problem = _check_class(kind, ep.name, entry.cls)
                if problem:
                    entry.status, entry.error, entry.cls = FAILED, problem, None
            entries.append(entry)
    return entries


def _check_class(kind: str, ep_name: str, cls: Any) -> str | None:
    from fp8_backends.backend import Fp8GemmBackend, NormQuantBackend

    base = Fp8GemmBackend if kind == "gemm" else NormQuantBackend
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return f"entry point does not name a {base.__name__} subclass (got {cls!r})"
    if getattr(cls, "name", None) != ep_name:
        return f"entry point name {ep_name!r} differs from the provider's name {getattr(cls, 'name', None)!r}"
    return None


def refresh() -> None:
    """Forget discovered providers (and stevedore's in-process entry-point cache): the next call
    rescans, e.g. after installing a plugin into the running interpreter."""
    from fp8_backends.backend import clear_availability_cache

    clear_availability_cache()
    with _lock:
        _cache.clear()
        for group in GROUPS.values():
            ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    try:
        from stevedore import _cache as stevedore_cache

        stevedore_cache._c._internal.clear()
    except Exception:  # private API: best effort
        pass
