"""NVIDIA ModelOpt FP8 checkpoints (``nvidia-modelopt``'s ``export_hf_checkpoint``), torch-free.

Config: ``hf_quant_config.json`` ``{"producer": ..., "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": ...,
"exclude_modules": ["lm_head", ...]}}``, or the same keys in ``config.json``'s ``quantization_config`` with
``"quant_method": "modelopt"`` (there the exclusions may be called ``ignore``). Exclusions are shell wildcards on
module names (a listed module excludes its children too).

Schemes (``quant_algo``, any case):

- ``FP8``: ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` fp32 scalar, ``input_scale`` fp32 scalar (static);
- ``FP8_PER_CHANNEL_PER_TOKEN``: ``weight_scale`` ``[N]`` (per channel), activations dynamic per token;
- ``MIXED_PRECISION``: ``quantized_layers: {module: {"quant_algo": ...}}``, each one of the above (modules not
  listed stay in the model dtype).

Other algorithms (NVFP4, W4A8_AWQ, INT8 SmoothQuant, weight-only FP8 blocks ``FP8_PB_WO``, ...) raise
:class:`~fp8_backends.core.errors.CheckpointError`. ``kv_cache_quant_algo`` scales (``k_proj.k_scale``, ...) are not
used.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

from .formats import QuantFormat, fail, require_mapping, require_str_list
from .schemes import Scheme

#: the ``quant_algo`` values served (lower case; the configs write them in upper case) and their schemes
SCHEMES = {
    "fp8": Scheme("tensor", "static"),
    "fp8_per_channel_per_token": Scheme("channel", "token"),
}


class ModelOptFormat(QuantFormat):
    kind = "modelopt"

    def __init__(self, section: Mapping[str, Any], source: str) -> None:
        algo = section.get("quant_algo")
        if not isinstance(algo, str):
            raise fail(f"ModelOpt quantization config has no quant_algo (got {algo!r})", source)
        algo = algo.upper()
        super().__init__(source, f"ModelOpt {algo}")
        self.algo = algo
        self.exclude = require_str_list(section.get("exclude_modules", section.get("ignore")),
                                        "exclude_modules", source)
        self.layers: dict[str, Scheme] | None = None
        if algo == "MIXED_PRECISION":
            layers = require_mapping(section.get("quantized_layers"), "quantized_layers", source)
            self.layers = {}
            for name, spec in layers.items():
                sub = require_mapping(spec, f"quantized_layers[{name!r}]", source).get("quant_algo")
                self.layers[name] = _scheme(sub, source, f"quantized_layers[{name!r}].quant_algo")
            self.scheme = None
        else:
            self.scheme = _scheme(algo, source, "quant_algo")
        kv = section.get("kv_cache_quant_algo")
        if kv:
            self.notes.append(f"kv_cache_quant_algo {kv}: KV-cache scales are not used (the KV cache stays in the "
                              "model dtype)")

    def _excluded(self, name: str) -> str | None:
        for pattern in self.exclude:
            if fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*"):
                return pattern
        return None

    def scheme_for(self, name: str, classes: Sequence[str]) -> Scheme | None:
        if "Linear" not in classes or self._excluded(name) is not None:
            return None
        if self.layers is not None:
            return self.layers.get(name)
        return self.scheme

    def keep_reason(self, name: str, classes: Sequence[str]) -> str:
        pattern = self._excluded(name)
        if pattern is not None:
            return f"exclude_modules: {pattern}"
        if self.layers is not None:
            return "not in quantized_layers"
        return super().keep_reason(name, classes)


def _scheme(algo: object, source: str, what: str) -> Scheme:
    if not isinstance(algo, str):
        raise fail(f"{what} must be a string, got {algo!r}", source)
    scheme = SCHEMES.get(algo.lower())
    if scheme is None:
        served = ", ".join(name.upper() for name in SCHEMES)
        raise fail(f"{what} {algo!r} is not an FP8 scheme this library serves (served: {served})", source)
    return scheme


__all__ = ["SCHEMES", "ModelOptFormat"]
