"""The shipped selection data policy: ``auto`` on a GPU family the library has measured, without a user lockfile.

Per GPU family (SM), the package ships the tuner's measurements of the dense linear shapes of common open
models (:mod:`fp8_backends.tuning.grid`, format in :mod:`.shipped_data`). For a GEMM problem with a known M:

1. ``shipped-exact``: the data holds this problem (N, K, dtypes, scale modes, bias) -> the tuned choice for its
   M bucket (smallest covered bucket >= M, clamped to the largest); if that provider cannot serve here (not
   installed, disabled), the next of the measured ranking that can. A choice whose first call would build for
   minutes (flashinfer's block module before ``python -m fp8_backends.build flashinfer_block``) is passed over for
   the measured choice among the others, and the note says what to build.
2. ``shipped-nearest``: the data holds the problem's class (dtypes, scale modes, bias) but not its (N, K) ->
   the nearest measured shapes of this GPU family at this bucket vote (:mod:`.nearest`); the note names them.
3. Otherwise (no data for this SM, class or kind; M unknown) the policies pass and the next one decides: the
   measured defaults (:mod:`.defaults`, which apply only to GPUs without shipped data), then static priority.

A user's tuned lockfile (rank 100) is asked before both (ranks -10 and -20); policies registered with the default
rank 0 come in between. The data is found by file name (``sm90-<gpu>.json``: a GPU no file names costs one
directory listing per process) and parsed on the first problem that needs it, then cached; answers are memoized
per problem. ``FP8_BACKENDS_SHIPPED=off`` turns the data off; ``FP8_BACKENDS_SHIPPED=<file or folder>`` uses
other data (e.g. a held-out subset for evaluation). A file that fails its checks is reported once (WARNING) and
ignored. Unlike the lockfile, shipped data also applies to simulated platforms (``--simulate-sm 9.0`` shows what
an H100-class GPU would run).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_backends.core import settings
from fp8_backends.core.errors import DataFileError
from fp8_backends.core.objective import SelectionObjective
from fp8_backends.core.padding import padded_size

from . import host_aware, lockfile, lockfile_policy, shipped_data
from .candidates import Candidate, pending_build
from .nearest import (
    DEFAULT_METRIC,
    DEFAULT_NEIGHBOURS,
    TIE_MARGIN,
    CandKey,
    Metric,
    NearestModel,
    build_model,
    cand_label,
    choose,
    class_key,
    entries_by_class,
    host_rows,
)
from .once import WarnOnce
from .platform import Platform
from .policy import SelectionPolicy, register_selection_policy

logger = logging.getLogger("fp8_backends")

POLICY_EXACT = "shipped-exact"
POLICY_NEAREST = "shipped-nearest"
RANK_EXACT = -10
RANK_NEAREST = -20
_OFF = {"off", "none", "0", "false", "no"}
_MAX_PICKS = 1 << 16


@functools.lru_cache(maxsize=1)
def packaged_dir() -> Path:
    """``fp8_backends/data/selection`` inside the installed package."""
    from importlib import resources

    return Path(str(resources.files("fp8_backends").joinpath("data", "selection")))


def _sm_text(platform: Platform) -> str | None:
    return None if platform.sm is None else f"{platform.sm[0]}.{platform.sm[1]}"


# ---------------------------------------------------------------------------------------- finding files
_listing_cache: dict[tuple[str, int], list[str]] = {}
_located: dict[tuple, tuple[Path | None, str]] = {}


def _list_dir(folder: Path) -> list[str]:
    try:
        stamp = folder.stat().st_mtime_ns
    except OSError:
        return []
    key = (str(folder), stamp)
    names = _listing_cache.get(key)
    if names is None:
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            names = []
        _listing_cache[key] = names
    return names


def locate(platform: Platform) -> tuple[Path | None, str]:
    """``(file, "")`` for the data that may apply to ``platform`` (not yet parsed), or ``(None, why not)``.

    In a folder, the file for the platform's SM whose GPU slug equals the platform's name wins, else the first
    by name. A file named by ``FP8_BACKENDS_SHIPPED`` is returned as is (its SM is checked when it loads). The
    answer is cached per (variable, SM, GPU name): files are not expected to appear while a process runs."""
    key = (settings.env_token(settings.SHIPPED_ENV), platform.sm, platform.name)
    hit = _located.get(key)
    if hit is None:
        hit = _locate(platform)
        if hit[0] is not None or "no such file" not in hit[1]:
            _located[key] = hit
    return hit


def _locate(platform: Platform) -> tuple[Path | None, str]:
    sm = _sm_text(platform)
    if sm is None:
        return None, "no SM (CPU platform)"
    raw = os.environ.get(settings.SHIPPED_ENV, "").strip()
    if raw.lower() in _OFF:
        return None, f"{settings.SHIPPED_ENV}={raw}"
    folder = packaged_dir()
    if raw:
        path = Path(raw).expanduser()
        if path.is_file():
            return path, ""
        if not path.is_dir():
            return None, f"{settings.SHIPPED_ENV}={raw}: no such file or folder"
        folder = path
    tag = shipped_data.sm_tag(platform.sm)  # type: ignore[arg-type]
    matches = []
    for name in _list_dir(folder):
        parsed = shipped_data.parse_file_name(name)
        if parsed is not None and parsed[0] == tag:
            matches.append((parsed[1] != shipped_data.slug(platform.name), name))
    if not matches:
        return None, f"no shipped selection data for SM {sm} in {folder}"
    return folder / min(matches)[1], ""


# ---------------------------------------------------------------------------------------- loaded data
@dataclass
class ShippedData:
    """One parsed, checked data file, indexed for exact lookups; nearest models are built per class on demand."""

    path: Path
    provenance: dict[str, Any]
    index: lockfile.SectionIndex
    models: dict[tuple, NearestModel | None] = field(default_factory=dict)
    classes: dict[tuple, dict[str, Any]] | None = None
    picks: dict[tuple, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_document(cls, path: Path, doc: Mapping[str, Any]) -> ShippedData:
        """``doc``: a document :func:`.shipped_data.check_document` passed (:func:`.shipped_data.load_file`)."""
        section = lockfile.SectionIndex.build(shipped_data.the_section(doc), checked=True)
        return cls(Path(path), dict(doc["provenance"]), section)

    @property
    def sm(self) -> str:
        return str(self.provenance["sm"])

    @property
    def label(self) -> str:
        """``sm90-nvidia-h200.json (NVIDIA H200, 2026-12-01)``."""
        return f"{self.path.name} ({self.provenance['gpu']}, {str(self.provenance['date'])[:10]})"

    def model_for(self, fields: Mapping[str, Any]) -> NearestModel | None:
        """The nearest-shapes model of ``fields``' problem class, built at its first use (only the classes a process
        asks about: a model load resolves one or two)."""
        ck = class_key(fields)
        with self.lock:
            if self.classes is None:
                self.classes = entries_by_class(self.index.entries)
            if ck not in self.models:
                group = self.classes.get(ck)
                k = shipped_data.neighbours(self.provenance, DEFAULT_NEIGHBOURS)
                metric = Metric(sms=shipped_data.sms(self.provenance, DEFAULT_METRIC.sms))
                self.models[ck] = build_model(group, neighbours=k, metric=metric) if group else None
            return self.models[ck]


_loaded: dict[str, tuple[tuple[int, int], ShippedData | None]] = {}
_state_lock = threading.Lock()
_warnings = WarnOnce(logger)
_warn_once = _warnings.warning


def load(path: Path) -> ShippedData | None:
    """The parsed file (cached until it changes on disk), or None (with one WARNING) when it fails its checks."""
    try:
        st = path.stat()
        sig = (st.st_mtime_ns, st.st_size)
    except OSError:
        return None
    hit = _loaded.get(str(path))
    if hit is not None and hit[0] == sig:
        return hit[1]
    try:
        data: ShippedData | None = ShippedData.from_document(path, shipped_data.load_file(path))
    except DataFileError as exc:
        _warn_once(("bad", str(path), sig), "shipped selection data %s is unusable and ignored (%d problem(s): %s)",
                   path, len(exc.problems), "; ".join(exc.problems[:3]))
        data = None
    with _state_lock:
        _loaded[str(path)] = (sig, data)
    return data


def data_for(platform: Platform) -> ShippedData | None:
    """The shipped data that applies to ``platform`` (its SM), loading it on first use; None when there is none."""
    path, why = locate(platform)
    if path is None:
        if why.startswith(settings.SHIPPED_ENV) and "no such file" in why:  # a typo there would disable it silently
            _warn_once(("missing", why), "%s; the shipped selection data is not used", why)
        return None
    data = load(path)
    if data is not None and data.sm != _sm_text(platform):
        _warn_once(("other-sm", str(path), data.sm, _sm_text(platform)),
                   "shipped selection data %s is for SM %s, not SM %s; ignored", path, data.sm, _sm_text(platform))
        return None
    return data


def covers(platform: Platform) -> bool:
    """Whether shipped data exists for ``platform``'s SM (by file name; a file named by the environment is loaded
    to read its SM). The measured defaults step aside on such GPUs for the classes the data holds."""
    path, _ = locate(platform)
    if path is None:
        return False
    raw = os.environ.get(settings.SHIPPED_ENV, "").strip()
    if raw and Path(raw).expanduser().is_file():
        return data_for(platform) is not None
    return True


def reset_state() -> None:
    """Forget loaded files, directory listings and warnings (tests)."""
    with _state_lock:
        _loaded.clear()
    _warnings.clear()
    _listing_cache.clear()
    _located.clear()


# ---------------------------------------------------------------------------------------- the policies
def lookup_problem(problem: Any) -> Any:
    """The problem the shipped data is asked about: ``problem`` itself, or where its N or K is not a multiple of 16 the
    padded problem (:func:`fp8_backends.core.padding.padded_size`: 3420 -> 3456, 6840 -> 6912). The providers that
    serve such sizes pad the weight and run the aligned neighbour's GEMM (``torch_scaled_mm``) or mask the same tiles
    (``triton``): the measurements of the padded shape are theirs, whereas the nearest measured shapes of an unaligned
    size (the data holds none) are far away in the model's alignment feature. Only the lookup changes: the candidates
    are still those that serve ``problem`` itself."""
    n, k = getattr(problem, "n", None), getattr(problem, "k", None)
    if not isinstance(n, int) or not isinstance(k, int):
        return problem
    padded = padded_size(n), padded_size(k)  # a 16-aligned size is its own padded size
    return problem if padded == (n, k) else dataclasses.replace(problem, n=padded[0], k=padded[1])


def _padded_note(problem: Any) -> str:
    """``", looked up as 3456x6912 (padded)"`` where :func:`lookup_problem` padded the shape, else ``""``."""
    lookup = lookup_problem(problem)
    return "" if lookup is problem else f", looked up as {lookup.n}x{lookup.k} (padded)"


def _answer(kind: str, problem: Any, platform: Platform, serving: list[Candidate],
            objective: SelectionObjective = SelectionObjective.KERNEL) -> tuple | None:
    """``(policy name, (entry, options, note))`` or None; computed once per problem, serving set and objective
    (under ``host`` the measured or predicted candidates are re-ranked by host cost, :mod:`.host_aware`)."""
    if kind != "gemm" or problem is None or not serving or getattr(problem, "m", None) is None:
        return None
    data = data_for(platform)
    if data is None:
        return None
    memo = (problem, platform, tuple(id(c.entry) for c in serving), host_aware.memo_key(objective))
    answer = data.picks.get(memo, data)
    if answer is not data and (answer is None or any(c.entry is answer[1][0] for c in serving)):
        return answer
    answer = _measured(kind, problem, platform, serving, data, objective)
    passed: list[str] = []
    while answer is not None:  # a choice whose first call would build for minutes: the measured choice of the rest
        chosen = answer[1][0]
        pending = pending_build(next(c for c in serving if c.entry is chosen), problem, platform)
        if not pending:
            break
        passed.append(f"{chosen.name} (measured faster) passed over: {pending}")
        serving = [c for c in serving if c.entry is not chosen]
        answer = _measured(kind, problem, platform, serving, data, objective) if serving else None
    if answer is not None and passed:
        name, (entry, options, note) = answer
        answer = name, (entry, options, "; ".join([note, *passed]))
    if len(data.picks) >= _MAX_PICKS:
        data.picks.clear()
    data.picks[memo] = answer
    return answer


def _measured(kind: str, problem: Any, platform: Platform, serving: list[Candidate], data: ShippedData,
              objective: SelectionObjective) -> tuple | None:
    """The exact entry's answer, else the nearest shapes'."""
    return (_exact(kind, problem, platform, serving, data, objective)
            or _nearest(kind, problem, platform, serving, data, objective))


def _exact(kind, problem, platform, serving, data: ShippedData, objective=SelectionObjective.KERNEL) -> tuple | None:
    hit = data.index.lookup(kind, lookup_problem(problem))
    if hit is None:
        return None
    bucket, record = hit
    picked = lockfile_policy.pick_from_entry(kind, problem, platform, serving, record)
    if picked is None:
        logger.debug("shipped data %s: no measured choice for %s (bucket M=%d) can serve here", data.path,
                     problem.describe(), bucket)
        return None
    entry, options, rank = picked
    answer = entry, options, lockfile_policy.choice_note(f"{data.label}, bucket M={bucket}{_padded_note(problem)}",
                                                         rank, record, "measured")
    if objective is SelectionObjective.HOST:
        answer = lockfile_policy.host_rerank(kind, problem, platform, serving, record, answer,
                                             data.index.below(kind, lookup_problem(problem), bucket))
    return POLICY_EXACT, answer


def _nearest(kind, problem, platform, serving, data: ShippedData, objective=SelectionObjective.KERNEL
             ) -> tuple | None:
    lookup = lookup_problem(problem)
    fields = lockfile.problem_fields(kind, lookup)
    model = data.model_for(fields)
    if model is None:
        logger.debug("shipped data %s has no %s problems like %s", data.path, kind, problem.describe())
        return None
    bucket = lockfile.bucket_for(problem.m, model.buckets)
    pred = model.predict(lookup.n, lookup.k, bucket) if bucket is not None else None
    if pred is None:
        return None
    found: dict[CandKey, tuple] = {}
    ranks: dict[CandKey, tuple] = {}

    def rank(ck: CandKey) -> tuple | None:
        picked = lockfile_policy.pick_from_entry(kind, problem, platform, serving, {"choice": pred.record(ck)})
        if picked is None:
            return None
        found[ck] = picked
        ranks[ck] = host_aware.static_rank(serving, picked[0], picked[1])
        return ranks[ck]

    won = choose(pred.scores, rank, TIE_MARGIN)
    if won is None:
        logger.debug("shipped data %s: no candidate near %s can serve here", data.path, problem.describe())
        return None
    ck, score = won
    why = ""
    if objective is SelectionObjective.HOST:
        def host(key: CandKey) -> float | None:
            return host_aware.host_us_of(found[key][0].cls, bucket, problem.n, problem.k, found[key][1],
                                         block=problem.block_scaled)

        ck, score = choose(pred.scores, rank, TIE_MARGIN, objective=objective, host=host, fastest_us=pred.fastest_us,
                           lower=_lower_rows(model, lookup, problem, bucket, found, ranks))
        if ck != won[0]:
            rows = host_rows([(c, s, ranks[c]) for c, s in pred.scores if c in ranks], host, pred.fastest_us)
            by_key = {r.key: r for r in rows}
            why = f"; {host_aware.note(by_key[ck], by_key[won[0]], rows, predicted=True)}"
    entry, options, _ = found[ck]
    note = (f"{data.label}, bucket M={bucket}{_padded_note(problem)}, nearest: {pred.describe_neighbours()}; "
            f"predicted {score:.3f}x the fastest{why}")
    logger.debug("shipped-nearest scores for %s: %s", problem.describe(),
                 ", ".join(f"{cand_label(k)} {s:.3f}" for k, s in pred.scores))
    return POLICY_NEAREST, (entry, options, note)


def _lower_rows(model: NearestModel, lookup: Any, problem: Any, bucket: int, found: Mapping[CandKey, tuple],
                ranks: Mapping[CandKey, tuple]) -> list[host_aware.Row] | None:
    """The candidates' rows predicted at :func:`.lockfile.bucket_below` ``bucket`` (the bottom of the M range it
    serves), their host µs at that M; None where there is no such bucket."""
    below = lockfile.bucket_below(problem.m, bucket, model.buckets)
    pred = model.predict(lookup.n, lookup.k, below) if below is not None else None
    if pred is None:
        return None

    def host(key: CandKey) -> float | None:
        return host_aware.host_us_of(found[key][0].cls, below, problem.n, problem.k, found[key][1],
                                     block=problem.block_scaled)

    return host_rows([(c, s, ranks[c]) for c, s in pred.scores if c in ranks], host, pred.fastest_us)


def exact_policy(kind: str, problem: Any, platform: Platform, serving: list[Candidate]):
    """``auto`` policy: the shipped data's measured choice for this exact problem and M bucket (:data:`EXACT`)."""
    return EXACT.pick(kind, problem, platform, serving)


def nearest_policy(kind: str, problem: Any, platform: Platform, serving: list[Candidate]):
    """``auto`` policy: the nearest measured shapes' vote for a problem the shipped data does not hold
    (:data:`NEAREST`)."""
    return NEAREST.pick(kind, problem, platform, serving)


def exact_buckets(kind: str, problem: Any, platform: Platform) -> list[int]:
    """The M buckets the shipped data measured for ``problem`` itself (its own M ignored); ``[]`` when the data
    does not hold its shape (or there is no data)."""
    data = _data_for_problem(kind, problem, platform)
    if data is None:
        return []
    fields = lockfile.problem_fields(kind, lookup_problem(problem))
    return list(data.index.buckets.get(lockfile.problem_key(kind, fields), ()))


def nearest_buckets(kind: str, problem: Any, platform: Platform) -> list[int]:
    """The M buckets of the nearest-shapes model of ``problem``'s class (dtypes, scale modes, bias); ``[]`` when
    the data holds no problem of that class."""
    data = _data_for_problem(kind, problem, platform)
    if data is None:
        return []
    model = data.model_for(lockfile.problem_fields(kind, lookup_problem(problem)))
    return list(model.buckets) if model is not None else []


def buckets(kind: str, problem: Any, platform: Platform) -> list[int]:
    """The M buckets the shipped data distinguishes for ``problem`` (its own M ignored): the exact entry's, else
    its class's; ``[]`` without data. Layers use them to pick a provider per bucket."""
    return exact_buckets(kind, problem, platform) or nearest_buckets(kind, problem, platform)


def _data_for_problem(kind: str, problem: Any, platform: Platform) -> ShippedData | None:
    if kind != "gemm" or problem is None:
        return None
    return data_for(platform)


class ShippedPolicy(SelectionPolicy):
    """One of the shipped data's two rungs: ``shipped-exact`` (rank -10: the measured choice for this exact problem
    and M bucket; its buckets are the ones measured for the weight, :func:`exact_buckets`) or ``shipped-nearest``
    (rank -20: the nearest measured shapes' vote; its buckets are the class model's, :func:`nearest_buckets`). Both
    read one answer per problem (:func:`_answer`, memoized), which names the rung that decides."""

    def __init__(self, name: str, rank: int, buckets: Callable[[str, Any, Platform], list[int]]) -> None:
        self.name, self.rank, self._buckets = name, rank, buckets

    def pick(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate]):
        return self.pick_for(kind, problem, platform, serving, SelectionObjective.KERNEL)

    def pick_for(self, kind: str, problem: Any, platform: Platform, serving: Sequence[Candidate],
                 objective: SelectionObjective):
        answer = _answer(kind, problem, platform, list(serving), objective)
        return answer[1] if answer is not None and answer[0] == self.name else None

    def buckets(self, kind: str, problem: Any, platform: Platform) -> list[int]:
        return self._buckets(kind, problem, platform)


# ---------------------------------------------------------------------------------------- listing
def describe(platform: Platform) -> dict[str, Any]:
    """What the listing shows: the file for this SM and, once ``auto`` has loaded it, its provenance. Never
    parses the file itself (the listing stays fast)."""
    path, why = locate(platform)
    if path is None:
        raw = os.environ.get(settings.SHIPPED_ENV, "").strip()
        status = "disabled" if raw and raw.lower() in _OFF else "none"
        return {"path": None, "status": status, "detail": why, "entries": 0}
    hit = _loaded.get(str(path))
    if hit is None:
        return {"path": str(path), "status": "found", "entries": 0,
                "detail": "loads when auto first resolves a GEMM problem with a known M"}
    data = hit[1]
    if data is None:
        return {"path": str(path), "status": "invalid", "entries": 0, "detail": "failed its checks (see the log)"}
    if data.sm != _sm_text(platform):
        return {"path": str(path), "status": "other-sm", "entries": 0, "detail": f"data for SM {data.sm}"}
    prov = data.provenance
    return {"path": str(path), "status": "ok", "entries": len(data.index.by_bucket),
            "detail": f"{len(data.index.by_bucket)} entries measured on {prov['gpu']} {str(prov['date'])[:10]}",
            "provenance": {k: prov.get(k) for k in ("gpu", "sm", "driver", "cuda", "libraries", "date", "command")}}


EXACT = register_selection_policy(ShippedPolicy(POLICY_EXACT, RANK_EXACT, exact_buckets))
NEAREST = register_selection_policy(ShippedPolicy(POLICY_NEAREST, RANK_NEAREST, nearest_buckets))

__all__ = [
    "EXACT",
    "NEAREST",
    "POLICY_EXACT",
    "POLICY_NEAREST",
    "ShippedData",
    "ShippedPolicy",
    "lookup_problem",
    "buckets",
    "covers",
    "data_for",
    "describe",
    "exact_buckets",
    "exact_policy",
    "load",
    "locate",
    "nearest_buckets",
    "nearest_policy",
    "packaged_dir",
    "reset_state",
]
