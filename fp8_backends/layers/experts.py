"""Mixture-of-experts weights as one linear triple per expert: :class:`PerExpertLinears`.

``transformers`` (5.x) holds a MoE layer's routed experts as two 3-D parameters of one module (``gate_up_proj``
``[E, 2*I, H]``, ``down_proj`` ``[E, H, I]``), while the FP8 checkpoints people download (DeepSeek-V3/R1,
Qwen3-MoE-FP8, GLM-4.5-FP8) store every expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` as its own FP8 weight
with its own scales (``mlp.experts.<e>.gate_proj.weight``). :class:`PerExpertLinears` takes the experts module's
place with one :class:`ExpertMLP` (three ``nn.Linear``) per expert, named as the checkpoint names them, so each can
become an :class:`~fp8_backends.layers.Fp8Linear` (gate/up fused into one GEMM where their blocks allow) like any
other linear of the model.

The forward is the one ``transformers``' default ("eager") experts implementation runs: for every expert some token
was routed to, ``down(gate(cat(gate_proj(x), up_proj(x)))) * routing weight``, summed into the tokens' rows; the
gating (activation and product) is the replaced module's own ``_apply_gate`` (default: ``act(gate) * up``). Which
experts were hit is read on the host (one sync per MoE layer and step, as in ``transformers``' eager experts), so a
MoE layer served this way is not CUDA-graph capturable and breaks a ``torch.compile`` graph; an FP8 grouped GEMM
over all experts is not part of the library yet.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.errors import InvalidInputError

#: the attributes ``transformers``' ``use_experts_implementation`` sets on an experts module, and the values the
#: per-expert layout serves: gate and up concatenated (not interleaved), ``[out, in]`` weights, no biases, no norm
#: after each expert
SERVED_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                 "has_post_expert_norm": False}


class ExpertMLP(nn.Module):
    """One routed expert: ``gate_proj`` and ``up_proj`` (``[I, H]``) and ``down_proj`` (``[H, I]``), no biases."""

    def __init__(self, hidden: int, intermediate: int, *, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden, intermediate, **kw)
        self.up_proj = nn.Linear(hidden, intermediate, **kw)
        self.down_proj = nn.Linear(intermediate, hidden, **kw)


def fused_experts_layout(module: nn.Module) -> tuple[int, int, int] | None:
    """``(E, I, H)`` when ``module`` is a ``transformers`` experts module of 3-D ``gate_up_proj`` ``[E, 2*I, H]`` and
    ``down_proj`` ``[E, H, I]`` parameters; None for any other module."""
    gate_up = module._parameters.get("gate_up_proj")
    down = module._parameters.get("down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return None
    e, two_i, h = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        return None
    return int(e), int(two_i // 2), int(h)


def unserved_layout(module: nn.Module) -> str | None:
    """Why the per-expert layout cannot serve the experts module ``module`` (None: it can)."""
    if fused_experts_layout(module) is None:
        return "its weights are not 3-D gate_up_proj [E, 2*I, H] and down_proj [E, H, I] parameters"
    differing = [f"{attr}={getattr(module, attr)!r}" for attr, value in SERVED_LAYOUT.items()
                 if getattr(module, attr, value) != value]
    if differing:
        return "its layout is not served per expert (" + ", ".join(differing) + ")"
    extra = sorted(set(module._parameters) - {"gate_up_proj", "down_proj"})
    if extra:
        return f"it holds parameters beside gate_up_proj / down_proj ({', '.join(extra)})"
    if not callable(getattr(module, "_apply_gate", None)) and not callable(getattr(module, "act_fn", None)):
        return "it has neither _apply_gate nor act_fn (its gating is unknown)"
    return None


class PerExpertLinears(nn.Module):
    """A ``transformers`` experts module's place in the model, served as one :class:`ExpertMLP` per expert (children
    named ``"0"``, ``"1"``, ...; module docstring). Build it with :meth:`from_fused`.

    Forward: ``hidden_states`` ``[T, H]`` (model dtype), ``top_k_index`` ``[T, k]`` (int, expert ids; ids >= E are
    skipped, as expert-parallel sentinels are), ``top_k_weights`` ``[T, k]`` -> ``[T, H]`` in ``hidden_states``'
    dtype.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, gating: nn.Module, *, device: Any = None,
                 dtype: Any = None) -> None:
        super().__init__()
        if num_experts < 1:
            raise InvalidInputError(f"a MoE layer needs >= 1 expert, got {num_experts}")
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.intermediate_dim = intermediate
        for e in range(num_experts):
            self.add_module(str(e), ExpertMLP(hidden, intermediate, device=device, dtype=dtype))
        #: the replaced experts module without its weights: its ``_apply_gate`` (or ``act_fn``) gates
        self.gating = gating
        self._own_gate = callable(getattr(gating, "_apply_gate", None))  # decided once, not per call

    @classmethod
    def from_fused(cls, module: nn.Module) -> PerExpertLinears:
        """The per-expert form of the ``transformers`` experts module ``module``, its linears on the meta device (the
        fused weights are dropped: a checkpoint's per-expert tensors are loaded into the new linears). Raises
        :class:`~fp8_backends.core.errors.InvalidInputError` where :func:`unserved_layout` gives a reason."""
        reason = unserved_layout(module)
        if reason is not None:
            raise InvalidInputError(f"{type(module).__name__} cannot be served per expert: {reason}")
        e, i, h = fused_experts_layout(module)  # type: ignore[misc]
        out = cls(e, h, i, module, device="meta", dtype=module._parameters["gate_up_proj"].dtype)
        for attr in ("gate_up_proj", "down_proj"):
            del module._parameters[attr]
        return out

    def expert(self, e: int) -> ExpertMLP:
        return self._modules[str(e)]  # type: ignore[return-value]

    def _gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self._own_gate:
            return self.gating._apply_gate(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.gating.act_fn(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            raise InvalidInputError("MoE experts served per expert read which experts were hit on the host: they "
                                    "cannot be captured in a CUDA graph (run the model eagerly or compiled)")
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        # the (token, slot) pairs grouped by expert; ids outside [0, E) (expert-parallel sentinels) counted apart
        ids = torch.where((flat >= 0) & (flat < self.num_experts), flat, self.num_experts)
        order = torch.argsort(ids, stable=True)
        counts = torch.bincount(ids, minlength=self.num_experts + 1).tolist()  # the layer's one host sync
        weights = top_k_weights.reshape(-1)
        start = 0
        for e, count in enumerate(counts[:-1]):
            if count:
                pairs = order[start:start + count]
                tokens = pairs // k
                x = hidden_states[tokens]
                expert = self.expert(e)
                h = self._gate(torch.cat((expert.gate_proj(x), expert.up_proj(x)), dim=-1))
                y = expert.down_proj(h) * weights[pairs, None]
                out.index_add_(0, tokens, y.to(out.dtype))
            start += count
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


__all__ = ["SERVED_LAYOUT", "ExpertMLP", "PerExpertLinears", "fused_experts_layout", "unserved_layout"]
