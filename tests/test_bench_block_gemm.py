"""``bench/block_gemm.py`` on the CPU: the smoke run end to end (tiny shapes on Triton's interpreter: every variant
built, checked and timed, refusals recorded, JSON and markdown written), and its pure functions (family picks, targets,
the sweep's table)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from bench import block_gemm as bench  # noqa: E402
from fp8_backends.providers.triton import _support  # noqa: E402
from fp8_backends.providers.triton import block_gemm_configs as bc  # noqa: E402


@pytest.mark.skipif(not _support.interpreting(), reason="the smoke run is the CPU one (TRITON_INTERPRET=1)")
def test_smoke_run_writes_json_and_markdown(tmp_path):
    assert bench.main(["--device", "cpu", "--smoke", "--no-compile-baseline", "--bounds", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "block_gemm.json").read_text())
    assert data["schema"] == "fp8_backends.bench.block_gemm/1" and data["meta"]["versions"]["torch"]
    assert [(p["n"], p["k"], p["m"]) for p in data["gemm"]] == [(144, 272, 1), (144, 272, 5)]
    for point in data["gemm"]:
        labels = set(point["variants"])
        assert {"bf16", "triton", "provider:torch_scaled_mm"} <= labels  # the library's CPU path of the mode
        assert any(lab.startswith("triton:") for lab in labels)
        assert all(v["error"] is None and v["us"] > 0 for lab, v in point["variants"].items()), point["variants"]
        assert point["variants"]["triton"]["config"] in bc.CONFIGS
        assert point["notes"]["scaled_mm"]["refused"]  # the CPU build refuses block scales: recorded, not fatal
        # the bounds at M <= 16 (the per-tensor FP8 GEMM is CUDA only)
        assert {"bound:launch", "bound:weight_read"} <= labels and "bound:fp8_tensor" not in labels
    assert data["flashinfer"]["error"] == "off"
    assert {(p["residual"]) for p in data["norm"]} == {False, True}
    for point in data["norm"]:
        assert {"triton_group", "triton_group_tma", "triton_token"} <= set(point["variants"])
    text = (tmp_path / "block_gemm.md").read_text()
    assert data["auto_geomean"]["points"] == 2
    for section in ("## Targets", "## GEMM: auto (what a layer runs)", "## GEMM: Triton (auto)",
                    "## GEMM: every variant", "## Refusals", "## Fused RMSNorm"):
        assert section in text


def test_family_configs():
    assert set(bench.family_configs(1, 4096, 4096, False)) == {
        "triton", "triton:gemv_n2_g8_w2", "triton:swap_n64_m16_s8_w4_sk0", "triton:mm_n128_m64_s4_w4_g8_sk0"}
    assert "triton:gemv_n4_g4_w4" in bench.family_configs(1, 24576, 1536, False)
    assert bench.family_configs(1, 4096, 4096, False, lean=True) == {"triton": "auto"}
    big = bench.family_configs(4096, 4096, 6840, False)  # K not 16-byte aligned: no TMA variant
    assert set(big) == {"triton", "triton:mm_n128_m128_s4_w8_g8_sk0"}
    assert "triton:tma_n128_m64_s4_w4_g8_p2" in bench.family_configs(4096, 4096, 4096, False)
    sweep = bench.family_configs(16, 4096, 4096, True)
    assert all(name in bc.CONFIGS for lab, name in sweep.items() if lab != "triton")
    assert not any("gemv" in lab for lab in sweep)  # GEMV configs stop at M = 4


def test_extra_configs_are_parsed_and_kept_where_eligible():
    got = bench.extra_configs("mm_n64_m64_s4_w4_g8_sk7, swap_n64_m64_s5_w4_sk14,tma_n64_m64_s4_w4_g8_p2", 256, 7168)
    assert [c.name for c in got] == ["mm_n64_m64_s4_w4_g8_sk7", "swap_n64_m64_s5_w4_sk14", "tma_n64_m64_s4_w4_g8_p2"]
    assert [c.name for c in bench.extra_configs("swap_n64_m64_s5_w4_sk14,tma_n64_m64_s4_w4_g8_p2", 1024, 7160)] == []
    assert bench.extra_configs("", 1, 16) == []
    with pytest.raises(SystemExit):
        bench.main(["--configs", "mm_n64", "--device", "cpu", "--smoke"])


def test_shapes_replace_the_model_tables_and_bad_ones_are_refused():
    args = bench.build_parser().parse_args(["--shapes", "576,7168", "4096x12288", "--models", "qwen3-8b"])
    assert bench.gemm_shapes(args) == [("shapes", "576x7168", 576, 7168), ("shapes", "4096x12288", 4096, 12288)]
    for bad in ("576", "0,128", "a,b", "1,2,3"):
        with pytest.raises(SystemExit):
            bench.main(["--shapes", bad, "--device", "cpu", "--smoke"])


def _point(m, us, model="deepseek-v3", layer="kv_a", n=576, k=7168, floor=None, pick="triton[config=auto]"):
    variants = {lab: {"us": v, "config": lab.split(":")[-1] if ":" in lab else "swap_n64_m16_s8_w4_sk0"}
                for lab, v in us.items()}
    if floor is not None:
        variants["auto"]["pct_floor"] = floor
    notes = {"providers": {"auto": pick, "refused": {}, "layout": None}}
    return bench.analyse_point(model, layer, n, k, m, {}, {}, notes, None) | {"variants": variants} | \
        bench.point_ratios(variants, notes)


def test_point_ratios_compare_auto_with_the_fastest_provider_as_layers_call_them():
    p = _point(64, {"bf16": 10.0, "triton": 8.0, "triton:mm_n64": 4.0, "auto": 6.0, "provider:cutlass": 5.0,
                    "scaled_mm": 3.0, "flashinfer": 2.0})
    # the raw calls and Triton's fixed configs are not providers as a layer calls them
    assert p["fastest_provider"] == "provider:cutlass" and p["auto_of_fastest"] == pytest.approx(5.0 / 6.0)
    assert p["auto_over_bf16"] == pytest.approx(10.0 / 6.0) and p["auto_pick"] == "triton[config=auto]"
    assert p["best_triton"] == "triton:mm_n64" and p["triton_over_bf16"] == pytest.approx(1.25)
    assert p["triton_vs_flashinfer"] == pytest.approx(0.25)
    lone = _point(1, {"bf16": 10.0})  # nothing but bf16 measured: no ratio, no error
    assert lone["auto_of_fastest"] is None and lone["auto_over_bf16"] is None


def test_targets_name_every_miss_of_auto():
    gemm = [_point(1, {"bf16": 10.0, "triton": 12.0, "auto": 12.5}, floor=60.0),
            _point(4096, {"bf16": 100.0, "triton": 80.0, "provider:cutlass": 60.0, "auto": 70.0}),
            _point(256, {"bf16": 100.0, "triton": 50.0, "auto": 50.0})]
    norm = [{"hidden": 7168, "tokens": 4096, "residual": True, "group_compiled_over_triton": 0.9,
             "token_compiled_over_triton": 1.2,
             "variants": {"triton_group": {"pct_copy": 80.0}, "triton_token": {"pct_copy": 90.0}}}]
    got = bench.targets(gemm, norm)
    assert got["auto_slower_than_bf16"] == ["deepseek-v3 kv_a 576x7168 M=1: 0.800x"]
    assert got["auto_below_75pct_floor"] == ["deepseek-v3 kv_a 576x7168 M=1: 60.0%"]
    assert got["auto_below_1.6x_bf16"] == ["deepseek-v3 kv_a 576x7168 M=4096: 1.429x"]
    assert got["auto_below_93pct_of_fastest"] == ["deepseek-v3 kv_a 576x7168 M=4096: 0.857 (provider:cutlass)"]
    assert got["norm_below_85pct_copy"] == ["H=7168 T=4096 +res group: 80.0%"]
    assert got["norm_slower_than_compiled"] == ["H=7168 T=4096 +res group: 0.900x"]
    geo = bench.auto_geomeans(gemm)
    assert geo["points"] == 3 and geo["per_m"][256] == pytest.approx(1.0)
    assert geo["all"] == pytest.approx((12.0 / 12.5 * 60.0 / 70.0 * 1.0) ** (1 / 3))
    assert bench.auto_geomeans([])["all"] is None


def test_misses_name_what_their_bounds_reach_and_are_counted_against_them():
    slow = _point(256, {"bf16": 10.0, "auto": 10.5, "bound:fp8_tensor": 9.0})
    big = _point(1024, {"bf16": 100.0, "auto": 80.0, "bound:fp8_tensor": 70.0,  # bound 1.43x: misses 1.6x too
                        "bound:fp8_tensor_precise": 75.0})
    big2 = _point(4096, {"bf16": 100.0, "auto": 80.0, "bound:fp8_tensor": 50.0})  # bound 2.0x: the GEMM's miss
    small = _point(1, {"bf16": 10.0, "auto": 5.0, "bound:weight_read": 2.0, "bound:launch": 1.5}, floor=20.0)
    small["variants"]["bound:weight_read"]["pct_floor"] = 50.0
    small["variants"]["bound:weight_read_64k"] = {"us": 2.5, "pct_floor": 40.0}  # the better read is the bound
    unbounded = _point(4, {"bf16": 10.0, "auto": 5.0}, floor=30.0)
    got = bench.targets([slow, big, big2, small, unbounded], [])
    assert got["auto_slower_than_bf16"] == ["deepseek-v3 kv_a 576x7168 M=256: 0.952x (per-tensor fp8 1.111x)"]
    assert got["auto_below_1.6x_bf16"] == ["deepseek-v3 kv_a 576x7168 M=1024: 1.250x (per-tensor fp8 1.429x; "
                                           "without fast accumulation 1.333x)",
                                           "deepseek-v3 kv_a 576x7168 M=4096: 1.250x (per-tensor fp8 2.000x)"]
    assert got["auto_below_75pct_floor"] == [
        "deepseek-v3 kv_a 576x7168 M=1: 20.0% (one read of the weight 50.0%; an empty launch 1.50 µs)",
        "deepseek-v3 kv_a 576x7168 M=4: 30.0%"]
    summary = bench.bound_summary([slow, big, big2, small, unbounded])
    assert summary["auto_slower_than_bf16"] == {"misses": 1, "bound_timed": 1, "bound_misses_too": 0}
    assert summary["auto_below_1.6x_bf16"] == {"misses": 2, "bound_timed": 2, "bound_misses_too": 1}
    assert summary["auto_below_75pct_floor"] == {"misses": 2, "bound_timed": 1, "bound_misses_too": 1}
    meta = {"versions": {}, "date": "-", "gpu": "-", "sm": "-", "driver": "-", "cuda_runtime": "-", "command": "-"}
    text = bench.markdown({"meta": meta, "copy_gbps": None, "flashinfer": {}, "method": "", "gemm": [], "norm": [],
                           "targets": got, "bounds": summary})
    assert "- auto_below_1.6x_bf16: the bound misses too at 1 of the 2 misses where it was timed (2 misses)" in text


def test_sweep_table_is_a_loadable_block_table():
    points = []
    for m, best in ((1, "gemv_n2_g8_w2"), (16, "swap_n64_m16_s6_w4_sk0"), (64, "swap_n64_m64_s5_w4_sk0"),
                    (256, "swap_n64_m64_s5_w4_sk0"), (4096, "tma_n128_m128_s4_w8_g8_p1")):
        us = {"bf16": 10.0, "triton": 9.0, f"triton:{best}": 5.0, "triton:mm_n128_m64_s4_w4_g8_sk0": 7.0}
        points.append(_point(m, us))
    table = bench.sweep_table(points)
    again = bc.BlockTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again.pick(1, 576, 7168) == "gemv_n2_g8_w2"
    assert again.pick(16, 576, 7168) == "swap_n64_m16_s6_w4_sk0"
    assert again.pick(100, 576, 7168) == again.pick(256, 576, 7168) == "swap_n64_m64_s5_w4_sk0"
    assert again.pick(8192, 576, 7168) == "tma_n128_m128_s4_w8_g8_p1"
    assert again.pick(1, 4096, 4096) == bc.DEFAULT_TABLE.pick(1, 4096, 4096)  # unmeasured shapes keep the default


def test_ceilings_are_the_slower_of_bytes_and_flops_and_rerender_adds_them(tmp_path):
    point = {"model": "m", "layer": "l", "m": 4096, "n": 4096, "k": 4096, "weight_bytes": 4096 * 4096 + 4 * 32 * 32,
             "variants": {"bf16": {"us": 200.0}, "auto": {"us": 100.0}, "triton": {"error": "x"}}}
    gpu = "NVIDIA H200"
    bench.add_ceilings(point, 4000.0, gpu)
    fp8_peak, bf16_peak = bench.PEAK_TFLOPS[gpu]
    flops = 2.0 * 4096**3
    assert point["ceiling_us"] == pytest.approx(flops / (fp8_peak * 1e6))  # compute-bound at M = 4096
    assert point["bf16_ceiling_us"] == pytest.approx(flops / (bf16_peak * 1e6))
    assert point["variants"]["auto"]["pct_ceiling"] == pytest.approx(100 * point["ceiling_us"] / 100.0)
    assert point["variants"]["bf16"]["pct_ceiling"] == pytest.approx(100 * point["bf16_ceiling_us"] / 200.0)
    assert "pct_ceiling" not in point["variants"]["triton"]
    one = dict(point, m=1, variants={"auto": {"us": 10.0}})
    bench.add_ceilings(one, 4000.0, gpu)  # one token: the bytes decide
    assert one["ceiling_us"] == pytest.approx((4096 + 4 * 32 + point["weight_bytes"] + 2 * 4096) / 4000e3)
    unknown = {k: v for k, v in point.items() if k not in ("ceiling_us", "bf16_ceiling_us")}
    assert "ceiling_us" not in bench.add_ceilings(unknown, 4000.0, "some other GPU")
    # an earlier run's file (a smoke run's, as if it ran on the H200), rewritten with the ceilings
    assert bench.main(["--device", "cpu", "--smoke", "--no-norm", "--out", str(tmp_path / "run")]) == 0
    src = tmp_path / "run" / "block_gemm.json"
    data = json.loads(src.read_text())
    data["meta"]["gpu"], data["copy_gbps"] = gpu, 4000.0
    src.write_text(json.dumps(data))
    assert bench.main(["--rerender", str(src), "--out", str(tmp_path / "out")]) == 0
    again = json.loads((tmp_path / "out" / "block_gemm.json").read_text())
    for p in again["gemm"]:
        assert p["ceiling_us"] > 0 and all(v["pct_ceiling"] > 0 for v in p["variants"].values() if v.get("us"))
    text = (tmp_path / "out" / "block_gemm.md").read_text()
    assert "% ceiling" in text and f"re-rendered from `{src}`" in text
