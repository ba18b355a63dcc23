"""The ``torch.compile`` path of a processed :class:`~fp8_backends.layers.Fp8Linear`: what Dynamo traces, bound once.

Dynamo guards every Python value a traced call reads, and checks those guards at every call of the compiled
graph, on the host, before any kernel is launched. ``nn.Linear`` costs ~10 guards (its module, its weight, its bias);
through the general path (:func:`~.general_path.apply_fp8_linear`) one ``Fp8Linear`` read ~90 values and
made ~5 tensors graph inputs with aliasing checks, and every layer that reached an object the others share (the
provider, an enum member) added an ``a is b`` guard, a Python call. Guards cost more than a warm loop of checks
suggests: a model step does much other host work between two checks, so the guard objects are out of the CPU's
caches at each check (``bench/guard_cost.py`` on a 2-core CPU: an 8-layer fused static FP8 Llama's guards took 90 µs
per check warm and 282 µs with the caches flushed before each check through the plan object this module replaced,
64 and 232 µs through the generated plans; bf16: 49 and 176 µs).

A traced plan (:func:`bind_traced`) is a **function generated for one layer** at load time, whose code holds the
layer's own numbers as constants: ``K``, ``N``, each M bucket's bound, the fields of each bucket's prepared weight.
Dynamo reads constants from the code without guarding them, so a layer's traced call guards only

- the plan function (its code object: one identity guard);
- the tensors the call reads, which are the function's closure variables, as ``nn.Parameter`` aliases (same storage,
  ``requires_grad=False``, so Dynamo installs no aliasing guards on them): the M bucket's prepared weight data and
  scale, and only the entries of its ``extra`` the provider reads for this layer's activation mode
  (:meth:`~fp8_backends.core.backend.Fp8GemmBackend.traced_extra_keys`), the static input scale, the bias;
- objects every layer shares (the provider, enum members, dtypes, devices) are read from one module-level table
  (``_SHARED``), so Dynamo guards each once for the whole model, never once per layer.

A call validates the input only (as the eager plan does), quantizes it with the library's traced ops
(:func:`fp8_backends.quant.quantize`: torch ops that Inductor fuses into the producer) unless it is a
:class:`~fp8_backends.core.types.QuantizedActivation`, and calls ``gemm_impl`` for the M bucket: the provider's
op, a ``triton_op`` or ``torch._scaled_mm``. Its operands come from the plan's own quantizer, or from a
quantized activation checked here, so :meth:`~fp8_backends.core.backend.Fp8GemmBackend.gemm`'s per-call
validation (evaluated once at trace time, but guarded at every call) is skipped. Under ``torch.compile`` the
rows are the ``host`` rows, as in the general path (see :func:`~.general_path.apply_fp8_linear`).

An M bucket whose provider quantizes inside its own launch
(:meth:`~fp8_backends.core.backend.Fp8GemmBackend.traced_fused_quant_max_m`: the ``triton`` provider's block-wise
GEMV at one token) gets the unquantized input instead (:func:`fused_finish`): where Inductor splits a per-token-group
quantization into two or three kernels, a decode step's linear is then one launch, as bf16's is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .. import quant
from ..core import output_contract, reference
from ..core.errors import InvalidInputError
from ..core.types import ActScale, Fp8Dtype, PreparedWeight, QuantizedActivation, ScaleLayout
from .general_path import unpack_quantized

if TYPE_CHECKING:
    import torch

    from ..registry.per_m import PerMGemm

#: Objects many layers share (providers, enum members, dtypes, devices), each under one small int: a plan reads them
#: as ``_SHARED[i]``, so Dynamo guards each once for the whole model instead of once per layer, plus an ``a is b``
#: guard (a Python call) for every other layer that reaches it. Entries live as long as the process.
_SHARED: dict[int, Any] = {}
_SHARED_INDEX: dict[Any, int] = {}

#: ``x`` (a tensor or a QuantizedActivation) -> ``y [..., N]``: one layer's traced call
TracedPlan = Callable[[Any], Any]


def shared_index(obj: Any) -> int:
    """The ``_SHARED`` key of ``obj`` (added on first use; load time only, never while Dynamo traces). Devices are
    keyed by value (every layer holds its own ``torch.device`` object), everything else by identity."""
    import torch

    key: Any = ("device", obj) if isinstance(obj, torch.device) else id(obj)
    index = _SHARED_INDEX.get(key)
    if index is None:
        index = _SHARED_INDEX[key] = len(_SHARED)
        _SHARED[index] = obj
    return index


def parameter_alias(t: Any) -> Any:
    """``t`` as an ``nn.Parameter`` sharing its storage, sizes and strides (``requires_grad=False``) when it is a
    plain tensor; anything else (None, a subclass, a non-tensor) as it is."""
    import torch

    if type(t) is torch.Tensor:
        return torch.nn.Parameter(t, requires_grad=False)
    return t


class TracedRow(NamedTuple):
    """One M bucket of a plan, as bound (introspection and tests; the plan function holds the same objects):
    ``bucket`` (the largest M it serves; the last row serves every larger M), the ``backend``, the ``prepared``
    weight whose fields the plan's code holds, and what the plan hands ``gemm_impl`` for it: ``"data"``, ``"scale"``
    and the ``extra`` entries it keeps, by name (tensors as parameter aliases, other values as they are)."""

    bucket: int
    backend: Any
    prepared: Any
    tensors: dict[str, Any]


# ------------------------------------------------------------------------------------------ what a plan calls
def prologue(x: Any, k: int, dtype: torch.dtype, device: torch.device, mode: ActScale, fp8: torch.dtype,
             fmax: float, kind: str, input_scale: torch.Tensor | None, group_size: int = 128,
             layout: str = "row_major", group_kernel: Callable[..., Any] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """``(x_q [M, K], scale, leading dims)``: ``x [..., K]`` in ``dtype`` on ``device`` quantized in ``mode`` (the
    static scale ``input_scale``), or a :class:`QuantizedActivation` in ``mode`` checked and flattened. Per-token-group
    scales come in ``layout`` (a :class:`ScaleLayout` value: the consuming row's), written by the quantization itself
    or, for a quantized activation, re-laid out: for one token by torch ops Inductor fuses into the producer
    (:func:`fp8_backends.quant.traced_quantize_groups`), for more by ``group_kernel`` where the device has one
    (:func:`fp8_backends.quant.traced_group_kernel`). Dynamo specializes M = 1, so one token is always a static
    size; more tokens are a symbolic size as soon as a second one was seen, where Inductor's code takes 3-4 kernels
    against the kernel's one launch (a static M >= 2 loses at most the one kernel a fused SiLU·mul saves).

    ``fmax`` (``fp8``'s largest value) and ``kind`` (``mode.value``: a string, which Dynamo does not guard as it does
    the enum member) are constants of the generated code: where compiled code quantizes with the reference torch code
    (compile mode ``"inline"``, :func:`fp8_backends.quant.set_compile_mode`), it calls the math directly
    (:func:`fp8_backends.core.reference.scaled_cast` and the scale functions) instead of the public
    :func:`fp8_backends.quant.quantize`, whose dtype and mode parsing Dynamo would guard at every call (~30 guards
    a model, 8 of them Python lambdas). The input was checked here and the static scale at load time."""
    if isinstance(x, QuantizedActivation):
        x_q, scale = unpack_quantized(x, mode, k, group_size)
        if x.orig_dtype != dtype:
            raise InvalidInputError(f"QuantizedActivation.orig_dtype is {x.orig_dtype} but this linear was prepared "
                                    f"for {dtype} activations and outputs")
        data = x.data
        if data.dtype != fp8 or data.device != device:
            raise InvalidInputError(f"QuantizedActivation.data must be {fp8} on {device}, got "
                                    f"{data.dtype} on {data.device}")
        if kind == "per_token_group":
            scale = quant.traced_layout(scale, ScaleLayout(layout))
        return x_q, scale, data.shape[:-1]
    check_input(x, k, dtype, device)
    x2 = x.reshape(-1, k)
    # compile mode "op": the library's quantization op. Read as the module attribute, not through a quant function:
    # calling one would make Dynamo reach the quant module through a second source and guard the two are one object
    # (a Python guard per model); this plan only runs under torch.compile, so the mode alone decides
    if quant._compile_mode != "inline":
        x_q, scale = quant.quantize(x2, mode, input_scale, fp8, group_size=group_size, scale_layout=layout)[:2]
        return x_q, scale, x.shape[:-1]
    if kind == "per_token_group":
        if group_kernel is not None and x2.shape[0] > 1:
            x_q, scale = group_kernel(x2, group_size, layout, fp8)
        else:
            x_q, scale = quant.traced_quantize_groups(x2, group_size, fp8, fmax, ScaleLayout(layout))
        return x_q, scale, x.shape[:-1]
    if kind == "per_tensor_static":
        scale = input_scale
    elif kind == "per_tensor_dynamic":
        scale = reference.dynamic_scale(x2, fmax)
    else:
        scale = reference.per_token_scale(x2, fmax)
    return reference.scaled_cast(x2, scale, fp8, fmax), scale, x.shape[:-1]


def check_input(x: torch.Tensor, k: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise the library's error for an unquantized input that is not ``[..., K]`` in ``dtype`` on ``device``."""
    if x.dtype != dtype:
        raise InvalidInputError(f"x is {x.dtype} but this linear was prepared for {dtype} activations")
    if x.dim() < 1 or x.shape[-1] != k:
        raise InvalidInputError(f"x must be [..., K={k}], got {tuple(x.shape)}")
    if x.device != device:
        raise InvalidInputError(f"input is on {x.device} but the layer's weight is on {device}")


def fused_finish(backend: Any, x: torch.Tensor, k: int, dtype: torch.dtype, device: torch.device, prepared: Any,
                 mode: ActScale, input_scale: torch.Tensor | None, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """An M bucket whose provider quantizes the unquantized ``x [..., K]`` inside its own launch
    (:meth:`~fp8_backends.core.backend.Fp8GemmBackend.traced_fused_quant_gemm_impl`): ``x`` checked as
    :func:`prologue` checks it, the output contract as :func:`finish`, ``y [..., N]``."""
    check_input(x, k, dtype, device)
    x2 = x.reshape(-1, k)
    y = _checked(backend, backend.traced_fused_quant_gemm_impl(x2, prepared, mode, input_scale, dtype, bias), x2, n,
                 dtype)
    return y.reshape(*x.shape[:-1], n)


def rows_of(x: Any, k: int) -> Any:
    """The number of ``[K]`` rows of ``x`` (a tensor or a :class:`QuantizedActivation`'s data), read before the
    prologue checks it: it only picks the M bucket whose prologue then checks the input (a wrong ``x`` raises there,
    whichever bucket it picked)."""
    data = x.data if isinstance(x, QuantizedActivation) else x
    return data.numel() // k if hasattr(data, "numel") else 0


def finish(backend: Any, x_q: torch.Tensor, prepared: Any, scale: torch.Tensor, dtype: torch.dtype,
           bias: torch.Tensor | None, lead: tuple[int, ...], n: int) -> torch.Tensor:
    """``backend.gemm_impl`` on the quantized input, its output contract checked (on the fake output while Dynamo
    traces: no cost in the compiled graph), reshaped to ``[*lead, N]``."""
    y = _checked(backend, backend.gemm_impl(x_q, prepared, scale, dtype, bias), x_q, n, dtype)
    return y.reshape(*lead, n)


def _checked(backend: Any, y: Any, rows: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``y`` when it is ``[rows, N]`` in ``dtype`` on ``rows``' device, else the output contract's error. Duck-typed
    (a non-tensor fails it): naming torch.Tensor here would add a guard that the model's own ``torch`` and this
    module's are one object, a Python guard per compiled model."""
    if (getattr(y, "dtype", None) != dtype or getattr(y, "shape", None) != (rows.shape[0], n)
            or getattr(y, "device", None) != rows.device):
        y = output_contract.gemm_output_failed(backend, y, rows, n, dtype)
    return y


# ------------------------------------------------------------------------------------------ code generation
class _Source:
    """The generated code of one plan: closure variables (tensors and objects the code reads) and constants."""

    def __init__(self) -> None:
        self.closure: list[Any] = []

    def var(self, value: Any) -> str:
        """A closure variable holding ``value`` (``None`` is written as a constant)."""
        if value is None:
            return "None"
        self.closure.append(value)
        return f"c{len(self.closure) - 1}"

    @staticmethod
    def shared(obj: Any) -> str:
        return f"_SHARED[{shared_index(obj)}]"


def _row_source(src: _Source, row: Any, act_scale: ActScale) -> tuple[str, str, TracedRow]:
    """``(the backend expression, the prepared-weight expression, the row as bound)`` of one bucket."""
    backend, prepared = row.backend, row.prepared
    if type(prepared) is not PreparedWeight:  # another type of prepared weight: read whole, as an object
        return src.shared(backend), src.var(prepared), TracedRow(row.bucket, backend, prepared, {})
    keys = backend.traced_extra_keys(prepared, act_scale)
    extra = {name: parameter_alias(value) for name, value in prepared.extra.items() if keys is None or name in keys}
    tensors = {"data": parameter_alias(prepared.data), "scale": parameter_alias(prepared.scale), **extra}
    if all(type(name) is str for name in extra):  # the documented case: a dict literal, each value its own variable
        extra_src = "{" + ", ".join(f"{name!r}: {src.var(value)}" for name, value in extra.items()) + "}"
    else:  # other keys: the dict itself, read as one object
        extra_src = src.var(extra)
    block = "None" if prepared.block is None else f"({int(prepared.block[0])}, {int(prepared.block[1])})"
    group = "None" if prepared.group_size is None else str(int(prepared.group_size))
    expr = (f"PreparedWeight(data={src.var(tensors['data'])}, scale={src.var(tensors['scale'])}, "
            f"n={int(prepared.n)}, k={int(prepared.k)}, dtype={src.shared(prepared.dtype)}, "
            f"weight_scale={src.shared(prepared.weight_scale)}, backend={str(prepared.backend)!r}, extra={extra_src}, "
            f"block={block}, group_size={group}, k_pad={None if prepared.k_pad is None else int(prepared.k_pad)})")
    return src.shared(backend), expr, TracedRow(row.bucket, backend, prepared, tensors)


def _fused_bounds(rows: Sequence[Any], mode: ActScale) -> list[int | None]:
    """Per M bucket, where its provider quantizes the unquantized input in its own launch
    (:meth:`~fp8_backends.core.backend.Fp8GemmBackend.traced_fused_quant_max_m`): ``None`` nowhere, ``-1`` at every M
    of the bucket, else the largest M it fuses (the bucket's other M quantize first)."""
    out: list[int | None] = []
    low = 0  # the smallest M of the bucket (0 rows too: the first)
    for i, row in enumerate(rows):
        last = i == len(rows) - 1
        hook = getattr(row.backend, "traced_fused_quant_max_m", None)  # a provider of another base: never fuses
        upto = 0 if hook is None else hook(row.prepared, mode)
        if upto < max(low, 1):
            out.append(None)
        else:
            out.append(-1 if not last and upto >= row.bucket else int(upto))
        low = int(row.bucket) + 1
    return out


@functools.lru_cache(maxsize=512)
def _compile_factory(source: str) -> Callable[..., TracedPlan]:
    """The factory function defined by ``source`` (cached: layers of one shape and configuration share the code
    object; each plan has its own closure). Its globals are this module's, so every plan reads ``_SHARED`` and the
    helpers through one source."""
    namespace: dict[str, Any] = {}
    exec(compile(source, "<fp8_backends traced plan>", "exec"), globals(), namespace)  # noqa: S102
    return namespace["make_plan"]


def bind_traced(kernel: PerMGemm, *, k: int, n: int, dtype: torch.dtype, device: torch.device,
                bias: torch.Tensor | None, mode: ActScale, input_scale: torch.Tensor | None,
                fp8_dtype: torch.dtype) -> TracedPlan:
    """The traced plan of a linear over ``kernel``'s ``host`` rows: a function ``plan(x) -> y [..., N]`` (see the
    module docstring). Its :class:`TracedRow` s are its ``rows`` attribute."""
    src = _Source()
    group_size = getattr(kernel.rows[0].prepared, "group_size", None) or 128
    bias_alias = parameter_alias(bias)
    scale_alias = parameter_alias(input_scale) if mode is ActScale.PER_TENSOR_STATIC else None
    bias_src, scale_src = src.var(bias_alias), src.var(scale_alias)
    dt = src.shared(dtype)
    group = mode is ActScale.PER_TOKEN_GROUP
    group_kernel = quant.traced_group_kernel(device.type) if group else None
    prologue_src = (f"prologue(x, {int(k)}, {dt}, {src.shared(device)}, {src.shared(mode)}, "
                    f"{src.shared(fp8_dtype)}, {Fp8Dtype.of(fp8_dtype).max!r}, {mode.value!r}, {scale_src}, "
                    f"{int(group_size)}, {{layout!r}}, "
                    f"{'None' if group_kernel is None else src.shared(group_kernel)})")
    empty = ["if x_q.shape[0] == 0:", f"    return x_q.new_empty((*lead, {int(n)}), dtype={dt})"]
    body = [
        "def make_plan(" + "{args}" + "):",
        "    def traced_linear(x):",
    ]
    rows: list[TracedRow] = []
    host_rows: Sequence[Any] = kernel.rows
    fused = _fused_bounds(host_rows, mode)
    per_bucket = group or any(bound is not None for bound in fused)
    if per_bucket:  # each M bucket quantizes for its own provider (group scales in the layout it reads), or fuses
        body.append(f"        m = rows_of(x, {int(k)})")
    else:  # one quantization, whichever bucket
        body.append("        x_q, scale, lead = " + prologue_src.format(layout="row_major"))
        body.extend("        " + line for line in empty)
    for i, row in enumerate(host_rows):
        backend_src, prepared_src, bound = _row_source(src, row, mode)
        rows.append(bound)
        call = f"finish({backend_src}, x_q, {prepared_src}, scale, {dt}, {bias_src}, lead, {int(n)})"
        last = i == len(host_rows) - 1
        indent = "        " if last else "            "
        if not last:
            body.append(f"        if {'m' if per_bucket else 'x_q.shape[0]'} <= {int(row.bucket)}:")
        if fused[i] is not None:  # a quantized activation (or a larger M) takes the provider's quantized path below
            upto = "" if fused[i] == -1 else f"m <= {fused[i]} and "
            body.append(f"{indent}if {upto}not isinstance(x, QuantizedActivation):")
            body.append(f"{indent}    return fused_finish({backend_src}, x, {int(k)}, {dt}, {src.shared(device)}, "
                        f"{prepared_src}, {src.shared(mode)}, {scale_src}, {bias_src}, {int(n)})")
        if per_bucket:
            layout = row.backend.capabilities.group_scale_layout.value if group else "row_major"
            body.append(f"{indent}x_q, scale, lead = " + prologue_src.format(layout=layout))
            body.extend(indent + line for line in empty)
        body.append(f"{indent}return {call}")
    body.append("    return traced_linear")
    source = "\n".join(body).replace("{args}", ", ".join(f"c{i}" for i in range(len(src.closure))))
    plan = _compile_factory(source)(*src.closure)
    # introspection and tests (never read while traced): the rows, and the aliases of the input scale and the bias
    plan.rows, plan.input_scale, plan.bias = tuple(rows), scale_alias, bias_alias  # type: ignore[attr-defined]
    return plan


# ------------------------------------------------------------------------------------------ the fused norm's plan
#: ``(x [..., H], residual or None) -> QuantizedActivation`` or ``(QuantizedActivation, residual)``: one norm's
#: traced call
TracedNorm = Callable[[Any, Any], Any]


def norm_input_failed(x: Any, residual: Any, h: int, dtype: torch.dtype, device: torch.device) -> None:
    """Raise the library's error for a norm input the generated check refused (``x`` or ``residual``): the eager
    forward's messages, and the device's."""
    from ..core import validation as V

    V.require_norm_input(x, residual, h, dtype)
    raise InvalidInputError(f"x is on {x.device} but the norm's weight is on {device}")


def bind_traced_norm(*, h: int, eps: float, dtype: torch.dtype, device: torch.device, weight: torch.Tensor,
                     input_scale: torch.Tensor, fp8_dtype: torch.dtype) -> TracedNorm:
    """What ``torch.compile`` traces for an :class:`~fp8_backends.layers.RMSNormFp8Quant` whose provider ``auto``
    chose: in compile mode ``"inline"`` (else it returns ``None``), a function generated for this norm that checks the
    input (and the residual)
    and computes :func:`fp8_backends.core.reference.rmsnorm_quant` (or the residual-add form, the sum written back in
    place) as torch ops that Inductor fuses, returning a :class:`QuantizedActivation` with the consumer's static
    ``input_scale``.

    ``H``, ``eps`` and the float8 type's largest value are constants of its code; ``weight`` (the norm's parameter)
    and ``input_scale`` (pass the consumer's traced plan's own alias: one graph input for the two) its closure;
    dtypes and the mode are read from ``_SHARED``. So the call reads neither the consumer linear, nor the provider,
    nor enum members through the module tree, each of which Dynamo would guard at every call (an ``a is b`` check
    for every object two modules reach)."""
    src = _Source()
    w_src, s_src = src.var(weight), src.var(input_scale)
    dt, fp8, static = src.shared(dtype), src.shared(fp8_dtype), src.shared(ActScale.PER_TENSOR_STATIC)
    dev = src.shared(device)
    fmax = Fp8Dtype.of(fp8_dtype).max
    h, eps = int(h), float(eps)
    body = [
        "def make_plan(" + "{args}" + "):",
        "    def traced_norm(x, residual):",
        "        if quant._compile_mode != 'inline':",  # the provider's op: the caller's general path
        "            return None",
        f"        if getattr(x, 'dtype', None) != {dt} or x.dim() < 1 or x.shape[-1] != {h} or "
        f"x.device != {dev}:",
        f"            norm_input_failed(x, residual, {h}, {dt}, {dev})",
        f"        x2 = x.reshape(-1, {h})",
        "        if residual is None:",
        f"            y = reference.rmsnorm(x2, {w_src}, {eps!r})",
        f"            q = reference.scaled_cast(y, {s_src}, {fp8}, {fmax!r})",
        f"            return QuantizedActivation(q.reshape(x.shape), {s_src}, {dt}, {static})",
        "        if (getattr(residual, 'shape', None) != x.shape or getattr(residual, 'dtype', None) != x.dtype",
        "                or residual.device != x.device or not residual.is_contiguous()):",
        f"            norm_input_failed(x, residual, {h}, {dt}, {dev})",
        f"        r2 = residual.view(-1, {h})",
        "        total = x2.float() + r2.float()",
        "        r2.copy_(total)",
        f"        q = reference.scaled_cast(reference.rmsnorm(total, {w_src}, {eps!r}), {s_src}, {fp8}, {fmax!r})",
        f"        return QuantizedActivation(q.reshape(x.shape), {s_src}, {dt}, {static}), residual",
        "    return traced_norm",
    ]
    source = "\n".join(body).replace("{args}", ", ".join(f"c{i}" for i in range(len(src.closure))))
    norm = _compile_factory(source)(*src.closure)
    norm.input_scale, norm.weight = input_scale, weight  # type: ignore[attr-defined]  # introspection and tests
    return norm


__all__ = ["TracedNorm", "TracedPlan", "TracedRow", "bind_traced", "bind_traced_norm", "check_input", "finish",
           "fused_finish", "norm_input_failed", "parameter_alias", "prologue", "rows_of", "shared_index"]
