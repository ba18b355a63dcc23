"""``python -m fp8_backends.selection_data``: check, pack and evaluate shipped selection data.

    python -m fp8_backends.selection_data pack OUT/sm90.lock.json                 # -> fp8_backends/data/selection/
    python -m fp8_backends.selection_data pack OUT/sm90.lock.json --exclude-model gemma3-12b mistral-nemo-12b \\
        --out /tmp/heldout.json                                                    # data without held-out models
    python -m fp8_backends.selection_data merge fp8_backends/data/selection/sm90-nvidia-h200.json \\
        OUT/sm90-block.lock.json                                                   # add the block grid's entries
    python -m fp8_backends.selection_data check fp8_backends/data/selection/*.json
    python -m fp8_backends.selection_data loo fp8_backends/data/selection/sm90-nvidia-h200.json \\
        --group model family tp shape --compare vote baseline

- ``pack`` takes the lockfile ``python -m fp8_backends.tune --shipped-grid`` wrote (entries + provenance), keeps
  the section the provenance describes, drops what ``auto`` never reads (per-entry skip lists and timestamps),
  optionally leaves out models (entries whose every label is an excluded model: a held-out set), checks the result
  (format in :mod:`fp8_backends.registry.shipped_data`), refuses an incomplete grid unless ``--partial``, and
  writes the compact file named ``sm<SM>-<gpu>.json``.
- ``merge`` adds the entries of another ``--shipped-grid`` run (e.g. ``--shipped-grid --block``, the block-wise FP8
  grid) to a shipped file, packed and checked as ``pack`` does; ``provenance.merged`` records each merged run.
- ``check`` validates files (exit 1 when any is unusable, listing every problem).
- ``loo`` measures the model for unseen shapes (:mod:`fp8_backends.registry.nearest`) on the data itself: every
  shape unique to one model (``--group model``), one model family (``family``: llama, qwen, ...), one TP split
  (``tp``), or every distinct shape (``shape``) is predicted by a model built from the rest, and the pick's
  measured time at that shape is compared with the fastest measured there, next to two rules that ignore the
  shape: static priority (``torch_scaled_mm`` with default options) and one global choice per M bucket (the
  candidate fastest on average over the other shapes). ``--compare vote`` adds the nearest shapes' vote without
  the trend (the model before it), ``--compare baseline`` (or ``--baseline``) the first model (log N, log K only),
  each with a before/after table. No GPU needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fp8_backends.core.errors import DataFileError
from fp8_backends.registry import lockfile, nearest, shipped_data

#: per-entry fields ``auto`` never reads: left out of the shipped file
DROPPED_ENTRY_FIELDS = ("skipped", "tuned_at")


# ---------------------------------------------------------------------------------------- pack
def _section_for(doc: Mapping[str, Any], prov: Mapping[str, Any]) -> dict[str, Any]:
    """The section measured on the platform the provenance describes."""
    fields = ("gpu", "sm", "driver", "cuda", "libraries")
    matches = [sec for sec in doc["sections"].values()
               if all(sec.get("platform", {}).get(f) == prov.get(f) for f in fields)]
    if len(matches) != 1:
        raise DataFileError("<lockfile>", [f"{len(matches)} sections match the provenance's platform "
                                           f"({prov.get('gpu')}, SM {prov.get('sm')}); expected 1"])
    return matches[0]


def exclude_models(entries: Mapping[str, Mapping[str, Any]], models: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The entries without those whose every label names one of ``models`` (entries without labels stay)."""
    from fp8_backends.tuning.models import model_spec

    gone = {model_spec(m).name for m in models}
    out = {}
    for key, entry in entries.items():
        owners = {str(label).split("/", 1)[0] for label in entry.get("labels") or ()}
        if owners and owners <= gone:
            continue
        out[key] = dict(entry)
    return out


class _Recorded(NamedTuple):
    """One ranking record as :func:`fp8_backends.tuning.engine.select_winner` reads a candidate."""

    record: Mapping[str, Any]
    us: float
    rank: tuple
    ok: bool = True
    margin: float = 0.0


def _win_margin(entry: Any) -> float:
    """The provider's declared ``win_margin`` (0 when unknown here or when its class does not load)."""
    try:
        return float(getattr(entry.cls, "win_margin", 0.0) or 0.0) if entry is not None else 0.0
    except Exception:  # noqa: BLE001 - a broken plugin competes without a margin; discovery reports it elsewhere
        return 0.0


def redecide(entries: Mapping[str, Mapping[str, Any]], tie_margin: float) -> dict[str, dict[str, Any]]:
    """The entries with each choice decided again from its recorded ``ranking`` (every candidate that passed, with
    its median µs) by the tuner's own rule (:func:`fp8_backends.tuning.engine.select_winner`): among the candidates
    within ``tie_margin`` (relative) of the fastest, the one static priority ranks first (provider priority as
    ``auto`` orders the providers installed here, unknown providers last, then option values in declared order);
    a provider's ``win_margin`` counts as there.
    ``fastest``, ``runner_up``, ``tie_break`` and ``tie_margin`` follow; entries without a usable ranking stay as
    they are. No GPU: the times are the recorded ones."""
    if not (isinstance(tie_margin, (int, float)) and math.isfinite(tie_margin) and tie_margin >= 0):
        raise DataFileError("<tie margin>", [f"a tie margin is a finite number >= 0, got {tie_margin!r}"])
    from fp8_backends.registry import resolution
    from fp8_backends.registry.discovery import discover
    from fp8_backends.registry.host_aware import option_rank
    from fp8_backends.tuning.engine import select_winner

    place: dict[str, tuple[int, Any]] = {}
    for i, e in enumerate(sorted(discover("gemm"), key=resolution.rank_key)):  # the tuner's candidate order
        place.setdefault(e.name, (i, e))

    def candidate(rec: Mapping[str, Any]) -> _Recorded:
        i, e = place.get(rec.get("provider"), (len(place), None))
        return _Recorded(rec, float(rec["us"]), (i, option_rank(e.cls, rec.get("options") or {}) if e else ()),
                         margin=_win_margin(e))

    def label(rec: Mapping[str, Any]) -> str:
        options = {str(k): str(v) for k, v in (rec.get("options") or {}).items()}
        found = place.get(rec.get("provider"))
        if found is not None:
            try:  # the label auto reports: every option, defaults included
                return resolution.provider_instance(found[1], tuple(sorted(options.items()))).label
            except Exception:  # noqa: BLE001 - a provider that cannot be made here keeps the recorded options
                pass
        return f"{rec.get('provider')}[{','.join(f'{k}={v}' for k, v in sorted(options.items()))}]"

    def measured(rec: Any) -> bool:
        us = rec.get("us") if isinstance(rec, Mapping) else None
        return isinstance(us, (int, float)) and not isinstance(us, bool) and us > 0

    out = {}
    for key, entry in entries.items():
        entry = dict(entry)
        winner, fastest, runner_up = select_winner([candidate(r) for r in entry.get("ranking") or () if measured(r)],
                                                   tie_margin)
        if winner is not None:
            entry.update(choice=dict(winner.record), fastest=label(fastest.record), tie_break=winner is not fastest,
                         runner_up=None if runner_up is None else label(runner_up.record),
                         tie_margin=float(tie_margin))
        out[key] = entry
    return out


def pack(doc: Mapping[str, Any], *, exclude: Sequence[str] = (), partial: bool = False,
         command: str = "", neighbours: int | None = None, sms: int | None = None,
         tie_margin: float | None = None) -> dict[str, Any]:
    """The shipped document made from a tuner lockfile with provenance (see the module docstring); with
    ``tie_margin``, every entry's choice re-decided from its recorded ranking at that margin (:func:`redecide`)."""
    problems = shipped_data.provenance_problems(doc.get("provenance"))
    if problems:
        hint = ["tune with --shipped-grid or --provenance"] if not isinstance(doc.get("provenance"), dict) else []
        raise DataFileError("<lockfile>", problems + hint)
    prov = dict(doc["provenance"])
    section = _section_for(doc, prov)
    entries = {k: {f: v for f, v in e.items() if f not in DROPPED_ENTRY_FIELDS}
               for k, e in section["entries"].items() if e.get("kind") == "gemm"}
    expected = (prov.get("grid") or {}).get("problems")
    if not partial and isinstance(expected, int) and len(entries) < expected:
        raise DataFileError("<lockfile>", [f"the grid has {expected} problems but only {len(entries)} are measured: "
                                           "resume the tuning (or pack --partial)"])
    bad = [f"entry {key}: {why}" for key, e in entries.items() for why in lockfile.entry_problems(e)]
    bad += [why for key, e in entries.items() for why in shipped_data.ranking_problems(key, e)]
    if bad:  # before anything reads them (re-deciding, excluding by label)
        raise DataFileError("<lockfile>", bad[:20] + ([f"... and {len(bad) - 20} more"] if len(bad) > 20 else []))
    if exclude:
        entries = exclude_models(entries, exclude)
    if tie_margin is not None:
        entries = redecide(entries, tie_margin)
    from fp8_backends.tuning.provenance import now_iso

    previous = prov.get("packed")  # packing a shipped file again: keep how it was packed before
    prov["packed"] = {"date": now_iso(), "command": command, "excluded_models": list(exclude),
                      "entries": len(entries), **({} if tie_margin is None else {"tie_margin": float(tie_margin)}),
                      **({"previous": previous} if isinstance(previous, Mapping) else {})}
    model = {"neighbours": neighbours, "sms": sms}
    if any(v is not None for v in model.values()):
        prov["model"] = {**(prov.get("model") or {}), **{k: int(v) for k, v in model.items() if v is not None}}
    out = {"schema": lockfile.SCHEMA, "updated": doc.get("updated"), "provenance": prov,
           "sections": {lockfile.key_digest(section["platform"]): {"platform": section["platform"],
                                                                   "entries": entries}}}
    problems = shipped_data.check_document(out)
    if problems:
        raise DataFileError("<packed data>", problems)
    return out


def merge(shipped: Mapping[str, Any], doc: Mapping[str, Any], *, partial: bool = False, command: str = "",
          tie_margin: float | None = None) -> dict[str, Any]:
    """``shipped`` (a checked shipped document) with the entries of another tuner run added: ``doc`` is a tuner
    lockfile with provenance (e.g. ``python -m fp8_backends.tune --shipped-grid --block``), packed first as
    :func:`pack` does (complete unless ``partial``; ``tie_margin`` re-decides its choices). Both must be measured on
    the same GPU and SM; an entry of ``doc`` replaces the shipped one with the same key. The shipped section's
    platform stays; ``provenance.merged`` lists each merged run (its date, command, grid, platform and entry count),
    so the file says where every part was measured."""
    packed = pack(doc, partial=partial, command=command, tie_margin=tie_margin)
    base_prov, new_prov = dict(shipped["provenance"]), packed["provenance"]
    differs = [f"{name}: {base_prov.get(name)!r} (shipped) vs {new_prov.get(name)!r} (merged run)"
               for name in ("gpu", "sm") if base_prov.get(name) != new_prov.get(name)]
    if differs:
        raise DataFileError("<merge>", ["the runs were measured on different GPUs: " + "; ".join(differs)])
    section = dict(shipped_data.the_section(shipped))
    added = shipped_data.the_section(packed)["entries"]
    entries = dict(section["entries"])
    for key, entry in added.items():
        entries[key] = _keeping_labels(entry, entries.get(key))
    replaced = sum(1 for key in added if key in section["entries"])
    record = {name: new_prov.get(name) for name in ("date", "command", "grid", "driver", "cuda", "libraries")}
    record.update({"merged": new_prov["packed"]["date"], "merge_command": command, "entries": len(added),
                   "replaced": replaced})
    prov = {**base_prov, "merged": [*(base_prov.get("merged") or []), record]}
    section["entries"] = entries
    out = {"schema": lockfile.SCHEMA, "updated": packed.get("updated") or shipped.get("updated"), "provenance": prov,
           "sections": {next(iter(shipped["sections"])): section}}
    problems = shipped_data.check_document(out)
    if problems:
        raise DataFileError("<merged data>", problems)
    return out


def _keeping_labels(entry: Mapping[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any]:
    """``entry`` replacing ``old``, with ``old``'s model labels (``model/tpN/layer``: what held-out evaluations leave
    out by) kept first; the new run's bare shape labels (``NxK``, from ``--shapes``) only where neither has a model
    label."""
    new_labels = [str(label) for label in entry.get("labels") or ()]
    kept = [str(label) for label in (old or {}).get("labels") or () if "/" in str(label)]
    labels = list(dict.fromkeys(kept + [label for label in new_labels if "/" in label])) or new_labels
    return {**entry, "labels": labels} if labels != new_labels else dict(entry)


# ---------------------------------------------------------------------------------------- leave-one-out
def _static_rank(priorities: Mapping[str, int]) -> Callable[[nearest.CandKey], tuple]:
    def rank(ck: nearest.CandKey) -> tuple:
        return (-priorities.get(ck[0], -999), ck[2])
    return rank


def _provider_priorities() -> dict[str, int]:
    from fp8_backends.registry.discovery import discover

    return {e.name: e.priority for e in discover("gemm")}


def _global_pick(pool: Sequence[nearest.MeasuredShape], missing: float) -> nearest.CandKey | None:
    """The candidate with the best geometric-mean relative time over ``pool`` (one choice for every shape)."""
    keys = sorted({ck for s in pool for ck in s.ratios})
    if not keys:
        return None
    return min(keys, key=lambda ck: (sum(math.log(s.ratios.get(ck, missing)) for s in pool), ck))


def _geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


#: how ``loo`` holds data out: a group's shapes are predicted from the shapes of the other groups (a shape that
#: belongs to more than one group stays in every prediction's data and is not predicted)
GROUPS = ("model", "family", "tp", "shape")
#: the first model's tie margin (its predicted near-ties went to static priority within 2%, the tuner's default then)
BASELINE_TIE_MARGIN = 0.02
#: the models ``loo`` evaluates: name -> (metric, tie margin, trend); "nearest" is the one ``auto`` uses, "vote" the
#: same vote without the trend (the model before it), "baseline" the first model (log N, log K only)
MODELS: dict[str, tuple[nearest.Metric, float, nearest.Trend | None]] = {
    "nearest": (nearest.DEFAULT_METRIC, nearest.TIE_MARGIN, nearest.DEFAULT_TREND),
    "vote": (nearest.DEFAULT_METRIC, nearest.TIE_MARGIN, None),
    "baseline": (nearest.LOG_SHAPE_METRIC, BASELINE_TIE_MARGIN, None),
}
#: how the comparison tables name the models, oldest first
MODEL_TITLES = {"baseline": "baseline (log N, log K)", "vote": "vote (no trend)", "nearest": "nearest"}
COMPARED = ("baseline", "vote")


def _group_of(group: str) -> Callable[[nearest.MeasuredShape], str | None]:
    """The held-out group of a measured shape under ``group`` (None: shared by several groups)."""
    if group not in GROUPS:
        raise ValueError(f"group must be one of {', '.join(GROUPS)}")

    def of(s: nearest.MeasuredShape) -> str | None:
        if group == "shape":
            return s.shape
        parts = [str(label).split("/") for label in s.labels]
        if group == "tp":
            values = {p[1] for p in parts if len(p) > 1}
        elif group == "family":  # the model name's leading letters: llama3.2-1b -> llama
            values = {re.match(r"[a-z]*", p[0].lower()).group(0) or p[0] for p in parts}
        else:
            values = {p[0] for p in parts}
        return next(iter(values)) if len(values) == 1 else None
    return of


def leave_out_report(doc: Mapping[str, Any], group: str = "model", neighbours: int = nearest.DEFAULT_NEIGHBOURS,
                     priorities: Mapping[str, int] | None = None, baseline: bool = False,
                     compare: Sequence[str] = ()) -> dict[str, Any]:
    """Per problem class and M bucket: speed of the pick relative to the fastest (fastest µs / pick µs, 1.0 =
    the fastest) for the nearest model (and the models named in ``compare``: ``vote``, the vote without the trend;
    ``baseline`` or ``baseline=True``, the first, log N / log K model), static priority and a global per-bucket
    rule, on held-out shapes (``group``: see :data:`GROUPS`)."""
    wanted = set(compare) | ({"baseline"} if baseline else set())
    unknown = wanted - set(COMPARED)
    if unknown:
        raise ValueError(f"compare: unknown model(s) {', '.join(sorted(unknown))} (known: {', '.join(COMPARED)})")
    prov = doc.get("provenance") or {}
    entries = shipped_data.the_section(doc)["entries"]
    evaluated = {name: spec for name, spec in MODELS.items() if name == "nearest" or name in wanted}
    sms = shipped_data.sms(prov, nearest.DEFAULT_METRIC.sms)
    built = {name: nearest.build_models(entries, neighbours=neighbours, metric=dataclasses.replace(metric, sms=sms),
                                        trend=trend)
             for name, (metric, _, trend) in evaluated.items()}
    rank = _static_rank(priorities if priorities is not None else _provider_priorities())
    baseline_key = ("torch_scaled_mm", "fp8-backends", (("fast_accum", "false"),))
    group_of = _group_of(group)
    names = [*evaluated, "priority", "global"]

    out: dict[str, Any] = {"group": group, "neighbours": neighbours, "models": list(evaluated), "classes": []}
    overall: dict[str, list[float]] = {name: [] for name in names}
    per_m: dict[int, dict[str, list[float]]] = {}
    points = 0
    for cls, model in sorted(built["nearest"].items()):
        rows = {name: nearest.leave_out(built[name][cls], group_of, rank, evaluated[name][1]) for name in evaluated}
        per_bucket = []
        for bucket in model.buckets:
            speed: dict[str, list[float]] = {name: [] for name in names}
            unmeasured = 0
            mine = {name: [r for r in rows[name] if r.shape.m == bucket and r.picked is not None] for name in rows}
            for name, rs in mine.items():
                for r in rs:
                    if r.actual is None:
                        unmeasured += name == "nearest"
                    else:
                        speed[name].append(1.0 / r.actual)
            for r in mine["nearest"]:
                pool = [s for s in model.by_bucket[bucket] if group_of(s) != r.group]
                speed["priority"].append(1.0 / r.shape.ratios.get(baseline_key, model.missing_ratio))
                g = _global_pick(pool, model.missing_ratio)
                if g is not None:
                    speed["global"].append(1.0 / r.shape.ratios.get(g, model.missing_ratio))
            row: dict[str, Any] = {"m": bucket, "points": len(mine["nearest"]), "unmeasured_picks": unmeasured}
            points += len(mine["nearest"])
            acc = per_m.setdefault(bucket, {name: [] for name in names})
            for name, values in speed.items():
                row[name] = _stats(values)
                overall[name] += values
                acc[name] += values
            worst = sorted((r for r in mine["nearest"] if r.actual is not None), key=lambda r: r.actual,
                           reverse=True)[:3]
            row["worst"] = [f"{r.shape.shape} ({r.group}): {nearest.cand_label(r.picked)} {1 / r.actual:.3f}"
                            for r in worst if r.picked is not None]
            per_bucket.append(row)
        out["classes"].append({"class": dict(cls), "buckets": per_bucket})
    out["by_m"] = [{"m": m, **{name: _stats(values) for name, values in acc.items()}}
                   for m, acc in sorted(per_m.items())]
    out["overall"] = {"points": points, **{name: _stats(values) for name, values in overall.items()}}
    return out


def _stats(values: Sequence[float]) -> dict[str, Any]:
    return {"geomean": _geomean(values), "min": min(values) if values else None,
            "at_least_0.95": sum(v >= 0.95 for v in values)}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def leave_out_markdown(report: Mapping[str, Any]) -> str:
    others = [name for name in COMPARED if name in report.get("models", ())]
    lines = [f"Leave-one-{report['group']}-out, {report['neighbours']} neighbours: speed of the pick relative to the "
             "fastest measured candidate at the held-out shape (1.000 = the fastest), geomean / min", ""]
    for cls in report["classes"]:
        c = cls["class"]
        act = str(c.get("act_scale")) + (f"/{c['group_size']}" if "group_size" in c else "")
        weight = str(c.get("weight_scale")) + (f"/{c['weight_block']}" if "weight_block" in c else "")
        lines += [f"### {c.get('input_dtype')}x{c.get('weight_dtype')}->{c.get('out_dtype')} act={act} "
                  f"w={weight} bias={int(bool(c.get('has_bias')))}", "",
                  "| M | points | nearest | >= 0.95 | " + "".join(f"{MODEL_TITLES[o]} | >= 0.95 | " for o in others)
                  + "global per-M rule | static priority | worst (nearest) |",
                  "|---|---|---|---|---|---|---|" + "---|---|" * len(others)]
        for b in cls["buckets"]:
            n, g, p = b["nearest"], b["global"], b["priority"]
            old = "".join(f"{_fmt(b[o]['geomean'])} / {_fmt(b[o]['min'])} | {b[o]['at_least_0.95']} | "
                          for o in others)
            lines.append(f"| {b['m']} | {b['points']} | {_fmt(n['geomean'])} / {_fmt(n['min'])} | "
                         f"{n['at_least_0.95']} | {old}{_fmt(g['geomean'])} / {_fmt(g['min'])} | "
                         f"{_fmt(p['geomean'])} / {_fmt(p['min'])} | {'; '.join(b['worst'])} |")
        lines.append("")
    return "\n".join(lines)


def baseline_comparison(reports: Sequence[Mapping[str, Any]]) -> str:
    """Per held-out split and M bucket (every problem class together): the compared models (oldest first) against
    the current one, geomean / min / points >= 0.95 of the fastest."""
    others = [name for name in COMPARED if any(name in r["overall"] for r in reports)]
    lines = ["| held out | M | points | " + " | ".join(f"{name}: geomean / min / >= 0.95" for name in others)
             + " | nearest: geomean / min / >= 0.95 |", "|---|---|---|" + "---|" * (len(others) + 1)]

    def cell(st: Mapping[str, Any] | None) -> str:
        return "-" if st is None else f"{_fmt(st['geomean'])} / {_fmt(st['min'])} / {st['at_least_0.95']}"

    for r in reports:
        if not any(name in r["overall"] for name in others):
            continue
        for row in [*r["by_m"], {"m": "all", **r["overall"]}]:
            pts = r["overall"]["points"] if row["m"] == "all" else None
            count = pts if pts is not None else sum(
                b["points"] for c in r["classes"] for b in c["buckets"] if b["m"] == row["m"])
            lines.append(f"| {r['group']} | {row['m']} | {count} | "
                         + " | ".join(cell(row.get(name)) for name in others) + f" | {cell(row['nearest'])} |")
    return "\n".join(lines)


def leave_out_comparison(reports: Sequence[Mapping[str, Any]]) -> str:
    """One row per neighbour count: the speed relative to the fastest over every class and bucket."""
    lines = ["| neighbours | points | nearest geomean / min | >= 0.95 | global per-M rule | static priority |",
             "|---|---|---|---|---|---|"]
    for r in reports:
        n, g, p = (r["overall"][k] for k in ("nearest", "global", "priority"))
        lines.append(f"| {r['neighbours']} | {r['overall']['points']} | {_fmt(n['geomean'])} / {_fmt(n['min'])} | "
                     f"{n['at_least_0.95']} | {_fmt(g['geomean'])} / {_fmt(g['min'])} | "
                     f"{_fmt(p['geomean'])} / {_fmt(p['min'])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fp8_backends.selection_data",
                                 description="Check, pack and evaluate shipped selection data.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="make the shipped file from a --shipped-grid tuner lockfile")
    p.add_argument("lockfile")
    p.add_argument("--out", default=None, help="a .json (.json.gz) file or a folder (default: the package's "
                                               "data/selection folder)")
    p.add_argument("--exclude-model", nargs="+", default=[], metavar="NAME", help="leave these models' shapes out")
    p.add_argument("--partial", action="store_true", help="pack even if the grid is not fully measured")
    p.add_argument("--neighbours", type=int, default=None, metavar="K",
                   help=f"record how many measured shapes vote for an unmeasured one (default "
                        f"{nearest.DEFAULT_NEIGHBOURS}; compare values with loo --neighbours 1 2 4 8)")
    p.add_argument("--tie-margin", type=float, default=None, metavar="M",
                   help="decide every choice again from its recorded ranking with this near-tie margin (0: the "
                        "measured fastest; default: keep the tuner's decisions)")
    p.add_argument("--sms", type=int, default=None, metavar="N",
                   help="record the SM count of the GPU the data was measured on (the nearest model's wave feature; "
                        f"default {nearest.DEFAULT_METRIC.sms}, the H100/H200 SXM)")
    m = sub.add_parser("merge", help="add another tuner run's entries (e.g. the block grid) to a shipped file")
    m.add_argument("shipped", help="the shipped data file (rewritten in place unless --out)")
    m.add_argument("lockfile", help="a tuner lockfile with provenance (--shipped-grid [--block] or --provenance)")
    m.add_argument("--out", default=None, help="write here instead of over the shipped file: a .json (.json.gz) "
                                               "file or a folder (the shipped file's name inside it)")
    m.add_argument("--partial", action="store_true", help="merge even if that run's grid is not fully measured")
    m.add_argument("--tie-margin", type=float, default=None, metavar="M",
                   help="decide the merged run's choices again with this near-tie margin (default: the tuner's)")
    c = sub.add_parser("check", help="validate shipped data files")
    c.add_argument("files", nargs="+")
    e = sub.add_parser("loo", help="leave-one-out evaluation of the nearest-shape model on a data file")
    e.add_argument("file")
    e.add_argument("--group", choices=GROUPS, nargs="+", default=["model"],
                   help="hold out by model, model family, TP split or distinct shape (several: one report each)")
    e.add_argument("--baseline", action="store_true",
                   help="also evaluate the first model (log N, log K only; 2%% tie margin) and compare")
    e.add_argument("--compare", nargs="+", choices=COMPARED, default=[], metavar="MODEL",
                   help="also evaluate and compare: vote (the nearest shapes' vote without the trend), baseline")
    e.add_argument("--neighbours", type=int, nargs="+", default=None, metavar="K",
                   help="neighbour counts to evaluate (default: the data's own, else "
                        f"{nearest.DEFAULT_NEIGHBOURS})")
    e.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "pack":
            return _pack_cli(args, argv)
        if args.command == "merge":
            return _merge_cli(args, argv)
        if args.command == "check":
            return _check_cli(args.files)
        doc = shipped_data.load_file(args.file)
        ks = args.neighbours or [shipped_data.neighbours(doc["provenance"], nearest.DEFAULT_NEIGHBOURS)]
        reports = [leave_out_report(doc, g, k, baseline=args.baseline, compare=args.compare)
                   for g in args.group for k in ks]
        for report in reports:
            print(leave_out_markdown(report))
        if len(ks) > 1:
            print(leave_out_comparison(reports))
        if args.baseline or args.compare:
            print(baseline_comparison(reports))
        if args.json:
            Path(args.json).write_text(json.dumps(reports if len(reports) > 1 else reports[0], indent=1) + "\n",
                                       encoding="utf-8")
        return 0
    except (ValueError, OSError) as exc:  # DataFileError (a ValueError) names its file; a bad value; an unwritable path
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _read_lockfile(path: str) -> tuple[Path, dict[str, Any]]:
    """``(path, document)`` of the lockfile at ``path``; :class:`DataFileError` when it cannot be read."""
    src = Path(path)
    doc, problem = lockfile.read_document(src)
    if doc is None:
        raise DataFileError(src, [problem or "unreadable"])
    bad = [f"entry {name}: not an object" for section in doc["sections"].values() if isinstance(section, dict)
           for name, entry in (section.get("entries") or {}).items() if not isinstance(entry, dict)]
    prov = doc.get("provenance")
    if isinstance(prov, dict) and prov.get("grid") is not None and not isinstance(prov["grid"], dict):
        bad.append("provenance.grid is not an object")
    if bad:
        raise DataFileError(src, bad)
    return src, doc


def _naming(src: Path, exc: DataFileError) -> DataFileError:
    """``exc`` naming the file ``src`` where it named a placeholder (``<lockfile>``: :func:`pack` and :func:`merge`
    see documents, not files)."""
    return DataFileError(src, exc.problems) if exc.path.startswith("<") else exc


def _write_compact(out: Path, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` in the shipped data's compact form to ``out`` (gzip-compressed, reproducibly, when the name ends in
    ``.gz``), creating its folder. The file is replaced atomically: a write that fails (a full disk, an interrupt)
    leaves the previous file whole."""
    data = shipped_data.dumps_compact(doc).encode("utf-8")
    if out.name.endswith(".gz"):
        import gzip

        data = gzip.compress(data, mtime=0)
    lockfile.atomic_write_bytes(out, data)


def _out_path(out: Path, name: str) -> Path:
    """Where ``--out`` writes: ``out`` itself when it names a data file (``.json`` / ``.json.gz``, any case) that is
    not a folder, else the file ``name`` inside the folder ``out`` (made when missing)."""
    is_file_name = out.name.lower().endswith((".json", ".json.gz"))
    return out if is_file_name and not out.is_dir() else out / name


def _pack_cli(args: argparse.Namespace, argv: list[str]) -> int:
    src, doc = _read_lockfile(args.lockfile)
    try:
        packed = pack(doc, exclude=args.exclude_model, partial=args.partial, neighbours=args.neighbours,
                      sms=args.sms, tie_margin=args.tie_margin,
                      command=" ".join(["python -m fp8_backends.selection_data", *argv]))
    except DataFileError as exc:
        raise _naming(src, exc) from None
    prov = packed["provenance"]
    name = shipped_data.file_name(prov["sm"], prov["gpu"])
    if args.out is None:
        from fp8_backends.registry.shipped import packaged_dir

        out = packaged_dir() / name
    else:
        out = _out_path(Path(args.out), name)
    _write_compact(out, packed)
    entries = len(shipped_data.the_section(packed)["entries"])
    print(f"{out}: {entries} entries, {prov['gpu']} SM {prov['sm']}, measured {prov['date']}"
          + (f", without {', '.join(args.exclude_model)}" if args.exclude_model else ""))
    return 0


def _merge_cli(args: argparse.Namespace, argv: list[str]) -> int:
    shipped = shipped_data.load_file(args.shipped)
    src, doc = _read_lockfile(args.lockfile)
    try:
        merged = merge(shipped, doc, partial=args.partial, tie_margin=args.tie_margin,
                       command=" ".join(["python -m fp8_backends.selection_data", *argv]))
    except DataFileError as exc:
        raise _naming(src, exc) from None
    out = Path(args.shipped) if args.out is None else _out_path(Path(args.out), Path(args.shipped).name)
    _write_compact(out, merged)
    record = merged["provenance"]["merged"][-1]
    print(f"{out}: {len(shipped_data.the_section(merged)['entries'])} entries ({record['entries']} from {src}, "
          f"{record['replaced']} of them replacing earlier ones)")
    return 0


def _check_cli(files: Sequence[str]) -> int:
    bad = 0
    for name in files:
        try:
            doc = shipped_data.load_file(name)
        except DataFileError as exc:
            bad += 1
            print(f"{name}: UNUSABLE")
            for problem in exc.problems:
                print(f"  - {problem}")
            continue
        prov, entries = doc["provenance"], shipped_data.the_section(doc)["entries"]
        classes = {nearest.class_key(e["problem"]) for e in entries.values()}
        buckets = sorted({e["m"] for e in entries.values()})
        print(f"{name}: ok: {len(entries)} entries, {len(classes)} problem class(es), M buckets {buckets}; "
              f"{prov['gpu']} SM {prov['sm']}, driver {prov['driver']}, CUDA {prov['cuda']}, {prov['date']}; "
              f"command: {prov['command']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
