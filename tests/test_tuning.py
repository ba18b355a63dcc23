"""Tuning and the selection lockfile: schema, keying, bucket mapping, tie-breaking, the ``auto`` policy,
mismatch warnings, corrupt-file recovery and concurrent writers.

Timings are faked (an injected timer) wherever the choice matters; every candidate is still run on the
CPU and verified against the reference, at tiny sizes.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import ClassVar

import fake_provider
import pytest
from fake_provider import FAKE_DIST, install_fake

from fp8_backends import tune as tune_cli
from fp8_backends.core import reference
from fp8_backends.core.capabilities import GemmCapabilities
from fp8_backends.core.errors import DataFileError
from fp8_backends.core.types import DeviceKind, GemmProblem, NormQuantProblem
from fp8_backends.list import collect, render
from fp8_backends.registry import lockfile, resolution
from fp8_backends.registry.platform import cpu_platform
from fp8_backends.tuning import engine as tuner
from fp8_backends.tuning.models import linear_shapes, model_spec
from fp8_backends.tuning.plan import parse_m_list
from fp8_backends.tuning.timing import CpuTimer, Measurement, Run, TimerConfig, rotation_count


# ------------------------------------------------------------------------------------------ fixtures
class FakeMM(fake_provider.FakeMM):
    """The shared fake on the CPU only, with one wrong variant (``broken``: 1.5x the reference)."""

    options: ClassVar[dict[str, tuple[str, ...]]] = {"variant": ("auto", "a", "b", "broken")}
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(devices=frozenset({DeviceKind.CPU}), priority=1)

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        y = super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)
        return y * 1.5 if self.config["variant"] == "broken" else y


@pytest.fixture(autouse=True)
def _fresh_tuning_state():
    lockfile.reset_state()
    yield
    lockfile.reset_state()


@pytest.fixture
def lockpath(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache" / "selection.lock.json"
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(path))
    return path


@pytest.fixture
def with_fake(monkeypatch):
    """The real GEMM providers plus FakeMM (as a third-party plugin, distribution fake-plugin 1.0)."""
    fake = install_fake(monkeypatch, FakeMM)
    lockfile.reset_state()
    return fake


def fake_timer(times: dict[str, float], calls: list[str] | None = None):
    """A timer that runs each candidate once (for real) and reports the given µs."""

    def timer(runs):
        out = {}
        for label, run in runs.items():
            run.fn(0)
            if calls is not None:
                calls.append(label)
            out[label] = Measurement.of([times.get(label, 100.0)] * 3, "fake")
        return out

    return timer


CPU = cpu_platform()
TORCH_F, TORCH_T = "torch_scaled_mm[fast_accum=false]", "torch_scaled_mm[fast_accum=true]"
FAKE_A, FAKE_B, FAKE_BROKEN = "fake_mm[variant=a]", "fake_mm[variant=b]", "fake_mm[variant=broken]"


def gemm(n=32, k=64, m=None, **kw) -> GemmProblem:
    return GemmProblem(n=n, k=k, m=m, device="cpu", **kw)


def tune_fake(path, times, buckets=(1, 8), problems=None, **kw):
    return tuner.tune(problems or [gemm()], m_buckets=buckets, platform=CPU, timer=fake_timer(times),
                      lockfile=path, progress=False, **kw)


# ------------------------------------------------------------------------------------------ pure logic
@pytest.mark.parametrize(
    ("m", "covered", "expected"),
    [
        (1, lockfile.DEFAULT_M_BUCKETS, 1),
        (0, lockfile.DEFAULT_M_BUCKETS, 1),
        (3, lockfile.DEFAULT_M_BUCKETS, 4),
        (16, lockfile.DEFAULT_M_BUCKETS, 16),
        (17, lockfile.DEFAULT_M_BUCKETS, 32),
        (16384, lockfile.DEFAULT_M_BUCKETS, 16384),
        (50000, lockfile.DEFAULT_M_BUCKETS, 16384),
        (1, (16, 256), 16),
        (17, (16, 256), 256),
        (300, (16, 256), 256),
        (5, (), None),
    ],
)
def test_bucket_mapping(m, covered, expected):
    assert lockfile.bucket_for(m, list(covered)) == expected


def test_default_buckets_and_m_lists():
    assert lockfile.DEFAULT_M_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
    assert parse_m_list("1-16384") == list(lockfile.DEFAULT_M_BUCKETS)
    assert parse_m_list("3-20,100") == [4, 8, 16, 100]
    with pytest.raises(ValueError):
        parse_m_list("0,4")


def _result(label, us, rank, ok=True):
    r = tuner.CandidateResult(label, label.split("[")[0], "d", {}, rank)
    r.measurement = Measurement.of([us], "fake") if ok else Measurement.failed("boom")
    return r


def test_tie_break_prefers_static_rank_and_is_order_independent():
    a = _result("static_first", 101.5, (0, (0,)))
    b = _result("fastest", 100.0, (1, (0,)))
    c = _result("slow", 130.0, (2, ()))
    for order in ([a, b, c], [c, b, a], [b, c, a]):
        winner, fastest, runner_up = tuner.select_winner(order, 0.02)
        assert (winner, fastest, runner_up) == (a, b, b)
    pr = tuner.ProblemResult("gemm", gemm(m=1), 1, [a, b, c], [], 0.02).decide()
    assert pr.tie_break and pr.margin == pytest.approx(100.0 / 101.5 - 1)
    # outside the margin the fastest wins; with margin 0 too
    assert tuner.select_winner([_result("s", 103.0, (0, ())), b], 0.02)[0] is b
    assert tuner.select_winner([a, b], 0.0)[0] is b
    # failed candidates never win, even when "fast"
    bad = _result("bad", 1.0, (0, ()), ok=False)
    assert tuner.select_winner([bad, c], 0.02)[0] is c
    assert tuner.select_winner([bad], 0.02) == (None, None, None)


def test_a_win_margin_makes_a_provider_win_only_by_more_than_it():
    costly = _result("costly", 100.0, (0, ()))
    costly.margin = 0.02
    other = _result("other", 101.5, (1, ()))
    winner, fastest, runner_up = tuner.select_winner([costly, other], 0.0)
    assert (winner, fastest, runner_up) == (other, costly, costly)  # 1.5% faster: not enough
    assert tuner.select_winner([costly, _result("other", 102.5, (1, ()))], 0.0)[0] is costly  # 2.5% faster: wins
    # the near-tie margin applies on top: a near-tie of the raised time goes to the static rank
    assert tuner.select_winner([costly, _result("other", 103.0, (1, ()))], 0.02)[0] is costly
    assert tuner.select_winner([_result("first", 103.5, (0, ())), _result("late", 101.0, (2, ()))], 0.0)[0].label \
        == "late"


def test_platform_and_problem_keys():
    key = lockfile.platform_key(CPU)
    assert set(key) == {"device", "gpu", "sm", "driver", "cuda", "libraries"}
    assert key["gpu"] == "CPU" and key["sm"] is None
    assert "torch" in key["libraries"] and "stevedore" not in key["libraries"]
    assert lockfile.key_digest(key) == lockfile.key_digest(json.loads(json.dumps(key)))
    other = {**key, "libraries": {**key["libraries"], "torch": "0.0.1"}}
    assert lockfile.key_digest(other) != lockfile.key_digest(key)
    assert any("torch 0.0.1 (lockfile)" in d for d in lockfile.key_differences(other, key))

    dyn = lockfile.problem_fields("gemm", gemm(act_scale="per_tensor_dynamic", m=3))
    static = lockfile.problem_fields("gemm", gemm(act_scale="per_tensor_static", m=9))
    token = lockfile.problem_fields("gemm", gemm(act_scale="per_token", out_dtype="bfloat16"))
    assert dyn == static and dyn != token  # static/dynamic per-tensor share entries; M is not in the fields
    assert lockfile.entry_key("gemm", dyn, 16) == (
        "gemm/n=32/k=64/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0/m=16"
    )
    assert lockfile.problem_key("gemm", lockfile.problem_fields("gemm", gemm(has_bias=True))).endswith("bias=1")
    nq = lockfile.problem_fields("norm_quant", NormQuantProblem(hidden=4096, tokens=7, residual=True, device="cpu"))
    assert lockfile.entry_key("norm_quant", nq, 8) == "norm_quant/h=4096/bfloat16->e4m3fn/residual=1/m=8"


def test_plugin_versions_are_part_of_the_key(with_fake):
    assert lockfile.platform_key(CPU)["libraries"][FAKE_DIST] == "1.0"


def test_default_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("FP8_BACKENDS_LOCKFILE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert lockfile.lockfile_path() == tmp_path / "fp8_backends" / "selection.lock.json"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    assert lockfile.default_lockfile_path() == Path.home() / ".cache" / "fp8_backends" / "selection.lock.json"
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", "off")
    assert lockfile.lockfile_path() is None


def test_models():
    assert [(s.n, s.k) for s in linear_shapes("llama3-8b")] == [(6144, 4096), (4096, 4096), (28672, 4096),
                                                                 (4096, 14336)]
    assert [(s.n, s.k) for s in linear_shapes("Llama-3-70B", tp=8)] == [(1280, 8192), (8192, 1024), (7168, 8192),
                                                                         (8192, 3584)]
    assert linear_shapes("qwen2-7b")[0].bias and not linear_shapes("qwen2-7b")[1].bias
    assert model_spec("mistral-7b").hidden == 4096
    with pytest.raises(ValueError, match="tp=8"):
        linear_shapes("qwen2-7b", tp=8)
    with pytest.raises(ValueError, match="unknown model"):
        model_spec("gpt-5")


def test_cpu_timer_and_rotation():
    assert rotation_count(16 << 20, 60 << 20) == 15
    assert rotation_count(500 << 20, 60 << 20) == 2
    assert rotation_count(1, 60 << 20, maximum=32) == 32

    def boom(i):
        raise RuntimeError("kernel exploded")

    results = CpuTimer(TimerConfig(rounds=2, replays=2))({"ok": Run(lambda i: sum(range(100)), 2), "bad": Run(boom)})
    assert results["ok"].ok and results["ok"].median_us > 0 and len(results["ok"].samples_us) == 4
    assert not results["bad"].ok and "kernel exploded" in results["bad"].error


class _FakeCuda:
    """Just enough of torch.cuda for timing._GraphReplayer: a "graph" records closures and replays them."""

    class CUDAGraph:
        def __init__(self):
            self.ops = []

        def replay(self):
            for op in self.ops:
                op()

    class Event:
        def __init__(self, enable_timing=True):
            self.t = 0.0

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    capturing = None

    @classmethod
    def graph(cls, g):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            cls.capturing = g
            try:
                yield
            finally:
                cls.capturing = None

        return ctx()

    @staticmethod
    def synchronize():
        pass


def test_graph_replayer_logic_with_a_fake_cuda():
    import types

    import torch

    from fp8_backends.tuning import timing

    fake = types.SimpleNamespace(cuda=_FakeCuda, Tensor=torch.Tensor, uint8=torch.uint8)
    expected = torch.arange(4.0)

    def make_run(records_work: bool):
        def fn(i):
            out = torch.empty(4, dtype=torch.float8_e4m3fn)
            work = lambda: out.copy_(expected.to(torch.float8_e4m3fn))  # noqa: E731
            g = _FakeCuda.capturing
            if g is None:
                work()
            elif records_work:
                g.ops.append(work)
            return out

        def check(out):
            ok = torch.equal(out.float(), expected)
            return (0.0 if ok else 1.0), (None if ok else "stale output")

        return Run(fn, n_sets=2, check=check)

    cfg = TimerConfig(target_replay_us=100.0, max_passes=4)
    rep = timing._GraphReplayer(fake, make_run(True), cfg, per_call_us=10.0)
    assert rep.calls == 2 * 4 and rep.method == "cuda_graph"  # ceil(100 / (10 * 2)) = 5 passes, capped at 4
    samples = rep.time(3)
    assert len(samples) == 3 and all(s >= 0 for s in samples)
    with pytest.raises(timing.GraphOutputError, match="stale output"):
        timing._GraphReplayer(fake, make_run(False), cfg, per_call_us=10.0)  # graph writes nothing


# ------------------------------------------------------------------------------------------ tuning + lockfile
def test_tune_writes_a_valid_lockfile_and_verifies_before_timing(lockpath, with_fake):
    calls: list[str] = []
    times = {FAKE_BROKEN: 10.0, FAKE_B: 50.0, FAKE_A: 90.0, TORCH_F: 100.0, TORCH_T: 100.0}
    report = tuner.tune([gemm()], m_buckets=[1, 8], platform=CPU, timer=fake_timer(times, calls),
                        lockfile=lockpath, progress=False)
    assert FAKE_BROKEN not in calls  # wrong output: never timed, cannot win
    doc, problem = lockfile.read_document(lockpath)
    assert problem is None and lockfile.validate_document(doc) == []
    assert doc["schema"] == lockfile.SCHEMA
    (section,) = doc["sections"].values()
    assert section["platform"] == lockfile.platform_key(CPU)
    assert lockpath.read_text() == lockfile.dumps(doc)  # deterministic serialisation
    key = lockfile.entry_key("gemm", lockfile.problem_fields("gemm", gemm()), 8)
    entry = section["entries"][key]
    assert entry["choice"] == {"provider": "fake_mm", "distribution": FAKE_DIST, "options": {"variant": "b"},
                               "us": 50.0, "error": entry["choice"]["error"]}
    assert entry["choice"]["error"] < 1e-2
    assert [r["options"] for r in entry["ranking"]][:2] == [{"variant": "b"}, {"variant": "a"}]
    assert entry["rejected"][0]["label"] == FAKE_BROKEN and "relative error" in entry["rejected"][0]["reason"]
    assert entry["tie_break"] is False and entry["tie_margin"] == lockfile.DEFAULT_TIE_MARGIN == 0.0
    assert entry["method"] == "fake"
    assert len(report.problems) == 2 and report.lockfile_entries_total == 2
    summary = tuner.format_summary(report)
    assert FAKE_B in summary and "runner-up" in summary


def test_near_tie_recorded_and_reruns_do_not_flip(lockpath, with_fake):
    # with a 2% margin: the fake is 1% faster than torch but torch ranks first statically: torch wins, marked as a
    # tie-break
    for jitter in (0.0, 0.5, -0.5):
        times = {TORCH_F: 100.0 + jitter, TORCH_T: 110.0, FAKE_A: 99.0, FAKE_B: 120.0}
        tune_fake(lockpath, times, buckets=[4], tie_margin=0.02)
        lockfile.reset_state()
        res = resolution.explain("gemm", "auto", problem=gemm(m=4), platform=CPU)
        assert (res.source, res.backend.label) == ("lockfile", TORCH_F)
        assert "near-tie within 2%" in res.note
        entry = next(iter(json.loads(lockpath.read_text())["sections"].values()))["entries"]
        (record,) = entry.values()
        assert record["tie_break"] is True and record["fastest"] == FAKE_A


def test_the_default_margin_records_the_measured_fastest(lockpath, with_fake):
    # the same times with the tuner's default margin (0): the fake, 1% faster, wins; no tie-break
    tune_fake(lockpath, {TORCH_F: 100.0, TORCH_T: 110.0, FAKE_A: 99.0, FAKE_B: 120.0}, buckets=[4])
    lockfile.reset_state()
    res = resolution.explain("gemm", "auto", problem=gemm(m=4), platform=CPU)
    assert (res.source, res.backend.label) == ("lockfile", FAKE_A)
    assert "near-tie" not in res.note
    (record,) = next(iter(json.loads(lockpath.read_text())["sections"].values()))["entries"].values()
    assert record["tie_break"] is False and record["tie_margin"] == 0.0 and record["runner_up"] == TORCH_F


def test_auto_uses_the_lockfile_choice_with_options(lockpath, with_fake, monkeypatch):
    tune_fake(lockpath, {FAKE_B: 50.0, FAKE_A: 90.0, TORCH_F: 100.0, TORCH_T: 100.0}, buckets=[1, 8, 64])
    res = resolution.explain("gemm", "auto", problem=gemm(m=5), platform=CPU)
    assert res.error is None and res.source == "lockfile"
    assert res.backend.name == "fake_mm" and res.backend.config == {"variant": "b"}
    assert res.note == f"{lockpath}, bucket M=8"
    assert resolution.resolve_gemm_backend("auto", problem=gemm(m=1000), platform=CPU).label == FAKE_B  # clamp

    # the listing shows where the choice came from
    data = collect(CPU, gemm_problem=gemm(m=5))
    assert data["resolution"]["gemm"]["source"] == "lockfile"
    assert data["lockfile"]["status"] == "ok" and data["lockfile"]["entries"] == 3
    text = render(data)
    assert f"auto (lockfile: {lockpath}, bucket M=8)" in text and f"lockfile: {lockpath} (ok" in text

    # not covered / unknown M / disabled: static priorities (torch_scaled_mm, default options)
    for problem in (gemm(m=None), gemm(n=48, m=5), gemm(m=5, out_dtype="float16")):
        res = resolution.explain("gemm", "auto", problem=problem, platform=CPU)
        assert (res.source, res.backend.label) == ("priority", TORCH_F)
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", "off")
    assert resolution.explain("gemm", "auto", problem=gemm(m=5), platform=CPU).source == "priority"
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(lockpath))

    # the tuned choice disabled here: the next of the ranking that can serve
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "fake_mm")
    res = resolution.explain("gemm", "auto", problem=gemm(m=5), platform=CPU)
    assert res.source == "lockfile" and res.backend.name == "torch_scaled_mm" and "ranked #3" in res.note


def test_lockfile_from_another_platform_is_ignored_with_one_warning(lockpath, with_fake, caplog):
    tune_fake(lockpath, {FAKE_B: 50.0})
    doc = json.loads(lockpath.read_text())
    (section,) = doc["sections"].values()
    section["platform"]["libraries"]["torch"] = "1.0.0"
    section["platform"]["libraries"][FAKE_DIST] = "0.9"
    lockpath.write_text(json.dumps(doc))
    lockfile.reset_state()
    with caplog.at_level(logging.DEBUG, logger="fp8_backends"):
        for m in (1, 2, 8, 8):
            res = resolution.explain("gemm", "auto", problem=gemm(m=m), platform=CPU)
            assert (res.source, res.backend.label) == ("priority", TORCH_F)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "torch 1.0.0 (lockfile) vs" in warnings[0] and f"{FAKE_DIST} 0.9 (lockfile) vs 1.0 (here)" in warnings[0]
    assert lockfile.describe_lockfile(CPU)["status"] == "other-platform"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "schema", "bad-entry"])
def test_corrupt_lockfile_is_reported_and_rebuilt(lockpath, with_fake, caplog, damage):
    tune_fake(lockpath, {FAKE_B: 50.0})
    text = lockpath.read_text()
    if damage == "truncate":
        lockpath.write_text(text[: len(text) // 2])
    elif damage == "garbage":
        lockpath.write_bytes(b"\x00\xff not json")
    elif damage == "schema":
        lockpath.write_text(json.dumps({"schema": "something/9", "sections": []}))
    else:  # one broken entry: the file stays usable, that entry is skipped
        doc = json.loads(text)
        entries = next(iter(doc["sections"].values()))["entries"]
        entries[next(iter(sorted(entries)))] = {"kind": "gemm", "m": "x"}
        lockpath.write_text(json.dumps(doc))
    lockfile.reset_state()
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        for _ in range(2):
            res = resolution.explain("gemm", "auto", problem=gemm(m=8), platform=CPU)
            assert res.error is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    if damage == "bad-entry":  # one WARNING with the counts; the m=8 entry survived
        assert len(warnings) == 1 and "1 of 2 entries skipped" in warnings[0] and "no integer 'm'" in warnings[0]
        assert res.source == "lockfile"
        return
    assert len(warnings) == 1 and "ignoring it" in warnings[0] and res.source == "priority"
    assert lockfile.describe_lockfile(CPU)["status"] == "corrupt"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8_backends"):
        tune_fake(lockpath, {FAKE_B: 50.0})
    assert any("rebuilding it" in r.getMessage() for r in caplog.records)
    assert lockpath.with_name(lockpath.name + ".corrupt").exists()
    doc, problem = lockfile.read_document(lockpath)
    assert problem is None and lockfile.validate_document(doc) == []
    assert resolution.explain("gemm", "auto", problem=gemm(m=8), platform=CPU).source == "lockfile"


WRITER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from fp8_backends.registry import lockfile

    path, wid, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    key = {"device": "cpu", "gpu": "CPU", "sm": None, "driver": None, "cuda": None, "libraries": {"torch": "x"}}
    for i in range(count):
        fields = {"n": 16 * (wid + 1), "k": 64, "input_dtype": "e4m3fn", "weight_dtype": "e4m3fn",
                  "out_dtype": "bfloat16", "act_scale": "per_tensor", "weight_scale": "per_tensor",
                  "has_bias": False}
        entry = {"kind": "gemm", "problem": fields, "m": i + 1, "ranking": [{"pad": "x" * 2000}],
                 "choice": {"provider": "p%d" % wid, "options": {}}}
        lockfile.write_entries(path, key, {lockfile.entry_key("gemm", fields, i + 1): entry}, timeout=60)
    """
)


def test_concurrent_writers_merge_without_torn_files(tmp_path):
    path = tmp_path / "shared" / "selection.lock.json"
    writers, count = 4, 12
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), str(count)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for w in range(writers)
    ]
    reads = 0
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        doc, problem = lockfile.read_document(path)
        assert problem in (None, "missing"), problem  # never a torn file
        reads += doc is not None
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    doc, problem = lockfile.read_document(path)
    assert problem is None and lockfile.validate_document(doc) == []
    (section,) = doc["sections"].values()
    assert len(section["entries"]) == writers * count
    assert {e["choice"]["provider"] for e in section["entries"].values()} == {f"p{w}" for w in range(writers)}
    assert not list(path.parent.glob(".*.tmp"))  # no temporary files left behind


def test_tune_at_first_use(lockpath, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_TUNE", "1")
    res = resolution.explain("gemm", "auto", problem=gemm(m=3), platform=CPU)
    assert res.source == "lockfile" and res.note.startswith(f"{lockpath}, bucket M=4")
    stamp = lockpath.stat().st_mtime_ns
    res = resolution.explain("gemm", "auto", problem=gemm(m=4), platform=CPU)
    assert res.source == "lockfile" and lockpath.stat().st_mtime_ns == stamp  # covered: no second tuning
    resolution.explain("gemm", "auto", problem=gemm(m=100), platform=CPU)  # another bucket: tuned and merged
    (section,) = json.loads(lockpath.read_text())["sections"].values()
    assert sorted(e["m"] for e in section["entries"].values()) == [4, 128]


def test_norm_quant_tuning_and_auto(lockpath):
    problems = [NormQuantProblem(hidden=64, residual=r, device="cpu") for r in (False, True)]
    report = tuner.tune(problems, m_buckets=[2], platform=CPU, lockfile=lockpath, progress=False,
                        timer_config=TimerConfig(rounds=1, replays=1))
    assert all(pr.winner is not None and pr.winner.provider == "torch" for pr in report.problems)
    res = resolution.explain("norm_quant", "auto", problem=NormQuantProblem(hidden=64, tokens=1, residual=True,
                                                                           device="cpu"), platform=CPU)
    assert res.source == "lockfile" and res.note == f"{lockpath}, bucket M=2"


def test_cli_on_cpu(tmp_path, capsys):
    path, report_path = tmp_path / "sel.json", tmp_path / "report.json"
    rc = tune_cli.main(["--device", "cpu", "--shapes", "32,64", "--m", "1,2", "--lockfile", str(path),
                     "--no-progress", "--rounds", "1", "--replays", "1", "--report", str(report_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "winner" in out and f"lockfile: {path} (2 entries" in out
    assert lockfile.read_document(path)[1] is None
    assert json.loads(report_path.read_text())["schema"] == "fp8_backends.tune-report/1"
    assert tune_cli.main(["--device", "cpu", "--model", "llama3-8b", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "N=28672 K=4096" in listing and "N=4096 K=14336" in listing and TORCH_T in listing
    with pytest.raises(SystemExit):
        tune_cli.main(["--device", "cpu", "--m", "0"])


def test_policy_module_is_light():
    code = ("import sys; import fp8_backends.registry.lockfile_policy as p, fp8_backends.registry.lockfile as t; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(t.SCHEMA, p.POLICY_NAME)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_tune_end_to_end_on_gpu(tmp_path, monkeypatch):
    import torch

    from fp8_backends.registry.platform import detect_platform
    from fp8_backends.tuning.timing import measure_copy_bandwidth

    path = tmp_path / "sel.json"
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(path))
    platform = detect_platform("cuda")
    problems = [GemmProblem(n=256, k=512), GemmProblem(n=512, k=256)]
    # torch_scaled_mm only: quick on a cold machine (every provider is tuned by bench/run_device.sh's tune stage),
    # and at M <= 16 on SM 9.0 the measured defaults would name triton: the lockfile's entry must win over them
    report = tuner.tune(problems, m_buckets=[1, 16, 128], platform=platform, lockfile=path, progress=False,
                        timer_config=TimerConfig.quick(), providers={"torch_scaled_mm"})
    assert len(report.problems) == 6
    for pr in report.problems:
        assert pr.winner is not None, tuner.format_rejections(report)
        assert 0 < pr.winner.us < 10_000
        assert any(r.measurement is not None and r.measurement.method == "cuda_graph" for r in pr.results)
    problem = GemmProblem(n=256, k=512, m=10)
    res = resolution.explain("gemm", "auto", problem=problem, platform=platform)
    assert res.source == "lockfile" and "bucket M=16" in res.note
    assert res.backend.name == "torch_scaled_mm"
    w = (torch.randn(256, 512, device="cuda") * 2)
    w_q, w_s = reference.quantize_dynamic_per_tensor(w)
    x_q, x_s = reference.quantize_dynamic_per_tensor(torch.randn(10, 512, device="cuda"))
    y = res.backend.gemm(x_q, res.backend.prepare_weight(w_q, w_s), x_s)
    expected = reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32)
    assert float((y.float() - expected).norm() / expected.norm()) < 1e-2
    assert measure_copy_bandwidth("cuda", nbytes=64 << 20) > 100  # GB/s


def test_fp8linear_runs_each_batch_size_on_its_tuned_provider(lockpath, monkeypatch, with_fake):
    """A layer resolved with ``auto`` prepares one provider per lockfile bucket and dispatches on M."""
    import torch

    from fp8_backends.layers import Fp8Linear

    # two CPU providers (fast_accum=true is refused on the CPU, so the plugin's variant a stands in)
    tune_fake(lockpath, {FAKE_A: 50.0, TORCH_F: 100.0}, buckets=[1])
    tune_fake(lockpath, {TORCH_F: 50.0, FAKE_A: 100.0}, buckets=[8])
    linear = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear, act_scale="per_tensor_dynamic")
    assert layer.kernel.per_m and [(b, be.label) for b, be, _ in layer.kernel.rows] == [(1, FAKE_A), (8, TORCH_F)]
    assert layer.backends_text == f"M<=1:{FAKE_A},M>1:{TORCH_F}"
    assert f"backends=M<=1:{FAKE_A}" in repr(layer)
    rows = layer.kernel.rows
    assert rows[0].prepared.data.data_ptr() == rows[1].prepared.data.data_ptr()  # views, no weight copy
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")  # the dispatch traces (M is static)
    for m in (1, 5):
        x = torch.randn(m, 64, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), layer(x))
    used = []
    for _, backend, _ in layer.kernel.rows:
        orig = backend.gemm_impl
        monkeypatch.setattr(backend, "gemm_impl",
                            lambda *a, _o=orig, _l=backend.label: used.append(_l) or _o(*a))
    for m in (1, 5, 100):  # 100 is beyond the largest bucket: the largest serves it
        x = torch.randn(m, 64, dtype=torch.bfloat16)
        y = layer(x)
        x_q, x_s = reference.quantize_dynamic_per_tensor(x)
        ref = reference.fp8_gemm(x_q, layer.weight, x_s, layer.weight_scale, torch.bfloat16)
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
    assert used == [FAKE_A, TORCH_F, TORCH_F]
    # an explicit choice ignores the lockfile
    explicit = Fp8Linear.from_linear(linear, act_scale="per_tensor_dynamic", backend="torch_scaled_mm")
    assert not explicit.kernel.per_m and len(explicit.kernel.rows) == 1
    assert explicit.backends_text == explicit.gemm_backend.label


class ContractBreakingMM(fake_provider.FakeMM):
    """A provider that overrides ``gemm`` itself (skipping the base class's output check) and returns the right
    values in the wrong dtype (``variant=dtype``), shape (``shape``) or as a view on another device type (``cpu``
    tensors are what it makes anyway, so only dtype and shape are exercised on the CPU)."""

    options: ClassVar[dict[str, tuple[str, ...]]] = {"variant": ("auto", "dtype", "shape")}
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(devices=frozenset({DeviceKind.CPU}), priority=1)

    def gemm(self, x_q, prepared, x_scale, *, out_dtype="bfloat16", bias=None):
        y = super().gemm(x_q, prepared, x_scale, out_dtype=out_dtype, bias=bias)
        if self.config["variant"] == "dtype":
            return y.float()
        if self.config["variant"] == "shape":
            return y[:, :-1]
        return y


@pytest.mark.parametrize("variant", ["dtype", "shape"])
def test_tuner_rejects_a_candidate_whose_output_breaks_the_contract(lockpath, monkeypatch, variant):
    install_fake(monkeypatch, ContractBreakingMM)
    lockfile.reset_state()
    label = f"fake_mm[variant={variant}]"
    report = tuner.tune([gemm()], m_buckets=[8], platform=CPU, timer=fake_timer({label: 1.0}), lockfile=lockpath,
                        progress=False)
    (pr,) = report.problems
    (bad,) = [c for c in pr.results if c.label == label]
    assert bad.wrong_output == "output contract" and bad.reason.startswith("gemm returned")
    assert ("dtype torch.float32" if variant == "dtype" else "shape [8, 31]") in bad.reason
    assert pr.winner is not None and pr.winner.label != label


def test_tune_cli_keeps_the_engine_names():
    from fp8_backends import tune
    from fp8_backends.tuning import engine, plan

    for name in ("tune", "measure_candidates", "select_winner", "CandidateResult", "ProblemResult", "TuneReport",
                 "format_summary", "format_rejections"):
        assert getattr(tune, name) is getattr(engine, name)
    assert tune.parse_m_list is plan.parse_m_list and tune.QUICK_M_BUCKETS == plan.QUICK_M_BUCKETS


# ------------------------------------------------------------------------------------------ stopping and locks
def test_an_interrupt_while_writing_stops_the_run_without_writing_again(lockpath, monkeypatch):
    """Ctrl-C (or SIGTERM) during a lockfile write (e.g. waiting for the lock) ends the run: no second write."""
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(args[0])
        raise KeyboardInterrupt

    monkeypatch.setattr(tuner.lockfile_io, "write_entries", interrupted)
    report = tune_fake(lockpath, {}, buckets=(1,), problems=[gemm(), gemm(n=64)])
    assert len(calls) == 1
    assert report.stopped == "interrupted" and len(report.problems) == 1
    assert report.write_errors and "interrupted" in report.write_errors[0]


def test_an_interrupt_during_the_last_write_ends_the_run(lockpath, monkeypatch):
    """An interrupt while measuring writes what was measured once; a second one during that write stops it."""
    calls = []

    def timer(runs):
        if calls:
            raise KeyboardInterrupt
        calls.append("timed")
        return fake_timer({})(runs)

    def interrupted(*args, **kwargs):
        calls.append("write")
        raise KeyboardInterrupt

    monkeypatch.setattr(tuner.lockfile_io, "write_entries", interrupted)
    report = tuner.tune([gemm()], m_buckets=(1, 2), platform=CPU, timer=timer, lockfile=lockpath, progress=False)
    assert calls == ["timed", "write"] and report.stopped == "interrupted" and report.write_errors


def test_a_lock_file_that_cannot_be_created_is_an_error_at_once(tmp_path):
    """No waiting for the lock timeout when the lock file cannot be created (a file where its folder should be;
    /proc); a lock another process holds is still waited for."""
    from filelock import FileLock, Timeout

    (tmp_path / "file").write_text("")
    paths = [tmp_path / "file" / "sel.lock.json"] + ([Path("/proc/fp8-backends-test.lock.json")]
                                                     if Path("/proc/self").exists() else [])
    for path in paths:
        assert lockfile.lock_problem(path) is not None
        started = time.monotonic()
        with pytest.raises(DataFileError, match="cannot"), lockfile.locked(path, timeout=5):
            pass
        assert time.monotonic() - started < 2
    path = tmp_path / "held" / "sel.lock.json"
    assert lockfile.lock_problem(path) is None
    with FileLock(str(path) + ".lock"), pytest.raises(Timeout), lockfile.locked(path, timeout=0.2):
        pass


@pytest.mark.parametrize("value", ["off", "None", "0", "false", "NO"])
def test_a_lockfile_turned_off_is_shown_by_the_value_that_turned_it_off(monkeypatch, value):
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", f" {value} ")
    shown = lockfile.describe_lockfile(CPU)
    assert shown["status"] == "disabled" and shown["detail"] == f"FP8_BACKENDS_LOCKFILE={value}"
