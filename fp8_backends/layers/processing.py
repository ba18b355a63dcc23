"""Processing a whole model after its weights were loaded: :func:`process_weights_after_loading`."""

from __future__ import annotations

from torch import nn

from .experts import stack_expert_weights
from .modules import Fp8Linear, RMSNormFp8Quant


def process_weights_after_loading(model: nn.Module) -> nn.Module:
    """Process every :class:`Fp8Linear` in ``model``, then every :class:`RMSNormFp8Quant` (whose
    quantization reads its linear's final input scale). MoE layers served per expert
    (:class:`~fp8_backends.layers.experts.PerExpertLinears`) stack their experts' weights first. Returns ``model``."""
    stack_expert_weights(model)  # MoE experts' weights into their stacks before their linears are processed
    mods = list(model.modules())
    for m in mods:
        if isinstance(m, Fp8Linear):
            m.process_weights_after_loading()
    stack_expert_weights(model)  # scales processing replaced (per-tensor / per-channel experts) back into the stacks
    for m in mods:
        if isinstance(m, RMSNormFp8Quant):
            m.process_weights_after_loading()
    return model


__all__ = ["process_weights_after_loading"]
