"""The contract of ``auto``'s selection policies, and their ranked register.

A selection policy is an object (:class:`SelectionPolicy`) with a ``name``, a ``rank`` and two answers:

- :meth:`~SelectionPolicy.pick`: which provider (and options) should serve this problem, from the candidates that
  can serve it, or ``None`` to let the next policy decide;
- :meth:`~SelectionPolicy.pick_for`: the same under a selection objective (``kernel``: fastest kernel in CUDA
  graphs; ``host``: the cost of a host-enqueued call; :mod:`fp8_backends.core.objective`); by default :meth:`pick`;
- :meth:`~SelectionPolicy.buckets`: which M buckets it distinguishes for a weight (its ``m`` ignored), so that a
  layer (:mod:`.per_m`) prepares one provider per bucket; ``[]`` when its answer does not depend on M.

``auto`` asks the registered policies by descending rank (:func:`ordered`), then falls back to static priority:
the built-ins are the tuned lockfile (rank 100, :mod:`.lockfile_policy`), the shipped selection data (exact -10,
nearest -20, :mod:`.shipped`) and the measured defaults (-100, :mod:`.defaults`). They live in their own modules,
which import this one and :mod:`.candidates`; this module never imports them: resolution loads them on its first
``auto`` (:func:`~.resolution.load_builtin_policies`). A bare callable registered with
:func:`register_selection_policy` (the API before policies were objects) is wrapped in a :class:`CallablePolicy`,
which distinguishes no buckets.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from fp8_backends.core.errors import InvalidInputError, InvalidTypeError

if TYPE_CHECKING:
    from fp8_backends.core.objective import SelectionObjective

    from .candidates import Candidate
    from .discovery import ProviderEntry
    from .platform import Platform

logger = logging.getLogger("fp8_backends")


class PolicyPick(NamedTuple):
    """A policy's answer: the provider entry (one of the serving candidates'), its options and a note for the
    log and the listing (where the choice came from). A plain ``(entry, options, note)`` tuple is accepted too."""

    entry: ProviderEntry
    options: dict[str, str]
    note: str


class SelectionPolicy(ABC):
    """One rung of ``auto``'s ladder. Subclasses set :attr:`name` and :attr:`rank` (class attributes or in
    ``__init__``) and implement :meth:`pick`; :meth:`buckets` defaults to "no buckets"."""

    #: the source ``auto`` reports when this policy decides (``Resolution.source``, the listing, the INFO line)
    name: str = ""
    #: asking order: higher first; among equal ranks the later registration first
    rank: int = 0

    @abstractmethod
    def pick(self, kind: str, problem: Any, platform: Platform,
             serving: Sequence[Candidate]) -> PolicyPick | tuple[ProviderEntry, dict[str, str], str] | None:
        """The choice for ``problem`` (of ``kind``, on ``platform``) among ``serving`` (the candidates that can
        serve it under ``auto``, in static-priority order), or None. A pick outside ``serving`` is ignored with a
        WARNING; raising :class:`~fp8_backends.core.errors.ConfigurationError` reaches the caller (a bad variable is the
        user's to fix), any other exception skips this policy with a WARNING."""

    def pick_for(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate],
                 objective: SelectionObjective) -> PolicyPick | tuple[ProviderEntry, dict[str, str], str] | None:
        """:meth:`pick` under a selection objective (``kernel`` or ``host``: :mod:`fp8_backends.core.objective`),
        which is what ``auto`` calls. The default ignores the objective and answers :meth:`pick`: a policy that does
        not decide from measured kernel times decides the same under both. The built-in measuring policies (the
        lockfile, the shipped data) override it and re-rank their candidates by host cost under ``host``
        (:mod:`.host_aware`)."""
        return self.pick(kind, problem, platform, serving)

    def buckets(self, kind: str, problem: Any, platform: Platform) -> list[int]:
        """The M buckets this policy distinguishes for ``problem`` (its ``m`` ignored), ascending: a batch of ``M``
        rows belongs to the first bucket ``>= M`` (the largest beyond them). ``[]``: none (the default)."""
        return []

    def __call__(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate]) -> Any:
        """A policy object is still callable as the bare callables were: :meth:`pick`."""
        return self.pick(kind, problem, platform, serving)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, rank={self.rank})"


#: the bare-callable form of a policy: ``(kind, problem, platform, serving) -> (entry, options, note) | None``
PolicyCallable = Callable[[str, Any, Any, list[Any]], Any]


class CallablePolicy(SelectionPolicy):
    """A bare callable registered as a policy: its answers are :meth:`pick`'s, and it distinguishes no buckets."""

    def __init__(self, name: str, fn: PolicyCallable, rank: int = 0) -> None:
        self.name, self.fn, self.rank = name, fn, rank

    def pick(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate]) -> Any:
        return self.fn(kind, problem, platform, serving)


_registered: list[SelectionPolicy] = []  # in asking order
_lock = threading.Lock()


def register_selection_policy(
    name: str | SelectionPolicy, policy: SelectionPolicy | PolicyCallable | None = None, rank: int | None = None
) -> SelectionPolicy:
    """Add (or replace, by name) an ``auto`` policy and return it.

    - ``register_selection_policy(policy_object)``: a :class:`SelectionPolicy` with its own ``name`` and ``rank``;
    - ``register_selection_policy(name, callable, rank=0)``: a bare callable, wrapped in a :class:`CallablePolicy`.

    Policies are asked by descending rank, and among equal ranks the later registration first, whatever order
    their modules were imported in. The built-ins: the tuned lockfile (rank 100: the user's own measurements, on
    their GPU and shapes), the shipped selection data (ranks -10 and -20: the library's measurements per GPU
    family, exact then nearest shapes) and the measured defaults (rank -100: for GPUs without shipped data). When
    none decides, the source is ``"priority"``."""
    if isinstance(name, SelectionPolicy):
        if policy is not None or rank is not None:
            raise InvalidInputError("register_selection_policy(policy) takes the policy's own name and rank; pass "
                                    "nothing else")
        obj = name
    elif isinstance(policy, SelectionPolicy):
        if policy.name != name or (rank is not None and rank != policy.rank):
            raise InvalidInputError(f"policy object {policy!r} registered as {name!r} (rank {rank}): a policy "
                                    "object carries its own name and rank; register it alone")
        obj = policy
    elif isinstance(name, str) and callable(policy):
        obj = CallablePolicy(name, policy, 0 if rank is None else rank)
    else:
        raise InvalidTypeError("register_selection_policy takes a SelectionPolicy, or a name and a callable "
                               f"(kind, problem, platform, serving) -> (entry, options, note) | None; got "
                               f"{type(name).__name__} and {type(policy).__name__}")
    if not isinstance(obj.name, str) or not obj.name:
        raise InvalidInputError(f"a selection policy needs a non-empty name, got {obj.name!r}")
    with _lock:
        _registered[:] = [p for p in _registered if p.name != obj.name]
        at = next((i for i, p in enumerate(_registered) if p.rank <= obj.rank), len(_registered))
        _registered.insert(at, obj)
    return obj


def unregister_selection_policy(name: str) -> SelectionPolicy | None:
    """Remove the policy registered as ``name`` and return it (None when there is none)."""
    with _lock:
        found = next((p for p in _registered if p.name == name), None)
        if found is not None:
            _registered.remove(found)
    return found


def ordered() -> tuple[SelectionPolicy, ...]:
    """The registered policies in asking order (a snapshot: registering while iterating is safe)."""
    return tuple(_registered)


__all__ = [
    "CallablePolicy",
    "PolicyCallable",
    "PolicyPick",
    "SelectionPolicy",
    "ordered",
    "register_selection_policy",
    "unregister_selection_policy",
]
