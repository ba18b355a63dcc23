"""``bench/checkpoints.py`` on the CPU: tiny checkpoints written in two formats, loaded by the library and by
transformers, timed eagerly, the load table measured in fresh processes, the report written."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")


@pytest.mark.slow
def test_the_checkpoint_benchmark_runs_on_the_cpu(tmp_path):
    from bench import checkpoints

    out = tmp_path / "out"
    assert checkpoints.main(["--device", "cpu", "--small", "--layers", "1", "--formats", "ct_dynamic", "hf_block",
                             "--modes", "eager", "--prefill", "8", "--context", "8", "--rounds", "1", "--iters", "1",
                             "--load-runs", "1", "--check-tokens", "8", "--ckpt-dir", str(tmp_path / "ckpt"),
                             "--out", str(out), "--profile-load"]) == 0
    result = json.loads((out / "checkpoints.json").read_text())
    rows = {(r["workload"], r["mode"]): r["us"] for r in result["rows"]}
    assert set(rows) == {("decode", "eager"), ("prefill8", "eager")}
    assert {"bf16", "ct_dynamic/lib", "ct_dynamic/hf", "hf_block/hf"} <= set(rows[("prefill8", "eager")])
    loads = {(r["format"], r["loader"]): r for r in result["load"]}
    assert loads[("ct_dynamic", "lib")]["seconds"] > 0 and loads[("bf16", "hf")]["peak_rss_gib"] > 0
    assert result["notes"]["ct_dynamic/lib"]["gemms"] == 4
    if "hf_block/lib" in result["errors"]:  # until the library serves block-scaled weights
        assert "not served by this version" in result["errors"]["hf_block/lib"]
    assert "ct_dynamic/lib/ct_dynamic/hf" in (out / "checkpoints.md").read_text()
    profile = (out / "load-profile-ct_dynamic-lib.txt").read_text()  # --profile-load: one more load, profiled
    assert "(profiled)" in profile and "load_pretrained" in profile
