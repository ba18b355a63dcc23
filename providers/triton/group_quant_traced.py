"""What ``torch.compile`` sees of the Triton per-token-group quantization: the body of the
``fp8_backends::triton_quant_per_token_group`` ``triton_op`` (the launch the eager path makes, through
:func:`torch.library.wrap_triton`, without PDL). Real type hints (no ``from __future__ import annotations``):
``triton_op`` infers the schema from them. This module imports torch and triton."""

import typing

import torch
from torch.library import wrap_triton

from .group_quant_kernels import group_scale_buffer, kernel_args


def triton_quant_per_token_group(
    x: torch.Tensor, group_size: int, fp8_dtype: torch.dtype, scale_layout: str
) -> typing.Tuple[torch.Tensor, torch.Tensor]:  # noqa: UP006 - schema inference
    """Per-token-group quantization (:func:`.group_quant_ops.quant_per_token_group`)."""
    m, k = x.shape
    q = x.new_empty((m, k), dtype=fp8_dtype)
    # the kernel writes the scale's whole buffer, not the view: a write through a view is traced as a write of a
    # copy that Inductor copies back (two more kernels for a padded m_major_tma scale)
    buffer, scale = group_scale_buffer(m, (k + group_size - 1) // group_size, scale_layout, x)
    if m == 0 or k == 0:
        return q, scale
    kernel, grid, args, warps = kernel_args(x, q, scale, group_size, False, scale_buffer=buffer)
    wrap_triton(kernel)[grid](*args, num_warps=warps)
    return q, scale


__all__ = ["triton_quant_per_token_group"]
