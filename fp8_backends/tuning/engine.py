"""The tuner's engine: measure every provider that can serve a problem at each M bucket, pick the winners and
merge them into the selection lockfile (its command line: ``python -m fp8_backends.tune``, :mod:`fp8_backends.tune`).

For each problem and M bucket, every provider that can serve it is a candidate, once per value
combination of its ``tunable_options``. Each candidate is first run once and compared with
:mod:`fp8_backends.core.reference` (relative error <= ``rtol``); only correct ones are timed (see
:mod:`fp8_backends.tuning.timing`: CUDA graphs, inputs rotated past L2, candidates interleaved, median).
The winner is the candidate static priorities rank first among those within ``tie_margin`` of the
fastest, decided here and recorded, so reruns of ``auto`` never flip. Entries are merged into the
lockfile after each shape (safe with concurrent writers). A provider that fails is recorded and
skipped; the run goes on. :func:`measure_candidates` is what the benchmarks (``bench/``) time with.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_backends.core.errors import ProviderOutputError
from fp8_backends.core.text_table import text_table
from fp8_backends.core.types import GemmProblem, NormQuantProblem
from fp8_backends.registry import lockfile as lockfile_io
from fp8_backends.registry.platform import Platform, detect_platform
from fp8_backends.tuning.timing import Measurement, Timer, TimerConfig, default_timer
from fp8_backends.tuning.workloads import CONTRACT_BROKEN, CandidateSpec, expand_candidates, kind_of, make_workload

logger = logging.getLogger("fp8_backends")

# ---------------------------------------------------------------------------------------- results
@dataclass
class CandidateResult:
    """One candidate on one problem: its timing, or why it was rejected."""

    label: str
    provider: str
    distribution: str | None
    options: dict[str, str]
    rank: tuple
    measurement: Measurement | None = None
    #: the provider's :attr:`~fp8_backends.core.backend.Fp8GemmBackend.win_margin`
    margin: float = 0.0
    error: float | None = None  # relative error against the reference
    reason: str | None = None  # why it cannot win (wrong output, crash, timing failure)
    #: why its output was wrong, when it was: "output contract" (wrong type, shape, dtype or device: the provider
    #: raised ProviderOutputError) or "reference" (wrong values, NaN/inf, or a shape the reference check refused)
    wrong_output: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None and self.measurement is not None and self.measurement.ok

    @property
    def us(self) -> float:
        return float(self.measurement.median_us) if self.ok else float("inf")

    def choice_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"provider": self.provider, "distribution": self.distribution,
                               "options": dict(self.options)}
        if self.ok:
            out["us"] = round(self.us, 3)
        if self.error is not None and self.error != float("inf"):
            out["error"] = float(f"{self.error:.3g}")
        return out


#: CandidateResult.wrong_output -> how the summary and the log say it
WRONG_OUTPUT_TEXT = {"output contract": "broke the output contract", "reference": "failed the reference check"}


def select_winner(
    results: Sequence[CandidateResult], tie_margin: float
) -> tuple[CandidateResult | None, CandidateResult | None, CandidateResult | None]:
    """``(winner, fastest, runner_up)`` among the candidates that passed.

    The fastest is the smallest median (static rank breaks exact ties). Every candidate within
    ``tie_margin`` (relative) of it is a near-tie; the winner is the near-tie with the best static rank.
    A candidate with a ``margin`` (its provider's ``win_margin``) competes with its median raised by that
    fraction: it wins only where it is faster than the others by more than its margin.
    The runner-up is the fastest candidate other than the winner.
    """
    ok = [r for r in results if r.ok]
    if not ok:
        return None, None, None
    fastest = min(ok, key=lambda r: (r.us, r.rank))

    def cost(r: Any) -> float:
        return r.us * (1.0 + float(getattr(r, "margin", 0.0) or 0.0))

    best = min(cost(r) for r in ok)
    near = [r for r in ok if cost(r) <= best * (1.0 + tie_margin)]
    winner = min(near, key=lambda r: r.rank)
    others = [r for r in ok if r is not winner]
    runner_up = min(others, key=lambda r: (r.us, r.rank)) if others else None
    return winner, fastest, runner_up


@dataclass
class ProblemResult:
    """Everything measured for one problem at one M bucket."""

    kind: str
    problem: Any
    m: int
    results: list[CandidateResult]
    skipped: list[tuple[str, str]]
    tie_margin: float
    winner: CandidateResult | None = None
    fastest: CandidateResult | None = None
    runner_up: CandidateResult | None = None
    seconds: float = 0.0
    labels: list[str] = field(default_factory=list)

    def decide(self) -> ProblemResult:
        self.winner, self.fastest, self.runner_up = select_winner(self.results, self.tie_margin)
        return self

    @property
    def tie_break(self) -> bool:
        return self.winner is not None and self.fastest is not None and self.winner is not self.fastest

    @property
    def margin(self) -> float | None:
        """How much slower the runner-up is than the winner (negative after a tie-break)."""
        if self.winner is None or self.runner_up is None:
            return None
        return self.runner_up.us / self.winner.us - 1.0

    def shape_text(self) -> str:
        f = lockfile_io.problem_fields(self.kind, self.problem)
        return f"{f['n']}x{f['k']}" if self.kind == "gemm" else f"H={f['hidden']}{'+res' if f['residual'] else ''}"

    def lockfile_entry(self) -> dict[str, Any] | None:
        """The lockfile record (None when no candidate passed)."""
        if self.winner is None:
            return None
        ranking = sorted((r for r in self.results if r.ok), key=lambda r: (r.us, r.rank))
        return {
            "kind": self.kind,
            "problem": lockfile_io.problem_fields(self.kind, self.problem),
            "m": int(self.m),
            "choice": self.winner.choice_json(),
            "ranking": [r.choice_json() for r in ranking],
            "fastest": self.fastest.label if self.fastest else None,
            "runner_up": None if self.runner_up is None else self.runner_up.label,
            "tie_break": self.tie_break,
            "tie_margin": self.tie_margin,
            "rejected": [{"label": r.label, "reason": r.reason or (r.measurement.error if r.measurement else "")}
                         for r in self.results if not r.ok],
            "skipped": [{"label": label, "reason": why} for label, why in self.skipped],
            "method": self.winner.measurement.method if self.winner.measurement else "",
            "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **({"labels": list(self.labels)} if self.labels else {}),
        }


@dataclass
class TuneReport:
    platform: Platform
    problems: list[ProblemResult] = field(default_factory=list)
    seconds: float = 0.0
    lockfile: Path | None = None
    lockfile_entries_total: int | None = None
    write_errors: list[str] = field(default_factory=list)
    provenance: Mapping[str, Any] | None = None
    started: float = field(default_factory=time.perf_counter)
    already_done: int = 0  # problems skipped because the lockfile had them
    remaining: int = 0  # problems not measured when the run ended
    stopped: str | None = None  # "time limit" or "interrupted" when the run ended early

    def lockfile_entries(self, problems: Iterable[ProblemResult] | None = None) -> dict[str, dict[str, Any]]:
        out = {}
        for pr in self.problems if problems is None else problems:
            entry = pr.lockfile_entry()
            if entry is not None:
                out[lockfile_io.entry_key(pr.kind, entry["problem"], pr.m)] = entry
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "fp8_backends.tune-report/1",
            "platform": lockfile_io.platform_key(self.platform),
            "seconds": round(self.seconds, 3),
            "lockfile": None if self.lockfile is None else str(self.lockfile),
            "problems": [
                {
                    "key": lockfile_io.entry_key(pr.kind, lockfile_io.problem_fields(pr.kind, pr.problem), pr.m),
                    "winner": None if pr.winner is None else pr.winner.label,
                    "tie_break": pr.tie_break,
                    "candidates": [
                        {"label": r.label, "rank": list(r.rank), "error": r.error, "reason": r.reason,
                         **(r.measurement.to_json() if r.measurement else {})}
                        for r in pr.results
                    ],
                    "skipped": [{"label": a, "reason": b} for a, b in pr.skipped],
                }
                for pr in self.problems
            ],
        }


# ---------------------------------------------------------------------------------------- the loop
def _device_for(problem: Any, platform: Platform) -> str:
    if problem.device.value == "cpu":
        return "cpu"
    return platform.torch_device


class _OutOfTime(Exception):
    """The next problem would not finish before the deadline."""


def tune(
    problems: Sequence[GemmProblem | NormQuantProblem],
    *,
    m_buckets: Sequence[int] = lockfile_io.DEFAULT_M_BUCKETS,
    platform: Platform | None = None,
    timer: Timer | None = None,
    timer_config: TimerConfig | None = None,
    tie_margin: float = lockfile_io.DEFAULT_TIE_MARGIN,
    rtol: float | None = None,
    providers: Collection[str] | None = None,
    lockfile: Path | str | None = None,
    progress: bool = True,
    seed: int = 0,
    on_result: Callable[[ProblemResult], None] | None = None,
    pins: Mapping[str, Mapping[str, str]] | None = None,
    labels: Mapping[str, Sequence[str]] | None = None,
    skip: Collection[str] = (),
    deadline: float | None = None,
    provenance: Mapping[str, Any] | None = None,
    allow_builds: bool = False,
) -> TuneReport:
    """Tune ``problems`` (their M is ignored) at every M in ``m_buckets``.

    - ``timer``: ``timer(runs) -> {label: Measurement}`` (default: CUDA graphs on a GPU, wall clock on
      the CPU; see :mod:`fp8_backends.tuning.timing`). Tests inject fake ones.
    - ``lockfile``: when given, entries are merged into it after each problem shape (and when the run stops).
    - ``providers``: provider names to consider (default: every discovered one).
    - ``pins``: provider name -> options held at one value (e.g. ``{"cutlass": {"config": "auto"}}``).
    - ``labels``: problem key (:func:`~fp8_backends.registry.lockfile.problem_key`) -> where the shape comes from
      (``"llama3-8b/tp2/o_proj"``), recorded in its entries.
    - ``skip``: entry keys (:func:`~fp8_backends.registry.lockfile.entry_key`) already measured: not tuned again.
    - ``deadline``: a ``time.perf_counter()`` value; no problem is started that would not finish before it
      (estimated from the last problem of the same M). ``report.stopped`` says why a run ended early; a
      ``KeyboardInterrupt`` (or SIGTERM under :func:`main`) also stops it, keeping what was measured.
    - ``provenance``: a run record to merge into the lockfile document's ``provenance`` (shipped data).
    - ``allow_builds``: also time candidates whose first call builds for minutes (default: skipped with the reason;
      :func:`~fp8_backends.tuning.workloads.expand_candidates`).
    Candidates are always verified against the reference before they are timed.
    """
    started = time.perf_counter()
    if not problems:
        raise ValueError("no problems to tune")
    kinds = {kind_of(p) for p in problems}
    if len(kinds) != 1:
        raise ValueError("tune one kind of problem at a time (GEMM or norm-quant)")
    kind = kinds.pop()
    buckets = sorted({int(m) for m in m_buckets})
    if not buckets or buckets[0] < 1:
        raise ValueError(f"M buckets must be positive integers, got {list(m_buckets)}")
    platform = platform or detect_platform(problems[0].device)
    device = _device_for(problems[0], platform)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("cannot tune while a CUDA graph is being captured")
    timer = timer or default_timer(device, timer_config)
    path = None if lockfile is None else Path(lockfile)
    report = TuneReport(platform=platform, lockfile=path, provenance=provenance)
    shapes: dict[str, Any] = {}
    for p in problems:
        shapes.setdefault(lockfile_io.problem_key(kind, lockfile_io.problem_fields(kind, p)), p)
    todo = {pk: [m for m in buckets
                 if lockfile_io.entry_key(kind, lockfile_io.problem_fields(kind, base), m) not in skip]
            for pk, base in shapes.items()}
    report.already_done = sum(len(buckets) - len(ms) for ms in todo.values())
    report.remaining = sum(len(ms) for ms in todo.values())
    ctx = _ShapeContext(kind, platform, device, timer, tie_margin, rtol, providers, seed, report, on_result,
                        dict(pins or {}), deadline, allow_builds)
    bar = ctx.bar = _progress(report.remaining, progress)
    pending: list[ProblemResult] = []
    writing = False
    try:
        for pk, base in shapes.items():
            if todo[pk]:
                _tune_shape(ctx, base, todo[pk], list((labels or {}).get(pk, ())), pending)
                if path is not None and pending:
                    writing = True
                    _write(report, path, pending)
                    writing = False
                pending.clear()
    except _OutOfTime:
        report.stopped = "time limit"
    except KeyboardInterrupt:
        report.stopped = "interrupted"
        if writing:  # the interrupt stopped the write itself (e.g. waiting for the lock): do not try again
            _interrupted_write(report, path, pending)
    finally:
        bar.close()
        if path is not None and pending:
            _final_write(report, path, pending)
    report.seconds = time.perf_counter() - started
    return report


def _interrupted_write(report: TuneReport, path: Path | None, pending: list[ProblemResult]) -> None:
    """Record that ``pending`` was not written because the run was interrupted, and drop it."""
    msg = f"could not write {path}: interrupted with {len(pending)} measured problem(s) not written"
    report.write_errors.append(msg)
    logger.warning("%s", msg)
    pending.clear()


def _final_write(report: TuneReport, path: Path, pending: list[ProblemResult]) -> None:
    """The last write of a run (what was measured since the last one); an interrupt during it stops it."""
    try:
        _write(report, path, pending)
    except KeyboardInterrupt:
        report.stopped = report.stopped or "interrupted"
        _interrupted_write(report, path, pending)


@dataclass
class _ShapeContext:
    kind: str
    platform: Platform
    device: str
    timer: Timer
    tie_margin: float
    rtol: float | None
    providers: Collection[str] | None
    seed: int
    report: TuneReport
    on_result: Callable[[ProblemResult], None] | None
    pins: dict[str, Mapping[str, str]]
    deadline: float | None
    allow_builds: bool = False
    bar: Any = None
    last_seconds: dict[int, float] = field(default_factory=dict)

    def check_time(self, m: int) -> None:
        if self.deadline is None:
            return
        recent = self.last_seconds.get(m, max(self.last_seconds.values(), default=0.0))
        if time.perf_counter() + 1.25 * recent > self.deadline:
            raise _OutOfTime()


def _tune_shape(ctx: _ShapeContext, base: Any, buckets: list[int], labels: list[str],
                pending: list[ProblemResult]) -> None:
    kind, device, report = ctx.kind, ctx.device, ctx.report
    ctx.check_time(buckets[0])
    kw = {"seed": ctx.seed} if ctx.rtol is None else {"seed": ctx.seed, "rtol": ctx.rtol}
    try:
        workload = make_workload(kind, base, device, **kw)
    except Exception as exc:
        logger.warning("cannot build inputs for %s: %s: %s", base.describe(), type(exc).__name__, exc)
        _free(device)
        ctx.bar.update(len(buckets))
        report.remaining -= len(buckets)
        return
    failed_prepare: dict[str, str] = {}
    try:
        for m in buckets:
            ctx.check_time(m)
            t0 = time.perf_counter()
            problem = workload.problem(m)
            cands, skipped = expand_candidates(kind, problem, ctx.platform, only=ctx.providers, pins=ctx.pins,
                                               allow_builds=ctx.allow_builds)
            results = measure_candidates(workload, m, cands, ctx.timer, failed_prepare)
            pr = ProblemResult(kind, problem, m, results, skipped, ctx.tie_margin, labels=labels).decide()
            pr.seconds = ctx.last_seconds[m] = time.perf_counter() - t0
            report.problems.append(pr)
            report.remaining -= 1
            pending.append(pr)
            if ctx.on_result is not None:
                ctx.on_result(pr)
            ctx.bar.update(1)
            ctx.bar.set_postfix_str(f"{pr.shape_text()} M={m}: {pr.winner.label if pr.winner else 'none'}")
            workload.release()
    finally:
        workload.close()
        _free(device)


def measure_candidates(
    workload: Any, m: int, cands: Sequence[CandidateSpec], timer: Timer, failed_prepare: dict[str, str] | None = None
) -> list[CandidateResult]:
    """Verify each candidate against the reference (one eager call), then time the correct ones together.

    ``failed_prepare`` remembers candidates whose ``prepare_weight`` failed (not retried for other M)."""
    failed_prepare = {} if failed_prepare is None else failed_prepare
    device = str(workload.device)
    results, runs = [], {}
    by_label: dict[str, CandidateResult] = {}
    problem = workload.problem(m)
    for cand in cands:
        res = CandidateResult(cand.label, cand.provider, cand.entry.dist, cand.options, cand.rank,
                              margin=float(getattr(cand.backend, "win_margin", 0.0) or 0.0))
        results.append(res)
        if cand.label in failed_prepare:
            res.reason = failed_prepare[cand.label]
            continue
        try:
            res.error, res.reason = workload.verify(cand, m)
            if res.reason is None:
                runs[cand.label] = workload.run(cand, m)
                by_label[cand.label] = res
            else:
                if res.reason.startswith(CONTRACT_BROKEN):
                    res.wrong_output, res.reason = "output contract", res.reason[len(CONTRACT_BROKEN):].lstrip(": ")
                else:
                    res.wrong_output = "reference"
        except Exception as exc:
            res.reason = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            if isinstance(exc, ProviderOutputError):
                res.wrong_output = "output contract"
            if "prepare_weight" in _where(exc):
                failed_prepare[cand.label] = res.reason
            _free(device)
        if res.wrong_output == "output contract":  # a provider bug that the caller would have met: say so loudly
            logger.warning("tuner: %s rejected for %s: its output %s: %s", cand.label, problem.describe(),
                           WRONG_OUTPUT_TEXT[res.wrong_output], res.reason)
        elif res.reason is not None:
            logger.info("%s rejected for %s: %s", cand.label, problem.describe(), res.reason)
    measured = timer(runs) if runs else {}
    runs.clear()
    for label, res in by_label.items():
        res.measurement = measured.get(label) or Measurement.failed("the timer returned nothing")
        if not res.measurement.ok:
            res.reason = f"timing failed: {res.measurement.error}"
    return results


def _where(exc: BaseException) -> str:
    """Names of the functions an exception passed through (to tell prepare_weight failures apart)."""
    names, tb = [], exc.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return " ".join(names)


def _free(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


def _write(report: TuneReport, path: Path, done: list[ProblemResult]) -> None:
    entries = report.lockfile_entries(done)
    if not entries:
        return
    key, _ = lockfile_io.current_key(report.platform)
    try:
        if report.provenance is None:
            report.lockfile_entries_total = lockfile_io.write_entries(path, key, entries)
            return
        from fp8_backends.tuning.provenance import merge_provenance

        def mutate(doc: dict[str, Any]) -> None:
            report.lockfile_entries_total = lockfile_io.merge_entries(doc, key, entries)
            doc["provenance"] = merge_provenance(doc.get("provenance"), report.provenance, len(report.problems),
                                                 time.perf_counter() - report.started)

        lockfile_io.update_document(path, mutate)
    except Exception as exc:  # a full disk or a lock timeout must not lose the measurements printed later
        msg = f"could not write {path}: {type(exc).__name__}: {exc}"
        report.write_errors.append(msg)
        logger.warning("%s", msg)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="tuning", unit="problem", dynamic_ncols=True, file=sys.stderr)


# ---------------------------------------------------------------------------------------- output
def format_summary(report: TuneReport) -> str:
    """The end-of-run table: winner, runner-up and margin per problem and M."""
    rows = []
    for pr in report.problems:
        w, r = pr.winner, pr.runner_up
        notes = []
        if pr.tie_break and pr.fastest is not None:
            notes.append(f"tie -> static (fastest {pr.fastest.label})")
        rejected = [x for x in pr.results if not x.ok]
        if rejected:
            wrong = [WRONG_OUTPUT_TEXT[kind] + f" ({n})" for kind in WRONG_OUTPUT_TEXT
                     if (n := sum(x.wrong_output == kind for x in rejected))]
            notes.append(f"{len(rejected)} rejected" + (f": {', '.join(wrong)}" if wrong else ""))
        rows.append([
            pr.shape_text(), str(pr.m),
            w.label if w else "NONE", f"{w.us:.2f}" if w else "-",
            r.label if r else "-", f"{r.us:.2f}" if r else "-",
            f"{100 * pr.margin:+.1f}%" if pr.margin is not None else "-",
            "; ".join(notes),
        ])
    return text_table(["problem", "M", "winner", "µs", "runner-up", "µs", "margin", "notes"], rows)


def format_rejections(report: TuneReport) -> str:
    """One line per distinct rejection reason (which candidates, how many problems)."""
    seen: dict[tuple[str, str], int] = {}
    for pr in report.problems:
        for r in pr.results:
            if not r.ok:
                reason = r.reason or (r.measurement.error if r.measurement else "?")
                seen[(r.label, reason)] = seen.get((r.label, reason), 0) + 1
    return "\n".join(f"  {label}: {reason} ({n} problem(s))" for (label, reason), n in sorted(seen.items()))
