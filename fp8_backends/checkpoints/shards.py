"""The tensors of a checkpoint folder, read from the safetensors headers alone (torch-free, no tensor data read).

A safetensors file starts with an 8-byte little-endian header length and a JSON header ``{name: {"dtype": "F8_E4M3",
"shape": [N, K], "data_offsets": [begin, end]}, "__metadata__": {...}}``; the data follows. :func:`read_index` reads
every shard's header (the shards listed by ``model.safetensors.index.json``, else every ``*.safetensors`` file of the
folder) into a :class:`ShardIndex`: name -> :class:`TensorMeta` (dtype code, shape, file). So a checkpoint's names,
dtypes and shapes are all checked before one weight is loaded. A malformed header, a tensor listed twice or in a file
that lacks it raises :class:`~fp8_backends.core.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import CheckpointError

INDEX = "model.safetensors.index.json"
#: bytes per element of each safetensors dtype code
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
               "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8}
#: headers larger than this are refused (the format's own limit is 100 MB)
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorMeta:
    """One stored tensor: its name, safetensors dtype code (``"F8_E4M3"``, ``"BF16"``, ...), shape and file;
    ``stored``: the name in the file where :attr:`name` is the model's name for it (:mod:`.names`), else empty."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    stored: str = ""

    @property
    def key(self) -> str:
        """The tensor's name in its file."""
        return self.stored or self.name

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES.get(self.dtype, 1)
        for d in self.shape:
            n *= d
        return n


@dataclass
class ShardIndex:
    """Every tensor of a checkpoint (``tensors``: name -> meta) and its files in load order (``files``)."""

    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def by_file(self) -> dict[str, list[str]]:
        """``{file: [tensor names in it]}`` in :attr:`files` order."""
        out: dict[str, list[str]] = {f: [] for f in self.files}
        for meta in self.tensors.values():
            out.setdefault(meta.file, []).append(meta.name)
        return out

    @property
    def nbytes(self) -> int:
        return sum(meta.nbytes for meta in self.tensors.values())


def read_header(path: str | Path) -> dict[str, TensorMeta]:
    """The tensors of one safetensors file, from its header."""
    path = Path(path)
    where = str(path)
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError("not a safetensors file (shorter than its 8-byte header length)", file=where)
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER:
                raise CheckpointError(f"not a safetensors file (header length {length})", file=where)
            raw = f.read(length)
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"cannot read it: {exc}", file=where) from None
    if len(raw) != length:
        raise CheckpointError("truncated safetensors header", file=where)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"malformed safetensors header: {exc}", file=where) from None
    if not isinstance(header, dict):
        raise CheckpointError("malformed safetensors header (not a JSON object)", file=where)
    data = size - 8 - length
    out: dict[str, TensorMeta] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _meta(name, entry, where, data)
    return out


def _meta(name: str, entry: object, where: str, data: int) -> TensorMeta:
    if not isinstance(entry, dict):
        raise CheckpointError("malformed safetensors header entry", tensor=name, file=where)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"unknown safetensors dtype {dtype!r}", tensor=name, file=where)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise CheckpointError(f"malformed shape {shape!r}", tensor=name, file=where)
    meta = TensorMeta(name, dtype, tuple(shape), where)
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data or offsets[1] - offsets[0] != meta.nbytes):
        raise CheckpointError(f"data offsets {offsets!r} do not fit a {dtype} tensor of shape {list(shape)} in the "
                              f"file's {data} data bytes", tensor=name, file=where)
    return meta


def read_index(path: str | Path) -> ShardIndex:
    """The :class:`ShardIndex` of the checkpoint folder ``path``."""
    folder = Path(path)
    index_file = folder / INDEX
    index = ShardIndex()
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise CheckpointError(f"cannot read the shard index: {exc}", file=str(index_file)) from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError("the shard index has no weight_map of tensor -> file", file=str(index_file))
        files = list(dict.fromkeys(weight_map.values()))
        for name in files:
            shard = folder / name
            if not shard.is_file():
                raise CheckpointError(f"lists the shard {name}, which is missing", file=str(index_file))
            index.files.append(str(shard))
            headers = read_header(shard)
            for tensor, meta in headers.items():
                if weight_map.get(tensor, name) != name:
                    raise CheckpointError(f"stored in {name} but the index names {weight_map[tensor]}",
                                          tensor=tensor, file=str(index_file))
                index.tensors[tensor] = meta
        missing = sorted(set(weight_map) - set(index.tensors))
        if missing:
            raise CheckpointError(f"the index lists a tensor its shard {weight_map[missing[0]]} does not hold",
                                  tensor=missing[0], file=str(index_file))
        return index
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError("no *.safetensors files (other weight formats are not read)", file=str(folder))
    for shard in shards:
        index.files.append(str(shard))
        for tensor, meta in read_header(shard).items():
            if tensor in index.tensors:
                raise CheckpointError(f"stored twice (also in {index.tensors[tensor].file})", tensor=tensor,
                                      file=str(shard))
            index.tensors[tensor] = meta
    return index


__all__ = ["DTYPE_BYTES", "INDEX", "ShardIndex", "TensorMeta", "read_header", "read_index"]
