"""What the formats share: :class:`QuantFormat` (which scheme each module has) and the config checks (torch-free).

A format is parsed from a checkpoint's quantization config (``config.json``'s ``quantization_config`` or ModelOpt's
``hf_quant_config.json``) by one of :mod:`.format_modelopt`, :mod:`.format_compressed_tensors`,
:mod:`.format_hf_fp8`; :func:`fp8_backends.checkpoints.detect.detect_format` picks the parser. A parsed format answers
one question per module: :meth:`QuantFormat.scheme_for` (``None``: the module stays in the model dtype). Any config
the library cannot serve raises :class:`~fp8_backends.core.errors.CheckpointError` naming the config file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..core.errors import CheckpointError
from .schemes import Scheme

#: tensors a checkpoint may hold beside a quantized linear's that the library does not use: KV-cache and attention
#: quantization scales (the served model's KV cache stays in the model dtype)
KV_CACHE_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale", "kv_scale")


class QuantFormat:
    """A parsed quantization config.

    Attributes: ``kind`` (``"modelopt"``, ``"compressed-tensors"`` or ``"fp8"``), ``source`` (the file the config was
    read from), ``description`` (one line for the summary), ``notes`` (what the library does not use, e.g. KV-cache
    scales), ``soft_keep`` (module leaf names kept in the model dtype when the checkpoint stores them unquantized even
    though the config covers them: HF ``fp8`` never quantizes the output head)."""

    kind = ""

    def __init__(self, source: str, description: str) -> None:
        self.source = source
        self.description = description
        self.notes: list[str] = []
        self.soft_keep: tuple[str, ...] = ()

    def scheme_for(self, name: str, classes: Sequence[str]) -> Scheme | None:
        """The scheme of module ``name`` (``classes``: its class and base-class names, e.g. ``["Linear",
        "Module"]``), or ``None`` when the config keeps it in the model dtype."""
        raise NotImplementedError

    def keep_reason(self, name: str, classes: Sequence[str]) -> str:
        """Why :meth:`scheme_for` keeps ``name`` (for the summary)."""
        return "not covered by the quantization config"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description!r}, source={self.source!r})"


def module_pattern(name: str, patterns: Sequence[str]) -> str | None:
    """The first of ``patterns`` that names module ``name`` as ``transformers`` matches its skip lists
    (``modules_to_not_convert``, ``_keep_in_fp32_modules``): as a regex from the start up to a module boundary
    (``layers.1`` names ``layers.1.mlp``, not ``layers.11.mlp``; ``mlp.gate`` not ``mlp.gate_proj``), or as a suffix
    (``fc1`` names ``model.layers.3.fc1``); ``None`` where none does. A pattern that is no valid regex names by its
    suffix only (a config's own lists are checked when the config is read)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for key in patterns:
        if name.endswith(key):
            return key
        try:
            if re.match(rf"(?:{key}){boundary}", name):
                return key
        except re.error:
            continue
    return None


def fail(message: str, source: str) -> CheckpointError:
    """The error of a config the library cannot serve (raise it)."""
    return CheckpointError(message, file=source)


def require_mapping(value: object, what: str, source: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise fail(f"{what} must be a JSON object, got {type(value).__name__}", source)
    return value


def require_str_list(value: object, what: str, source: str) -> list[str]:
    """``value`` as a list of strings (``None`` -> ``[]``)."""
    if value is None:
        return []
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise fail(f"{what} must be a list of strings, got {value!r}", source)
    return list(value)


def require_block(value: object, what: str, source: str) -> tuple[int, int]:
    """A ``[BN, BK]`` block size of two positive integers."""
    if (not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise fail(f"{what} must be two positive integers [BN, BK], got {value!r}", source)
    return int(value[0]), int(value[1])


def served_block_modes() -> frozenset[tuple[int, int, int]]:
    """``(BN, BK, group size)`` of every block-wise FP8 mode a registered GEMM provider declares
    (:attr:`~fp8_backends.core.capabilities.GemmCapabilities.weight_blocks` x ``group_sizes``), whatever this machine
    can run: which provider serves a layer is decided when it is loaded, on its device. Providers that failed to load
    declare nothing."""
    from fp8_backends.registry.discovery import LOADED, discover

    modes: set[tuple[int, int, int]] = set()
    for entry in discover("gemm"):
        caps = getattr(entry.cls, "capabilities", None) if entry.status == LOADED else None
        if caps is not None and getattr(caps, "block_scaled", False):
            modes.update((bn, bk, g) for bn, bk in caps.weight_blocks for g in caps.group_sizes if bk % g == 0)
    return frozenset(modes)


def require_served_block(block: tuple[int, int], group: int, what: str, source: str) -> None:
    """Refuse, from the config alone (before any tensor is read or any module swapped), ``block`` weights with
    activation groups of ``group`` where no registered GEMM provider declares that mode (:func:`served_block_modes`)."""
    modes = served_block_modes()
    if (*block, group) in modes:
        return
    served = ", ".join(f"{bn}x{bk} blocks with groups of {g}" for bn, bk, g in sorted(modes)) or "none"
    raise fail(f"{what} {block[0]}x{block[1]} with activation groups of {group}: no registered GEMM provider serves "
               f"this block-wise mode (served: {served})", source)


__all__ = ["KV_CACHE_SCALES", "QuantFormat", "fail", "module_pattern", "require_block", "require_mapping",
           "require_served_block", "require_str_list", "served_block_modes"]
