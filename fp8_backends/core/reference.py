"""Pure-torch reference semantics. Every provider is tested against these functions.

- GEMM: ``y = (x_q·s_x) @ (w_q·s_w)ᵀ + bias``, computed in fp32 and cast to ``out_dtype``.
  ``s_x`` is one value or ``[M, 1]``; ``s_w`` one value, ``[N]`` or ``[N, 1]``. Block-wise FP8: ``s_x`` is
  ``[M, ceil(K/G)]`` (one scale per token and group of ``G`` columns) and ``s_w`` ``[ceil(N/BN), ceil(K/BK)]``
  (one per ``BN x BK`` block); each operand is dequantized in fp32 by its own scale before the fp32 matmul, so the
  reference is exact up to fp32 summation whatever order a kernel applies the scales in.
- Quantization: ``clamp(x / s, -448, 448) -> float8_e4m3fn`` (``±57344`` for e5m2). The codes are a new row-major
  tensor whatever ``x``'s strides (a transposed view, a column slice, broadcast rows): the GEMM kernels read them
  with unit column stride and a row stride of ``K``.
- RMSNorm: in fp32, ``x · rsqrt(mean(x²) + eps) · weight``.

These run on any device torch supports; they are slow by design (several kernels, fp32 copies).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .types import DEFAULT_GROUP_SIZE, DEFAULT_WEIGHT_BLOCK, ActScale, Fp8Dtype

if TYPE_CHECKING:
    import torch

#: smallest scale produced by dynamic quantization (an all-zero input would give 0 otherwise)
MIN_DYNAMIC_SCALE = 1e-12


def _fp8(dtype: object) -> tuple[torch.dtype, float]:
    fp8 = Fp8Dtype.of(dtype)
    return fp8.torch_dtype(), fp8.max


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q.float() * scale`` with ``scale`` one value or broadcastable rows (``[M, 1]``)."""
    return q.float() * scale.float().reshape(-1, 1) if scale.numel() > 1 else q.float() * scale.float()


def expand_groups(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A ``[ceil(rows/BR), ceil(cols/BC)]`` grid of scales spread to one fp32 value per element ``[rows, cols]``
    (element ``(r, c)`` takes ``scale[r // BR, c // BC]``; the last block of a ragged edge is cut short). Any
    strides."""
    return _blockwise(scale.new_ones((rows, cols), dtype=scale.float().dtype), scale, block, "mul")


def _blockwise(t: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], op: str) -> torch.Tensor:
    """``t [R, C]`` (as fp32) multiplied (``op="mul"``) or divided (``"div"``) by the scale of its ``BR x BC`` block,
    ``scale [ceil(R/BR), ceil(C/BC)]``: ``t`` padded to whole blocks and viewed ``[Rb, BR, Cb, BC]`` so each scale
    broadcasts over its block (no per-element copy of the scales; a form ``torch.compile`` lowers correctly)."""
    import torch.nn.functional as F

    rows, cols = t.shape
    br, bc = block
    rb, cb = scale.shape
    tf = F.pad(t.float(), (0, cb * bc - cols, 0, rb * br - rows)).view(rb, br, cb, bc)
    sf = scale.float()[:, None, :, None]
    out = tf * sf if op == "mul" else tf / sf
    return out.reshape(rb * br, cb * bc)[:rows, :cols]


def _groupwise(t: torch.Tensor, scale: torch.Tensor, group_size: int, op: str) -> torch.Tensor:
    """``t [M, K]`` (as fp32) multiplied or divided by its group's scale, ``scale [M, ceil(K/G)]``: the whole groups
    viewed ``[M, K // G, G]`` with the scale broadcast, the ragged last group on its own, then joined. Inductor's CPU
    code for the padded form (:func:`_blockwise`) and for a gathered ``scale[:, arange(K) // G]`` read the wrong
    elements of a ragged last group (torch 2.13, M = 1 or K % G != 0); this form compiles right."""
    import torch

    m, k = t.shape
    full = k // group_size
    tf, sf = t.float(), scale.float()
    parts = []
    if full:
        body = tf[:, :full * group_size].reshape(m, full, group_size)
        body = body * sf[:, :full, None] if op == "mul" else body / sf[:, :full, None]
        parts.append(body.reshape(m, full * group_size))
    if k % group_size:
        tail = tf[:, full * group_size:]
        parts.append(tail * sf[:, full:full + 1] if op == "mul" else tail / sf[:, full:full + 1])
    if not parts:
        return tf
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def dequantize_block(w_q: torch.Tensor, w_scale: torch.Tensor,
                     block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK) -> torch.Tensor:
    """fp32 ``[N, K]``: ``w_q[n, k] * w_scale[n // BN, k // BK]`` (``w_scale [ceil(N/BN), ceil(K/BK)]``)."""
    return _blockwise(w_q, w_scale, block, "mul")


def dequantize_groups(x_q: torch.Tensor, x_scale: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> torch.Tensor:
    """fp32 ``[M, K]``: ``x_q[m, k] * x_scale[m, k // G]`` (``x_scale [M, ceil(K/G)]``, any layout)."""
    return _groupwise(x_q, x_scale, group_size, "mul")


def fp8_gemm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    *,
    group_size: int = DEFAULT_GROUP_SIZE,
    weight_block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK,
) -> torch.Tensor:
    """Reference FP8 GEMM. ``x_q: [M, K]``, ``w_q: [N, K]`` (float8), scales fp32; returns ``[M, N]``.

    Scales: ``x_scale`` one value, ``[M, 1]`` (per token) or ``[M, ceil(K/G)]`` with more than one column (per
    token and group of ``group_size``); ``w_scale`` one value, ``[N]`` / ``[N, 1]`` (per channel) or a 2-D
    ``[ceil(N/BN), ceil(K/BK)]`` with ``weight_block = (BN, BK)`` (per block; told from ``[N, 1]`` by its shape:
    the two coincide only when both mean the same numbers)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if x_scale.dim() == 2 and x_scale.shape[1] > 1:
        x = dequantize_groups(x_q, x_scale, group_size)
    else:
        x = x_q.float() * (x_scale.float().reshape(()) if x_scale.numel() == 1 else x_scale.float().reshape(-1, 1))
    if _is_block_scale(w_scale, n, k, weight_block):
        w = dequantize_block(w_q, w_scale, weight_block)
    else:
        w = w_q.float() * (w_scale.float().reshape(()) if w_scale.numel() == 1 else w_scale.float().reshape(-1, 1))
    y = x @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _is_block_scale(w_scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> bool:
    grid = (-(-n // block[0]), -(-k // block[1]))
    return w_scale.dim() == 2 and tuple(w_scale.shape) == grid and tuple(w_scale.shape) != (n, 1)


def quantize_static(x: torch.Tensor, scale: torch.Tensor, dtype: object = "e4m3fn") -> torch.Tensor:
    """``clamp(x / scale, ±max) -> fp8`` with a given per-tensor (or ``[M, 1]``) fp32 scale."""
    fp8, fmax = _fp8(dtype)
    return scaled_cast(x, scale, fp8, fmax)


def quantize_dynamic_per_tensor(
    x: torch.Tensor, dtype: object = "e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic quantization: ``scale = max(amax(x) / max, 1e-12)`` as a ``[1]`` fp32 tensor (an empty
    ``x`` gets ``1e-12``, as an all-zero one does)."""
    fp8, fmax = _fp8(dtype)
    scale = dynamic_scale(x, fmax)
    return scaled_cast(x, scale, fp8, fmax), scale


def quantize_per_token(x: torch.Tensor, dtype: object = "e4m3fn") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) dynamic quantization of ``x: [M, K]``; ``scale: [M, 1]`` fp32 (rows of an ``x`` with
    K = 0 get ``1e-12``)."""
    fp8, fmax = _fp8(dtype)
    scale = per_token_scale(x, fmax)
    return scaled_cast(x, scale, fp8, fmax), scale


def quantize_per_token_group(
    x: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, dtype: object = "e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group dynamic quantization of ``x: [M, K]``: ``scale [M, ceil(K/G)]`` fp32 row-major, each
    ``max(amax(|x[m, g*G:(g+1)*G]|) / max, 1e-12)`` (the last group of a ragged K covers the columns left);
    ``q [M, K]`` = ``clamp(x / scale of its group, ±max)``."""
    fp8, fmax = _fp8(dtype)
    return quantize_groups(x, group_size, fp8, fmax)


def quantize_block(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK, dtype: object = "e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization of a weight ``w: [N, K]`` (any float dtype): ``scale [ceil(N/BN), ceil(K/BK)]`` fp32, each
    ``max(amax(|block|) / max, 1e-12)``; ``w_q [N, K]`` row-major = ``clamp(w / scale of its block, ±max)``. What
    block-wise FP8 checkpoints store (as ``weight_scale_inv`` / ``weight_scale``)."""
    import torch
    import torch.nn.functional as F

    fp8, fmax = _fp8(dtype)
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.detach().float().abs(), (0, kb * bk - k, 0, nb * bn - n))
    amax = padded.reshape(nb, bn, kb, bk).amax(dim=(1, 3))
    scale = (amax / fmax).clamp_min(MIN_DYNAMIC_SCALE)
    if n and k and bool(torch.isnan(w).any()):  # a NaN block keeps a NaN scale, as the other modes do
        nan = F.pad(torch.isnan(w.detach()), (0, kb * bk - k, 0, nb * bn - n))
        scale = scale.masked_fill(nan.reshape(nb, bn, kb, bk).any(dim=3).any(dim=1), float("nan"))
    q = _blockwise(w, scale, block, "div").clamp(-fmax, fmax).to(fp8)
    return q.contiguous(), scale.contiguous()


# The math itself, with the float8 torch dtype and its largest value given: what the functions above compute once
# they parsed their dtype, and what a compiled layer's generated plan calls with both as constants (no parsing, no
# enum lookups for Dynamo to guard).
def row_major(q: torch.Tensor) -> torch.Tensor:
    """``q [M, K]`` with strides ``(K, 1)``: itself when it has them, else a row-major copy. Elementwise ops keep a
    transposed input's layout, and ``is_contiguous()`` also accepts odd strides on a dimension of size 1 (``[1, K]``
    with strides ``(1, 1)``, from ``a.t()`` of a ``[K, 1]`` tensor), which ``torch._scaled_mm`` refuses as not
    row-major. Under ``torch.compile`` Inductor writes the copy from the kernel that computes ``q``."""
    if q.stride(-1) == 1 and q.stride(0) == max(q.shape[-1], 1):
        return q
    import torch

    return q.clone(memory_format=torch.contiguous_format)


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype, fmax: float) -> torch.Tensor:
    """``clamp(x.float() / scale.float(), ±fmax).to(fp8)``, row-major whatever ``x``'s strides (:func:`row_major`)."""
    return row_major((x.float() / scale.float()).clamp(-fmax, fmax).to(fp8))


def dynamic_scale(x: torch.Tensor, fmax: float) -> torch.Tensor:
    """``[1]`` fp32: ``max(amax(x) / fmax, 1e-12)`` (``1e-12`` for an empty ``x``)."""
    import torch

    if x.numel() == 0:
        return torch.full((1,), MIN_DYNAMIC_SCALE, dtype=torch.float32, device=x.device)
    return (x.detach().abs().amax().float() / fmax).clamp_min(MIN_DYNAMIC_SCALE).reshape(1)


def per_token_scale(x: torch.Tensor, fmax: float) -> torch.Tensor:
    """``[M, 1]`` fp32: each row's ``max(amax / fmax, 1e-12)`` (``1e-12`` where K = 0)."""
    import torch

    if x.shape[-1] == 0:
        return torch.full((*x.shape[:-1], 1), MIN_DYNAMIC_SCALE, dtype=torch.float32, device=x.device)
    return (x.detach().abs().amax(dim=-1, keepdim=True).float() / fmax).clamp_min(MIN_DYNAMIC_SCALE)


def group_scale(x: torch.Tensor, group_size: int, fmax: float) -> torch.Tensor:
    """``[M, ceil(K/G)]`` fp32 row-major: each group's ``max(amax / fmax, 1e-12)`` (NaN where the group holds one,
    as ``amax`` gives; an empty ``x`` with K = 0 gets ``[M, 0]``)."""
    import torch
    import torch.nn.functional as F

    m, k = x.shape
    groups = -(-k // group_size)
    if k == 0:
        return x.new_empty((m, 0), dtype=torch.float32)
    padded = F.pad(x.detach().float().abs(), (0, groups * group_size - k))
    amax = padded.reshape(m, groups, group_size).amax(dim=-1)
    return (amax / fmax).clamp_min(MIN_DYNAMIC_SCALE).contiguous()


def quantize_groups(x: torch.Tensor, group_size: int, fp8: torch.dtype,
                    fmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization of ``x [M, K]``: ``(q [M, K] row-major, scale [M, ceil(K/G)] fp32 row-major)``,
    each group's ``scale = max(amax(|x|) / fmax, 1e-12)`` (NaN where the group holds one, as ``amax`` gives; the last
    group of a ragged K covers the columns left; K = 0 gives ``[M, 0]``) and ``q = clamp(x / scale, ±fmax) -> fp8``.

    Where K is a multiple of G, one reduction per group broadcast back over the same ``[M, K // G, G]`` view, the form
    of a softmax: compiled after a standalone RMSNorm or SiLU·mul, Inductor emits the scale and the codes from one
    kernel where the scale computed first (:func:`group_scale`) and applied through a second view of ``x`` took two
    (H200, ``bench/results/hf_model/2026-12-04-h200-block-native-op/quant_kernels.txt``). A ragged K keeps that
    two-step form (the one-pass form's concatenation of the ragged group took 1-2 kernels more there). The same
    operations in the same order either way: the same bits."""
    m, k = x.shape
    if k % group_size or k == 0:
        scale = group_scale(x, group_size, fmax)
        return scaled_cast_groups(x, scale, group_size, fp8, fmax), scale
    groups = k // group_size
    view = x.float().reshape(m, groups, group_size)
    scale = (view.detach().abs().amax(dim=-1, keepdim=True) / fmax).clamp_min(MIN_DYNAMIC_SCALE)
    q = (view / scale).clamp(-fmax, fmax).to(fp8).reshape(m, k)
    return row_major(q), scale.reshape(m, groups).contiguous()


def scaled_cast_groups(x: torch.Tensor, scale: torch.Tensor, group_size: int, fp8: torch.dtype,
                       fmax: float) -> torch.Tensor:
    """``clamp(x / scale[m, k // G], ±fmax).to(fp8)`` for ``x [M, K]`` and group scales ``[M, ceil(K/G)]``, row-major
    (row stride ``K``)."""
    return row_major(_groupwise(x, scale, group_size, "div").clamp(-fmax, fmax).to(fp8))


def quantize(
    x: torch.Tensor, mode: ActScale, scale: torch.Tensor | None = None, dtype: object = "e4m3fn",
    group_size: int = DEFAULT_GROUP_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` in ``mode``; ``scale`` is required for (and only used by) the static mode; ``group_size``
    only by the per-token-group mode."""
    mode = ActScale.of(mode)
    if mode is ActScale.PER_TENSOR_STATIC:
        if scale is None:
            from .errors import InvalidInputError

            raise InvalidInputError("static quantization needs a scale")
        return quantize_static(x, scale, dtype), scale
    if mode is ActScale.PER_TENSOR_DYNAMIC:
        return quantize_dynamic_per_tensor(x, dtype)
    if mode is ActScale.PER_TOKEN_GROUP:
        return quantize_per_token_group(x, group_size, dtype)
    return quantize_per_token(x, dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32 RMSNorm of ``x: [T, H]`` times ``weight: [H]``; returns fp32."""
    import torch

    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rmsnorm_quant(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, dtype: object = "e4m3fn"
) -> torch.Tensor:
    """``clamp(rmsnorm(x)·weight / scale, ±max) -> fp8`` (``dtype``: float8_e4m3fn by default, ±448)."""
    return quantize_static(rmsnorm(x, weight, eps), scale, dtype)


def fused_add_rmsnorm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    dtype: object = "e4m3fn",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(q, new_residual)`` with ``new_residual = (x + residual)`` in x's dtype and ``q`` the
    quantized RMSNorm of the fp32 sum (in ``dtype``). Does not modify its inputs."""
    total = x.float() + residual.float()
    return quantize_static(rmsnorm(total, weight, eps), scale, dtype), total.to(x.dtype)


def rmsnorm_quant_dynamic(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, act_scale: ActScale = ActScale.PER_TOKEN,
    group_size: int = DEFAULT_GROUP_SIZE, residual: torch.Tensor | None = None, dtype: object = "e4m3fn",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Fused RMSNorm (+ residual add) + dynamic quantization, per token or per token group: returns ``(q [T, H],
    scale, new_residual)``: the fp32 RMSNorm of ``x`` (of ``x + residual`` in fp32 when ``residual`` is given),
    quantized as :func:`quantize_per_token` (``scale [T, 1]``) or :func:`quantize_per_token_group` (``scale
    [T, ceil(H/G)]``) quantize it; ``new_residual`` is the sum in ``x``'s dtype (``None`` without a residual). Does
    not modify its inputs."""
    mode = ActScale.of(act_scale)
    if mode not in (ActScale.PER_TOKEN, ActScale.PER_TOKEN_GROUP):
        from .errors import InvalidInputError

        raise InvalidInputError(f"rmsnorm_quant_dynamic quantizes per_token or per_token_group, not {mode.value}")
    total = x.float() if residual is None else x.float() + residual.float()
    normed = rmsnorm(total, weight, eps)
    if mode is ActScale.PER_TOKEN:
        q, scale = quantize_per_token(normed, dtype)
    else:
        q, scale = quantize_per_token_group(normed, group_size, dtype)
    return q, scale, None if residual is None else total.to(x.dtype)


__all__ = [
    "dequantize",
    "dequantize_block",
    "dequantize_groups",
    "expand_groups",
    "quantize_block",
    "quantize_per_token_group",
    "rmsnorm_quant_dynamic",
    "row_major",
    "group_scale",
    "quantize_groups",
    "scaled_cast_groups",
    "dynamic_scale",
    "fp8_gemm",
    "fused_add_rmsnorm_quant",
    "per_token_scale",
    "quantize",
    "quantize_dynamic_per_tensor",
    "quantize_per_token",
    "quantize_static",
    "rmsnorm",
    "rmsnorm_quant",
    "scaled_cast",
]
