"""``bench/hf_model.py --parallel-compile`` (``bench/hf_workers.py``): the slot schedule, the token, the barrier, the
merge, and one end-to-end run on the CPU with two processes."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def workers():
    sys.path.insert(0, str(ROOT))
    try:
        from bench import hf_bench, hf_model, hf_workers

        yield hf_workers, hf_model, hf_bench
    finally:
        sys.path.remove(str(ROOT))


def test_schedule_interleaves_rounds_rotated_as_one_process_does_then_one_profile_slot_each(workers):
    hf_workers, _, _ = workers
    slots = hf_workers.schedule(rows=2, rounds=3, active=[0, 1, 2])
    first_row = [(r, w) for j, r, w in slots if j == 0]
    assert first_row == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1),
                         (-1, 0), (-1, 1), (-1, 2)]
    assert [j for j, _, _ in slots] == [0] * 12 + [1] * 12  # a row is finished before the next starts
    assert hf_workers.schedule(rows=2, rounds=3, active=[]) == []
    # a failed process (1) takes no slot; the others keep the rotation among themselves
    assert [(r, w) for j, r, w in hf_workers.schedule(1, 2, [0, 2])] == [(0, 0), (0, 2), (1, 2), (1, 0),
                                                                          (-1, 0), (-1, 2)]


def test_the_token_runs_slots_in_order_across_threads(workers, tmp_path):
    hf_workers, _, _ = workers
    (tmp_path / hf_workers.TURN).write_text("0")
    slots = hf_workers.schedule(rows=1, rounds=4, active=[0, 1])
    ran: list[int] = []

    def process(me: int) -> None:
        turns = hf_workers.Turns(tmp_path, me, timeout=10)
        for s, (_, _, w) in enumerate(slots):
            if w == me:
                turns.wait(s)
                ran.append(s)
                turns.done(s)

    threads = [threading.Thread(target=process, args=(me,)) for me in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert ran == list(range(len(slots)))
    assert hf_workers.Turns(tmp_path, 0, 1).current() == len(slots)


def test_a_token_nobody_hands_on_times_out_and_a_passed_slot_is_an_error(workers, tmp_path):
    hf_workers, _, _ = workers
    (tmp_path / hf_workers.TURN).write_text("3")
    turns = hf_workers.Turns(tmp_path, 0, timeout=0.05)
    with pytest.raises(TimeoutError):
        turns.wait(4)
    with pytest.raises(RuntimeError, match="passed over"):
        turns.wait(2)


def test_the_barrier_waits_for_every_process_and_returns_the_ready_ones(workers, tmp_path):
    hf_workers, _, _ = workers
    got: list[list[int]] = []
    t = threading.Thread(target=lambda: got.append(hf_workers.barrier(tmp_path, 0, 3, True, timeout=10)))
    t.start()
    time.sleep(0.2)
    assert not got  # processes 1 and 2 have not said anything yet
    hf_workers.barrier(tmp_path, 2, 3, False, timeout=0.01)  # process 2 failed its compiles
    (tmp_path / "ready-1").write_text("")
    t.join(10)
    assert got == [[0, 1]]


def test_merge_puts_each_process_variant_side_by_side_per_row(workers):
    hf_workers, _, _ = workers
    part = lambda v, us: {"header": {"gpu": "x"}, "model": "llama", "notes": {v: {"n": 1}}, "errors": {},  # noqa: E731
                          "rows": [{"workload": "decode", "mode": "eager", "us": {v: us}, "host_us": {v: us / 2}}]}
    merged = hf_workers.merge([part("bf16", 10.0), part("fp8_static", 8.0)])
    assert merged["rows"] == [{"workload": "decode", "mode": "eager", "us": {"bf16": 10.0, "fp8_static": 8.0},
                               "host_us": {"bf16": 5.0, "fp8_static": 4.0}}]
    assert merged["notes"] == {"bf16": {"n": 1}, "fp8_static": {"n": 1}} and merged["header"] == {"gpu": "x"}


def test_ratios_are_taken_per_round_and_reported_with_their_range(workers):
    """Variants timed in the same rounds compare round by round (a host whose speed moves between rounds moves both):
    the report's ratio is the median of the rounds' ratios with their range; a row without per-round samples (older
    results) falls back to the ratio of the medians."""
    _, _, hf_bench = workers
    row = {"workload": "prefill512", "mode": "compiled",
           **hf_bench.timed_row({"bf16": [100.0, 200.0, 110.0], "fp8": [90.0, 150.0, 121.0]},
                                {"bf16": [50.0, 60.0, 55.0]})}
    assert row["us"] == {"bf16": 110.0, "fp8": 121.0} and row["host_us"] == {"bf16": 55.0}
    assert row["us_rounds"]["fp8"] == [90.0, 150.0, 121.0]
    mid, low, high = hf_bench.round_ratios(row, "fp8", "bf16")
    assert (mid, low, high) == (pytest.approx(0.9), pytest.approx(0.75), pytest.approx(1.1))
    assert hf_bench.ratio_cell(row, "fp8", "bf16") == "0.900 (0.75-1.10)"  # the ratio of medians would read 1.100
    assert hf_bench.row_ratio(row, "fp8", "bf16") == pytest.approx(0.9)
    old = {"us": {"bf16": 110.0, "fp8": 121.0}}
    assert hf_bench.round_ratios(old, "fp8", "bf16") is None and hf_bench.ratio_cell(old, "fp8", "bf16") == "1.100"
    short = {**row, "us_rounds": {"bf16": [100.0, 200.0], "fp8": [90.0, 150.0, 121.0]}}
    assert hf_bench.round_ratios(short, "fp8", "bf16") is None  # not timed in the same rounds
    header = {"versions": {}, "date": "d", "gpu": "g", "sm": "9.0", "driver": "13.0", "cuda_runtime": "13.0",
              "command": "c"}
    renamed = {**row, "us": {"bf16": 110.0, "fp8_static": 121.0},
               "us_rounds": {"bf16": row["us_rounds"]["bf16"], "fp8_static": row["us_rounds"]["fp8"]}}
    text = "\n".join(hf_bench.render({"header": header, "model": "llama", "layers": 1, "rows": [renamed],
                                      "notes": {}, "errors": {}}))
    assert "| 0.900 (0.75-1.10) |" in text


def test_worker_arguments_override_the_parents(workers, tmp_path):
    hf_workers, hf_model, _ = workers
    argv = hf_workers.worker_argv(["--variants", "bf16", "fp8_static", "--parallel-compile", "--out", "x",
                                   "--check-tokens", "64"], "fp8_static", 1, 2, tmp_path / "w", tmp_path / "s")
    args = hf_model.parse_args(argv)
    assert args.variants == ["fp8_static"] and args.out == tmp_path / "w" and args.worker == "1/2"
    assert not args.parallel_compile and args.check_tokens == 0 and args.host_rounds == 0


def test_one_process_refuses_fp8_variants_with_and_without_the_static_launcher(workers, tmp_path):
    _, hf_model, _ = workers
    args = hf_model.parse_args(["--variants", "fp8_static", "fp8_static_sl", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--parallel-compile"):
        hf_model.check_args(args)
    hf_model.check_args(hf_model.parse_args(["--variants", "bf16", "fp8_static_sl", "--out", str(tmp_path)]))
    hf_model.check_args(hf_model.parse_args(["--variants", "fp8_static", "fp8_static_sl", "--parallel-compile",
                                             "--out", str(tmp_path)]))


def test_parallel_run_on_the_cpu_measures_every_variant_in_one_report(workers, tmp_path):
    _, hf_model, _ = workers
    assert hf_model.main(["--device", "cpu", "--small", "--layers", "1", "--out", str(tmp_path), "--prefill", "8",
                          "--context", "8", "--rounds", "2", "--iters", "2", "--host-rounds", "0", "--check-tokens",
                          "8", "--modes", "eager", "--variants", "bf16", "fp8_static", "--parallel-compile"]) == 0
    result = json.loads((tmp_path / "hf_model_llama.json").read_text())
    rows = {(r["workload"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {("decode", "eager"), ("prefill8", "eager")}
    assert all(set(r["us"]) == {"bf16", "fp8_static"} and set(r["host_us"]) == {"bf16", "fp8_static"}
               for r in rows.values()), rows
    # each process's rounds, side by side: round r of one variant is round r of the other (the token's schedule)
    assert all({k: len(v) for k, v in r["us_rounds"].items()} == {"bf16": 2, "fp8_static": 2} for r in rows.values())
    assert not result["errors"], result["errors"]
    assert result["header"]["parallel_compile"]["processes"] == 2
    assert "--parallel-compile" in result["header"]["command"]
    assert result["accuracy"]["fp8_static"]["top1_agree"] > 0.5  # the parent's check, after the processes
    assert (tmp_path / "sync" / "turn").read_text() == str(2 * (2 * 2 + 2))  # 2 rows x (2 rounds x 2 + 2 profile)
    assert "| decode | eager |" in (tmp_path / "hf_model_llama.md").read_text()


def test_a_host_context_variant_sets_the_variable_while_it_is_built_then_restores_it(workers, monkeypatch):
    """``fp8_static+host_context=0``: an A/B of the host objective's context in one process."""
    import torch
    from torch import nn

    import fp8_backends
    from fp8_backends import convert
    from fp8_backends.core.settings import HOST_CONTEXT_ENV

    _, _, hf_bench = workers
    assert hf_bench.variant_kwargs("fp8_dynamic+host_context=0+plan=general") == {"host_context": "0",
                                                                                 "plan": "general"}
    with pytest.raises(ValueError, match="host_context=US"):
        hf_bench.variant_kwargs("fp8_dynamic+context=0")
    monkeypatch.setenv(HOST_CONTEXT_ENV, "7")
    seen = []
    real = convert.quantize_model

    def spy(*a, **kw):
        seen.append(os.environ[HOST_CONTEXT_ENV])
        return real(*a, **kw)

    # the package's lazy name first: reading it to save the old value caches convert's current one, which must be
    # the real function, or the spy outlives the test
    monkeypatch.setattr(fp8_backends, "quantize_model", spy, raising=False)
    monkeypatch.setattr(convert, "quantize_model", spy)
    base = nn.Sequential(nn.Linear(64, 32, bias=False, dtype=torch.bfloat16))
    models, notes = hf_bench.make_variants(base, ["fp8_dynamic+host_context=0"], torch.zeros(1, 4, dtype=torch.long))
    assert notes["fp8_dynamic+host_context=0"]["host_context_us"] == 0.0 and set(models) == {
        "fp8_dynamic+host_context=0"}
    assert seen == ["0"] and os.environ[HOST_CONTEXT_ENV] == "7"


def test_a_fuse_variant_builds_the_unfused_layout_beside_the_fused_one(workers):
    """``fp8_static+fuse=0``: every linear its own GEMM, measured beside the fused default in one process."""
    import torch
    from torch import nn

    from fp8_backends.layers import Fp8Linear
    from fp8_backends.layers.shared_input import Fp8LinearSlice

    _, _, hf_bench = workers
    assert hf_bench.variant_kwargs("fp8_dynamic+fuse=0") == {"fuse": "0"}
    for bad in ("fp8_dynamic+fuse=no", "fp8_dynamic+fuse=2"):
        with pytest.raises(ValueError, match="fuse=0"):
            hf_bench.variant_kwargs(bad)
    base = nn.Module()
    base.gate_proj = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    base.up_proj = nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    models, notes = hf_bench.make_variants(base, ["fp8_dynamic", "fp8_dynamic+fuse=0"],
                                           torch.zeros(1, 4, dtype=torch.long))
    assert isinstance(models["fp8_dynamic"].up_proj, Fp8LinearSlice)
    assert isinstance(models["fp8_dynamic+fuse=0"].up_proj, Fp8Linear)
    assert (notes["fp8_dynamic"]["gemms"], notes["fp8_dynamic+fuse=0"]["gemms"]) == (1, 2)
