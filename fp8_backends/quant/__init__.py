"""FP8 activation quantization as torch library ops.

Three ops, defined with :func:`fp8_backends.core.oplib.define_ops` (each with a fake implementation, so
``torch.compile`` traces them without running them) on first use, never at import, for CPU and CUDA tensors:

========================================  =========================================================
op                                        semantics (``fmax`` = 448 for e4m3fn, 57344 for e5m2)
========================================  =========================================================
``fp8_backends::quant_static``            ``q = clamp(x / scale, ±fmax) -> fp8``; ``scale`` given
``fp8_backends::quant_dynamic``           ``scale = max(amax(|x|) / fmax, 1e-12)`` as ``[1]``, then as above
``fp8_backends::quant_per_token``         ``scale[m] = max(amax(|x[m, :]|) / fmax, 1e-12)`` as ``[M, 1]``
``fp8_backends::quant_per_token_group``   ``scale[m, g] = max(amax(|x[m, gG:(g+1)G]|) / fmax, 1e-12)`` as
                                          ``[M, ceil(K/G)]`` in the requested :class:`ScaleLayout`
========================================  =========================================================

``x`` is ``[M, K]`` bf16/fp16/fp32 on any device, with any strides (a transposed view, a column slice of a wider
buffer, broadcast rows of stride 0); ``q`` is always a new row-major ``[M, K]`` tensor (the layout every GEMM kernel
reads); scales are fp32 on ``x``'s device. Dynamic scales are computed on the device: no op here synchronises with
the host.

Implementations: a kernel registered per mode and device type with :func:`register_quant_impl` always wins
(``x.device.type`` picks the entry at run time). Without one, the default is a provider's, through the provider hook
:meth:`~fp8_backends.core.backend.ProviderBase.activation_quant_kernels`: the first provider, in ``auto``'s order
(priority, built-ins first), that lists the device type in its ``activation_quant_devices``, is usable here (not
disabled by ``FP8_BACKENDS_DISABLED``, blocked by ``FP8_BACKENDS_PLUGINS`` or unavailable) and answers with kernels;
else :mod:`fp8_backends.core.reference`. This module names no provider. With the built-ins:

- CUDA tensors: the built-in ``triton`` norm-quant provider supplies its Triton quant kernels when triton is
  installed, the provider is not disabled and every visible GPU is SM >= 8.9 (FP8 conversions); otherwise the
  reference. Decided once per device type and process, at the first call on it (which imports triton; each new
  kernel configuration then compiles at its first use: make those first calls outside CUDA graph capture); later
  calls cost a dict lookup. :func:`reset_default_impls` forgets the decision; :func:`default_quant_impl` tells
  what it is.
- every other device type (the CPU included): :mod:`fp8_backends.core.reference`.

Under ``torch.compile`` the public functions trace the reference torch code inline instead of the
opaque op (``set_compile_mode("inline")``, the default), so Inductor can fuse the quantization into
whatever produced ``x`` (an activation, a transpose, SiLU·mul): one kernel and one pass over ``x``
instead of two. ``set_compile_mode("op")`` keeps the op (and any registered kernel) in compiled
graphs too. Eager calls always go through the op.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..core import validation as V
from ..core.backend import on_provider_refresh
from ..core.errors import BackendUnavailableError, InvalidInputError
from ..core.oplib import LazyOps
from ..core.types import (
    DEFAULT_GROUP_SIZE,
    GROUP_SIZES,
    ActScale,
    Fp8Dtype,
    OutDtype,
    QuantizedActivation,
    ScaleLayout,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("fp8_backends")

#: ``fn(x, scale, fp8_dtype) -> q`` for the static mode; ``fn(x, fp8_dtype) -> (q, scale)`` otherwise
QuantImpl = Callable[..., Any]

_impls: dict[tuple[ActScale, str], QuantImpl] = {}
_lock = threading.Lock()
_compile_mode = "inline"

_OP_NAMES = {
    ActScale.PER_TENSOR_STATIC: "quant_static",
    ActScale.PER_TENSOR_DYNAMIC: "quant_dynamic",
    ActScale.PER_TOKEN: "quant_per_token",
    ActScale.PER_TOKEN_GROUP: "quant_per_token_group",
}


def register_quant_impl(mode: ActScale | str, device_type: str, fn: QuantImpl | None) -> QuantImpl | None:
    """Use ``fn`` for ``mode`` on tensors of ``device_type`` (``"cuda"``, ``"cpu"``, ...).

    - static: ``fn(x: [M, K], scale: fp32 one value, fp8_dtype: torch.dtype) -> q: [M, K]``
    - dynamic / per-token: ``fn(x: [M, K], fp8_dtype) -> (q: [M, K], scale: [1] or [M, 1] fp32)``
    - per-token-group: ``fn(x: [M, K], group_size: int, scale_layout: str, fp8_dtype) -> (q: [M, K], scale:
      [M, ceil(K/G)] fp32 in that layout)`` (:class:`~fp8_backends.core.types.ScaleLayout` values)

    ``fn`` must return new tensors (never views of its inputs), run without host syncs, and follow
    the semantics in this module's docstring; ``x`` may have any strides (a transposed view, a column slice,
    broadcast rows) and ``q`` should be row-major (codes returned in another layout are copied into one).
    An ``fn`` that can write its codes zero-padded to a wider row (for layers whose provider padded the weight's K:
    :func:`padded_quantizer`) says so with a ``pads_output = True`` attribute and takes a keyword ``k_out`` (the
    padded width; row-major ``[M, k_out]`` codes, zeros beyond K; static, dynamic and per-token modes).
    A per-token-group ``fn`` may name, as its ``traced`` attribute, a callable of the same signature (and promise) that
    ``torch.compile`` can trace into kernels it launches itself (an op whose traced body launches the kernel through
    ``torch.library.wrap_*``; a ``load`` attribute of that callable, if any, is called once at load time): compiled
    layers call it where the token count may be dynamic (:func:`traced_group_kernel`).
    ``fn=None`` removes the entry. Returns the entry it replaced (or None), so a caller can restore it.
    """
    mode = ActScale.of(mode)
    key = (mode, str(device_type))
    with _lock:
        previous = _impls.get(key)
        if fn is None:
            _impls.pop(key, None)
        else:
            if not callable(fn):
                raise InvalidInputError(f"register_quant_impl needs a callable, got {type(fn).__name__}")
            _impls[key] = fn
    logger.debug("quant impl for %s on %s: %r", mode.value, device_type, fn)
    return previous


def registered_quant_impl(mode: ActScale | str, device_type: str) -> QuantImpl | None:
    """The kernel registered for ``mode`` on ``device_type`` (None: the reference runs)."""
    return _impls.get((ActScale.of(mode), str(device_type)))


def compile_mode() -> str:
    """The current compile mode (:func:`set_compile_mode`): ``"inline"`` or ``"op"``."""
    return _compile_mode


def set_compile_mode(mode: str) -> str:
    """``"inline"`` (default): under torch.compile trace the reference torch code so the compiler can
    fuse it; ``"op"``: keep the library op (and registered kernels) in compiled graphs. It also decides what a
    compiled :class:`~fp8_backends.layers.RMSNormFp8Quant` resolved by ``auto`` traces (the reference torch code
    under ``"inline"``, its provider's op under ``"op"``). Returns the previous mode."""
    global _compile_mode
    if mode not in ("inline", "op"):
        raise InvalidInputError(f"compile mode must be 'inline' or 'op', got {mode!r}")
    if mode == "op":
        _OPS.preload()  # defined now: a first call inside torch.compile tracing cannot define them (Dynamo and locks)
    previous, _compile_mode = _compile_mode, mode
    return previous


# ---------------------------------------------------------------------------------------------- ops
def _reference_static(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    from ..core import reference

    return reference.quantize_static(x, scale, fp8_dtype)


def _reference_dynamic(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from ..core import reference

    return reference.quantize_dynamic_per_tensor(x, fp8_dtype)


def _reference_per_token(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from ..core import reference

    return reference.quantize_per_token(x, fp8_dtype)


def _reference_per_token_group(x: torch.Tensor, group_size: int, scale_layout: str,
                               fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from ..core import group_scales, reference

    q, scale = reference.quantize_per_token_group(x, group_size, fp8_dtype)
    return q, group_scales.to_layout(scale, ScaleLayout.of(scale_layout))


_REFERENCE: dict[ActScale, QuantImpl] = {
    ActScale.PER_TENSOR_STATIC: _reference_static,
    ActScale.PER_TENSOR_DYNAMIC: _reference_dynamic,
    ActScale.PER_TOKEN: _reference_per_token,
    ActScale.PER_TOKEN_GROUP: _reference_per_token_group,
}


#: the default per (mode, device type) when nothing is registered; filled at the first call per device type
_defaults: dict[tuple[ActScale, str], QuantImpl] = {}


def _provider_kernels(device_type: str) -> tuple[dict[ActScale, QuantImpl], str, list[str]]:
    """The activation-quant kernels the providers supply for ``device_type`` (the provider hook
    :meth:`~fp8_backends.core.backend.ProviderBase.activation_quant_kernels`): ``(kernels, provider, reasons)`` from the
    first provider, in ``auto``'s order (priority, built-ins first, name), that declares ``device_type`` in its
    ``activation_quant_devices``, is usable (not disabled, blocked or unavailable) and answers; ``({}, "", reasons)``
    when none does, ``reasons`` saying why each provider asked could not serve. A provider whose hook raises anything
    but :class:`~fp8_backends.core.errors.BackendUnavailableError` (a broken install) is passed over with a WARNING."""
    from fp8_backends.registry import candidates, discovery

    entries = [e for kind in ("norm_quant", "gemm") for e in discovery.discover(kind)
               if e.cls is not None and device_type in getattr(e.cls, "activation_quant_devices", ())]
    entries.sort(key=lambda e: (*candidates.rank_key(e), e.kind))
    reasons: list[str] = []
    for entry in entries:
        who = f"{entry.name} ({entry.dist})"
        why = entry.unusable_reason()
        if why is None:
            try:
                kernels = dict(entry.cls.activation_quant_kernels(device_type))
            except BackendUnavailableError as exc:
                why = str(exc)
            except Exception as exc:  # a broken kernel install must not break quantization
                logger.warning("quant: %s's activation-quant kernels are unusable on %s (%s: %s); passing over them",
                               who, device_type, type(exc).__name__, exc)
                why = f"raised {type(exc).__name__}: {exc}"
            else:
                if kernels:
                    return {ActScale.of(mode): fn for mode, fn in kernels.items()}, who, reasons
                continue
        reasons.append(f"{who}: {why}")
    return {}, "", reasons


def _resolve_default(mode: ActScale, device_type: str) -> QuantImpl:
    """Decide (once per device type) what runs when no impl is registered; see the module docstring."""
    with _lock:
        fn = _defaults.get((mode, device_type))
        if fn is not None:
            return fn
        chosen: dict[ActScale, QuantImpl] = dict(_REFERENCE)
        try:
            kernels, who, reasons = _provider_kernels(device_type)
        except Exception as exc:  # a broken registry or plugin must not break quantization
            logger.warning("quant: cannot ask the providers for %s activation-quant kernels (%s: %s); using the "
                           "reference", device_type, type(exc).__name__, exc)
            kernels, who, reasons = {}, "", []
        if kernels:
            chosen.update(kernels)
            logger.debug("quant: the %s default is %s's kernels (%s)", device_type, who,
                         ", ".join(m.value for m in kernels))
        elif reasons:
            logger.info("quant: the %s default is the reference torch code, not a provider's kernels (%s)",
                        device_type.upper(), "; ".join(reasons))
        for m, impl in chosen.items():
            _defaults[(m, device_type)] = impl
        return chosen[mode]


def reset_default_impls() -> None:
    """Forget the per-device-type default decisions (tests; after changing ``FP8_BACKENDS_DISABLED``; the registry's
    ``refresh`` calls it)."""
    with _lock:
        _defaults.clear()


on_provider_refresh(reset_default_impls)


def default_quant_impl(mode: ActScale | str, device_type: str) -> QuantImpl:
    """What runs for ``mode`` on ``device_type`` when nothing is registered (decides it if needed)."""
    mode = ActScale.of(mode)
    return _defaults.get((mode, str(device_type))) or _resolve_default(mode, str(device_type))


def _impl_for(mode: ActScale, device_type: str) -> QuantImpl:
    key = (mode, device_type)
    return _impls.get(key) or _defaults.get(key) or _resolve_default(mode, device_type)


# The ops' bodies. Whatever the implementation, the codes come out row-major with strides (K, 1) (what the fake
# implementations promise and every GEMM kernel reads, reference.row_major): an implementation that kept a strided
# x's layout gets its codes copied (fp8, M x K bytes); the library's own write row-major codes (two stride reads).
def _row_major(q):
    if q.stride(-1) == 1 and q.stride(0) == max(q.shape[-1], 1):
        return q
    from ..core import reference

    return reference.row_major(q)


def _op_static(x, scale, fp8_dtype):
    return _row_major(_impl_for(ActScale.PER_TENSOR_STATIC, x.device.type)(x, scale, fp8_dtype))


def _op_dynamic(x, fp8_dtype):
    q, scale = _impl_for(ActScale.PER_TENSOR_DYNAMIC, x.device.type)(x, fp8_dtype)
    return _row_major(q), scale


def _op_per_token(x, fp8_dtype):
    q, scale = _impl_for(ActScale.PER_TOKEN, x.device.type)(x, fp8_dtype)
    return _row_major(q), scale


def _op_per_token_group(x, group_size, scale_layout, fp8_dtype):
    q, scale = _impl_for(ActScale.PER_TOKEN_GROUP, x.device.type)(x, group_size, scale_layout, fp8_dtype)
    return _row_major(q), scale


def _fake_static(x, scale, fp8_dtype):
    return x.new_empty(x.shape, dtype=fp8_dtype)


def _fake_dynamic(x, fp8_dtype):
    import torch

    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty((1,), dtype=torch.float32)


def _fake_per_token(x, fp8_dtype):
    import torch

    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def _fake_per_token_group(x, group_size, scale_layout, fp8_dtype):
    from ..core import group_scales

    groups = -(-x.shape[1] // group_size)
    scale = group_scales.empty_group_scale(x.shape[0], groups, ScaleLayout.of(scale_layout), x.device)
    return x.new_empty(x.shape, dtype=fp8_dtype), scale


_SCHEMAS = {
    ActScale.PER_TENSOR_STATIC: ("(Tensor x, Tensor scale, ScalarType fp8_dtype) -> Tensor", _op_static, _fake_static),
    ActScale.PER_TENSOR_DYNAMIC: ("(Tensor x, ScalarType fp8_dtype) -> (Tensor, Tensor)", _op_dynamic, _fake_dynamic),
    ActScale.PER_TOKEN: ("(Tensor x, ScalarType fp8_dtype) -> (Tensor, Tensor)", _op_per_token, _fake_per_token),
    ActScale.PER_TOKEN_GROUP: ("(Tensor x, int group_size, str scale_layout, ScalarType fp8_dtype) -> (Tensor, Tensor)",
                               _op_per_token_group, _fake_per_token_group),
}


_OPS = LazyOps(  # defined on first use
    {_OP_NAMES[mode]: (_OP_NAMES[mode] + schema, impl, fake) for mode, (schema, impl, fake) in _SCHEMAS.items()},
    ("CPU", "CUDA"),
)


def quant_op(mode: ActScale | str) -> Any:
    """The op for ``mode`` (defined on first call): ``torch.ops.fp8_backends.<name>.default``."""
    return _OPS.op(_OP_NAMES[ActScale.of(mode)])


def _call(mode: ActScale) -> Any:
    """The op for ``mode`` as the hot path calls it (:func:`fp8_backends.core.oplib.eager_fast`)."""
    return _OPS.call(_OP_NAMES[mode])


def op_call(mode: ActScale | str) -> Any:
    """The op for ``mode`` as a callable for hot paths that validated their input at load time: a plain eager
    call runs the implementation directly (:func:`fp8_backends.core.oplib.eager_fast`), anything else goes through
    the op. Static: ``(x, scale, fp8_dtype) -> q``; dynamic / per-token: ``(x, fp8_dtype) -> (q, scale)``;
    per-token-group: ``(x, group_size, scale_layout, fp8_dtype) -> (q, scale)``."""
    return _call(ActScale.of(mode))


# ------------------------------------------------------------------------------------- public API
def _check_x(x: object, what: str = "x") -> None:
    V.require_tensor(x, what)
    try:
        OutDtype.of(x.dtype)
    except ValueError:
        raise InvalidInputError(f"{what} must be bfloat16, float16 or float32 to quantize, got {x.dtype}") from None
    if x.dim() != 2:
        raise InvalidInputError(f"{what} must be 2-D [M, K], got shape {tuple(x.shape)}")


def _fp8(dtype: object) -> torch.dtype:
    try:
        return Fp8Dtype.of(dtype).torch_dtype()
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None


def _inline() -> bool:
    import torch

    return _compile_mode == "inline" and torch.compiler.is_compiling()


def quantize_checked(x: torch.Tensor, mode: ActScale, scale: torch.Tensor | None = None,
                     dtype: object = Fp8Dtype.E4M3FN, group_size: int = DEFAULT_GROUP_SIZE,
                     scale_layout: ScaleLayout = ScaleLayout.ROW_MAJOR) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K], scale)`` of ``x`` quantized in ``mode`` (an :class:`ActScale`), for callers that checked ``x``
    (a ``[M, K]`` bf16/fp16/fp32 tensor) and, static, ``scale`` (fp32, one value, on ``x``'s device) themselves, as
    the public functions below and a linear's general path (:mod:`fp8_backends.layers.general_path`) do: nothing is
    checked again. ``group_size`` and ``scale_layout`` (a :class:`ScaleLayout`) are the per-token-group mode's. Under
    ``torch.compile`` in compile mode ``"inline"`` the reference torch code (which the compiler fuses into the
    producer), otherwise the mode's op."""
    fp8 = _fp8(dtype)
    if _inline():
        from ..core import reference

        if mode is ActScale.PER_TENSOR_STATIC:
            return reference.quantize_static(x, scale, fp8), scale
        if mode is ActScale.PER_TENSOR_DYNAMIC:
            return reference.quantize_dynamic_per_tensor(x, fp8)
        if mode is ActScale.PER_TOKEN:
            return reference.quantize_per_token(x, fp8)
        return traced_quantize_groups(x, group_size, fp8, Fp8Dtype.of(fp8).max, scale_layout)
    if mode is ActScale.PER_TENSOR_STATIC:
        return _call(mode)(x, scale, fp8), scale
    if mode is ActScale.PER_TOKEN_GROUP:
        return _call(mode)(x, group_size, scale_layout.value, fp8)
    return _call(mode)(x, fp8)


def padded_quantizer(mode: ActScale, fp8_dtype: torch.dtype, input_scale: torch.Tensor | None,
                     k_pad: int) -> Callable[[Any], Any]:
    """``x [M, K] -> (q [M, k_pad], scale)``: ``mode``'s quantization (not per-token-group) with the codes
    zero-padded to ``k_pad`` columns, for the layers whose provider padded the weight's K
    (:attr:`~fp8_backends.core.types.PreparedWeight.k_pad`). The implementation for ``x``'s device type (looked up at
    each call, as the ops do) writes the padded codes itself when it says it can (a ``pads_output = True``
    attribute: it takes ``k_out=k_pad`` and returns row-major ``[M, k_pad]`` codes: the built-in Triton kernels), so
    the pad costs nothing; otherwise the codes are padded after it (:func:`fp8_backends.core.padding.pad_columns`).
    Static: ``input_scale`` is the layer's scale, returned as the scale."""
    import torch

    from ..core.padding import pad_columns

    static = mode is ActScale.PER_TENSOR_STATIC
    if mode is ActScale.PER_TOKEN_GROUP:
        raise InvalidInputError("per-token-group codes are not padded (block-wise providers serve any K)")

    def quantize_padded(x: Any) -> Any:
        if not torch.compiler.is_compiling():
            impl = _impl_for(mode, x.device.type)
            if getattr(impl, "pads_output", False):
                if static:
                    return impl(x, input_scale, fp8_dtype, k_out=k_pad), input_scale
                return impl(x, fp8_dtype, k_out=k_pad)
        q, scale = quantize_checked(x, mode, input_scale, fp8_dtype)
        return pad_columns(q, k_pad), scale

    return quantize_padded


def traced_group_kernel(device_type: str) -> Callable[..., Any] | None:
    """The per-token-group implementation's ``traced`` callable for ``device_type`` (:func:`register_quant_impl`),
    or ``None``: what a compiled layer quantizes more than one token with (looked up at load time).

    Compiled with a dynamic M, the reference torch code (:func:`traced_quantize_groups`) becomes 3-4 Inductor kernels
    after a norm or SiLU·mul (group amax, codes, the scale's transposed store: Inductor does not keep them in one
    kernel when M is symbolic) against one launch of a Triton kernel Inductor launches itself; with a static M it
    stays in the producer's kernel(s) (H200, ``bench/results/hf_model/2026-12-04-h200-qwen3-block-quant-layout/``)."""
    fn = getattr(_impl_for(ActScale.PER_TOKEN_GROUP, device_type), "traced", None)
    if not callable(fn):
        return None
    load = getattr(fn, "load", None)  # define what it calls now: Dynamo cannot trace an op's definition
    if callable(load):
        load()
    return fn


def traced_quantize_groups(x: torch.Tensor, group_size: int, fp8: torch.dtype, fmax: float,
                           layout: ScaleLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_backends.core.reference.quantize_groups` of ``x [M, K]`` with the scale written in ``layout``, as
    torch ops from which Inductor emits the codes and the scale in the scale's layout from one kernel (the
    quantization's own, fused into the producer's where it can be).

    ``m_major_tma`` pads its column stride to a multiple of 4 tokens: re-laying out an ``[M, G]`` scale into that
    padded buffer is a copy over another iteration space (``M`` rows read, ``round_up(M, 4)`` written), which Inductor
    emits as a kernel of its own, one more launch per linear (every compiled call whose M is not known to be a multiple
    of 4: decode, and every M under dynamic shapes). So the input is zero-padded to ``round_up(M, 4)`` rows first: the
    quantization runs over the padded rows (a zero group quantizes to zero codes and the smallest scale), writes the
    padded transposed scale in place, and the first ``M`` rows of codes and scale columns are returned as views (codes
    row-major ``[M, K]``, rows ``K`` apart)."""
    from ..core import group_scales, reference

    if layout is ScaleLayout.M_MAJOR_TMA:
        import torch

        m = x.shape[0]
        padded = torch.nn.functional.pad(x, (0, 0, 0, (-m) % group_scales.TMA_ALIGN))
        q, s = reference.quantize_groups(padded, group_size, fp8, fmax)
        return q[:m], s.t().contiguous()[:, :m].t()
    q, s = reference.quantize_groups(x, group_size, fp8, fmax)
    return q, traced_layout(s, layout)


def traced_layout(scale: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """``scale [M, G]`` (any layout) in ``layout``, as torch ops a compiler can fuse into the quantization that made
    it; ``scale`` itself when it is in ``layout`` already (a quantized activation made for this consumer). A scale
    this code quantizes is written in its layout by :func:`traced_quantize_groups` instead (``m_major_tma``'s padding
    is a copy of its own here)."""
    from ..core import group_scales

    if group_scales.is_layout(scale, layout):
        return scale
    if layout is ScaleLayout.M_MAJOR:
        return scale.t().contiguous().t()
    return group_scales.to_layout(scale, layout)


def quantize_static(x: torch.Tensor, scale: torch.Tensor, dtype: object = Fp8Dtype.E4M3FN) -> torch.Tensor:
    """``clamp(x / scale, ±fmax) -> fp8``. ``x: [M, K]`` bf16/fp16/fp32; ``scale``: fp32, one value
    (0-d, ``[1]`` or ``[1, 1]``) on ``x``'s device. Returns ``[M, K]`` in ``dtype`` (e4m3fn default)."""
    _check_x(x)
    V.require_fp32_scale(scale, "scale")
    if not V.is_scalar_shape(scale):
        raise InvalidInputError(f"a static scale holds one value, got shape {tuple(scale.shape)}")
    V.require_same_device(scale, "scale", x.device)
    V.check_scale_values(scale, "scale")
    return quantize_checked(x, ActScale.PER_TENSOR_STATIC, scale, dtype)[0]


def quantize_dynamic(x: torch.Tensor, dtype: object = Fp8Dtype.E4M3FN) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic quantization of ``x: [M, K]``; returns ``(q [M, K], scale [1] fp32)``,
    the scale computed on ``x``'s device."""
    _check_x(x)
    return quantize_checked(x, ActScale.PER_TENSOR_DYNAMIC, None, dtype)


def quantize_per_token(x: torch.Tensor, dtype: object = Fp8Dtype.E4M3FN) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic quantization of ``x: [M, K]``; returns ``(q [M, K], scale [M, 1] fp32)``."""
    _check_x(x)
    return quantize_checked(x, ActScale.PER_TOKEN, None, dtype)


def quantize_per_token_group(
    x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, dtype: object = Fp8Dtype.E4M3FN,
    scale_layout: ScaleLayout | str = ScaleLayout.ROW_MAJOR,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group dynamic quantization of ``x: [M, K]`` (any strides) in groups of ``group_size`` (64 or 128)
    along K; returns ``(q [M, K] row-major, scale [M, ceil(K/G)] fp32)``, the scale written in ``scale_layout`` (the
    layout the consuming GEMM reads: its ``capabilities.group_scale_layout``)."""
    _check_x(x)
    if type(group_size) is not int or group_size not in GROUP_SIZES:  # 64.0 == 64, but a float cannot shape a view
        raise InvalidInputError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}")
    return quantize_checked(x, ActScale.PER_TOKEN_GROUP, None, dtype, group_size, ScaleLayout.of(scale_layout))


def quantize(
    x: torch.Tensor,
    mode: ActScale | str,
    scale: torch.Tensor | None = None,
    dtype: object = Fp8Dtype.E4M3FN,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    scale_layout: ScaleLayout | str = ScaleLayout.ROW_MAJOR,
) -> QuantizedActivation:
    """Quantize ``x: [M, K]`` in ``mode`` and wrap the result as a :class:`QuantizedActivation`
    (``orig_dtype = x.dtype``). ``scale`` is required for the static mode and refused otherwise; ``group_size``
    and ``scale_layout`` are the per-token-group mode's (:func:`quantize_per_token_group`)."""
    mode = ActScale.of(mode)
    if mode is ActScale.PER_TENSOR_STATIC:
        if scale is None:
            raise InvalidInputError("static quantization needs a scale (the layer's input_scale)")
        return QuantizedActivation(quantize_static(x, scale, dtype), scale, x.dtype, mode)
    if scale is not None:
        raise InvalidInputError(f"{mode.value} quantization computes its own scale; do not pass one")
    if mode is ActScale.PER_TENSOR_DYNAMIC:
        q, s = quantize_dynamic(x, dtype)
    elif mode is ActScale.PER_TOKEN_GROUP:
        q, s = quantize_per_token_group(x, group_size, dtype, scale_layout)
    else:
        q, s = quantize_per_token(x, dtype)
    return QuantizedActivation(q, s, x.dtype, mode)


__all__ = [
    "compile_mode",
    "default_quant_impl",
    "op_call",
    "padded_quantizer",
    "quant_op",
    "quantize",
    "quantize_checked",
    "quantize_dynamic",
    "quantize_per_token",
    "quantize_per_token_group",
    "traced_group_kernel",
    "traced_layout",
    "traced_quantize_groups",
    "quantize_static",
    "register_quant_impl",
    "registered_quant_impl",
    "reset_default_impls",
    "set_compile_mode",
]
