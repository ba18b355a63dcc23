"""``python -m fp8_backends.tune``: measure every provider on your GEMM (or norm-quant) problems and write
the selection lockfile that ``auto`` reads.

Examples::

    python -m fp8_backends.tune --model llama3-8b                 # 4 shapes x M = 1, 2, 4, ... 16384
    python -m fp8_backends.tune --model llama3-70b --tp 4 --m 1-4096
    python -m fp8_backends.tune --shapes 6144,4096 4096,14336 --m 1,16,256,4096 --lockfile sel.lock.json
    python -m fp8_backends.tune --kind norm_quant --model llama3-8b   # RMSNorm+quant, T buckets
    python -m fp8_backends.tune --model llama3-8b --list              # what would be timed, no GPU work
    python -m fp8_backends.tune --shapes-file my_model.csv --m 1-4096   # an engine's own shapes
    python -m fp8_backends.tune --shipped-grid --lockfile sm90.json --limit-seconds 480   # resumable chunks

For each problem and M bucket, every provider that can serve it is a candidate, once per value
combination of its ``tunable_options``. Each candidate is first run once and compared with
:mod:`fp8_backends.reference` (relative error <= ``--rtol``); only correct ones are timed (see
:mod:`fp8_backends.timing`: CUDA graphs, inputs rotated past L2, candidates interleaved, median).
The winner is the candidate static priorities rank first among those within ``--tie-margin`` of the
fastest, decided here and recorded, so reruns of ``auto`` never flip. Entries are merged into the
lockfile after each shape (safe with concurrent writers). A provider that fails is recorded and
skipped; the run goes on.

Runs resume: problems the lockfile already holds for this platform are skipped (``--retune`` measures them
again), so a long grid can be tuned in chunks (``--limit-seconds``) or shards (``--shard I/N``, one process per
GPU). ``--shipped-grid`` tunes the grid of the selection data that ships with the package and records its
provenance (:mod:`fp8_backends.grid`, :mod:`fp8_backends.provenance`).

Exit status: 0 when at least one problem got a choice (or none was left to do), 1 when none did, 2 on bad
arguments, 3 when ``--limit-seconds`` (or SIGTERM) stopped the run with problems left (run it again to resume).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_backends.errors import ProviderOutputError
from fp8_backends.registry import tuning
from fp8_backends.registry.discovery import discover as discover_entries
from fp8_backends.registry.platform import Platform, detect_platform
from fp8_backends.text_table import text_table
from fp8_backends.timing import Measurement, Timer, TimerConfig, default_timer
from fp8_backends.types import ActScale, GemmProblem, NormQuantProblem, WeightScale
from fp8_backends.workloads import CandidateSpec, expand_candidates, kind_of, make_workload, option_combos

logger = logging.getLogger("fp8_backends")

QUICK_M_BUCKETS = (1, 16, 256, 4096)


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
    The runner-up is the fastest candidate other than the winner.
    """
    ok = [r for r in results if r.ok]
    if not ok:
        return None, None, None
    fastest = min(ok, key=lambda r: (r.us, r.rank))
    near = [r for r in ok if r.us <= fastest.us * (1.0 + tie_margin)]
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
        f = tuning.problem_fields(self.kind, self.problem)
        return f"{f['n']}x{f['k']}" if self.kind == "gemm" else f"H={f['hidden']}{'+res' if f['residual'] else ''}"

    def lockfile_entry(self) -> dict[str, Any] | None:
        """The lockfile record (None when no candidate passed)."""
        if self.winner is None:
            return None
        ranking = sorted((r for r in self.results if r.ok), key=lambda r: (r.us, r.rank))
        return {
            "kind": self.kind,
            "problem": tuning.problem_fields(self.kind, self.problem),
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
                out[tuning.entry_key(pr.kind, entry["problem"], pr.m)] = entry
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "fp8_backends.tune-report/1",
            "platform": tuning.platform_key(self.platform),
            "seconds": round(self.seconds, 3),
            "lockfile": None if self.lockfile is None else str(self.lockfile),
            "problems": [
                {
                    "key": tuning.entry_key(pr.kind, tuning.problem_fields(pr.kind, pr.problem), pr.m),
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
    m_buckets: Sequence[int] = tuning.DEFAULT_M_BUCKETS,
    platform: Platform | None = None,
    timer: Timer | None = None,
    timer_config: TimerConfig | None = None,
    tie_margin: float = tuning.DEFAULT_TIE_MARGIN,
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
) -> TuneReport:
    """Tune ``problems`` (their M is ignored) at every M in ``m_buckets``.

    - ``timer``: ``timer(runs) -> {label: Measurement}`` (default: CUDA graphs on a GPU, wall clock on
      the CPU; see :mod:`fp8_backends.timing`). Tests inject fake ones.
    - ``lockfile``: when given, entries are merged into it after each problem shape (and when the run stops).
    - ``providers``: provider names to consider (default: every discovered one).
    - ``pins``: provider name -> options held at one value (e.g. ``{"cutlass": {"config": "auto"}}``).
    - ``labels``: problem key (:func:`~fp8_backends.registry.tuning.problem_key`) -> where the shape comes from
      (``"llama3-8b/tp2/o_proj"``), recorded in its entries.
    - ``skip``: entry keys (:func:`~fp8_backends.registry.tuning.entry_key`) already measured: not tuned again.
    - ``deadline``: a ``time.perf_counter()`` value; no problem is started that would not finish before it
      (estimated from the last problem of the same M). ``report.stopped`` says why a run ended early; a
      ``KeyboardInterrupt`` (or SIGTERM under :func:`main`) also stops it, keeping what was measured.
    - ``provenance``: a run record to merge into the lockfile document's ``provenance`` (shipped data).
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
        shapes.setdefault(tuning.problem_key(kind, tuning.problem_fields(kind, p)), p)
    todo = {pk: [m for m in buckets if tuning.entry_key(kind, tuning.problem_fields(kind, base), m) not in skip]
            for pk, base in shapes.items()}
    report.already_done = sum(len(buckets) - len(ms) for ms in todo.values())
    report.remaining = sum(len(ms) for ms in todo.values())
    ctx = _ShapeContext(kind, platform, device, timer, tie_margin, rtol, providers, seed, report, on_result,
                        dict(pins or {}), deadline)
    bar = ctx.bar = _progress(report.remaining, progress)
    pending: list[ProblemResult] = []
    try:
        for pk, base in shapes.items():
            if todo[pk]:
                _tune_shape(ctx, base, todo[pk], list((labels or {}).get(pk, ())), pending)
                if path is not None and pending:
                    _write(report, path, pending)
                pending.clear()
    except _OutOfTime:
        report.stopped = "time limit"
    except KeyboardInterrupt:
        report.stopped = "interrupted"
    finally:
        bar.close()
        if path is not None and pending:
            _write(report, path, pending)
    report.seconds = time.perf_counter() - started
    return report


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
            cands, skipped = expand_candidates(kind, problem, ctx.platform, only=ctx.providers, pins=ctx.pins)
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
        res = CandidateResult(cand.label, cand.provider, cand.entry.dist, cand.options, cand.rank)
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
    key, _ = tuning.current_key(report.platform)
    try:
        if report.provenance is None:
            report.lockfile_entries_total = tuning.write_entries(path, key, entries)
            return
        from fp8_backends.provenance import merge_provenance

        def mutate(doc: dict[str, Any]) -> None:
            report.lockfile_entries_total = tuning.merge_entries(doc, key, entries)
            doc["provenance"] = merge_provenance(doc.get("provenance"), report.provenance, len(report.problems),
                                                 time.perf_counter() - report.started)

        tuning.update_document(path, mutate)
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


# ---------------------------------------------------------------------------------------- CLI
def parse_m_list(text: str) -> list[int]:
    """``"1,16,256"``, or ``"1-16384"`` (every power of two in the range), or a mix: ``"1-8,100"``."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "-" in part:
            lo_text, _, hi_text = part.partition("-")
            lo, hi = int(lo_text), int(hi_text)
            if lo < 1 or hi < lo:
                raise ValueError(f"bad M range {part!r}")
            v = 1
            while v <= hi:
                if v >= lo:
                    out.add(v)
                v *= 2
        else:
            v = int(part)
            if v < 1:
                raise ValueError(f"M must be >= 1, got {v}")
            out.add(v)
    if not out:
        raise ValueError(f"no M values in {text!r}")
    return sorted(out)


def _parse_shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is N,K (two integers), got {text!r}") from None
    return n, k


def build_parser() -> argparse.ArgumentParser:
    from fp8_backends.tune_plan import parse_pin, parse_scales, parse_shard

    ap = argparse.ArgumentParser(
        prog="python -m fp8_backends.tune",
        description="Time every FP8 provider on your problems and write the lockfile that `auto` reads.",
    )
    what = ap.add_argument_group("problems")
    what.add_argument("--kind", choices=["gemm", "norm_quant"], default="gemm")
    what.add_argument("--model", nargs="+", default=[], metavar="NAME",
                      help="built-in linear-shape tables (llama3-8b, qwen2.5-14b, gemma3-12b, phi4, ...; "
                           "default llama3-8b when no --shapes/--shapes-file/--hidden)")
    what.add_argument("--tp", nargs="+", type=int, default=None, metavar="N",
                      help="tensor-parallel degrees for --model shapes (default 1); degrees that do not divide a "
                           "model's heads are skipped")
    what.add_argument("--exclude-model", nargs="+", default=[], metavar="NAME",
                      help="leave these models' shapes out (a held-out set); shapes another model shares stay")
    what.add_argument("--shapes", nargs="+", type=_parse_shape, default=[], metavar="N,K",
                      help="GEMM weight shapes [N, K]")
    what.add_argument("--shapes-file", nargs="+", default=[], metavar="PATH",
                      help="JSON or CSV of N, K (optional bias, model, tp, layer labels): an engine's own shapes")
    what.add_argument("--shipped-grid", action="store_true",
                      help="the grid of the shipped selection data (fp8_backends/grid.py: 25 models x TP 1/2/4/8 "
                           "x M 1,4,16,64,256,1024,4096, kernel-config tables pinned to auto) with provenance")
    what.add_argument("--hidden", nargs="+", type=int, default=[], metavar="H", help="norm-quant hidden sizes")
    what.add_argument("--m", default=None, metavar="LIST",
                      help="M (token) buckets: '1,16,256' or '1-16384' (powers of two; default 1-16384)")
    what.add_argument("--act-scale", nargs="+", default=None, choices=[a.value for a in ActScale],
                      help="activation scale modes (default per_tensor_dynamic); crossed with --weight-scale")
    what.add_argument("--weight-scale", nargs="+", default=None, choices=[w.value for w in WeightScale])
    what.add_argument("--scales", nargs="+", type=parse_scales, default=[], metavar="ACT:W",
                      help="(activation, weight) scale pairs instead of the cross product, e.g. "
                           "per_tensor_dynamic:per_tensor per_token:per_channel")
    what.add_argument("--input-dtype", default="e4m3fn", choices=["e4m3fn", "e5m2"])
    what.add_argument("--weight-dtype", default=None, choices=["e4m3fn", "e5m2"])
    what.add_argument("--out-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    what.add_argument("--bias", action="store_true", help="--shapes problems have a bias")
    what.add_argument("--in-dtype", default="bfloat16", choices=["bfloat16", "float16"], help="norm-quant input")
    what.add_argument("--residual", choices=["both", "yes", "no"], default="both",
                      help="norm-quant: with the fused residual add, without, or both (default)")
    how = ap.add_argument_group("tuning")
    how.add_argument("--providers", default=None, help="comma-separated provider names (default: all discovered)")
    how.add_argument("--pin", action="append", type=parse_pin, default=[], metavar="PROVIDER:OPTION=VALUE",
                     help="hold a provider option at one value instead of timing each (e.g. cutlass:config=auto)")
    how.add_argument("--no-pins", action="store_true", help="with --shipped-grid: time every kernel config")
    how.add_argument("--tie-margin", type=float, default=tuning.DEFAULT_TIE_MARGIN,
                     help="near-tie margin; near-ties go to the static-priority provider (default 0.02)")
    how.add_argument("--rtol", type=float, default=None, help="max relative error against the reference (1e-2)")
    how.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 5; --quick 3)")
    how.add_argument("--replays", type=int, default=None, help="graph replays per round (default 3; --quick 2)")
    how.add_argument("--eager", action="store_true", help="time without CUDA graphs")
    how.add_argument("--quick", action="store_true", help=f"M buckets {QUICK_M_BUCKETS} and fewer repeats")
    how.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: the current GPU)")
    how.add_argument("--seed", type=int, default=0)
    run = ap.add_argument_group("splitting and resuming")
    run.add_argument("--retune", action="store_true",
                     help="measure again problems the lockfile already holds (default: skip them, i.e. resume)")
    run.add_argument("--limit-seconds", type=float, default=None, metavar="S",
                     help="start no problem that would end after S seconds; exit 3 if problems are left")
    run.add_argument("--shard", type=parse_shard, default=None, metavar="I/N",
                     help="take shard I of N of the shapes (one process per GPU; they share the lockfile)")
    out = ap.add_argument_group("output")
    out.add_argument("--lockfile", default=None, metavar="PATH",
                     help="lockfile to merge into (default: $FP8_BACKENDS_LOCKFILE or the per-user cache)")
    out.add_argument("--provenance", action="store_true",
                     help="record provenance in the lockfile (GPU, versions, date, command): for shipped data "
                          "(implied by --shipped-grid)")
    out.add_argument("--no-write", action="store_true", help="measure and print, write no lockfile")
    out.add_argument("--report", default=None, metavar="PATH", help="also write every measurement as JSON")
    out.add_argument("--list", action="store_true", help="print the problems, candidates and a time estimate; "
                                                         "time nothing")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("-v", "--verbose", action="store_true", help="log at INFO (rejections, choices)")
    return ap


def problems_from_args(args: argparse.Namespace, device: str) -> list[Any]:
    """The problem templates (M unset) the arguments describe."""
    from fp8_backends.tune_plan import plan_from_args

    return plan_from_args(args, device).problems


def _list_candidates(problems: list[Any], buckets: list[int], platform: Platform, providers,
                     pins=None) -> tuple[str, float]:
    lines = [f"platform: {platform.describe()}", f"M buckets: {', '.join(map(str, buckets))}"]
    total = 0
    for p in problems:
        kind = kind_of(p)
        probe = p.with_m(buckets[0]) if kind == "gemm" else p
        cands, skipped = expand_candidates(kind, probe, platform, only=providers, pins=pins)
        total += len(cands)
        lines.append(f"{p.describe()}: {len(cands)} candidate(s): {', '.join(c.label for c in cands) or 'none'}")
        lines += [f"    skipped {label}: {why}" for label, why in skipped]
    return "\n".join(lines), total / max(1, len(problems))


def _estimate_text(problems: int, per_problem: float) -> str:
    from fp8_backends.grid import H200_SECONDS_PER_CANDIDATE, estimate_seconds

    seconds = estimate_seconds(problems, per_problem)
    return (f"estimate: {problems} problem(s) x {per_problem:.1f} candidate(s) x "
            f"{1000 * H200_SECONDS_PER_CANDIDATE:.0f} ms (the H200's measured rate per candidate run) = "
            f"{seconds:.0f} s ({seconds / 60:.1f} min)")


@contextlib.contextmanager
def _sigterm_to_interrupt() -> Iterator[None]:
    """While tuning, a SIGTERM (``timeout``, a job scheduler) stops the run like Ctrl-C: what was measured is
    written. The previous handler comes back afterwards."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None, *, timer: Timer | None = None) -> int:
    from fp8_backends.tune_plan import done_keys, plan_from_args, select_shard

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        platform = detect_platform(args.device)
        device = "cpu" if platform.kind.value == "cpu" else "cuda"
        plan = plan_from_args(args, device)
        for provider, options in plan.pins.items():
            for entry in (e for e in discover_entries(plan.kind) if e.name == provider and e.cls is not None):
                option_combos(entry.cls, options)  # unknown option values: a clear error now
    except (ValueError, argparse.ArgumentTypeError) as exc:
        ap.error(str(exc))
    if args.shard is not None:
        plan = select_shard(plan, *args.shard)
    for note in plan.notes:
        print(f"left out: {note}", file=sys.stderr)
    providers = None if args.providers is None else {p.strip() for p in args.providers.split(",") if p.strip()}
    if args.list:
        text, per_problem = _list_candidates(plan.problems, plan.buckets, platform, providers, plan.pins)
        print(text)
        print(_estimate_text(len(plan.problems) * len(plan.buckets), per_problem))
        return 0
    if platform.simulated:
        ap.error(f"cannot time on a simulated platform ({platform.describe()}); --list shows its candidates")
    if device == "cpu" and args.device != "cpu":
        ap.error("no CUDA device found; pass --device cpu to tune CPU problems (small --shapes)")
    if args.no_write:
        path = None
    elif args.lockfile:
        path = Path(args.lockfile).expanduser()
    else:
        path = tuning.lockfile_path() or tuning.default_lockfile_path()
    config = TimerConfig.quick() if args.quick else TimerConfig()
    if args.rounds is not None:
        config.rounds = max(1, args.rounds)
    if args.replays is not None:
        config.replays = max(1, args.replays)
    config.use_graphs = not args.eager
    skip = set() if args.retune else done_keys(path, platform)
    provenance = None
    if (args.shipped_grid or args.provenance) and path is not None:
        from fp8_backends.provenance import build_provenance

        provenance = build_provenance(platform, argv, plan.grid)
    deadline = None if args.limit_seconds is None else time.perf_counter() + args.limit_seconds
    print(f"tuning {len(plan.problems)} problem(s) x {len(plan.buckets)} M bucket(s) on {platform.describe()}"
          + (f" (shard {args.shard[0]}/{args.shard[1]})" if args.shard else ""), file=sys.stderr)
    with _sigterm_to_interrupt():
        report = tune(plan.problems, m_buckets=plan.buckets, platform=platform, timer=timer, timer_config=config,
                      tie_margin=args.tie_margin, rtol=args.rtol, providers=providers, lockfile=path,
                      progress=not args.no_progress, seed=args.seed, pins=plan.pins, labels=plan.labels, skip=skip,
                      deadline=deadline, provenance=provenance)
    if report.already_done:
        print(f"{report.already_done} problem(s) already in {path}: skipped (--retune measures them again)")
    print(format_summary(report))
    rejections = format_rejections(report)
    if rejections:
        print("rejected candidates:\n" + rejections)
    chosen = sum(1 for pr in report.problems if pr.winner is not None)
    print(f"\n{chosen}/{len(report.problems)} problems got a choice in {report.seconds:.1f} s "
          f"({sum(len(pr.results) for pr in report.problems)} candidate runs)")
    if path is not None:
        if report.write_errors:
            print("lockfile NOT fully written: " + "; ".join(report.write_errors))
        elif report.lockfile_entries_total is not None:
            print(f"lockfile: {path} ({report.lockfile_entries_total} entries for this platform)")
    if args.report:
        Path(args.report).expanduser().parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).expanduser().write_text(json.dumps(report.to_json(), indent=1) + "\n", encoding="utf-8")
        print(f"report: {args.report}")
    if report.stopped and report.remaining:
        print(f"stopped ({report.stopped}) with {report.remaining} problem(s) left: run the same command again to "
              "resume")
        return 3
    if not report.problems:
        print("nothing to do: every problem is in the lockfile")
        return 0
    return 0 if chosen else 1


if __name__ == "__main__":
    sys.exit(main())
