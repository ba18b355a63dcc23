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


@pytest.mark.slow
def test_the_checkpoint_benchmark_writes_a_moe_model_s_experts_one_by_one(tmp_path):
    """``--model qwen3_moe``: the FP8 checkpoint stores each expert's gate/up/down (as MoE checkpoints ship), the
    library serves them per expert, and the static formats (no per-expert input scales) are refused."""
    from bench import checkpoints

    if int(__import__("transformers").__version__.split(".")[0]) < 5:
        pytest.skip("transformers < 5 holds MoE experts as nn.Linear modules")
    out = tmp_path / "out"
    assert checkpoints.main(["--device", "cpu", "--small", "--model", "qwen3_moe", "--layers", "1", "--modes", "eager",
                             "--prefill", "8", "--context", "8", "--rounds", "1", "--iters", "1", "--load-runs", "0",
                             "--check-tokens", "8", "--loaders", "lib", "--ckpt-dir", str(tmp_path / "ckpt"),
                             "--out", str(out)]) == 0
    result = json.loads((out / "checkpoints.json").read_text())
    assert not result["errors"] and result["model"] == "qwen3_moe"
    assert {"bf16", "hf_block/lib"} <= set(result["rows"][0]["us"])
    assert result["accuracy"]["hf_block/lib"]["rel_err"] < 0.15
    from safetensors import safe_open

    (folder,) = [p for p in (tmp_path / "ckpt").iterdir()]
    names = set()
    for f in (folder / "hf_block").glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            names.update(handle.keys())
    assert "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    with pytest.raises(SystemExit):
        checkpoints.main(["--model", "qwen3_moe", "--formats", "ct_fp8", "--out", str(out)])
