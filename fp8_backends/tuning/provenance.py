"""Provenance of shipped selection data: where, with what and by which command the tuner measured it.

``python -m fp8_backends.tune --shipped-grid`` (or ``--provenance``) records a block like this in the document
it writes (format in :mod:`fp8_backends.registry.shipped_data`); resumed runs of the same command (chunks,
shards) add their run records to it::

    {"format": "fp8_backends.shipped/1", "gpu": "NVIDIA H200", "sm": "9.0", "driver": "13.0", "cuda": "13.0",
     "libraries": {"torch": "2.11.0+cu130", ...}, "toolchain": {"cutlass_headers": "4.2.0", "nvcc": "13.0.88"},
     "date": "<first run>", "updated": "<last write>",
     "command": "python -m fp8_backends.tune --shipped-grid --lockfile OUT.json",
     "grid": {"models": [...], "tp": [1, 2, 4, 8], "m_buckets": [...], "scales": [...], "pins": {...},
              "shapes": 260, "problems": 1820},
     "runs": [{"started": "...", "argv": [...], "problems": 812, "seconds": 480.2}, ...]}
"""

from __future__ import annotations

import datetime as _dt
import socket
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fp8_backends.registry import lockfile, shipped_data
from fp8_backends.registry.platform import Platform

#: tuner flags that only change how a run goes (left out of the regenerating command), and whether they take a value
RUN_ONLY_FLAGS = {"--limit-seconds": True, "--shard": True, "--no-progress": False, "--report": True, "-v": False,
                  "--verbose": False}


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def canonical_command(argv: Sequence[str], prog: str = "python -m fp8_backends.tune") -> str:
    """The command that regenerates the data: ``argv`` without the flags that only split or report a run."""
    out, skip_next = [], False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in RUN_ONLY_FLAGS:
            skip_next = RUN_ONLY_FLAGS[flag] and not eq
            continue
        out.append(arg)
    return " ".join([prog, *out])


def toolchain_versions() -> dict[str, str]:
    """CUTLASS headers and nvcc the ``cutlass`` provider builds with (best effort; empty where not found)."""
    out: dict[str, str] = {}
    try:
        from fp8_backends.providers.cutlass import build

        headers = build.find_cutlass()
        if headers is not None:
            out["cutlass_headers"] = build.cutlass_version(headers[0])
        nvcc = build.find_nvcc()
        if nvcc is not None:
            out["nvcc"] = build.nvcc_version(nvcc)
    except Exception:  # provenance must never break tuning
        pass
    return out


def build_provenance(platform: Platform, argv: Sequence[str], grid: Mapping[str, Any]) -> dict[str, Any]:
    """A new provenance block (with this run's record) for ``platform``."""
    key = lockfile.platform_key(platform)
    started = now_iso()
    return {
        "format": shipped_data.FORMAT,
        "gpu": key["gpu"],
        "sm": key["sm"],
        "driver": key["driver"],
        "cuda": key["cuda"],
        "libraries": dict(key["libraries"]),
        "toolchain": toolchain_versions(),
        "date": started,
        "command": canonical_command(argv),
        "grid": dict(grid),
        "runs": [{"id": uuid.uuid4().hex[:12], "started": started, "host": socket.gethostname(), "argv": list(argv)}],
    }


def merge_provenance(old: Any, new: Mapping[str, Any], problems: int, seconds: float) -> dict[str, Any]:
    """``new`` merged into the document's ``old`` block: the first run's date stays, the platform and command are
    the latest, and the current run's record (the last of ``new["runs"]``) is added or updated with how many
    problems it measured in how many seconds."""
    merged = dict(new)
    previous = old if isinstance(old, dict) else {}
    runs = [r for r in previous.get("runs", []) if isinstance(r, dict)]
    current = dict(new["runs"][-1], problems=problems, seconds=round(seconds, 1))
    runs = [r for r in runs if r.get("id") != current.get("id")] + [current]
    merged["runs"] = runs
    merged["date"] = previous.get("date") or new["date"]
    merged["updated"] = now_iso()
    merged["tuning_seconds"] = round(sum(float(r.get("seconds") or 0.0) for r in runs), 1)
    return merged


__all__ = ["RUN_ONLY_FLAGS", "build_provenance", "canonical_command", "merge_provenance", "toolchain_versions"]
