"""``bench.eval_replay``: the shipped data's rankings replayed against ``bench.auto_eval`` timings (CPU)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # appended: the installed fp8_backends keeps precedence over the source tree
eval_replay = pytest.importorskip("bench.eval_replay", reason="needs the repository's bench/ folder")

CUT = {"provider": "cutlass", "options": {"config": "auto"}}
TSM = {"provider": "torch_scaled_mm", "options": {"fast_accum": "true"}}
FI = {"provider": "flashinfer_bmm", "options": {"runner": "cublas"}}
LABELS = {"cutlass": "cutlass[config=auto,fast_accum=true]", "torch_scaled_mm": "torch_scaled_mm[fast_accum=true]",
          "flashinfer_bmm": "flashinfer_bmm[runner=cublas,autotune=off]"}


def entry(choice, ranking):
    """An entry as the tuner records it: ``ranking`` fastest first, ``(record, µs)`` pairs."""
    return {"choice": {**choice, "us": dict((r["provider"], us) for r, us in ranking)[choice["provider"]]},
            "ranking": [{**r, "us": us} for r, us in ranking]}


def row(n, m, candidates, source="shipped-exact", torch_us=None):
    """An auto_eval row timing ``candidates`` (provider -> µs) at N x K = n x 4096."""
    timed = {LABELS[p]: us for p, us in candidates.items()}
    return {"shape": f"{n}x4096", "n": n, "k": 4096, "m": m, "source": source, "fastest_us": min(timed.values()),
            "torch_us": torch_us if torch_us is not None else candidates["torch_scaled_mm"], "candidates": timed}


def key(n, m):
    return f"gemm/n={n}/k=4096/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0/m={m}"


#: two points: at M = 4096 the tuner measured cutlass 1% ahead and the 2% rule recorded torch_scaled_mm; the run
#: then measured cutlass 10% ahead. At M = 1 torch_scaled_mm was the fastest and the choice.
ENTRIES = {
    key(4096, 4096): entry(TSM, [(CUT, 99.0), (TSM, 100.0), (FI, 101.0)]),
    key(4096, 1): entry(TSM, [(TSM, 10.0), (CUT, 10.5), (FI, 11.0)]),
}
ROWS = [
    row(4096, 4096, {"cutlass": 90.0, "torch_scaled_mm": 100.0, "flashinfer_bmm": 101.0}),
    row(4096, 1, {"cutlass": 10.5, "torch_scaled_mm": 10.0, "flashinfer_bmm": 11.0}),
    row(1024, 1, {"cutlass": 5.0, "torch_scaled_mm": 5.0}),  # no entry: not replayed
    row(4096, 16, {"cutlass": 5.0, "torch_scaled_mm": 5.0}, source="shipped-nearest"),  # not exact: not replayed
]


def test_labels_match_records_by_provider_and_recorded_options():
    assert eval_replay.parse_label("cutlass[config=auto,fast_accum=true]") == (
        "cutlass", {"config": "auto", "fast_accum": "true"})
    assert eval_replay.parse_label("triton") == ("triton", {})
    assert eval_replay.matches("cutlass[config=auto,fast_accum=true]", CUT)
    assert not eval_replay.matches("cutlass[config=ws64x16_swap,fast_accum=true]", CUT)
    assert not eval_replay.matches("torch_scaled_mm[fast_accum=false]", TSM)
    assert eval_replay.entry_key(ROWS[0]) == key(4096, 4096)
    assert [r["m"] for r, _ in eval_replay.exact_points(ENTRIES, ROWS)] == [4096, 1]


def test_pick_keeps_the_recorded_choice_only_within_the_margin():
    e = ENTRIES[key(4096, 4096)]  # the choice is 1.0% behind the fastest
    assert eval_replay.pick(e, 0.02)["provider"] == "torch_scaled_mm"  # the recorded choice
    assert eval_replay.pick(e, 0.011)["provider"] == "torch_scaled_mm"  # within the margin: kept
    assert eval_replay.pick(e, 0.005)["provider"] == "cutlass"  # beyond it: the fastest
    assert eval_replay.pick(e, 0.0)["provider"] == "cutlass"


def test_tie_margin_replay_times_each_margins_picks_with_the_run():
    by_margin = {r["margin"]: r for r in eval_replay.tie_margin_replay(ENTRIES, ROWS, (0.0, 0.02))}
    recorded, fastest = by_margin[0.02], by_margin[0.0]
    assert recorded["n"] == fastest["n"] == 2
    # margin 0.02 keeps torch_scaled_mm at M = 4096: 90 / 100 of the run's fastest
    assert recorded["min"] == pytest.approx(0.9) and recorded["below_0.97"] == 1
    assert recorded["geomean"] == pytest.approx(0.9 ** 0.5)
    # margin 0 picks cutlass there, the run's fastest; M = 1 is torch_scaled_mm either way
    assert fastest["min"] == pytest.approx(1.0) and fastest["below_0.97"] == 0
    assert fastest["decode_n"] == 1 and fastest["decode_min"] == pytest.approx(1.0)
    assert fastest["decode_below_0.98"] == 0


def test_noise_divides_out_the_shift_a_point_shares():
    # every candidate 20% slower at M = 1 (a shared shift): no noise there; at M = 4096 cutlass moved alone
    rows = [row(4096, 1, {"cutlass": 12.6, "torch_scaled_mm": 12.0, "flashinfer_bmm": 13.2}),
            row(4096, 4096, {"cutlass": 90.0, "torch_scaled_mm": 100.0, "flashinfer_bmm": 101.0})]
    result = eval_replay.run_to_run_noise(ENTRIES, rows)
    assert result["points"] == 2 and result["n"] == 6
    assert result["moved"] == 1  # cutlass at M = 4096: (90 / 99) / (100 / 100) = 0.909
    assert result["p1"] == pytest.approx(90 / 99)
    assert result["p50"] == pytest.approx(1.0)


def test_runs_noise_compares_two_runs_point_by_point():
    later = [row(4096, 4096, {"cutlass": 180.0, "torch_scaled_mm": 200.0, "flashinfer_bmm": 202.0}),  # shift 2x
             row(4096, 1, {"cutlass": 10.5, "torch_scaled_mm": 11.0, "flashinfer_bmm": 11.0}),
             row(8192, 1, {"cutlass": 1.0, "torch_scaled_mm": 1.0})]  # not in the first run
    result = eval_replay.runs_noise(ROWS, later)
    assert result["points"] == 2 and result["n"] == 6
    # M = 4096: every candidate 2x (the shared shift); M = 1: torch_scaled_mm alone 10% slower
    assert result["moved"] == 1 and result["p1"] == result["p50"] == pytest.approx(1.0)
    assert eval_replay.quantiles([]) == {"n": 0, "moved": 0}


def test_cli_reads_gzip_and_prints_markdown(tmp_path, capsys):
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"sections": {"a": {"entries": ENTRIES}}}))
    run = tmp_path / "run.json.gz"
    with gzip.open(run, "wt") as f:
        json.dump({"rows": ROWS}, f)
    assert eval_replay.read_json(run)["rows"] == ROWS

    assert eval_replay.main(["tie-margin", str(data), str(run), "--margins", "0", "0.02"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| tie margin | points |")
    assert out[2] == "| 0 | 2 | 1.0000 | 1.000 | 0 | 1 | 1.000 | 0 |"
    assert out[3] == "| 0.02 | 2 | 0.9487 | 0.900 | 1 | 1 | 1.000 | 0 |"

    assert eval_replay.main(["noise", str(data), str(run)]) == 0
    assert "2 points, 6 candidate timings" in capsys.readouterr().out
    assert eval_replay.main(["runs", str(run), str(run)]) == 0
    assert "moved by more than 3%: 0" in capsys.readouterr().out
