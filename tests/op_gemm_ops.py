"""The ops of :mod:`op_gemm_provider` (imports torch: loaded by the providers' ``load_op``)."""

from __future__ import annotations

from typing import Any

import torch

from fp8_backends.core import reference
from fp8_backends.core.oplib import LazyOps

#: calls of the library op's implementation (the eager fast path runs it without the dispatcher)
impl_calls: list[tuple[int, ...]] = []


@torch.library.custom_op("fp8b_tests::op_custom_gemm", mutates_args=())
def custom_gemm(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype, compute: str) -> torch.Tensor:
    ct = getattr(torch, compute)
    y = (x.to(ct) * x_scale.reshape(-1, 1).to(ct)) @ (w.to(ct) * w_scale.reshape(-1, 1).to(ct)).t()
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(out_dtype)


@custom_gemm.register_fake
def _(x, w, x_scale, w_scale, bias, out_dtype, compute):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


def _library_impl(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    impl_calls.append(tuple(x.shape))
    return reference.fp8_gemm(x, w, x_scale, w_scale, out_dtype, None)


def _library_fake(x: Any, w: Any, x_scale: Any, w_scale: Any, out_dtype: Any) -> Any:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


_OPS = LazyOps({"test_library_gemm": (
    "test_library_gemm(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, ScalarType out_dtype) -> Tensor",
    _library_impl, _library_fake)}, ("CPU",))


def library_op() -> Any:
    return _OPS.op("test_library_gemm")
