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
from .core.types import ActScale, Fp8Dtype, PreparedWeight, QuantizedActivation, WeightScale
from .layers.general_path import apply_fp8_linear

if TYPE_CHECKING:
    import torch

    from .layers import Fp8Linear
    from .registry.per_m import PerMGemm


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
      ``act_scale`` says otherwise (default without it: dynamic per-tensor; for a block-scaled weight per token
      group, the mode it pairs with).
    - ``x``: ``[..., K]`` bf16/fp16/fp32 or a :class:`QuantizedActivation`; ``bias``: ``[N]`` in the
      output dtype. The output is ``[..., N]`` in ``out_dtype`` (default: ``x``'s dtype, or the
      activation's ``orig_dtype``).
    """
    from .layers import Fp8Linear
    from .layers.modules import no_backward
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
    prepared = layer_or_weight.default.prepared if kernel is not None else layer_or_weight
    if act_scale is None and prepared.weight_scale is WeightScale.BLOCK:
        mode = ActScale.PER_TOKEN_GROUP  # the one mode a block weight pairs with
    elif act_scale is None:
        mode = ActScale.PER_TENSOR_STATIC if input_scale is not None else ActScale.PER_TENSOR_DYNAMIC
    else:
        mode = ActScale.of(act_scale)
    block = prepared.weight_scale is WeightScale.BLOCK
    if not isinstance(x, QuantizedActivation) and (mode is ActScale.PER_TOKEN_GROUP) != block:
        raise InvalidInputError(  # before the activation is quantized
            f"{prepared.weight_scale.value} weight scales do not pair with {mode.value} activation scales (block "
            "weights pair with per_token_group activations, and only they)")
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
    y = apply_fp8_linear(x, backend if kernel is None else kernel, layer_or_weight if kernel is None else None,
                         act_scale=mode, input_scale=input_scale, bias=bias, out_dtype=out, input_dtype=fp8_in)
    return no_backward(y, x)  # no backward: as Fp8Linear's


__all__ = ["apply_fp8_linear", "fp8_linear"]
