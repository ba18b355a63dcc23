"""Mixture-of-experts weights as one linear triple per expert: :class:`PerExpertLinears`.

``transformers`` (5.x) holds a MoE layer's routed experts as two 3-D parameters of one module (``gate_up_proj``
``[E, 2*I, H]``, ``down_proj`` ``[E, H, I]``), while the FP8 checkpoints people download (DeepSeek-V3/R1,
Qwen3-MoE-FP8, GLM-4.5-FP8) store every expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` as its own FP8 weight
with its own scales (``mlp.experts.<e>.gate_proj.weight``). :class:`PerExpertLinears` takes the experts module's
place with one :class:`ExpertMLP` (three ``nn.Linear``) per expert, named as the checkpoint names them, so each can
become an :class:`~fp8_backends.layers.Fp8Linear` (gate/up fused into one GEMM where their blocks allow) like any
other linear of the model.

Two forwards:

- **Grouped** (where the experts stack): :meth:`PerExpertLinears.stack_weights` (run by
  :func:`fp8_backends.layers.process_weights_after_loading` and the checkpoint loaders, before the linears are
  processed) copies every expert's FP8 gate/up and down weights into one ``[E, 2*I, H]`` and one ``[E, H, I]``
  tensor (with ``[E, ., .]`` block scales, or ``[E, 2*I]`` / ``[E, H]`` scales one per output row for per-channel and
  per-tensor experts) and makes each expert's linears views of them (no second copy; after processing, scales it
  replaced go back into the stack's rows).
  Both projections then run on the grouped-experts kernels of the first provider that supplies them
  (``ProviderBase.experts_kernels``; the built-in ``triton`` provider's): up to :data:`GROUPED_MAX_PAIRS`
  (token, slot) pairs (decode) an experts GEMV, each pair's row against its own expert's weight with the activation
  quantized per group of 128 inside the launch; more pairs (prefill) a tiled experts GEMM, pairs sorted by expert on
  the device into tensor-core tiles of one expert each. Nothing is read on the host: CUDA-graph capturable, one
  graph under ``torch.compile``. Stacking needs every expert's linears e4m3 in one scheme, block-scaled (128x128,
  activation groups of 128, gate/up in whole blocks: ``I % 128 == 0``) or per-channel / per-tensor (any activation
  scheme: the grouped paths quantize activations dynamically per group of 128, finer than per token or per tensor),
  without biases, of one shape, a provider with grouped kernels for the device (for per-row scales, kernels whose
  ``row_scales`` is True), and the linears' provider left to ``auto`` (an explicit provider choice is honoured by
  the loop); where it cannot, :attr:`PerExpertLinears.grouped_reason` says why.
- **The per-expert loop** otherwise, the one ``transformers``' "eager" experts implementation runs: for every expert
  some token was routed to, ``down(gate(cat(gate_proj(x), up_proj(x)))) * routing weight``, summed into the tokens'
  rows. Which experts were hit is read on the host (one sync per MoE layer and step), so the loop is not CUDA-graph
  capturable and breaks a ``torch.compile`` graph.

Both gate with the replaced module's own ``_apply_gate`` (default: ``act(gate) * up``).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn

from ..core.backend import on_provider_refresh
from ..core.errors import InvalidInputError

logger = logging.getLogger("fp8_backends")

#: the most (token, slot) pairs a call serves with the experts GEMV (each pair's row against its expert's weight);
#: more go through the tiled experts GEMM (tensor cores, pairs sorted by expert)
GROUPED_MAX_PAIRS = 64

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


class StackedExperts(NamedTuple):
    """Every expert's FP8 weights in one tensor per projection (:meth:`PerExpertLinears.stack_weights`), scales
    below as block scales (per-row scales: ``[E, 2*I]`` and ``[E, H]``):
    ``gate_up`` ``[E, 2*I, H]`` float8 with ``gate_up_scale`` ``[E, 2*I/128, ceil(H/128)]`` fp32, ``down``
    ``[E, H, I]`` with ``down_scale`` ``[E, ceil(H/128), ceil(I/128)]``."""

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor

    def holds(self, lin: Any) -> bool:
        """Whether ``lin``'s weight and scales are views of this stack."""
        return ((lin.weight._base is self.gate_up and lin.weight_scale._base is self.gate_up_scale)
                or (lin.weight._base is self.down and lin.weight_scale._base is self.down_scale))


_kernels: dict[str, tuple[Any, str]] = {}  # device type -> (ExpertsKernels or None, why none)
on_provider_refresh(_kernels.clear)  # a plugin installed and discovered anew may supply them


def experts_kernels(device_type: str) -> tuple[Any, str]:
    """``(kernels, reason)``: the :class:`~fp8_backends.core.backend.ExpertsKernels` of the first usable provider
    that declares ``device_type`` in its ``experts_devices`` and answers (``auto``'s order: priority, built-ins
    first), or ``(None, why none does)``. Asked once per device type (at load time: stacking) until the registry's
    ``refresh``."""
    got = _kernels.get(device_type)
    if got is not None:
        return got
    from fp8_backends.core.errors import BackendUnavailableError
    from fp8_backends.registry import candidates, discovery

    entries = [e for e in discovery.discover("gemm")
               if e.cls is not None and device_type in getattr(e.cls, "experts_devices", ())]
    entries.sort(key=candidates.rank_key)
    reasons = []
    for entry in entries:
        why = entry.unusable_reason()
        if why is None:
            try:
                kernels = entry.cls.experts_kernels(device_type)
            except BackendUnavailableError as exc:
                why = str(exc)
            except Exception as exc:  # a broken kernel install must not break loading: the loop serves
                logger.warning("MoE experts: %s's grouped kernels are unusable on %s (%s: %s)", entry.name,
                               device_type, type(exc).__name__, exc)
                why = f"raised {type(exc).__name__}: {exc}"
            else:
                if kernels is not None:
                    got = _kernels[device_type] = (kernels, "")
                    return got
                continue
        reasons.append(f"{entry.name}: {why}")
    got = _kernels[device_type] = (None, "no provider supplies grouped-experts kernels for "
                                   f"{device_type} tensors" + (f" ({'; '.join(reasons)})" if reasons else ""))
    return got


class _ExpertsNoBackward(torch.autograd.Function):
    """Identity on the grouped output; a backward reaching it raises (as :class:`~.modules.NoBackward` does for the
    linears): the grouped kernels define no gradient, for the hidden states or the routing weights."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise InvalidInputError("FP8 layers have no backward: run them under torch.no_grad() or "
                                "torch.inference_mode() (inference only)")


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
        #: the stacked weights of the grouped paths (None: per-expert loop only; :attr:`grouped_reason` says why)
        self.stacked: StackedExperts | None = None
        self.grouped_reason: str | None = "not stacked yet (process_weights_after_loading)"
        #: the most (token, slot) pairs a call serves with the experts GEMV (more: the tiled experts GEMM)
        self.grouped_max_pairs = GROUPED_MAX_PAIRS
        #: the grouped paths: None (default) where they can run on a GPU, True also on the CPU under Triton's
        #: interpreter (tests; takes effect at the next :meth:`stack_weights`), False never (the per-expert loop at
        #: once; the stack is dropped at the next :meth:`stack_weights`)
        self.grouped: bool | None = None

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

    # ------------------------------------------------------------------------------ stacking
    def _sources(self) -> tuple[list[tuple[Any, ...]], str | None]:
        """Per expert ``(gate_up_parts, down)``: the Fp8Linear(s) holding its gate and up rows (one fused layer, or
        gate and up) and its down layer; or a reason the experts cannot be stacked."""
        from .modules import Fp8Linear
        from .shared_input import Fp8LinearSlice

        out = []
        for e in range(self.num_experts):
            ex = self.expert(e)
            gate, up, down = ex.gate_proj, ex.up_proj, ex.down_proj
            if (isinstance(gate, Fp8LinearSlice) and isinstance(up, Fp8LinearSlice) and gate.group is up.group
                    and gate.index == 0 and up.index == 1 and len(gate.group.sizes) == 2):
                parts = (gate.group.layer,)
            elif isinstance(gate, Fp8Linear) and isinstance(up, Fp8Linear):
                parts = (gate, up)
            else:
                return [], f"expert {e}'s gate_proj / up_proj are not FP8 linears ({type(gate).__name__})"
            if not isinstance(down, Fp8Linear):
                return [], f"expert {e}'s down_proj is not an FP8 linear ({type(down).__name__})"
            out.append((parts, down))
        return out, None

    def _stack_problem(self, sources: list[tuple[Any, ...]]) -> str | None:
        from ..core.types import ActScale
        from .modules import _requests_auto

        h, i = self.hidden_dim, self.intermediate_dim
        if self.grouped is False:
            return "switched off (grouped=False)"
        block = _block_scaled(sources[0][1])
        if block and i % 128:
            return f"the intermediate size {i} is not a multiple of 128 (gate and up in whole blocks)"
        first = sources[0][1].weight
        for e, (parts, down) in enumerate(sources):
            for lin, rows, cols in [(p, 2 * i // len(parts), h) for p in parts] + [(down, h, i)]:
                if lin.weight_block is not None and not _block_scaled(lin):
                    return (f"expert {e}'s weights are block-scaled with {lin.weight_block[0]}x{lin.weight_block[1]} "
                            f"blocks and activation groups of {lin.group_size}, not 128x128 and 128")
                if _block_scaled(lin) != block:
                    return "the experts mix block-scaled and per-tensor / per-channel linears"
                if block and lin.act_scale is not ActScale.PER_TOKEN_GROUP:
                    return f"expert {e} is block-scaled without activation groups of 128"
                if (lin.out_features, lin.in_features) != (rows, cols) or lin.bias is not None:
                    return f"expert {e}'s linears are not [{rows}, {cols}] without bias"
                if lin.weight.dtype != torch.float8_e4m3fn or lin.input_dtype.torch_dtype() != torch.float8_e4m3fn:
                    return f"expert {e}'s weights or inputs are not float8_e4m3fn"
                if lin.weight.device != first.device:
                    return "the experts' weights are on several devices"
                if not _requests_auto("gemm", lin.backend_request):
                    return f"an explicit GEMM provider was asked for ({lin.backend_request!r}): the loop honours it"
        if first.device.type == "cpu" and self.grouped is not True:
            return "CPU tensors (grouped kernels on the CPU, e.g. under Triton's interpreter, only when asked: " \
                   "grouped=True)"
        kernels, why = experts_kernels(first.device.type)
        if kernels is not None and not block and not getattr(kernels, "row_scales", False):
            return f"the grouped-experts kernels ({type(kernels).__name__}) take 128x128 block scales only"
        return why or None

    def stack_weights(self) -> bool:
        """Stack every expert's FP8 weights for the grouped paths (module docstring); True when stacked, else
        :attr:`grouped_reason` says why not. Load time: copies the weights once (peak: one more copy of this
        layer's experts), makes every expert's linears views of the stack and leaves them unprocessed where they
        were (a processed linear whose weight moved into the stack is processed again)."""
        sources, why = self._sources()
        why = why or self._stack_problem(sources)
        if why is not None:
            self.stacked, self.grouped_reason = None, why
            return False
        stacked = self.stacked
        everyone = [lin for parts, down in sources for lin in (*parts, down)]
        if stacked is not None and all(stacked.holds(lin) for lin in everyone):
            return True  # every weight and scale already a view of the current stack
        if (stacked is not None and stacked.gate_up_scale.dim() == 2
                and all(lin.weight._base is stacked.gate_up or lin.weight._base is stacked.down for lin in everyone)):
            # per-row scales: processing replaced some linears' scales (shards' equal scales reduced to one, or
            # requantized to their max in place, in the stack's rows): take the new values over, no copy of weights
            for lin, _rows, scale_rows in self._places(sources, stacked):
                if lin.weight_scale._base is not scale_rows._base:
                    _take_scale(lin, scale_rows)
            return True
        h, i, e_count = self.hidden_dim, self.intermediate_dim, self.num_experts
        dev = sources[0][1].weight.device
        gate_up = torch.empty((e_count, 2 * i, h), dtype=torch.float8_e4m3fn, device=dev)
        down = torch.empty((e_count, h, i), dtype=torch.float8_e4m3fn, device=dev)
        if _block_scaled(sources[0][1]):
            gate_up_scale = torch.empty((e_count, 2 * i // 128, -(-h // 128)), dtype=torch.float32, device=dev)
            down_scale = torch.empty((e_count, -(-h // 128), i // 128), dtype=torch.float32, device=dev)
        else:  # one scale per output row (per-tensor scales repeated over their rows)
            gate_up_scale = torch.empty((e_count, 2 * i), dtype=torch.float32, device=dev)
            down_scale = torch.empty((e_count, h), dtype=torch.float32, device=dev)
        new = StackedExperts(gate_up, gate_up_scale, down, down_scale)
        for lin, weight_rows, scale_rows in self._places(sources, new):
            _move_into(lin, weight_rows, scale_rows)
        self.stacked = new
        self.grouped_reason = None
        logger.debug("MoE experts %d x [%d, %d] stacked for the grouped paths", e_count, i, h)
        return True

    def _places(self, sources: list[tuple[Any, ...]], stack: StackedExperts) -> list[tuple[Any, Any, Any]]:
        """``(linear, its weight rows in the stack, its scale rows)`` for every expert linear (block scales: the rows
        of 128-row blocks)."""
        i = self.intermediate_dim
        per = 128 if stack.gate_up_scale.dim() == 3 else 1
        out = []
        for e, (parts, down_lin) in enumerate(sources):
            rows = 2 * i // len(parts)
            for j, lin in enumerate(parts):
                out.append((lin, stack.gate_up[e, j * rows:(j + 1) * rows],
                            stack.gate_up_scale[e, j * rows // per:(j + 1) * rows // per]))
            out.append((down_lin, stack.down[e], stack.down_scale[e]))
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> PerExpertLinears:
        """A move (``.to()``, ``.cuda()``) moves the stack once and makes the expert linears views of the moved stack
        before their own moves (then no-ops); processed linears are processed again on their new tensors. Linears
        that were not views of the stack are stacked anew (or the stack dropped, with the reason, where the new
        device cannot serve it)."""
        from .modules import _keeping_dtype

        stacked, moved = self.stacked, []
        if stacked is not None:
            new = StackedExperts(*(_keeping_dtype(fn)(t) for t in stacked))
            if any(a is not b for a, b in zip(stacked, new)):
                # the linears become views of the moved stack first: their own moves are then no-ops
                for parts, down in self._sources()[0]:
                    for lin in (*parts, down):
                        if stacked.holds(lin):
                            moved.append((lin, lin.kernel is not None))
                            _point_at(lin, stacked, new)
                self.stacked = new
        super()._apply(fn, recurse)
        for lin, processed in moved:  # their prepared weights held the old tensors
            lin.kernel = lin._plan = lin._traced = None
            if processed:
                lin.process_weights_after_loading()
        if stacked is not None:
            self.stack_weights()  # a no-op where every linear is a view of the stack, else it copies anew
        return self

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any) -> None:
        # the linears below take new tensors (or new values): the stack is rebuilt when they are processed again
        self.stacked = None
        self.grouped_reason = "not stacked since the last state-dict load (process_weights_after_loading)"
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ------------------------------------------------------------------------------ forward
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        stacked = self.stacked
        if stacked is not None and self.grouped is not False:
            if top_k_index.numel() == 0:
                return torch.zeros_like(hidden_states)
            y = self._grouped(stacked, hidden_states, top_k_index, top_k_weights)
            if torch.is_grad_enabled() and (hidden_states.requires_grad or top_k_weights.requires_grad):
                y = _ExpertsNoBackward.apply(y, hidden_states, top_k_weights)
            return y
        if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
            raise InvalidInputError("MoE experts served per expert read which experts were hit on the host: they "
                                    "cannot be captured in a CUDA graph (run the model eagerly or compiled; the "
                                    f"grouped experts paths that can are off: {self.grouped_reason})")
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

    def _grouped(self, stacked: StackedExperts, x: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """Both projections through the provider's grouped-experts kernels (one plan for both); the slots summed in
        fp32."""
        k = top_k_index.shape[-1]
        ids = top_k_index.contiguous().view(-1)
        rw = top_k_weights.contiguous().view(-1).float()
        kernels = (_kernels.get(x.device.type) or experts_kernels(x.device.type))[0]
        plan = kernels.plan(ids, self.num_experts, self.grouped_max_pairs)
        gate_up = kernels.matmul(x, stacked.gate_up, stacked.gate_up_scale, ids, None, k, x.dtype, plan)
        y = kernels.matmul(self._gate(gate_up), stacked.down, stacked.down_scale, ids, rw, 1, torch.float32, plan)
        return y.view(x.shape[0], k, self.hidden_dim).sum(dim=1).to(x.dtype)

    def extra_repr(self) -> str:
        grouped = "stacked" if self.stacked is not None else f"off ({self.grouped_reason})"
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}, "
                f"grouped: {grouped}")


def _block_scaled(lin: Any) -> bool:
    return lin.weight_block == (128, 128) and lin.group_size == 128


def _put(lin: Any, attr: str, value: torch.Tensor) -> None:
    """Make ``value`` ``lin``'s buffer ``attr`` without the layer's own assignment rule (an assigned weight or scale
    makes a processed layer unprocessed): the stack's views hold the same values, and the callers decide whether
    the layer is processed again."""
    lin._buffers[attr] = value


def _take_scale(lin: Any, scale: torch.Tensor) -> None:
    """Copy ``lin``'s weight scales into the stack's view ``scale`` and make that view its buffer: block scales as
    they are; per-tensor or per-row scales (one value, or one per row) written over the linear's rows, the linear
    keeping its own shape (one value: a view of its first row's)."""
    own = lin.weight_scale
    if scale.dim() == 2:
        scale.copy_(own)
        _put(lin, "weight_scale", scale)
        return
    scale.copy_(own.reshape(-1).expand(scale.shape[0]) if own.numel() == 1 else own.reshape(-1))
    _put(lin, "weight_scale", scale[:1] if own.numel() == 1 else scale.view(own.shape))


def _move_into(lin: Any, weight: torch.Tensor, scale: torch.Tensor) -> None:
    """Copy ``lin``'s weight and scales into the stack's views ``weight`` / ``scale`` (:func:`_take_scale`) and make
    those its buffers (processed again when it had been: its prepared weight held the old tensor)."""
    weight.copy_(lin.weight)
    _take_scale(lin, scale)
    _put(lin, "weight", weight)
    if lin.kernel is not None:
        lin.kernel = lin._plan = lin._traced = None
        lin.process_weights_after_loading()


def _point_at(lin: Any, old: StackedExperts, new: StackedExperts) -> None:
    """Make ``lin``'s weight and scales the views of ``new`` at the places they have in ``old``."""
    for attr in ("weight", "weight_scale"):
        t = getattr(lin, attr)
        index = next(i for i, b in enumerate(old) if t._base is b)
        _put(lin, attr, new[index].as_strided(t.size(), t.stride(), t.storage_offset()))


def stack_expert_weights(model: nn.Module) -> list[str]:
    """:meth:`PerExpertLinears.stack_weights` for every MoE layer of ``model`` served per expert; returns the
    reasons of those that were not stacked (``"<name>: <reason>"``)."""
    return [f"{name}: {m.grouped_reason}" for name, m in model.named_modules()
            if isinstance(m, PerExpertLinears) and not m.stack_weights()]


__all__ = ["GROUPED_MAX_PAIRS", "SERVED_LAYOUT", "ExpertMLP", "PerExpertLinears", "StackedExperts",
           "experts_kernels", "fused_experts_layout", "stack_expert_weights", "unserved_layout"]
