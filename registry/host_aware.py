"""The ``host`` selection objective's rule, shared by every policy that decides from measurements.

``auto``'s measuring policies (the tuned lockfile, the shipped data's exact entries, the nearest-shapes model) first
find the ``kernel`` answer, as they always have: the fastest kernel in CUDA-graph replay (with the tuner's
near-tie rule). Under :attr:`~fp8_backends.core.objective.SelectionObjective.HOST` they hand that answer and the
candidates they know, as :class:`Row` ``(key, kernel µs, host µs, static rank)``, to :func:`choose`:

- a call the host enqueues costs ``max(kernel µs, host µs + context)`` (``host µs``: the provider class's
  :attr:`~fp8_backends.core.backend.Fp8GemmBackend.host_us`; a candidate that declares none counts as the most
  expensive declared candidate of the decision: it never wins on host time alone; none declared: 0). ``context``
  (:data:`~fp8_backends.core.objective.HOST_CONTEXT_US`, ``FP8_SELECTION_HOST_CONTEXT_US``) is the host time of the
  model's other work around each linear: the GPU idles unless the kernels outlast all of the host's work, not only
  their own calls', so a 79 µs kernel behind a 40 µs call is not kernel-bound in a model whose host spends ~70 µs more
  per linear (a compiled 512-token step measured host-bound at 2083 µs of kernels against 6590 µs of host time);
- only candidates whose kernel µs is within :data:`HOST_MARGIN` (5%) of the fastest are considered, or within
  :data:`HOST_HIDDEN_MARGIN` (25%) when the kernel is hidden behind the host's work: at most :data:`HOST_HIDDEN`
  (half) of its host µs plus the context. So the host-aware choice runs a kernel more than 5% slower than the fastest
  only where the host, not the GPU, decides a call's time twice over (a 15 µs QKV kernel at M = 256 behind 13 µs of
  its own call and ~50 µs of the model's); beyond 25% only where the fastest kernel is itself hidden behind its own
  call, the candidate's kernel would be hidden there too, and the candidate's host saving is large (half the context
  or more) and at least its kernel loss, so a step that turns out GPU-bound loses no more than a host-bound one gains
  (cuBLASLt's block-scaled 15.6 µs QKV kernel behind ~75 µs of its opaque op against cutlass's 22.1 µs behind ~13);
  inside a CUDA graph the ``auto`` objective runs the kernel answer;
- among those, the lowest cost wins, ties by kernel µs then static rank;
- the kernel answer (``incumbent``) stays when its own call is kernel-bound (its host µs plus the context at most its
  kernel µs: host time hides behind the kernel, so a change could only be a kernel-time change, which the kernel
  answer's near-tie rule already settled), unless a candidate within :data:`HOST_TIE` (1%) of its kernel time
  costs less host time (kernel times that close are one time, and the bucket's smaller M are host-bound sooner),
  and when no candidate costs strictly less;
- a bucket serves a range of M and is measured at its top: a kernel answer kept there as kernel-bound is checked at
  the range's bottom too (the bucket below's measurement) where the caller knows it; host-bound there, the candidate
  within :data:`HOST_MARGIN` of the fastest at the top, with a call at least half the context cheaper, and with the
  lowest summed cost at the two ends wins (:func:`span_choice`).

:func:`rows_from_record` turns a measured lockfile or shipped entry into rows, and :func:`note` explains a change
("host-aware: triton 18.1 µs kernel + ~5 µs host over torch_scaled_mm 17.5 µs + ~20 µs host"). Pure Python; no
provider is named here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from fp8_backends.core import settings
from fp8_backends.core.objective import (
    HOST_CONTEXT_US,
    HOST_HIDDEN,
    HOST_HIDDEN_MARGIN,
    HOST_MARGIN,
    HOST_TIE,
    SelectionObjective,
)

if TYPE_CHECKING:
    from .candidates import Candidate
    from .discovery import ProviderEntry

logger = logging.getLogger("fp8_backends")


class Row(NamedTuple):
    """One candidate of a decision: ``key`` (any hashable identity), its measured or predicted kernel µs, its
    provider's host µs per call (None: undeclared), and its static rank (lower first: priority, options)."""

    key: Hashable
    kernel_us: float
    host_us: float | None
    rank: tuple = ()
    label: str = ""


def _valid_us(cls: Any, value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        logger.debug("provider %s declares %s=%r, not a finite number >= 0: treated as undeclared",
                     getattr(cls, "name", cls), what, value)
        return None
    return float(value)


def host_us_of(cls: Any, m: int | None = None, n: int | None = None, k: int | None = None,
               options: Mapping[str, str] | None = None, *, block: bool = False) -> float | None:
    """A provider class's host µs per call.

    - A block-scaled problem (``block``): at an M where the class's call quantizes the activation itself,
      :meth:`~fp8_backends.core.backend.Fp8GemmBackend.block_fused_host_us_for`'s answer; else its declared
      :attr:`~fp8_backends.core.backend.Fp8GemmBackend.block_host_us` where it has one.
    - Otherwise at ``M x N x K`` with ``options``: its :meth:`~fp8_backends.core.backend.Fp8GemmBackend.host_us_for`
      where the problem is given and the class has one, else its declared
      :attr:`~fp8_backends.core.backend.Fp8GemmBackend.host_us`.

    None when it declares none or something that is not a finite number >= 0 (reported at DEBUG). A hook that raises
    or answers such a value counts as undeclared (``host_us_for``: as ``host_us``)."""
    if block:
        fused_hook = getattr(cls, "block_fused_host_us_for", None)
        if fused_hook is not None and m is not None:
            try:
                fused = _valid_us(cls, fused_hook(m, dict(options or {})), f"block_fused_host_us_for({m})")
            except Exception as exc:  # a plugin's hook must not break resolution
                logger.debug("provider %s: block_fused_host_us_for(%s) raised %s: %s", getattr(cls, "name", cls), m,
                             type(exc).__name__, exc)
                fused = None
            if fused is not None:
                return fused
        per_block = _valid_us(cls, getattr(cls, "block_host_us", None), "block_host_us")
        if per_block is not None:
            return per_block
    declared = _valid_us(cls, getattr(cls, "host_us", None), "host_us")
    per_problem = getattr(cls, "host_us_for", None)
    if per_problem is None or m is None or n is None or k is None:
        return declared
    try:
        value = per_problem(m, n, k, dict(options or {}))
    except Exception as exc:  # a plugin's hook must not break resolution
        logger.debug("provider %s: host_us_for(%s, %s, %s) raised %s: %s; using host_us", getattr(cls, "name", cls),
                     m, n, k, type(exc).__name__, exc)
        return declared
    if value is None:
        return declared
    checked = _valid_us(cls, value, f"host_us_for({m}, {n}, {k})")
    return declared if checked is None else checked


def effective_host(rows: Sequence[Row]) -> dict[Hashable, float]:
    """Each row's host µs, an undeclared one replaced by the largest declared in ``rows`` (0.0 when none is)."""
    declared = [r.host_us for r in rows if r.host_us is not None]
    worst = max(declared) if declared else 0.0
    return {r.key: worst if r.host_us is None else r.host_us for r in rows}


def cost(row: Row, host: float, context: float = 0.0) -> float:
    """What a call the host enqueues costs: ``max(kernel µs, host µs + context µs)``."""
    return max(row.kernel_us, host + context)


def hidden(row: Row, host: float, context: float) -> bool:
    """Whether ``row``'s kernel hides behind the host's work: at most :data:`HOST_HIDDEN` of ``host + context`` µs."""
    return row.kernel_us <= HOST_HIDDEN * (host + context)


def choose(rows: Sequence[Row], objective: SelectionObjective | str = SelectionObjective.HOST, *,
           incumbent: Hashable | None = None, margin: float = HOST_MARGIN, context: float | None = None,
           lower: Sequence[Row] | None = None) -> Row | None:
    """The winner of ``rows`` under ``objective`` (module docstring); None for no rows. ``context``: the host µs of
    other work around each call (None: :func:`fp8_backends.core.settings.host_context_us`, read now).

    - ``kernel`` (or ``auto``, which is kernel for one decision): the incumbent when given and among the rows, else
      the fastest kernel (ties by static rank);
    - ``host``: among rows within ``margin`` of the fastest kernel, or within :data:`HOST_HIDDEN_MARGIN` and hidden
      (:func:`hidden`), or (where the fastest kernel is itself hidden behind its call) hidden behind the fastest's call
      too with a host saving of at least half the context and at least their kernel loss, the lowest
      ``max(kernel µs, host µs + context)``, ties by kernel µs then static rank; the incumbent (the kernel answer)
      stays when its call is kernel-bound (unless a candidate within :data:`HOST_TIE` of its kernel µs has a cheaper
      call: that one wins) or nothing costs strictly less.

    ``lower``: the same candidates measured at the bottom of the M range the decision serves (the bucket below's
    measurement; None: unknown). A kernel answer kept because its call is kernel-bound at the top is kernel-bound over
    the whole range only if it is at the bottom too; where it is host-bound there, :func:`span_choice` decides."""
    rows = [r for r in rows if r.kernel_us > 0 and math.isfinite(r.kernel_us)]
    if not rows:
        return None
    objective = SelectionObjective.of(objective).for_resolution()
    current = next((r for r in rows if incumbent is not None and r.key == incumbent), None)
    if objective is SelectionObjective.KERNEL:
        return current or min(rows, key=lambda r: (r.kernel_us, r.rank))
    if context is None:
        context = settings.host_context_us()
    host = effective_host(rows)
    fastest = min(r.kernel_us for r in rows)
    if current is not None and host[current.key] + context <= current.kernel_us:
        # kernel-bound: host time hides behind the kernel; a tie on kernel time goes to the cheaper call
        tie = min(current.kernel_us * (1.0 + HOST_TIE), fastest * (1.0 + margin))
        tied = [r for r in rows if r.kernel_us <= tie and host[r.key] < host[current.key]]
        if tied:
            return min(tied, key=lambda r: (host[r.key], r.kernel_us, r.rank))
        return span_choice(rows, lower or (), current, context, fastest * (1.0 + margin)) or current
    # beyond the hidden margin: the fastest kernel hides behind its own call's host work (budget), r's would too, and
    # r's host saving is half the context or more and at least its kernel loss (what a GPU-bound step would lose)
    quickest = min(rows, key=lambda r: (r.kernel_us, r.rank))
    budget = HOST_HIDDEN * (host[quickest.key] + context)

    def pays(r: Row) -> bool:
        return (quickest.kernel_us <= budget and r.kernel_us <= budget
                and host[quickest.key] - host[r.key] >= max(r.kernel_us - quickest.kernel_us, HOST_HIDDEN * context))

    eligible = [r for r in rows if r.kernel_us <= fastest * (1.0 + margin)
                or (r.kernel_us <= fastest * (1.0 + HOST_HIDDEN_MARGIN) and hidden(r, host[r.key], context))
                or pays(r)]
    best = min(eligible, key=lambda r: (cost(r, host[r.key], context), r.kernel_us, r.rank))
    if current is not None and cost(best, host[best.key], context) >= cost(current, host[current.key], context):
        return current
    return best


def span_choice(top: Sequence[Row], bottom: Sequence[Row], current: Row, context: float, limit: float) -> Row | None:
    """A bucket decided at both ends of the M range it serves, for a kernel answer ``current`` whose call is
    kernel-bound at the top (``top``: the bucket's own measurement) but host-bound at the bottom (``bottom``: the
    same candidates measured at the bucket below's M, their host µs at that M): among the candidates measured at both
    ends with a kernel at most ``limit`` µs at the top (the fastest plus :data:`HOST_MARGIN`: what a kernel-bound call
    may lose) and a call at least half the context (:data:`HOST_HIDDEN`) cheaper than ``current``'s at the bottom (a
    saving the context's estimate cannot swallow), the one whose summed cost at the two ends (:func:`cost`) is the
    lowest, if below ``current``'s; else None.

    A bucket's calls span its range, and the smaller ones are host-bound long before the top is: H200, Qwen3-8B's
    fused gate/up (24576 x 4096) in block-wise FP8, M <= 1024: ``torch._scaled_mm`` 166.0 µs against cutlass's 172.3
    at M = 1024 (kernel-bound), 47.1 against 59.0 µs at M = 256 behind ~75 µs of its opaque op's host time against
    cutlass's ~10 (``bench/results/tune/2026-12-03-h200-block-grid/``): summed, cutlass costs 232 µs to 291."""
    low = {r.key: r for r in bottom}
    if current.key not in low:
        return None
    low_host = effective_host(list(low.values()))
    if low_host[current.key] + context <= low[current.key].kernel_us:
        return None  # kernel-bound at both ends
    top_host = effective_host(top)

    def summed(r: Row) -> float:
        return cost(r, top_host[r.key], context) + cost(low[r.key], low_host[r.key], context)

    saving = HOST_HIDDEN * context  # what a call must save to count (the context is an estimate; half of it)
    eligible = [r for r in top if r.key in low and r.kernel_us <= limit
                and low_host[current.key] - low_host[r.key] >= saving]
    if not eligible:
        return None
    best = min(eligible, key=lambda r: (summed(r), r.kernel_us, r.rank))
    return best if summed(best) < summed(current) else None


def memo_key(objective: SelectionObjective) -> Hashable:
    """What a memoized answer under ``objective`` depends on besides the problem: the objective, and under ``host``
    the context µs read now (``FP8_SELECTION_HOST_CONTEXT_US`` may change between resolutions)."""
    return (objective, settings.host_context_us()) if objective is SelectionObjective.HOST else objective


def describe(row: Row, host: float, predicted: bool = False) -> str:
    """``"triton 18.1 µs kernel + ~5 µs host"``."""
    tilde = "~" if predicted else ""
    return f"{row.label or row.key} {tilde}{row.kernel_us:.1f} µs kernel + ~{host:g} µs host"


def note(winner: Row, over: Row, rows: Sequence[Row], predicted: bool = False) -> str:
    """Why the host objective changed the kernel answer ``over`` to ``winner``: ``"host-aware: triton 18.1 µs
    kernel + ~5 µs host over torch_scaled_mm 17.5 µs + ~20 µs host"`` (``~`` on predicted kernel times)."""
    host = effective_host(rows)
    tilde = "~" if predicted else ""
    return (f"host-aware: {describe(winner, host[winner.key], predicted)} over {over.label or over.key} "
            f"{tilde}{over.kernel_us:.1f} µs + ~{host[over.key]:g} µs host")


def option_rank(cls: Any, options: Mapping[str, str]) -> tuple[int, ...]:
    """Options in their declared order (the first value of each option ranks first; unknown values last)."""
    declared = getattr(cls, "options", {}) or {}
    return tuple(declared[k].index(v) if v in declared.get(k, ()) else 99 for k, v in sorted(options.items()))


def static_rank(serving: Sequence[Candidate], entry: ProviderEntry, options: Mapping[str, str]) -> tuple:
    """``entry``'s place among the serving candidates (static priority order), then its options' order."""
    index = next((i for i, c in enumerate(serving) if c.entry is entry), len(serving))
    return (index, option_rank(entry.cls, options))


#: ``(choice record) -> (entry, options) | None``: a measured candidate that can serve here, with its options
Servable = Callable[[Mapping[str, Any]], "tuple[ProviderEntry, dict[str, str]] | None"]


def rows_from_record(record: Mapping[str, Any], servable: Servable, serving: Sequence[Candidate]
                     ) -> tuple[list[Row], dict[Hashable, tuple[ProviderEntry, dict[str, str]]]]:
    """The rows of a measured entry (its ``ranking``: every candidate with a measured ``us``) that can serve here,
    keyed by ``(provider entry id, sorted options)``, and what each key stands for. A candidate measured twice
    keeps its fastest time. Host µs: :func:`host_us_of` at the entry's ``m`` (its bucket) and ``problem`` N x K
    (block-scaled where its ``weight_scale`` is ``block``)."""
    rows: dict[Hashable, Row] = {}
    found: dict[Hashable, tuple[ProviderEntry, dict[str, str]]] = {}
    problem = record.get("problem") if isinstance(record.get("problem"), Mapping) else {}
    m = record.get("m") if isinstance(record.get("m"), int) else None
    for rec in record.get("ranking") or ():
        us = rec.get("us") if isinstance(rec, Mapping) else None
        if isinstance(us, bool) or not isinstance(us, (int, float)) or not us > 0:
            continue
        picked = servable(rec)
        if picked is None:
            continue
        entry, options = picked
        key = row_key(entry, options)
        if key in rows and rows[key].kernel_us <= us:
            continue
        host = host_us_of(entry.cls, m, problem.get("n"), problem.get("k"), options,
                          block=problem.get("weight_scale") == "block")
        rows[key] = Row(key, float(us), host, static_rank(serving, entry, options), entry.name)
        found[key] = (entry, options)
    return list(rows.values()), found


def row_key(entry: ProviderEntry, options: Mapping[str, str]) -> tuple:
    """The identity of a serving candidate with options."""
    return (id(entry), tuple(sorted((str(k), str(v)) for k, v in options.items())))


def rerank_record(record: Mapping[str, Any], servable: Servable, serving: Sequence[Candidate],
                  kernel_pick: tuple[ProviderEntry, Mapping[str, str]], lower: Mapping[str, Any] | None = None
                  ) -> tuple[ProviderEntry, dict[str, str], str] | None:
    """The host objective on a measured entry whose kernel answer is ``kernel_pick``: ``(entry, options, note)``
    of the candidate that replaces it, or None when the kernel answer stays (or it was not measured). ``lower``: the
    entry of the bucket below (the bottom of the M range this entry's bucket serves; :func:`span_choice`)."""
    rows, found = rows_from_record(record, servable, serving)
    incumbent = row_key(*kernel_pick)
    current = next((r for r in rows if r.key == incumbent), None)
    if current is None:
        return None
    bottom = rows_from_record(lower, servable, serving)[0] if lower is not None else None
    won = choose(rows, SelectionObjective.HOST, incumbent=incumbent, lower=bottom)
    if won is None or won.key == incumbent:
        return None
    entry, options = found[won.key]
    why = note(won, current, rows)
    if bottom and effective_host(rows)[incumbent] + settings.host_context_us() <= current.kernel_us:
        low = {r.key: r for r in bottom}
        if won.key in low and incumbent in low:
            why += (f"; at M={lower.get('m')}: {low[won.key].kernel_us:.1f} µs against "
                    f"{low[incumbent].kernel_us:.1f} µs + ~{effective_host(bottom)[incumbent]:g} µs host")
    return entry, dict(options), why


__all__ = [
    "HOST_CONTEXT_US",
    "HOST_HIDDEN",
    "HOST_HIDDEN_MARGIN",
    "HOST_MARGIN",
    "HOST_TIE",
    "Row",
    "choose",
    "cost",
    "describe",
    "effective_host",
    "hidden",
    "host_us_of",
    "memo_key",
    "note",
    "option_rank",
    "rerank_record",
    "row_key",
    "rows_from_record",
    "span_choice",
    "static_rank",
]
