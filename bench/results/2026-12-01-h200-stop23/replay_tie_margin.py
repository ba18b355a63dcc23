"""Stop 23 analysis (no GPU): the shipped data's recorded rankings re-decided with other near-tie margins, each
pick timed by an auto_eval run.

    git show b4e1bd1:fp8_backends/data/selection/sm90-nvidia-h200.json > /tmp/shipped-2pct.json  # the data before
    python bench/results/2026-12-01-h200-stop23/replay_tie_margin.py /tmp/shipped-2pct.json \\
        bench/results/2026-12-01-h200-stop23/call2/ingrid/auto_eval.json

At margin 0.02 a pick is the data's recorded choice (the tuner's 2% rule then), at 0 the fastest of the ranking, in
between the recorded choice when it is within the margin of the fastest, else the fastest.
"""

from __future__ import annotations

import math
import sys

from _common_replay import exact_points, load, matches


def pick(entry: dict, margin: float) -> dict:
    ranking = entry["ranking"]
    if margin >= 0.02:
        return entry["choice"]
    choice = entry["choice"]
    near = [r for r in ranking if r["us"] <= ranking[0]["us"] * (1 + margin)]
    kept = any(r["provider"] == choice["provider"] and r["options"] == choice["options"] for r in near)
    return choice if margin > 0 and kept else ranking[0]


def main() -> None:
    entries, rows = load(sys.argv[1], sys.argv[2])
    for margin in (0.0, 0.0025, 0.005, 0.01, 0.02):
        speeds, decode = [], []
        for row, entry in exact_points(entries, rows):
            chosen = pick(entry, margin)
            label = next(c for c in row["candidates"] if matches(c, chosen))
            speeds.append(row["fastest_us"] / row["candidates"][label])
            if row["m"] <= 16:
                decode.append(row["torch_us"] / row["candidates"][label])
        geomean = math.exp(sum(map(math.log, speeds)) / len(speeds))
        below = sum(s < 0.97 for s in speeds)
        print(f"margin {margin}: n={len(speeds)} geomean {geomean:.4f} min {min(speeds):.3f} below0.97 {below}; "
              f"M <= 16 against torch: n={len(decode)} min {min(decode):.3f} below0.98 {sum(d < 0.98 for d in decode)}")


if __name__ == "__main__":
    main()
