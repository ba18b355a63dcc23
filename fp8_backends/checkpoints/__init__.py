"""Serving FP8 checkpoints as they ship: ModelOpt, compressed-tensors and Hugging Face ``fp8``.

- :func:`load_pretrained` (``fp8_backends.load_pretrained``): a checkpoint folder -> a ``transformers`` model whose
  quantized linears are :class:`~fp8_backends.layers.Fp8Linear` with the checkpoint's own weights and scales;
- :func:`swap_fp8_layers`: a model ``transformers`` already loaded with its own FP8 layers -> the same model on
  ``Fp8Linear`` (its tensors kept);
- :func:`load_fp8_state_dict` and :class:`Fp8CheckpointLoader`: what an engine calls with its own modules and a state
  dict or a stream of tensors (``create_weights`` / ``weight_loader`` / ``process_weights_after_loading``);
- :func:`detect_format`: the parsed quantization config (which scheme each module has).

Importing this package imports neither torch nor transformers nor safetensors: they load when a function runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8_backends import _lazy_exports

_EXPORTS = {
    "load_pretrained": "fp8_backends.checkpoints.pretrained",
    "LoadedModel": "fp8_backends.checkpoints.pretrained",
    "swap_fp8_layers": "fp8_backends.checkpoints.swap",
    "load_fp8_state_dict": "fp8_backends.checkpoints.loader",
    "Fp8CheckpointLoader": "fp8_backends.checkpoints.loader",
    "CheckpointSummary": "fp8_backends.checkpoints.summary",
    "detect_format": "fp8_backends.checkpoints.detect",
    "Scheme": "fp8_backends.checkpoints.schemes",
    "QuantFormat": "fp8_backends.checkpoints.formats",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from .detect import detect_format
    from .formats import QuantFormat
    from .loader import Fp8CheckpointLoader, load_fp8_state_dict
    from .pretrained import LoadedModel, load_pretrained
    from .schemes import Scheme
    from .summary import CheckpointSummary
    from .swap import swap_fp8_layers
