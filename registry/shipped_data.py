"""The format of the per-GPU-family selection data that ships with the package, and its strict checks.

A shipped data file IS a selection lockfile document (schema ``fp8_backends.selection/1``, see
:mod:`.lockfile`: one section, entries keyed by problem and M bucket, each with the tuned ``choice`` and the
measured ``ranking`` of every candidate with its µs) plus a required ``provenance`` object::

    {"schema": "fp8_backends.selection/1",
     "provenance": {"format": "fp8_backends.shipped/1",
                    "gpu": "NVIDIA H200", "sm": "9.0", "driver": "13.0", "cuda": "13.0",
                    "libraries": {"torch": "2.11.0+cu130", "triton": "3.6.0", "flashinfer-python": "0.7.2.post1",
                                  "nvidia-cutlass": "4.2.0.0", "fp8-backends": "0.1.0"},
                    "cutlass_headers": "4.2.0", "date": "2026-12-01T10:00:00Z",
                    "command": "python -m fp8_backends.tune --shipped-grid --lockfile ...",
                    "grid": {...}, "runs": [...]},
     "sections": {"<digest>": {"platform": {...}, "entries": {"gemm/n=.../m=16": {...}, ...}}}}

``python -m fp8_backends.tune --shipped-grid`` writes such a document (the tuner's lockfile with the
provenance block) and ``python -m fp8_backends.selection_data pack`` checks it and writes the compact file
that ships: ``fp8_backends/data/selection/sm<major><minor>-<gpu slug>.json`` (one entry per line). Files are
found by name, so that a GPU whose SM has no file costs nothing, and parsed only when ``auto`` first needs them.

Unlike a user's lockfile (where a bad entry is skipped), shipped data is all-or-nothing: :func:`check_document`
lists every problem and :func:`load_file` raises :class:`~fp8_backends.core.errors.DataFileError` with them.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fp8_backends.core.errors import DataFileError

from . import lockfile

FORMAT = "fp8_backends.shipped/1"
SUPPORTED_FORMATS = frozenset({FORMAT})
#: provenance fields that must be non-empty strings
REQUIRED_TEXT = ("gpu", "sm", "driver", "cuda", "date", "command")
#: libraries whose versions the provenance must state (the kernels' sources)
REQUIRED_LIBRARIES = ("torch", "fp8-backends")
FILE_RE = re.compile(r"^sm(?P<sm>\d{2,3})-(?P<slug>[a-z0-9-]+)\.json(?:\.gz)?$")


def slug(text: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def sm_tag(sm: str | tuple[int, int]) -> str:
    """``"9.0"`` or ``(9, 0)`` -> ``"90"``; ``(10, 0)`` -> ``"100"``."""
    if isinstance(sm, str):
        major, _, minor = sm.partition(".")
        return f"{int(major)}{int(minor or 0)}"
    return f"{int(sm[0])}{int(sm[1])}"


def file_name(sm: str | tuple[int, int], gpu: str) -> str:
    """``sm90-nvidia-h200.json``."""
    return f"sm{sm_tag(sm)}-{slug(gpu)}.json"


def parse_file_name(name: str) -> tuple[str, str] | None:
    """``("90", "nvidia-h200")`` for a shipped data file name, else None."""
    m = FILE_RE.match(name)
    return (m.group("sm"), m.group("slug")) if m else None


# ---------------------------------------------------------------------------------------- checks
def _positive_number(value: Any) -> bool:
    """A finite number > 0 (Python's json reads ``Infinity`` and ``NaN``: no time a ranking can compare)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf


def provenance_problems(prov: Any) -> list[str]:
    """Why a provenance block is unusable (empty: fine)."""
    if not isinstance(prov, dict):
        return ["'provenance' is missing or not an object (shipped data must say where it was measured)"]
    out = []
    fmt = prov.get("format")
    if fmt not in SUPPORTED_FORMATS:
        out.append(f"provenance format is {fmt!r}; this version reads {', '.join(sorted(SUPPORTED_FORMATS))}")
    for name in REQUIRED_TEXT:
        value = prov.get(name)
        if not isinstance(value, str) or not value.strip():
            out.append(f"provenance.{name} is missing or empty")
    if isinstance(prov.get("sm"), str) and not re.fullmatch(r"\d+\.\d", prov["sm"]):
        out.append(f"provenance.sm {prov['sm']!r} is not like '9.0'")
    model = prov.get("model", {})
    if not isinstance(model, dict):
        out.append("provenance.model must be an object")
    else:
        out += [f"provenance.model.{name} must be an integer >= 1" for name in ("neighbours", "sms")
                if not (model.get(name) is None or (isinstance(model[name], int) and not isinstance(model[name], bool)
                                                    and model[name] >= 1))]
    libs = prov.get("libraries")
    if not isinstance(libs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in libs.items()):
        out.append("provenance.libraries is missing or not an object of name -> version strings")
    else:
        out += [f"provenance.libraries lacks {name}" for name in REQUIRED_LIBRARIES if name not in libs]
    return out


def ranking_problems(name: str, entry: Mapping[str, Any]) -> list[str]:
    """The measured candidates of an entry: a non-empty list, each with a provider, options and µs > 0."""
    ranking = entry.get("ranking")
    if not isinstance(ranking, list) or not ranking:
        return [f"entry {name}: no measured 'ranking'"]
    out = []
    for i, cand in enumerate(ranking):
        if not isinstance(cand, dict) or not isinstance(cand.get("provider"), str):
            out.append(f"entry {name}: ranking #{i + 1} has no provider")
        elif not isinstance(cand.get("options", {}), dict):
            out.append(f"entry {name}: ranking #{i + 1} options is not an object")
        elif not _positive_number(cand.get("us")):
            out.append(f"entry {name}: ranking #{i + 1} ({cand['provider']}) has no finite measured µs > 0")
        else:
            out += [f"entry {name}: ranking #{i + 1}: {why}" for why in lockfile.choice_problems(cand)]
    if not _positive_number((entry.get("choice") or {}).get("us")):
        out.append(f"entry {name}: the choice has no finite measured µs > 0")
    return out


def check_document(doc: Any) -> list[str]:
    """Every reason ``doc`` is not usable shipped selection data (empty: usable)."""
    if not isinstance(doc, dict):
        return [f"top level is a {type(doc).__name__}, not an object"]
    out = lockfile.validate_document(doc)
    out += provenance_problems(doc.get("provenance"))
    sections = doc.get("sections")
    if not isinstance(sections, dict):
        return out
    if len(sections) != 1:
        out.append(f"shipped data holds exactly one platform section, found {len(sections)}")
        return out
    (section,) = sections.values()
    if not isinstance(section, dict) or not isinstance(section.get("entries"), dict):
        return out
    prov = doc.get("provenance") if isinstance(doc.get("provenance"), dict) else {}
    plat = section.get("platform") if isinstance(section.get("platform"), dict) else {}
    for fld in ("gpu", "sm"):
        if prov.get(fld) is not None and plat.get(fld) != prov.get(fld):
            out.append(f"provenance.{fld} {prov.get(fld)!r} differs from the section's platform {plat.get(fld)!r}")
    entries = section["entries"]
    if not entries:
        out.append("the section has no entries")
    for name, entry in entries.items():
        bad = lockfile.entry_problems(entry)
        if not bad:
            try:
                expected = lockfile.entry_key(entry["kind"], entry["problem"], entry["m"])
            except (KeyError, TypeError, ValueError) as exc:
                bad = [f"problem fields: {exc}"]
            else:
                if expected != name:
                    bad = [f"key does not match its problem and m (expected {expected})"]
        if bad:
            out.append(f"entry {name}: {'; '.join(bad)}")
            continue
        out += ranking_problems(name, entry)
    return out


# ---------------------------------------------------------------------------------------- reading / writing
def read_text(path: Path) -> str:
    """The file's text (``.gz`` files are decompressed)."""
    raw = Path(path).read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


def load_file(path: str | Path) -> dict[str, Any]:
    """Parse and check one shipped data file; :class:`DataFileError` lists every problem."""
    p = Path(path)
    try:
        text = read_text(p)
    except FileNotFoundError:
        raise DataFileError(p, ["no such file"]) from None
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DataFileError(p, [f"unreadable ({type(exc).__name__}: {exc})"]) from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise DataFileError(p, [f"not valid JSON ({exc})"]) from None
    problems = check_document(doc)
    if problems:
        raise DataFileError(p, problems)
    return doc


def neighbours(prov: Mapping[str, Any], default: int) -> int:
    """How many measured shapes vote for an unmeasured one: ``provenance.model.neighbours`` when the data says
    (chosen by ``selection_data pack --neighbours``), else ``default``."""
    value = (prov.get("model") or {}).get("neighbours")
    return value if isinstance(value, int) and value >= 1 else default


def sms(prov: Mapping[str, Any], default: int) -> int:
    """The SM count of the GPU the data was measured on (the nearest model's wave feature):
    ``provenance.model.sms`` when the data says (``selection_data pack --sms``), else ``default``."""
    value = (prov.get("model") or {}).get("sms")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def the_section(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The one section of a checked document."""
    (section,) = doc["sections"].values()
    return section


def dumps_compact(doc: Mapping[str, Any]) -> str:
    """Deterministic compact text: sorted keys, every entry on its own line (small, and diffs stay readable)."""

    def one(value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    parts = []
    for key in sorted(doc):
        if key != "sections":
            parts.append(f"{one(key)}:{one(doc[key])}")
    sections = []
    for digest in sorted(doc.get("sections", {})):
        sec = doc["sections"][digest]
        entries = sec.get("entries", {})
        lines = ",\n".join(f"{one(name)}:{one(entries[name])}" for name in sorted(entries))
        rest = "".join(f"{one(k)}:{one(sec[k])}," for k in sorted(sec) if k != "entries")
        sections.append(f"{one(digest)}:{{{rest}\"entries\":{{\n{lines}\n}}}}")
    parts.append('"sections":{' + ",".join(sections) + "}")
    return "{" + ",\n".join(parts) + "}\n"


__all__ = [
    "FORMAT",
    "check_document",
    "dumps_compact",
    "file_name",
    "load_file",
    "neighbours",
    "sms",
    "parse_file_name",
    "provenance_problems",
    "read_text",
    "slug",
    "sm_tag",
    "the_section",
]
