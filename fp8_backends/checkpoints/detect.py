"""Which FP8 format a checkpoint is in: :func:`detect_format` (torch-free).

Reads ``config.json`` (its ``quantization_config``) and, where present, ModelOpt's ``hf_quant_config.json``, and
returns the parsed :class:`~fp8_backends.checkpoints.formats.QuantFormat`:

- ``quant_method: "modelopt"`` or an ``hf_quant_config.json``: :class:`.format_modelopt.ModelOptFormat`
  (``hf_quant_config.json`` wins where both exist; their ``quant_algo`` must agree);
- ``quant_method: "compressed-tensors"``: :class:`.format_compressed_tensors.CompressedTensorsFormat`;
- ``quant_method: "fp8"``: :class:`.format_hf_fp8.HfFp8Format`.

No quantization config, another method (GPTQ, AWQ, bitsandbytes, ...), or a malformed file raises
:class:`~fp8_backends.core.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .format_compressed_tensors import CompressedTensorsFormat
from .format_hf_fp8 import HfFp8Format
from .format_modelopt import ModelOptFormat
from .formats import QuantFormat, fail, require_mapping

CONFIG = "config.json"
HF_QUANT_CONFIG = "hf_quant_config.json"
#: the ``quant_method`` values served
METHODS = ("modelopt", "compressed-tensors", "fp8")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path`` (CheckpointError naming the file if it is unreadable or not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise fail(f"cannot read it as JSON: {exc}", str(path)) from None
    if not isinstance(data, dict):
        raise fail(f"must hold a JSON object, got {type(data).__name__}", str(path))
    return data


def read_configs(path: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``(config.json, hf_quant_config.json or None)`` of the checkpoint folder ``path``."""
    folder = Path(path)
    if not folder.is_dir():
        raise fail("not a checkpoint folder (no such directory)", str(folder))
    if not (folder / CONFIG).is_file():
        raise fail(f"no {CONFIG}: not a Hugging Face checkpoint folder", str(folder))
    config = read_json(folder / CONFIG)
    quant = folder / HF_QUANT_CONFIG
    return config, read_json(quant) if quant.is_file() else None


def detect_format(config: Mapping[str, Any], hf_quant_config: Mapping[str, Any] | None = None, *,
                  source: str = CONFIG, quant_source: str = HF_QUANT_CONFIG) -> QuantFormat:
    """The FP8 format of a checkpoint from its ``config.json`` (a dict; a bare ``quantization_config`` dict is
    accepted too) and ModelOpt's ``hf_quant_config.json`` if it has one. ``source`` / ``quant_source``: the files'
    names for messages."""
    config = require_mapping(config, "the config", source)
    qc = config.get("quantization_config")
    if qc is None and "quant_method" in config:
        qc = config  # a quantization_config given alone
    if qc is not None:
        qc = require_mapping(qc, "quantization_config", source)
    method = None if qc is None else qc.get("quant_method")
    if hf_quant_config is not None:
        quant = require_mapping(hf_quant_config, "the ModelOpt config", quant_source)
        section = require_mapping(quant.get("quantization"), "its quantization section", quant_source)
        fmt = ModelOptFormat(section, quant_source)
        if method not in (None, "modelopt"):
            raise fail(f"{quant_source} says ModelOpt but quantization_config.quant_method is {method!r}", source)
        if method == "modelopt" and isinstance(qc.get("quant_algo"), str) and qc["quant_algo"].upper() != fmt.algo:
            raise fail(f"quant_algo {qc['quant_algo']!r} differs from {quant_source}'s {fmt.algo!r}", source)
        return fmt
    if qc is None:
        raise fail("no quantization_config (and no hf_quant_config.json): not an FP8 checkpoint; a bf16 model is "
                   "served through transformers and fp8_backends.quantize_model", source)
    if method == "modelopt":
        return ModelOptFormat(qc, source)
    if method == "compressed-tensors":
        return CompressedTensorsFormat(qc, source)
    if method == "fp8":
        return HfFp8Format(qc, source)
    raise fail(f"quant_method {method!r} is not an FP8 format this library serves ({', '.join(METHODS)})", source)


def detect(path: str | Path) -> QuantFormat:
    """:func:`detect_format` of the checkpoint folder ``path``."""
    folder = Path(path)
    config, quant = read_configs(folder)
    return detect_format(config, quant, source=str(folder / CONFIG), quant_source=str(folder / HF_QUANT_CONFIG))


__all__ = ["CONFIG", "HF_QUANT_CONFIG", "METHODS", "detect", "detect_format", "read_configs", "read_json"]
