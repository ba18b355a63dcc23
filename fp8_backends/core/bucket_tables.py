"""Per-provider M-bucket config tables: which kernel config a provider runs for a problem ``(M, N, K)``.

A table maps a problem to a config name: per ``(N, K)`` where the table lists that weight shape, else
its ``default`` buckets. Each bucket is ``(max_m, name)`` with ``max_m`` inclusive and increasing; the
last bucket has ``max_m = None`` (no limit). Tables are data: a provider ships a measured one and a
user may replace it with a JSON file named by an environment variable (:class:`TableSource`).

A provider subclasses :class:`BucketTable` to state its JSON ``FORMAT`` and its known config names
(``known_names``); everything else (validation, lookup, JSON round trip, file reloading) is here.
Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from fp8_backends.core import settings
from fp8_backends.core.errors import ConfigurationError

Buckets = tuple[tuple[int | None, str], ...]


@dataclass(frozen=True)
class BucketTable:
    """M buckets -> config name, per ``(N, K)`` shape with a fallback ``default``."""

    FORMAT: ClassVar[str] = "fp8_backends.dispatch_table/1"

    default: Buckets
    shapes: Mapping[tuple[int, int], Buckets] = field(default_factory=dict)
    source: str = ""

    @classmethod
    def known_names(cls) -> Sequence[str] | None:
        """Config names a bucket may name (``None``: any identifier)."""
        return None

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", self._check_buckets(self.default, "default"))
        shapes = {(int(n), int(k)): self._check_buckets(b, f"shape {n}x{k}") for (n, k), b in self.shapes.items()}
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "_index", {})

    @classmethod
    def _check_buckets(cls, buckets: Sequence[Sequence[Any]], where: str) -> Buckets:
        known = cls.known_names()
        out: list[tuple[int | None, str]] = []
        last = 0
        for i, item in enumerate(buckets):
            if len(item) != 2:
                raise ValueError(f"{where}: bucket {i} must be [max_m, config], got {item!r}")
            max_m, name = item
            if known is not None and name not in known:
                raise ValueError(f"{where}: unknown config {name!r} (known: {', '.join(known)})")
            if max_m is None:
                if i != len(buckets) - 1:
                    raise ValueError(f"{where}: only the last bucket may have max_m = null")
            else:
                max_m = int(max_m)
                if max_m <= last:
                    raise ValueError(f"{where}: bucket bounds must increase (got {max_m} after {last})")
                last = max_m
            out.append((max_m, str(name)))
        if not out or out[-1][0] is not None:
            raise ValueError(f"{where}: the last bucket must have max_m = null (covers every larger M)")
        return tuple(out)

    def buckets_for(self, n: int, k: int) -> Buckets:
        return self.shapes.get((n, k), self.default)

    def pick(self, m: int, n: int, k: int) -> str:
        """The config name for ``M x N x K`` (``M`` may be 0). Cached per ``(N, K)``: a bisect per call."""
        index = self._index.get((n, k))  # type: ignore[attr-defined]
        if index is None:
            buckets = self.buckets_for(n, k)
            index = ([b for b, _ in buckets[:-1]], [name for _, name in buckets])
            self._index[(n, k)] = index  # type: ignore[attr-defined]
        bounds, names = index
        return names[bisect.bisect_left(bounds, m)]

    def config_names(self) -> set[str]:
        """Every config this table can pick."""
        names = {name for _, name in self.default}
        for buckets in self.shapes.values():
            names.update(name for _, name in buckets)
        return names

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.FORMAT,
            "source": self.source,
            "default": [list(b) for b in self.default],
            "shapes": {f"{n}x{k}": [list(b) for b in buckets] for (n, k), buckets in sorted(self.shapes.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BucketTable:
        fmt = data.get("format", cls.FORMAT)
        if fmt != cls.FORMAT:
            raise ValueError(f"unsupported table format {fmt!r} (expected {cls.FORMAT!r})")
        shapes: dict[tuple[int, int], Iterable[Sequence[Any]]] = {}
        for key, buckets in (data.get("shapes") or {}).items():
            n, _, k = str(key).partition("x")
            shapes[(int(n), int(k))] = buckets
        return cls(default=data["default"], shapes=shapes, source=str(data.get("source", "")))


T = TypeVar("T", bound=BucketTable)


class TableSource(Generic[T]):
    """The table a provider's ``auto`` uses: the JSON file named by ``env`` if set, else ``builtin``.

    The file is re-read when its path or modification time changes; a broken file raises
    :class:`~fp8_backends.core.errors.ConfigurationError` (a ``ValueError``) naming the variable, so the provider can
    report itself unavailable with that reason.
    """

    def __init__(self, env: str, builtin: T, what: str) -> None:
        self.env = env
        self.builtin = builtin
        self.what = what
        self._loaded: tuple[str, float, T] | None = None

    def active(self) -> T:
        if not settings.env_token(self.env):  # unset or empty: the common case, without decoding the value
            return self.builtin
        path = os.environ.get(self.env, "").strip()
        if not path:
            return self.builtin
        try:
            mtime = os.stat(path).st_mtime
        except OSError as exc:
            raise ConfigurationError(self.env, path, f"a readable {self.what} file (JSON)", str(exc)) from None
        loaded = self._loaded
        if loaded is not None and loaded[0] == path and loaded[1] == mtime:
            return loaded[2]
        try:
            with open(path, encoding="utf-8") as f:
                table = type(self.builtin).from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigurationError(self.env, path, f"a readable {self.what} file (JSON)",
                                     f"invalid {self.what}: {exc}") from None
        self._loaded = (path, mtime, table)  # type: ignore[assignment]
        return table  # type: ignore[return-value]


__all__ = ["BucketTable", "Buckets", "TableSource"]
