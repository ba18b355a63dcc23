"""A model ``transformers`` already loaded with its own FP8 layers, onto the library's: :func:`swap_fp8_layers`.

What ``transformers`` leaves in a model it loaded from an FP8 checkpoint:

- Hugging Face ``fp8`` (``FineGrainedFP8Config``, on a GPU of compute capability >= 8.9): ``FP8Linear`` modules
  (``transformers.integrations.finegrained_fp8``) with ``weight`` float8_e4m3fn, ``weight_scale_inv`` (one value, or
  ``[ceil(N/BN), ceil(K/BK)]`` with ``block_size``), ``activation_scale`` when ``activation_scheme`` is static;
- compressed-tensors (before the model's first forward, which decompresses every layer to the model dtype):
  ``nn.Linear`` modules with a ``quantization_scheme`` whose ``weight`` is float8 with ``weight_scale`` (and
  ``input_scale``).

Each becomes an :class:`~fp8_backends.layers.Fp8Linear` over the same tensors (nothing requantized; fused siblings
copied into one weight), through the same plan and loader as :func:`~fp8_backends.checkpoints.load_pretrained`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.errors import CheckpointError, InvalidTypeError
from .formats import QuantFormat
from .schemes import Scheme

if TYPE_CHECKING:
    from torch import nn

    from .summary import CheckpointSummary

logger = logging.getLogger("fp8_backends")
WHERE = "<loaded model>"


class _LoadedFormat(QuantFormat):
    """The schemes found on a loaded model's modules."""

    kind = "loaded"

    def __init__(self, schemes: dict[str, Scheme], description: str) -> None:
        super().__init__(WHERE, description)
        self.schemes = schemes

    def scheme_for(self, name: str, classes: Sequence[str]) -> Scheme | None:
        return self.schemes.get(name)

    def keep_reason(self, name: str, classes: Sequence[str]) -> str:
        return "not an FP8 layer in the loaded model"


def _hf_fp8_scheme(module: Any) -> Scheme:
    from .format_hf_fp8 import INPUT_SCALE_NAMES, WEIGHT_SCALE_NAMES

    block = getattr(module, "block_size", None)
    act = getattr(module, "activation_scheme", "dynamic")
    if block is not None:
        if act != "dynamic":
            raise CheckpointError("block weights with static activations are not served", tensor="activation_scale",
                                  file=WHERE)
        bn, bk = (int(v) for v in block)
        return Scheme("block", "group", block=(bn, bk), group_size=bk, weight_scale_names=WEIGHT_SCALE_NAMES,
                      input_scale_names=INPUT_SCALE_NAMES)
    return Scheme("tensor", "static" if act == "static" else "dynamic", weight_scale_names=WEIGHT_SCALE_NAMES,
                  input_scale_names=INPUT_SCALE_NAMES)


def _ct_scheme(name: str, module: Any) -> Scheme:
    from .format_compressed_tensors import _group_scheme

    scheme = module.quantization_scheme
    dump = scheme.model_dump() if hasattr(scheme, "model_dump") else dict(scheme)
    return _group_scheme(dump, name, WHERE)


def find_fp8_layers(model: nn.Module) -> tuple[dict[str, Scheme], dict[str, Any], str]:
    """``({module name: scheme}, {tensor name: tensor}, description)`` of the FP8 layers ``transformers`` put in
    ``model``."""
    import torch

    schemes: dict[str, Scheme] = {}
    tensors: dict[str, Any] = {}
    kinds = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls == "FP8Linear" and hasattr(module, "weight_scale_inv"):
            schemes[name] = _hf_fp8_scheme(module)
            kinds.add("Hugging Face fp8 FP8Linear")
        elif getattr(module, "quantization_scheme", None) is not None and isinstance(module, torch.nn.Linear):
            if module.weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise CheckpointError(f"{name} was decompressed to {module.weight.dtype} (its model ran a forward "
                                      "already): swap before the first forward, or load the checkpoint with "
                                      "fp8_backends.load_pretrained", tensor=f"{name}.weight", file=WHERE)
            schemes[name] = _ct_scheme(name, module)
            kinds.add("compressed-tensors")
        else:
            continue
        for attr, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if t is not None:
                tensors[f"{name}.{attr}"] = t.detach()
    return schemes, tensors, " + ".join(sorted(kinds)) or "no FP8 layers"


def swap_fp8_layers(model: nn.Module, *, backend: Any = None, fuse: Any = True, shard_scales: str = "auto",
                    objective: Any = None, dtype: Any = None) -> CheckpointSummary:
    """Replace the FP8 layers ``transformers`` loaded into ``model`` (module docstring) by ``Fp8Linear`` in place;
    return the summary. ``dtype``: the model dtype (default: the input embeddings' dtype, else bf16); every other
    argument as :func:`~fp8_backends.checkpoints.load_pretrained` takes it. A model with no FP8 layer raises
    :class:`~fp8_backends.core.errors.CheckpointError`."""
    import torch
    from torch import nn

    from .loader import Fp8CheckpointLoader, block_layer_served, check_backend, dtype_code, fuse_patterns
    from .params import linear_infos
    from .plan import LinearInfo, plan_linears
    from .shards import TensorMeta

    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"swap_fp8_layers needs an nn.Module, got {type(model).__name__}")
    schemes, tensors, description = find_fp8_layers(model)
    if not schemes:
        raise CheckpointError("no FP8 layers (transformers' FP8Linear or compressed-tensors linears) in this model",
                              file=WHERE)
    if dtype is None:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        weight = getattr(emb, "weight", None)
        dtype = weight.dtype if weight is not None and weight.dtype.is_floating_point else torch.bfloat16
    fmt = _LoadedFormat(schemes, description)
    infos = []
    for info in linear_infos(model):
        if info.name in schemes:  # transformers' FP8Linear subclasses nn.Linear; its tensors are what is read
            info = LinearInfo(info.name, info.k, info.n, info.bias, ("Linear", "Module"), True)
        infos.append(info)
    metas = {name: TensorMeta(name, dtype_code(t), tuple(t.shape), WHERE) for name, t in tensors.items()}
    plan = plan_linears(fmt, infos, metas, fuse_groups=fuse_patterns(fuse), block_served=block_layer_served(),
                        where=WHERE)
    device = next(iter(tensors.values())).device
    check_backend(backend, device)
    loader = Fp8CheckpointLoader(plan, dtype=dtype, device=device, backend=backend, objective=objective,
                                 shard_scales=shard_scales)
    with torch.no_grad():
        for meta in plan.small_tensors():
            loader.weight_loader(meta.name, tensors[meta.name])
        loader.create_weights(model)
        for name, t in tensors.items():
            loader.weight_loader(name, t)
        summary = loader.process_weights_after_loading()
    hook = getattr(model, "ct_decompress_hook", None)
    if hook is not None:  # compressed-tensors' decompression at the first forward: nothing left to decompress
        hook.remove()
        del model.ct_decompress_hook
    logger.info("%s", summary)
    return summary


__all__ = ["find_fp8_layers", "swap_fp8_layers"]
