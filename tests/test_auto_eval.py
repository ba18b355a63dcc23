"""``bench.auto_eval``: the per-point verdicts and targets from measured rows, a CPU smoke run, sharding and merging."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # appended: the installed fp8_backends keeps precedence over the source tree
auto_eval = pytest.importorskip("bench.auto_eval", reason="needs the repository's bench/ folder")


def row(shape, m, source, auto_us, fastest_us, torch_us, auto="a", fastest="f"):
    return {"shape": shape, "n": 64, "k": 64, "m": m, "source": source, "auto": auto, "auto_note": "",
            "auto_error": None, "auto_us": auto_us, "fastest": fastest, "fastest_us": fastest_us,
            "torch_us": torch_us, "auto_vs_fastest": fastest_us / auto_us, "auto_vs_torch": torch_us / auto_us,
            "candidates": {}}


def test_targets_by_source():
    rows = [
        row("s1", 1, "shipped-exact", 10.0, 10.0, 10.0),
        row("s1", 16, "shipped-exact", 10.5, 10.0, 10.2),  # 0.952 of the fastest; 0.971x torch at decode
        row("s1", 256, "shipped-exact", 10.0, 10.0, 11.0),
        row("s1", 4096, "shipped-exact", 100.0, 99.0, 104.0),
        row("s2", 1, "shipped-nearest", 10.0, 9.6, 10.0),  # 0.96
        row("s2", 64, "shipped-nearest", 10.0, 9.0, 10.0),  # 0.90: below 0.95
        row("s3", 1, "priority", 10.0, 10.0, 10.0),
    ]
    result = auto_eval.summarize(rows)
    t = result["targets"]
    assert t["exact: auto >= 0.97 of the fastest at every point"]["points"] == 4
    assert t["exact: auto >= 0.97 of the fastest at every point"]["violations"] == ["s1 M=16: a 0.952"]
    prefill = t["exact, M >= 256: auto >= 1.04x torch geomean"]
    assert prefill["value"] == pytest.approx((1.1 * 1.04) ** 0.5) and prefill["met"] is True
    assert t["exact, M <= 16: auto >= 0.98x torch at every point"]["violations"] == ["s1 M=16: a 0.971"]
    assert t["nearest: auto >= 0.95 of the fastest at every point"]["violations"] == ["s2 M=64: a 0.900"]
    assert t["nearest: auto >= 0.98 of the fastest geomean"]["met"] is False
    assert result["by_source"]["priority"]["points"] == 1 and result["by_source"]["shipped-exact"]["points"] == 4
    md = "\n".join(auto_eval.markdown({"date": "d", "gpu": "g", "sm": "9.0a", "driver": "x", "cuda_runtime": "y",
                                       "versions": {}, "command": "c"}, result, "m", None))
    assert "| s2 | 64 | shipped-nearest | a |" in md and "NOT met" in md


def test_cpu_smoke_shards_and_merge(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", "off")
    shapes = tmp_path / "s.csv"
    shapes.write_text("n,k,model,tp,layer\n32,64,mine,1,a\n64,32,mine,1,b\n")
    for i in (1, 2):
        rc = auto_eval.main(["--shapes-file", str(shapes), "--device", "cpu", "--m", "1,2", "--quick", "--rounds",
                             "1", "--replays", "1", "--no-progress", "--shard", f"{i}/2", "--out",
                             str(tmp_path / f"s{i}")])
        assert rc == 0
    first = json.loads((tmp_path / "s1" / "auto_eval.json").read_text())
    assert [r["shape"] for r in first["rows"]] == ["32x64 (mine/tp1/a)"] * 2
    assert all(r["source"] == "priority" and r["auto_vs_fastest"] for r in first["rows"])  # the CPU: no data
    assert auto_eval.main(["--merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "auto_eval.json").read_text())
    assert len(merged["rows"]) == 4 and merged["points_planned"] == 4
    rc = auto_eval.main(["--shapes-file", str(shapes), "--device", "cpu", "--m", "1,2", "--quick", "--rounds", "1",
                         "--replays", "1", "--no-progress", "--limit-seconds", "0", "--out", str(tmp_path / "t")])
    stopped = json.loads((tmp_path / "t" / "auto_eval.json").read_text())
    assert rc == 0 and stopped["stopped"] == "time limit" and len(stopped["rows"]) == 1
