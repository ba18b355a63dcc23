"""How the conformance kit compares a provider's output with :mod:`fp8_backends.core.reference`.

The tolerances are stated here, once, and printed in every failure:

- GEMM (:func:`assert_gemm_close`): the reference is computed in fp32 (bias included). The output must have
  the expected shape and dtype, be finite wherever the reference is, and satisfy both

  - ``‖y − ref‖ / ‖ref‖ ≤ rtol`` (default ``1e-2``: fp32 accumulation in any order, any rounding of the
    output, fast accumulation of FP8 tensor cores), and
  - for every element ``|y − ref| ≤ rtol · max|ref| + ulp · |ref|``, where ``ulp`` is one unit in the last
    place of the output dtype (``2^-7`` bf16, ``2^-10`` fp16; ``2^-20``, a few ulps, for fp32): one wrong element (an
    unwritten tail, a stray row) fails even when the norm hides it.

- FP8 codes (:func:`assert_codes_close`, fused RMSNorm + quant): every code at most one FP8 step from the
  reference's, and at most ``max_fraction`` (default 0.5 %) of them different at all (a kernel that
  multiplies by ``1/scale`` where the reference divides, or sums squares in another order, lands on the
  neighbouring code for values at a rounding boundary). ``max_fraction = 0`` asks for every code exactly.

- Residual (:func:`assert_residual_close`): equal to the reference (``x + residual`` summed in fp32, rounded
  once to the residual's dtype), or within ``max_ulps`` units in the last place when a provider states so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GEMM_RTOL = 1e-2
CODES_MAX_FRACTION = 5e-3

_ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10, "float32": 2.0**-20}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖actual − expected‖ / ‖expected‖`` in fp32 (0 for two empty tensors)."""
    if expected.numel() == 0:
        return 0.0
    a, e = actual.float(), expected.float()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def assert_gemm_close(
    y: torch.Tensor, ref: torch.Tensor, out_dtype: torch.dtype, rtol: float = GEMM_RTOL, what: str = ""
) -> None:
    """``y`` (the provider's ``[M, N]`` output in ``out_dtype``) against ``ref`` (fp32 reference, same shape);
    see the module docstring for the two criteria."""
    import torch

    label = f"{what}: " if what else ""
    assert isinstance(y, torch.Tensor), f"{label}gemm returned {type(y).__name__}, not a tensor"
    assert tuple(y.shape) == tuple(ref.shape), f"{label}output shape {tuple(y.shape)}, expected {tuple(ref.shape)}"
    assert y.dtype == out_dtype, f"{label}output dtype {y.dtype}, expected {out_dtype}"
    assert y.device == ref.device, f"{label}output on {y.device}, inputs on {ref.device}"
    if ref.numel() == 0:
        return
    yf, rf = y.float(), ref.float()
    finite = torch.isfinite(rf)
    bad = finite & ~torch.isfinite(yf)
    assert not bool(bad.any()), f"{label}{int(bad.sum())} non-finite outputs where the reference is finite"
    err = relative_error(yf[finite], rf[finite])
    assert err <= rtol, f"{label}relative error {err:.3g} > {rtol:g} (‖y − ref‖ / ‖ref‖, reference in fp32)"
    ulp = _ULP[str(out_dtype).removeprefix("torch.")]
    bound = rtol * rf[finite].abs().max() + ulp * rf.abs()
    excess = torch.where(finite, (yf - rf).abs() - bound, torch.full_like(rf, -1.0))
    if bool((excess > 0).any()):
        row, col = divmod(int(excess.argmax()), ref.shape[1])
        raise AssertionError(
            f"{label}{int((excess > 0).sum())} of {ref.numel()} elements off by more than "
            f"{rtol:g}·max|ref| + ulp·|ref|; worst at [{row}, {col}]: {yf[row, col].item():.6g} vs "
            f"{rf[row, col].item():.6g}"
        )


def _ordinal(q: torch.Tensor) -> torch.Tensor:
    """FP8 codes as signed integers in value order (sign-magnitude -> two's complement; ±0 -> 0)."""
    import torch

    b = q.view(torch.uint8).to(torch.int16)
    mag = b & 0x7F
    return torch.where(b >= 0x80, -mag, mag)


def assert_codes_close(
    q: torch.Tensor, ref: torch.Tensor, max_fraction: float = CODES_MAX_FRACTION, what: str = ""
) -> None:
    """Every FP8 code of ``q`` at most one step from ``ref``'s, and at most ``max_fraction`` of them off."""
    label = f"{what}: " if what else ""
    assert q.dtype == ref.dtype and q.shape == ref.shape, f"{label}{q.dtype} {tuple(q.shape)} vs {ref.dtype} " \
        f"{tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    diff = (_ordinal(q.cpu()) - _ordinal(ref.cpu())).abs()
    worst = int(diff.max())
    off = int((diff > 0).sum())
    assert worst <= 1, f"{label}an FP8 code is {worst} steps from the reference"
    allowed = max(1, int(max_fraction * diff.numel())) if max_fraction > 0 else 0  # 0: every code exact
    assert off <= allowed, (
        f"{label}{off} of {diff.numel()} FP8 codes differ from the reference (at most {max_fraction:.2%} may)"
    )


def assert_residual_close(actual: torch.Tensor, expected: torch.Tensor, max_ulps: int = 0, what: str = "") -> None:
    """``actual`` equals ``expected`` (same dtype), or is within ``max_ulps`` units in the last place."""
    import torch

    label = f"{what}: " if what else ""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, f"{label}residual {actual.dtype} " \
        f"{tuple(actual.shape)} vs {expected.dtype} {tuple(expected.shape)}"
    if max_ulps == 0:
        if not torch.equal(actual, expected):
            n = int((actual != expected).sum())
            raise AssertionError(f"{label}residual differs from x + residual (fp32 sum rounded once) at {n} places")
        return
    ulp = torch.finfo(expected.dtype).eps * expected.float().abs().clamp_min(torch.finfo(expected.dtype).tiny)
    off = (actual.float() - expected.float()).abs() > max_ulps * ulp
    assert not bool(off.any()), f"{label}residual off by more than {max_ulps} ulp at {int(off.sum())} places"


def assert_scales_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "", rtol: float = 2e-6) -> None:
    """Dynamic scales: the reference's shape, NaN where it has NaN, elsewhere within ``rtol`` (a few fp32 ulps: a
    kernel sums the squares of a row in its own order)."""
    import torch

    label = f"{what}: " if what else ""
    assert actual.dtype == torch.float32 and tuple(actual.shape) == tuple(expected.shape), (
        f"{label}scale {actual.dtype} {tuple(actual.shape)}, expected float32 {tuple(expected.shape)}")
    a, e = actual.cpu(), expected.cpu()
    nan = torch.isnan(e)
    assert torch.equal(torch.isnan(a), nan), f"{label}the scales' NaNs are not where the reference has them"
    torch.testing.assert_close(a[~nan], e[~nan], rtol=rtol, atol=0, msg=lambda m: f"{label}scales: {m}")


__all__ = [
    "CODES_MAX_FRACTION",
    "GEMM_RTOL",
    "assert_codes_close",
    "assert_gemm_close",
    "assert_residual_close",
    "assert_scales_close",
    "relative_error",
]
