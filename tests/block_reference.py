"""The block-wise FP8 reference (:mod:`fp8_backends.core.reference`) in the call forms the Triton kernel tests use.

- :func:`quantize_per_token_group` / :func:`quantize_block`: the reference's, with torch dtypes;
- :func:`block_fp8_gemm`: the reference GEMM (each operand dequantized in fp32 per group / per block, fp32 matmul
  without TF32, bias, one cast);
- :func:`rmsnorm_quant_dynamic`: the reference fused norm with the residual kept in the residual's dtype.
"""

from __future__ import annotations

import torch

from fp8_backends.core import reference


def quantize_per_token_group(x: torch.Tensor, group: int = 128, fp8: torch.dtype = torch.float8_e4m3fn
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K], scale [M, ceil(K / group)])`` fp32 row-major."""
    return reference.quantize_per_token_group(x, group, fp8)


def quantize_block(w: torch.Tensor, block: tuple[int, int] = (128, 128), fp8: torch.dtype = torch.float8_e4m3fn
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_q [N, K], scale [ceil(N / bn), ceil(K / bk)])``."""
    return reference.quantize_block(w, block, fp8)


def block_fp8_gemm(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None, group: int = 128,
                   block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The fp32 reference of the block-scaled GEMM (TF32 off while it runs)."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        x = reference.dequantize_groups(x_q, x_scale, group)
        w = reference.dequantize_block(w_q, w_scale, block)
        y = x @ w.t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def rmsnorm_quant_dynamic(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                          per_token: bool = False, group: int = 128, fp8: torch.dtype = torch.float8_e4m3fn
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, scale, new_residual)``; does not modify its inputs (``new_residual``: ``x + residual`` in the residual's
    dtype, or None)."""
    q, scale, _ = reference.rmsnorm_quant_dynamic(x, weight, eps, act_scale="per_token" if per_token else
                                                  "per_token_group", group_size=group, residual=residual, dtype=fp8)
    new_residual = None if residual is None else (x.float() + residual.float()).to(residual.dtype)
    return q, scale, new_residual


__all__ = ["block_fp8_gemm", "quantize_block", "quantize_per_token_group", "rmsnorm_quant_dynamic"]
