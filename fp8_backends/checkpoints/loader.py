"""Load a quantized checkpoint's linears into :class:`~fp8_backends.layers.Fp8Linear` layers, in vLLM's three steps.

:class:`Fp8CheckpointLoader` is what an engine calls (and what :func:`~fp8_backends.checkpoints.load_pretrained`,
:func:`~fp8_backends.checkpoints.load_fp8_state_dict` and :func:`~fp8_backends.checkpoints.swap_fp8_layers` call):

1. ``create_weights(model)``: every planned linear becomes an unloaded ``Fp8Linear`` on the target device (fused
   siblings one ``Fp8Linear`` with ``shard_sizes``, each sibling an :class:`~fp8_backends.shared_input.Fp8LinearSlice`
   of it), put in the model in place of the ``nn.Linear``;
2. ``weight_loader(name, tensor)`` for each checkpoint tensor, in any order: scales (converted to fp32, values checked:
   finite and > 0) and biases wait for their weight; a weight is loaded with the layer's own ``load_weights`` /
   ``load_shard`` as soon as its scales are there (its scales fed first, nothing waits: what ``load_pretrained``
   does). Returns False for a tensor that is not a planned linear's (the caller loads it elsewhere);
3. ``process_weights_after_loading()``: checks that every planned tensor came, processes every layer (providers
   resolved once, weights prepared; fused shards' per-tensor scales kept per channel where the provider can, else
   requantized to the largest: the layer's ``shard_scales`` policy) and returns the :class:`CheckpointSummary`.

The checkpoint's weights and scales are used as stored: nothing is requantized except fused per-tensor shards whose
provider takes one per-tensor scale, and the summary names those groups.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..core.errors import CheckpointError, InvalidInputError
from .plan import FusedPlan, LinearPlan, LoadPlan
from .summary import CheckpointSummary, ServedLinear

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger("fp8_backends")

#: safetensors dtype code of each torch dtype a state dict may hold
TORCH_DTYPE_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                     "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                     "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0"}


def dtype_code(t: torch.Tensor) -> str:
    """The safetensors dtype code of ``t`` (``"BF16"``, ``"F8_E4M3"``, ...)."""
    return TORCH_DTYPE_CODES.get(str(t.dtype).removeprefix("torch."), str(t.dtype))


def block_layer_served() -> bool:
    """Whether this library's ``Fp8Linear`` serves block-scaled weights with per-token-group activations."""
    from fp8_backends.layers import Fp8Linear

    try:
        layer = Fp8Linear(256, 256, weight_scale="block", act_scale="per_token_group", device="meta")
    except (InvalidInputError, ValueError, TypeError):
        return False
    return tuple(layer.weight_scale.shape) == (2, 2)


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at ``name`` in ``model``."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


class Fp8CheckpointLoader:
    """The three loading steps over a :class:`~fp8_backends.checkpoints.plan.LoadPlan` (module docstring).

    Args:
        plan: from :func:`~fp8_backends.checkpoints.plan.plan_linears`.
        dtype: the model dtype (what the layers take and return; biases are converted to it).
        device: where the layers' tensors live.
        backend: the GEMM provider request of every layer (as :class:`~fp8_backends.layers.Fp8Linear` takes it).
        objective: the selection objective of every layer (as :class:`~fp8_backends.layers.Fp8Linear` takes it).
        shard_scales: how fused siblings with per-tensor weight scales are combined (``"auto"``: per channel where
            the provider can, else requantized to the largest; ``"per_channel"``; ``"requantize"``). Per-channel
            checkpoints are always kept per channel.
    """

    def __init__(self, plan: LoadPlan, *, dtype: Any, device: Any, backend: Any = None, objective: Any = None,
                 shard_scales: str = "auto") -> None:
        self.plan = plan
        self.dtype = dtype
        self.device = device
        self.backend = backend
        self.objective = objective
        self.shard_scales = shard_scales
        self.layers: dict[str, Any] = {}  # linear or fused-group name -> its Fp8Linear
        self._pending: dict[str, dict[str, Any]] = {}  # linear name -> role -> tensor (converted)
        self._loaded: set[str] = set()  # linear names whose weight is in its layer
        self._biases: dict[str, dict[int, Any]] = {}  # fused group name -> member index -> bias
        self._shard_scales: dict[str, list[float]] = {}  # fused group name -> its members' per-tensor weight scales
        self._input_scales: dict[str, list[float]] = {}  # fused group name -> its members' static input scales
        self._seen: set[str] = set()
        self._created = False
        self._experts: list[Any] = []  # the model's PerExpertLinears (stacked before the layers are processed)
        self.experts_notes: list[str] = []  # MoE layers not stacked for the grouped experts paths, and why

    # ---------------------------------------------------------------------------------------- 1. create_weights
    def create_weights(self, model: nn.Module) -> None:
        """Replace every planned linear of ``model`` by an unloaded ``Fp8Linear`` (or a slice of a fused one)."""
        from fp8_backends.layers import Fp8Linear
        from fp8_backends.layers.shared_input import Fp8LinearSlice, SharedInputGroup

        for group in self.plan.fused:
            first = group.members[0]
            scheme = first.scheme
            policy = "per_channel" if scheme.weight == "channel" else self.shard_scales
            layer = Fp8Linear(first.k, sum(group.sizes), bias=first.bias is not None, act_scale=scheme.act_scale,
                              weight_scale=scheme.weight_scale, dtype=self.dtype, device=self.device,
                              backend=self.backend, objective=self.objective, shard_sizes=group.sizes,
                              shard_scales=policy, **_block_kwargs(scheme))
            self.layers[group.name] = layer
            shared = SharedInputGroup(group.sizes, group.leaves)
            slices = [Fp8LinearSlice(shared, 0, fused=layer)] + [Fp8LinearSlice(shared, i)
                                                                 for i in range(1, len(group.members))]
            for member, piece in zip(group.members, slices):
                set_module(model, member.name, piece)
        for lin in self.plan.linears.values():
            if lin.group is not None:
                continue
            layer = Fp8Linear(lin.k, lin.n, bias=lin.bias is not None, act_scale=lin.scheme.act_scale,
                              weight_scale=lin.scheme.weight_scale, dtype=self.dtype, device=self.device,
                              backend=self.backend, objective=self.objective, **_block_kwargs(lin.scheme))
            self.layers[lin.name] = layer
            set_module(model, lin.name, layer)
        from fp8_backends.layers.experts import PerExpertLinears

        self._experts = [(name, m) for name, m in model.named_modules() if isinstance(m, PerExpertLinears)]
        self._created = True
        for name in list(self._pending):  # weights that came before the layers existed
            self._try_load(self.plan.linears[name])

    # ---------------------------------------------------------------------------------------- 2. weight_loader
    def weight_loader(self, name: str, tensor: torch.Tensor) -> bool:
        """Take one checkpoint tensor (module docstring); False when no planned linear loads it."""
        route = self.plan.routes.get(name)
        if route is None:
            return name in self.plan.ignored
        lin, role = route
        meta = dict(lin.tensors())[role]
        if tuple(tensor.shape) != meta.shape:
            raise CheckpointError(f"shape {list(tensor.shape)}, its header said {list(meta.shape)}", tensor=name,
                                  file=meta.file)
        if role in ("weight_scale", "input_scale"):
            tensor = _scale(tensor, name, meta.file)
        self._seen.add(name)
        self._pending.setdefault(lin.name, {})[role] = tensor
        if self._created:
            self._try_load(lin)
        return True

    def _try_load(self, lin: LinearPlan) -> None:
        got = self._pending.get(lin.name, {})
        group = lin.group
        if "bias" in got and group is not None:
            self._biases.setdefault(group.name, {})[lin.index] = got.pop("bias")
            self._load_group_bias(group)
        elif "bias" in got and lin.name in self._loaded:
            self.layers[lin.name].load_bias(got.pop("bias"))
        if lin.name in self._loaded or "weight" not in got or "weight_scale" not in got:
            return
        if lin.input_scale is not None and "input_scale" not in got:
            return
        w, s, x_s = got.pop("weight"), got.pop("weight_scale"), got.pop("input_scale", None)
        if lin.scheme.weight == "channel":
            s = s.reshape(-1)
        elif lin.scheme.weight == "tensor":
            s = s.reshape(1)
        if group is None:
            self.layers[lin.name].load_weights(w, s, input_scale=x_s, bias=got.pop("bias", None))
        else:
            self.layers[group.name].load_shard(lin.index, w, s, input_scale=x_s)
            if lin.scheme.weight == "tensor":
                self._shard_scales.setdefault(group.name, [0.0] * len(group.members))[lin.index] = float(s)
            if x_s is not None:
                self._input_scales.setdefault(group.name, [0.0] * len(group.members))[lin.index] = float(x_s)
        self._loaded.add(lin.name)
        if not got:
            self._pending.pop(lin.name, None)

    def _load_group_bias(self, group: FusedPlan) -> None:
        import torch

        got = self._biases.get(group.name, {})
        if len(got) == len(group.members):
            self.layers[group.name].load_bias(torch.cat([got[i].to(self.dtype) for i in range(len(group.members))]))
            del self._biases[group.name]

    # ---------------------------------------------------------------------------------------- 3. processing
    def process_weights_after_loading(self) -> CheckpointSummary:
        """Check that every planned tensor was loaded, process every layer, and say what was done."""
        if not self._created:
            raise InvalidInputError("call create_weights(model) before process_weights_after_loading()")
        for lin in self.plan.linears.values():
            for _, meta in lin.tensors():
                if meta.name not in self._seen:
                    raise CheckpointError("never given to weight_loader (missing from the checkpoint?)",
                                          tensor=meta.key, file=meta.file)
        # MoE experts go into their stacks first: the linears are then processed once, on their final tensors
        self.experts_notes = [f"{name}: {m.grouped_reason}" for name, m in self._experts if not m.stack_weights()]
        for layer in self.layers.values():
            layer.process_weights_after_loading()
        for _, m in self._experts:  # scales processing replaced (per-tensor / per-channel experts) back into the stack
            if m.stacked is not None:
                m.stack_weights()
        return self.summary()

    def summary(self) -> CheckpointSummary:
        """The :class:`CheckpointSummary` of what was loaded so far (the layers' providers once processed)."""
        from fp8_backends.core.types import WeightScale

        fmt = self.plan.fmt
        out = CheckpointSummary(format=fmt.description, source=fmt.source, kept=list(self.plan.kept),
                                not_fused=list(self.plan.not_fused), ignored=list(self.plan.ignored),
                                notes=list(fmt.notes) + _grouped_off(self.experts_notes))
        for lin in self.plan.linears.values():
            layer = self.layers.get(lin.group.name if lin.group is not None else lin.name)
            backends = layer.backends_text if layer is not None else "(not created)"
            fused_with = "+".join(lin.group.leaves) if lin.group is not None else ""
            out.served.append(ServedLinear(lin.name, lin.n, lin.k, lin.scheme.describe(), backends, fused_with))
            out.fp8_bytes += sum(meta.nbytes for _, meta in lin.tensors())
            if layer is not None and out.objective == "" and layer.objective is not None:
                out.objective = layer.objective.value
        for group in self.plan.fused:
            layer = self.layers.get(group.name)
            out.fused.append((group.name, f"{sum(group.sizes)}x{group.members[0].k}"))
            scales = self._shard_scales.get(group.name)
            if (layer is not None and layer.is_processed and scales and len(set(scales)) > 1
                    and layer.weight_scale_mode is WeightScale.PER_TENSOR):
                out.requantized.append((group.name, "shard weight scales " + "/".join(f"{s:.4g}" for s in scales)
                                        + f" -> {max(scales):.4g} ({layer.backends_text} takes one per-tensor scale)"))
            inputs = self._input_scales.get(group.name)
            if inputs and len(set(inputs)) > 1:
                out.merged_input_scales.append((group.name, "/".join(f"{s:.4g}" for s in inputs)
                                                + f" -> {max(inputs):.4g}"))
        return out


def _grouped_off(notes: list[str]) -> list[str]:
    """The summary's lines for MoE layers left without the grouped experts paths: one per reason."""
    by_reason: dict[str, list[str]] = {}
    for note in notes:
        name, _, reason = note.partition(": ")
        by_reason.setdefault(reason, []).append(name)
    return [f"{len(names)} MoE layer(s) without the grouped experts paths (they run the per-expert loop: a host "
            f"sync per layer, no CUDA-graph capture): {reason} ({names[0]}{', ...' if len(names) > 1 else ''})"
            for reason, names in by_reason.items()]


def _scale(tensor: torch.Tensor, name: str, file: str) -> torch.Tensor:
    """A checkpoint scale as fp32 (bf16/fp16/e8m0 converted), its values checked: finite and > 0."""
    import torch

    s = tensor.detach().to(torch.float32)
    bad = ~(torch.isfinite(s) & (s > 0))
    if bool(bad.any()):
        sample = s[bad].flatten()[:4].tolist()
        raise CheckpointError(f"scales must be finite and > 0; got {sample}", tensor=name, file=file)
    return s.contiguous()


def _block_kwargs(scheme: Any) -> dict[str, Any]:
    """The ``Fp8Linear`` arguments of a block scheme beyond its modes (none for the others)."""
    if scheme.weight != "block":
        return {}
    import inspect

    from fp8_backends.layers import Fp8Linear

    params = inspect.signature(Fp8Linear.__init__).parameters
    out: dict[str, Any] = {}
    if "weight_block" in params:
        out["weight_block"] = tuple(scheme.block)
    if "group_size" in params:
        out["group_size"] = scheme.group_size
    return out


def load_fp8_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor],
                        quantization_config: Mapping[str, Any], *, hf_quant_config: Mapping[str, Any] | None = None,
                        backend: Any = None,
                        device: Any = None, dtype: Any = None, fuse: Any = True, shard_scales: str = "auto",
                        objective: Any = None, strict: bool = True) -> CheckpointSummary:
    """Load a quantized checkpoint held in memory into ``model`` in place; return the summary.

    ``model``: a module whose linears are ``nn.Linear`` (on any device, the meta device included: nothing of theirs
    is read); ``state_dict``: the checkpoint's tensors by name (FP8 weights, their scales, everything else);
    ``quantization_config``: ``config.json``'s ``quantization_config`` (or the whole ``config.json``), with
    ModelOpt's ``hf_quant_config`` where the checkpoint has one. ``device``: where the model ends up (default: where
    the state dict's first tensor is); ``dtype``: the model dtype (default: bf16). ``strict``: every parameter of
    the model must come from ``state_dict``. Every other argument as :func:`~fp8_backends.checkpoints.load_pretrained`
    takes it. Problems raise :class:`~fp8_backends.core.errors.CheckpointError` before the model is changed."""
    import torch

    from .detect import detect_format
    from .experts import expand_experts
    from .names import model_names
    from .params import assign_params, linear_infos, plan_params
    from .plan import plan_linears
    from .shards import ShardIndex, TensorMeta

    fmt = detect_format(quantization_config, hf_quant_config, source="quantization_config",
                        quant_source="hf_quant_config")
    dtype = torch.bfloat16 if dtype is None else dtype
    first = next(iter(state_dict.values()), None)
    device = torch.device(device if device is not None else (first.device if first is not None else "cpu"))
    check_backend(backend, device)
    index = ShardIndex({name: TensorMeta(name, dtype_code(t), tuple(t.shape), "<state dict>")
                        for name, t in state_dict.items()})
    index, name_notes = model_names(model, index)  # a family's stored names read under the model's
    metas = index.tensors
    expert_notes, undo_experts = expand_experts(model, metas, strict=strict, where="<state dict>")
    try:  # every check before the model changes; a failure puts the experts modules back
        plan = plan_linears(fmt, linear_infos(model), metas, fuse_groups=fuse_patterns(fuse),
                            block_served=block_layer_served(), where="<state dict>")
        targets = plan_params(model, plan, metas, strict=strict, where="<state dict>")
        loader = Fp8CheckpointLoader(plan, dtype=dtype, device=device, backend=backend, objective=objective,
                                     shard_scales=shard_scales)
        for meta in plan.small_tensors():
            loader.weight_loader(meta.name, state_dict[meta.key])
    except BaseException:
        undo_experts()
        raise
    loader.create_weights(model)
    for name, meta in metas.items():
        tensor = state_dict[meta.key]
        if name in targets:
            assign_params(targets[name], tensor, device)
        elif not loader.weight_loader(name, tensor):
            plan.ignored.append(name)
    model.to(device)
    summary = loader.process_weights_after_loading()
    summary.notes += name_notes + expert_notes
    summary.checkpoint_bytes = sum(meta.nbytes for meta in metas.values())
    return summary


def check_backend(backend: Any, device: Any) -> None:
    """An explicit GEMM backend for the layers (``backend``, or ``FP8_GEMM_BACKEND`` when it is None): known, usable
    here and serving ``device``'s tensors, checked before the model is changed (the library error otherwise). What each
    layer's problem adds (shapes, scale modes) is checked when the layers are processed."""
    from fp8_backends.core.backend import Fp8GemmBackend
    from fp8_backends.core.errors import UnsupportedProblemError
    from fp8_backends.registry.resolution import requests_auto, resolve_gemm_backend

    if requests_auto("gemm", backend):
        return
    provider = backend if isinstance(backend, Fp8GemmBackend) else resolve_gemm_backend(backend)
    served = ", ".join(sorted(d.value for d in provider.capabilities.devices))
    if device.type not in served.split(", "):
        raise UnsupportedProblemError(f"GEMM backend {provider.label!r} cannot serve the layers on {device}: it runs "
                                      f"on {served} tensors", [f"runs on {served} tensors only"])


def fuse_patterns(fuse: Any) -> tuple[tuple[str, ...], ...]:
    """``fuse`` as leaf-name groups: True -> :data:`fp8_backends.convert.DEFAULT_FUSE_GROUPS` (q/k/v, gate/up, ...),
    False or None -> none, else the groups given (each >= 2 distinct leaf names)."""
    from fp8_backends.convert import DEFAULT_FUSE_GROUPS

    if fuse is True:
        return DEFAULT_FUSE_GROUPS
    if fuse is False or fuse is None:
        return ()
    try:
        groups = tuple(tuple(g) for g in fuse)
    except TypeError:
        raise InvalidInputError(f"fuse must be a bool or a sequence of leaf-name groups, got {fuse!r}") from None
    for group in groups:
        if len(group) < 2 or len(set(group)) != len(group) or not all(isinstance(n, str) and n for n in group):
            raise InvalidInputError(f"each fuse group needs >= 2 distinct leaf names, got {group!r}")
    return groups


__all__ = [
    "Fp8CheckpointLoader", "block_layer_served", "check_backend", "dtype_code", "fuse_patterns", "load_fp8_state_dict",
    "set_module",
]
