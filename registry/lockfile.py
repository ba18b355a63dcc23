"""The tuned selection lockfile: format, keys, locking, atomic writes, and cached, validated reading.

``python -m fp8_backends.tune`` times every provider that can serve a problem and writes the winner
here; ``auto`` then reads it through the ``"lockfile"`` selection policy (:mod:`.lockfile_policy`).

File (JSON, schema ``fp8_backends.selection/1``)::

    {
      "schema": "fp8_backends.selection/1",
      "updated": "2026-11-30T12:00:00Z",
      "sections": {
        "<digest of the platform key>": {
          "platform": {"device": "cuda", "gpu": "NVIDIA H200", "sm": "9.0", "driver": "13.0",
                       "cuda": "13.0", "libraries": {"torch": "2.11.0", "flashinfer-python": "0.7.2", ...}},
          "entries": {
            "gemm/n=4096/k=4096/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0/m=16": {
              "kind": "gemm", "problem": {"n": 4096, "k": 4096, ...}, "m": 16,
              "choice": {"provider": "torch_scaled_mm", "distribution": "fp8-backends",
                         "options": {"fast_accum": "false"}, "us": 7.7},
              "ranking": [{"provider": ..., "distribution": ..., "options": {...}, "us": ..., "error": ...}, ...],
              "tie_break": true, "tie_margin": 0.02, "rejected": [{"label": ..., "reason": ...}],
              "method": "cuda_graph", "tuned_at": "..."}}}}}

- A *section* holds the entries measured on one platform key: GPU name, SM, CUDA driver and
  runtime versions, and the versions of the libraries kernels come from (torch, triton,
  flashinfer, CUTLASS, this package, and every third-party provider distribution). ``auto`` uses
  only the section whose key equals this process's; otherwise it logs ONE warning naming what
  differs and falls back to static priorities.
- An *entry* key is the problem without M (kind, N, K, dtypes, scale modes, bias; hidden size etc.
  for norm-quant) plus an M bucket. Block-wise FP8 problems add their group size and weight block
  (``.../act=per_token_group/g=128/w=block/128x128/bias=0/m=16``); the other modes' keys carry neither.
  A problem's M maps to the smallest covered bucket >= M, or the
  largest covered bucket when M is larger than all of them (:func:`bucket_for`). ``m=None`` (batch
  size unknown, e.g. at load time) does not use the lockfile: static priorities decide.
- ``choice`` was decided at tune time: among candidates within ``tie_margin`` of the fastest, the
  one static priorities rank first (the default margin, :data:`DEFAULT_TIE_MARGIN`, is 0: the
  fastest). Reading never re-decides, so the same file gives the same choice
  every run. If the choice cannot serve here (disabled, not installed), the next of ``ranking`` that
  can is used.
- Writers merge their entries into the file under a file lock (``<path>.lock``) and replace it
  atomically (temporary file + ``os.replace``), so concurrent tensor-parallel ranks never tear it.
  A truncated or corrupt file is reported once (WARNING), ignored by readers, and rebuilt by the
  next writer (the bad file is kept as ``<path>.corrupt``).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_backends.core import settings
from fp8_backends.core.errors import DataFileError
from fp8_backends.core.types import ActScale, GemmProblem, NormQuantProblem, WeightScale

from .discovery import ProviderEntry, discover
from .once import WarnOnce
from .platform import Platform

logger = logging.getLogger("fp8_backends")

SCHEMA = "fp8_backends.selection/1"
DEFAULT_M_BUCKETS: tuple[int, ...] = tuple(2**i for i in range(15))  # 1 ... 16384
#: near-ties (within this relative margin of the fastest) go to static priority. 0: the measured fastest wins (static
#: priority breaks exact ties only). It was 0.02 until 2026-12-01: re-deciding the shipped H200 data at 0 raised `auto`
#: on 364 in-grid points of an independent run from 0.9949 to 0.9976 of the fastest (geomean), its minimum from 0.871 to
#: 0.918, and cut the points below 0.97 from 18 to 5
#: (bench/results/auto_eval/2026-12-01-h200-tie-margin-2pct/tie_margin_replay.md): priority's pick among near-ties was
#: slower in another run more often than the measured fastest
DEFAULT_TIE_MARGIN = 0.0
DEFAULT_LOCK_TIMEOUT_S = 600.0
#: distributions whose versions do not change kernels (left out of the platform key)
UNKEYED_DISTRIBUTIONS = frozenset({"stevedore", "cuda-python"})
_OFF = {"off", "none", "0", "false", "no"}


# ---------------------------------------------------------------------------------------- paths
def default_lockfile_path() -> Path:
    """``selection.lock.json`` in the cache folder (:func:`fp8_backends.core.settings.cache_dir`:
    ``$FP8_BACKENDS_CACHE_DIR``, else ``$XDG_CACHE_HOME/fp8_backends``, ``~/.cache`` when unset or relative)."""
    return settings.cache_dir() / "selection.lock.json"


def lockfile_setting() -> str:
    """``FP8_BACKENDS_LOCKFILE`` as set, stripped (``""`` when unset): a path, or a value that turns the lockfile off
    (``off``, ``none``, ``0``, ``false``, ``no``; any case)."""
    return os.environ.get(settings.LOCKFILE_ENV, "").strip()


def lockfile_path() -> Path | None:
    """The lockfile ``auto`` reads: ``FP8_BACKENDS_LOCKFILE``, else the default; None when set to ``off``."""
    raw = lockfile_setting()
    where = ("", "") if raw else (os.environ.get(settings.CACHE_DIR_ENV, ""), os.environ.get("XDG_CACHE_HOME", ""))
    return _path_for(raw, where)


@functools.lru_cache(maxsize=16)
def _path_for(raw: str, where: tuple[str, str]) -> Path | None:
    if raw.lower() in _OFF:
        return None
    return Path(raw).expanduser() if raw else default_lockfile_path()


# ---------------------------------------------------------------------------------------- keys
def platform_key(platform: Platform, kinds: Sequence[str] = ("gemm", "norm_quant")) -> dict[str, Any]:
    """What a section of the lockfile is valid for (JSON-ready, deterministic).

    Library versions: the platform's tracked distributions except :data:`UNKEYED_DISTRIBUTIONS`, plus
    the distribution of every discovered third-party provider of ``kinds``.
    """
    libs = {k: v for k, v in platform.library_versions.items() if k not in UNKEYED_DISTRIBUTIONS}
    for kind in kinds:
        for entry in discover(kind):
            if entry.dist and not entry.builtin and entry.dist_version:
                libs[settings.canonical_dist(entry.dist)] = entry.dist_version
    return {
        "device": platform.kind.value,
        "gpu": platform.name,
        "sm": None if platform.sm is None else f"{platform.sm[0]}.{platform.sm[1]}",
        "driver": platform.driver_version,
        "cuda": platform.cuda_runtime_version,
        "libraries": dict(sorted(libs.items())),
    }


def key_digest(key: Mapping[str, Any]) -> str:
    """Short stable id of a platform key (the section's name in the file)."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def key_differences(lockfile_key: Mapping[str, Any], here: Mapping[str, Any]) -> list[str]:
    """Human-readable differences, e.g. ``["torch 2.11.0 (lockfile) vs 2.13.0 (here)"]``."""
    out = []
    labels = {"device": "device", "gpu": "GPU", "sm": "SM", "driver": "CUDA driver", "cuda": "CUDA runtime"}
    for field_name, label in labels.items():
        a, b = lockfile_key.get(field_name), here.get(field_name)
        if a != b:
            out.append(f"{label} {a} (lockfile) vs {b} (here)")
    la, lb = lockfile_key.get("libraries") or {}, here.get("libraries") or {}
    for name in sorted(set(la) | set(lb)):
        a, b = la.get(name, "not installed"), lb.get(name, "not installed")
        if a != b:
            out.append(f"{name} {a} (lockfile) vs {b} (here)")
    return out


def problem_fields(kind: str, problem: Any) -> dict[str, Any]:
    """The problem without its M (tokens), as JSON values.

    Static and dynamic per-tensor activation scales share one key (``act_scale: "per_tensor"``): the
    kernels see one fp32 scale either way. A recorded choice that cannot serve the other mode is
    skipped at lookup (the next of its ranking is used).

    Block-wise FP8 (``per_token_group`` activations x ``block`` weights) keys on its own mode with the activation
    group size and the weight block: ``"group_size": 128`` and ``"weight_block": "128x128"`` (a string, so that a
    problem class stays hashable; :mod:`.nearest`). The other modes carry neither field, so their keys are what they
    were before block problems existed."""
    if kind == "gemm":
        p: GemmProblem = problem
        if p.act_scale is ActScale.PER_TOKEN_GROUP:
            act = "per_token_group"
        else:
            act = "per_token" if p.act_scale is ActScale.PER_TOKEN else "per_tensor"
        out: dict[str, Any] = {
            "n": int(p.n), "k": int(p.k), "input_dtype": p.input_dtype.value, "weight_dtype": p.weight_dtype.value,
            "out_dtype": p.out_dtype.value, "act_scale": act, "weight_scale": p.weight_scale.value,
            "has_bias": bool(p.has_bias),
        }
        if act == "per_token_group" or p.weight_scale is WeightScale.BLOCK:
            out["group_size"] = int(p.group_size)
            out["weight_block"] = block_text(p.weight_block)
        return out
    if kind == "norm_quant":
        q: NormQuantProblem = problem
        return {"hidden": int(q.hidden), "in_dtype": q.in_dtype.value, "out_fp8": q.out_fp8.value,
                "residual": bool(q.residual)}
    raise ValueError(f"unknown provider kind {kind!r}")


def block_text(block: Sequence[int]) -> str:
    """``(128, 128)`` -> ``"128x128"`` (a weight block as the keys write it)."""
    bn, bk = block
    return f"{int(bn)}x{int(bk)}"


def is_block_fields(fields: Mapping[str, Any]) -> bool:
    """Whether problem fields describe a block-wise FP8 GEMM (either side of the pairing)."""
    return fields.get("act_scale") == "per_token_group" or fields.get("weight_scale") == "block"


def problem_m(kind: str, problem: Any) -> int | None:
    """M for a GEMM, the token count for norm-quant (None: unknown)."""
    return problem.m if kind == "gemm" else problem.tokens


def problem_key(kind: str, fields: Mapping[str, Any]) -> str:
    """``gemm/n=4096/k=4096/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0``; block-wise FP8:
    ``gemm/n=7168/k=16384/e4m3fn.e4m3fn->bfloat16/act=per_token_group/g=128/w=block/128x128/bias=0``. Block fields
    without their group size or weight block raise ``KeyError`` (a reader skips such an entry)."""
    f = fields
    if kind == "gemm":
        if is_block_fields(f):  # block-wise FP8: the group size and the weight block are part of the problem
            scales = f"act={f['act_scale']}/g={int(f['group_size'])}/w={f['weight_scale']}/{f['weight_block']}"
        else:
            scales = f"act={f['act_scale']}/w={f['weight_scale']}"
        return (
            f"gemm/n={f['n']}/k={f['k']}/{f['input_dtype']}.{f['weight_dtype']}->{f['out_dtype']}"
            f"/{scales}/bias={int(bool(f['has_bias']))}"
        )
    if kind == "norm_quant":
        return f"norm_quant/h={f['hidden']}/{f['in_dtype']}->{f['out_fp8']}/residual={int(bool(f['residual']))}"
    raise ValueError(f"unknown provider kind {kind!r}")


def entry_key(kind: str, fields: Mapping[str, Any], m: int) -> str:
    return f"{problem_key(kind, fields)}/m={int(m)}"


def bucket_for(m: int, covered: Sequence[int]) -> int | None:
    """The bucket a problem of size ``m`` uses: the smallest covered bucket >= ``m``, else the largest
    covered one (clamp). ``covered`` must be sorted ascending; None when it is empty."""
    if not covered:
        return None
    i = bisect.bisect_left(covered, m)
    return covered[i] if i < len(covered) else covered[-1]


def bucket_below(m: int, bucket: int, covered: Sequence[int]) -> int | None:
    """The bucket just below ``bucket`` in ``covered`` (sorted ascending): the measured bottom of the M range
    ``bucket`` serves. None where ``bucket`` is the lowest, or the highest (it serves every larger M too, an open
    range mostly far above its lower end), or not in ``covered``, or ``m`` lies above it."""
    i = bisect.bisect_left(covered, bucket)
    if m > bucket or i == 0 or i >= len(covered) - 1 or covered[i] != bucket:
        return None
    return covered[i - 1]


def candidate_label(provider: str, options: Mapping[str, str]) -> str:
    """``torch_scaled_mm[fast_accum=true]`` (just the name without options)."""
    cfg = ",".join(f"{k}={v}" for k, v in options.items())
    return f"{provider}[{cfg}]" if cfg else provider


# ---------------------------------------------------------------------------------------- documents
def new_document() -> dict[str, Any]:
    return {"schema": SCHEMA, "updated": None, "sections": {}}


def validate_document(doc: Any) -> list[str]:
    """Structural problems of a lockfile document (empty: usable). Bad single entries are not listed
    here: readers skip them (see :func:`entry_problems`)."""
    if not isinstance(doc, dict):
        return [f"top level is a {type(doc).__name__}, not an object"]
    problems = []
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
    sections = doc.get("sections")
    if not isinstance(sections, dict):
        problems.append("'sections' is missing or not an object")
        return problems
    for name, sec in sections.items():
        if not isinstance(sec, dict) or not isinstance(sec.get("platform"), dict) or not isinstance(
            sec.get("entries"), dict
        ):
            problems.append(f"section {name!r} lacks a 'platform' or 'entries' object")
    return problems


#: the problem fields of an entry, by kind, with their JSON types (what :func:`problem_fields` writes)
PROBLEM_FIELD_TYPES: dict[str, dict[str, type]] = {
    "gemm": {"n": int, "k": int, "input_dtype": str, "weight_dtype": str, "out_dtype": str, "act_scale": str,
             "weight_scale": str, "has_bias": bool},
    "norm_quant": {"hidden": int, "in_dtype": str, "out_fp8": str, "residual": bool},
}
#: the extra problem fields of a block-wise FP8 GEMM entry (``act_scale`` ``per_token_group`` or ``weight_scale``
#: ``block``), with their JSON types
BLOCK_FIELD_TYPES: dict[str, type] = {"group_size": int, "weight_block": str}
_SCALARS = (str, int, float, bool)
_BLOCK_RE = re.compile(r"^[1-9][0-9]*x[1-9][0-9]*$")


def block_field_problems(problem: Mapping[str, Any]) -> list[str]:
    """Why a GEMM entry's block-wise fields are unusable (empty: fine, or not a block problem): both sides of the
    pairing (``per_token_group`` activations with ``block`` weights; an entry with one but not the other was written
    before block problems had keys of their own), an integer ``group_size`` and a ``weight_block`` like ``128x128``."""
    if not is_block_fields(problem):
        return [f"problem field {name!r} belongs to block-wise entries only" for name in BLOCK_FIELD_TYPES
                if name in problem]
    out = []
    if problem.get("act_scale") != "per_token_group" or problem.get("weight_scale") != "block":
        out.append(f"block-wise problem with act_scale {problem.get('act_scale')!r} and weight_scale "
                   f"{problem.get('weight_scale')!r} (block weights pair with per_token_group activations; re-tune)")
    if not _is_int(problem.get("group_size")) or problem["group_size"] < 1:
        out.append("problem field 'group_size' is not a positive int")
    if not isinstance(problem.get("weight_block"), str) or not _BLOCK_RE.match(problem["weight_block"]):
        out.append("problem field 'weight_block' is not a block like '128x128'")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def choice_problems(choice: Any) -> list[str]:
    """Why one recorded candidate (an entry's ``choice`` or a ``ranking`` item) is unusable (empty: fine)."""
    if not isinstance(choice, dict):
        return ["not an object"]
    out = []
    if not isinstance(choice.get("provider"), str) or not choice["provider"]:
        out.append("no 'provider' name")
    if choice.get("distribution") is not None and not isinstance(choice["distribution"], str):
        out.append("'distribution' is not a string")
    options = choice.get("options", {})
    if not (isinstance(options, dict) and all(isinstance(v, _SCALARS) for v in options.values())):
        out.append("'options' is not an object of plain values")
    return out


def entry_problems(entry: Any) -> list[str]:
    """Why one entry is unusable (empty: fine): any field of the wrong type or out of range (optional fields may
    be left out, not set to null)."""
    if not isinstance(entry, dict):
        return ["not an object"]
    out = []
    kind = entry.get("kind")
    if kind not in PROBLEM_FIELD_TYPES:
        out.append(f"kind {kind!r}")
    problem = entry.get("problem")
    if not isinstance(problem, dict):
        out.append("no 'problem'")
    elif kind in PROBLEM_FIELD_TYPES:
        for name, typ in PROBLEM_FIELD_TYPES[kind].items():
            value = problem.get(name)
            if not (isinstance(value, typ) and (typ is not int or _is_int(value))):
                out.append(f"problem field {name!r} is not a {typ.__name__}")
            elif name in ("n", "k", "hidden") and value < 1:
                out.append(f"problem field {name!r} is {value}, not >= 1")
        if kind == "gemm":
            out += block_field_problems(problem)
    if not _is_int(entry.get("m")) or entry["m"] < 0:
        out.append("no integer 'm'")
    bad_choice = choice_problems(entry.get("choice"))
    if bad_choice:
        out.append("'choice': " + ", ".join(bad_choice))
    if not isinstance(entry.get("ranking", []), list):
        out.append("'ranking' is not a list")
    if not isinstance(entry.get("tie_break", False), bool):
        out.append("'tie_break' is not a bool")
    margin = entry.get("tie_margin", DEFAULT_TIE_MARGIN)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        out.append("'tie_margin' is not a number")
    labels = entry.get("labels", [])
    if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
        out.append("'labels' is not a list of strings")
    return out


def platform_problems(platform: Any) -> list[str]:
    """Why a section's ``platform`` key is unusable (empty: fine): every field a string (or null) and
    ``libraries`` an object of strings."""
    if not isinstance(platform, dict):
        return ["'platform' is not an object"]
    out = [f"platform field {name!r} is not a string" for name in ("device", "gpu", "sm", "driver", "cuda")
           if platform.get(name) is not None and not isinstance(platform[name], str)]
    libs = platform.get("libraries", {})
    if not isinstance(libs, dict) or not all(isinstance(v, str) for v in libs.values()):
        out.append("'platform.libraries' is not an object of version strings")
    return out


def dumps(doc: Mapping[str, Any]) -> str:
    """Deterministic text: sorted keys, one-space indent, trailing newline."""
    return json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def read_document(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """``(document, None)``, ``(None, "missing")`` or ``(None, "corrupt: <why>")``. Never raises."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, "missing"
    except OSError as exc:
        return None, f"unreadable: {exc}"
    except UnicodeDecodeError as exc:
        return None, f"corrupt: not UTF-8 text ({exc})"
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return None, f"corrupt: not valid JSON ({exc}; {len(text)} bytes)"
    problems = validate_document(doc)
    if problems:
        return None, "corrupt: " + "; ".join(problems)
    return doc, None


def merge_entries(doc: dict[str, Any], key: Mapping[str, Any], entries: Mapping[str, Mapping[str, Any]]) -> int:
    """Put ``entries`` (entry key -> entry) into ``doc``'s section for ``key``; a new entry replaces an
    old one with the same key, others stay. Returns the section's entry count."""
    digest = key_digest(key)
    section = doc["sections"].setdefault(digest, {"platform": dict(key), "entries": {}})
    section["platform"] = dict(key)
    section["entries"].update({k: dict(v) for k, v in entries.items()})
    return len(section["entries"])


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, fsync it, and ``os.replace`` it over ``path``:
    readers see the old file or the new one, never a part (a full disk or an interrupt leaves the old file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
            os.chmod(tmp, mode)
        except OSError:
            pass
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable (best effort; not on every filesystem)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def lock_problem(path: Path) -> str | None:
    """Why ``<path>.lock`` cannot be created (its folder cannot be made or written, e.g. under ``/proc`` or read-only),
    or None. A lock file that exists already is fine: another process may hold it, and :func:`locked` waits."""
    lock = Path(str(path) + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        if lock.exists():
            return None
        os.close(os.open(lock, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError as exc:
        return f"cannot create the lock file {lock}: {exc.strerror or exc}"
    return None


@contextlib.contextmanager
def locked(path: Path, timeout: float = DEFAULT_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold ``<path>.lock`` (a filelock, shared by every process on the host), waiting up to ``timeout`` seconds
    while another process holds it. A lock file that cannot be created raises
    :class:`~fp8_backends.core.errors.DataFileError` at once (waiting would not help)."""
    from filelock import FileLock

    path = Path(path)
    problem = lock_problem(path)
    if problem is not None:
        raise DataFileError(path, [problem])
    with FileLock(str(path) + ".lock", timeout=timeout):
        yield


def update_document(
    path: Path,
    mutate: Callable[[dict[str, Any]], Any],
    *,
    timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    already_locked: bool = False,
) -> dict[str, Any]:
    """Read-modify-write ``path`` under its lock: ``mutate(doc)`` changes the current document (a fresh
    one when the file is missing or corrupt; a corrupt file is kept as ``<path>.corrupt`` and reported). A path that
    cannot be read (a folder, no permission) raises :class:`~fp8_backends.core.errors.DataFileError`: it is not moved
    aside."""
    path = Path(path)
    with contextlib.nullcontext() if already_locked else locked(path, timeout):
        doc, problem = read_document(path)
        if doc is None and problem and problem.startswith("unreadable"):  # a folder, no permission: not ours to move
            raise DataFileError(path, [f"{problem}: nothing was written"])
        if doc is None:
            if problem and problem != "missing":
                backup = path.with_name(path.name + ".corrupt")
                with contextlib.suppress(OSError):
                    os.replace(path, backup)
                logger.warning("lockfile %s was %s; rebuilding it (old file kept as %s)", path, problem, backup)
            doc = new_document()
        mutate(doc)
        doc["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        atomic_write_text(path, dumps(doc))
    _store.forget(path)
    return doc


def write_entries(
    path: Path,
    key: Mapping[str, Any],
    entries: Mapping[str, Mapping[str, Any]],
    *,
    timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    already_locked: bool = False,
) -> int:
    """Merge ``entries`` into ``path``'s section for platform ``key``; returns the section's entry count."""
    count = 0

    def mutate(doc: dict[str, Any]) -> None:
        nonlocal count
        count = merge_entries(doc, key, entries)

    update_document(path, mutate, timeout=timeout, already_locked=already_locked)
    return count


# ---------------------------------------------------------------------------------------- reading (cached)
@dataclass
class SectionIndex:
    """One section, indexed for lookups: problem key -> sorted buckets and their entries."""

    key: dict[str, Any]
    entries: dict[str, dict[str, Any]]
    buckets: dict[str, list[int]] = field(default_factory=dict)
    by_bucket: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    skipped: int = 0
    #: why entries were skipped or trimmed: problem text -> count (see :func:`entry_problems`)
    problems: dict[str, int] = field(default_factory=dict)
    #: whether :func:`audit_section` looked at this section (it warns once per loaded file and section)
    audited: bool = False

    @classmethod
    def build(cls, section: Mapping[str, Any], checked: bool = False) -> SectionIndex:
        """Index the section's well-formed entries; a malformed one is skipped and a malformed ``ranking`` item
        dropped, each counted in ``problems`` (the caller warns once per file) and logged at DEBUG. ``checked``: the
        caller has already refused any document with a malformed entry or ranking item (shipped data:
        :func:`fp8_backends.registry.shipped_data.check_document`), so entries are indexed without checking them
        again (the shipped H200 file's second check took 0.17 of its 0.41 s in a profiled model load)."""
        idx = cls(key=dict(section["platform"]), entries=dict(section["entries"]))
        for name, entry in idx.entries.items():
            bad = [] if checked else entry_problems(entry)
            if not bad:
                try:
                    pk = problem_key(entry["kind"], entry["problem"])
                except (KeyError, TypeError, ValueError) as exc:
                    bad = [f"problem fields: {exc}"]
            if bad:
                idx.skipped += 1
                for why in bad:
                    idx.problems[why] = idx.problems.get(why, 0) + 1
                logger.debug("lockfile entry %s skipped: %s", name, "; ".join(bad))
                continue
            ranking = entry.get("ranking") or []
            good = ranking if checked else [r for r in ranking if not choice_problems(r)]
            if len(good) != len(ranking):
                why = "malformed 'ranking' items dropped"
                idx.problems[why] = idx.problems.get(why, 0) + len(ranking) - len(good)
                entry = {**entry, "ranking": good}
            idx.by_bucket[(pk, entry["m"])] = entry
            idx.buckets.setdefault(pk, []).append(entry["m"])
        for values in idx.buckets.values():
            values.sort()
        return idx

    def lookup(self, kind: str, problem: Any) -> tuple[int, dict[str, Any]] | None:
        m = problem_m(kind, problem)
        if m is None:
            return None
        pk = problem_key(kind, problem_fields(kind, problem))
        bucket = bucket_for(m, self.buckets.get(pk, ()))
        if bucket is None:
            return None
        return bucket, self.by_bucket[(pk, bucket)]

    def below(self, kind: str, problem: Any, bucket: int) -> dict[str, Any] | None:
        """The entry of :func:`bucket_below` ``bucket`` for ``problem``'s shape (the measured lower end of the M
        range ``bucket`` serves), or None."""
        m = problem_m(kind, problem)
        pk = problem_key(kind, problem_fields(kind, problem))
        below = None if m is None else bucket_below(m, bucket, self.buckets.get(pk, ()))
        return None if below is None else self.by_bucket[(pk, below)]


@dataclass
class LoadedLockfile:
    path: Path
    error: str | None
    sections: dict[str, SectionIndex] = field(default_factory=dict)
    #: (kind, problem, platform, serving entries) -> the policy's answer; dropped with this object on reload
    picks: dict[tuple, Any] = field(default_factory=dict)
    #: problems the file covers for which no recorded choice can serve here (the first one is a WARNING)
    unserved: int = 0


class _Store:
    """Parsed lockfiles, re-read only when the file's (mtime, size, inode) changes; the file is looked at
    (``stat``) at most once per ``STAT_INTERVAL_S`` (writers in this process invalidate at once)."""

    STAT_INTERVAL_S = 1.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, int, int] | None, LoadedLockfile]] = {}
        self._checked: dict[str, float] = {}

    def load(self, path: Path) -> LoadedLockfile:
        name = str(path)
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit is not None and now - self._checked.get(name, -1e9) < self.STAT_INTERVAL_S:
            return hit[1]
        try:
            st = os.stat(path)
            sig: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            sig = None
        with self._lock:
            hit = self._cache.get(name)
            if hit is not None and hit[0] == sig:
                self._checked[name] = now
                return hit[1]
        loaded = self._parse(Path(path), sig) if sig is not None else LoadedLockfile(Path(path), "missing")
        with self._lock:
            self._cache[name] = (sig, loaded)
            self._checked[name] = now
        return loaded

    @staticmethod
    def _parse(path: Path, sig: object = None) -> LoadedLockfile:
        """Read and index ``path``. Malformed sections (their platform key) and entries (any field) are left
        out, with ONE warning per file version giving the counts; never raises."""
        try:
            doc, problem = read_document(path)
            if doc is None:
                return LoadedLockfile(path, problem)
            sections = {}
            dropped: dict[str, int] = {}
            total = skipped = 0
            for sec in doc["sections"].values():
                bad = platform_problems(sec["platform"])
                if bad:
                    for why in bad:
                        dropped[f"section: {why}"] = dropped.get(f"section: {why}", 0) + 1
                    continue
                index = SectionIndex.build(sec)
                sections[key_digest(sec["platform"])] = index
                total += len(index.entries)
                skipped += index.skipped
                for why, count in index.problems.items():
                    dropped[why] = dropped.get(why, 0) + count
        except Exception as exc:  # noqa: BLE001 - a lockfile must never break auto or the layers
            return LoadedLockfile(path, f"corrupt: {type(exc).__name__}: {exc}")
        if dropped:
            _warn_once(("malformed", str(path), sig),
                       "lockfile %s has malformed parts, left out: %d of %d entries skipped (%s); the rest is used "
                       "(the next tune rewrites the file)",
                       path, skipped, total, "; ".join(f"{n}x {why}" for why, n in sorted(dropped.items())))
        return LoadedLockfile(path, None, sections)

    def forget(self, path: Path | None = None) -> None:
        with self._lock:
            if path is None:
                self._cache.clear()
                self._checked.clear()
            else:
                self._cache.pop(str(path), None)
                self._checked.pop(str(path), None)


_store = _Store()
_warnings = WarnOnce(logger)
_warn_once = _warnings.warning  # one WARNING per (problem, file): lockfile_policy warns through it too
_key_cache: dict[tuple, tuple[dict[str, Any], str]] = {}
_last_key: list[Any] = [None]  # (platform, gemm entries, norm entries, result): identity fast path


def current_key(platform: Platform) -> tuple[dict[str, Any], str]:
    """(platform key, digest) for ``platform`` in this process; cached until providers are rediscovered."""
    lists = (discover("gemm"), discover("norm_quant"))
    last = _last_key[0]
    if last is not None and last[0] is platform and last[1] is lists[0] and last[2] is lists[1]:
        return last[3]
    cache_key = (platform, tuple(sorted(platform.library_versions.items())), id(lists[0]), id(lists[1]))
    hit = _key_cache.get(cache_key)
    if hit is None:
        key = platform_key(platform)
        hit = (key, key_digest(key))
        _key_cache[cache_key] = hit
    _last_key[0] = (platform, lists[0], lists[1], hit)
    return hit


def reset_state() -> None:
    """Forget cached files, warnings and keys (tests)."""
    _store.forget()
    _warnings.clear()
    _key_cache.clear()
    _last_key[0] = None
    _path_for.cache_clear()


def _closest_section(sections: Mapping[str, SectionIndex], here: Mapping[str, Any]) -> SectionIndex:
    return min(sections.values(), key=lambda s: (len(key_differences(s.key, here)), key_digest(s.key)))


def covered_buckets(kind: str, problem: Any, platform: Platform) -> list[int]:
    """The M (token) buckets this platform's lockfile section holds for ``problem`` (its own M ignored),
    ascending; ``[]`` when no usable lockfile covers it. Layers use it to pick a provider per bucket."""
    if problem is None or platform.simulated:
        return []
    path = lockfile_path()
    if path is None:
        return []
    try:
        loaded = _store.load(path)
        if loaded.error is not None:
            return []
        section = find_section(loaded, platform)
        if section is None:
            return []
        return list(section.buckets.get(problem_key(kind, problem_fields(kind, problem)), ()))
    except Exception as exc:  # noqa: BLE001 - a lockfile must never break the layers
        _warn_once(("failed", str(path), type(exc).__name__), "lockfile %s could not be used (%s: %s); ignoring it",
                   path, type(exc).__name__, exc)
        return []


def find_section(loaded: LoadedLockfile, platform: Platform, *, warn: bool = True) -> SectionIndex | None:
    """This platform's section, or None (with ONE warning per file and platform saying what differs
    when the file holds only other platforms' sections)."""
    key, digest = current_key(platform)
    section = loaded.sections.get(digest)
    if section is not None and not section.audited:
        audit_section(loaded.path, section)
    if section is None and loaded.sections and warn:
        closest = _closest_section(loaded.sections, key)
        diffs = key_differences(closest.key, key)
        _warn_once(
            ("mismatch", str(loaded.path), digest, tuple(sorted(loaded.sections))),
            "lockfile %s was tuned for another platform and is ignored (static priorities decide); "
            "differences: %s. Re-run python -m fp8_backends.tune here.",
            loaded.path, "; ".join(diffs) or "unknown",
        )
    return section


def audit_section(path: Path, section: SectionIndex) -> None:
    """ONE warning per loaded file and section when recorded choices name providers not installed here or
    carry options their provider no longer takes (the next ranked candidate, or static priorities, decide for
    those; lookups log each at DEBUG)."""
    section.audited = True
    missing: dict[str, int] = {}
    stale: dict[str, int] = {}
    for entry in section.by_bucket.values():
        choice = entry["choice"]
        provider, options = choice["provider"], {str(k): str(v) for k, v in (choice.get("options") or {}).items()}
        found = [e for e in discover(entry["kind"]) if e.name == provider
                 and _dist_matches(e, choice.get("distribution"))]
        label = candidate_label(provider, options)
        if not found:
            missing[provider] = missing.get(provider, 0) + 1
        elif not any(_options_ok(e, options) for e in found):
            stale[label] = stale.get(label, 0) + 1
    if missing or stale:
        parts = [f"{n} name {name}, which is not installed here" for name, n in sorted(missing.items())]
        parts += [f"{n} carry options {label} no longer takes" for label, n in sorted(stale.items())]
        logger.warning("lockfile %s: of %d recorded choices for this platform, %s; the next ranked candidate that "
                       "can serve (else static priorities) decides for those. Re-run python -m fp8_backends.tune "
                       "to refresh it.", path, len(section.by_bucket), "; ".join(parts))


# ---------------------------------------------------------------------------------------- recorded choices
def _options_ok(entry: ProviderEntry, options: Mapping[str, str]) -> bool:
    allowed = getattr(entry.cls, "options", {}) or {}
    return all(k in allowed and str(v) in allowed[k] for k, v in options.items())


def _dist_matches(entry: ProviderEntry, dist: str | None) -> bool:
    if not dist or entry.dist is None:
        return True
    return settings.canonical_dist(entry.dist) == settings.canonical_dist(dist)


# ---------------------------------------------------------------------------------------- listing
def describe_lockfile(platform: Platform) -> dict[str, Any]:
    """What ``python -m fp8_backends.list`` shows about the lockfile for ``platform``."""
    path = lockfile_path()
    if path is None:
        return {"path": None, "status": "disabled", "entries": 0,
                "detail": f"{settings.LOCKFILE_ENV}={lockfile_setting()}"}
    loaded = _store.load(path)
    if loaded.error == "missing":
        return {"path": str(path), "status": "missing", "entries": 0,
                "detail": "no file; python -m fp8_backends.tune writes it"}
    if loaded.error is not None:
        return {"path": str(path), "status": "corrupt", "detail": loaded.error, "entries": 0}
    if platform.simulated:
        return {"path": str(path), "status": "unused", "detail": "simulated platform", "entries": 0}
    key, digest = current_key(platform)
    section = loaded.sections.get(digest)
    if section is None:
        if not loaded.sections:
            return {"path": str(path), "status": "empty", "detail": "no sections", "entries": 0}
        diffs = key_differences(_closest_section(loaded.sections, key).key, key)
        return {"path": str(path), "status": "other-platform", "detail": "; ".join(diffs), "entries": 0}
    problems = len(section.buckets)
    return {"path": str(path), "status": "ok", "entries": len(section.by_bucket),
            "detail": f"{len(section.by_bucket)} entries for {problems} problems on this platform"}


__all__ = [
    "DEFAULT_M_BUCKETS",
    "DEFAULT_TIE_MARGIN",
    "SCHEMA",
    "BLOCK_FIELD_TYPES",
    "block_field_problems",
    "block_text",
    "bucket_below",
    "bucket_for",
    "default_lockfile_path",
    "describe_lockfile",
    "entry_key",
    "is_block_fields",
    "lockfile_path",
    "lockfile_setting",
    "platform_key",
    "problem_fields",
    "problem_key",
    "read_document",
    "update_document",
    "validate_document",
    "write_entries",
]
