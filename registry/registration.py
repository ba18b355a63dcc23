"""Registering providers in-process, beside entry points: for engines that embed a kernel and for tests.

:func:`register_provider` lists a provider class as if a distribution had registered it under an entry point (like
fsspec's ``register_implementation`` and vLLM's attention ``register_backend``)::

    from fp8_backends import register_provider

    register_provider(MyGemmBackend, dist="my-engine")          # the engine's own kernel, no package metadata needed

    with register_provider(FakeGemm, dist="fake-plugin"):       # a test: unregistered when the block ends
        ...

From then on it appears in :func:`~fp8_backends.registry.discovery.discover`, the listing, the flags' choices,
``auto`` and explicit requests exactly like an entry-point provider: by name, alias or ``DIST:NAME``, ranked by its
priority (built-ins first on a tie), excluded by ``FP8_BACKENDS_DISABLED``, listed as blocked (and never used)
when ``FP8_BACKENDS_PLUGINS`` does not name its distribution. The provider kind comes from the class (an
:class:`~fp8_backends.core.backend.Fp8GemmBackend` or :class:`~fp8_backends.core.backend.NormQuantBackend` subclass).

A registration lives as long as the process (or until :func:`unregister_provider` / the handle's
:meth:`Registration.unregister`); :func:`~fp8_backends.registry.discovery.refresh` keeps it. Registering or
unregistering forgets the resolved provider instances and the quantization defaults decided so far, so the next
resolution sees the change.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from types import TracebackType
from typing import Any

from fp8_backends.core import settings
from fp8_backends.core.errors import InvalidInputError, InvalidTypeError, UnknownBackendError

from . import discovery
from .discovery import BUILTIN_DIST, LOADED, ProviderEntry

logger = logging.getLogger("fp8_backends")

#: what a distribution name may not contain (it is parsed out of ``[KIND:][DIST:]NAME[@opts]`` requests and lists)
_BAD_NAME = discovery.BAD_NAME_CHARS
_lock = threading.Lock()


class Registration:
    """The handle :func:`register_provider` returns: :attr:`entry` is the listed record; :meth:`unregister` (or
    leaving a ``with`` block) removes it."""

    def __init__(self, entry: ProviderEntry) -> None:
        self.entry = entry

    @property
    def active(self) -> bool:
        """Whether this registration is still listed."""
        return discovery.in_process.get(_key_of(self.entry)) is self.entry

    def unregister(self) -> None:
        """Remove this registration (nothing happens if it was removed already or replaced by a newer one)."""
        with _lock:
            if not self.active:
                return
            _store({k: e for k, e in discovery.in_process.items() if e is not self.entry})
        _changed()

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.unregister()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<Registration {self.entry.kind} {self.entry.qualified_name} ({state})>"


def register_provider(cls: type, *, dist: str | None = None, version: str | None = None,
                      replace: bool = False) -> Registration:
    """List provider class ``cls`` as distribution ``dist``'s (default: the installed distribution that holds the
    class's top-level package, else that package's name) at ``version`` (default: that distribution's installed
    version, if any). Returns a :class:`Registration` (also a context manager that unregisters at exit).

    Raises :class:`~fp8_backends.core.errors.InvalidTypeError` when ``cls`` is not a provider class or its capability
    record is not one (of its kind, with an int priority) or its ``options`` are not a mapping of option name to a
    tuple of string values, and :class:`~fp8_backends.core.errors.InvalidInputError` for a malformed name, alias
    (``aliases`` must be a tuple of names, each under the rule a name follows) or distribution, for this package's own
    distribution (its providers register through its entry points), and when ``dist`` already registers this
    kind and name (through an entry point, or in-process unless ``replace=True``: ``DIST:NAME`` must name one
    provider)."""
    kind = _kind_of(cls)
    name = getattr(cls, "name", None)
    if discovery.name_problem(name) is not None:
        raise InvalidInputError(f"{cls.__qualname__}.name must be {discovery.NAME_RULE} (it is what requests name); "
                                f"got {name!r}")
    problem = discovery.aliases_problem(getattr(cls, "aliases", ()))
    if problem is not None:
        raise InvalidInputError(f"{cls.__qualname__}: {problem}")
    if dist is None:
        dist = _distribution_of_module(cls.__module__)
    if not isinstance(dist, str) or not dist.strip() or _BAD_NAME.search(dist):
        raise InvalidInputError(f"dist must be a distribution name (no ':', '@', ',', '=' or spaces), got {dist!r}")
    canonical = settings.canonical_dist(dist)
    if canonical == BUILTIN_DIST:
        raise InvalidInputError(f"{BUILTIN_DIST}'s own providers register through its entry points; register "
                                f"{cls.__qualname__} under your own distribution name")
    if version is None:
        version = _installed_version(dist)
    problem = discovery._check_class(kind, name, cls)  # the capability record, as discovery checks an entry point's
    if problem is not None:
        raise InvalidTypeError(f"{cls.__qualname__}: {problem}")
    entry = ProviderEntry(kind=kind, name=name, target=f"{cls.__module__}:{cls.__qualname__}", dist=dist,
                          dist_version=version, status=LOADED, cls=cls, origin="in_process")
    key = _key_of(entry)
    if any(settings.canonical_dist(ep_dist) == canonical for ep_dist in _entry_point_dists(kind, name)):
        raise InvalidInputError(f"distribution {dist} already registers {kind} provider {name!r} through an entry "
                                "point; register this class under another name or distribution")
    with _lock:
        held = discovery.in_process.get(key)
        if held is not None and not replace:
            raise InvalidInputError(f"{kind} provider {dist}:{name} is registered already ({held.target}); "
                                    "unregister it first or pass replace=True")
        _store({**{k: e for k, e in discovery.in_process.items() if k != key}, key: entry})
    _changed()
    logger.debug("registered %s provider %s (%s) in-process", kind, entry.qualified_name, entry.target)
    return Registration(entry)


def unregister_provider(
    provider: type | str, *, dist: str | None = None, kind: str | None = None
) -> list[ProviderEntry]:
    """Remove the in-process registrations of ``provider`` (a class, or a name or alias), narrowed to distribution
    ``dist`` and ``kind`` when given; returns the entries removed. Raises
    :class:`~fp8_backends.core.errors.UnknownBackendError` when none matches (entry points cannot be unregistered:
    uninstall the distribution, or disable the provider with ``FP8_BACKENDS_DISABLED``)."""
    if kind is not None and kind not in discovery.GROUPS:
        raise InvalidInputError(f"unknown provider kind {kind!r} (expected one of {', '.join(discovery.GROUPS)})")

    def matches(entry: ProviderEntry) -> bool:
        if kind is not None and entry.kind != kind:
            return False
        if dist is not None and settings.canonical_dist(entry.dist or "") != settings.canonical_dist(dist):
            return False
        return entry.cls is provider if isinstance(provider, type) else entry.matches(str(provider))

    with _lock:
        removed = [e for e in discovery.in_process.values() if matches(e)]
        if removed:
            _store({k: e for k, e in discovery.in_process.items() if e not in removed})
    if not removed:
        what = provider.__qualname__ if isinstance(provider, type) else str(provider)
        held = sorted(e.qualified_name for e in discovery.in_process.values())
        error = UnknownBackendError(what if dist is None else f"{dist}:{what}", kind or "provider", held)
        error.args = (f"no in-process registration matches {error.name!r} (registered: {', '.join(held) or 'none'})",)
        raise error
    _changed()
    return removed


def registered_providers(kind: str | None = None) -> list[ProviderEntry]:
    """The in-process registrations (of ``kind``, or both kinds), in registration order."""
    return [e for e in discovery.in_process.values() if kind is None or e.kind == kind]


# ------------------------------------------------------------------------------------------------- helpers
def _kind_of(cls: Any) -> str:
    from fp8_backends.core.backend import Fp8GemmBackend, NormQuantBackend

    if isinstance(cls, type) and issubclass(cls, Fp8GemmBackend):
        return "gemm"
    if isinstance(cls, type) and issubclass(cls, NormQuantBackend):
        return "norm_quant"
    raise InvalidTypeError(f"register_provider needs an Fp8GemmBackend or NormQuantBackend subclass, got {cls!r}")


def _key_of(entry: ProviderEntry) -> tuple[str, str, str]:
    return entry.kind, settings.canonical_dist(entry.dist or ""), entry.name


def _store(entries: dict[tuple[str, str, str], ProviderEntry]) -> None:
    """Replace the registry's in-process table (a new dict each time: :func:`discover` reads it without a lock)."""
    discovery.in_process = entries


def _changed() -> None:
    """Forget what was decided from the old provider set, in the modules that are loaded (importing none): the
    resolved instances and log-once memory, the quantization defaults, the output contract's distribution names."""
    for module, reset in (("fp8_backends.registry.resolution", "reset_caches"),
                          ("fp8_backends.quant", "reset_default_impls")):
        loaded = sys.modules.get(module)
        if loaded is not None:
            getattr(loaded, reset)()
    contract = sys.modules.get("fp8_backends.core.output_contract")
    if contract is not None:
        contract.distribution_of.cache_clear()


def _entry_point_dists(kind: str, name: str) -> list[str]:
    """The distributions that register ``name`` for ``kind`` through an entry point (read, not loaded)."""
    import importlib.metadata

    return [ep.dist.metadata["Name"] for ep in importlib.metadata.entry_points(group=discovery.GROUPS[kind])
            if ep.name == name and ep.dist is not None]


@functools.lru_cache(maxsize=64)
def _distribution_of_module(module: str) -> str:
    import importlib.metadata

    top = module.split(".")[0]
    dists = importlib.metadata.packages_distributions().get(top) or []
    return dists[0] if dists else top


def _installed_version(dist: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


__all__ = ["Registration", "register_provider", "registered_providers", "unregister_provider"]
