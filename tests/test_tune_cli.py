"""``python -m fp8_backends.tune`` arguments: what is refused before measuring (with a message naming the option),
what an empty plan or shard does, and the exit status when an output cannot be written. Runs on the CPU with
``torch_scaled_mm`` at tiny shapes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fp8_backends import tune as tune_cli
from fp8_backends.registry import lockfile

RUN = ["--device", "cpu", "--no-progress", "--rounds", "1", "--replays", "1", "--providers", "torch_scaled_mm"]


@pytest.fixture(autouse=True)
def _fresh_lockfile_state(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(tmp_path / "default.lock.json"))
    lockfile.reset_state()
    yield
    lockfile.reset_state()


def refused(argv: list[str], capsys) -> str:
    """The argument error ``argv`` gets (exit 2), as printed."""
    with pytest.raises(SystemExit) as info:
        tune_cli.main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_a_lock_file_that_cannot_be_created_is_refused_before_measuring(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    paths = [tmp_path / "file" / "sel.lock.json"]
    paths += [Path("/proc/fp8-backends-test.lock.json")] if Path("/proc/self").exists() else []
    for path in paths:
        started = time.monotonic()
        err = refused([*RUN, "--shapes", "32,64", "--m", "1", "--lockfile", str(path)], capsys)
        assert f"lockfile {path}: cannot create the lock file" in err and time.monotonic() - started < 5


def test_lockfile_off_needs_a_named_lockfile_or_no_write(tmp_path, capsys, monkeypatch):
    """``FP8_BACKENDS_LOCKFILE=off``: auto reads no lockfile, so a run that would write the default one (which auto
    would never read) is refused, naming --lockfile and --no-write."""
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", "none")
    lockfile.reset_state()
    err = refused([*RUN, "--shapes", "32,64", "--m", "1"], capsys)
    assert "FP8_BACKENDS_LOCKFILE=none turns the lockfile off" in err and "--lockfile" in err and "--no-write" in err
    assert not list(tmp_path.glob("*.json"))


def test_an_empty_shard_has_nothing_to_do(tmp_path, capsys):
    """More shards than problems: the empty shard says so and exits 0 (no traceback, no lockfile)."""
    path = tmp_path / "sel.lock.json"
    assert tune_cli.main([*RUN, "--shapes", "32,64", "--m", "1", "--shard", "2/2", "--lockfile", str(path)]) == 0
    assert "nothing to do: no problems in shard 2/2" in capsys.readouterr().out and not path.exists()


@pytest.mark.parametrize(("kind", "given", "needed"), [
    ("norm_quant", ["--shapes", "32,64"], "--kind norm_quant needs --hidden"),
    ("gemm", ["--hidden", "64"], "--hidden is for --kind norm_quant"),
])
def test_problems_of_the_other_kind_are_an_argument_error(kind, given, needed, capsys):
    assert needed in refused([*RUN, "--kind", kind, *given, "--m", "1", "--no-write"], capsys)


def test_a_report_path_that_cannot_be_written_is_refused_before_measuring(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert "is a folder" in refused([*RUN, "--shapes", "32,64", "--m", "1", "--no-write", "--report",
                                     str(tmp_path)], capsys)
    assert "cannot be made" in refused([*RUN, "--shapes", "32,64", "--m", "1", "--no-write", "--report",
                                        str(tmp_path / "file" / "report.json")], capsys)


def test_a_lockfile_that_could_not_be_written_exits_4(tmp_path, capsys, monkeypatch):
    """The measurements are printed, the failure is named, and the exit status says the lockfile is incomplete."""
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lockfile, "write_entries", full_disk)
    path = tmp_path / "sel.lock.json"
    assert tune_cli.main([*RUN, "--shapes", "32,64", "--m", "1", "--lockfile", str(path)]) == 4
    out = capsys.readouterr().out
    assert "torch_scaled_mm" in out and "lockfile NOT fully written" in out and "No space left" in out


@pytest.mark.parametrize(("given", "named"), [
    (["--providers", "bogus"], "--providers: unknown gemm provider(s) bogus"),
    (["--providers", "torch_scaled_mm,bogus"], "--providers: unknown gemm provider(s) bogus"),
    (["--pin", "nosuch:x=y"], "--pin: unknown gemm provider(s) nosuch"),
])
def test_unknown_provider_names_are_refused_listing_the_known_ones(given, named, capsys):
    err = refused(["--device", "cpu", "--no-progress", "--shapes", "32,64", "--m", "1", "--no-write", *given], capsys)
    assert named in err and "known: " in err and "torch_scaled_mm" in err.split("known: ")[1]


@pytest.mark.parametrize("m", ["", " , ", "-1", "0", "1.5", "abc", "8-1", "1-"])
def test_a_bad_m_list_is_refused_naming_m_and_its_syntax(m, capsys):
    err = refused(["--device", "cpu", "--shapes", "32,64", "--m", m, "--list"], capsys)
    assert f"--m {m!r}" in err and "comma-separated positive integers and LO-HI ranges" in err


@pytest.mark.parametrize("seconds", ["nan", "inf", "-1", "0"])
def test_limit_seconds_must_be_finite_and_positive(seconds, capsys):
    err = refused([*RUN, "--shapes", "32,64", "--m", "1", "--no-write", "--limit-seconds", seconds], capsys)
    assert "--limit-seconds must be a finite number of seconds > 0" in err
