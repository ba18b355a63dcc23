"""What one ``python -m fp8_backends.tune`` run covers: problem templates with their labels, M buckets, option
pins, the shard of the work this process takes, and which problems the output already holds (resuming).

Kept apart from :mod:`.engine` (which measures) so that the grid logic is testable without timing
anything. Every function here is pure Python (no torch).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_backends.core.types import GemmProblem, NormQuantProblem
from fp8_backends.registry import lockfile
from fp8_backends.registry.platform import Platform
from fp8_backends.tuning import grid

#: the M buckets of ``--quick`` (the tuner and the benchmarks)
QUICK_M_BUCKETS = (1, 16, 256, 4096)


#: the M list syntax, for error messages
M_LIST_SYNTAX = ("comma-separated positive integers and LO-HI ranges (which stand for their powers of two), "
                 "e.g. 1,16,256 or 1-16384 or 1-8,100")


def _m_value(text: str, part: str) -> int:
    """One M of an M list (``part`` is the item it comes from, for the message)."""
    try:
        v = int(text.strip())
    except ValueError:
        raise ValueError(f"bad M {part!r}: M buckets are {M_LIST_SYNTAX}") from None
    if v < 1:
        raise ValueError(f"bad M {part!r}: M buckets are {M_LIST_SYNTAX}")
    return v


def _m_range(part: str) -> list[int]:
    """Every power of two in ``"LO-HI"``."""
    lo_text, _, hi_text = part.partition("-")
    lo, hi = _m_value(lo_text, part), _m_value(hi_text, part)
    powers = [1 << e for e in range(hi.bit_length()) if lo <= 1 << e <= hi]
    if not powers:
        raise ValueError(f"bad M range {part!r}: it holds no power of two; M buckets are {M_LIST_SYNTAX}")
    return powers


def parse_m_list(text: str) -> list[int]:
    """``"1,16,256"``, or ``"1-16384"`` (every power of two in the range), or a mix: ``"1-8,100"``. Anything else
    (a negative or fractional M, an empty list) raises ValueError naming the syntax."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        out.update(_m_range(part) if "-" in part else [_m_value(part, part)])
    if not out:
        raise ValueError(f"no M values in {text!r}: M buckets are {M_LIST_SYNTAX}")
    return sorted(out)


@dataclass
class TunePlan:
    """The problems of a run (M unset), where each shape comes from, and how the grid is set up."""

    kind: str
    problems: list[Any]
    buckets: list[int]
    labels: dict[str, list[str]] = field(default_factory=dict)  # problem key -> "model/tpN/layer" labels
    pins: dict[str, dict[str, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # shapes left out and why
    grid: dict[str, Any] = field(default_factory=dict)  # what provenance records

    @property
    def total(self) -> int:
        return len(self.problems) * len(self.buckets)

    def keys(self) -> list[str]:
        """Every entry key the plan covers (problem x bucket)."""
        out = []
        for p in self.problems:
            fields = lockfile.problem_fields(self.kind, p)
            out += [lockfile.entry_key(self.kind, fields, m) for m in self.buckets]
        return out


# ---------------------------------------------------------------------------------------- argument parsing
def parse_pin(text: str) -> tuple[str, str, str]:
    """``"cutlass:config=auto"`` -> ``("cutlass", "config", "auto")``."""
    provider, colon, rest = text.partition(":")
    key, eq, value = rest.partition("=")
    if not colon or not eq or not provider.strip() or not key.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"a pin is PROVIDER:OPTION=VALUE (e.g. cutlass:config=auto), got {text!r}")
    return provider.strip(), key.strip(), value.strip()


def parse_scales(text: str) -> tuple[str, str]:
    """``"per_token:per_channel"`` -> ``("per_token", "per_channel")`` (activation, weight)."""
    from fp8_backends.core.types import ActScale, WeightScale

    act, colon, weight = text.partition(":")
    acts, weights = {a.value for a in ActScale}, {w.value for w in WeightScale}
    if not colon or act not in acts or weight not in weights:
        raise argparse.ArgumentTypeError(
            f"scales are ACT:WEIGHT with ACT in {sorted(acts)} and WEIGHT in {sorted(weights)}, got {text!r}")
    return act, weight


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> ``(2, 4)`` (1-based shard index, shard count)."""
    try:
        index, count = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shard is I/N (e.g. 1/2), got {text!r}") from None
    if not 1 <= index <= count:
        raise argparse.ArgumentTypeError(f"shard {text!r}: need 1 <= I <= N")
    return index, count


def pins_from(items: Iterable[tuple[str, str, str]], base: Mapping[str, Mapping[str, str]] | None = None,
              ) -> dict[str, dict[str, str]]:
    out = {p: dict(o) for p, o in (base or {}).items()}
    for provider, key, value in items:
        out.setdefault(provider, {})[key] = value
    return out


# ---------------------------------------------------------------------------------------- the plan
def gemm_problems(shapes: Sequence[grid.ShapeSpec], scales: Sequence[tuple[str, str]], *, input_dtype: str,
                  weight_dtype: str, out_dtype: str, device: str, group_size: int = 128,
                  ) -> tuple[list[GemmProblem], dict[str, list[str]]]:
    """One problem per shape and (activation, weight) scale pair, and the labels per problem key. ``group_size``:
    the activation group of ``per_token_group`` problems (their weight block is 128x128)."""
    problems, labels = [], {}
    for s in shapes:
        for act, weight in scales:
            p = GemmProblem(n=s.n, k=s.k, input_dtype=input_dtype, weight_dtype=weight_dtype, out_dtype=out_dtype,
                            act_scale=act, weight_scale=weight, has_bias=s.bias, device=device,
                            **({"group_size": group_size} if act == "per_token_group" else {}))
            pk = lockfile.problem_key("gemm", lockfile.problem_fields("gemm", p))
            if pk not in labels:
                problems.append(p)
                labels[pk] = list(s.labels)
    return problems, labels


def plan_from_args(args: argparse.Namespace, device: str) -> TunePlan:
    """The plan the tuner's arguments describe (see ``python -m fp8_backends.tune --help``)."""
    from fp8_backends.tuning.models import hidden_size

    shipped = bool(getattr(args, "shipped_grid", False))
    block = bool(getattr(args, "block", False))
    explicit = args.shapes or args.shapes_file or args.hidden
    shipped_models = grid.BLOCK_MODELS if block else grid.SHIPPED_MODELS
    models = list(args.model) or (list(shipped_models) if shipped else [] if explicit else ["llama3-8b"])
    tps = list(args.tp) if args.tp else (list(grid.SHIPPED_TPS) if shipped else [1])
    if args.m is not None:
        try:
            buckets = parse_m_list(args.m)
        except ValueError as exc:
            raise ValueError(f"--m {args.m!r}: {exc}") from None
    elif shipped:
        buckets = list(grid.SHIPPED_M_BUCKETS)
    else:
        buckets = list(QUICK_M_BUCKETS if args.quick else lockfile.DEFAULT_M_BUCKETS)
    base_pins = grid.SHIPPED_PINS if shipped and not args.no_pins else {}
    pins = pins_from(args.pin or [], base_pins)
    if args.kind == "norm_quant":
        hiddens = list(dict.fromkeys([*args.hidden, *(hidden_size(m) for m in models)]))
        if not hiddens:
            raise ValueError("--kind norm_quant needs --hidden H (or --model): --shapes and --shapes-file are GEMM "
                             "weight shapes")
        residuals = {"both": [False, True], "yes": [True], "no": [False]}[args.residual]
        problems = [NormQuantProblem(hidden=h, in_dtype=args.in_dtype, residual=r, device=device)
                    for h in hiddens for r in residuals]
        return TunePlan("norm_quant", problems, buckets, pins=pins, grid={"hidden": hiddens, "m_buckets": buckets})
    shapes, notes = grid.model_shapes(models, tps, exclude=args.exclude_model or (),
                                      block=grid.BLOCK_WEIGHT if block else None,
                                      first=grid.BLOCK_FIRST if block and shipped else ())
    if models and not shapes:
        raise ValueError("no shapes: " + "; ".join(notes) if notes else "no shapes for the given models")
    shapes += [grid.ShapeSpec(n, k, args.bias, (f"{n}x{k}",)) for n, k in args.shapes]
    for path in args.shapes_file or ():
        shapes += grid.read_shapes_file(path)
    if args.exclude_model:
        from fp8_backends.tuning.models import model_spec

        gone = {model_spec(m).name for m in args.exclude_model}
        shapes = [s for s in shapes if not s.labels or not s.models <= gone]
    shapes = grid.merge_shapes(shapes)
    if args.hidden and not (models or args.shapes or args.shapes_file):
        raise ValueError("--hidden is for --kind norm_quant; GEMM problems need --shapes, --shapes-file or --model")
    if block and (args.scales or args.act_scale or args.weight_scale):
        raise ValueError("--block sets the scales (per_token_group x block); leave out --scales, --act-scale and "
                         "--weight-scale")
    if block:
        scales = list(grid.BLOCK_SCALES)
    elif args.scales:
        scales = list(dict.fromkeys(args.scales))
    elif shipped and args.act_scale is None and args.weight_scale is None:
        scales = list(grid.SHIPPED_SCALES)
    else:
        scales = [(a, w) for a in (args.act_scale or ["per_tensor_dynamic"])
                  for w in (args.weight_scale or ["per_tensor"])]
    group_size = int(getattr(args, "group_size", 128) or 128)
    problems, labels = gemm_problems(shapes, scales, input_dtype=args.input_dtype,
                                     weight_dtype=args.weight_dtype or args.input_dtype, out_dtype=args.out_dtype,
                                     device=device, group_size=group_size)
    info = {"models": models, "tp": tps, "excluded_models": list(args.exclude_model or []),
            "shapes_files": [str(p) for p in args.shapes_file or ()], "extra_shapes": [list(s) for s in args.shapes],
            "m_buckets": buckets, "scales": [list(s) for s in scales], "pins": pins,
            "dtypes": [args.input_dtype, args.weight_dtype or args.input_dtype, args.out_dtype],
            "shapes": len(shapes), "problems": len(problems) * len(buckets)}
    if any(act == "per_token_group" for act, _ in scales):
        info["group_size"] = group_size
        info["weight_block"] = list(grid.BLOCK_WEIGHT)
    return TunePlan("gemm", problems, buckets, labels, pins, notes, info)


def select_shard(plan: TunePlan, index: int, count: int) -> TunePlan:
    """The shapes of shard ``index`` of ``count`` (round robin over the plan's problems, so shards get similar
    mixes of sizes); the same arguments always give the same split."""
    if count == 1:
        return plan
    mine = [p for i, p in enumerate(plan.problems) if i % count == index - 1]
    return TunePlan(plan.kind, mine, plan.buckets, plan.labels, plan.pins, plan.notes, plan.grid)


def done_keys(path: Path | None, platform: Platform) -> set[str]:
    """Entry keys the lockfile at ``path`` already holds, usable, for ``platform`` (empty when there is no usable file):
    an entry readers skip as malformed is measured again."""
    if path is None:
        return set()
    doc, _ = lockfile.read_document(path)
    if doc is None:
        return set()
    _, digest = lockfile.current_key(platform)
    section = doc["sections"].get(digest)
    entries = section.get("entries") if isinstance(section, dict) else None
    if not isinstance(entries, dict):
        return set()
    return {key for key, entry in entries.items() if not lockfile.entry_problems(entry)}


__all__ = ["TunePlan", "done_keys", "gemm_problems", "parse_pin", "parse_scales", "parse_shard", "pins_from",
           "plan_from_args", "select_shard"]
