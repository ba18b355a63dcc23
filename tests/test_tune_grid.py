"""The tuner's grid machinery: model shapes x TP, shapes files, option pins, labels, provenance, resuming, time
limits, interruption and shards; and the path tuner lockfile -> ``selection_data pack`` -> the shipped policy.

Candidates run for real on the CPU at tiny sizes (verified against the reference); their timings are faked.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fake_provider import install_fake

from fp8_backends import selection_data
from fp8_backends import tune as tune_cli
from fp8_backends.core.errors import DataFileError
from fp8_backends.core.types import DeviceKind, GemmProblem
from fp8_backends.registry import lockfile, resolution, shipped, shipped_data
from fp8_backends.registry.platform import Platform, cpu_platform, simulate_platform
from fp8_backends.tuning import engine as tuner
from fp8_backends.tuning import grid, models
from fp8_backends.tuning.plan import parse_pin, select_shard
from fp8_backends.tuning.provenance import build_provenance, canonical_command
from fp8_backends.tuning.timing import Measurement
from fp8_backends.tuning.workloads import expand_candidates

CPU = cpu_platform()
FAKE_A, FAKE_B = "fake_mm[variant=a]", "fake_mm[variant=b]"
TORCH_F = "torch_scaled_mm[fast_accum=false]"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(tmp_path / "unused.json"))
    monkeypatch.delenv("FP8_BACKENDS_SHIPPED", raising=False)
    lockfile.reset_state()
    shipped.reset_state()
    resolution.reset_caches()
    install_fake(monkeypatch)
    yield
    lockfile.reset_state()
    shipped.reset_state()


def fake_timer(times=None, calls=None, sleep=0.0, interrupt_after=None):
    """Runs each candidate once for real; reports ``times`` (µs, default 100); optionally sleeps per call or
    raises KeyboardInterrupt (as SIGTERM does under the CLI) once ``interrupt_after`` calls were made."""
    state = {"n": 0}

    def timer(runs):
        state["n"] += 1
        if interrupt_after is not None and state["n"] > interrupt_after:
            raise KeyboardInterrupt
        if sleep:
            time.sleep(sleep)
        out = {}
        for label, run in runs.items():
            run.fn(0)
            if calls is not None:
                calls.append(label)
            out[label] = Measurement.of([(times or {}).get(label, 100.0)] * 3, "fake")
        return out

    return timer


def write_csv(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(["# a comment", "n,k,bias,model,tp,layer", *rows]) + "\n")
    return path


# ------------------------------------------------------------------------------------------ grid + shapes files
def test_model_shapes_dedupe_label_and_skip():
    shapes, skipped = grid.model_shapes(["llama3-8b", "mistral-7b"], [1, 2])
    assert len(shapes) == 8  # Mistral-7B has Llama-3-8B's shapes
    qkv = next(s for s in shapes if (s.n, s.k) == (6144, 4096))
    assert qkv.labels == ("llama3-8b/tp1/qkv_proj", "mistral-7b/tp1/qkv_proj") and qkv.models == {"llama3-8b",
                                                                                                     "mistral-7b"}
    assert any((s.n, s.k) == (3072, 4096) and "llama3-8b/tp2/qkv_proj" in s.labels for s in shapes)
    shapes, skipped = grid.model_shapes(["qwen2-7b"], [1, 8])
    assert len(shapes) == 4 and skipped == ["qwen2-7b tp=8: qwen2-7b: tp=8 does not divide 28 attention heads and "
                                            "intermediate size 18944"]
    assert grid.model_shapes(["llama3-8b", "mistral-7b"], [1], exclude=["llama-3-8b"])[0][0].labels == (
        "mistral-7b/tp1/qkv_proj",)


def test_alignment_skip(monkeypatch):
    odd = models.ModelSpec("odd", 1000, 10, 2, 100, 3000)
    monkeypatch.setitem(models.MODELS, "odd", odd)
    shapes, skipped = grid.model_shapes(["odd"], [1])
    assert shapes == [] and len(skipped) == 4 and "1400x1000 is not a multiple of 16" in skipped[0]


def test_the_shipped_grid_and_its_time_estimate():
    shapes, _ = grid.model_shapes(grid.SHIPPED_MODELS, grid.SHIPPED_TPS)
    owners = set().union(*(s.models for s in shapes))
    assert owners == set(grid.SHIPPED_MODELS) and len(shapes) == 260
    assert sum(s.bias for s in shapes) == 20  # Qwen's QKV
    problems = len(shapes) * len(grid.SHIPPED_M_BUCKETS)
    # ~6 candidates per problem on the H200 with the kernel-config tables pinned to auto
    assert grid.estimate_seconds(problems, 6) == pytest.approx(1820 * 6 * 46.0 / 900)
    assert 480 < grid.estimate_seconds(problems, 6) < 660


def test_shapes_files_json_and_csv(tmp_path):
    j = tmp_path / "s.json"
    j.write_text(json.dumps([{"n": 6144, "k": 4096, "model": "mine", "tp": 2, "layer": "qkv_proj"},
                             {"N": 4096, "K": 4096, "bias": True}, [8192, 4096], {"n": 6144, "k": 4096, "label": "x"}]))
    specs = grid.read_shapes_file(j)
    assert [(s.n, s.k, s.bias) for s in specs] == [(6144, 4096, False), (4096, 4096, True), (8192, 4096, False)]
    assert specs[0].labels == ("mine/tp2/qkv_proj", "x")
    j.write_text(json.dumps({"shapes": [[64, 32]]}))
    assert [(s.n, s.k) for s in grid.read_shapes_file(j)] == [(64, 32)]
    c = write_csv(tmp_path / "s.csv", ["6144,4096,0,mine,1,qkv_proj", "4096, 14336, false, mine, 1, down_proj",
                                       "64,32,yes,,,"])
    specs = grid.read_shapes_file(c)
    assert [(s.n, s.k, s.bias) for s in specs] == [(6144, 4096, False), (4096, 14336, False), (64, 32, True)]
    assert specs[1].labels == ("mine/tp1/down_proj",) and specs[2].labels == ()


@pytest.mark.parametrize(("text", "needles"), [
    ('[{"n": 64}, {"n": "x", "k": -2}, {"n": 16, "k": 16, "colour": 1}]',
     ["shape #1: missing k", "shape #2 n: 'x' is not an integer", "shape #2 k: -2 must be >= 1",
      "shape #3: unknown field(s) colour"]),
    ('{"shapes": 3}', ["expected a list of shapes"]),
    ("[1, 2", ["not valid JSON"]),
    ("[]", ["no shapes"]),
    ("n,m\n1,2\n", ["needs a header row with n and k"]),
    ("n,k\n64,32\n64,abc\n16,16,1,2,3,4,5\n", ["line 3 k: 'abc' is not an integer", "line 4: more values"]),
    ("n,k,bias\n64,32,maybe\n", ["line 2 bias: 'maybe' is not a boolean"]),
    ("# my shapes\n\nn,k\n64,32\n  # a comment\n\n64,abc\n16,16,1\n",
     ["line 7 k: 'abc' is not an integer", "line 8: more values"]),  # the file's own line numbers
])
def test_bad_shapes_files_list_every_problem(tmp_path, text, needles):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(DataFileError) as info:
        grid.read_shapes_file(path)
    for needle in needles:
        assert any(needle in p for p in info.value.problems), (needle, info.value.problems)
    assert str(path) in str(info.value)
    with pytest.raises(DataFileError, match="cannot read it"):
        grid.read_shapes_file(tmp_path / "missing.csv")


# ------------------------------------------------------------------------------------------ pins, labels, plan
def test_pins_hold_options_at_one_value():
    problem = GemmProblem(n=32, k=64, m=1, device="cpu")
    cands, _ = expand_candidates("gemm", problem, CPU, pins={"fake_mm": {"variant": "auto"}})
    assert [c.label for c in cands if c.provider == "fake_mm"] == ["fake_mm[variant=auto]"]
    cands, _ = expand_candidates("gemm", problem, CPU)
    assert [c.label for c in cands if c.provider == "fake_mm"] == [FAKE_A, FAKE_B]
    with pytest.raises(ValueError, match="no option value variant=c"):
        expand_candidates("gemm", problem, CPU, pins={"fake_mm": {"variant": "c"}})
    assert parse_pin("cutlass:config=auto") == ("cutlass", "config", "auto")
    for bad in ("cutlass", "cutlass:config", ":config=auto"):
        with pytest.raises(Exception, match="PROVIDER:OPTION=VALUE"):
            parse_pin(bad)


def test_cli_plan_pins_labels_and_list(tmp_path, capsys):
    csv_path = write_csv(tmp_path / "mine.csv", ["32,64,0,mine,1,qkv_proj", "64,32,0,mine,1,o_proj"])
    lock = tmp_path / "sel.json"
    rc = tune_cli.main(["--device", "cpu", "--shapes-file", str(csv_path), "--m", "1,2", "--lockfile", str(lock),
                     "--no-progress", "--pin", "fake_mm:variant=b", "--providers", "fake_mm,torch_scaled_mm"],
                    timer=fake_timer({FAKE_B: 10.0}))
    assert rc == 0, capsys.readouterr()
    (section,) = json.loads(lock.read_text())["sections"].values()
    assert len(section["entries"]) == 4
    for entry in section["entries"].values():
        assert entry["choice"]["options"] == {"variant": "b"} and entry["labels"][0].startswith("mine/tp1/")
        assert {r["provider"] for r in entry["ranking"]} == {"fake_mm", "torch_scaled_mm"}
        assert len([r for r in entry["ranking"] if r["provider"] == "fake_mm"]) == 1
    assert "provenance" not in json.loads(lock.read_text())  # only with --provenance / --shipped-grid
    capsys.readouterr()
    assert tune_cli.main(["--device", "cpu", "--shipped-grid", "--list", "--model", "llama3-8b", "--tp", "1"]) == 0
    out = capsys.readouterr().out
    assert "M buckets: 1, 4, 16, 64, 256, 1024, 4096" in out and "estimate: 28 problem(s)" in out
    with pytest.raises(SystemExit):
        tune_cli.main(["--device", "cpu", "--shapes", "32,64", "--pin", "fake_mm:variant=zzz", "--list"])
    with pytest.raises(SystemExit):
        tune_cli.main(["--device", "cpu", "--model", "qwen2-7b", "--tp", "8", "--list"])


def test_shards_split_the_work_deterministically():
    args = tune_cli.build_parser().parse_args(["--shipped-grid", "--device", "cpu"])
    from fp8_backends.tuning.plan import plan_from_args

    plan = plan_from_args(args, "cpu")
    assert len(plan.problems) == 260 and plan.total == 1820 and plan.pins == grid.SHIPPED_PINS
    parts = [select_shard(plan, i, 3) for i in (1, 2, 3)]
    keys = [set(p.keys()) for p in parts]
    assert sum(len(k) for k in keys) == 1820 and set().union(*keys) == set(plan.keys())
    assert [p.keys() for p in parts] == [select_shard(plan, i, 3).keys() for i in (1, 2, 3)]
    excluded = plan_from_args(tune_cli.build_parser().parse_args(
        ["--shipped-grid", "--device", "cpu", "--exclude-model", "gemma3-12b"]), "cpu")
    assert len(excluded.problems) == 260 - 15 and excluded.grid["excluded_models"] == ["gemma3-12b"]


# ------------------------------------------------------------------------------------------ resuming and stopping
def _cli(tmp_path, *extra, timer=None):
    csv_path = write_csv(tmp_path / "mine.csv", [f"{n},64,0,mine,1,l{n}" for n in (16, 32, 48)])
    return tune_cli.main(["--device", "cpu", "--shapes-file", str(csv_path), "--m", "1,2", "--lockfile",
                       str(tmp_path / "sel.json"), "--no-progress", "--providers", "fake_mm", *extra], timer=timer)


def _entries(tmp_path) -> dict:
    (section,) = json.loads((tmp_path / "sel.json").read_text())["sections"].values()
    return section["entries"]


def test_time_limit_stops_and_the_same_command_resumes(tmp_path, capsys):
    calls: list[str] = []
    rc = _cli(tmp_path, "--limit-seconds", "0.5", timer=fake_timer(calls=calls, sleep=0.2))
    out = capsys.readouterr().out
    first = len(_entries(tmp_path))
    assert rc == 3 and "run the same command again to resume" in out and 1 <= first < 6
    calls.clear()
    assert _cli(tmp_path, timer=fake_timer(calls=calls)) == 0
    assert len(_entries(tmp_path)) == 6 and len(calls) == 2 * (6 - first)  # only what was missing (2 variants)
    assert f"{first} problem(s) already in" in capsys.readouterr().out
    calls.clear()
    assert _cli(tmp_path, timer=fake_timer(calls=calls)) == 0 and calls == []  # nothing left to do
    assert "nothing to do" in capsys.readouterr().out
    assert _cli(tmp_path, "--retune", timer=fake_timer(calls=calls)) == 0 and len(calls) == 12


def test_an_interrupted_run_keeps_what_it_measured(tmp_path, capsys):
    rc = _cli(tmp_path, timer=fake_timer(interrupt_after=3))
    assert rc == 3 and "stopped (interrupted) with 3 problem(s) left" in capsys.readouterr().out
    assert len(_entries(tmp_path)) == 3  # the first shape's two M and the next shape's first M were written


# ------------------------------------------------------------------------------------------ provenance and pack
def test_canonical_command_drops_run_only_flags():
    argv = ["--shipped-grid", "--lockfile", "o.json", "--limit-seconds", "480", "--shard=1/2", "--no-progress",
            "--report", "r.json", "-v"]
    assert canonical_command(argv) == "python -m fp8_backends.tune --shipped-grid --lockfile o.json"


FAKE_GPU = Platform(kind=DeviceKind.CPU, name="Test GPU", sm=(9, 0), driver_version="13.0",
                    cuda_runtime_version="13.0", library_versions=CPU.library_versions)


def _tune_with_provenance(path: Path, problems, buckets, times, argv, total=6):
    plan_grid = {"models": ["mine"], "m_buckets": list(buckets), "problems": total}
    prov = build_provenance(FAKE_GPU, argv, plan_grid)
    labels = {lockfile.problem_key("gemm", lockfile.problem_fields("gemm", p)): [f"mine/tp1/l{p.n}"] for p in problems}
    return tuner.tune(problems, m_buckets=buckets, platform=FAKE_GPU, timer=fake_timer(times), lockfile=path,
                      progress=False, provenance=prov, labels=labels, providers={"fake_mm", "torch_scaled_mm"})


def test_tuner_lockfile_to_shipped_data_to_auto(tmp_path, monkeypatch):
    """The whole path: tune with provenance (in two chunks), pack, and ``auto`` reads the packed file."""
    path = tmp_path / "sm90.lock.json"
    problems = [GemmProblem(n=n, k=64, device="cpu") for n in (32, 64, 128)]
    times = {FAKE_A: 50.0, FAKE_B: 70.0, TORCH_F: 100.0}
    _tune_with_provenance(path, problems[:2], (1, 16), times, ["--shipped-grid", "--lockfile", str(path)])
    with pytest.raises(DataFileError, match="the grid has 6 problems but only 4 are measured"):
        selection_data.pack(json.loads(path.read_text()))
    report = _tune_with_provenance(path, problems, (1, 16), times,
                                   ["--shipped-grid", "--lockfile", str(path), "--limit-seconds", "60"])
    assert len(report.problems) == 6
    doc = json.loads(path.read_text())
    prov = doc["provenance"]
    assert prov["gpu"] == "Test GPU" and prov["sm"] == "9.0" and prov["driver"] == "13.0"
    assert prov["libraries"]["torch"] and prov["command"].endswith(f"--shipped-grid --lockfile {path}")
    assert len(prov["runs"]) == 2 and prov["date"] == prov["runs"][0]["started"]
    assert shipped_data.check_document(doc) == []  # the tuner's document is already valid shipped data
    rc = selection_data.main(["pack", str(path), "--out", str(tmp_path / "data")])
    assert rc == 0
    packed = tmp_path / "data" / "sm90-test-gpu.json"
    assert selection_data.main(["check", str(packed)]) == 0
    monkeypatch.setenv("FP8_BACKENDS_SHIPPED", str(tmp_path / "data"))
    gpu = simulate_platform("9.0", name="Test GPU")
    res = resolution.explain("gemm", "auto", problem=GemmProblem(n=64, k=64, m=8), platform=gpu)
    assert (res.source, res.backend.label) == ("shipped-exact", FAKE_A)
    res = resolution.explain("gemm", "auto", problem=GemmProblem(n=96, k=64, m=8), platform=gpu)
    assert (res.source, res.backend.label) == ("shipped-nearest", FAKE_A)
    assert "64x64 (w " in res.note and "128x64 (w " in res.note
    # held out: leaving a model out removes its entries
    rc = selection_data.main(["pack", str(path), "--out", str(tmp_path / "heldout.json"), "--exclude-model",
                              "llama3-8b"])
    assert rc == 0  # no entry is labelled llama3-8b: all stay
    assert len(shipped_data.the_section(shipped_data.load_file(tmp_path / "heldout.json"))["entries"]) == 6


def test_check_cli_reports_bad_files(tmp_path, capsys):
    bad = tmp_path / "sm90-bad.json"
    bad.write_text(json.dumps({"schema": lockfile.SCHEMA, "sections": {}}))
    assert selection_data.main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "UNUSABLE" in out and "'provenance' is missing" in out
