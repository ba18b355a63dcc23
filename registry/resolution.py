"""Turn a backend request (explicit name, alias, ``DIST:NAME``, env var, or ``auto``) into a provider.

Rules:
- An explicit choice that cannot serve raises :class:`UnsupportedProblemError` with every reason and
  the names that could serve. Nothing falls back silently.
- Unknown names raise :class:`UnknownBackendError` listing the valid ones.
- A name registered by two distributions must be qualified as ``DIST:NAME`` when requested explicitly
  (entries disabled by ``FP8_BACKENDS_DISABLED`` or blocked by ``FP8_BACKENDS_PLUGINS`` do not count).
- An explicit name evaluates (constructs, probes) only the entries it names; the others are evaluated only when
  an error lists the providers that could serve instead.
- ``auto`` evaluates every provider and climbs one ladder (:func:`_auto_ladder`): the selection policies by rank
  (:mod:`.policy`: the tuned lockfile, the shipped data, the measured defaults), then the highest-priority provider
  that can serve (built-ins first on a tie); the choice is logged once at INFO, the others' reasons at DEBUG. A
  name clash never stops ``auto``: it ranks every entry and logs one WARNING naming the clash and how to pin or
  disable one.
- Options follow ``@``: ``flashinfer_bmm@runner=cudnn`` (``key=value`` pairs separated by ``,``). A part without
  ``=``, a key given twice, nothing after ``@`` and options on ``auto`` raise :class:`BackendOptionError`.
- A provider whose construction or support check raises (a plugin bug) cannot serve: ``auto`` passes over it with
  the cause among its reasons, and naming it raises :class:`BackendUnavailableError` with that cause.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fp8_backends.core import settings
from fp8_backends.core.errors import (
    AmbiguousBackendError,
    BackendOptionError,
    BackendUnavailableError,
    ConfigurationError,
    Fp8BackendError,
    InvalidInputError,
    InvalidTypeError,
    UnknownBackendError,
    UnsupportedProblemError,
)
from fp8_backends.core.objective import SelectionObjective
from fp8_backends.core.types import GemmProblem, NormQuantProblem

# the candidates' record, instance cache and order, below resolution and the policies (public here too)
from .candidates import Candidate as Candidate
from .candidates import forget_instances
from .candidates import provider_instance as provider_instance
from .candidates import rank_key as rank_key
from .discovery import BLOCKED, ProviderEntry, discover, name_problem
from .platform import Platform, detect_platform

# the policy contract, re-exported here (its public home before policies were objects); the built-in policies
# import it and the candidates, never this module: this module loads them (:func:`load_builtin_policies`)
from .policy import CallablePolicy as CallablePolicy
from .policy import PolicyPick as PolicyPick
from .policy import SelectionPolicy as SelectionPolicy
from .policy import ordered as _ordered_policies
from .policy import register_selection_policy as register_selection_policy
from .policy import unregister_selection_policy as unregister_selection_policy

logger = logging.getLogger("fp8_backends")

AUTO = "auto"
KIND_LABEL = {"gemm": "GEMM", "norm_quant": "norm-quant"}
ENV_FOR_KIND = {"gemm": settings.GEMM_BACKEND_ENV, "norm_quant": settings.NORM_QUANT_BACKEND_ENV}


@dataclass
class Resolution:
    """The full story of one resolution, for the listing and for error messages.

    :attr:`candidates` is every registered provider's verdict (in rank order) with default options. ``auto``
    evaluates them all to choose; an explicit name evaluates only the entries it names (stevedore's ``named``
    loads only what was named), and the others are evaluated when something reads :attr:`candidates`: the error
    listing the alternatives, the listing (``python -m fp8_backends.list``), the argparse help."""

    kind: str
    request: str
    source: str  # "explicit", "env" (a name from the environment), "priority", or the deciding policy's name
    platform: Platform
    problem: Any
    #: every registered entry of ``kind`` (``discover(kind)``), in discovery order
    entries: Sequence[ProviderEntry] = ()
    chosen: Candidate | None = None
    backend: Any = None
    error: Exception | None = None
    note: str = ""
    #: what ``auto`` optimized (``kernel`` or ``host``; :func:`resolution_objective`); explicit names ignore it
    objective: SelectionObjective = SelectionObjective.KERNEL
    _verdicts: dict[int, Candidate] = field(default_factory=dict, repr=False)

    def verdict(self, entry: ProviderEntry) -> Candidate:
        """Whether ``entry`` (default options) can serve this resolution's problem: evaluated once, then kept."""
        cand = self._verdicts.get(id(entry))
        if cand is None:
            cand = self._verdicts[id(entry)] = _consider(entry, self.problem, self.platform)
        return cand

    @property
    def candidates(self) -> list[Candidate]:
        """Every entry's :meth:`verdict`, in rank order (priority, then built-ins first, then name)."""
        return [self.verdict(e) for e in sorted(self.entries, key=rank_key)]

    @property
    def evaluated(self) -> list[Candidate]:
        """The verdicts evaluated so far (all of them for ``auto``; for an explicit name, the named entries)."""
        return [c for e in sorted(self.entries, key=rank_key) if (c := self._verdicts.get(id(e))) is not None]


@dataclass(frozen=True)
class BackendRequest:
    """A parsed backend string: ``[DIST:]NAME[@key=value,...]`` or ``auto``."""

    name: str
    dist: str | None = None
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> BackendRequest:
        """Parse ``[DIST:]NAME[@key=value,...]``; raises :class:`InvalidTypeError` for a non-string and
        :class:`BackendOptionError` for malformed options (no ``=``, an empty key, a key given twice, nothing
        after ``@``, options on ``auto``). Option keys and values are checked by the provider."""
        if not isinstance(text, str):
            raise InvalidTypeError(
                "a backend request is a string ('auto', 'NAME', 'DIST:NAME' or 'NAME@key=value'), got "
                f"{type(text).__name__} {text!r}"
            )
        raw = text.strip()
        spec, at, opts = raw.partition("@")
        dist, sep, name = spec.rpartition(":")
        name = name.strip()
        options: list[tuple[str, str]] = []
        if at:
            parts = [p.strip() for p in opts.split(",")]
            if not any(parts):
                raise BackendOptionError(f"backend request {raw!r}: no options after '@' (write NAME@key=value)")
            for part in filter(None, parts):
                key, eq, value = part.partition("=")
                key, value = key.strip(), value.strip()
                if not eq or not key:
                    raise BackendOptionError(
                        f"backend request {raw!r}: option {part!r} is not key=value (e.g. torch@fast_accum=true)"
                    )
                if any(k == key for k, _ in options):
                    raise BackendOptionError(f"backend request {raw!r}: option {key!r} is given twice")
                options.append((key, value))
        if options and name == AUTO and not sep:
            raise BackendOptionError(
                f"backend request {raw!r}: auto takes no options (they would be dropped); name a provider to pass "
                "options, e.g. torch_scaled_mm@fast_accum=true"
            )
        return cls(name=name, dist=dist.strip() if sep else None, options=tuple(options))

    @property
    def is_auto(self) -> bool:
        return self.name == AUTO and self.dist is None


_logged: set[tuple] = set()
_lock = threading.Lock()


def _platform_for(problem: Any, platform: Platform | None) -> Platform:
    if platform is not None:
        return platform
    return detect_platform(None if problem is None else problem.device)


def _consider(entry: ProviderEntry, problem: Any, platform: Platform, options=()) -> Candidate:
    """Whether ``entry`` (with ``options``) can serve ``problem`` on ``platform``. Never raises: a library error
    from the provider (bad options, a bad environment variable) becomes its reason and stays in ``fault``; any
    other exception from its construction or support check is a fault of the provider (a plugin bug), given as
    the reason, and one from its default construction marks the provider unavailable for this process."""
    if entry.disabled:
        return Candidate(entry, [f"disabled by {settings.DISABLED_ENV}"])
    avail = entry.availability()
    if not avail.ok:
        error = avail.error if isinstance(avail.error, ConfigurationError) else None
        return Candidate(entry, _unavailable_reasons(entry, avail, problem, platform), fault=error)
    explicit_only = None
    try:
        backend = provider_instance(entry, options)
    except Fp8BackendError as exc:  # bad options or configuration: the caller's to fix, reported as such
        return Candidate(entry, [str(exc)], fault=exc)
    except Exception as exc:  # noqa: BLE001 - a plugin's constructor must not break resolution
        reason = f"construction raised {type(exc).__name__}: {exc}"
        if not options:  # the default construction failed: the provider cannot be used at all here
            _mark_unavailable(entry, reason)
        return Candidate(entry, [reason], fault=exc)
    try:
        from fp8_backends.core.backend import support_reasons

        reasons = support_reasons(backend, problem, platform)
        if not reasons:
            explicit_only = backend.explicit_only_reason(problem, platform)
    except ConfigurationError as exc:
        return Candidate(entry, [str(exc)], fault=exc)
    except Exception as exc:  # noqa: BLE001 - a plugin's check must not break resolution
        return Candidate(entry, [f"support check raised {type(exc).__name__}: {exc}"], fault=exc)
    return Candidate(entry, reasons, explicit_only)


def _mark_unavailable(entry: ProviderEntry, reason: str) -> None:
    """Record that ``entry``'s provider cannot be used in this process (its construction failed): the listing
    and every later resolution give ``reason``; ``discovery.refresh()`` forgets it."""
    if entry.cls is None:
        return
    from fp8_backends.core.backend import record_fault

    record_fault(entry.cls, reason)
    logger.warning("%s provider %s (%s) is unusable: %s", KIND_LABEL.get(entry.kind, entry.kind), entry.name,
                   entry.dist, reason)


def _unavailable_reasons(entry: ProviderEntry, avail: Any, problem: Any, platform: Platform) -> list[str]:
    """Why a provider that cannot run in this process cannot serve ``problem`` on ``platform``.

    When its declared capabilities already rule the platform out (a CUDA-only provider on a CPU machine, an
    SM it was not built for), those reasons come first and no install hint is given: installing its
    extras would not help here. On a simulated platform the missing piece is still named (without the
    hint), so ``--simulate-sm`` shows both. Otherwise the availability reason and its install hint."""
    declared: list[str] = []
    if entry.cls is not None:
        try:
            declared = list(entry.cls.capabilities.check(problem, platform))
        except Exception as exc:  # a broken capability record must not break resolution
            declared = [f"capability check raised {type(exc).__name__}: {exc}"]
    elif platform.simulated:
        return [avail.reason, "its supported architectures are unknown here (the provider class did not load)"]
    if not declared:
        return [avail.reason + (f" (install: {avail.install_hint})" if avail.install_hint else "")]
    if platform.simulated:
        return [*declared, f"also unavailable in this process: {avail.reason}"]
    return declared


def resolution_objective(objective: SelectionObjective | str | None = None) -> SelectionObjective:
    """The objective one resolution decides by: ``objective`` (a :class:`SelectionObjective` or its value), else
    ``FP8_SELECTION_OBJECTIVE``, else ``kernel``; ``auto`` (a layer's objective) is ``kernel`` here, as one
    resolution has one provider for every path (:mod:`fp8_backends.core.objective`). A bad value raises
    :class:`InvalidInputError` (argument) or :class:`ConfigurationError` (the variable)."""
    if objective is None:
        return settings.selection_objective(SelectionObjective.KERNEL).for_resolution()
    return SelectionObjective.of(objective).for_resolution()


def explain(
    kind: str,
    name: str | None = None,
    *,
    problem: Any = None,
    platform: Platform | None = None,
    objective: SelectionObjective | str | None = None,
) -> Resolution:
    """Resolve without raising: a :class:`Resolution` with ``chosen``/``backend`` set or ``error`` holding the
    exception :func:`resolve` would raise, and every candidate's reasons (:attr:`Resolution.candidates`). Arguments
    of the wrong type (a number as ``name``, a ``dict`` as ``problem``, a string as ``platform``) raise
    :class:`InvalidTypeError` at once, and a bad ``FP8_BACKENDS_SIMULATE_SM`` :class:`ConfigurationError`.

    ``objective``: what ``auto``'s measuring policies optimize (:func:`resolution_objective`: default
    ``FP8_SELECTION_OBJECTIVE``, else ``kernel``); an explicit name ignores it. A bad ``FP8_SELECTION_OBJECTIVE``
    raises :class:`ConfigurationError` when ``auto`` reads it."""
    check_arguments(kind, name, problem, platform)
    if objective is not None:
        objective = SelectionObjective.of(objective)  # a bad argument fails whatever the request
    source = "explicit"
    if name is None:
        env_value = os.environ.get(ENV_FOR_KIND[kind], "").strip()
        name, source = (env_value, "env") if env_value else (AUTO, "auto")
    platform = _platform_for(problem, platform)
    entries = discover(kind)
    _warn_unmatched_disabled()
    res = Resolution(kind=kind, request=name, source=source, platform=platform, problem=problem, entries=entries)
    try:
        request = BackendRequest.parse(name)
    except InvalidInputError as exc:
        res.error = exc
        return res
    # entries blocked by FP8_BACKENDS_PLUGINS or disabled by FP8_BACKENDS_DISABLED take no part in ambiguity
    selectable = [e for e in entries if e.status != BLOCKED and not e.disabled]
    if request.is_auto:
        if objective is not None or kind == "gemm":  # the variable is about GEMM providers
            try:
                res.objective = resolution_objective(objective)
            except ConfigurationError as exc:  # a bad FP8_SELECTION_OBJECTIVE: never ignored
                res.error = exc
                return res
        _warn_clashes(kind, selectable)
        return _explain_auto(res)
    return _explain_named(res, request, selectable)


class _Choice(NamedTuple):
    """Who serves under ``auto`` and why: the deciding policy's name (or ``"priority"``), its note, the candidate
    and the provider instance."""

    source: str
    note: str
    candidate: Candidate
    backend: Any


def _explain_auto(res: Resolution) -> Resolution:
    """``auto``: evaluate every provider, then climb :func:`_auto_ladder`. A provider's configuration error (a bad
    ``FP8_BACKENDS_TRITON_TABLE``, ...) is the resolution's error: ``auto`` never passes over a setting the user made
    to pick another provider silently."""
    misconfigured = next((c.fault for c in res.candidates if isinstance(c.fault, ConfigurationError)), None)
    if misconfigured is not None:
        res.error = misconfigured
        return res
    serving = [c for c in res.candidates if c.auto_ok]
    res.source = "priority"
    try:
        choice = _auto_ladder(res.kind, res.problem, res.platform, serving, res.objective)
    except ConfigurationError as exc:  # a bad variable a policy reads (FP8_BACKENDS_TUNE, ...): never ignored
        res.error = exc
        return res
    if choice is None:
        label, entries = KIND_LABEL[res.kind], res.entries
        what = res.problem.describe() if res.problem is not None else "any problem"
        res.error = UnsupportedProblemError(
            f"no {label} provider can serve {what} on {res.platform.describe()} under auto:\n"
            + _format_reasons(res.candidates),
            reasons=[f"{display_name(c.entry, entries)}: {r}" for c in res.candidates for r in c.reasons],
        )
        return res
    res.source, res.note, res.chosen, res.backend = choice
    return res


def selection_policies() -> tuple[SelectionPolicy, ...]:
    """The registered selection policies in asking order, the built-in ones included (loaded first if no ``auto``
    resolution has loaded them yet)."""
    load_builtin_policies()
    return _ordered_policies()


#: the built-in policies' modules, loaded on the first ``auto`` resolution (each registers its policies on import)
BUILTIN_POLICY_MODULES = {
    "lockfile_policy": lambda: importlib.import_module("fp8_backends.registry.lockfile_policy"),
    "shipped": lambda: importlib.import_module("fp8_backends.registry.shipped"),
    "defaults": lambda: importlib.import_module("fp8_backends.registry.defaults"),
}
_builtins_loaded = False


def load_builtin_policies() -> None:
    """Import the built-in policies' modules once (:data:`BUILTIN_POLICY_MODULES`: importing this module does not;
    they import the policy contract and the candidates, never this module); their ranks, not this order, decide
    which is asked first. A module that fails to import is reported (WARNING) and left out: resolution goes on
    without it."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module, load in BUILTIN_POLICY_MODULES.items():
        try:
            load()  # registers its policies
        except Exception as exc:  # a broken policy module must not break resolution
            logger.warning("%s selection policy unavailable (%s: %s)", module, type(exc).__name__, exc)


def _auto_ladder(kind: str, problem: Any, platform: Platform, serving: list[Candidate],
                 objective: SelectionObjective = SelectionObjective.KERNEL) -> _Choice | None:
    """``auto``'s choice among ``serving``, one rung after the other: the selection policies by rank (the tuned
    lockfile, policies others registered, the shipped data's exact then nearest answer, the measured defaults;
    :mod:`.policy`), each asked under ``objective``, then the highest static priority. None: nothing can serve."""
    load_builtin_policies()
    return _ask_policies(kind, problem, platform, serving, objective) or _by_priority(serving)


def _by_priority(serving: list[Candidate]) -> _Choice | None:
    """The last rung: the first serving candidate (candidates are in rank order: priority, built-ins first on a
    tie, then name), with default options."""
    if not serving:
        return None
    return _Choice("priority", "", serving[0], provider_instance(serving[0].entry))


def _explain_named(res: Resolution, request: BackendRequest, selectable: list[ProviderEntry]) -> Resolution:
    """An explicit request: evaluate only the entries it names; the others only for an error's alternatives."""
    kind, problem, platform, entries = res.kind, res.problem, res.platform, res.entries
    label = KIND_LABEL[kind]
    matches = named_entries(selectable, request.name, request.dist)
    if not matches:
        matches = named_entries(entries, request.name, request.dist)  # disabled or blocked ones
        if len(matches) > 1:
            res.error = BackendUnavailableError(
                f"{label} backend {request.name!r} is not usable here: "
                + "; ".join(f"{e.qualified_name}: {'; '.join(res.verdict(e).reasons)}" for e in matches)
                + _alternatives_text(res, None)
            )
            return res
    if not matches:
        # an entry point under a name no request can give (it failed to load for it) is no valid name
        valid = {e.name for e in entries if name_problem(e.name) is None} | {
            a for e in entries for a in e.aliases}
        res.error = UnknownBackendError(
            request.name if request.dist is None else f"{request.dist}:{request.name}", label, valid
        )
        return res
    if len(matches) > 1:
        res.error = _ambiguous(kind, request.name, matches)
        return res
    entry = matches[0]
    if entry.disabled or not entry.availability().ok:
        reasons = res.verdict(entry).reasons
        res.error = BackendUnavailableError(
            f"{label} backend {entry.name!r} ({entry.dist}) is not usable here: {'; '.join(reasons)}"
            + _alternatives_text(res, entry)
        )
        return res
    cand = res.verdict(entry) if not request.options else _consider(entry, problem, platform, request.options)
    if isinstance(cand.fault, Fp8BackendError):  # bad options or configuration: that error, as raised
        res.error = cand.fault
        return res
    if cand.fault is not None:  # the provider itself failed: it is unusable, and says why
        res.error = BackendUnavailableError(
            f"{label} backend {entry.name!r} ({entry.dist}) is not usable here: {'; '.join(cand.reasons)}"
            + _alternatives_text(res, entry)
        )
        res.error.__cause__ = cand.fault
        return res
    backend = provider_instance(entry, request.options)  # made (and cached) by _consider
    if cand.reasons:
        what = problem.describe() if problem is not None else "any problem"
        alts = [display_name(c.entry, entries) for c in _serving_alternatives(res, entry)]
        res.error = UnsupportedProblemError(
            f"{label} backend {backend.label!r} cannot serve {what} on {platform.describe()}:\n"
            + "".join(f"  - {r}\n" for r in cand.reasons)
            + (f"providers that can: {', '.join(alts)}" if alts else "no other provider can serve it either"),
            reasons=cand.reasons,
            alternatives=alts,
        )
        return res
    res.chosen, res.backend = cand, backend
    return res


def display_name(entry: ProviderEntry, entries: Sequence[ProviderEntry]) -> str:
    """``entry.name``, or ``DIST:NAME`` when another entry of ``entries`` carries the same name (so that
    help texts and errors never show one name twice without saying which is which)."""
    if any(e is not entry and e.name == entry.name for e in entries):
        return entry.qualified_name
    return entry.name


def name_clashes(entries: Sequence[ProviderEntry]) -> dict[str, list[ProviderEntry]]:
    """Requestable names that several entries of ``entries`` answer to, each with its entries in rank order: a name
    several register, or an alias several plugins declare that no entry has as its name and no built-in declares
    (a request names a provider's name before an alias, and a built-in's alias before a plugin's:
    :func:`named_entries`)."""
    names = {e.name for e in entries}
    aliases = [a for e in entries for a in e.aliases if a not in names]
    if len(names) == len(entries) and len(set(aliases)) == len(aliases):  # the usual case, at every resolution
        return {}
    by_name: dict[str, list[ProviderEntry]] = {}
    by_alias: dict[str, list[ProviderEntry]] = {}
    for e in sorted(entries, key=rank_key):
        by_name.setdefault(e.name, []).append(e)
        for a in dict.fromkeys(e.aliases):
            if a not in names:
                by_alias.setdefault(a, []).append(e)
    clashes = {name: group for name, group in by_name.items() if len(group) > 1}
    clashes.update({a: group for a, group in by_alias.items()
                    if len(group) > 1 and not any(e.builtin for e in group)})
    return clashes


def named_entries(entries: Sequence[ProviderEntry], name: str, dist: str | None = None) -> list[ProviderEntry]:
    """The entries a request for ``[dist:]name`` names: those registered under that name; where none is, those
    that declare it as an alias, a built-in's alias before a plugin's. A plugin's alias equal to another provider's
    name or to a built-in's alias (``torch``, ``cutlass``) so never takes it over, nor makes it ambiguous."""
    matches = [e for e in entries if e.matches(name, dist)]
    if len(matches) > 1:
        for preferred in ([e for e in matches if e.name == name], [e for e in matches if e.builtin]):
            if preferred:
                return preferred
    return matches


def _warn_clashes(kind: str, selectable: Sequence[ProviderEntry]) -> None:
    """One WARNING per clash and process: which distributions register the name, and how to pin or disable one;
    and one per alias that is another provider's name or a built-in's alias (requests for it name that provider)."""
    names = {e.name: e for e in selectable}
    builtin_aliases = {a: e for e in selectable if e.builtin for a in e.aliases}
    for e in selectable:
        for alias in e.aliases:
            owner = names.get(alias) or (None if e.builtin else builtin_aliases.get(alias))
            if owner is None or owner is e:
                continue
            key = ("shadowed", kind, alias, e.qualified_name)
            with _lock:
                if key in _logged:
                    continue
                _logged.add(key)
            logger.warning("%s provider %s declares the alias %r, a name of %s: a request for %r names %s",
                           KIND_LABEL[kind], e.qualified_name, alias, owner.qualified_name, alias,
                           owner.qualified_name)
    for name, group in name_clashes(selectable).items():
        key = ("clash", kind, name, tuple(e.qualified_name for e in group))
        with _lock:
            if key in _logged:
                continue
            _logged.add(key)
        dists = ", ".join(f"{e.dist} ({e.target})" for e in group)
        pins = " or ".join(e.qualified_name for e in group)
        other = next((e for e in reversed(group) if not e.builtin), group[-1])  # suggest disabling a plugin
        off = f"{kind}:{other.qualified_name}"
        how = "registered by several distributions" if group[0].name == name else "an alias of several providers"
        logger.warning(
            "%s provider name %r is %s: %s. auto ranks each like any other provider (priority, built-ins first on a "
            "tie); to choose one by name, pin it as %s, or disable one with %s=%s",
            KIND_LABEL[kind], name, how, dists, pins, settings.DISABLED_ENV, off,
        )


#: per policy: how many of its picks were ignored because they could not serve (see :func:`_ignore_pick`)
ignored_picks: dict[str, int] = {}


def _ask_policies(kind: str, problem: Any, platform: Platform, serving: list[Candidate],
                  objective: SelectionObjective = SelectionObjective.KERNEL) -> _Choice | None:
    """The first policy's usable pick, or None. A policy that raises is skipped with a WARNING (a
    :class:`ConfigurationError` propagates: a bad variable is the user's to fix); a pick that cannot serve, or whose
    options the provider refuses, is ignored (:func:`_ignore_pick`)."""
    for pol in _ordered_policies():
        try:
            picked = pol.pick_for(kind, problem, platform, serving, objective)
        except ConfigurationError:
            raise
        except Exception as exc:
            logger.warning("selection policy %s failed (%s); using static priorities", pol.name, exc)
            continue
        if picked is None:
            continue
        entry, options, note = picked
        cand = next((c for c in serving if c.entry is entry), None)
        if cand is None:
            _ignore_pick(pol.name, entry, problem, "it cannot serve this problem here")
            continue
        try:
            backend = provider_instance(entry, tuple(dict(options).items()))
        except Exception as exc:  # noqa: BLE001 - options the provider refuses (a stale policy), or a broken plugin
            _ignore_pick(pol.name, entry, problem, f"{type(exc).__name__}: {exc}")
            continue
        return _Choice(pol.name, note, cand, backend)
    return None


def _ask_buckets(kind: str, problem: Any, platform: Platform) -> tuple[str, list[int]]:
    """``(policy name, buckets)`` of the first policy (by rank) that distinguishes M buckets for ``problem``, or
    ``("", [])``. A policy whose :meth:`~.policy.SelectionPolicy.buckets` raises is skipped with a WARNING (once per
    policy and error type; later ones at DEBUG; a :class:`ConfigurationError` propagates)."""
    for pol in _ordered_policies():
        try:
            found = sorted({int(b) for b in pol.buckets(kind, problem, platform) or ()})
        except ConfigurationError:
            raise
        except Exception as exc:  # noqa: BLE001 - a policy's bug must not break the layers
            key = ("buckets-failed", pol.name, type(exc).__name__)
            with _lock:
                first = key not in _logged
                _logged.add(key)
            (logger.warning if first else logger.debug)(
                "selection policy %s could not give its M buckets (%s: %s); asking the next", pol.name,
                type(exc).__name__, exc)
            continue
        if found:
            return pol.name, found
    return "", []


def _ignore_pick(policy_name: str, entry: Any, problem: Any, why: str) -> None:
    """Count an ignored pick of ``policy_name``: the first one per policy and process is a WARNING (with the
    count so far), later ones are DEBUG lines with the running count (:data:`ignored_picks`)."""
    with _lock:
        count = ignored_picks[policy_name] = ignored_picks.get(policy_name, 0) + 1
        first = ("ignored-pick", policy_name) not in _logged
        _logged.add(("ignored-pick", policy_name))
    what = problem.describe() if problem is not None else "any problem"
    name = getattr(entry, "name", entry)
    if first:
        logger.warning("selection policy %s picked %s for %s, but %s; the pick is ignored (the next policy or "
                       "static priorities decide). Ignored picks of this policy so far: %d (later ones are logged "
                       "at DEBUG)", policy_name, name, what, why, count)
    else:
        logger.debug("selection policy %s picked %s for %s, but %s; ignored (%d ignored picks so far)",
                     policy_name, name, what, why, count)


def _ambiguous(kind: str, name: str, entries: list[ProviderEntry]) -> AmbiguousBackendError:
    clash = [e for e in entries if e.name == name or name in e.aliases]
    dists = ", ".join(sorted(f"{e.dist} ({e.target})" for e in clash))
    qualified = " or ".join(sorted(e.qualified_name for e in clash))
    how = "registered by several distributions" if clash[0].name == name else "an alias of several providers"
    return AmbiguousBackendError(f"{KIND_LABEL[kind]} backend name {name!r} is {how}: {dists}; select one as "
                                 f"{qualified}")


def _format_reasons(candidates: list[Candidate]) -> str:
    entries = [c.entry for c in candidates]
    lines = []
    for c in candidates:
        for r in c.reasons or ([c.explicit_only] if c.explicit_only else []):
            lines.append(f"  - {display_name(c.entry, entries)}: {r}\n")
    return "".join(lines) or "  (no providers are registered)\n"


def _alternatives_text(res: Resolution, exclude: ProviderEntry | None) -> str:
    alts = [display_name(c.entry, res.entries) for c in _serving_alternatives(res, exclude)]
    return f"; providers that can serve: {', '.join(alts)}" if alts else "; no other provider can serve it"


def _serving_alternatives(res: Resolution, exclude: ProviderEntry | None) -> list[Candidate]:
    """The candidates of ``res`` other than ``exclude`` that can serve its problem, by what is known of them: one
    whose preload has failed in this process is unusable and left out. An error loads nothing to find out more (a
    preload may import a kernel library or build one, and some errors are caught by their caller, e.g. a layer's
    optional residual norm)."""
    return [c for c in res.candidates if c.ok and c.entry is not exclude]


def explain_loaded(
    kind: str, name: str | None = None, *, problem: Any = None, platform: Platform | None = None,
    objective: SelectionObjective | str | None = None,
) -> Resolution:
    """:func:`explain`, then load the chosen provider (:meth:`~fp8_backends.core.backend.ProviderBase.ensure_preloaded`)
    as :func:`resolve` does: when it fails to load, ``auto`` resolves again without it (one WARNING each) and an
    explicit choice gets the :class:`BackendUnavailableError`. The listing marks this resolution's choice, so its
    ``*`` is exactly what :func:`resolve` returns."""
    failed = 0
    while True:
        res = explain(kind, name, problem=problem, platform=platform, objective=objective)
        if res.error is not None:
            return res
        if failed > len(res.entries):  # each failure removes one candidate: cannot happen, but never loop
            res.error = BackendUnavailableError(f"no {KIND_LABEL[kind]} provider could be loaded")
            res.chosen = res.backend = None
            return res
        try:
            res.backend.ensure_preloaded()  # load time: a compiled model's first call must find its ops defined
        except BackendUnavailableError as exc:
            if res.request != AUTO:
                res.error, res.chosen, res.backend = exc, None, None
                return res
            # ensure_preloaded marked the provider unavailable: auto resolves again without it
            logger.warning("%s backend %s failed to load and is skipped: %s", KIND_LABEL[kind], res.backend.label,
                           exc)
            failed += 1
            continue
        return res


def resolve(kind: str, name: str | None = None, *, problem: Any = None, platform: Platform | None = None,
            objective: SelectionObjective | str | None = None) -> Any:
    """Resolve and return the provider instance, or raise the library error that explains why not. ``objective``:
    what ``auto`` optimizes (:func:`explain`)."""
    res = explain_loaded(kind, name, problem=problem, platform=platform, objective=objective)
    if res.error is not None:
        raise res.error
    _log_choice(res)
    return res.backend


def resolve_or_check(kind: str, backend: Any, problem: Any, platform: Platform | None = None,
                     objective: SelectionObjective | str | None = None) -> Any:
    """A provider for ``problem``: a given provider instance (checked: it must serve ``problem``, then loaded with
    :meth:`~fp8_backends.core.backend.ProviderBase.ensure_preloaded`), else a request string or None (env var, else
    ``auto``) resolved by :func:`resolve`. Raises the library's errors."""
    from fp8_backends.core.backend import Fp8GemmBackend, NormQuantBackend, support_reasons

    base = Fp8GemmBackend if kind == "gemm" else NormQuantBackend
    if isinstance(backend, base):
        reasons = support_reasons(backend, problem, platform)
        if reasons:
            raise UnsupportedProblemError(
                f"{KIND_LABEL[kind]} backend {backend.label!r} cannot serve {problem.describe()}:\n"
                + "".join(f"  - {r}\n" for r in reasons),
                reasons=reasons,
            )
        backend.ensure_preloaded()
        return backend
    if backend is not None and not isinstance(backend, str):
        raise InvalidTypeError(f"backend must be a name, a {base.__name__} or None, got {type(backend).__name__}")
    return resolve(kind, backend, problem=problem, platform=platform, objective=objective)


_PROBLEM_TYPES = {"gemm": GemmProblem, "norm_quant": NormQuantProblem}


def check_arguments(kind: str, name: Any, problem: Any, platform: Any) -> None:
    """Raise :class:`InvalidTypeError` for a resolution argument of the wrong type (cheap ``isinstance`` checks)."""
    if kind not in _PROBLEM_TYPES:
        raise InvalidInputError(f"unknown provider kind {kind!r} (expected gemm or norm_quant)")
    if name is not None and not isinstance(name, str):
        BackendRequest.parse(name)  # raises InvalidTypeError
    wanted = _PROBLEM_TYPES[kind]
    if problem is not None and not isinstance(problem, wanted):
        raise InvalidTypeError(
            f"a {KIND_LABEL[kind]} resolution's problem must be a {wanted.__name__} (or None), got "
            f"{type(problem).__name__}"
        )
    if platform is not None and not isinstance(platform, Platform):
        raise InvalidTypeError(
            "platform must be a Platform (detect_platform(...), simulate_platform('9.0')) or None, got "
            f"{type(platform).__name__} {platform!r}"
        )


def _warn_unmatched_disabled() -> None:
    """One WARNING per ``FP8_BACKENDS_DISABLED`` item (and value of the variable) that matches no registered
    provider of any kind: a typo there would otherwise disable nothing, silently. Costs a dict lookup once
    checked."""
    token = settings.env_token(settings.DISABLED_ENV)
    if not token:
        return
    key = ("disabled-checked", token)
    if key in _logged:
        return
    items = settings.disabled_items()
    entries = [*discover("gemm"), *discover("norm_quant")]
    for item in items:
        if not any(item.applies_to(e.kind, e.dist, {e.name, *e.aliases}) for e in entries):
            known = sorted({e.name for e in entries} | {a for e in entries for a in e.aliases})
            logger.warning("%s item %r matches no registered provider and disables nothing (known names: %s; "
                           "write [KIND:][DIST:]NAME)", settings.DISABLED_ENV, _item_text(item), ", ".join(known))
    with _lock:
        _logged.add(key)


def _item_text(item: settings.DisabledItem) -> str:
    return ":".join(p for p in (item.kind, item.dist, item.name) if p)


def _log_choice(res: Resolution) -> None:
    key = (res.kind, res.request, res.source, res.backend.label, res.problem, res.platform, res.objective)
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    what = res.problem.describe() if res.problem is not None else "any problem"
    logger.info(
        "%s backend %s selected (%s%s) for %s on %s%s",
        KIND_LABEL[res.kind], res.backend.label, res.source, f": {res.note}" if res.note else "",
        what, res.platform.describe(), _objective_text(res),
    )
    if logger.isEnabledFor(logging.DEBUG):
        for c in res.evaluated:  # an explicit name evaluated no others: none are made up for the log
            if c is not res.chosen:
                logger.debug("  %s: %s", c.entry.name, "; ".join(c.reasons) or "could serve (lower rank)")


def _objective_text(res: Resolution) -> str:
    """``" (host objective)"`` for an ``auto`` resolution under the host objective, else nothing."""
    if res.request == AUTO and res.objective is SelectionObjective.HOST:
        return " (host objective)"
    return ""


def resolve_gemm_backend(
    name: str | None = None,
    *,
    problem: GemmProblem | None = None,
    platform: Platform | None = None,
    objective: SelectionObjective | str | None = None,
):
    """The FP8 GEMM provider for ``problem`` on ``platform``.

    ``name``: ``"auto"``, a provider name or alias, ``"DIST:NAME"``, optionally with options
    (``"flashinfer_bmm@runner=cudnn"``); ``None`` reads ``FP8_GEMM_BACKEND`` (default ``auto``).
    ``platform`` defaults to the detected device for ``problem.device`` (see
    :func:`~fp8_backends.registry.platform.simulate_platform` to ask about another GPU). ``objective``: what
    ``auto`` optimizes, ``"kernel"`` (the fastest kernel in CUDA graphs) or ``"host"`` (a host-enqueued call's
    cost); default ``FP8_SELECTION_OBJECTIVE``, else kernel (:mod:`fp8_backends.core.objective`).
    """
    return resolve("gemm", name, problem=problem, platform=platform, objective=objective)


def resolve_gemm_buckets(
    name: str | None = None,
    *,
    problem: GemmProblem,
    platform: Platform | None = None,
    objective: SelectionObjective | str | None = None,
) -> list[tuple[int, Any]]:
    """For ``auto``: the provider for each M bucket that the first selection policy distinguishing any (by rank:
    the tuned lockfile's buckets for ``problem``, its ``m`` ignored, else the shipped selection data's, else this
    GPU's measured defaults'; :meth:`~.policy.SelectionPolicy.buckets`) names, as ``[(bucket, provider), ...]``
    ascending; a batch of ``M`` rows uses the first bucket ``>= M`` (the largest beyond them). ``[]`` for an
    explicit choice or when no policy distinguishes buckets. Logs one INFO line per problem summarising the
    choices. :mod:`.per_m` turns the table into one weight's per-M provider. ``objective``: as
    :func:`resolve_gemm_backend` (``kernel`` or ``host``; ``auto`` is ``kernel`` here: a layer asks for both tables,
    :func:`~.per_m.init_fp8_gemm`)."""
    check_arguments("gemm", name, problem, platform)
    if objective is not None:
        objective = SelectionObjective.of(objective)
    if problem is None:
        raise InvalidTypeError("resolve_gemm_buckets needs a GemmProblem")
    if not requests_auto("gemm", name):
        return []
    platform = _platform_for(problem, platform)
    objective = resolution_objective(objective)
    load_builtin_policies()
    source, covered = _ask_buckets("gemm", problem.with_m(None), platform)
    table = []
    for bucket in covered:
        res = explain("gemm", name, problem=problem.with_m(bucket), platform=platform, objective=objective)
        if res.error is not None:
            raise res.error
        table.append((bucket, res.backend))
    if table:
        key = ("gemm-buckets", problem.with_m(None), platform, tuple((b, be.label) for b, be in table), objective)
        with _lock:
            first = key not in _logged
            _logged.add(key)
        if first:
            logger.info(
                "GEMM backends by M bucket (%s%s) for %s on %s: %s", source,
                ", host objective" if objective is SelectionObjective.HOST else "",
                problem.with_m(None).describe(), platform.describe(),
                describe_buckets([(b, be.label) for b, be in table]),
            )
    return table


def describe_buckets(rows: Sequence[tuple[int, str]]) -> str:
    """``[(16, "triton"), (17, "torch_scaled_mm")]`` -> ``"M<=16:triton,M>16:torch_scaled_mm"``: each bucket serves
    the batch sizes up to its bound, the last one every larger batch size too."""
    if not rows:
        return ""
    cells = [f"M<={bound}:{label}" for bound, label in rows[:-1]]
    last = rows[-1][1]
    return ",".join(cells + ([f"M>{rows[-2][0]}:{last}"] if len(rows) > 1 else [last]))


def resolve_norm_quant_backend(
    name: str | None = None,
    *,
    problem: NormQuantProblem | None = None,
    platform: Platform | None = None,
):
    """The fused RMSNorm+FP8-quant provider; same rules as :func:`resolve_gemm_backend`
    (env var ``FP8_NORM_QUANT_BACKEND``)."""
    return resolve("norm_quant", name, problem=problem, platform=platform)


def requests_auto(kind: str, name: Any) -> bool:
    """Whether a backend request of ``kind`` is ``auto``: ``name`` a string, or None for the kind's environment
    variable (``FP8_GEMM_BACKEND`` / ``FP8_NORM_QUANT_BACKEND``, read now), else ``auto``. A provider instance or an
    unparsable name is not."""
    if name is None:
        name = os.environ.get(ENV_FOR_KIND[kind], "").strip() or AUTO
    if not isinstance(name, str):
        return False
    try:
        return BackendRequest.parse(name).is_auto
    except InvalidInputError:
        return False


def reset_caches() -> None:
    """Forget provider instances and the log-once memory (tests, plugin reloads)."""
    forget_instances()
    with _lock:
        _logged.clear()
        ignored_picks.clear()
