"""Hugging Face ``fp8`` checkpoints (``transformers``' ``FineGrainedFP8Config``: DeepSeek-V3, Qwen3-*-FP8), torch-free.

Config (``config.json``'s ``quantization_config``): ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic" | "static", "weight_block_size": [128, 128] | null, "modules_to_not_convert": [...] | null}``
(``ignored_layers`` is read as ``modules_to_not_convert``, as ``transformers`` does; ``scale_fmt: "ue8m0"`` stores
the block scales as powers of two, converted to fp32 at load).

Schemes:

- ``weight_block_size [BN, BK]``, dynamic: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv``
  ``[ceil(N/BN), ceil(K/BK)]`` (despite the name, the dequantization multiplier: ``w = w_q * weight_scale_inv``),
  activations quantized per token in groups of ``BK``;
- no block size: one weight scale (``weight_scale_inv``, or ``weight_scale`` as vLLM writes it), activations dynamic
  per tensor, or static with ``activation_scale`` (``input_scale``).

``modules_to_not_convert`` patterns match as ``transformers`` matches them: from the start of a name up to a module
boundary, as a regex with the same boundary, or as a suffix. The output head (``lm_head``) is kept in the model dtype
unless the checkpoint stores it in FP8 (``transformers`` never converts it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from .formats import QuantFormat, fail, module_pattern, require_block, require_served_block, require_str_list
from .schemes import Scheme

WEIGHT_SCALE_NAMES = ("weight_scale_inv", "weight_scale")
INPUT_SCALE_NAMES = ("activation_scale", "input_scale")


class HfFp8Format(QuantFormat):
    kind = "fp8"

    def __init__(self, qc: Mapping[str, Any], source: str) -> None:
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise fail(f"fmt {fmt!r} is not served: the fp8 format's weights are float8_e4m3fn (fmt e4m3)", source)
        act = qc.get("activation_scheme", "dynamic")
        if act not in ("dynamic", "static"):
            raise fail(f"activation_scheme {act!r} is not dynamic or static", source)
        block = qc.get("weight_block_size")
        scale_fmt = qc.get("scale_fmt", "float")
        if scale_fmt not in (None, "float", "ue8m0"):
            raise fail(f"scale_fmt {scale_fmt!r} is not float or ue8m0", source)
        if qc.get("modules_to_convert"):
            raise fail(f"modules_to_convert {qc['modules_to_convert']!r}: FP8 embeddings are not served", source)
        if block is not None:
            bn, bk = require_block(block, "weight_block_size", source)
            if act != "dynamic":
                raise fail("block weights with static activations are not served (weight_block_size with "
                           "activation_scheme static)", source)
            require_served_block((bn, bk), bk, "weight_block_size", source)
            self.scheme = Scheme("block", "group", block=(bn, bk), group_size=bk, weight_scale_names=WEIGHT_SCALE_NAMES,
                                 input_scale_names=INPUT_SCALE_NAMES)
            described = f"weight_block_size [{bn}, {bk}]"
        else:
            self.scheme = Scheme("tensor", "static" if act == "static" else "dynamic",
                                 weight_scale_names=WEIGHT_SCALE_NAMES, input_scale_names=INPUT_SCALE_NAMES)
            described = "per-tensor"
        super().__init__(source, f"Hugging Face fp8 ({described}, {act} activations)")
        self.scale_fmt = scale_fmt or "float"
        skip = qc.get("modules_to_not_convert")
        if skip is None:
            skip = qc.get("ignored_layers")
        self.skip = require_str_list(skip, "modules_to_not_convert", source)
        for pattern in self.skip:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise fail(f"modules_to_not_convert entry {pattern!r} is not a valid pattern: {exc}", source) from None
        self.soft_keep = ("lm_head",)

    def _skipped(self, name: str) -> str | None:
        return module_pattern(name, self.skip)

    def scheme_for(self, name: str, classes: Sequence[str]) -> Scheme | None:
        if "Linear" not in classes or self._skipped(name) is not None:
            return None
        return self.scheme

    def keep_reason(self, name: str, classes: Sequence[str]) -> str:
        key = self._skipped(name)
        return f"modules_to_not_convert: {key}" if key is not None else super().keep_reason(name, classes)


__all__ = ["INPUT_SCALE_NAMES", "WEIGHT_SCALE_NAMES", "HfFp8Format"]
