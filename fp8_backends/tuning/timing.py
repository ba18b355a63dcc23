"""Timing primitives shared by the tuner (:mod:`.engine`) and the benchmarks (``bench/``).

Method (CUDA): each candidate is a :class:`Run`: ``fn(i)`` does one call on input set ``i``; the sets are
copies of the same data, enough of them to rotate the working set past L2 (:func:`rotation_count`).
:class:`CudaGraphTimer` warms every candidate up (on a side stream), captures one CUDA graph per
candidate that calls it once per set (repeated in ``passes`` so a replay lasts about
``target_replay_us``), checks the graph's outputs (NaN-filled first) where the run has a ``check``,
then replays the candidates *interleaved*: ``rounds`` rounds, each replaying every candidate
``replays`` times in a rotated order, each replay timed with a CUDA event pair. A sample is one
replay's time divided by its number of calls; the result is the median of the samples, so slow
drift (power capping at large M) hits every candidate alike. When capture fails the candidate is
timed eagerly (same events and rounds; ``method="eager"``).

On the CPU, :class:`CpuTimer` does the same with ``time.perf_counter``. A *timer* is any callable
``timer(runs: Mapping[str, Run]) -> dict[str, Measurement]``: tests inject fake ones.

torch is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

DEFAULT_L2_BYTES = 60 * 1024 * 1024  # H200 / H100 class; used when the device does not say


@dataclass
class Run:
    """One candidate's work.

    - ``fn(i)``: one call on input set ``i`` (``0 <= i < n_sets``); returns the output tensor to check.
    - ``check(out)``: ``(error, reason)``, ``reason`` None when ``out`` is right. The graph timer runs it on
      graph outputs after a NaN fill; leave it None for calls that are not idempotent (in-place updates).
    """

    fn: Callable[[int], Any]
    n_sets: int = 1
    check: Callable[[Any], tuple[float, str | None]] | None = None


@dataclass
class Measurement:
    """Per-call microseconds of one candidate (median of ``samples_us``) or why it could not be timed."""

    median_us: float | None
    samples_us: list[float] = field(default_factory=list)
    method: str = ""
    error: str | None = None
    calls_per_sample: int = 1

    @property
    def ok(self) -> bool:
        return self.error is None and self.median_us is not None

    @classmethod
    def of(cls, samples_us: list[float], method: str, calls_per_sample: int = 1) -> Measurement:
        if not samples_us:
            return cls.failed("no samples", method)
        return cls(statistics.median(samples_us), list(samples_us), method, None, calls_per_sample)

    @classmethod
    def failed(cls, error: str, method: str = "") -> Measurement:
        return cls(None, [], method, error)

    def spread(self) -> tuple[float, float] | None:
        """(10th, 90th) percentile of the samples (None with fewer than two)."""
        if len(self.samples_us) < 2:
            return None
        s = sorted(self.samples_us)
        lo = s[int(0.1 * (len(s) - 1))]
        hi = s[int(math.ceil(0.9 * (len(s) - 1)))]
        return lo, hi

    def to_json(self) -> dict[str, Any]:
        spread = self.spread()
        return {
            "median_us": None if self.median_us is None else round(self.median_us, 4),
            "p10_us": None if spread is None else round(spread[0], 4),
            "p90_us": None if spread is None else round(spread[1], 4),
            "samples": len(self.samples_us),
            "calls_per_sample": self.calls_per_sample,
            "method": self.method,
            "error": self.error,
        }


class Timer(Protocol):
    def __call__(self, runs: Mapping[str, Run]) -> dict[str, Measurement]: ...


@dataclass
class TimerConfig:
    """How hard to measure. ``quick()`` is for smoke runs."""

    rounds: int = 5
    replays: int = 3
    warmup: int = 1
    target_replay_us: float = 300.0
    max_passes: int = 16
    use_graphs: bool = True

    @classmethod
    def quick(cls) -> TimerConfig:
        return cls(rounds=3, replays=2, warmup=1, target_replay_us=200.0, max_passes=8)


def rotation_count(set_bytes: float, l2_bytes: float, *, factor: float = 4.0, minimum: int = 2,
                   maximum: int = 32) -> int:
    """How many input sets to rotate so that one pass touches more than ``factor`` x L2."""
    if set_bytes <= 0 or l2_bytes <= 0:
        return max(1, minimum)
    return int(min(maximum, max(minimum, math.ceil(factor * l2_bytes / set_bytes))))


def l2_cache_bytes(device: Any = None) -> int:
    """The device's L2 size (``DEFAULT_L2_BYTES`` when torch does not report it); 0 for the CPU."""
    import torch

    dev = torch.device(device if device is not None else "cuda")
    if dev.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(dev)
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def _rotated(labels: list[str], r: int) -> list[str]:
    if not labels:
        return labels
    k = r % len(labels)
    return labels[k:] + labels[:k]


class GraphOutputError(RuntimeError):
    """A candidate's CUDA graph did not write correct outputs."""


def _fail_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


class _Replayer:
    calls: int
    method: str

    def time(self, replays: int) -> list[float]:  # per-call µs, one sample per replay
        raise NotImplementedError


class _GraphReplayer(_Replayer):
    def __init__(self, torch: Any, run: Run, cfg: TimerConfig, per_call_us: float) -> None:
        self.torch = torch
        passes = max(1, min(cfg.max_passes, math.ceil(cfg.target_replay_us / max(per_call_us * run.n_sets, 1e-3))))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(passes - 1):
                for i in range(run.n_sets):
                    run.fn(i)  # outputs dropped: the pool reuses their memory
            outs = [run.fn(i) for i in range(run.n_sets)]
        self.graph, self.calls, self.method = graph, passes * run.n_sets, "cuda_graph"
        graph.replay()
        torch.cuda.synchronize()
        if run.check is not None:  # the graph must really write its outputs
            for o in outs:
                _poison(torch, o)
            graph.replay()
            torch.cuda.synchronize()
            for o in outs:
                _, reason = run.check(o)
                if reason:
                    raise GraphOutputError(f"wrong output under CUDA graph replay: {reason}")
        self.outs = outs

    def time(self, replays: int) -> list[float]:
        torch = self.torch
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in pairs:
            start.record()
            self.graph.replay()
            end.record()
        pairs[-1][1].synchronize()
        return [start.elapsed_time(end) * 1000.0 / self.calls for start, end in pairs]


def _poison(torch: Any, t: Any) -> None:
    """Fill an output with NaN (fp8: byte 0x7F, NaN in e4m3fn and e5m2) so a stale result cannot pass."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return
    if t.element_size() == 1:
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))


class _EagerReplayer(_Replayer):
    def __init__(self, torch: Any, run: Run, method: str = "eager") -> None:
        self.torch, self.run, self.calls, self.method = torch, run, run.n_sets, method

    def time(self, replays: int) -> list[float]:
        torch = self.torch
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
        for start, end in pairs:
            start.record()
            for i in range(self.run.n_sets):
                self.run.fn(i)
            end.record()
        pairs[-1][1].synchronize()
        return [start.elapsed_time(end) * 1000.0 / self.calls for start, end in pairs]


class CudaGraphTimer:
    """Interleaved CUDA-graph timing of several candidates (see the module docstring)."""

    def __init__(self, config: TimerConfig | None = None, device: Any = None) -> None:
        self.config = config or TimerConfig()
        self.device = device

    def __call__(self, runs: Mapping[str, Run]) -> dict[str, Measurement]:
        import torch

        cfg = self.config
        results: dict[str, Measurement] = {}
        replayers: dict[str, _Replayer] = {}
        with torch.cuda.device(torch.device(self.device or "cuda")):
            for label, run in runs.items():
                try:
                    replayers[label] = self._prepare(torch, run)
                except Exception as exc:
                    results[label] = Measurement.failed(_fail_text(exc))
                    _recover(torch)
            samples: dict[str, list[float]] = {label: [] for label in replayers}
            labels = list(replayers)
            for r in range(cfg.rounds):
                for label in _rotated(labels, r):
                    if label in results:
                        continue
                    try:
                        samples[label] += replayers[label].time(cfg.replays)
                    except Exception as exc:
                        results[label] = Measurement.failed(_fail_text(exc), replayers[label].method)
                        _recover(torch)
            for label, rep in replayers.items():
                if label not in results:
                    results[label] = Measurement.of(samples[label], rep.method, rep.calls)
            replayers.clear()
        return {label: results[label] for label in runs}

    def _prepare(self, torch: Any, run: Run) -> _Replayer:
        cfg = self.config
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream (library handles, workspaces)
            for _ in range(max(1, cfg.warmup)):
                for i in range(run.n_sets):
                    run.fn(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(run.n_sets):
            run.fn(i)
        end.record()
        end.synchronize()
        per_call_us = start.elapsed_time(end) * 1000.0 / run.n_sets
        if not cfg.use_graphs:
            return _EagerReplayer(torch, run)
        try:
            return _GraphReplayer(torch, run, cfg, per_call_us)
        except GraphOutputError:
            raise
        except Exception as exc:
            _recover(torch)
            return _EagerReplayer(torch, run, f"eager (graph capture failed: {_fail_text(exc)})")


def _recover(torch: Any) -> None:
    """Best-effort cleanup after a failed candidate (OOM, aborted capture)."""
    with contextlib.suppress(Exception):
        torch.cuda.synchronize()
    torch.cuda.empty_cache()


class CpuTimer:
    """Interleaved wall-clock timing for CPU tensors (same rounds/replays as the CUDA timer)."""

    def __init__(self, config: TimerConfig | None = None) -> None:
        self.config = config or TimerConfig(rounds=3, replays=2)

    def __call__(self, runs: Mapping[str, Run]) -> dict[str, Measurement]:
        cfg = self.config
        results: dict[str, Measurement] = {}
        samples: dict[str, list[float]] = {label: [] for label in runs}
        for label, run in runs.items():
            try:
                for _ in range(max(1, cfg.warmup)):
                    for i in range(run.n_sets):
                        run.fn(i)
            except Exception as exc:
                results[label] = Measurement.failed(_fail_text(exc), "cpu")
        labels = [label for label in runs if label not in results]
        for r in range(cfg.rounds):
            for label in _rotated(labels, r):
                if label in results:
                    continue
                run = runs[label]
                try:
                    for _ in range(cfg.replays):
                        t0 = time.perf_counter()
                        for i in range(run.n_sets):
                            run.fn(i)
                        samples[label].append((time.perf_counter() - t0) * 1e6 / run.n_sets)
                except Exception as exc:
                    results[label] = Measurement.failed(_fail_text(exc), "cpu")
        for label in labels:
            if label not in results:
                results[label] = Measurement.of(samples[label], "cpu", runs[label].n_sets)
        return {label: results[label] for label in runs}


def default_timer(device: Any, config: TimerConfig | None = None) -> Timer:
    """:class:`CudaGraphTimer` for CUDA devices, :class:`CpuTimer` for the CPU."""
    text = str(device)
    if text.startswith("cuda"):
        return CudaGraphTimer(config, device)
    return CpuTimer(config)


def measure_copy_bandwidth(device: Any = "cuda", nbytes: int = 1 << 30, config: TimerConfig | None = None) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written): eager ``copy_`` timed with
    CUDA events, median of ``rounds * replays`` copies after two warm-ups.

    Not graph-timed: the 2026-11-29 H200 runs measured 2708-2763 GB/s for a copy captured in a CUDA
    graph against 4173 GB/s for the same copy issued eagerly in the same session
    (and 4248-4274 GB/s in ../shared/notes/device-baseline.md), so a graph-timed copy understates the
    ceiling the kernels are compared with."""
    import statistics

    import torch

    cfg = config or TimerConfig(rounds=3, replays=5)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(2 + max(1, cfg.rounds * cfg.replays)):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    return 2 * nbytes / statistics.median(times) / 1e9


__all__ = [
    "CpuTimer",
    "CudaGraphTimer",
    "Measurement",
    "Run",
    "Timer",
    "TimerConfig",
    "default_timer",
    "l2_cache_bytes",
    "measure_copy_bandwidth",
    "rotation_count",
]
