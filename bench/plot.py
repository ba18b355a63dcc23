"""Plots for the benchmarks (matplotlib, Agg backend: no display needed).

- :func:`roofline`: achieved TFLOP/s against arithmetic intensity (FLOP per DRAM byte), one marker
  style per provider, with the run's measured ceilings (copy bandwidth slope, best FP8 GEMM rate).
- :func:`bandwidth`: achieved GB/s against bytes moved per call, one marker per provider, with the
  copy-bandwidth ceiling (for memory-bound ops such as RMSNorm + quant).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p", "d", "8")


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(rows: Sequence[dict[str, Any]], x: str, y: str) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        if r.get(x) and r.get(y):
            xs, ys = out.setdefault(r["label"], ([], []))
            xs.append(r[x])
            ys.append(r[y])
    return out


def _scatter(ax: Any, series: dict[str, tuple[list[float], list[float]]]) -> None:
    import matplotlib

    colors = matplotlib.colormaps["tab10"]
    for i, (label, (xs, ys)) in enumerate(sorted(series.items())):
        ax.scatter(xs, ys, s=22, marker=MARKERS[i % len(MARKERS)], color=colors(i % 10), alpha=0.8, label=label)


def roofline(rows: Sequence[dict[str, Any]], copy_gbps: float | None, peak_tflops: float | None, path: Path,
             title: str) -> Path:
    """``rows``: dicts with ``label``, ``intensity`` (FLOP/byte) and ``tflops``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    series = _series(rows, "intensity", "tflops")
    _scatter(ax, series)
    xs = [x for pts in series.values() for x in pts[0]]
    if xs and (copy_gbps or peak_tflops):
        lo, hi = min(xs) / 2, max(xs) * 2
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        roof = [min(peak_tflops or float("inf"), x * (copy_gbps or float("inf")) / 1e3) for x in grid]
        label = (f"roofline: copy {copy_gbps:.0f} GB/s" if copy_gbps else "roofline") + (
            f", FP8 GEMM peak {peak_tflops:.0f} TFLOP/s" if peak_tflops else "")
        ax.plot(grid, roof, color="black", linewidth=1.2, label=label)
    return _save_loglog(plt, fig, ax, path, "arithmetic intensity (FLOP / DRAM byte, x + w + y)",
                        "achieved TFLOP/s", title)


def bandwidth(rows: Sequence[dict[str, Any]], copy_gbps: float | None, path: Path, title: str) -> Path:
    """``rows``: dicts with ``label``, ``bytes`` (per call) and ``gbps``."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 6))
    series = _series(rows, "bytes", "gbps")
    _scatter(ax, series)
    if copy_gbps:
        ax.axhline(copy_gbps, color="black", linewidth=1.2, label=f"copy ceiling {copy_gbps:.0f} GB/s")
    return _save_loglog(plt, fig, ax, path, "bytes moved per call", "achieved GB/s", title)


def _save_loglog(plt: Any, fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Log-log axes, labels, grid and legend; write ``path`` (PNG) and close the figure."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path

