"""Shared by this stop's two replay scripts: the shipped data's entries and an auto_eval run's rows, matched by key."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def load(data_path: str, eval_path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(shipped entries by key, auto_eval rows)``."""
    doc = json.loads(Path(data_path).read_text())
    entries = next(iter(doc["sections"].values()))["entries"]
    rows = json.loads(Path(eval_path).read_text())["rows"]
    return entries, rows


def entry_key(row: Mapping[str, Any]) -> str:
    """The entry key of a bias-free per-tensor bf16-out point (the q/k/v rows with biases have other keys)."""
    return (f"gemm/n={row['n']}/k={row['k']}/e4m3fn.e4m3fn->bfloat16/act=per_tensor/w=per_tensor/bias=0"
            f"/m={row['m']}")


def parse_label(label: str) -> tuple[str, dict[str, str]]:
    """``"cutlass[config=auto,fast_accum=true]"`` -> ``("cutlass", {"config": "auto", "fast_accum": "true"})``."""
    provider, _, rest = label.partition("[")
    options = dict(kv.split("=", 1) for kv in rest.rstrip("]").split(",")) if rest else {}
    return provider, options


def matches(label: str, record: Mapping[str, Any]) -> bool:
    """Whether an auto_eval candidate label names the recorded candidate (its options a subset of the label's)."""
    provider, options = parse_label(label)
    return provider == record["provider"] and all(options.get(k) == v for k, v in record["options"].items())


def exact_points(entries: Mapping[str, Any], rows: list[dict[str, Any]]) -> Iterator[tuple[dict, dict]]:
    """``(row, entry)`` for every shipped-exact row whose entry the data holds."""
    for row in rows:
        entry = entries.get(entry_key(row))
        if row["source"] == "shipped-exact" and entry is not None:
            yield row, entry
