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
    python -m fp8_backends.tune --shipped-grid --block --lockfile sm90-block.json --limit-seconds 200  # block FP8

For each problem and M bucket, every provider that can serve it is a candidate, once per value
combination of its ``tunable_options``. Each candidate is first run once and compared with
:mod:`fp8_backends.core.reference` (relative error <= ``--rtol``); only correct ones are timed (see
:mod:`fp8_backends.tuning.timing`: CUDA graphs, inputs rotated past L2, candidates interleaved, median).
The winner is the candidate static priorities rank first among those within ``--tie-margin`` of the
fastest, decided here and recorded, so reruns of ``auto`` never flip. Entries are merged into the
lockfile after each shape (safe with concurrent writers). A provider that fails is recorded and
skipped; the run goes on. This module is the command line; the engine is :mod:`fp8_backends.tuning.engine`.

Runs resume: problems the lockfile already holds for this platform are skipped (``--retune`` measures them
again), so a long grid can be tuned in chunks (``--limit-seconds``) or shards (``--shard I/N``, one process per
GPU). ``--shipped-grid`` tunes the grid of the selection data that ships with the package and records its
provenance (:mod:`fp8_backends.tuning.grid`, :mod:`fp8_backends.tuning.provenance`).

Exit status: 0 when at least one problem got a choice (or none was left to do), 1 when none did, 2 on bad
arguments, 3 when ``--limit-seconds`` (or SIGTERM) stopped the run with problems left (run it again to resume),
4 when the lockfile or the ``--report`` could not be written (the measurements are printed all the same).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fp8_backends.core import settings
from fp8_backends.core.types import ActScale, WeightScale
from fp8_backends.registry import lockfile
from fp8_backends.registry.discovery import discover as discover_entries
from fp8_backends.registry.platform import Platform, detect_platform
from fp8_backends.tuning.engine import (  # noqa: F401 (the engine's public names, importable here as before)
    WRONG_OUTPUT_TEXT,
    CandidateResult,
    ProblemResult,
    TuneReport,
    format_rejections,
    format_summary,
    measure_candidates,
    select_winner,
    tune,
)
from fp8_backends.tuning.plan import QUICK_M_BUCKETS, parse_m_list  # noqa: F401
from fp8_backends.tuning.timing import Timer, TimerConfig
from fp8_backends.tuning.workloads import expand_candidates, kind_of, option_combos


# ---------------------------------------------------------------------------------------- CLI
def _parse_shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is N,K (two integers), got {text!r}") from None
    return n, k


def build_parser() -> argparse.ArgumentParser:
    from fp8_backends.tuning.plan import parse_pin, parse_scales, parse_shard

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
                      help="the grid of the shipped selection data (fp8_backends/tuning/grid.py: 25 models x TP "
                           "1/2/4/8 x M 1,4,16,64,256,1024,4096, kernel-config tables pinned to auto) with provenance")
    what.add_argument("--block", action="store_true",
                      help="block-wise FP8 problems (per_token_group activations x 128x128 block weights); TP "
                           "splits whose shards would cut a checkpoint's blocks are left out. With --shipped-grid: "
                           "the block grid (DeepSeek-V3 and Qwen3 0.6B-32B x TP 1/2/4/8 x the 7 M buckets; "
                           "DeepSeek-V3 TP1/TP8 and Qwen3-8B/32B TP1/TP2 first)")
    what.add_argument("--group-size", type=int, default=128, choices=[64, 128],
                      help="activation group size of per_token_group problems (default 128)")
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
    how.add_argument("--allow-builds", action="store_true",
                     help="also time candidates whose first call builds kernels for minutes (flashinfer_block's "
                          "module, cutlass libraries not built yet); default: skip them with the reason and the "
                          "command that builds them ahead")
    how.add_argument("--pin", action="append", type=parse_pin, default=[], metavar="PROVIDER:OPTION=VALUE",
                     help="hold a provider option at one value instead of timing each (e.g. cutlass:config=auto)")
    how.add_argument("--no-pins", action="store_true", help="with --shipped-grid: time every kernel config")
    how.add_argument("--tie-margin", type=float, default=lockfile.DEFAULT_TIE_MARGIN,
                     help="near-tie margin: candidates within it of the fastest go to the static-priority provider "
                          f"(default {lockfile.DEFAULT_TIE_MARGIN:g}: the measured fastest)")
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
    from fp8_backends.tuning.plan import plan_from_args

    return plan_from_args(args, device).problems


def _list_candidates(problems: list[Any], buckets: list[int], platform: Platform, providers,
                     pins=None, allow_builds: bool = False) -> tuple[str, float]:
    lines = [f"platform: {platform.describe()}", f"M buckets: {', '.join(map(str, buckets))}"]
    total = 0
    for p in problems:
        kind = kind_of(p)
        probe = p.with_m(buckets[0]) if kind == "gemm" else p
        cands, skipped = expand_candidates(kind, probe, platform, only=providers, pins=pins,
                                           allow_builds=allow_builds)
        total += len(cands)
        lines.append(f"{p.describe()}: {len(cands)} candidate(s): {', '.join(c.label for c in cands) or 'none'}")
        lines += [f"    skipped {label}: {why}" for label, why in skipped]
    return "\n".join(lines), total / max(1, len(problems))


def _estimate_text(problems: int, per_problem: float) -> str:
    from fp8_backends.tuning.grid import H200_SECONDS_PER_CANDIDATE, estimate_seconds

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


def _report_problem(path: Path) -> str | None:
    """Why the ``--report`` file ``path`` cannot be written (checked before measuring), or None."""
    if path.is_dir():
        return "is a folder: name a file"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"its folder cannot be made ({exc.strerror or exc})"
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK):
        return f"{target} is not writable"
    return None


def _write_report(report: TuneReport, path: Path) -> bool:
    """Write ``report`` as JSON to ``path``; False (and the reason printed) when that fails."""
    try:
        lockfile.atomic_write_text(path, json.dumps(report.to_json(), indent=1) + "\n")
    except OSError as exc:
        print(f"report NOT written: {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False
    print(f"report: {path}")
    return True


def _check_limit_seconds(seconds: float | None) -> None:
    """``--limit-seconds`` is a finite number of seconds > 0 (or not given)."""
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--limit-seconds must be a finite number of seconds > 0, got {seconds:g}")


def _provider_names(text: str | None) -> set[str] | None:
    """The ``--providers`` names (None: every discovered provider)."""
    if text is None:
        return None
    names = {p.strip() for p in text.split(",") if p.strip()}
    if not names:
        raise ValueError("--providers names no provider (comma-separated names, e.g. torch_scaled_mm,cutlass)")
    return names


def _check_provider_names(kind: str, providers: set[str] | None, pinned: list[str]) -> None:
    """Refuse ``--providers`` and ``--pin`` names that no discovered ``kind`` provider has."""
    known = sorted({e.name for e in discover_entries(kind)})
    for option, names in (("--providers", sorted(providers or ())), ("--pin", list(dict.fromkeys(pinned)))):
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(f"{option}: unknown {kind} provider(s) {', '.join(unknown)}; known: {', '.join(known)}")


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None, *, timer: Timer | None = None) -> int:
    from fp8_backends.tuning.plan import done_keys, plan_from_args, select_shard

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        platform = detect_platform(args.device)
        device = "cpu" if platform.kind.value == "cpu" else "cuda"
        plan = plan_from_args(args, device)
        _check_limit_seconds(args.limit_seconds)
        providers = _provider_names(args.providers)
        _check_provider_names(plan.kind, providers, [provider for provider, _, _ in args.pin])
        for provider, options in plan.pins.items():
            for entry in (e for e in discover_entries(plan.kind) if e.name == provider and e.cls is not None):
                option_combos(entry.cls, options)  # unknown option values: a clear error now
    except (ValueError, argparse.ArgumentTypeError) as exc:
        ap.error(str(exc))
    planned = len(plan.problems)
    if args.shard is not None:
        plan = select_shard(plan, *args.shard)
    for note in plan.notes:
        print(f"left out: {note}", file=sys.stderr)
    if not plan.problems and not args.list:
        shard = f" in shard {args.shard[0]}/{args.shard[1]}" if args.shard else ""
        print(f"nothing to do: no problems{shard} (the arguments describe {planned} problem(s))")
        return 0
    if args.list:
        text, per_problem = _list_candidates(plan.problems, plan.buckets, platform, providers, plan.pins,
                                             args.allow_builds)
        print(text)
        print(_estimate_text(len(plan.problems) * len(plan.buckets), per_problem))
        return 0
    if platform.simulated:
        ap.error(f"cannot time on a simulated platform ({platform.describe()}); --list shows its candidates")
    if device == "cpu" and args.device != "cpu" or device == "cuda" and not _cuda_visible():
        ap.error("no CUDA device found; pass --device cpu to tune CPU problems (small --shapes)")
    if not 0.0 <= args.tie_margin < math.inf:
        ap.error(f"--tie-margin must be a finite number >= 0, got {args.tie_margin}")
    if args.no_write:
        path = None
    elif args.lockfile:
        path = Path(args.lockfile).expanduser()
        if path.is_dir():
            ap.error(f"--lockfile {path} is a folder: name a file (e.g. {path / 'fp8_backends.lock.json'})")
    else:
        path = lockfile.lockfile_path()
        if path is None:  # FP8_BACKENDS_LOCKFILE=off: auto would never read what this run wrote
            ap.error(f"{settings.LOCKFILE_ENV}={lockfile.lockfile_setting()} turns the "
                     f"lockfile off, so auto reads no lockfile: name one with --lockfile (and point "
                     f"{settings.LOCKFILE_ENV} at it to use it), or measure without writing (--no-write)")
    problem = None if path is None else lockfile.lock_problem(path)
    if problem is not None:
        ap.error(f"lockfile {path}: {problem} (name another --lockfile, or --no-write)")
    report_path = None if args.report is None else Path(args.report).expanduser()
    problem = None if report_path is None else _report_problem(report_path)
    if problem is not None:
        ap.error(f"--report {report_path}: {problem}")
    config = TimerConfig.quick() if args.quick else TimerConfig()
    if args.rounds is not None:
        config.rounds = max(1, args.rounds)
    if args.replays is not None:
        config.replays = max(1, args.replays)
    config.use_graphs = not args.eager
    skip = set() if args.retune else done_keys(path, platform)
    provenance = None
    if (args.shipped_grid or args.provenance) and path is not None:
        from fp8_backends.tuning.provenance import build_provenance

        provenance = build_provenance(platform, argv, plan.grid)
    deadline = None if args.limit_seconds is None else time.perf_counter() + args.limit_seconds
    print(f"tuning {len(plan.problems)} problem(s) x {len(plan.buckets)} M bucket(s) on {platform.describe()}"
          + (f" (shard {args.shard[0]}/{args.shard[1]})" if args.shard else ""), file=sys.stderr)
    with _sigterm_to_interrupt():
        report = tune(plan.problems, m_buckets=plan.buckets, platform=platform, timer=timer, timer_config=config,
                      tie_margin=args.tie_margin, rtol=args.rtol, providers=providers, lockfile=path,
                      progress=not args.no_progress, seed=args.seed, pins=plan.pins, labels=plan.labels, skip=skip,
                      deadline=deadline, provenance=provenance, allow_builds=args.allow_builds)
    return _finish(report, path, report_path)


def _finish(report: TuneReport, path: Path | None, report_path: Path | None) -> int:
    """Print the end of a run, write the ``--report``, and return the exit status (see the module docstring)."""
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
    written = not (path is not None and report.write_errors)
    if report_path is not None:
        written = _write_report(report, report_path) and written
    left = bool(report.stopped and report.remaining)
    if left:
        print(f"stopped ({report.stopped}) with {report.remaining} problem(s) left: run the same command again to "
              "resume")
    if not written:
        return 4
    if left:
        return 3
    if not report.problems:
        print("nothing to do: every problem is in the lockfile")
        return 0
    return 0 if chosen else 1

if __name__ == "__main__":
    sys.exit(main())
