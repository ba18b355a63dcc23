"""The eager hot path of a processed :class:`~fp8_backends.layers.Fp8Linear`: everything known at load time, bound once.

A layer's processing (``process_weights_after_loading``) builds one :class:`EagerPlan` (:func:`bind_per_m`): the
rows of the layer's per-M composite provider (:class:`~fp8_backends.registry.per_m.PerMGemm`: each bucket's provider
with its prepared weight), the output dtype, the bias and the activation quantizer of the layer's mode, each bound
into a closure. A plain eager call then checks only what can change from call to call (the input's type, dtype, last
dimension and device) and runs two closures: quantize, GEMM; or one, where the provider quantizes the activation inside
its GEMM launch (:meth:`~fp8_backends.core.backend.Fp8GemmBackend.bind_fused_quant_gemm`, bound once: the ``triton``
swap-AB and GEMV kernels at small M, the ``cutlass`` C++ linear op). Then it checks the provider's output contract
(type, ``[M, N]``, dtype, device: a few attribute comparisons, see :mod:`fp8_backends.core.output_contract`). Everything
else the general path checks (scale shapes and dtypes, the prepared weight's owner, bias shape and dtype, the quantized
input's layout) was fixed at load time and is guaranteed by construction: the plan quantizes the input itself.

A composite whose CUDA-graph rows differ from its other rows (the ``auto`` selection objective, where the ``kernel``
and ``host`` choices disagree: :attr:`~fp8_backends.registry.per_m.PerMGemm.split`) binds both; a call then asks
``torch.cuda.is_current_stream_capturing()`` and runs the graph rows while a graph is captured, the host rows
otherwise. A composite whose choices agree binds one set and never asks.

The general path (:func:`~.general_path.apply_fp8_linear`) still serves every other call: under
``torch.compile`` (where it is what Dynamo traces: the quantization as torch ops Inductor fuses into the producer,
the GEMM as the provider's op), under a dispatch mode or tensor subclass, a
:class:`~fp8_backends.core.types.QuantizedActivation` input, an empty input, or anything the plan's checks refuse
(which the general path then explains with the library's errors).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..core import output_contract
from ..core.types import ActScale, ScaleLayout

if TYPE_CHECKING:
    import torch

    from ..core.backend import Fp8GemmBackend
    from ..core.types import PreparedWeight
    from ..registry.per_m import PerMGemm

#: ``(x_q [M, K] fp8, x_scale fp32 [1] or [M, 1]) -> y [M, N]``
GemmCall = Callable[[Any, Any], Any]


def bind_gemm(backend: Fp8GemmBackend, prepared: PreparedWeight, out_dtype: torch.dtype,
              bias: torch.Tensor | None) -> GemmCall:
    """``backend``'s GEMM hook with everything but the activation bound. Its inputs come from the plan's own
    quantizer, so the per-call validation of :meth:`Fp8GemmBackend.gemm` is skipped (it was done for these
    operands' types, shapes and devices when the layer was processed)."""

    def gemm(x_q: Any, x_scale: Any) -> Any:
        return backend.gemm_impl(x_q, prepared, x_scale, out_dtype, bias)

    gemm.backend = backend  # type: ignore[attr-defined]  # named by the output contract's error
    return gemm


#: ``x [M, K]`` (model dtype) ``-> y [M, N]``: one bucket's whole linear
LinearCall = Callable[[Any], Any]


def bind_linear(backend: Fp8GemmBackend, prepared: PreparedWeight, out_dtype: torch.dtype,
                bias: torch.Tensor | None, quantize: Callable[[Any], Any], mode: ActScale,
                input_scale: torch.Tensor | None, fp8_dtype: torch.dtype, in_graph: bool = False) -> LinearCall:
    """One provider's linear: its fused quantize+GEMM launch (:meth:`Fp8GemmBackend.fused_quant_gemm_impl`) where
    it fuses ``mode`` for ``prepared`` (:meth:`Fp8GemmBackend.fuses_act_quant_for`; ``in_graph``: the binding for
    calls captured into a CUDA graph), the activation's float8 type is the weight's and the weight is not K-padded,
    falling back to ``quantize`` then :func:`bind_gemm`'s call where it declines; else those two."""
    gemm = bind_gemm(backend, prepared, out_dtype, bias)
    # a weight the provider padded along K (prepared.k_pad) runs on its aligned rows: quantize into the padded width,
    # then the GEMM (a fused launch would read the unpadded K with masked loads: 1.8-3.5x slower at K = 6840 on the
    # H200, bench/results/unaligned/2026-12-03-h200-layers/)
    if (not backend.fuses_act_quant_for(prepared, mode, in_graph) or prepared.data.dtype != fp8_dtype
            or prepared.k_pad is not None):
        def linear(x: Any) -> Any:
            x_q, x_scale = quantize(x)
            return gemm(x_q, x_scale)

        linear.backend = backend  # type: ignore[attr-defined]  # named by the output contract's error
        return linear
    scale = input_scale if mode is ActScale.PER_TENSOR_STATIC else None
    fused = backend.bind_fused_quant_gemm(prepared, mode, scale, out_dtype, bias)

    def fused_linear(x: Any) -> Any:
        y = fused(x)
        if y is None:
            x_q, x_scale = quantize(x)
            y = gemm(x_q, x_scale)
        return y

    fused_linear.backend = backend  # type: ignore[attr-defined]
    return fused_linear


def bind_quantizer(mode: ActScale, fp8_dtype: torch.dtype, input_scale: torch.Tensor | None,
                   group_size: int | None = None, scale_layout: ScaleLayout | None = None,
                   k_pad: int | None = None) -> Callable[[Any], Any]:
    """``x [M, K] -> (x_q [M, K] fp8, x_scale)`` in ``mode`` through :mod:`fp8_backends.quant`'s ops (their
    implementation is looked up at each call, so :func:`~fp8_backends.quant.register_quant_impl` still applies).
    Per-token-group: groups of ``group_size``, the scale written in ``scale_layout`` (the consuming provider's).
    ``k_pad`` (a provider that padded the weight's K: :attr:`PreparedWeight.k_pad`): ``x_q`` is ``[M, k_pad]``,
    zeros beyond K, written so by the quantization itself where its kernel can
    (:func:`~fp8_backends.quant.padded_quantizer`)."""
    from .. import quant

    if k_pad is not None and mode is not ActScale.PER_TOKEN_GROUP:
        return quant.padded_quantizer(mode, fp8_dtype, input_scale, k_pad)
    op = quant.op_call(mode)
    if mode is ActScale.PER_TOKEN_GROUP:
        group, layout = int(group_size or 128), (scale_layout or ScaleLayout.ROW_MAJOR).value

        def grouped(x: Any) -> Any:
            return op(x, group, layout, fp8_dtype)

        return grouped
    if mode is ActScale.PER_TENSOR_STATIC:
        assert input_scale is not None
        scale = input_scale

        def static(x: Any) -> Any:
            return op(x, scale, fp8_dtype), scale

        return static

    def dynamic(x: Any) -> Any:
        return op(x, fp8_dtype)

    return dynamic


def _always() -> bool:
    return True


class EagerPlan:
    """One processed layer's eager call. ``rows``: ``((bucket, linear), ...)`` by increasing bucket (each a
    :func:`bind_linear` call), the last row serving every larger M (one row: one provider for every M).
    ``graph_rows``: the same for calls made while a CUDA graph is captured, or None when they are ``rows``."""

    __slots__ = ("capturing", "device", "dtype", "graph_rows", "index", "k", "linear", "n", "rows", "tensor")

    def __init__(self, *, k: int, n: int, dtype: torch.dtype, device: torch.device,
                 rows: Sequence[tuple[int, LinearCall]],
                 graph_rows: Sequence[tuple[int, LinearCall]] | None = None) -> None:
        import torch

        self.k, self.n, self.dtype, self.device = k, n, dtype, device
        self.index = device.index if device.type == "cuda" else -1  # x.get_device() of an input on it
        self.rows = tuple(rows)
        self.graph_rows = None if graph_rows is None else tuple(graph_rows)
        self.linear = self.rows[-1][1] if len(self.rows) == 1 and self.graph_rows is None else None
        self.tensor = torch.Tensor
        # whether a CUDA graph is being captured (asked only when graph_rows differ). The plan never runs while
        # torch.compile traces (Fp8Linear.forward takes the traced plan then), so torch's own query serves directly.
        query = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) if device.type == "cuda" else None
        if query is None:  # a torch without CUDA, or a layer on another device
            from ..registry.per_m import capturing as query
        self.capturing = query

    @contextlib.contextmanager
    def captured_rows(self) -> Iterator[None]:
        """Within: calls take the rows of calls captured into a CUDA graph, outside any capture (a warm-up runs the
        providers a later capture will; :func:`fp8_backends.warm_up`). Load time only."""
        query = self.capturing
        self.capturing = _always
        try:
            yield
        finally:
            self.capturing = query

    def __call__(self, x: Any) -> Any:
        """``y [..., N]`` for a plain ``x [..., K]`` in the model dtype on the layer's device, or ``None`` when
        the general path must take the call (see the module docstring)."""
        if type(x) is not self.tensor or x.dtype is not self.dtype:
            return None
        index = x.get_device()  # -1 for every non-CUDA device: compare those by device
        if index != self.index or (index < 0 and x.device != self.device):
            return None
        shape = x.shape
        k = self.k
        if not shape or shape[-1] != k:
            return None
        x2 = x if len(shape) == 2 else x.reshape(-1, k)
        m = x2.shape[0]
        if m == 0:
            return None
        linear = self.linear
        if linear is None:
            rows = self.rows
            if self.graph_rows is not None and self.capturing():
                rows = self.graph_rows
            for bucket, linear in rows:  # noqa: B007 - the last row serves larger M
                if m <= bucket:
                    break
        y = linear(x2)
        # the provider's output contract (metadata only): a plain tensor [M, N] in the layer dtype on its device
        if type(y) is not self.tensor or y.dtype is not self.dtype or y.shape != (m, self.n) or y.get_device() != index:
            y = output_contract.gemm_output_failed(linear.backend, y, x2, self.n, self.dtype)
        return y if len(shape) == 2 else y.view(*shape[:-1], self.n)


def bind_per_m(kernel: PerMGemm, *, k: int, n: int, dtype: torch.dtype, device: torch.device,
               bias: torch.Tensor | None, mode: ActScale, input_scale: torch.Tensor | None,
               fp8_dtype: torch.dtype) -> EagerPlan:
    """The eager plan of a linear over ``kernel``: a quantizer of ``mode`` (``input_scale`` for static; per-token-group:
    one per scale layout its providers read; one per padded K a provider's weight has), and each
    of the kernel's rows bound once (:func:`bind_linear`), so that a call costs what it did before the rows were a
    composite (the bucket loop, and no more). A kernel whose CUDA-graph rows differ (``split``) has those bound too
    (one binding per provider and prepared weight)."""
    quantizers: dict[Any, Callable[[Any], Any]] = {}

    def quantizer(row: Any) -> Callable[[Any], Any]:
        """One quantizer per scale layout the rows' providers read (the per-token-group mode) and padded K."""
        layout = row.backend.capabilities.group_scale_layout if mode is ActScale.PER_TOKEN_GROUP else None
        key = (layout, row.prepared.k_pad)
        if key not in quantizers:
            quantizers[key] = bind_quantizer(mode, fp8_dtype, input_scale, row.prepared.group_size, layout,
                                             row.prepared.k_pad)
        return quantizers[key]

    bound: dict[tuple[int, int, bool], LinearCall] = {}

    def bind(rows: Sequence[Any], in_graph: bool = False) -> list[tuple[int, LinearCall]]:
        out = []
        for row in rows:
            key = (id(row.backend), id(row.prepared), in_graph)
            if key not in bound:
                bound[key] = bind_linear(row.backend, row.prepared, dtype, bias, quantizer(row), mode, input_scale,
                                         fp8_dtype, in_graph)
            out.append((row.bucket, bound[key]))
        return out

    # calls captured into a CUDA graph take rows of their own where the providers differ there, or where one fuses
    # this mode's quantization in eager calls but not in graphs (Fp8GemmBackend.fused_act_quant_in_graphs, per weight:
    # fuses_act_quant_for)
    graph_differs = kernel.split or any(
        row.backend.fuses_act_quant_for(row.prepared, mode, False)
        != row.backend.fuses_act_quant_for(row.prepared, mode, True) for row in kernel.rows)
    graph = bind(kernel.graph_rows if kernel.split else kernel.rows, True) if graph_differs else None
    return EagerPlan(k=k, n=n, dtype=dtype, device=device, rows=bind(kernel.rows), graph_rows=graph)


__all__ = ["EagerPlan", "bind_gemm", "bind_linear", "bind_per_m", "bind_quantizer"]
