"""MoE experts stored one by one: :func:`expand_experts` gives the model the checkpoint's per-expert linears.

``transformers`` 5 builds a MoE layer's routed experts as one module of 3-D ``gate_up_proj`` / ``down_proj``
parameters, while FP8 checkpoints store each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` as its own FP8
weight with its own scales. Before the plan is made, every such experts module whose checkpoint holds per-expert
tensors (``<module>.<e>.gate_proj.weight``, ...) is replaced by a
:class:`~fp8_backends.layers.experts.PerExpertLinears`, whose linears then are planned, checked and loaded like the
model's others (FP8 where the config quantizes them, fused gate/up where their blocks allow, kept in the model dtype
where the config keeps them). A checkpoint that stores the 3-D parameters themselves is loaded as the model holds
them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..core.errors import CheckpointError
from .shards import TensorMeta

if TYPE_CHECKING:
    from torch import nn

PER_EXPERT_LEAVES = ("gate_proj", "up_proj", "down_proj")


def expand_experts(model: nn.Module, tensors: Mapping[str, TensorMeta], *, strict: bool = True,
                   where: str = "") -> tuple[list[str], Callable[[], None]]:
    """Replace, in ``model``, every ``transformers`` experts module whose experts ``tensors`` stores one by one by a
    :class:`~fp8_backends.layers.experts.PerExpertLinears` (module docstring); return the summary's notes (empty when
    nothing was replaced) and a function that puts the replaced modules back (a load that fails before it changes
    the model otherwise). ``strict``: an experts module the checkpoint stores in neither layout is an error.

    Raises :class:`~fp8_backends.core.errors.CheckpointError` for experts stored one by one whose module's layout
    the per-expert form cannot serve (biases, interleaved gate/up, ...), before the model is changed."""
    from fp8_backends.layers.experts import (
        GROUPED_MAX_PAIRS,
        PerExpertLinears,
        fused_experts_layout,
        unserved_layout,
    )

    found = [(name, module, layout) for name, module in model.named_modules()
             if (layout := fused_experts_layout(module)) is not None]
    todo = []
    sizes: set[str] = set()
    for name, module, (e, i, h) in found:
        if f"{name}.gate_up_proj" in tensors or f"{name}.down_proj" in tensors:
            continue  # stored as the model holds it: loaded as any other parameter
        first = next((f"{name}.0.{leaf}.weight" for leaf in PER_EXPERT_LEAVES
                      if f"{name}.0.{leaf}.weight" in tensors), None)
        if first is None:
            if strict:
                raise CheckpointError(f"missing: the model holds {name}'s {e} experts as gate_up_proj [{e}, {2 * i}, "
                                      f"{h}] and down_proj [{e}, {h}, {i}]; the checkpoint stores neither those nor "
                                      f"per-expert {name}.<e>.{{{','.join(PER_EXPERT_LEAVES)}}}.weight",
                                      tensor=f"{name}.gate_up_proj", file=where)
            continue
        reason = unserved_layout(module)
        if reason is not None:
            raise CheckpointError(f"the checkpoint stores {name}'s experts one by one, but {type(module).__name__} "
                                  f"cannot be served per expert: {reason}", tensor=first, file=tensors[first].file)
        todo.append((name, module))
        sizes.add(f"{e} x gate/up [{i}, {h}] + down [{h}, {i}]")
    if not todo:
        return [], lambda: None
    replaced = []
    for name, module in todo:
        weights = {attr: module._parameters[attr] for attr in ("gate_up_proj", "down_proj")}
        model.set_submodule(name, PerExpertLinears.from_fused(module))
        replaced.append((name, module, weights))

    def undo() -> None:
        for name, module, weights in replaced:
            module._parameters.update(weights)
            model.set_submodule(name, module)

    return [f"{len(todo)} MoE layer(s) with experts stored one by one, served one linear triple per expert "
            f"({'; '.join(sorted(sizes))}): stacked, an experts GEMV per projection up to {GROUPED_MAX_PAIRS} "
            "(token, slot) pairs and a tiled experts GEMM above; experts that cannot stack run an eager loop over "
            "the experts hit (one host sync per layer)"], undo


__all__ = ["PER_EXPERT_LEAVES", "expand_experts"]
