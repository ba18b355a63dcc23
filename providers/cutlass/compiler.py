"""Running a JIT build's compiler so that it never outlives its builder, and sweeping what dead builders left.

**The compiler dies with its builder.** :func:`run_compiler` does not start nvcc directly: it starts a small guard
(this file run as a script, ``python -I compiler.py``) as the leader of a new process group, and
the guard starts nvcc in that group (nvcc's own children, cicc, ptxas and the host compiler, stay in it too). The
builder keeps the write end of a pipe whose read end only the guard holds. Whatever ends the builder — a return, an
exception, ``KeyboardInterrupt``, SIGTERM's default action, SIGKILL, the OOM killer — the kernel closes that write
end, the guard reads end-of-file and kills the whole group. On exceptions in the builder (including
``KeyboardInterrupt``, a timeout, and ``SystemExit`` from a SIGTERM handler) :func:`run_compiler` kills the group
itself and waits for it before re-raising. A pipe instead of ``prctl(PR_SET_PDEATHSIG)`` in a ``preexec_fn``:
``preexec_fn`` is unsafe in a threaded builder (``build_many`` compiles from a thread pool), the death signal follows
the parent *thread* rather than the process, and it would reach nvcc alone, not its children.

**Temp files name their owner.** :func:`temp_path` names a file being written ``.<name>.h-<host>.<pid>[.<tid>].tmp``
(``.so.tmp`` for libraries: nvcc reads the extension); :func:`sweep_stale_temps`, run by every build before it
compiles, removes the temp files of this host whose process is gone (files of other hosts sharing the cache are
left alone; pre-host names count as this host's).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

logger = logging.getLogger("fp8_backends")

#: the guard runs this file as a script in isolated mode (``-I``: stdlib imports only, no dependence on how the
#: builder found this package)
GUARD_SCRIPT = str(Path(__file__).resolve())
_HOST_PREFIX = "h-"


# ------------------------------------------------------------------------------------------ the builder's side
def run_compiler(cmd: Sequence[str], timeout: float) -> tuple[int, str, str]:
    """Run ``cmd`` under the guard; ``(exit status, stdout, stderr)``. A timeout kills the compiler's group and
    returns ``(-1, stdout so far, "timed out after ... s")``; an exception (``KeyboardInterrupt`` included) kills
    it and propagates. ``OSError`` when the guard cannot start."""
    read_end, write_end = os.pipe()  # both non-inheritable: only the guard gets read_end (pass_fds)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", GUARD_SCRIPT, str(read_end), "--", *cmd],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            pass_fds=(read_end,), start_new_session=True, cwd="/",
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    try:
        with _killed_on_exit(proc):
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                out, err = proc.communicate()
                return -1, out or "", f"timed out after {timeout:g} s\n{err or ''}"
            return proc.returncode, out, err
    finally:
        os.close(write_end)


@contextlib.contextmanager
def _killed_on_exit(proc: subprocess.Popen) -> Iterator[None]:
    """Kill ``proc``'s process group (and wait for it) when the block exits with any exception."""
    try:
        yield
    except BaseException:
        kill_group(proc)
        with contextlib.suppress(Exception):
            proc.communicate(timeout=30)
        raise


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (started with ``start_new_session``); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------ temp files
def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "localhost"


def temp_path(final: Path, *, thread: bool = False) -> Path:
    """Where to write ``final`` before renaming it into place: a hidden name carrying host, pid (and thread)."""
    suffix = f".{threading.get_ident()}" if thread else ""
    tail = ".so.tmp" if final.suffix == ".so" else ".tmp"
    stem = final.name[: -len(".so")] if final.suffix == ".so" else final.name
    return final.with_name(f".{stem}.{_HOST_PREFIX}{_host()}.{os.getpid()}{suffix}{tail}")


def temp_owner(name: str) -> tuple[str | None, int] | None:
    """``(host or None, pid)`` of a temp file name from :func:`temp_path` (or the older ``.<name>.<pid>.so.tmp``),
    ``None`` for other names."""
    if not name.startswith(".") or not name.endswith(".tmp"):
        return None
    parts = name[1:-len(".tmp")].split(".")
    if parts and parts[-1] == "so":
        parts.pop()
    numbers = []
    while len(parts) > 1 and parts[-1].isdigit():
        numbers.insert(0, int(parts.pop()))
    if not numbers:
        return None
    host = parts[-1][len(_HOST_PREFIX):] if len(parts) > 1 and parts[-1].startswith(_HOST_PREFIX) else None
    return host, numbers[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale_temps(root: Path) -> list[Path]:
    """Remove the temp files under ``root`` (one folder level down, where builds write) whose builder process on
    this host is gone; returns what was removed."""
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    here = _host()
    for path in root.glob("*/.*.tmp"):
        owner = temp_owner(path.name)
        if owner is None:
            continue
        host, pid = owner
        if (host is not None and host != here) or _alive(pid):
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
            logger.info("cutlass: removed %s, left by builder process %d (gone)", path, pid)
    return removed


# ------------------------------------------------------------------------------------------ the guard
def _guard(argv: list[str]) -> int:
    """The guard process: start the compiler in this process group, kill the group when the builder's pipe closes
    or a termination signal arrives, otherwise exit with the compiler's status."""
    watch_fd, cmd = int(argv[0]), argv[2:]

    def kill_all(*_: object) -> None:
        os.killpg(os.getpgrp(), signal.SIGKILL)  # the compiler, its children and this guard

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, kill_all)
    try:
        child = subprocess.Popen(cmd)
    except OSError as exc:
        print(f"cannot run {cmd[0]}: {exc}", file=sys.stderr)
        return 127

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(watch_fd, 4096):
                pass
        if child.poll() is None:  # end of file before the compiler finished: the builder is gone
            kill_all()

    threading.Thread(target=watch, daemon=True).start()
    status = child.wait()
    return status if status >= 0 else 128 - status  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(_guard(sys.argv[1:]))
