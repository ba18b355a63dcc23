"""Shared benchmark code: run header, output folder, ceilings, the measured grid, and tables.

Timing comes from :mod:`fp8_backends.tuning.timing` (the same code the tuner uses): one CUDA graph per
candidate over input copies rotated past L2, candidates interleaved over several rounds, median per
call. Every candidate is checked against :mod:`fp8_backends.core.reference` before it is timed; a candidate
that fails is recorded with its reason and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import math
import platform as _host
import re
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_backends.core.text_table import text_table
from fp8_backends.core.types import GemmProblem
from fp8_backends.registry import resolution
from fp8_backends.registry.platform import Platform, detect_platform
from fp8_backends.tuning.engine import CandidateResult, measure_candidates
from fp8_backends.tuning.timing import Timer, measure_copy_bandwidth
from fp8_backends.tuning.workloads import CandidateSpec, GemmWorkload, expand_candidates, make_candidate, make_workload

RESULTS_ROOT = Path(__file__).resolve().parent / "results"
VERSIONED = ("fp8-backends", "torch", "triton", "flashinfer-python", "nvidia-cutlass", "cuda-python")


# ---------------------------------------------------------------------------------------- header / output
def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def default_out_dir(platform: Platform) -> Path:
    """``bench/results/<YYYY-MM-DD>-<gpu>/``."""
    return RESULTS_ROOT / f"{_dt.date.today().isoformat()}-{slug(platform.name)}"


def dist_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (None when it is not installed)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {dist: dist_version(dist) for dist in VERSIONED}


def run_header(platform: Platform, device: str) -> dict[str, Any]:
    """Date, GPU, driver, CUDA and library versions, host and command line of this run."""
    import torch

    header: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": platform.name,
        "sm": platform.arch,
        "driver": platform.driver_version,
        "cuda_runtime": platform.cuda_runtime_version or getattr(torch.version, "cuda", None),
        "versions": versions(),
        "python": sys.version.split()[0],
        "host": _host.node(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": device,
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        header["multiprocessors"] = props.multi_processor_count
        header["l2_bytes"] = int(getattr(props, "L2_cache_size", 0) or 0)
        header["memory_gib"] = round(props.total_memory / 2**30, 1)
    return header


def header_markdown(header: dict[str, Any], title: str) -> list[str]:
    v = header["versions"]
    libs = ", ".join(f"{k} {val}" for k, val in v.items() if val) or "-"
    return [
        f"# {title}",
        "",
        f"- date: {header['date']}",
        f"- GPU: {header['gpu']} (SM {header['sm']}), driver {header['driver']}, CUDA runtime {header['cuda_runtime']}",
        f"- versions: {libs}",
        f"- command: `{header['command']}`",
        "",
    ]


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")


def write_markdown(path: Path, lines: Sequence[str]) -> None:
    """Write a report's markdown lines to ``path`` and print them."""
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    print(text)


def add_rounds_device_out(ap: argparse.ArgumentParser, iters: int) -> None:
    """``--rounds`` (5), ``--iters`` (``iters``: calls a sample), ``--device`` (cuda when torch sees one) and the
    required ``--out`` folder: the arguments the interleaved-rounds benches share."""
    import torch

    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=iters)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)


def write_report(out: Path, stem: str, result: Any, lines: Sequence[str]) -> None:
    """Write a run's ``<stem>.json`` and ``<stem>.md`` under ``out`` (the markdown printed too)."""
    write_json(out / f"{stem}.json", result)
    write_markdown(out / f"{stem}.md", lines)


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return lines


#: the library's plain-text table (header, rows) -> str
console_table = text_table


def fmt(value: float | None, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def geomean(values: Sequence[float]) -> float | None:
    """The geometric mean of the positive ``values`` (None when there are none)."""
    kept = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in kept) / len(kept)) if kept else None


def progress(total: int, desc: str, enabled: bool = True) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="pt", dynamic_ncols=True, file=sys.stderr, disable=not enabled)


# ---------------------------------------------------------------------------------------- ceilings
def copy_ceiling(device: str, nbytes: int = 1 << 30) -> float | None:
    """Device-to-device copy bandwidth (GB/s, read + write) measured now; None on the CPU."""
    if not device.startswith("cuda"):
        return None
    return measure_copy_bandwidth(device, nbytes)


def gemm_peak(
    platform: Platform, device: str, timer: Timer, providers: Collection[str] | None = None, size: int = 8192
) -> dict[str, Any]:
    """The best FP8 GEMM rate at ``size``^3 (per-tensor scales, bf16 out) among the providers, measured now."""
    problem = GemmProblem(n=size, k=size, device="cuda" if device.startswith("cuda") else "cpu")
    workload = GemmWorkload(problem, device)
    try:
        cands, _ = expand_candidates("gemm", workload.problem(size), platform, only=providers)
        results = measure_candidates(workload, size, cands, timer)
    finally:
        workload.close()
    flops = 2.0 * size**3
    per = {r.label: flops / (r.us * 1e-6) / 1e12 for r in results if r.ok}
    errors = {r.label: r.reason for r in results if not r.ok}
    best = max(per, key=per.get) if per else None
    return {"size": size, "tflops": per.get(best) if best else None, "provider": best, "per_provider": per,
            "errors": errors}


# ---------------------------------------------------------------------------------------- the grid
@dataclass
class Point:
    """All candidates measured on one problem at one M (or token count)."""

    kind: str
    shape: str
    problem: Any
    m: int
    flops: float
    bytes: float
    results: list[CandidateResult]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    auto_label: str | None = None
    auto_source: str | None = None
    auto_note: str = ""
    auto_error: str | None = None
    baseline_label: str | None = None
    seconds: float = 0.0
    #: providers measured for comparison only (bench baselines ``auto`` can never pick): not oracles
    comparison_only: frozenset[str] = frozenset()

    def result(self, label: str | None) -> CandidateResult | None:
        return next((r for r in self.results if r.label == label), None)

    def us(self, label: str | None) -> float | None:
        r = self.result(label)
        return r.us if r is not None and r.ok else None

    @property
    def oracle(self) -> CandidateResult | None:
        """The fastest correct provider ``auto`` could have picked."""
        ok = [r for r in self.results if r.ok and r.provider not in self.comparison_only]
        return min(ok, key=lambda r: (r.us, r.rank)) if ok else None


def _auto_candidate(
    kind: str, problem: Any, platform: Platform
) -> tuple[CandidateSpec | None, str | None, str, str | None]:
    """What ``auto`` picks for this exact problem (lockfile included): (candidate, source, note, error)."""
    res = resolution.explain(kind, "auto", problem=problem, platform=platform)
    if res.error is not None or res.backend is None or res.chosen is None:
        return None, None, "", f"{type(res.error).__name__}: {res.error}" if res.error else "nothing chosen"
    cand, why = make_candidate(res.chosen.entry, dict(res.backend.config), problem, platform, order=-1)
    return cand, res.source, res.note, (None if cand else why)


def run_grid(
    kind: str,
    templates: Sequence[tuple[str, Any]],
    buckets: Sequence[int],
    platform: Platform,
    device: str,
    timer: Timer,
    *,
    providers: Collection[str] | None = None,
    baseline: str | None = None,
    show_progress: bool = True,
    on_point: Callable[[Point], None] | None = None,
    extra_entries: Sequence[Any] = (),
    pins: Mapping[str, Mapping[str, str]] | None = None,
) -> list[Point]:
    """Measure every candidate (plus what ``auto`` picks, plus the ``baseline`` provider) on every
    ``(shape label, problem template)`` x M bucket. ``extra_entries``: benchmark-only providers
    (e.g. :mod:`bench.compiled_baseline`) measured beside the discovered ones. ``pins``: provider options held
    at one value (see :func:`fp8_backends.tuning.workloads.expand_candidates`)."""
    from fp8_backends.registry.discovery import discover

    entries = [*discover(kind), *extra_entries] if extra_entries else None
    points: list[Point] = []
    bar = progress(len(templates) * len(buckets), kind, show_progress)
    try:
        for shape, template in templates:
            try:
                workload = make_workload(kind, template, device)
            except Exception as exc:
                print(f"skipping {shape}: cannot build inputs ({type(exc).__name__}: {exc})", file=sys.stderr)
                bar.update(len(buckets))
                continue
            failed_prepare: dict[str, str] = {}
            try:
                for m in buckets:
                    t0 = time.perf_counter()
                    problem = workload.problem(m)
                    only = None if providers is None else {*providers, *(e.name for e in extra_entries)}
                    cands, skipped = expand_candidates(kind, problem, platform, only=only, entries=entries,
                                                       pins=pins)
                    auto, source, note, auto_error = _auto_candidate(kind, problem, platform)
                    labels = {c.label for c in cands}
                    if auto is not None and auto.label not in labels:
                        cands.append(auto)
                        labels.add(auto.label)
                    baseline_label = _baseline(kind, baseline, problem, platform, cands, labels)
                    results = measure_candidates(workload, m, cands, timer, failed_prepare)
                    point = Point(kind, shape, problem, m, workload.flops(m), workload.bytes_moved(m), results,
                                  skipped, auto.label if auto else None, source, note, auto_error, baseline_label,
                                  time.perf_counter() - t0, frozenset(e.name for e in extra_entries))
                    points.append(point)
                    if on_point is not None:
                        on_point(point)
                    oracle = point.oracle
                    bar.set_postfix_str(f"{shape} M={m}: {oracle.label if oracle else 'none'}")
                    bar.update(1)
                    workload.release()
            finally:
                workload.close()
                if device.startswith("cuda"):
                    import torch

                    torch.cuda.empty_cache()
    finally:
        bar.close()
    return points


def _baseline(kind, name, problem, platform, cands, labels) -> str | None:
    """The label of ``name`` with its default options, added to ``cands`` when missing."""
    if not name:
        return None
    for cand in cands:
        declared = getattr(cand.entry.cls, "options", {}) or {}
        if cand.provider == name and all(declared[k][0] == v for k, v in cand.options.items() if k in declared):
            return cand.label
    from fp8_backends.registry.discovery import discover

    entry = next((e for e in discover(kind) if e.name == name and e.unusable_reason() is None), None)
    if entry is None:
        return None
    cand, _ = make_candidate(entry, {}, problem, platform, order=-2)
    if cand is None:
        return None
    if cand.label not in labels:
        cands.append(cand)
        labels.add(cand.label)
    return cand.label


def failures_text(points: Sequence[Point]) -> list[str]:
    """One line per distinct failure (label: reason, count)."""
    seen: dict[tuple[str, str], int] = {}
    for p in points:
        for r in p.results:
            if not r.ok:
                reason = r.reason or (r.measurement.error if r.measurement else "?")
                seen[(r.label, reason)] = seen.get((r.label, reason), 0) + 1
        if p.auto_error:
            seen[("auto", p.auto_error)] = seen.get(("auto", p.auto_error), 0) + 1
    return [f"{label}: {reason} ({n} point(s))" for (label, reason), n in sorted(seen.items())]


def add_run_options(ap: argparse.ArgumentParser, cpu_option: str) -> None:
    """The options every measuring bench CLI takes: ``--out``, ``--providers``, ``--device`` (on the CPU only with a
    small ``--<cpu_option>``), ``--rounds``, ``--replays`` (read by :func:`run_setup`)."""
    ap.add_argument("--out", default=None, help="output folder (default bench/results/<date>-<gpu>/)")
    ap.add_argument("--providers", default=None, help="comma-separated provider names (default: all usable)")
    ap.add_argument("--device", default=None, help=f"cuda, cuda:N or cpu (cpu: small --{cpu_option} only)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--replays", type=int, default=None)


def parse_run_args(ap: argparse.ArgumentParser, argv: list[str] | None, cpu_needs: str, cpu_hint: str
                   ) -> tuple[argparse.Namespace, Platform, str]:
    """A bench CLI's arguments and where it runs: ``(args, platform, device)`` with ``device`` ``"cpu"`` or the
    platform's torch device (``--device`` picks the platform). Without a CUDA device the option whose attribute is
    ``cpu_needs`` must be given (the full-size defaults are too large for the CPU): else the parser exits with
    ``no CUDA device: on the CPU pass <cpu_hint>``."""
    args = ap.parse_args(argv)
    platform = detect_platform(args.device)
    device = "cpu" if platform.kind.value == "cpu" else platform.torch_device
    if device == "cpu" and not getattr(args, cpu_needs):
        ap.error(f"no CUDA device: on the CPU pass {cpu_hint}")
    return args, platform, device


def run_setup(args: Any, platform: Platform, device: str) -> tuple[set[str] | None, Any, Path, dict[str, Any]]:
    """``(providers, timer, out, header)`` of a bench run: :func:`providers_from_args`, :func:`timer_from_args`, the
    ``--out`` folder (default :func:`default_out_dir`) and :func:`run_header`."""
    providers = providers_from_args(args)
    timer = timer_from_args(args, device)
    out = Path(args.out) if args.out else default_out_dir(platform)
    return providers, timer, out, run_header(platform, device)


def timer_from_args(args: Any, device: str) -> Any:
    """The timer the ``--quick`` / ``--rounds`` / ``--replays`` options of a bench CLI ask for."""
    from fp8_backends.tuning.timing import TimerConfig, default_timer

    config = TimerConfig.quick() if args.quick else TimerConfig()
    if args.rounds:
        config.rounds = args.rounds
    if args.replays:
        config.replays = args.replays
    return default_timer(device, config)


def providers_from_args(args: Any) -> set[str] | None:
    """``--providers a,b`` as a set (``None``: every usable provider)."""
    if args.providers is None:
        return None
    return {p.strip() for p in args.providers.split(",") if p.strip()}


def host_per_call_us(fn: Callable[[], Any], calls: int, device: str, busy: bool = True, warmup: int = 0,
                     busy_cycles: int = int(1e9)) -> float:
    """Host µs per call: ``calls`` calls enqueued back to back. ``busy``: while the GPU is kept busy, so that no
    call waits for the GPU (only for code that never syncs: a call that syncs would wait for the busy GPU). Without
    it, after a sync: the time until the calls return, which is the host's as long as the GPU keeps up. ``warmup``
    calls first, untimed. ``busy_cycles``: the GPU's sleep ahead of the calls (1e9: ~0.5 s on an H200), longer than
    the calls take to enqueue."""
    import torch

    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(busy_cycles)  # GPU work ahead of the calls: the queue never drains
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    if device == "cuda":
        torch.cuda.synchronize()
    return elapsed / calls * 1e6


def rotated_host_us(fns: Mapping[str, Callable[[], Any]], rounds: int, calls: int, device: str, *,
                    ref: str | None = None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Host µs per call of each function (:func:`host_per_call_us`: 3 warm-up calls, then ``calls`` calls enqueued
    while the GPU is kept busy), every function once per round in an order rotated each round, ``rounds`` rounds:
    ``(samples, ratios)``, each function's samples and its ratios to ``ref``'s sample of the same round (empty lists
    without ``ref`` or when ``ref`` is not among ``fns``). A host whose speed drifts reaches every function alike."""
    keys = list(fns)
    samples: dict[str, list[float]] = {key: [] for key in keys}
    ratios: dict[str, list[float]] = {key: [] for key in keys}
    for r in range(rounds if keys else 0):
        shift = r % len(keys)
        got = {key: host_per_call_us(fns[key], calls, device, warmup=3, busy_cycles=int(2e8))
               for key in keys[shift:] + keys[:shift]}
        for key, us in got.items():
            samples[key].append(us)
            if ref in got:
                ratios[key].append(us / got[ref])
    return samples, ratios
