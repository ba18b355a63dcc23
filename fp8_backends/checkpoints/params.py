"""The model side of loading: its linears as :class:`~fp8_backends.checkpoints.plan.LinearInfo` and where every other
checkpoint tensor goes (embeddings, norms, the head, linears kept in the model dtype, persistent buffers).

:func:`plan_params` maps each such tensor to the module attributes that hold it (tied weights: every holder gets the
one loaded parameter) and checks names, dtypes and shapes before anything is loaded; :func:`assign_params` puts a
loaded tensor in place (the model's parameters may be on the meta device until then).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.errors import CheckpointError
from .formats import module_pattern
from .plan import LinearInfo, LoadPlan
from .shards import TensorMeta

if TYPE_CHECKING:
    import torch
    from torch import nn

FLOAT_CODES = ("F32", "BF16", "F16", "F64")


@dataclass
class Holder:
    """One module attribute a tensor is loaded into: ``module.<attr>`` (a parameter or a buffer) of ``dtype``."""

    module: Any
    attr: str
    parameter: bool
    dtype: Any


def linear_infos(model: nn.Module) -> list[LinearInfo]:
    """Every ``nn.Linear`` (subclasses included, marked) of ``model``, each with the entry of the model's
    ``_keep_in_fp32_modules`` or ``_keep_in_fp32_modules_strict`` (``transformers`` class attributes: modules its
    quantizers never convert) that names it, if one does."""
    from torch import nn

    keep = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        listed = getattr(model, attr, None)
        if isinstance(listed, (list, tuple, set, frozenset)):
            keep += sorted(k for k in listed if isinstance(k, str) and k)
    out = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            out.append(LinearInfo(name, module.in_features, module.out_features, module.bias is not None,
                                  tuple(c.__name__ for c in type(module).__mro__), type(module) is nn.Linear,
                                  model_keeps=module_pattern(name, keep) or ""))
    return out


def plan_params(model: nn.Module, plan: LoadPlan, tensors: Mapping[str, TensorMeta], *, strict: bool = True,
                where: str = "") -> dict[str, list[Holder]]:
    """``{checkpoint tensor: [holders]}`` of every parameter (and stored persistent buffer) the plan does not serve as
    FP8. ``strict``: a parameter the checkpoint lacks is an error (else it is left as it is)."""
    served = set(plan.linears)
    groups: dict[int, list[tuple[str, Any, str]]] = {}
    params: dict[int, Any] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if module_name in served:
            continue
        for attr, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{attr}" if module_name else attr
            groups.setdefault(id(param), []).append((name, module, attr))
            params[id(param)] = param
    out: dict[str, list[Holder]] = {}
    for key, holders in groups.items():
        param = params[key]
        source = next((name for name, _, _ in holders if name in tensors), None)
        if source is None:
            if strict:
                raise CheckpointError(f"missing: the model's parameter {holders[0][0]} "
                                      f"{list(param.shape)} is not in the checkpoint", tensor=holders[0][0], file=where)
            continue
        _check(tensors[source], tuple(param.shape))
        out[source] = [Holder(module, attr, True, param.dtype) for _, module, attr in holders]
    for name, buffer in model.named_buffers():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        if name in tensors and attr not in module._non_persistent_buffers_set and module_name not in served:
            _check(tensors[name], tuple(buffer.shape))
            out[name] = [Holder(module, attr, False, buffer.dtype)]
    return out


def _check(meta: TensorMeta, shape: tuple[int, ...]) -> None:
    if meta.dtype not in FLOAT_CODES and not meta.dtype.startswith(("I", "U", "BOOL")):
        raise CheckpointError(f"{meta.dtype} is not served here: only nn.Linear weights are served as FP8",
                              tensor=meta.key, file=meta.file)
    if meta.shape != shape:
        raise CheckpointError(f"shape {list(meta.shape)} does not match the model's {list(shape)}", tensor=meta.key,
                              file=meta.file)


def assign_params(holders: list[Holder], tensor: torch.Tensor, device: Any) -> None:
    """Put ``tensor`` (converted to each holder's dtype, on ``device``) into every holder; tied holders share one
    parameter."""
    from torch import nn

    shared: dict[Any, Any] = {}
    for h in holders:
        value = shared.get(h.dtype)
        if value is None:
            value = tensor.detach().to(device=device, dtype=h.dtype)
            value = nn.Parameter(value, requires_grad=False) if h.parameter else value
            shared[h.dtype] = value
        if h.parameter:
            h.module._parameters[h.attr] = value
        else:
            h.module._buffers[h.attr] = value


__all__ = ["Holder", "assign_params", "linear_infos", "plan_params"]
