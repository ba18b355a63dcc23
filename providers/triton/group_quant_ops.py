"""The torch side of the Triton per-token-group FP8 quantization (:mod:`.group_quant_kernels`): the eager call
(:func:`quant_per_token_group`, launched through :mod:`.launcher` with replays), the entry
:func:`fp8_backends.quant.register_quant_impl` takes (:func:`quant_impl`), and the ``triton_op``
``fp8_backends::triton_quant_per_token_group`` whose traced body (:mod:`.group_quant_traced`) launches the same kernel
from Inductor's code under ``torch.compile``. No host-device synchronisation; CUDA-graph capturable. This module imports
torch and triton: import it lazily.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.oplib import LazyOps, TritonOpSpec

from . import _support
from .group_quant_kernels import check_fp8, group_scale_empty, kernel_args
from .launcher import ReplayCache, launcher_for, raw_stream


def _q_empty(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    if x.is_contiguous():
        return torch.empty_like(x, dtype=fp8_dtype)
    return x.new_empty(x.shape, dtype=fp8_dtype)


#: replays: a call passes its three data pointers; sizes, strides and flags are fixed by the key
_replays = ReplayCache(head=3)


def _launch(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_size: int, index: int) -> None:
    use_pdl = _support.pdl_on(index)
    key = None
    if index >= 0:
        px, pq, ps = x.data_ptr(), q.data_ptr(), scale.data_ptr()
        if not (px | pq | ps) & 15:
            key = (x.shape, x.stride(), q.stride(0), scale.stride(), group_size, x.dtype, q.dtype, use_pdl, index)
            hit = _replays.lookup(key)
            if hit is not None and index == _support.current_device():
                r = hit[0]
                r.run(r.g0, r.g1, r.g2, raw_stream(index), r.function, r.packed, None, None, None, px, pq, ps,
                      *hit[1])
                return
    kernel, grid, args, warps = kernel_args(x, q, scale, group_size, use_pdl)
    kernel_launcher = launcher_for(kernel)
    options = {"num_warps": warps, "pdl": use_pdl, "device_index": max(index, 0)}
    kernel_launcher(grid, args, **options)
    if key is not None:
        _replays.record(key, kernel_launcher, grid, args, **options)


def quant_per_token_group(
    x: torch.Tensor, group_size: int = 128, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_layout: str = "row_major", *, q_out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization of ``x [M, K]``: ``(q [M, K], scale [M, ceil(K / group_size)])`` (module
    docstring). ``q_out`` / ``scale_out``: tensors to write instead of new ones (``scale_out`` in any layout, which
    then overrides ``scale_layout``)."""
    check_fp8(fp8_dtype)
    if x.dim() != 2:
        raise InvalidInputError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if group_size < 16 or group_size & (group_size - 1):
        raise InvalidInputError(f"group_size must be a power of two >= 16 (64 or 128), got {group_size}")
    m, k = x.shape
    kg = -(-k // group_size)
    if q_out is None:
        q = _q_empty(x, fp8_dtype)
    else:
        if tuple(q_out.shape) != (m, k) or q_out.dtype != fp8_dtype or q_out.device != x.device or (
                k > 1 and q_out.stride(1) != 1):
            raise InvalidInputError(f"q_out must be {fp8_dtype} [{m}, {k}] on {x.device} with unit column stride")
        q = q_out
    if scale_out is None:
        scale = group_scale_empty(m, kg, scale_layout, x)
    else:
        if tuple(scale_out.shape) != (m, kg) or scale_out.dtype != torch.float32 or scale_out.device != x.device:
            raise InvalidInputError(f"scale_out must be fp32 [{m}, {kg}] on {x.device}, got {scale_out.dtype} "
                                    f"{list(scale_out.shape)} on {scale_out.device}")
        scale = scale_out
    if m == 0 or k == 0:
        return q, scale
    index = x.get_device()
    _support.on_device(index, _launch, x, q, scale, group_size, index)
    return q, scale


def quant_impl(x: torch.Tensor, group_size: int, scale_layout: str, fp8_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quant_per_token_group` with the argument order of the per-token-group entry of
    :func:`fp8_backends.quant.register_quant_impl`: ``(x, group_size, scale_layout, fp8_dtype) -> (q, scale)``."""
    return quant_per_token_group(x, group_size, fp8_dtype, str(getattr(scale_layout, "value", scale_layout)))


def _traced_impl(x: torch.Tensor, group_size: int, scale_layout: str, fp8_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The op ``fp8_backends::triton_quant_per_token_group`` in :func:`quant_impl`'s argument order: what compiled
    layers trace (``quant_impl.traced``, its ``load`` defining the op at load time; see
    :func:`fp8_backends.quant.traced_group_kernel`)."""
    return _OPS.op(OP_BASENAME)(x, group_size, fp8_dtype, scale_layout)


quant_impl.traced = _traced_impl  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- the torch op
OP_BASENAME = "triton_quant_per_token_group"
OP_SCHEMA = (f"{OP_BASENAME}(Tensor x, int group_size, ScalarType fp8_dtype, str scale_layout) "
             "-> (Tensor, Tensor)")


def _op_eager(x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, scale_layout: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    return quant_per_token_group(x, group_size, fp8_dtype, scale_layout)


def _op_fake(x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, scale_layout: str
             ) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    return x.new_empty((m, k), dtype=fp8_dtype), group_scale_empty(m, -(-k // group_size), scale_layout, x)


def _dispatch_keys() -> tuple[str, ...]:
    return ("CUDA", "CPU") if _support.interpreting() else ("CUDA",)


def _specs() -> dict[str, Any]:
    if _support.interpreting():
        return {OP_BASENAME: (OP_SCHEMA, _op_eager, _op_fake)}
    from . import group_quant_traced

    return {OP_BASENAME: TritonOpSpec(group_quant_traced.triton_quant_per_token_group, _op_eager)}


_OPS = LazyOps(_specs, _dispatch_keys)


def load_op() -> Any:
    """Define ``fp8_backends::triton_quant_per_token_group`` now (load time) and return its OpOverload."""
    _OPS.preload()
    return _OPS.op(OP_BASENAME)


_traced_impl.load = load_op  # type: ignore[attr-defined]


def triton_quant_per_token_group(x: torch.Tensor, group_size: int = 128, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                                 scale_layout: str = "row_major") -> tuple[torch.Tensor, torch.Tensor]:
    """The op: :func:`quant_per_token_group` for plain eager calls, the traced body under ``torch.compile``."""
    return _OPS.call(OP_BASENAME)(x, group_size, fp8_dtype, scale_layout)


__all__ = ["OP_BASENAME", "load_op", "quant_impl", "quant_per_token_group", "triton_quant_per_token_group"]
