"""``quantize_model``: swap the ``nn.Linear`` modules of a model for :class:`~fp8_backends.layers.Fp8Linear` in place.

Works on any ``nn.Module`` (a ``transformers`` model included) without model-specific code: it walks the module
tree, quantizes each eligible ``nn.Linear`` (``Fp8Linear.from_linear``: per-tensor or per-channel weight scales),
resolves its GEMM provider and prepares the weight once, and puts the new module where the old one was. The
model's own code keeps calling ``self.q_proj(x)``; ``generate()`` and ``torch.compile`` keep working.

What is skipped: modules matching ``skip`` (default: the output head ``lm_head`` and anything named like an
embedding), linears a filter rejects, and, with ``backend="auto"``, linears no provider can serve (the summary
says why, e.g. a K that is not a multiple of 16). MoE experts that ``transformers`` holds as 3-D parameters (not
``nn.Linear``) stay in the model dtype, and the summary lists them (FP8 checkpoints that store them one by one are
served per expert by :func:`~fp8_backends.checkpoints.load_pretrained`). A backend named explicitly that cannot
serve a layer raises, as everywhere in the library.

Static activation scales (``act_scale="per_tensor_static"``) come from ``input_scales`` (``{module name: float}``)
or from calibration: ``calibration`` batches are run through the unmodified model with a hook on every linear
to be swapped, which keeps the running ``amax(|x|)`` of its input on the device; the input scale is then
``max(amax / fmax, 1e-12)``, the scale dynamic quantization would have computed for the largest batch seen.

Siblings that read one input (``fuse``, on by default): the linears of one parent module named like one of
:data:`DEFAULT_FUSE_GROUPS` (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``, ...) with the same
``in_features``, dtype, device and bias presence become one :class:`~fp8_backends.layers.Fp8Linear` over their
concatenated weights, quantized as one weight (one per-tensor scale, or per-channel scales as asked), and each
sibling an :class:`~fp8_backends.layers.shared_input.Fp8LinearSlice` that returns its columns of the fused output: one
GEMM and one activation quantization where the model makes two or three calls (see
:mod:`fp8_backends.layers.shared_input` for
why results stay correct when siblings are called with different inputs). With calibration batches, a group whose
siblings did not receive the same tensors in every call is not fused. Static input scales of fused siblings: their
maximum.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .core.backend import Fp8GemmBackend
from .core.errors import InvalidInputError, InvalidTypeError, UnsupportedProblemError
from .core.objective import SelectionObjective
from .core.types import DEFAULT_WEIGHT_BLOCK, ActScale, Fp8Dtype, WeightScale
from .core.validation import blocks_straddle_shards
from .layers import Fp8Linear
from .layers.shared_input import Fp8LinearSlice, SharedInputGroup, version_of

logger = logging.getLogger("fp8_backends")

#: default ``skip`` patterns (fnmatch, on the full name or its last part): the output head, embedding-like modules,
#: and MoE routers and gates (``gate``, ``*router*``, ``*_gate``: Mixtral's / OLMoE's ``gate``, JetMoE's and DBRX's
#: ``router.layer``, Qwen2-MoE's ``shared_expert_gate``), whose expert choice stays in the model dtype as engines and
#: ``load_pretrained`` keep it (in FP8 a few percent of tokens pick other experts). A gated MLP's ``gate_proj`` is
#: quantized.
DEFAULT_SKIP: tuple[str, ...] = ("lm_head", "*embed*", "gate", "*router*", "*_gate")

#: default ``fuse`` groups: the leaf names of sibling linears that read one input in common model code (attention's
#: query / key / value, a gated MLP's gate and up projections, and multi-head latent attention's two down-projections
#: of DeepSeek-V2/V3, Kimi-K2 and their kin: ``q_a_proj`` 1536 x 7168 and ``kv_a_proj_with_mqa`` 576 x 7168 in
#: DeepSeek-V3, one 2112 x 7168 GEMM as engines run it)
DEFAULT_FUSE_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),
    ("wq", "wk", "wv"),
    ("w1", "w3"),
)


@dataclass
class SwappedLayer:
    """One ``nn.Linear`` replaced: its qualified name, ``N x K`` and the provider(s) it runs on."""

    name: str
    n: int
    k: int
    backends: str
    #: the siblings this layer runs fused with (``"q_proj+k_proj+v_proj"``), empty when it runs alone
    fused_with: str = ""


@dataclass
class QuantizeSummary:
    """What :func:`quantize_model` did. ``bytes_before``: weight (and bias) bytes of the swapped layers;
    ``bytes_after``: that less what the model holds fewer after the swap (storages counted once: a weight tied to a
    module kept unquantized stays held, so its layer's FP8 copy adds to the model)."""

    swapped: list[SwappedLayer] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    act_scale: str = ""
    weight_scale: str = ""
    #: the selection objective the layers' providers were chosen by (``kernel``, ``host`` or ``auto``)
    objective: str = ""
    #: each fused group: ``(parent module name, sibling leaf names, fused N x K)``
    fused: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)
    #: each group of siblings quantized one by one instead: ``(their names joined by "+", why)``
    not_fused: list[tuple[str, str]] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.swapped)

    @property
    def gemms(self) -> int:
        """GEMMs per forward of the swapped layers: one per fused group, one per other layer."""
        return self.count - sum(len(leaves) - 1 for _, leaves, _ in self.fused)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_before - self.bytes_after

    def providers(self) -> dict[str, int]:
        """``{provider label(s): number of layers}``."""
        return dict(Counter(layer.backends for layer in self.swapped))

    def __str__(self) -> str:
        objective = f", objective {self.objective}" if self.objective else ""
        lines = [f"quantize_model: {self.count} nn.Linear -> Fp8Linear ({self.act_scale} activations, "
                 f"{self.weight_scale} weights{objective}); weights {self.bytes_before / 2**20:.1f} MiB -> "
                 f"{self.bytes_after / 2**20:.1f} MiB (saved {self.bytes_saved / 2**20:.1f} MiB)"]
        for label, count in sorted(self.providers().items()):
            lines.append(f"  {count:4d} layer(s) on {label}")
        if self.fused:
            kinds = Counter(("+".join(leaves), shape) for _, leaves, shape in self.fused)
            lines.append(f"  {len(self.fused)} fused group(s), {self.gemms} GEMMs for {self.count} layers:")
            lines += [f"    {count:4d} x {leaves} -> one {shape} GEMM"
                      for (leaves, shape), count in sorted(kinds.items())]
        if self.not_fused:
            lines.append(f"  not fused {len(self.not_fused)}:")
            lines += [f"    {names}: {reason}" for names, reason in self.not_fused]
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)}:")
            lines += [f"    {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _matches(name: str, patterns: Sequence[str]) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(leaf, p) for p in patterns)


def module_aliases(model: nn.Module) -> dict[str, list[str]]:
    """``{first name: every name}`` of each module ``model`` registers under more than one name (a module reused in
    an ``nn.Sequential``, or assigned to two attributes)."""
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return {found[0]: found for found in names.values() if len(found) > 1}


def _targets(model: nn.Module, skip: Sequence[str], include: Callable[[str, nn.Linear], bool] | None,
             summary: QuantizeSummary, aliases: Mapping[str, list[str]]) -> list[tuple[str, nn.Linear]]:
    from .layers.experts import fused_experts_layout

    found = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:  # exactly nn.Linear: subclasses may change the forward
            layout = fused_experts_layout(module)
            if layout is not None:
                summary.skipped.append((name, f"MoE experts held as 3-D parameters ({layout[0]} experts), not "
                                              "nn.Linear: kept in the model dtype"))
            elif isinstance(module, nn.Linear):
                summary.skipped.append((name, f"{type(module).__name__} subclasses nn.Linear (its forward may differ)"))
            elif type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
                summary.skipped.append((name, "transformers Conv1D (a linear stored [in, out], GPT-2 style), not "
                                              "nn.Linear: kept in the model dtype"))
            continue
        names = aliases.get(name, [name])
        skipped_as = next((alias for alias in names if _matches(alias, skip)), None)
        if skipped_as is not None:
            summary.skipped.append((name, "matches skip" + (f" (as {skipped_as})" if skipped_as != name else "")))
        elif include is not None and not all(include(alias, module) for alias in names):
            summary.skipped.append((name, "rejected by include"))
        elif module.weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            summary.skipped.append((name, f"weight dtype {module.weight.dtype}"))
        elif module.in_features == 0 or module.out_features == 0:
            summary.skipped.append((name, f"zero-size weight [{module.out_features}, {module.in_features}]"))
        else:
            found.append((name, module))
    return found


def _run_batch(model: nn.Module, batch: Any) -> None:
    if isinstance(batch, Mapping):
        model(**batch)
    elif isinstance(batch, (tuple, list)):
        model(*batch)
    else:
        model(batch)


def calibrate_input_amax(model: nn.Module, modules: Mapping[str, nn.Module],
                         batches: Iterable[Any]) -> dict[str, float]:
    """Run ``batches`` through ``model`` (no grad) and return ``{name: amax(|input|)}`` of each module in ``modules``
    over every batch. A batch is passed as ``model(**batch)`` (a mapping), ``model(*batch)`` (a tuple or list) or
    ``model(batch)``. The running maxima stay on the device; one sync at the end."""
    return _calibrate(model, modules, batches)[0]


#: what identifies one input tensor during a calibration run: storage address, shape, strides, version counter
_Fingerprint = tuple[int, tuple[int, ...], tuple[int, ...], int]


def _calibrate(model: nn.Module, modules: Mapping[str, nn.Module], batches: Iterable[Any]
               ) -> tuple[dict[str, float], dict[str, list[_Fingerprint]]]:
    """:func:`calibrate_input_amax`, and the fingerprint of every input each module received, in call order (which
    siblings share their input)."""
    amax: dict[str, torch.Tensor] = {}
    inputs: dict[str, list[_Fingerprint]] = {name: [] for name in modules}

    def hook(name: str) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor):
                inputs[name].append((x.data_ptr(), tuple(x.shape), tuple(x.stride()), version_of(x)))
                if x.numel():
                    value = x.detach().abs().amax().float()
                    amax[name] = value if name not in amax else torch.maximum(amax[name], value)
        return record

    handles = [module.register_forward_pre_hook(hook(name)) for name, module in modules.items()]
    seen = 0
    try:
        with torch.no_grad():
            for batch in batches:
                _run_batch(model, batch)
                seen += 1
    finally:
        for handle in handles:
            handle.remove()
    if not seen:
        raise InvalidInputError("calibration got no batches")
    return {name: float(value) for name, value in amax.items()}, inputs


def _fuse_patterns(fuse: object) -> tuple[tuple[str, ...], ...]:
    """``fuse`` as groups of leaf names: True -> :data:`DEFAULT_FUSE_GROUPS`, False / None -> none."""
    if fuse is True:
        return DEFAULT_FUSE_GROUPS
    if fuse is False or fuse is None:
        return ()
    try:
        groups = tuple(tuple(g) for g in fuse)  # type: ignore[union-attr]
    except TypeError:
        raise InvalidTypeError(f"fuse must be a bool or a sequence of leaf-name groups, got {type(fuse).__name__}"
                               ) from None
    for group in groups:
        if len(group) < 2 or len(set(group)) != len(group) or not all(isinstance(n, str) and n for n in group):
            raise InvalidInputError(f"each fuse group needs >= 2 distinct leaf names, got {group!r}")
    return groups


def _sibling_groups(targets: Sequence[tuple[str, nn.Linear]], patterns: Sequence[tuple[str, ...]],
                    inputs: Mapping[str, Sequence[_Fingerprint]] | None, summary: QuantizeSummary,
                    aliases: Mapping[str, list[str]]) -> list[list[tuple[str, nn.Linear]]]:
    """The groups of ``targets`` to fuse: per parent module, the members of a pattern that are all targets, with one
    ``in_features``, weight dtype, device and bias presence (and, when ``inputs`` were recorded, the same inputs in
    every call); each linear in one group at most. A module registered under several names never fuses. Groups that
    match a pattern but do not fuse are added to ``summary.not_fused`` with the reason."""
    by_parent: dict[str, dict[str, tuple[str, nn.Linear]]] = {}
    for name, linear in targets:
        if name in aliases:
            continue
        parent, _, leaf = name.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = (name, linear)
    groups = []
    for leaves in by_parent.values():
        used: set[str] = set()
        for pattern in patterns:
            if not all(leaf in leaves and leaf not in used for leaf in pattern):
                continue
            members = [leaves[leaf] for leaf in pattern]
            lins = [lin for _, lin in members]
            first = lins[0]
            same = all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype
                       and lin.weight.device == first.weight.device
                       and (lin.bias is None) == (first.bias is None) for lin in lins)
            joined = "+".join(name for name, _ in members)
            if not same:
                summary.not_fused.append((joined, "in_features, dtype, device or bias presence differ"))
                logger.info("quantize_model: %s not fused (in_features, dtype, device or bias differ)", joined)
                continue
            if inputs is not None:
                seen = [inputs.get(name, []) for name, _ in members]
                if not seen[0] or any(s != seen[0] for s in seen[1:]):
                    summary.not_fused.append((joined, "the calibration batches gave them different inputs"))
                    logger.info("quantize_model: %s not fused (the calibration batches gave them different inputs)",
                                joined)
                    continue
            used.update(pattern)
            groups.append(members)
    return groups


def _concatenated(members: Sequence[tuple[str, nn.Linear]]) -> nn.Linear:
    """An ``nn.Linear`` whose weight (and bias) are the members' concatenated along the output dim."""
    lins = [lin for _, lin in members]
    weight = torch.cat([lin.weight.detach() for lin in lins])
    out = nn.Linear(lins[0].in_features, weight.shape[0], bias=lins[0].bias is not None, device="meta",
                    dtype=weight.dtype)
    out.weight = nn.Parameter(weight, requires_grad=False)
    if lins[0].bias is not None:
        out.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in lins]), requires_grad=False)
    return out


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, module)


def _held_bytes(modules: Iterable[nn.Module], recurse: bool = True) -> int:
    """Bytes of every parameter and buffer of ``modules`` (with their submodules when ``recurse``), each storage
    counted once (tied weights, views of one tensor)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for module in modules:
        for t in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)):
            if t.device.type == "meta":
                total += t.numel() * t.element_size()
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def _check_input_scale_names(model: nn.Module, input_scales: Mapping[str, float], targets: set[str]) -> None:
    """``input_scales`` naming no module of ``model`` is an error (a typo would otherwise be ignored); naming a
    module that is not swapped is logged."""
    if not input_scales:
        return
    modules = {name for name, _ in model.named_modules(remove_duplicate=False)}
    unknown = sorted(set(input_scales) - modules)
    if unknown:
        raise InvalidInputError(f"input_scales names no module of the model: {', '.join(unknown[:5])}"
                                + (" ..." if len(unknown) > 5 else ""))
    unused = sorted(set(input_scales) - targets)
    if unused:
        logger.warning("quantize_model: input_scales of %d module(s) not swapped are not used: %s", len(unused),
                       ", ".join(unused[:5]))


def _patterns(skip: object) -> tuple[str, ...]:
    """``skip`` as a tuple of fnmatch patterns (one string is one pattern)."""
    if isinstance(skip, str):
        return (skip,)
    try:
        patterns = tuple(skip)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidTypeError(f"skip must be a sequence of fnmatch patterns, got {type(skip).__name__}") from None
    if not all(isinstance(p, str) for p in patterns):
        raise InvalidTypeError(f"skip patterns must be strings, got {patterns!r}")
    return patterns


def _input_scales(values: object) -> dict[str, float]:
    """``input_scales`` checked: module name -> a finite float > 0."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise InvalidTypeError(f"input_scales must be a mapping of module name -> scale, got {type(values).__name__}")
    out = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidTypeError(f"input_scales[{name!r}] must be a float, got {type(value).__name__} {value!r}")
        if not 0.0 < value < math.inf:
            raise InvalidInputError(f"input_scales[{name!r}] must be finite and > 0, got {value!r}")
        out[str(name)] = float(value)
    return out


def _swap_fused(model: nn.Module, members: Sequence[tuple[str, nn.Linear]], scales: Mapping[str, float],
                quantize: Mapping[str, Any], summary: QuantizeSummary) -> bool:
    """Replace ``members`` by slices of one fused :class:`Fp8Linear`; False (nothing changed) when no provider can
    serve the fused shape: the members are then quantized one by one."""
    names = [name for name, _ in members]
    leaves = tuple(name.rpartition(".")[2] for name in names)
    static = [scales[name] for name in names if name in scales]
    reason = None
    rows = DEFAULT_WEIGHT_BLOCK[0]
    sizes = [lin.out_features for _, lin in members]
    if quantize["weight_scale"] is WeightScale.BLOCK and blocks_straddle_shards(sizes, rows):
        reason = (f"block scales would straddle siblings ({'/'.join(map(str, sizes))} rows: every one but the last "
                  f"must span whole {rows}-row blocks)")
    else:
        try:
            layer = Fp8Linear.from_linear(_concatenated(members), input_scale=max(static) if static else None,
                                          **quantize)
        except UnsupportedProblemError as exc:
            reason = str(exc).splitlines()[0]
    if reason is not None:
        logger.info("quantize_model: %s not fused: %s", "+".join(names), reason)
        summary.not_fused.append(("+".join(names), reason))
        return False
    group = SharedInputGroup([lin.out_features for _, lin in members], leaves)
    slices = [Fp8LinearSlice(group, 0, fused=layer)] + [Fp8LinearSlice(group, i) for i in range(1, len(members))]
    with_text = "+".join(leaves)
    for (name, lin), piece in zip(members, slices):
        _set_module(model, name, piece)
        summary.swapped.append(SwappedLayer(name, lin.out_features, lin.in_features, layer.backends_text, with_text))
    summary.fused.append((names[0].rpartition(".")[0], leaves, f"{layer.out_features}x{layer.in_features}"))
    return True


#: the weight scale that pairs with each activation mode when only the activation mode is given, and back
_WEIGHT_FOR = {ActScale.PER_TOKEN: WeightScale.PER_CHANNEL, ActScale.PER_TOKEN_GROUP: WeightScale.BLOCK,
               ActScale.PER_TENSOR_DYNAMIC: WeightScale.PER_TENSOR, ActScale.PER_TENSOR_STATIC: WeightScale.PER_TENSOR}
_ACT_FOR = {WeightScale.PER_CHANNEL: ActScale.PER_TOKEN, WeightScale.BLOCK: ActScale.PER_TOKEN_GROUP,
            WeightScale.PER_TENSOR: ActScale.PER_TENSOR_DYNAMIC}


def default_scheme(act_scale: ActScale | str | None, weight_scale: WeightScale | str | None
                   ) -> tuple[ActScale, WeightScale]:
    """:func:`quantize_model`'s scheme: both None -> per-token activations x per-channel weights (the default);
    one given -> the other that pairs with it (per-tensor with per-tensor, per-token with per-channel, per-token-group
    with block); both given -> as given."""
    if weight_scale is None:
        wmode = None
    else:
        try:
            wmode = WeightScale(weight_scale)
        except (ValueError, TypeError):
            raise InvalidInputError(
                f"weight_scale must be per_tensor, per_channel or block, got {weight_scale!r}") from None
    if act_scale is None:
        mode = _ACT_FOR[wmode] if wmode is not None else ActScale.PER_TOKEN
    else:
        mode = ActScale.of(act_scale)
    return mode, (wmode if wmode is not None else _WEIGHT_FOR[mode])


def quantize_model(
    model: nn.Module,
    *,
    act_scale: ActScale | str | None = None,
    weight_scale: WeightScale | str | None = None,
    backend: str | Fp8GemmBackend | None = None,
    skip: Sequence[str] = DEFAULT_SKIP,
    include: Callable[[str, nn.Linear], bool] | None = None,
    calibration: Iterable[Any] | None = None,
    input_scales: Mapping[str, float] | None = None,
    weight_dtype: object = Fp8Dtype.E4M3FN,
    input_dtype: object = Fp8Dtype.E4M3FN,
    static_launch: bool = False,
    objective: SelectionObjective | str | None = None,
    fuse: bool | Sequence[Sequence[str]] = True,
) -> QuantizeSummary:
    """Replace the model's ``nn.Linear`` modules by :class:`Fp8Linear` in place; return a :class:`QuantizeSummary`.

    Args:
        model: any ``nn.Module``; its linears keep their device and dtype (bf16/fp16/fp32 model dtype).
        act_scale: ``"per_token"`` (dynamic, one scale per row: the default), ``"per_tensor_dynamic"`` or
            ``"per_tensor_static"`` (needs ``calibration`` or ``input_scales``); ``"per_token_group"`` (groups of 128
            along K) for block weights, their default.
        weight_scale: ``"per_channel"`` (one scale per output row: the default, with per-token activations the
            scheme of compressed-tensors' FP8_DYNAMIC checkpoints), ``"per_tensor"`` (the default when
            ``act_scale`` is a per-tensor mode) or ``"block"`` (block-wise FP8 as DeepSeek-V3 and Qwen3-FP8 ship it:
            one scale per 128x128 weight block, activations quantized per token in groups of 128; siblings are fused
            only where every one but the last spans whole 128-row blocks, so that no block straddles two of them:
            ``summary.not_fused`` names the others). Why per-channel x per-token is the default:
            README ("The default scheme").
        backend: GEMM provider for every layer: a name (``"auto"``, ``"triton"``, ``"DIST:NAME@opt=v"``), an
            instance, or ``None`` (``FP8_GEMM_BACKEND``, else ``auto``).
        skip: fnmatch patterns on the qualified module name or its last part (default :data:`DEFAULT_SKIP`).
        include: optional ``(name, linear) -> bool`` filter applied after ``skip``.
        calibration: batches run through the unmodified model to calibrate static input scales.
        input_scales: static input scales by module name (override calibration where both are given).
        weight_dtype: FP8 element type of the weights.
        input_dtype: FP8 element type of the quantized activations.
        static_launch: also let Inductor launch the Triton kernels of the library's ops with its static CUDA
            launcher under ``torch.compile`` (:func:`fp8_backends.layers.inductor_setup.static_launch_triton_ops`: a
            global Inductor setting). Off by default: on the H200 it made a compiled decode step slower (1.7x bf16
            against 1.03x without it, ``bench/results/hf_model/2026-12-01-h200-static-launcher-on/``).
        objective: what ``auto`` optimizes for every layer (:mod:`fp8_backends.core.objective`): ``"kernel"``
            (the fastest kernel in CUDA graphs: a model that runs in CUDA graphs), ``"host"`` (the cost of a call
            the host enqueues: eager or ``torch.compile`` without CUDA graphs) or ``"auto"`` (default, unless
            ``FP8_SELECTION_OBJECTIVE`` says otherwise: host choices, and kernel choices for calls made while a
            CUDA graph is captured); the summary reports it. An explicit ``backend`` ignores it.
        fuse: run sibling linears that read one input as one GEMM (module docstring): ``True`` (default) for the
            leaf-name groups of :data:`DEFAULT_FUSE_GROUPS`, a sequence of leaf-name groups (``[("q", "k", "v")]``)
            for others, ``False`` for none. A group the providers cannot serve fused is quantized layer by layer.
    """
    if not isinstance(model, nn.Module):
        raise InvalidTypeError(f"quantize_model needs an nn.Module, got {type(model).__name__}")
    mode, wmode = default_scheme(act_scale, weight_scale)
    if (mode is ActScale.PER_TOKEN_GROUP) != (wmode is WeightScale.BLOCK):
        raise InvalidInputError(f"block weight scales pair with per_token_group activation scales (block-wise FP8); "
                                f"got act_scale={mode.value} with weight_scale={wmode.value}")
    fp8_in = Fp8Dtype.of(input_dtype)
    Fp8Dtype.of(weight_dtype)
    skip = _patterns(skip)
    if include is not None and not callable(include):
        raise InvalidTypeError(f"include must be a callable (name, linear) -> bool, got {type(include).__name__}")
    if calibration is not None and (isinstance(calibration, (str, bytes, Mapping, torch.Tensor))
                                    or not hasattr(calibration, "__iter__")):
        hint = ": wrap one batch in a list ([batch])" if isinstance(calibration, (Mapping, torch.Tensor)) else ""
        raise InvalidTypeError(f"calibration must be an iterable of batches, got {type(calibration).__name__}{hint}")
    if isinstance(model, nn.Linear):
        raise InvalidInputError("quantize_model swaps the linears inside a model, and this model is an nn.Linear "
                                "itself: Fp8Linear.from_linear(linear, ...) quantizes one")
    input_scales = _input_scales(input_scales)
    patterns = _fuse_patterns(fuse)
    if backend is not None and not isinstance(backend, (str, Fp8GemmBackend)):
        raise InvalidTypeError(f"backend must be a name, an Fp8GemmBackend or None, got {type(backend).__name__}")
    if isinstance(backend, str):
        from .registry.resolution import BackendRequest

        BackendRequest.parse(backend)  # malformed options fail here, before any layer is touched
    from .registry.per_m import layer_objective

    objective = layer_objective(objective)  # once: every layer decides by the same objective
    summary = QuantizeSummary(act_scale=mode.value, weight_scale=wmode.value, objective=objective.value)
    aliases = module_aliases(model)
    targets = _targets(model, tuple(skip), include, summary, aliases)
    _check_input_scale_names(model, input_scales, {name for name, _ in targets})
    held_before = _held_bytes([model])
    scales: dict[str, float] = {}
    seen_inputs: dict[str, list[_Fingerprint]] | None = None
    if mode is ActScale.PER_TENSOR_STATIC:
        if calibration is not None:
            amax, seen_inputs = _calibrate(model, dict(targets), calibration)
            scales = {name: max(value / fp8_in.max, 1e-12) for name, value in amax.items()}
        scales.update(input_scales)
        missing = [name for name, _ in targets if name not in scales]
        if missing:
            raise InvalidInputError(
                f"static activation scales need calibration batches or input_scales; none for {len(missing)} "
                f"layer(s): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (a layer the calibration "
                "batches never reached has no scale either)")
    elif input_scales or calibration is not None:
        raise InvalidInputError(f"calibration and input_scales are for act_scale='per_tensor_static', not {mode.value}")
    from .registry.resolution import requests_auto

    explicit = not requests_auto("gemm", backend)  # None: FP8_GEMM_BACKEND may name one
    quantize = {"act_scale": mode, "weight_scale": wmode, "weight_dtype": weight_dtype, "input_dtype": fp8_in,
                "backend": backend, "objective": objective}
    group_of = {name: members for members in _sibling_groups(targets, patterns, seen_inputs, summary, aliases)
                for name, _ in members}
    done: set[str] = set()
    for name, linear in targets:
        if name in done:
            continue  # swapped with its group
        members = group_of.get(name)
        if members is not None:
            if _swap_fused(model, members, scales, quantize, summary):
                done.update(member for member, _ in members)
                continue
            for member, _ in members:  # not fusable: every member goes alone
                group_of.pop(member, None)
        try:
            layer = Fp8Linear.from_linear(linear, input_scale=scales.get(name), **quantize)
        except UnsupportedProblemError as exc:
            if explicit:
                raise
            reason = "; ".join(exc.reasons) if getattr(exc, "reasons", None) else str(exc).splitlines()[0]
            summary.skipped.append((name, f"no provider can serve it: {reason}"))
            logger.warning("quantize_model: %s stays %s: %s", name, type(linear).__name__, reason)
            continue
        except InvalidInputError as exc:  # the weight itself (non-finite values, the meta device): name the module
            if type(exc) is not InvalidInputError:  # a subclass (an option error, ...) keeps its type and message
                raise
            raise InvalidInputError(f"{name}: {exc} (the linears before it are swapped already)") from None
        for alias in aliases.get(name, [name]):  # every name the module has gets the one new layer
            _set_module(model, alias, layer)
        summary.swapped.append(SwappedLayer(name, layer.out_features, layer.in_features, layer.backends_text))
    # what the model holds now against before, storages counted once (a weight tied to a module kept unquantized,
    # e.g. an embedding, stays held: its bytes are not saved)
    swapped = {layer.name for layer in summary.swapped}
    summary.bytes_before = _held_bytes([lin for name, lin in targets if name in swapped], recurse=False)
    summary.bytes_after = summary.bytes_before - (held_before - _held_bytes([model]))
    if static_launch and summary.swapped:
        from .layers.inductor_setup import static_launch_triton_ops

        static_launch_triton_ops(True)
    logger.info("%s", summary)
    return summary


__all__ = [
    "DEFAULT_FUSE_GROUPS",
    "DEFAULT_SKIP",
    "QuantizeSummary",
    "SwappedLayer",
    "calibrate_input_amax",
    "quantize_model",
]
