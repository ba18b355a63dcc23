"""Which module becomes which FP8 layer, from which tensors: :func:`plan_linears` (torch-free).

Given a model's linears (:class:`LinearInfo`), a parsed format and the checkpoint's tensors (name ->
:class:`~fp8_backends.checkpoints.shards.TensorMeta`, from the safetensors headers or a state dict), the plan checks
every name, dtype and shape before anything is loaded and says:

- which linears are quantized, with which :class:`~fp8_backends.checkpoints.schemes.Scheme` and tensors
  (:class:`LinearPlan`), and which stay in the model dtype (``kept``, with the config's reason);
- which siblings (q/k/v, gate/up: the leaf-name groups of ``fuse_groups``) run as one GEMM (:class:`FusedPlan`):
  siblings of one parent quantized alike with one ``K`` and bias presence; block-scaled ones only where every
  sibling's ``N`` but the last one's is a multiple of the block's (a block never straddles two siblings; the last
  one's ragged block stays the fused weight's last); ``not_fused`` says why not;
- which tensors are not used (``ignored``: KV-cache scales, input scales of dynamic schemes).

Every problem raises :class:`~fp8_backends.core.errors.CheckpointError` naming the tensor and its file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..core.errors import CheckpointError
from ..core.validation import blocks_straddle_shards
from .formats import KV_CACHE_SCALES, QuantFormat
from .schemes import FP8_E4M3, FP8_E5M2, SCALE_DTYPES, Scheme, input_scale_fits
from .shards import TensorMeta

FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


@dataclass(frozen=True)
class LinearInfo:
    """One linear module of the model: its qualified name, ``K`` (in), ``N`` (out), bias presence, the names of its
    class and base classes (``("Linear", "Module")``), whether it is exactly ``nn.Linear``, and ``model_keeps``: the
    entry of the model's ``_keep_in_fp32_modules(_strict)`` that names it (``""``: none): ``transformers`` never
    quantizes those, so a checkpoint may store them unquantized whatever its config covers; they are kept then (and
    served in FP8 where stored in FP8)."""

    name: str
    k: int
    n: int
    bias: bool
    classes: tuple[str, ...] = ("Linear", "Module")
    plain: bool = True
    model_keeps: str = ""


@dataclass
class LinearPlan:
    """A quantized linear: its scheme and the tensors it loads (``input_scale``: static schemes only)."""

    name: str
    n: int
    k: int
    scheme: Scheme
    weight: TensorMeta
    weight_scale: TensorMeta
    input_scale: TensorMeta | None = None
    bias: TensorMeta | None = None
    #: the fused group it belongs to and its place there (None: it runs alone)
    group: FusedPlan | None = None
    index: int = 0

    def tensors(self) -> list[tuple[str, TensorMeta]]:
        """``[(role, meta)]`` of what it loads: ``weight``, ``weight_scale``, ``input_scale``, ``bias``."""
        return [(role, meta) for role, meta in (("weight", self.weight), ("weight_scale", self.weight_scale),
                                                ("input_scale", self.input_scale), ("bias", self.bias))
                if meta is not None]


@dataclass
class FusedPlan:
    """Siblings that read one input, served by one fused layer (``members`` in the fused layer's row order)."""

    parent: str
    leaves: tuple[str, ...]
    members: list[LinearPlan] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.parent}.{'+'.join(self.leaves)}" if self.parent else "+".join(self.leaves)

    @property
    def sizes(self) -> list[int]:
        return [m.n for m in self.members]


@dataclass
class LoadPlan:
    """The result of :func:`plan_linears` (module docstring)."""

    fmt: QuantFormat
    linears: dict[str, LinearPlan] = field(default_factory=dict)
    fused: list[FusedPlan] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)
    not_fused: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    #: tensor name -> (the linear that loads it, its role)
    routes: dict[str, tuple[LinearPlan, str]] = field(default_factory=dict)

    def small_tensors(self) -> list[TensorMeta]:
        """Every scale and bias the plan loads (read first, so their values are checked before any weight)."""
        return [meta for lin in self.linears.values() for role, meta in lin.tensors() if role != "weight"]

    @property
    def kept_names(self) -> set[str]:
        return {name for name, _ in self.kept}


def plan_linears(fmt: QuantFormat, linears: Iterable[LinearInfo], tensors: Mapping[str, TensorMeta], *,
                 fuse_groups: Sequence[Sequence[str]] = (), block_served: bool = False,
                 where: str = "") -> LoadPlan:
    """The :class:`LoadPlan` of ``linears`` over the checkpoint ``tensors`` (module docstring). ``block_served``:
    whether this library's :class:`~fp8_backends.layers.Fp8Linear` serves block-scaled weights; ``where``: the
    checkpoint (a folder) for messages about missing tensors."""
    plan = LoadPlan(fmt)
    by_module: dict[str, list[str]] = {}
    for name in tensors:
        prefix, _, leaf = name.rpartition(".")
        by_module.setdefault(prefix, []).append(leaf)
    for info in linears:
        weight = tensors.get(f"{info.name}.weight")
        # the config names modules as the checkpoint does: a weight read under the model's name (.names) is looked
        # up under its stored module name
        config_name = weight.key.rpartition(".")[0] if weight is not None and weight.stored else info.name
        scheme = fmt.scheme_for(config_name, info.classes)
        leaf = info.name.rpartition(".")[2]
        stored_plain = weight is None or weight.dtype != FP8_E4M3
        if scheme is not None and leaf in fmt.soft_keep and stored_plain:
            plan.kept.append((info.name, f"{fmt.kind} keeps the output head in the model dtype"))
            continue
        if scheme is not None and info.model_keeps and stored_plain:
            plan.kept.append((info.name, f"the model keeps it unquantized (_keep_in_fp32_modules: "
                                         f"{info.model_keeps})"))
            continue
        if scheme is None:
            if weight is not None and weight.dtype in (FP8_E4M3, FP8_E5M2):
                raise CheckpointError(f"the weight is float8 but the config keeps {info.name} in the model dtype "
                                      f"({fmt.keep_reason(config_name, info.classes)})", tensor=weight.key,
                                      file=weight.file)
            plan.kept.append((info.name, fmt.keep_reason(config_name, info.classes)))
            continue
        lin = _plan_one(fmt, info, scheme, tensors, where, block_served)
        plan.linears[info.name] = lin
        _check_extra(plan, lin, by_module.get(info.name, ()), tensors)
    _plan_fusion(plan, fuse_groups)
    for lin in plan.linears.values():
        for role, meta in lin.tensors():
            plan.routes[meta.name] = (lin, role)
    return plan


def _plan_one(fmt: QuantFormat, info: LinearInfo, scheme: Scheme, tensors: Mapping[str, TensorMeta], where: str,
              block_served: bool) -> LinearPlan:
    name = info.name
    weight = tensors.get(f"{name}.weight")
    if weight is None:
        raise CheckpointError(f"missing: the {fmt.kind} config quantizes {name} ({scheme.describe()})",
                              tensor=f"{name}.weight", file=where)
    if weight.dtype == FP8_E5M2:
        raise CheckpointError(f"float8_e5m2 weights are not served for the {fmt.kind} format (it stores "
                              "float8_e4m3fn)", tensor=weight.key, file=weight.file)
    if weight.dtype != FP8_E4M3:
        raise CheckpointError(f"the {fmt.kind} config quantizes {name} but its weight is {weight.dtype}, not "
                              "float8_e4m3fn", tensor=weight.key, file=weight.file)
    if not info.plain:
        raise CheckpointError(f"{name} is a {info.classes[0]} (a subclass of nn.Linear whose forward may differ): "
                              "it cannot be served as an FP8 linear", tensor=weight.key, file=weight.file)
    if weight.shape != (info.n, info.k):
        raise CheckpointError(f"shape {list(weight.shape)} does not match the model's [{info.n}, {info.k}]",
                              tensor=weight.key, file=weight.file)
    scale = _first(tensors, name, scheme.weight_scale_names)
    if scale is None:
        raise CheckpointError(f"missing weight scale ({' or '.join(scheme.weight_scale_names)}) of an FP8 weight",
                              tensor=f"{name}.{scheme.weight_scale_names[0]}", file=weight.file)
    both = [leaf for leaf in scheme.weight_scale_names if f"{name}.{leaf}" in tensors]
    if len(both) > 1:
        raise CheckpointError(f"{name} holds {' and '.join(both)}: which one scales its weight is ambiguous",
                              tensor=scale.key, file=scale.file)
    e8m0 = scale.dtype == "F8_E8M0" and scheme.weight == "block"
    if scale.dtype not in SCALE_DTYPES and not e8m0:
        raise CheckpointError(f"scale dtype {scale.dtype} is not a float (fp32, bf16, fp16)", tensor=scale.key,
                              file=scale.file)
    if not scheme.weight_scale_fits(scale.shape, info.n, info.k):
        raise CheckpointError(f"shape {list(scale.shape)} does not fit the weight [{info.n}, {info.k}] "
                              f"({scheme.describe()}: expected {scheme.weight_scale_shape_text(info.n, info.k)})",
                              tensor=scale.key, file=scale.file)
    if scheme.weight == "block" and not block_served:
        raise CheckpointError(f"block-scaled FP8 ({scheme.describe()}) is not served by this version of "
                              "fp8_backends yet: its Fp8Linear has no block mode", tensor=scale.key, file=scale.file)
    input_scale = None
    if scheme.static:
        input_scale = _first(tensors, name, scheme.input_scale_names)
        if input_scale is None:
            raise CheckpointError(f"missing static input scale ({' or '.join(scheme.input_scale_names)}) of "
                                  f"{name} ({scheme.describe()})",
                                  tensor=f"{name}.{scheme.input_scale_names[0]}", file=weight.file)
        if input_scale.dtype not in SCALE_DTYPES:
            raise CheckpointError(f"scale dtype {input_scale.dtype} is not a float (fp32, bf16, fp16)",
                                  tensor=input_scale.key, file=input_scale.file)
        if not input_scale_fits(input_scale.shape):
            raise CheckpointError(f"a static input scale holds one value, got shape {list(input_scale.shape)}",
                                  tensor=input_scale.key, file=input_scale.file)
    bias = tensors.get(f"{name}.bias")
    if info.bias:
        if bias is None:
            raise CheckpointError(f"missing: the model's {name} has a bias", tensor=f"{name}.bias", file=weight.file)
        if bias.dtype not in FLOAT_DTYPES or bias.shape != (info.n,):
            raise CheckpointError(f"a bias must be a float [{info.n}], got {bias.dtype} {list(bias.shape)}",
                                  tensor=bias.key, file=bias.file)
    elif bias is not None:
        raise CheckpointError(f"the model's {name} has no bias", tensor=bias.key, file=bias.file)
    return LinearPlan(name, info.n, info.k, scheme, weight, scale, input_scale, bias)


def _first(tensors: Mapping[str, TensorMeta], module: str, names: Sequence[str]) -> TensorMeta | None:
    for leaf in names:
        meta = tensors.get(f"{module}.{leaf}")
        if meta is not None:
            return meta
    return None


def _check_extra(plan: LoadPlan, lin: LinearPlan, leaves: Iterable[str], tensors: Mapping[str, TensorMeta]) -> None:
    """Tensors stored under a quantized linear beside the ones it loads: KV-cache scales and unused input scales are
    ignored (noted); anything else (zero points, ``g_idx``, ``pre_quant_scale``, ...) changes the math: an error."""
    used = {meta.name for _, meta in lin.tensors()}
    for leaf in leaves:
        name = f"{lin.name}.{leaf}"
        if name in used:
            continue
        if leaf in KV_CACHE_SCALES or leaf in lin.scheme.input_scale_names or leaf in lin.scheme.weight_scale_names:
            plan.ignored.append(name)
            continue
        meta = tensors[name]
        raise CheckpointError(f"unexpected tensor beside an FP8 linear ({lin.scheme.describe()}): the library "
                              "serves no such parameter", tensor=name, file=meta.file)


def _plan_fusion(plan: LoadPlan, fuse_groups: Sequence[Sequence[str]]) -> None:
    by_parent: dict[str, dict[str, LinearPlan]] = {}
    for lin in plan.linears.values():
        parent, _, leaf = lin.name.rpartition(".")
        by_parent.setdefault(parent, {})[leaf] = lin
    for parent, leaves in by_parent.items():
        used: set[str] = set()
        for pattern in fuse_groups:
            present = [leaf for leaf in pattern if leaf in leaves and leaf not in used]
            if len(present) < 2:
                continue
            group_name = f"{parent}.{'+'.join(pattern)}" if parent else "+".join(pattern)
            if len(present) != len(pattern):
                plan.not_fused.append((group_name, "not every sibling is quantized"))
                continue
            members = [leaves[leaf] for leaf in pattern]
            first = members[0]
            reason = None
            rows = first.scheme.block[0] if first.scheme.weight == "block" else 0  # type: ignore[index]
            if not all(m.scheme.same_math(first.scheme) for m in members):
                reason = "the siblings are quantized differently"
            elif not all(m.k == first.k and (m.bias is None) == (first.bias is None) for m in members):
                reason = "K or bias presence differ"
            elif rows and blocks_straddle_shards([m.n for m in members], rows):
                reason = (f"a sibling's N (the last one's aside) is not a multiple of the {rows}-row block "
                          f"({'/'.join(str(m.n) for m in members)}): its scale blocks would straddle two siblings")
            if reason is not None:
                plan.not_fused.append((group_name, reason))
                continue
            group = FusedPlan(parent, tuple(pattern), members)
            for i, m in enumerate(members):
                m.group, m.index = group, i
            used.update(pattern)
            plan.fused.append(group)


__all__ = ["FusedPlan", "LinearInfo", "LinearPlan", "LoadPlan", "plan_linears"]
