"""The general path of an FP8 linear call, ``y [..., N] = x [..., K] @ Wᵀ (+ bias)``, read top-down:

1. the activation. A :class:`~fp8_backends.core.types.QuantizedActivation` in the linear's mode is used as is
   (:func:`unpack_quantized`). A high-precision ``x`` is checked once, with the static scale it is quantized with
   (:func:`check_activation`), then quantized once (:func:`fp8_backends.quant.quantize_checked`: the mode's op, or
   the reference torch code that ``torch.compile`` fuses into the producer);
2. the GEMM. A per-M composite (:class:`~fp8_backends.registry.per_m.PerMGemm`) picks the row of the batch's M
   bucket; the provider's :meth:`~fp8_backends.core.backend.Fp8GemmBackend.gemm` checks its operands' metadata and
   runs the kernel; leading dims are restored.

What takes it: the calls of a :class:`~fp8_backends.layers.Fp8Linear` its eager and traced plans leave (a dispatch
mode or tensor subclass, a QuantizedActivation, an empty input, an input a plan refuses, which this path then
explains with the library's errors), and :func:`fp8_backends.fp8_linear`. Metadata checks only: no host-device sync
(scale values are read for CPU scales, or when ``FP8_BACKENDS_CHECK_SCALES`` asks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import quant
from ..core import reference
from ..core import validation as V
from ..core.errors import InvalidInputError
from ..core.types import ActScale, Fp8Dtype, OutDtype, PreparedWeight, QuantizedActivation

if TYPE_CHECKING:
    import torch

    from ..core.backend import Fp8GemmBackend
    from ..registry.per_m import PerMGemm


def apply_fp8_linear(
    x: torch.Tensor | QuantizedActivation,
    backend: Fp8GemmBackend | PerMGemm,
    prepared: PreparedWeight | None = None,
    *,
    act_scale: ActScale,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: OutDtype | None = None,
    input_dtype: Fp8Dtype = Fp8Dtype.E4M3FN,
) -> torch.Tensor:
    """The shared forward of :class:`~fp8_backends.layers.Fp8Linear` and :func:`~fp8_backends.fp8_linear`.

    - ``backend`` and ``prepared``: a provider and the weight it prepared; or a per-M composite
      (:class:`~fp8_backends.registry.per_m.PerMGemm`) alone, ``prepared`` None: the provider of the batch's M
      bucket serves, with its prepared weight.
    - ``x``: ``[..., K]`` high-precision (bf16/fp16/fp32; quantized here in ``act_scale`` mode) or a
      :class:`QuantizedActivation` whose ``data`` is ``[..., K]`` fp8 (used as is; its ``mode`` must
      equal ``act_scale``).
    - ``out_dtype``: the dtype the caller was prepared for; ``x.dtype`` (or ``orig_dtype``) must match
      it. ``None``: follow the input.
    - Returns ``[..., N]`` in that dtype; leading dims are flattened for the GEMM and restored.

    A composite chosen under the ``auto`` selection objective whose ``kernel`` and ``host`` rows differ
    (:attr:`~fp8_backends.registry.per_m.PerMGemm.split`) runs its CUDA-graph rows (``kernel``) for a call made
    eagerly while a CUDA graph is being captured, and its other rows (``host``) otherwise. Under ``torch.compile``
    it is always the ``host`` rows: Dynamo traces the call before any graph is captured (``mode="reduce-overhead"``
    and a captured compiled step replay what was traced), and the compiled path without CUDA graphs is exactly
    where the host enqueues every call.
    """
    kernel = None
    if prepared is None:  # a per-M composite: its row for this batch's M is picked below
        kernel = backend
        k, n = kernel.k, kernel.n
        group_size, layout_of = kernel.prepared.group_size, kernel.backend
    else:
        k, n = prepared.k, prepared.n
        group_size, layout_of = prepared.group_size, backend
    # 1. the activation: quantized by the caller, or here
    if isinstance(x, QuantizedActivation):
        x_q, scale = unpack_quantized(x, act_scale, k, group_size)
        out = _out_dtype(x.orig_dtype, out_dtype, "QuantizedActivation.orig_dtype")
        lead = x.data.shape[:-1]
    else:
        out = check_activation(x, k, out_dtype, act_scale, input_scale)
        # the activation's FP8 type against the provider before it is quantized (no kernel for a refused call)
        layout_of.check_input_dtype(input_dtype, (kernel.prepared if kernel is not None else prepared).dtype)
        lead = x.shape[:-1]
        if x.numel() == 0:
            return _empty(lead, n, out, x.device)
        scale = input_scale if act_scale is ActScale.PER_TENSOR_STATIC else None
        if scale is not None:
            check_static_scale(scale, x.device)
        if act_scale is ActScale.PER_TOKEN_GROUP:  # in the layout the weight's (default) provider reads
            x_q, scale = quant.quantize_checked(x.reshape(-1, k), act_scale, None, input_dtype, group_size,
                                                layout_of.capabilities.group_scale_layout)
        else:
            x_q, scale = quant.quantize_checked(x.reshape(-1, k), act_scale, scale, input_dtype)
    if x_q.shape[0] == 0:
        return _empty(lead, n, out, x_q.device)
    # 2. the GEMM of the batch's M bucket
    if kernel is not None:
        graph = False
        if kernel.split:  # the auto objective's kernel and host rows differ: which one serves depends on capture
            from ..registry.per_m import capturing

            graph = capturing()
        _, backend, prepared = kernel.pick(x_q.shape[0], graph)
    y = backend.gemm(x_q, prepared, scale, out_dtype=out, bias=bias)
    return y.reshape(*lead, n)


def check_activation(x: object, k: int, expected: OutDtype | None, act_scale: ActScale,
                     input_scale: torch.Tensor | None) -> OutDtype:
    """The output dtype of a linear over the high-precision input ``x``, after checking it: a tensor of a model dtype
    (``expected``, when not None), ``[..., K]``, and given an ``input_scale`` when ``act_scale`` is static. Raises
    :class:`InvalidInputError` (:class:`~fp8_backends.core.errors.InvalidTypeError` for a non-tensor)."""
    V.require_tensor(x, "x")
    out = _out_dtype(x.dtype, expected, "x")
    if x.dim() < 1 or x.shape[-1] != k:
        raise InvalidInputError(f"x must be [..., K={k}], got {tuple(x.shape)}")
    if act_scale is ActScale.PER_TENSOR_STATIC and input_scale is None:
        raise InvalidInputError("a static per-tensor linear needs input_scale")
    return out


def check_static_scale(scale: object, device: torch.device) -> None:
    """A static scale to quantize an input on ``device`` with: fp32, one value (0-d, ``[1]`` or ``[1, 1]``), on that
    device, finite and > 0 (values read for CPU scales only, unless ``FP8_BACKENDS_CHECK_SCALES`` asks)."""
    V.require_fp32_scale(scale, "scale")
    if not V.is_scalar_shape(scale):
        raise InvalidInputError(f"a static scale holds one value, got shape {tuple(scale.shape)}")
    V.require_same_device(scale, "scale", device)
    V.check_scale_values(scale, "scale")


def unpack_quantized(x: QuantizedActivation, act_scale: ActScale, k: int,
                     group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q [M, K], scale)`` of a :class:`QuantizedActivation` handed to a linear prepared for ``act_scale``
    activations of width ``k``: its mode must be ``act_scale`` (a linear never re-quantizes), its data ``[..., K]``
    with any strides (returned row-major: leading dims flattened, a strided view copied), a per-token scale
    ``[..., 1]`` with one value per row (returned ``[M, 1]`` contiguous) and a
    per-token-group scale ``[..., ceil(K/group_size)]`` (returned ``[M, ceil(K/G)]``, its layout kept when it is 2-D).
    Raises :class:`InvalidInputError`; the data's dtype and device are the caller's to check."""
    data, scale, _, mode = x
    if ActScale.of(mode) is not act_scale:  # .of: a dict lookup, safe while torch.compile traces
        raise InvalidInputError(
            f"this linear was prepared for {act_scale.value} activations but got a QuantizedActivation "
            f"in {ActScale.of(mode).value} mode; it never re-quantizes (quantize for the consumer's mode)"
        )
    V.require_tensor(data, "QuantizedActivation.data")
    if data.dim() < 1 or data.shape[-1] != k:
        raise InvalidInputError(f"QuantizedActivation.data must be [..., K={k}], got {tuple(data.shape)}")
    x_q = reference.row_major(data.reshape(-1, k))  # any strides in, the row-major codes every kernel reads out
    if act_scale is ActScale.PER_TOKEN:
        V.require_tensor(scale, "QuantizedActivation.scale")
        if scale.numel() != x_q.shape[0] or (scale.dim() > 0 and scale.shape[-1] != 1):
            raise InvalidInputError(
                f"a per-token scale must be [..., 1] with one value per row ({x_q.shape[0]}), "
                f"got {tuple(scale.shape)}"
            )
        scale = scale.reshape(-1, 1).contiguous()
    elif act_scale is ActScale.PER_TOKEN_GROUP:
        V.require_tensor(scale, "QuantizedActivation.scale")
        groups = -(-k // (group_size or 128))
        if scale.dim() < 1 or scale.shape[-1] != groups or scale.numel() != x_q.shape[0] * groups:
            raise InvalidInputError(
                f"a per-token-group scale must be [..., ceil(K/{group_size})] = [..., {groups}] with one row per "
                f"token ({x_q.shape[0]}), got {tuple(scale.shape)}")
        if scale.dim() != 2:
            scale = scale.reshape(-1, groups)
    return x_q, scale


def _out_dtype(dtype: torch.dtype, expected: OutDtype | None, what: str) -> OutDtype:
    try:
        got = OutDtype.of(dtype)
    except ValueError:
        hint = ""
        if "float8" in str(dtype) and what == "x":  # e.g. T5's feed-forward casts its input to wo.weight.dtype
            hint = (": the model cast this linear's input to its weight's dtype (float8 here; unscaled, the values are "
                    "lost): keep the module out of quantize_model (skip=[...])")
        raise InvalidInputError(f"{what} must be bfloat16, float16 or float32, got {dtype}{hint}") from None
    if expected is not None and got is not expected:
        raise InvalidInputError(
            f"{what} is {got.value} but this linear was prepared for {expected.value} activations and outputs"
        )
    return got


def _empty(lead: tuple[int, ...], n: int, out: OutDtype, device: torch.device) -> torch.Tensor:
    """The ``[*lead, N]`` result of an empty batch (no GEMM runs)."""
    import torch

    return torch.empty((*lead, n), dtype=out.torch_dtype(), device=device)


__all__ = ["apply_fp8_linear", "check_activation", "check_static_scale", "unpack_quantized"]
