"""``fp8_linear``: the FP8 linear as a function, for engines that keep their own modules.

Load time (once per weight)::

    backend = resolve_gemm_backend(None, problem=GemmProblem(n=N, k=K, act_scale="per_tensor_static",
                                                             device="cuda"))
    prepared = backend.prepare_weight(w_q, w_scale)          # w_q [N, K] fp8, w_scale fp32

Per call::

    y = fp8_linear(x, prepared, backend=backend, input_scale=s_in, bias=b)   # x [..., K] bf16

or ``fp8_linear(x, layer)`` with an :class:`~fp8_backends.layers.Fp8Linear`. A raw fp8 weight is
refused: preparing it per call would convert (and check) the weight on the hot path.

Per-M choice (``auto`` picking one provider for decode batches and another for prefill, as ``Fp8Linear`` does):
choose and prepare once with :func:`~fp8_backends.registry.per_m.init_fp8_gemm`, then pass the composite::

    kernel = init_fp8_gemm(w_q, w_scale, problem=GemmProblem(n=N, k=K, act_scale="per_tensor_static",
                                                           device="cuda"))   # backend: auto (or a name)
    y = fp8_linear(x, kernel, input_scale=s_in, bias=b)      # the provider of x's M bucket serves
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core import validation as V
from .core.backend import Fp8GemmBackend
from .core.errors import InvalidInputError
from .core.types import ActScale, Fp8Dtype, OutDtype, PreparedWeight, QuantizedActivation

if TYPE_CHECKING:
    import torch

    from .layers import Fp8Linear
    from .registry.per_m import PerMGemm


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
    """The shared forward of :class:`~fp8_backends.layers.Fp8Linear` and :func:`fp8_linear`.

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
    from . import quant

    kernel = None
    if prepared is None:  # a per-M composite: its row for this batch's M is picked below
        kernel = backend
        k, n = kernel.k, kernel.n
    else:
        k, n = prepared.k, prepared.n
    if isinstance(x, QuantizedActivation):
        x_q, scale = unpack_quantized(x, act_scale, k)
        out = _out_dtype(x.orig_dtype, out_dtype, "QuantizedActivation.orig_dtype")
        lead = x.data.shape[:-1]
    else:
        V.require_tensor(x, "x")
        out = _out_dtype(x.dtype, out_dtype, "x")
        if x.dim() < 1 or x.shape[-1] != k:
            raise InvalidInputError(f"x must be [..., K={k}], got {tuple(x.shape)}")
        lead = x.shape[:-1]
        if act_scale is ActScale.PER_TENSOR_STATIC and input_scale is None:
            raise InvalidInputError("a static per-tensor linear needs input_scale")
        if x.numel() == 0:
            import torch

            return torch.empty((*lead, n), dtype=out.torch_dtype(), device=x.device)
        qa = quant.quantize(x.reshape(-1, k), act_scale,
                            input_scale if act_scale is ActScale.PER_TENSOR_STATIC else None, input_dtype)
        x_q, scale = qa.data, qa.scale
    if x_q.shape[0] == 0:
        import torch

        return torch.empty((*lead, n), dtype=out.torch_dtype(), device=x_q.device)
    if kernel is not None:
        graph = False
        if kernel.split:  # the auto objective's kernel and host rows differ: which one serves depends on capture
            from .registry.per_m import capturing

            graph = capturing()
        _, backend, prepared = kernel.pick(x_q.shape[0], graph)
    y = backend.gemm(x_q, prepared, scale, out_dtype=out, bias=bias)
    return y.reshape(*lead, n)


def unpack_quantized(x: QuantizedActivation, act_scale: ActScale, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q [M, K], scale)`` of a :class:`QuantizedActivation` handed to a linear prepared for ``act_scale``
    activations of width ``k``: its mode must be ``act_scale`` (a linear never re-quantizes), its data ``[..., K]``
    (leading dims flattened) and a per-token scale ``[..., 1]`` with one value per row (returned ``[M, 1]``).
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
    x_q = data.reshape(-1, k)
    if act_scale is ActScale.PER_TOKEN:
        V.require_tensor(scale, "QuantizedActivation.scale")
        if scale.numel() != x_q.shape[0] or (scale.dim() > 0 and scale.shape[-1] != 1):
            raise InvalidInputError(
                f"a per-token scale must be [..., 1] with one value per row ({x_q.shape[0]}), "
                f"got {tuple(scale.shape)}"
            )
        scale = scale.reshape(-1, 1)
    return x_q, scale


def _out_dtype(dtype: torch.dtype, expected: OutDtype | None, what: str) -> OutDtype:
    try:
        got = OutDtype.of(dtype)
    except ValueError:
        raise InvalidInputError(f"{what} must be bfloat16, float16 or float32, got {dtype}") from None
    if expected is not None and got is not expected:
        raise InvalidInputError(
            f"{what} is {got.value} but this linear was prepared for {expected.value} activations and outputs"
        )
    return got


def fp8_linear(
    x: torch.Tensor | QuantizedActivation,
    layer_or_weight: Fp8Linear | PerMGemm | PreparedWeight,
    *,
    backend: Fp8GemmBackend | None = None,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    act_scale: ActScale | str | None = None,
    out_dtype: object = None,
    input_dtype: object = Fp8Dtype.E4M3FN,
) -> torch.Tensor:
    """``y = x @ Wᵀ (+ bias)`` through an FP8 GEMM provider.

    - ``layer_or_weight``: an :class:`~fp8_backends.layers.Fp8Linear` (then no other keyword may be
      given: the layer holds them), a per-M composite from
      :func:`~fp8_backends.registry.per_m.init_fp8_gemm` (each batch runs on its M bucket's provider, as in
      ``Fp8Linear``; no ``backend``: it holds them), or a :class:`PreparedWeight` from ``backend.prepare_weight``.
    - ``backend``: the provider instance that prepared the weight (required with a PreparedWeight).
    - ``input_scale``: fp32 one value; its presence selects static per-tensor quantization unless
      ``act_scale`` says otherwise (default without it: dynamic per-tensor).
    - ``x``: ``[..., K]`` bf16/fp16/fp32 or a :class:`QuantizedActivation`; ``bias``: ``[N]`` in the
      output dtype. The output is ``[..., N]`` in ``out_dtype`` (default: ``x``'s dtype, or the
      activation's ``orig_dtype``).
    """
    from .layers import Fp8Linear
    from .registry.per_m import PerMGemm

    if isinstance(layer_or_weight, Fp8Linear):
        given = {k: v for k, v in (("backend", backend), ("input_scale", input_scale), ("bias", bias),
                                   ("act_scale", act_scale), ("out_dtype", out_dtype)) if v is not None}
        if given:
            raise InvalidInputError(
                f"fp8_linear(x, layer) takes its settings from the layer; got {', '.join(given)}"
            )
        return layer_or_weight(x)
    kernel = layer_or_weight if isinstance(layer_or_weight, PerMGemm) else None
    if kernel is not None:
        if backend is not None:
            raise InvalidInputError("fp8_linear(x, kernel) takes its providers from the kernel (init_fp8_gemm); "
                                    "got backend= too")
    elif not isinstance(layer_or_weight, PreparedWeight):
        raise InvalidInputError(
            "fp8_linear needs an Fp8Linear, a kernel from init_fp8_gemm(w_q, w_scale, problem=...) or a "
            "PreparedWeight (backend.prepare_weight(w_q, w_scale)), made once at load time; got "
            f"{type(layer_or_weight).__name__}"
        )
    elif not isinstance(backend, Fp8GemmBackend):
        raise InvalidInputError(
            f"fp8_linear with a PreparedWeight needs backend= (the {layer_or_weight.backend!r} provider "
            "instance that prepared it)"
        )
    if act_scale is None:
        mode = ActScale.PER_TENSOR_STATIC if input_scale is not None else ActScale.PER_TENSOR_DYNAMIC
    else:
        mode = ActScale.of(act_scale)
    if mode is not ActScale.PER_TENSOR_STATIC and input_scale is not None:
        raise InvalidInputError(f"input_scale is only used by static quantization, not {mode.value}")
    if input_scale is not None:
        V.require_fp32_scale(input_scale, "input_scale")
        if not V.is_scalar_shape(input_scale):
            raise InvalidInputError(f"input_scale must hold one value, got shape {tuple(input_scale.shape)}")
    out = None if out_dtype is None else V.out_dtype_of(out_dtype)
    try:
        fp8_in = Fp8Dtype.of(input_dtype)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    # a composite picks its provider and prepared weight per M; otherwise the caller's provider and weight serve
    return apply_fp8_linear(x, backend if kernel is None else kernel, layer_or_weight if kernel is None else None,
                            act_scale=mode, input_scale=input_scale, bias=bias, out_dtype=out, input_dtype=fp8_in)


__all__ = ["apply_fp8_linear", "fp8_linear"]
