"""``bench/unaligned.py`` on the CPU: a small pair through the whole run (candidates, one interleaved timing per M,
the table, the targets, the JSON and Markdown files)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")


def test_cpu_smoke_run(tmp_path, capsys):
    from bench import unaligned

    assert unaligned.main(["--device", "cpu", "--pairs", "40,72:48,80", "--m", "1,3", "--quick", "--rounds", "1",
                           "--replays", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "unaligned.json").read_text())
    assert data["schema"] == "fp8_backends.bench.unaligned/1" and data["m_values"] == [1, 3]
    rows = data["rows"]
    assert {r["m"] for r in rows} == {1, 3} and all(r["pair"] == [[40, 72], [48, 80]] for r in rows)
    # torch's CPU _scaled_mm serves the unaligned shape and auto picks it: both sides timed
    served = [r for r in rows if r["provider"].startswith("torch_scaled_mm")]
    assert served and all(r["unaligned_us"] and r["aligned_us"] and r["time_ratio"] for r in served)
    assert all("unaligned" in r["auto"] for r in served)
    assert 0.7 < served[0]["bytes_ratio"] < 0.8  # (40*72 + M*72 + M*40*2) / (48*80 + ...)
    assert data["targets"]["auto_serves_unaligned"] == {"points": 2, "met": 2, "violations": []}
    # the auto layers of both shapes in each scale mode, bf16 in: the no-cliff target is theirs
    layers = data["layer_rows"]
    assert {(r["m"], r["mode"]) for r in layers} == {(m, mode) for m in (1, 3) for mode in unaligned.LAYER_MODES}
    assert all(r["provider"]["unaligned"] == "torch_scaled_mm" and r["time_ratio"] for r in layers)
    assert data["targets"]["no_cliff"]["points"] == len(layers)
    md = (tmp_path / "unaligned.md").read_text()
    assert "| 40x72 | 48x80 |" in md and "Fp8Linear(backend=\"auto\")" in md
    assert "target no_cliff" in capsys.readouterr().out


def test_pairs_are_parsed_strictly():
    from bench import unaligned

    assert unaligned.parse_pair("3420,6840:3456,6912") == ((3420, 6840), (3456, 6912))
    for bad in ("3420,6840", "3420:3456", "0,1:16,16", "a,b:c,d"):
        with pytest.raises(ValueError):
            unaligned.parse_pair(bad)
