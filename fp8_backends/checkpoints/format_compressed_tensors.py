"""compressed-tensors FP8 checkpoints (``format: float-quantized``), torch-free.

Config (``config.json``'s ``quantization_config``): ``{"quant_method": "compressed-tensors", "format":
"float-quantized", "quantization_status": "compressed", "config_groups": {NAME: {"targets": [...], "weights": ARGS,
"input_activations": ARGS | null, "output_activations": null, "format": ...}}, "ignore": [...], "kv_cache_scheme":
...}`` with ``ARGS = {"num_bits": 8, "type": "float", "strategy": ..., "dynamic": ..., "symmetric": true,
"group_size": ..., "block_structure": ...}``. Targets and ``ignore`` entries match a module by exact name, by
``"re:REGEX"`` (``re.match`` on the name) or by class name (``"Linear"`` matches every ``nn.Linear``), the first
match of an exact name, then a regex, then a class deciding, as compressed-tensors does.

Schemes served (the presets ``FP8``, ``FP8_DYNAMIC``, ``FP8_BLOCK`` and their neighbours):

- weights ``tensor`` (``weight_scale`` ``[1]``) or ``channel`` (``[N, 1]``) with input ``tensor`` static
  (``input_scale`` ``[1]``), ``tensor`` dynamic or ``token`` dynamic;
- weights ``block`` (``block_structure [BN, BK]``, ``weight_scale [ceil(N/BN), ceil(K/BK)]``) with input ``group``
  dynamic of ``group_size == BK``.

Scales are stored in the weight's original dtype (bf16 or fp16 as often as fp32) and converted to fp32 at load.
Weight-only schemes (no ``input_activations``), asymmetric ones, output-activation quantization, transforms and
sparsity raise :class:`~fp8_backends.core.errors.CheckpointError`. ``kv_cache_scheme`` scales are not used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .formats import QuantFormat, fail, require_block, require_mapping, require_served_block, require_str_list
from .schemes import Scheme

#: per-module formats whose FP8 weights are stored as float8 values with their scales
FORMATS = ("float-quantized", "naive-quantized")


class CompressedTensorsFormat(QuantFormat):
    kind = "compressed-tensors"

    def __init__(self, qc: Mapping[str, Any], source: str) -> None:
        top = qc.get("format")
        super().__init__(source, f"compressed-tensors {top}")
        status = qc.get("quantization_status", "compressed")
        if status != "compressed":
            raise fail(f"quantization_status is {status!r}: only compressed checkpoints (FP8 weights stored as "
                       "float8) are served", source)
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise fail(f"{key} is set ({qc[key]!r}): sparse or transformed checkpoints are not served", source)
        groups = require_mapping(qc.get("config_groups"), "config_groups", source)
        if not groups:
            raise fail("config_groups is empty", source)
        self.ignore = require_str_list(qc.get("ignore"), "ignore", source)
        #: (target, scheme, group name) in the config's order
        self.targets: list[tuple[str, Scheme, str]] = []
        for gname, group in groups.items():
            group = require_mapping(group, f"config_groups[{gname!r}]", source)
            fmt = group.get("format") or top
            if fmt not in FORMATS:
                raise fail(f"config_groups[{gname!r}] has format {fmt!r}: only {', '.join(FORMATS)} FP8 is served",
                           source)
            scheme = _group_scheme(group, gname, source)
            for target in require_str_list(group.get("targets"), f"config_groups[{gname!r}].targets", source):
                self.targets.append((target, scheme, gname))
        if not self.targets:
            raise fail("config_groups name no targets", source)
        for what, entry in [("ignore", i) for i in self.ignore] + [("targets", t[0]) for t in self.targets]:
            if entry.startswith("re:"):
                try:
                    re.compile(entry[3:])
                except re.error as exc:
                    raise fail(f"{what} entry {entry!r} is not a valid pattern: {exc}", source) from None
        if qc.get("kv_cache_scheme"):
            self.notes.append("kv_cache_scheme: KV-cache scales are not used (the KV cache stays in the model dtype)")

    def _ignored(self, name: str, classes: Sequence[str]) -> str | None:
        return next((i for i in self.ignore if _match(name, classes, i)), None)

    def scheme_for(self, name: str, classes: Sequence[str]) -> Scheme | None:
        if self._ignored(name, classes) is not None:
            return None
        exact = [t for t in self.targets if not t[0].startswith("re:") and t[0] == name]
        regex = [t for t in self.targets if t[0].startswith("re:") and _match(name, (), t[0])]
        by_class = [t for t in self.targets if not t[0].startswith("re:") and t[0] in classes]
        for found in (exact, regex, by_class):
            if found:
                return found[0][1]
        return None

    def keep_reason(self, name: str, classes: Sequence[str]) -> str:
        target = self._ignored(name, classes)
        return f"ignore: {target}" if target is not None else "no config group targets it"


def _match(name: str, classes: Sequence[str], target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target in classes


def _args(group: Mapping[str, Any], key: str, gname: str, source: str) -> Mapping[str, Any] | None:
    args = group.get(key)
    if args is None:
        return None
    args = require_mapping(args, f"config_groups[{gname!r}].{key}", source)
    what = f"config_groups[{gname!r}].{key}"
    if args.get("num_bits") != 8 or args.get("type") != "float":
        raise fail(f"{what} is {args.get('type')!r} with {args.get('num_bits')!r} bits: only 8-bit float (FP8) is "
                   "served", source)
    if args.get("symmetric", True) is not True:
        raise fail(f"{what} is asymmetric (zero points): not served", source)
    if args.get("actorder"):
        raise fail(f"{what} has actorder {args['actorder']!r}: not served", source)
    return args


def _block_structure(value: object) -> object:
    """A ``block_structure`` as compressed-tensors reads it: ``[BN, BK]``, or the string ``"BNxBK"`` its earlier
    versions wrote (``"128x128"``); anything else as it is (``require_block`` refuses it)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", value)
        if m:
            return [int(m.group(1)), int(m.group(2))]
    return value


def _group_scheme(group: Mapping[str, Any], gname: str, source: str) -> Scheme:
    where = f"config_groups[{gname!r}]"
    if group.get("output_activations") is not None:
        raise fail(f"{where} quantizes output activations: not served", source)
    weights = _args(group, "weights", gname, source)
    inputs = _args(group, "input_activations", gname, source)
    if weights is None:
        raise fail(f"{where} has no weights scheme", source)
    if inputs is None:
        raise fail(f"{where} is weight-only (no input_activations): FP8 weight-only linears are not served", source)
    w_strategy = weights.get("strategy")
    if weights.get("dynamic", False) is not False:
        raise fail(f"{where}.weights are dynamic: not served", source)
    block = None
    if w_strategy == "block":
        block = require_block(_block_structure(weights.get("block_structure")), f"{where}.weights.block_structure",
                              source)
    elif w_strategy not in ("tensor", "channel"):
        raise fail(f"{where}.weights strategy {w_strategy!r} is not served (tensor, channel or block)", source)
    a_strategy, dynamic = inputs.get("strategy"), inputs.get("dynamic", False)
    group_size = None
    if a_strategy == "tensor" and dynamic is False:
        act = "static"
    elif a_strategy == "tensor" and dynamic is True:
        act = "dynamic"
    elif a_strategy == "token" and dynamic is True:
        act = "token"
    elif a_strategy == "group" and dynamic is True:
        act = "group"
        group_size = inputs.get("group_size")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise fail(f"{where}.input_activations.group_size must be a positive integer, got {group_size!r}", source)
    else:
        raise fail(f"{where}.input_activations strategy {a_strategy!r} with dynamic={dynamic!r} is not served "
                   "(tensor static, tensor/token/group dynamic)", source)
    if (w_strategy == "block") != (act == "group") or (block is not None and group_size != block[1]):
        raise fail(f"{where}: {w_strategy} weights with {a_strategy} activations are not served (block weights pair "
                   "with dynamic group activations whose group size is the block's K)", source)
    if block is not None:
        require_served_block(block, block[1], f"{where}.weights.block_structure", source)
    return Scheme(w_strategy, act, block=block, group_size=group_size)


__all__ = ["FORMATS", "CompressedTensorsFormat"]
