"""Pure-torch references of the block-wise FP8 mode, for the Triton kernel tests.

The semantics of the block-wise contract (issue 34):

- per-token-group quantization: ``scale[m, g] = max(amax(|x[m, g·G:(g+1)·G]|) / fmax, 1e-12)`` (the last group may be
  shorter), ``q = clamp(x / scale, ±fmax) -> fp8``;
- 128x128 block weights: ``w[n, k] = w_q[n, k] · w_scale[n // 128, k // 128]``;
- the block GEMM: dequantize both operands in fp32 per group / per block, matmul in fp32 (no TF32), add the bias,
  cast once;
- the fused norm: :func:`fp8_backends.core.reference.rmsnorm` of the fp32 ``x (+ residual)``, then the per-token or
  per-token-group quantization of that fp32 row.

Slow by design (fp32 copies); CPU or GPU.
"""

from __future__ import annotations

import torch

from fp8_backends.core import reference

FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
MIN_SCALE = 1e-12


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_groups(scale: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """``[M, Kg]`` -> ``[M, K]``: each group's value over its columns."""
    return scale.float().repeat_interleave(group, dim=1)[:, :k]


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """``[Nb, Kb]`` -> ``[N, K]``."""
    return scale.float().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]


def group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[M, ceil(K / group)]``: the largest |x| of each group (NaN where a group holds one)."""
    m, k = x.shape
    kg = _cdiv(k, group)
    padded = torch.nn.functional.pad(x.float(), (0, kg * group - k))
    return padded.view(m, kg, group).abs().amax(dim=-1)


def quantize_per_token_group(x: torch.Tensor, group: int = 128, fp8: torch.dtype = torch.float8_e4m3fn
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K], scale [M, ceil(K / group)])`` fp32 row-major."""
    fmax = FMAX[fp8]
    k = x.shape[1]
    scale = (group_amax(x, group) / fmax).clamp_min(MIN_SCALE)
    q = (x.float() / expand_groups(scale, group, k)).clamp(-fmax, fmax).to(fp8)
    return q, scale


def quantize_block(w: torch.Tensor, block: tuple[int, int] = (128, 128), fp8: torch.dtype = torch.float8_e4m3fn
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_q [N, K], scale [ceil(N / bn), ceil(K / bk)])``: one scale per block (``amax / fmax``)."""
    fmax = FMAX[fp8]
    n, k = w.shape
    bn, bk = block
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = (amax / fmax).clamp_min(MIN_SCALE)
    q = (w.float() / expand_blocks(scale, block, n, k)).clamp(-fmax, fmax).to(fp8)
    return q, scale


def block_fp8_gemm(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None, group: int = 128,
                   block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The fp32 reference of the block-scaled GEMM."""
    m, k = x_q.shape
    n = w_q.shape[0]
    x = x_q.float() * expand_groups(x_scale, group, k)
    w = w_q.float() * expand_blocks(w_scale, block, n, k)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y = x @ w.t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def rmsnorm_quant_dynamic(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                          per_token: bool = False, group: int = 128, fp8: torch.dtype = torch.float8_e4m3fn
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q, scale, new_residual)``: the fused norm's reference; does not modify its inputs (``new_residual`` is
    ``x + residual`` in the residual's dtype, or None)."""
    total = x.float() if residual is None else x.float() + residual.float()
    y = reference.rmsnorm(total, weight, eps)
    if per_token:
        fmax = FMAX[fp8]
        scale = (y.abs().amax(dim=-1, keepdim=True) / fmax).clamp_min(MIN_SCALE)
        q = (y / scale).clamp(-fmax, fmax).to(fp8)
    else:
        q, scale = quantize_per_token_group(y, group, fp8)
    return q, scale, None if residual is None else total.to(residual.dtype)


__all__ = ["FMAX", "block_fp8_gemm", "expand_blocks", "expand_groups", "group_amax", "quantize_block",
           "quantize_per_token_group", "rmsnorm_quant_dynamic"]
