"""Find providers through stevedore entry points, without ever raising, and list them with those registered in
this process.

Groups: ``fp8_backends.gemm`` and ``fp8_backends.norm_quant``. Each entry point becomes a
:class:`ProviderEntry` whatever happens when it loads: a module that fails to import, raises, points
at the wrong kind of class, or belongs to a distribution that ``FP8_BACKENDS_PLUGINS`` does not allow
is listed with its status and error, never hidden and never fatal. Providers registered in-process
(:func:`fp8_backends.registry.registration.register_provider`) follow the entry points in :func:`discover`'s
list, under the same rules (a distribution ``FP8_BACKENDS_PLUGINS`` does not allow is listed as blocked).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from stevedore import ExtensionManager

from fp8_backends.core import output_contract, settings
from fp8_backends.core.types import Availability

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
    #: ``"entry_point"``, or ``"in_process"`` for a provider registered with ``register_provider``
    origin: str = "entry_point"

    @property
    def builtin(self) -> bool:
        return self.dist is not None and _canonical(self.dist) == BUILTIN_DIST

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
        """Named in ``FP8_BACKENDS_DISABLED`` as ``[KIND:][DIST:]NAME`` by name or alias (distribution names
        compared after PEP 503 normalisation: ``fp8_backends:triton`` and ``fp8-backends:triton`` are the same;
        ``gemm:torch`` disables the GEMM provider only, plain ``torch`` every provider answering to it)."""
        items = settings.disabled_items()
        if not items:
            return False
        names = {self.name, *self.aliases}
        return any(item.applies_to(self.kind, self.dist, names) for item in items)

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
        from fp8_backends.core.backend import checked_availability

        try:  # per class, per process (a failed preload updates it)
            return checked_availability(self.cls.cached_availability())
        except Exception as exc:  # noqa: BLE001 - a class that overrides the cache must not break the registry
            return Availability.no(f"cached_availability() raised {type(exc).__name__}: {exc}")

    def unusable_reason(self) -> str | None:
        """Why this entry can never be chosen here (blocked, failed, disabled, unavailable), or None."""
        if self.disabled:
            return f"disabled by {settings.DISABLED_ENV}"
        avail = self.availability()
        if not avail.ok:
            return avail.reason + (f" (install: {avail.install_hint})" if avail.install_hint else "")
        return None


@functools.lru_cache(maxsize=256)
def _canonical(dist: str) -> str:
    return settings.canonical_dist(dist)


class _Blocked(Exception):
    pass


class _LoadFailed(Exception):
    def __init__(self, original: BaseException) -> None:
        self.original = original
        super().__init__(f"{type(original).__name__}: {original}")


class _ProviderManager(ExtensionManager):
    """stevedore's manager over a given list of entry points, with a gate before each import and every
    failure captured. The list comes from :mod:`importlib.metadata` at each scan: stevedore's own entry-point
    caches (in-process, and on disk under ``$XDG_CACHE_HOME/python-entrypoints``, keyed on file times rounded
    to float32, which hides a reinstall for minutes) are never consulted."""

    def __init__(self, namespace: str, entry_points: list[Any], dist_of: dict[tuple[str, str], list[Any]],
                 allowed: set[str] | None):
        self._entry_points = entry_points
        self._dist_of = dist_of
        self._allowed = allowed
        self.failures: dict[tuple[str, str], BaseException] = {}
        super().__init__(namespace, invoke_on_load=False, on_load_failure_callback=self._on_failure)

    def list_entry_points(self) -> list[Any]:
        return self._entry_points

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


def _read_entry_points(group: str) -> tuple[list[Any], dict[tuple[str, str], list[Any]]]:
    """What :mod:`importlib.metadata` reports for ``group`` now: the distinct ``(name, value)`` entry points
    in the order found, and the distributions that register each (one distribution once, even when it is
    reachable through two ``sys.path`` entries)."""
    unique: list[Any] = []
    dist_of: dict[tuple[str, str], list[Any]] = {}
    seen: set[tuple[str, str, str | None]] = set()
    for ep in importlib.metadata.entry_points(group=group):
        key = (ep.name, ep.value)
        if key not in dist_of:
            unique.append(ep)
            dist_of[key] = []
        dist = ep.dist
        dist_name = settings.canonical_dist(dist.metadata["Name"]) if dist is not None else None
        if (*key, dist_name) not in seen:
            seen.add((*key, dist_name))
            dist_of[key].append(dist)
    return unique, dist_of


#: a file or folder name that makes a ``sys.path`` folder hold distributions (and so entry points)
_METADATA_SUFFIXES = (".dist-info", ".egg-info", ".egg-link", ".pth")


def _holds_metadata(folder: str) -> bool:
    """Whether ``folder`` holds installed-distribution metadata (``*.dist-info``, ``*.egg-info``, ``.pth`` files):
    where an install, uninstall or reinstall shows up. A missing or unreadable folder holds none."""
    try:
        with os.scandir(folder or os.curdir) as it:
            return any(e.name.endswith(_METADATA_SUFFIXES) for e in it)
    except OSError:
        return False


class PathWatch:
    """What the entry points depend on, checked at every :func:`discover` for a few ``stat`` calls (about 1 µs each):
    the ``sys.path`` list, and the modification time and inode of each folder on it that holds distribution metadata
    (an install, uninstall or editable reinstall there changes the folder's time). A folder on ``sys.path`` without
    metadata (the working directory, a script's folder) is watched too, but a change of its time rescans only once
    metadata appears in it: a log file, a cache or a plugin writing there never costs a rescan (nor forgets what the
    last scan found)."""

    def __init__(self) -> None:
        self.path: tuple[str, ...] = ()
        self.stats: dict[str, tuple[int, int]] = {}
        self.metadata: dict[str, bool] = {}

    def record(self) -> None:
        """Take the current state (at a scan)."""
        self.path = tuple(sys.path)
        self.stats = {entry: _stat(entry) for entry in self.path}
        self.metadata = {entry: _holds_metadata(entry) for entry in self.path}

    def changed(self) -> bool:
        """Whether an install, uninstall or a ``sys.path`` edit may have changed the entry points since
        :meth:`record`. A folder without metadata whose time moved is re-read once (``scandir``) and, still without
        metadata, recorded with its new time."""
        if tuple(sys.path) != self.path:
            return True
        for entry in self.path:
            now = _stat(entry)
            if now == self.stats.get(entry):
                continue
            if self.metadata.get(entry) or _holds_metadata(entry):
                return True
            self.stats[entry] = now
        return False


def _stat(entry: str) -> tuple[int, int]:
    try:
        st = os.stat(entry or os.curdir)
    except OSError:
        return (-1, -1)
    return (st.st_mtime_ns, st.st_ino)


#: reentrant, so that a plugin calling :func:`discover` while a scan imports it fails with a reason instead of
#: waiting forever on the lock its own thread holds
_lock = threading.RLock()
#: per thread: how many scans are importing plugins now (a :func:`discover` inside one is refused)
_scanning = threading.local()
_cache: dict[tuple[str, frozenset[str] | None], list[ProviderEntry]] = {}
_watches: dict[tuple[str, frozenset[str] | None], PathWatch] = {}


def discover(kind: str) -> list[ProviderEntry]:
    """Every provider registered for ``kind`` (``"gemm"`` or ``"norm_quant"``): the entry points in entry-point
    order, then the providers registered in-process (:mod:`.registration`) in registration order.

    The entry points are read from :mod:`importlib.metadata` (never from stevedore's disk cache), so a new
    process always sees what is installed. Within a process the result is cached per value of
    ``FP8_BACKENDS_PLUGINS`` and rescanned when :class:`PathWatch` sees a change (an install, uninstall or
    editable reinstall into a ``sys.path`` folder, a ``sys.path`` edit; not a file written into the working
    directory); :func:`refresh` forces a rescan (e.g. after editing an installed ``entry_points.txt`` in place, which
    no folder time records). A rescan keeps the entries of unchanged entry points (the same objects, with what was
    recorded about them: a provider found unusable stays so).
    """
    if kind not in GROUPS:
        raise ValueError(f"unknown provider kind {kind!r} (expected one of {', '.join(GROUPS)})")
    allowed = settings.allowed_plugin_dists()
    key = (kind, None if allowed is None else frozenset(allowed))
    with _lock:
        _refuse_reentrant_scan(kind)
        watch = _watches.get(key)
        if key not in _cache or watch is None or watch.changed():
            if watch is None:
                watch = _watches[key] = PathWatch()
            else:  # something was installed or removed since the last scan: probe availability again
                importlib.invalidate_caches()
                from fp8_backends.core.backend import clear_availability_cache

                clear_availability_cache(faults=False)
            watch.record()
            _cache[key] = _keep_known(_cache.get(key, []), _guarded_scan(kind, allowed))
        found = _cache[key]
        registered = in_process  # replaced, never mutated, by .registration: one read is a consistent view
        if not registered:
            return found
        extra = [_gated(entry, allowed) for entry in registered.values() if entry.kind == kind]
        return [*found, *extra] if extra else found


def _refuse_reentrant_scan(kind: str) -> None:
    """Raise :class:`~fp8_backends.core.errors.BackendUnavailableError` when this thread is importing plugins for a
    scan: a plugin that discovers or resolves providers while its module is imported would otherwise read a half-built
    registry (or, without the reentrant lock, wait forever). Raised inside that plugin's import, it makes the plugin
    fail to load with this reason; the scan goes on with the others."""
    if getattr(_scanning, "depth", 0):
        from fp8_backends.core.errors import BackendUnavailableError

        raise BackendUnavailableError(
            f"{kind} provider discovery was called while providers are being imported: a plugin must not discover "
            "or resolve providers (discover(), resolve_*_backend()) when its module is imported; do it on first use"
        )


def _guarded_scan(kind: str, allowed: set[str] | None) -> list[ProviderEntry]:
    """:func:`_scan`, with this thread marked as importing plugins (:func:`_refuse_reentrant_scan`)."""
    _scanning.depth = getattr(_scanning, "depth", 0) + 1
    try:
        return _scan(kind, allowed)
    finally:
        _scanning.depth -= 1


#: providers registered in this process, by ``(kind, canonical distribution, name)`` in registration order; written
#: only by :mod:`.registration` (which checks each class), read by :func:`discover`
in_process: dict[tuple[str, str, str], ProviderEntry] = {}
_blocked_views: dict[tuple[int, frozenset[str]], tuple[ProviderEntry, ProviderEntry]] = {}


def _gated(entry: ProviderEntry, allowed: set[str] | None) -> ProviderEntry:
    """``entry`` itself, or, when ``FP8_BACKENDS_PLUGINS`` does not allow its distribution, its blocked view (the
    class withheld, as a blocked entry point's is never imported): one object per entry and allowlist, so that
    callers comparing entries by identity across :func:`discover` calls (the listing) see the same one."""
    if allowed is None or _canonical(entry.dist or "") in allowed:
        return entry
    key = (id(entry), frozenset(allowed))
    held = _blocked_views.get(key)
    if held is None or held[0] is not entry:
        view = dataclasses.replace(entry, status=BLOCKED, cls=None,
                                   error=f"blocked: distribution {entry.dist} not in {settings.PLUGINS_ENV}")
        held = _blocked_views[key] = (entry, view)
    return held[1]


def _keep_known(old: list[ProviderEntry], new: list[ProviderEntry]) -> list[ProviderEntry]:
    """``new`` with each entry that equals one of ``old`` (same kind, name, target, distribution and version,
    status, class) replaced by that old object: a rescan keeps what the process recorded about unchanged providers
    (identity, availability found at run time) and renews only what an install changed."""
    if not old:
        return new
    known = {_identity(e): e for e in old}
    return [known.get(_identity(e), e) for e in new]


def _identity(entry: ProviderEntry) -> tuple:
    return (entry.kind, entry.name, entry.target, entry.dist, entry.dist_version, entry.status, entry.error,
            entry.cls)


def _scan(kind: str, allowed: set[str] | None) -> list[ProviderEntry]:
    group = GROUPS[kind]
    unique, dist_of = _read_entry_points(group)
    manager = _ProviderManager(group, unique, dist_of, allowed)
    loaded = {(ext.entry_point.name, ext.entry_point.value): ext.plugin for ext in manager.extensions}
    entries: list[ProviderEntry] = []
    for ep in unique:
        key = (ep.name, ep.value)
        for dist in dist_of.get(key) or [None]:
            dist_name = dist.metadata["Name"] if dist is not None else None
            dist_version = dist.version if dist is not None else None
            entry = ProviderEntry(kind=kind, name=ep.name, target=ep.value, dist=dist_name,
                                  dist_version=dist_version, status=LOADED)
            if allowed is not None and dist_name is not None and (
                    settings.canonical_dist(dist_name) not in {BUILTIN_DIST} | allowed):
                # this distribution's entry, though another, allowed one registers the same entry point
                entry.status, entry.error = BLOCKED, f"blocked: distribution {dist_name} not in {settings.PLUGINS_ENV}"
            elif key in manager.failures:
                err = manager.failures[key]
                if isinstance(err, _Blocked):
                    entry.status, entry.error = BLOCKED, f"blocked: {err}"
                else:
                    entry.status, entry.error = FAILED, str(err)
                    logger.warning("%s provider %s (%s) failed to load and cannot be used: %s", kind, ep.name,
                                   ep.value, err)
            else:
                entry.cls = loaded.get(key)
                problem = _check_class(kind, ep.name, entry.cls)
                if problem:
                    entry.status, entry.error, entry.cls = FAILED, problem, None
            entries.append(entry)
    _fail_repeats(kind, entries)
    return entries


def _fail_repeats(kind: str, entries: list[ProviderEntry]) -> None:
    """One distribution that registers one name under two targets (a setup.py list allows it) cannot be told apart
    by a qualified request (``DIST:NAME``): its first entry point serves; every later one is listed, blocked, saying
    so (no request names it)."""
    first: dict[tuple[str | None, str], ProviderEntry] = {}
    for entry in entries:
        key = (settings.canonical_dist(entry.dist) if entry.dist else None, entry.name)
        kept = first.setdefault(key, entry)
        if kept is not entry and kept.target != entry.target and entry.status == LOADED:
            entry.status, entry.cls = BLOCKED, None
            entry.error = (f"distribution {entry.dist} registers {kind} provider {entry.name!r} twice ({kept.target}"
                           f" and {entry.target}): the first serves")
            logger.warning("%s provider %s (%s) is not used: %s", kind, entry.name, entry.target, entry.error)


#: what a provider name or alias may not contain (it is parsed out of ``[KIND:][DIST:]NAME[@opts]`` requests and lists)
BAD_NAME_CHARS = re.compile(r"[:@,=\s]")
#: the rule :func:`name_problem` applies, in words
NAME_RULE = "a non-empty string without ':', '@', ',', '=' or spaces, and not 'auto' in any case"


def name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a provider (as its name or an alias: requests parse ``[DIST:]NAME[@key=value]`` and
    ``auto`` is the automatic choice), or None. The one rule for entry points and in-process registrations."""
    if not isinstance(name, str) or not name or BAD_NAME_CHARS.search(name) or name.lower() == "auto":
        return f"{name!r} is not a valid provider name ({NAME_RULE})"
    return None


def aliases_problem(aliases: Any) -> str | None:
    """Why ``aliases`` (a provider class's attribute) is not a tuple or list of valid names (:func:`name_problem`),
    or None."""
    if not isinstance(aliases, (tuple, list)):
        return f"aliases must be a tuple of names, got {type(aliases).__name__} {aliases!r}"
    for alias in aliases:
        problem = name_problem(alias)
        if problem is not None:
            return f"alias {problem}"
    return None


def options_problem(options: Any) -> str | None:
    """Why ``options`` (a provider class's attribute) is not a mapping of option name to a non-empty tuple or list of
    string values (the first the default), or None."""
    if not isinstance(options, Mapping):
        return f"options must be a mapping of option name to allowed values, got {type(options).__name__}"
    for key, values in options.items():
        if not isinstance(key, str) or not key:
            return f"option name {key!r} is not a non-empty string"
        if not isinstance(values, (tuple, list)) or not values or not all(isinstance(v, str) for v in values):
            return f"option {key!r} must list its allowed values as a non-empty tuple of strings, got {values!r}"
    return None


def _attribute_problems(cls: type) -> str | None:
    """Why the aliases, options, description or install hint of provider class ``cls`` (read by every listing, flag
    and resolution) are malformed, or None."""
    try:
        aliases, options = getattr(cls, "aliases", ()), getattr(cls, "options", {})
        texts = {what: getattr(cls, what, "") for what in ("description", "install_hint")}
    except Exception as exc:  # noqa: BLE001 - a plugin's attribute may raise anything
        return f"reading its aliases, options, description or install hint raised {type(exc).__name__}: {exc}"
    for what, text in texts.items():
        if not isinstance(text, str):
            return f"{what} must be a str (the listing shows it), got {type(text).__name__} {text!r}"
    return aliases_problem(aliases) or options_problem(options)


def _check_class(kind: str, ep_name: str, cls: Any) -> str | None:
    from fp8_backends.core.backend import Fp8GemmBackend, NormQuantBackend

    base = Fp8GemmBackend if kind == "gemm" else NormQuantBackend
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return f"entry point does not name a {base.__name__} subclass (got {cls!r})"
    problem = name_problem(ep_name)
    if problem is not None:
        return problem
    if getattr(cls, "name", None) != ep_name:
        return f"entry point name {ep_name!r} differs from the provider's name {getattr(cls, 'name', None)!r}"
    problem = _attribute_problems(cls)
    if problem is not None:
        return problem
    from fp8_backends.core.capabilities import GemmCapabilities, NormQuantCapabilities

    record = GemmCapabilities if kind == "gemm" else NormQuantCapabilities
    try:  # the record is read by every listing and ranking: a broken one makes the provider unusable, not them
        caps = cls.capabilities
        priority = caps.priority
    except Exception as exc:  # noqa: BLE001 - a plugin's attribute may raise anything
        return f"reading its capabilities raised {type(exc).__name__}: {exc}"
    if not isinstance(caps, record):
        return f"capabilities must be a {record.__name__}, got {type(caps).__name__}"
    if not isinstance(priority, int) or isinstance(priority, bool):
        return f"capabilities.priority must be an int, got {priority!r}"
    problems = caps.record_problems()
    if problems:
        return "malformed capabilities: " + "; ".join(problems)
    return None


def refresh() -> None:
    """Forget discovered providers and cached availability: the next :func:`discover` rescans the entry
    points (e.g. after installing a plugin into the running interpreter; an install into a ``sys.path``
    folder is noticed without it)."""
    from fp8_backends.core.backend import clear_availability_cache, run_refresh_hooks

    clear_availability_cache()
    importlib.invalidate_caches()
    with _lock:
        _cache.clear()
        _watches.clear()
    run_refresh_hooks()  # the decisions the floors above made from the providers (quant defaults, MoE kernels)


def _distribution_of(cls: type) -> str | None:
    """``"acme-fp8 1.2.0"``: the distribution whose entry point registers provider class ``cls``, or None (the
    output contract's errors name it: :func:`fp8_backends.core.output_contract.distribution_of`)."""
    for kind in ("gemm", "norm_quant"):
        for entry in discover(kind):
            if entry.cls is cls and entry.dist:
                return f"{entry.dist} {entry.dist_version or ''}".strip()
    return None


output_contract.set_distribution_lookup(_distribution_of)
