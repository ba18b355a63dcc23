"""A model variant from the miss study (no GPU): clamp *every* trend feature to the measured range, not only log N
and log K, so the trend never extrapolates (at 8192x3696, M = 1024 the 4 neighbours measured cuBLAS and Triton /
CUTLASS within 2% of each other, and only the trend's alignment slope, extrapolated to a K that 32 does not
divide, made Triton look 6% faster):

    python bench/results/2026-12-01-loo-robust/clamp_all.py     # ~25 s

Same leave-out as ``selection_data loo`` and the replay of ``../2026-12-01-loo-model2/heldout_replay.py``; cells:
geomean / min / points below 0.95 of the fastest.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "2026-12-01-loo-model2"))

import heldout_replay  # noqa: E402

from fp8_backends import selection_data  # noqa: E402
from fp8_backends.registry import nearest, shipped_data  # noqa: E402

_fit = nearest._fit_trend


def fit_with_ranges(xs, logs, trend):
    fitted = _fit(xs, logs, trend)
    object.__setattr__(fitted, "ranges", [(min(x[j] for x in xs), max(x[j] for x in xs)) for j in range(len(xs[0]))])
    return fitted


def clamp_every_feature(self, x):
    return tuple(min(max(v, lo), hi) for v, (lo, hi) in zip(x, self.ranges))


def main() -> None:
    nearest._fit_trend = fit_with_ranges
    nearest._BucketTrend.clamp = clamp_every_feature
    doc = shipped_data.load_file(heldout_replay.DATA)
    cells = []
    for group in ("model", "family", "tp", "shape"):
        report = selection_data.leave_out_report(doc, group)
        st = report["overall"]["nearest"]
        cells.append(f"{st['geomean']:.4f} / {st['min']:.3f} / {report['overall']['points'] - st['at_least_0.95']}")
    g, lo, ok = heldout_replay.summary(heldout_replay.replay(nearest.build_models, nearest.TIE_MARGIN))
    cells.append(f"{g:.4f} / {lo:.3f} / {len(heldout_replay.bench_rows()) - ok}")
    print("| variant | by model | by family | by TP | by shape | held-out bench replay |\n|---|---|---|---|---|---|")
    print("| trend with every feature clamped to the measured range | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
