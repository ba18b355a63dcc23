"""The ``torch.compile`` path of a processed :class:`~fp8_backends.layers.Fp8Linear`: what Dynamo traces, bound once.

Dynamo guards every Python value a traced call reads, and checks those guards at every call of the compiled
graph, on the host. Through the general path (:func:`fp8_backends.functional.apply_fp8_linear`) one layer's call
reads ~90 values (the per-M composite, the provider's capabilities and options, the prepared weight's fields,
the layer's buffers) and makes ~5 tensors graph inputs with aliasing checks; ``nn.Linear`` reads ~12 values and one
parameter. Every layer that reaches an object the others share (the provider, an enum member) adds an ``a is b``
guard, a Python call. Measured on a 2-core CPU, Dynamo's own time per call of an 8-layer model outside the graph was
~2x bf16's through the general path, ~1.6x through the plans.

A :class:`TracedPlan` reads only what the call needs, from one object per layer:

- the layer's K, N, dtype and device (to check the input) and float8 type;
- per M bucket (a :data:`TracedRow`), the fields of the provider's prepared weight, its tensors (data, scale, and
  those in ``extra``) as ``nn.Parameter`` aliases (same storage, ``requires_grad=False``), as are the static input
  scale and the bias: Dynamo installs no aliasing guards on parameters. The call rebuilds the prepared weight from
  these fields while it is traced (no cost in the compiled graph);
- the provider, the activation mode and the prepared weight's enum members as keys of one module-level table
  (``_SHARED``), so Dynamo guards each once for the whole model.

A call validates the input only (as the eager plan does), quantizes it with the library's traced ops
(:func:`fp8_backends.quant.quantize`: torch ops that Inductor fuses into the producer) unless it is a
:class:`~fp8_backends.core.types.QuantizedActivation`, and calls ``gemm_impl`` for the M bucket: the provider's
op, a ``triton_op`` or ``torch._scaled_mm``. Its operands come from the plan's own quantizer, or from a
quantized activation checked here, so :meth:`~fp8_backends.core.backend.Fp8GemmBackend.gemm`'s per-call
validation (evaluated once at trace time, but guarded at every call) is skipped. Under ``torch.compile`` the
rows are the ``host`` rows, as in the general path (see :func:`~fp8_backends.functional.apply_fp8_linear`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .core import output_contract
from .core.errors import InvalidInputError
from .core.types import ActScale, PreparedWeight, QuantizedActivation
from .functional import unpack_quantized

if TYPE_CHECKING:
    import torch

    from .registry.per_m import PerMGemm

#: Objects many layers share (providers, enum members), each under one small int: a plan reads them as
#: ``_SHARED[i]``, so Dynamo guards each once for the whole model instead of once per layer, plus an
#: ``a is b`` guard (a Python call) for every other layer that reaches it. Entries live as long as the process.
_SHARED: dict[int, Any] = {}
_SHARED_INDEX: dict[int, int] = {}


def shared_index(obj: Any) -> int:
    """The ``_SHARED`` key of ``obj`` (added on first use; load time only, never while Dynamo traces)."""
    index = _SHARED_INDEX.get(id(obj))
    if index is None:
        index = _SHARED_INDEX[id(obj)] = len(_SHARED)
        _SHARED[index] = obj
    return index


def parameter_alias(t: Any) -> Any:
    """``t`` as an ``nn.Parameter`` sharing its storage, sizes and strides (``requires_grad=False``) when it is a
    plain tensor; anything else (None, a subclass, a non-tensor) as it is."""
    import torch

    if type(t) is torch.Tensor:
        return torch.nn.Parameter(t, requires_grad=False)
    return t


#: one M bucket of a plan: ``(bucket, provider key, n, k, float8 type key, weight scale key, provider name,
#: data, scale, extra)``: the fields of the bucket's prepared weight with its tensors as parameter aliases and its
#: shared objects as :func:`shared_index` keys. Dynamo realizes ``extra`` whole when the traced call rebuilds the
#: prepared weight, so each tensor in it is a graph input (``torch_scaled_mm``'s row-wise scale, even on a per-tensor
#: problem, where its kernel never reads it)
TracedRow = tuple[int, int, int, int, int, int, str, Any, Any, dict[str, Any]]


def traced_row(bucket: int, backend: Any, prepared: PreparedWeight) -> TracedRow:
    """The :data:`TracedRow` of one bucket (``prepared`` of a type other than :class:`PreparedWeight` is kept
    whole, in the data slot, with key -1 for the float8 type)."""
    key = shared_index(backend)
    if type(prepared) is not PreparedWeight:
        return (bucket, key, 0, 0, -1, -1, "", prepared, None, {})
    extra = {name: parameter_alias(value) for name, value in prepared.extra.items()}
    return (bucket, key, prepared.n, prepared.k, shared_index(prepared.dtype), shared_index(prepared.weight_scale),
            prepared.backend, parameter_alias(prepared.data), parameter_alias(prepared.scale), extra)


class TracedPlan:
    """One processed layer's traced call. ``rows``: :data:`TracedRow` s by increasing bucket, the last serving every
    larger M. ``input_scale``: the static scale (``[1]`` fp32) or None; ``bias``: ``[N]`` in ``dtype`` or None
    (both parameter aliases)."""

    __slots__ = ("bias", "device", "dtype", "fp8", "input_scale", "k", "mode", "n", "rows", "tensor")

    def __init__(self, *, k: int, n: int, dtype: torch.dtype, device: torch.device, mode: ActScale,
                 fp8: torch.dtype, input_scale: torch.Tensor | None, bias: torch.Tensor | None,
                 rows: Sequence[TracedRow]) -> None:
        import torch

        self.k, self.n, self.dtype, self.device, self.fp8 = k, n, dtype, device, fp8
        self.mode = shared_index(mode)
        self.tensor = torch.Tensor
        self.input_scale = parameter_alias(input_scale)
        self.bias = parameter_alias(bias)
        self.rows = tuple(rows)

    def __call__(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """``y [..., N]`` in the layer dtype for ``x [..., K]`` in that dtype on the layer's device, or a
        :class:`QuantizedActivation` in the layer's mode whose ``orig_dtype`` is that dtype."""
        from . import quant

        k = self.k
        mode = _SHARED[self.mode]
        if isinstance(x, QuantizedActivation):
            x_q, scale = self._unpack(x, mode)
            lead = x.data.shape[:-1]
        else:
            if x.dtype != self.dtype:
                raise InvalidInputError(f"x is {x.dtype} but this linear was prepared for {self.dtype} activations")
            if x.dim() < 1 or x.shape[-1] != k:
                raise InvalidInputError(f"x must be [..., K={k}], got {tuple(x.shape)}")
            if x.device != self.device:
                raise InvalidInputError(f"input is on {x.device} but the layer's weight is on {self.device}")
            lead = x.shape[:-1]
            x_q, scale = quant.quantize(x.reshape(-1, k), mode, self.input_scale, self.fp8)[:2]
        m, n = x_q.shape[0], self.n
        if m == 0:
            return x_q.new_empty((*lead, n), dtype=self.dtype)
        for row in self.rows:  # noqa: B007 - the last row serves larger M
            if m <= row[0]:
                break
        _, key, rn, rk, dtype, weight_scale, name, data, w_scale, extra = row
        backend = _SHARED[key]
        if dtype < 0:
            prepared = data
        else:
            prepared = PreparedWeight(data=data, scale=w_scale, n=rn, k=rk, dtype=_SHARED[dtype],
                                      weight_scale=_SHARED[weight_scale], backend=name, extra=extra)
        y = backend.gemm_impl(x_q, prepared, scale, self.dtype, self.bias)
        # the provider's output contract, on its fake output while Dynamo traces (no cost in the compiled graph)
        if not isinstance(y, self.tensor) or y.dtype != self.dtype or y.shape != (m, n) or y.device != x_q.device:
            y = output_contract.gemm_output_failed(backend, y, x_q, n, self.dtype)
        return y.reshape(*lead, n)

    def _unpack(self, x: QuantizedActivation, mode: ActScale) -> tuple[torch.Tensor, torch.Tensor]:
        unpacked = unpack_quantized(x, mode, self.k)
        if x.orig_dtype != self.dtype:
            raise InvalidInputError(f"QuantizedActivation.orig_dtype is {x.orig_dtype} but this linear was prepared "
                                    f"for {self.dtype} activations and outputs")
        data = x.data
        if data.dtype != self.fp8 or data.device != self.device:
            raise InvalidInputError(f"QuantizedActivation.data must be {self.fp8} on {self.device}, got "
                                    f"{data.dtype} on {data.device}")
        return unpacked


def bind_traced(kernel: PerMGemm, *, k: int, n: int, dtype: torch.dtype, device: torch.device,
                bias: torch.Tensor | None, mode: ActScale, input_scale: torch.Tensor | None,
                fp8_dtype: torch.dtype) -> TracedPlan:
    """The traced plan of a linear over ``kernel``'s ``host`` rows."""
    rows = [traced_row(row.bucket, row.backend, row.prepared) for row in kernel.rows]
    return TracedPlan(k=k, n=n, dtype=dtype, device=device, mode=mode, fp8=fp8_dtype,
                      input_scale=input_scale if mode is ActScale.PER_TENSOR_STATIC else None, bias=bias, rows=rows)


__all__ = ["TracedPlan", "TracedRow", "bind_traced", "parameter_alias", "shared_index", "traced_row"]
