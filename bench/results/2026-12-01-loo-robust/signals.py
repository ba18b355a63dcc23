"""Why risk-aware choice does not help: do the model's own uncertainty signals tell its misses apart, and when
they do, is there a better candidate to switch to? (no GPU; reads the ``harness.py`` cache)

    python bench/results/2026-12-01-loo-robust/signals.py > bench/results/2026-12-01-loo-robust/signals.md

1. For each signal, the AUC of separating the current picks below 0.95 of the fastest from the others (0.5: no
   information; 1.0: every miss has a higher signal than every hit).
2. The points split by whether the neighbours agree on the winner (each neighbour's world: the trend here plus its
   residual), with what the current pick, the minimax-regret pick, the best and the worst of the neighbours' winners
   (an oracle that knows which neighbour to follow), and the oracle over all candidates reach there.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import rules as v  # noqa: E402


def auc(pos, neg) -> float:
    total = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return total / (len(pos) * len(neg))


def signals(rec, ck) -> dict[str, float]:
    mus = sorted(rec["mu"].values())
    ws = v.worlds(rec)
    mean = sum(w * L[ck] for w, L in ws)
    return {
        "small margin to the runner-up": -(mus[1] - mus[0]),
        "distance to the nearest shape": rec["nbs"][0][1],
        "neighbours' winners (count)": len({min(L, key=L.get) for _, L in ws}),
        "spread of the pick over the neighbours": math.sqrt(sum(w * (L[ck] - mean) ** 2 for w, L in ws)),
        "pick's worst regret at a neighbour": max(L[ck] - min(L.values()) for _, L in ws),
        "pick's RMS error on the training shapes": v.rms(v.errors(rec, ck, 1)),
        "trend leverage": rec["h"],
    }


def main() -> None:
    cache = harness.load()
    names = list(signals(cache["model"][0], cache["model"][0]["keys"][0]))
    print("## 1. AUC of each signal for the current picks below 0.95\n")
    print("| signal | " + " | ".join(v.SETS) + " |\n|---|" + "---|" * len(v.SETS))
    table = {}
    for g in v.SETS:
        rows = []
        for r in cache[g]:
            ck = v.pick(r, v.mean)
            rows.append((v.speed(r, ck) < 0.95, signals(r, ck)))
        pos = [s for miss, s in rows if miss]
        neg = [s for miss, s in rows if not miss]
        table[g] = {n: auc([p[n] for p in pos], [q[n] for q in neg]) for n in names}
    for n in names:
        print(f"| {n} | " + " | ".join(f"{table[g][n]:.2f}" for g in v.SETS) + " |")
    print("\n## 2. Points by neighbour agreement (geomean / min / points below 0.95)\n")
    print("| held out | neighbours | points | current pick | minimax regret | best neighbour winner (oracle) | "
          "worst neighbour winner | best candidate (oracle) |\n|---|---|---|---|---|---|---|---|")
    for g in v.SETS:
        split: dict[str, list] = {"disagree": [], "agree": []}
        for r in cache[g]:
            winners = {min(L, key=L.get) for _, L in v.worlds(r)}
            ok = [ck for ck in r["keys"] if r["rank"][ck] is not None]
            split["disagree" if len(winners) > 1 else "agree"].append((
                v.speed(r, v.pick(r, v.mean)), v.speed(r, v.pick(r, v.worst_regret)),
                max(v.speed(r, c) for c in winners), min(v.speed(r, c) for c in winners),
                max(v.speed(r, c) for c in ok)))
        for name, rows in split.items():
            cols = list(zip(*rows))
            print(f"| {g} | {name} | {len(rows)} | " + " | ".join(v.cell(v.stats(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
