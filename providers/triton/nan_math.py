"""NaN-propagating maxima and clamps for the Triton kernels, and the dynamic quantization built on them
(``@triton.jit`` helpers).

Triton's ``tl.max``, ``tl.maximum`` and ``tl.clamp`` default to ``PropagateNan.NONE``: on the GPU they compile to
``max.f32`` / ``min.f32``, which return the other operand when one is NaN (the interpreter emulates this with
``np.fmax``). The library's reference (``torch.amax``, ``torch.clamp``) keeps a NaN: a NaN element quantizes to an
fp8 NaN, and a NaN anywhere in a dynamic scale's input makes that scale (and every code it divides) NaN. These
helpers give the kernels the reference's semantics; on SM >= 8.0 they compile to the ``.NaN`` forms of the same
instructions.

Kernels import these by name (``from .nan_math import nan_clamp``) and call them unqualified: Inductor, when it
launches a kernel from its generated code, copies the kernel's source with the JIT functions it names, and does not
resolve a module attribute (``nan_math.nan_clamp``).

- :func:`nan_maximum` ``(a, b)``: elementwise ``max``; NaN if either is NaN.
- :func:`nan_max_reduce` ``(x, axis)``: the largest element along ``axis``; NaN if any is NaN.
- :func:`nan_clamp` ``(x, lo, hi)``: ``min(max(x, lo), hi)``; NaN where ``x`` is NaN.
- :func:`dynamic_scale` ``(amax, FMAX)``: ``max(amax / FMAX, 1e-12)`` (IEEE division): a dynamic scale from its amax.
- :func:`scaled_cast` ``(v, scale, FMAX, dtype)``: ``clamp(v / scale, ±FMAX)`` (IEEE division) rounded to ``dtype``
  (float8): the codes. With the reference's order of operations: the kernels that quantize with these two (the fused
  GEMMs and GEMV, the group-quant kernel) give the reference's scales and codes, and each other's, bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def nan_maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_max_reduce(x, axis: tl.constexpr):
    return tl.reduce(x, axis, nan_maximum)


@triton.jit
def nan_clamp(x, lo, hi):
    return tl.clamp(x, lo, hi, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def dynamic_scale(amax, FMAX: tl.constexpr):
    return nan_maximum(tl.math.div_rn(amax, FMAX), 1e-12)


@triton.jit
def scaled_cast(v, scale, FMAX: tl.constexpr, dtype: tl.constexpr):
    return nan_clamp(tl.math.div_rn(v.to(tl.float32), scale), -FMAX, FMAX).to(dtype)
