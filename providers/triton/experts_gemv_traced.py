"""What ``torch.compile`` sees of the experts GEMV: the body of the ``fp8_backends::triton_experts_gemv``
``triton_op``, the launch :func:`.experts_gemv_ops.launch` makes, through :func:`torch.library.wrap_triton`.

Real type hints (no ``from __future__ import annotations``): ``triton_op`` infers the op's schema from them.
"""

import typing

import torch
from torch.library import wrap_triton

from .experts_gemv_ops import kernel_args


def triton_experts_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    ids: torch.Tensor,
    rw: typing.Optional[torch.Tensor],  # noqa: UP045 - triton_op's schema inference on every torch version
    token_div: int,
    out_dtype: torch.dtype,
    config: str,
) -> torch.Tensor:
    """The experts GEMV (operands as :mod:`.experts_gemv_ops` states, checked by the caller)."""
    out = x.new_empty((ids.shape[0], w.shape[1]), dtype=out_dtype)
    if ids.shape[0] == 0:
        return out
    kernel, grid, args, warps = kernel_args(x, w, w_scale, ids, rw, token_div, out, config)
    wrap_triton(kernel)[grid](*args, num_warps=warps, num_stages=1)
    return out


__all__ = ["triton_experts_gemv"]
