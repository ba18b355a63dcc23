"""A CUTLASS JIT builder killed mid-compile (SIGKILL, SIGTERM, Ctrl-C) leaves no compiler running and no temp file
after the next build. On the CPU: a fake nvcc (a shell script that starts a child, like nvcc starts cicc, and
sleeps) replaces nvcc; the builder is a separate Python process that the test kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fp8_backends.providers.cutlass import build, compiler

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups and /proc: Linux")

FAKE_NVCC = textwrap.dedent(
    """\
    #!/bin/sh
    case "$*" in *--version*) echo "Cuda compilation tools, release 12.8, V12.8.93"; exit 0;; esac
    out=""; prev=""
    for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
    if [ -n "$FAKE_NVCC_PIDS" ]; then
        printf 'half a library' > "$out"
        sleep 300 &
        echo "$$ $!" >> "$FAKE_NVCC_PIDS"
        wait
    fi
    printf 'not a real library' > "$out"
    """
)
SPEC = build.LibrarySpec("ws64x16_swap")
BUILDER = "from fp8_backends.providers.cutlass import build; build.build_library(build.LibrarySpec('ws64x16_swap'))"


@pytest.fixture
def toolchain(tmp_path, monkeypatch):
    """A sleeping fake nvcc, fake CUTLASS headers and an empty cache; returns the builder's environment."""
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    cut = tmp_path / "cutlass"
    (cut / "include" / "cutlass").mkdir(parents=True)
    (cut / "include" / "cutlass" / "cutlass.h").write_text("// fake\n")
    (cut / "include" / "cutlass" / "version.h").write_text(
        "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
    util = cut / "tools" / "util" / "include" / "cutlass" / "util"
    util.mkdir(parents=True)
    (util / "packed_stride.hpp").write_text("// fake\n")
    env = {"CUDA_HOME": str(nvcc.parent.parent), build.CUTLASS_DIR_ENV: str(cut),
           build.CACHE_ENV: str(tmp_path / "cache")}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("FAKE_NVCC_PIDS", raising=False)
    return {**os.environ, **env, "FAKE_NVCC_PIDS": str(tmp_path / "nvcc_pids.txt")}


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may be slow to reap)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_for(cond, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _temps(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/.*.tmp"))


def _start_builder_and_wait_for_nvcc(env: dict[str, str]) -> tuple[subprocess.Popen, list[int]]:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER], env=env, cwd="/", stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    pids_file = Path(env["FAKE_NVCC_PIDS"])
    assert _wait_for(lambda: pids_file.is_file() and pids_file.read_text().strip()), builder.communicate(timeout=5)
    pids = [int(p) for p in pids_file.read_text().split()]
    assert all(_running(p) for p in pids)
    return builder, pids


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killed_builder_leaves_no_compiler_and_the_next_build_no_temp_file(toolchain, sig):
    cache = Path(toolchain[build.CACHE_ENV])
    builder, pids = _start_builder_and_wait_for_nvcc(toolchain)
    assert _temps(cache), "the fake nvcc writes its output (a temp file) before sleeping"
    builder.send_signal(sig)
    builder.communicate(timeout=30)
    assert builder.returncode == -sig
    assert _wait_for(lambda: not any(_running(p) for p in pids), 20), f"orphaned compiler processes {pids}"
    assert _temps(cache), "a killed builder cannot clean up itself: the next build does"
    lib = build.build_library(SPEC)  # this process, fake nvcc without sleeping
    assert lib.is_file() and lib.read_bytes() == b"not a real library"
    assert _temps(cache) == []


def test_interrupted_builder_kills_its_compiler_and_removes_its_temp_file(toolchain):
    cache = Path(toolchain[build.CACHE_ENV])
    builder, pids = _start_builder_and_wait_for_nvcc(toolchain)
    builder.send_signal(signal.SIGINT)
    _, err = builder.communicate(timeout=30)
    assert "KeyboardInterrupt" in err
    assert _wait_for(lambda: not any(_running(p) for p in pids), 20), f"orphaned compiler processes {pids}"
    assert _temps(cache) == []
    assert [p for p in cache.iterdir() if p.is_dir()] == []  # nor the library's folder it made


def test_timeout_kills_the_compiler_group(toolchain, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_PIDS", toolchain["FAKE_NVCC_PIDS"])
    rc, _, err = compiler.run_compiler([str(Path(toolchain["CUDA_HOME"]) / "bin" / "nvcc"), "-o", "/dev/null"],
                                       timeout=1.0)
    assert rc == -1 and "timed out" in err
    pids = [int(p) for p in Path(toolchain["FAKE_NVCC_PIDS"]).read_text().split()]
    assert _wait_for(lambda: not any(_running(p) for p in pids), 20)


def test_temp_names_carry_host_and_pid_and_the_sweep_spares_live_and_foreign_ones(tmp_path):
    lib = tmp_path / "lib-x" / "libfp8b_x.so"
    lib.parent.mkdir()
    mine = compiler.temp_path(lib)
    assert mine.name.endswith(f".{os.getpid()}.so.tmp") and compiler.temp_owner(mine.name) == (compiler._host(),
                                                                                                os.getpid())
    manifest = compiler.temp_path(lib.parent / "manifest.json", thread=True)
    assert compiler.temp_owner(manifest.name) == (compiler._host(), os.getpid())
    assert compiler.temp_owner(".libfp8b_x.4242.so.tmp") == (None, 4242)  # the pre-host name
    assert compiler.temp_owner("libfp8b_x.so") is None and compiler.temp_owner(".lock.tmp") is None
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = lib.with_name(f".libfp8b_x.h-{compiler._host()}.{dead.pid}.so.tmp")
    old_style = lib.with_name(f".libfp8b_x.{dead.pid}.so.tmp")
    foreign = lib.with_name(f".libfp8b_x.h-otherhost.{dead.pid}.so.tmp")
    for path in (mine, manifest, gone, old_style, foreign):
        path.write_text("x")
    removed = compiler.sweep_stale_temps(tmp_path)
    assert sorted(removed) == sorted([gone, old_style])
    assert mine.exists() and manifest.exists() and foreign.exists()
