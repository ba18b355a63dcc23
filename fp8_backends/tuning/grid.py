"""The GEMM shapes a tuning run covers: model tables x tensor-parallel splits, shapes files, and the shipped grid.

- :func:`model_shapes`: the linear weights of models (:mod:`fp8_backends.tuning.models`) at several tensor-parallel
  degrees, deduplicated across models (Mistral-7B and Llama-3-8B share every shape), each shape labelled
  ``"model/tpN/layer"`` with every place it comes from. A degree that does not divide a model's heads or
  intermediate size is skipped, and so is a weight whose N or K is not a multiple of ``align`` (16 by default: the
  alignment every provider but ``triton`` needs on the GPU, so only such shapes have several candidates to compare).
- :func:`read_shapes_file`: the same from a JSON or CSV file (N, K, optional bias and model / TP / layer
  labels), so an engine can tune its own model in one command.
- The *shipped grid* (:data:`SHIPPED_MODELS` x :data:`SHIPPED_TPS` x :data:`SHIPPED_M_BUCKETS`, per-tensor scales,
  providers' kernel-config tables pinned to ``auto``) is what ``python -m fp8_backends.tune --shipped-grid``
  measures for the per-GPU selection data that ships with the package (:mod:`fp8_backends.registry.shipped`).

Sizing the shipped grid (:func:`estimate_seconds`): the H200 tuned 60 problems with 15 candidates each in 46.0 s
(``bench/results/tune/2026-11-29-h200/tune.txt``), 51 ms per candidate run all included (inputs, reference check,
graph capture, 5 rounds x 3 replays, first-use kernel loads). Every one of the 7 M buckets doubles as a point the
held-out check benches; powers of 4 sample decode (1: the GEMV kernels; 2-4; 5-16), the memory-to-compute
transition (17-64, 65-256) and prefill (257-1024, 1025-4096; larger M uses the 4096 choice).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8_backends.core.errors import DataFileError

#: the models whose shapes the shipped selection data covers (names of :data:`fp8_backends.tuning.models.MODELS`)
SHIPPED_MODELS: tuple[str, ...] = (
    "llama3.2-1b", "llama3.2-3b", "llama3-8b", "llama3-70b",
    "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2-72b",
    "mistral-7b", "mistral-nemo-12b", "mistral-small-24b",
    "gemma2-2b", "gemma2-9b", "gemma2-27b", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b",
    "phi3-mini", "phi3-medium", "phi4", "phi4-mini",
)
SHIPPED_TPS: tuple[int, ...] = (1, 2, 4, 8)
SHIPPED_M_BUCKETS: tuple[int, ...] = (1, 4, 16, 64, 256, 1024, 4096)
#: (activation scale, weight scale) pairs of the shipped grid: per-tensor FP8 checkpoints
SHIPPED_SCALES: tuple[tuple[str, str], ...] = (("per_tensor_dynamic", "per_tensor"),)
#: options held fixed while tuning the shipped grid: the providers' own per-M kernel-config tables (``auto``)
#: compete instead of each of their 11-12 configs, which keeps the grid at ~6 candidates per problem
SHIPPED_PINS: dict[str, dict[str, str]] = {"cutlass": {"config": "auto"}, "triton": {"config": "auto"}}
#: the models of the block-wise FP8 shipped grid (``--shipped-grid --block``): those that ship 128x128 block
#: checkpoints (DeepSeek-V3/R1, Qwen3-*-FP8)
BLOCK_MODELS: tuple[str, ...] = (
    "deepseek-v3", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
)
#: (model, TP) pairs of the block grid tuned first (their shapes lead the plan, so that a run stopped by
#: ``--limit-seconds`` has covered them; the next run resumes with the rest)
BLOCK_FIRST: tuple[tuple[str, int], ...] = (
    ("deepseek-v3", 1), ("deepseek-v3", 8), ("qwen3-8b", 1), ("qwen3-8b", 2), ("qwen3-32b", 1), ("qwen3-32b", 2),
)
#: (activation scale, weight scale) of the block grid: 1x128 activation groups x 128x128 weight blocks
BLOCK_SCALES: tuple[tuple[str, str], ...] = (("per_token_group", "block"),)
#: the weight block of the block grid's checkpoints (a TP split whose shards would cut blocks is left out)
BLOCK_WEIGHT = (128, 128)
ALIGNMENT = 16
#: seconds per candidate run measured on the H200 (46.0 s / 900 runs, see the module docstring)
H200_SECONDS_PER_CANDIDATE = 46.0 / 900


@dataclass(frozen=True)
class ShapeSpec:
    """One GEMM weight ``[n, k]`` (with or without bias) and where it comes from (``"llama3-8b/tp2/o_proj"``)."""

    n: int
    k: int
    bias: bool = False
    labels: tuple[str, ...] = field(default=(), compare=False)

    @property
    def key(self) -> tuple[int, int, bool]:
        return self.n, self.k, self.bias

    @property
    def models(self) -> set[str]:
        """The model names among the labels (the part before the first ``/``)."""
        return {label.split("/", 1)[0] for label in self.labels if label}


def merge_shapes(specs: Iterable[ShapeSpec]) -> list[ShapeSpec]:
    """One spec per (n, k, bias), labels united (first-seen order), in first-seen order."""
    order: dict[tuple[int, int, bool], list[str]] = {}
    for s in specs:
        labels = order.setdefault(s.key, [])
        labels.extend(label for label in s.labels if label not in labels)
    return [ShapeSpec(n, k, bias, tuple(labels)) for (n, k, bias), labels in order.items()]


def model_shapes(
    models: Sequence[str], tps: Sequence[int] = (1,), *, exclude: Iterable[str] = (), align: int = ALIGNMENT,
    block: tuple[int, int] | None = None, first: Sequence[tuple[str, int]] = (),
) -> tuple[list[ShapeSpec], list[str]]:
    """``(shapes, skipped)``: the deduplicated weights of ``models`` at every degree in ``tps`` (models in
    ``exclude`` left out, names or aliases), and one line per (model, TP) or weight that was skipped and why.

    ``block``: the ``(BN, BK)`` weight block of block-wise FP8 checkpoints; a weight whose shard or fused parts would
    cut blocks is skipped (:func:`~fp8_backends.tuning.models.block_misfit`). ``first``: (model, TP) pairs whose
    shapes come first (those of ``models`` x ``tps``), in that order."""
    from fp8_backends.tuning.models import block_misfit, linear_shapes, model_spec

    excluded = {model_spec(name).name for name in exclude}
    specs: list[ShapeSpec] = []
    skipped: list[str] = []
    wanted = [(model_spec(name), tp) for name in models for tp in tps]
    lead = [(model_spec(name), tp) for name, tp in first]
    pairs = [pair for pair in lead if pair in wanted] + [pair for pair in wanted if pair not in lead]
    for spec, tp in pairs:
        if spec.name in excluded:
            continue
        try:
            layers = linear_shapes(spec, tp)
        except ValueError as exc:
            skipped.append(f"{spec.name} tp={tp}: {exc}")
            continue
        for layer in layers:
            label = f"{spec.name}/tp{tp}/{layer.name}"
            if layer.n % align or layer.k % align:
                skipped.append(f"{label}: {layer.n}x{layer.k} is not a multiple of {align}")
                continue
            misfit = None if block is None else block_misfit(layer, block)
            if misfit:
                skipped.append(f"{label}: {layer.n}x{layer.k}: {misfit} (a block-wise checkpoint's blocks would "
                               "straddle tensor-parallel ranks or fused weights)")
                continue
            specs.append(ShapeSpec(layer.n, layer.k, layer.bias, (label,)))
    return merge_shapes(specs), skipped


# ---------------------------------------------------------------------------------------- shapes files
_TRUE = {"1", "true", "yes", "y", "t"}
_FALSE = {"0", "false", "no", "n", "f", ""}


def _int(value: Any, what: str, problems: list[str]) -> int | None:
    if isinstance(value, bool):
        problems.append(f"{what}: {value!r} is not an integer")
        return None
    try:
        number = int(str(value).strip()) if not isinstance(value, int) else value
    except ValueError:
        problems.append(f"{what}: {value!r} is not an integer")
        return None
    if number < 1:
        problems.append(f"{what}: {number} must be >= 1")
        return None
    return number


def _bool(value: Any, what: str, problems: list[str]) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text not in _FALSE:
        problems.append(f"{what}: {value!r} is not a boolean")
    return False


def _spec_from_record(record: Mapping[str, Any], where: str, problems: list[str]) -> ShapeSpec | None:
    fields = {str(k).strip().lower(): v for k, v in record.items()}
    unknown = sorted(set(fields) - {"n", "k", "bias", "model", "tp", "layer", "label"})
    if unknown:
        problems.append(f"{where}: unknown field(s) {', '.join(unknown)} (known: n, k, bias, model, tp, layer, label)")
    missing = [f for f in ("n", "k") if fields.get(f) in (None, "")]
    if missing:
        problems.append(f"{where}: missing {' and '.join(missing)}")
        return None
    n, k = _int(fields["n"], f"{where} n", problems), _int(fields["k"], f"{where} k", problems)
    bias = _bool(fields.get("bias", False), f"{where} bias", problems)
    if n is None or k is None:
        return None
    label = str(fields.get("label") or "").strip()
    if not label and fields.get("model") not in (None, ""):
        tp = fields.get("tp")
        parts = [str(fields["model"]).strip()]
        if tp not in (None, ""):
            tp_value = _int(tp, f"{where} tp", problems)
            parts.append(f"tp{tp_value}")
        if fields.get("layer") not in (None, ""):
            parts.append(str(fields["layer"]).strip())
        label = "/".join(parts)
    return ShapeSpec(n, k, bias, (label,) if label else ())


def parse_shapes(text: str, name: str = "<shapes>") -> list[ShapeSpec]:
    """Shapes from the text of a JSON or CSV shapes file (see :func:`read_shapes_file`)."""
    problems: list[str] = []
    specs: list[ShapeSpec] = []
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise DataFileError(name, [f"not valid JSON ({exc})"]) from None
        rows = doc.get("shapes") if isinstance(doc, dict) else doc
        if not isinstance(rows, list):
            raise DataFileError(name, ["expected a list of shapes or an object with a 'shapes' list"])
        for i, row in enumerate(rows):
            where = f"shape #{i + 1}"
            if isinstance(row, (list, tuple)) and len(row) in (2, 3):
                row = dict(zip(("n", "k", "bias"), row))
            if not isinstance(row, dict):
                problems.append(f"{where}: expected an object with n and k, or [n, k], got {row!r}")
                continue
            spec = _spec_from_record(row, where, problems)
            if spec is not None:
                specs.append(spec)
    else:
        numbered = [(no, line) for no, line in enumerate(text.splitlines(), 1)
                    if line.strip() and not line.lstrip().startswith("#")]
        reader = csv.DictReader(io.StringIO("\n".join(line for _, line in numbered)), skipinitialspace=True)
        header = [h.strip().lower() for h in reader.fieldnames or []]
        if "n" not in header or "k" not in header:
            raise DataFileError(name, [f"a CSV shapes file needs a header row with n and k columns, got {header}"])
        for row in reader:
            where = f"line {numbered[reader.line_num - 1][0]}"  # the file's own line (comments and blanks count)
            if None in row:
                problems.append(f"{where}: more values than header columns")
                continue
            spec = _spec_from_record(row, where, problems)
            if spec is not None:
                specs.append(spec)
    if problems:
        raise DataFileError(name, problems)
    if not specs:
        raise DataFileError(name, ["no shapes"])
    return merge_shapes(specs)


def read_shapes_file(path: str | Path) -> list[ShapeSpec]:
    """Shapes from a file, deduplicated (labels united). Raises :class:`DataFileError` naming every bad row.

    JSON: ``[{"n": 6144, "k": 4096, "bias": false, "model": "my-model", "tp": 2, "layer": "qkv_proj"}, ...]``
    (``[[6144, 4096], ...]`` and ``{"shapes": [...]}`` work too). CSV: a header row with ``n,k`` and any of
    ``bias,model,tp,layer,label``; ``#`` starts a comment line.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataFileError(p, [f"cannot read it ({exc})"]) from None
    return parse_shapes(text, str(p))


def estimate_seconds(problems: int, candidates_per_problem: float,
                     seconds_per_candidate: float = H200_SECONDS_PER_CANDIDATE) -> float:
    """Tuning time of ``problems`` (shape x M bucket) at the H200's measured rate per candidate run."""
    return problems * candidates_per_problem * seconds_per_candidate


__all__ = [
    "ALIGNMENT",
    "BLOCK_FIRST",
    "BLOCK_MODELS",
    "BLOCK_SCALES",
    "BLOCK_WEIGHT",
    "SHIPPED_M_BUCKETS",
    "SHIPPED_MODELS",
    "SHIPPED_PINS",
    "SHIPPED_SCALES",
    "SHIPPED_TPS",
    "ShapeSpec",
    "estimate_seconds",
    "merge_shapes",
    "model_shapes",
    "parse_shapes",
    "read_shapes_file",
]
