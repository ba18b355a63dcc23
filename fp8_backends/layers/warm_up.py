"""``warm_up(model, batch_sizes)``: run, before any CUDA-graph capture, the kernels captures at those batch sizes call.

A capture records kernel launches; it cannot compile or load a kernel that has not run yet in the process, and some
providers build kernels at their first call of a shape (``flashinfer_block`` compiles a DeepGEMM kernel per weight
shape and tile config, ~2 s each, cached on disk; it refuses such a first call during a capture, with this advice).
Engines and ``torch.compile``'s CUDA graphs run a model eagerly before they capture it, but under ``auto`` a capture
may run other providers than eager calls (the ``kernel`` objective's rows, :attr:`~fp8_backends.PerMGemm.split`):
those would still meet their first call inside the capture. :func:`warm_up` runs every processed
:class:`~fp8_backends.layers.Fp8Linear` of a model once per batch size on zeros, through the rows of eager calls and,
where they differ, through the rows of captured calls, outside any capture (load time, not a hot path).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..core.errors import InvalidInputError
from ..registry.per_m import capturing
from .modules import Fp8Linear


def _sizes(batch_sizes: Iterable[int]) -> list[int]:
    try:
        sizes = list(batch_sizes)
    except TypeError:
        raise InvalidInputError(f"batch_sizes must be an iterable of ints, got {type(batch_sizes).__name__}") from None
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if bad or not sizes:
        raise InvalidInputError(f"batch_sizes must be positive ints (rows per call), got {sizes!r}")
    return sorted(set(sizes))


def _run(layer: Fp8Linear, xs: list[torch.Tensor]) -> int:
    for x in xs:
        layer(x)
    return len(xs)


def warm_up(model: nn.Module, batch_sizes: Iterable[int]) -> int:
    """Run every processed :class:`~fp8_backends.layers.Fp8Linear` in ``model`` (or ``model`` itself) once per
    batch size on zeros ``[M, in_features]`` in its dtype and device, as eager calls run it and, where captured calls
    run other providers, as those do: every kernel a later capture at these ``M`` calls has run once in this process.

    ``batch_sizes``: rows per call (tokens per step), e.g. an engine's CUDA-graph capture sizes. Layers not processed
    yet (no ``process_weights_after_loading``) are skipped. Returns the number of calls made. Call it after loading,
    outside any capture (inside one it raises :class:`~fp8_backends.core.errors.InvalidInputError`)."""
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"warm_up takes an nn.Module, got {type(model).__name__}")
    sizes = _sizes(batch_sizes)
    if capturing():
        raise InvalidInputError("warm_up runs kernels: call it before capturing a CUDA graph, not during a capture")
    calls = 0
    with torch.no_grad():
        for layer in model.modules():
            if not isinstance(layer, Fp8Linear) or layer.kernel is None:
                continue
            xs = [torch.zeros((m, layer.in_features), dtype=layer.dtype, device=layer.weight.device) for m in sizes]
            calls += _run(layer, xs)
            plan = layer._plan  # bound by the calls above
            if plan is not None and plan.graph_rows is not None:
                with plan.captured_rows():
                    calls += _run(layer, xs)
    return calls


__all__ = ["warm_up"]
