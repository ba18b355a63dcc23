"""The plain-text tables the library prints (the listing, the tuner's summary; benchmarks use it too)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``header`` and ``rows`` as left-aligned columns two spaces apart, a dashed rule under the header, no
    trailing spaces."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*(str(c) for c in r)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)
