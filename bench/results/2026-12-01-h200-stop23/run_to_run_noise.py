"""Stop 23 analysis (no GPU): each candidate's time in an auto_eval run over its time in the tuning run (the shipped
data's ranking), divided by the median ratio of the point's candidates (the shift every candidate shares).

    python bench/results/2026-12-01-h200-stop23/run_to_run_noise.py /tmp/shipped-2pct.json \\
        bench/results/2026-12-01-h200-stop23/call2/ingrid/auto_eval.json
"""

from __future__ import annotations

import statistics
import sys

from _common_replay import exact_points, load, matches


def main() -> None:
    entries, rows = load(sys.argv[1], sys.argv[2])
    rel: list[float] = []
    points = 0
    for row, entry in exact_points(entries, rows):
        ratios = []
        for label, us in row["candidates"].items():
            tuned = next((r["us"] for r in entry["ranking"] if matches(label, r)), None)
            if tuned:
                ratios.append(us / tuned)
        if len(ratios) < 2:
            continue
        med = statistics.median(ratios)
        rel.extend(r / med for r in ratios)
        points += 1
    rel.sort()

    def q(p: float) -> float:
        return rel[int(p * (len(rel) - 1))]

    moved = sum(abs(v - 1) > 0.03 for v in rel)
    print(f"points {points}, candidate timings {len(rel)}: eval/tuned relative to the point's median ratio: "
          f"p1 {q(0.01):.3f} p5 {q(0.05):.3f} p50 {q(0.5):.3f} p95 {q(0.95):.3f} p99 {q(0.99):.3f}; "
          f"beyond +-3%: {moved}")


if __name__ == "__main__":
    main()
