"""The ``"lockfile"`` selection policy of ``auto``: the tuned lockfile's choice (:mod:`.lockfile`) for a
problem's M bucket, the next ranked candidate when that one cannot serve here, else nothing (the next policy, or
static priorities, decide). With ``FP8_BACKENDS_TUNE=1`` a problem the lockfile lacks is tuned at first use
(:mod:`fp8_backends.tuning.first_use`). :data:`POLICY` (a :class:`LockfilePolicy`, rank 100) is registered on
import, which resolution does on first use; its M buckets are the ones the lockfile holds for a weight.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8_backends.core import settings
from fp8_backends.core.errors import ConfigurationError
from fp8_backends.core.objective import SelectionObjective

from . import host_aware
from .candidates import Candidate, provider_instance
from .discovery import ProviderEntry
from .lockfile import (
    DEFAULT_M_BUCKETS,
    DEFAULT_TIE_MARGIN,
    _dist_matches,
    _options_ok,
    _store,
    _warn_once,
    bucket_for,
    candidate_label,
    covered_buckets,
    find_section,
    lockfile_path,
    problem_m,
)
from .platform import Platform
from .policy import SelectionPolicy, register_selection_policy

logger = logging.getLogger("fp8_backends")

POLICY_NAME = "lockfile"


def tune_at_first_use() -> bool:
    """``FP8_BACKENDS_TUNE=1``: tune problems the lockfile does not cover when ``auto`` first meets them (strictly
    parsed: an unknown value raises :class:`~fp8_backends.core.errors.ConfigurationError`)."""
    return settings.tune_at_first_use()


def _tuning_now() -> bool:
    """Whether this thread is tuning at first use (its own resolutions must not tune again)."""
    from fp8_backends.tuning import first_use

    return first_use.active()


def _tune_missing(kind: str, problem: Any, platform: Platform, path: Path, bucket: int):
    from fp8_backends.tuning import first_use

    return first_use.tune_missing(kind, problem, platform, path, bucket)


def pick_from_entry(
    kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate], record: Mapping[str, Any]
) -> tuple[ProviderEntry, dict[str, str], int] | None:
    """The first of the entry's ``choice`` then ``ranking`` that can serve here:
    ``(provider entry, options, rank)`` (rank 0 = the recorded choice)."""
    seen = []
    ordered = [record["choice"], *[r for r in record.get("ranking") or [] if isinstance(r, dict)]]
    for choice in ordered:
        provider = choice.get("provider")
        options = {str(k): str(v) for k, v in (choice.get("options") or {}).items()}
        ident = (provider, choice.get("distribution"), tuple(sorted(options.items())))
        if ident in seen or not isinstance(provider, str):
            continue
        seen.append(ident)
        found = servable_choice(kind, problem, platform, serving, choice)
        if found is not None:
            return found[0], found[1], len(seen) - 1
    return None


def servable_choice(
    kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate], choice: Mapping[str, Any]
) -> tuple[ProviderEntry, dict[str, str]] | None:
    """The serving provider entry a recorded candidate ``{"provider", "distribution", "options"}`` names, with its
    options, when it can serve ``problem`` here with them; else None."""
    provider = choice.get("provider")
    if not isinstance(provider, str):
        return None
    options = {str(k): str(v) for k, v in (choice.get("options") or {}).items()}
    for cand in serving:
        e = cand.entry
        if e.name != provider or not _dist_matches(e, choice.get("distribution")):
            continue
        if not _options_ok(e, options):
            logger.debug("lockfile choice %s: options no longer valid", candidate_label(provider, options))
            return None
        try:
            backend = provider_instance(e, tuple(sorted(options.items())))
            # ``e`` is serving, so it is available: check what the options may change (not the
            # availability probe ``supports()`` repeats on every call)
            reasons = list(backend.capabilities.check(problem, platform))
            reasons += backend.extra_reasons(problem, platform)
        except Exception as exc:
            reasons = [f"{type(exc).__name__}: {exc}"]
        if reasons:
            logger.debug("lockfile choice %s cannot serve: %s", candidate_label(provider, options),
                         "; ".join(reasons))
            return None
        return e, options
    return None


def host_rerank(
    kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate], record: Mapping[str, Any],
    picked: tuple[ProviderEntry, dict[str, str], str], lower: Mapping[str, Any] | None = None,
) -> tuple[ProviderEntry, dict[str, str], str]:
    """The host objective on a measured entry (:func:`.host_aware.rerank_record`): ``picked`` (the kernel answer
    ``(entry, options, note)``) or the candidate replacing it, its note saying why. ``lower``: the entry of the
    bucket below, the bottom of the M range ``record``'s bucket serves (None: none)."""
    changed = host_aware.rerank_record(
        record, lambda choice: servable_choice(kind, problem, platform, serving, choice), serving, picked[:2],
        lower)
    if changed is None:
        return picked
    entry, options, why = changed
    return entry, options, f"{picked[2]}; {why}"


_MAX_PICKS = 1 << 16


def lockfile_policy(
    kind: str, problem: Any, platform: Platform, serving: list[Candidate],
    objective: SelectionObjective = SelectionObjective.KERNEL,
) -> tuple[ProviderEntry, dict[str, str], str] | None:
    """The ``auto`` policy: the lockfile's choice for this problem's M bucket, or None (static priorities). A
    lockfile it cannot use is ignored with one WARNING; only a bad ``FP8_BACKENDS_TUNE`` value raises. Under the
    ``host`` objective the entry's measured candidates are re-ranked by host cost (:func:`host_rerank`); the
    recorded ``choice`` stays the kernel answer."""
    try:
        return _lockfile_policy(kind, problem, platform, serving, objective)
    except ConfigurationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a lockfile must never break auto
        path = lockfile_path()
        _warn_once(("failed", str(path), type(exc).__name__), "lockfile %s could not be used (%s: %s); ignoring it",
                   path, type(exc).__name__, exc)
        return None


def _lockfile_policy(
    kind: str, problem: Any, platform: Platform, serving: list[Candidate], objective: SelectionObjective
) -> tuple[ProviderEntry, dict[str, str], str] | None:
    if problem is None or not serving:
        return None
    m = problem_m(kind, problem)
    if m is None:
        logger.debug("lockfile not consulted for %s: M unknown (static priorities decide)", problem.describe())
        return None
    if platform.simulated:
        logger.debug("lockfile not consulted on simulated platform %s", platform.describe())
        return None
    path = lockfile_path()
    if path is None:
        return None
    loaded = _store.load(path)
    tune = tune_at_first_use() and not _tuning_now()
    memo = None
    if loaded.error is None and not tune:
        memo = (kind, problem, platform, tuple(id(c.entry) for c in serving), host_aware.memo_key(objective))
        answer = loaded.picks.get(memo, loaded)
        if answer is not loaded and (answer is None or any(c.entry is answer[0] for c in serving)):
            return answer  # the warm path: the same answer as last time, no work
    if loaded.error is not None and loaded.error != "missing":
        _warn_once(("corrupt", str(path), loaded.error),
                   "lockfile %s is %s; ignoring it (static priorities decide; the next tune rebuilds it)",
                   path, loaded.error)
    section = find_section(loaded, platform) if loaded.error is None else None
    answer = _answer(kind, problem, platform, serving, path, loaded, section, tune, m, objective)
    if memo is not None:
        if len(loaded.picks) >= _MAX_PICKS:
            loaded.picks.clear()
        loaded.picks[memo] = answer
    return answer


def _answer(kind, problem, platform, serving, path, loaded, section, tune, m, objective):
    hit = section.lookup(kind, problem) if section is not None else None
    if tune:
        wanted = bucket_for(m, DEFAULT_M_BUCKETS)
        if hit is None or hit[0] != wanted:  # tune the problem's own bucket, not a neighbour's
            hit = _tune_missing(kind, problem, platform, path, wanted) or hit
    if hit is None:
        why = (f"lockfile {path} {loaded.error}" if loaded.error else
               f"lockfile {path} has no section for this platform" if section is None else
               f"lockfile {path} does not cover this problem")
        logger.debug("%s for %s: static priorities decide", why, problem.describe())
        return None
    bucket, record = hit
    picked = pick_from_entry(kind, problem, platform, serving, record)
    if picked is None:
        loaded.unserved += 1
        text = "lockfile %s: no recorded choice for %s (bucket M=%d) can serve here; static priorities decide"
        if loaded.unserved == 1:
            logger.warning(text + " (logged once per file; later ones at DEBUG)", path, problem.describe(), bucket)
        else:
            logger.debug(text + " (%d problems so far)", path, problem.describe(), bucket, loaded.unserved)
        return None
    entry, options, rank = picked
    answer = entry, options, choice_note(f"{path}, bucket M={bucket}", rank, record, "tuned")
    if objective is SelectionObjective.HOST:
        answer = host_rerank(kind, problem, platform, serving, record, answer,
                             section.below(kind, problem, bucket) if section is not None else None)
    return answer


def choice_note(note: str, rank: int, record: Mapping[str, Any], chosen: str) -> str:
    """``note`` plus why a recorded entry's pick (:func:`pick_from_entry`'s ``rank``) won: a later-ranked candidate
    because the ``chosen`` ("tuned", "measured") one cannot serve here, or a near-tie broken by static priority."""
    if rank:
        note += f", ranked #{rank + 1} (the {chosen} choice cannot serve here)"
    elif record.get("tie_break"):
        margin = record.get("tie_margin")
        margin = DEFAULT_TIE_MARGIN if margin is None else float(margin)
        note += f", near-tie within {100 * margin:g}% -> static priority"
    return note


class LockfilePolicy(SelectionPolicy):
    """The tuned lockfile as ``auto``'s first rung: :func:`lockfile_policy` picks, and the buckets are those the
    lockfile's section for this platform holds for the weight (:func:`~.lockfile.covered_buckets`)."""

    name = POLICY_NAME
    rank = 100

    def pick(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate]):
        return lockfile_policy(kind, problem, platform, list(serving))

    def pick_for(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate],
                 objective: SelectionObjective):
        return lockfile_policy(kind, problem, platform, list(serving), objective)

    def buckets(self, kind: str, problem: Any, platform: Platform) -> list[int]:
        return covered_buckets(kind, problem, platform)


POLICY = register_selection_policy(LockfilePolicy())

__all__ = ["POLICY", "POLICY_NAME", "LockfilePolicy", "choice_note", "host_rerank", "lockfile_policy",
           "pick_from_entry", "servable_choice", "tune_at_first_use"]
