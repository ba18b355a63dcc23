"""``flashinfer`` norm-quant provider: flashinfer's fused RMSNorm + static FP8 quant kernels.

- ``rmsnorm_quant``: ``x [T, H]`` bf16/fp16 row-major, ``weight [H]`` same dtype, ``scale`` one fp32
  value on x's device -> ``out [T, H]`` float8_e4m3fn = ``clamp(rmsnorm(x)·weight · (1/scale), ±448)``.
- ``fused_add_rmsnorm_quant``: ``residual <- x + residual`` **in place** (flashinfer's kernel writes it,
  as the NormQuantBackend contract asks), then the same on the fp32 sum (kept in shared memory).

Both run as ``torch.library`` ops (``fp8_backends::flashinfer_rmsnorm_quant`` /
``fp8_backends::flashinfer_fused_add_rmsnorm_quant``, see ``norm_ops``) that call flashinfer's
compiled norm module directly when flashinfer uses its CUDA norm kernels (``FLASHINFER_USE_CUDA_NORM=1``
or no CuTe DSL for the GPU), else ``flashinfer.rmsnorm_quant`` / ``flashinfer.fused_add_rmsnorm_quant``.
``scale`` goes to the kernel as a ``(1,)`` fp32 device tensor (read on the device: CUDA-graph safe).
Launches use programmatic dependent launch on SM >= 9.0.

Numerics: flashinfer multiplies by ``1/scale`` where the reference divides, so a few fp8 codes
(fraction well under 1e-3) can differ by one step from ``fp8_backends.core.reference``.

Availability imports flashinfer once (1.3-1.5 s after torch, byte-compiled) to probe for ``rmsnorm_quant`` and
``fused_add_rmsnorm_quant``, but only when flashinfer is installed and a CUDA device is present.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from fp8_backends.core.backend import OpNormQuantBackend
from fp8_backends.core.capabilities import NormQuantCapabilities
from fp8_backends.core.types import (
    Availability,
    DeviceKind,
    NormQuantProblem,
    OutDtype,
)

from . import common

if TYPE_CHECKING:

    from fp8_backends.registry.platform import Platform

FEATURES = ("rmsnorm_quant", "fused_add_rmsnorm_quant")

# max dynamic shared memory per block (KiB) by SM; the fused-add kernel keeps an fp32 row there
_SMEM_KIB = {(8, 0): 163, (8, 7): 163, (9, 0): 227, (10, 0): 227, (10, 3): 227, (10, 7): 227, (11, 0): 227}
_SMEM_KIB_DEFAULT = 99


def fused_add_smem_bytes(hidden: int) -> int:
    """Shared memory flashinfer's FusedAddRMSNormQuant asks for: one fp32 per element of the row
    plus the per-warp partial sums (rounded up to 4 floats)."""
    vec = _gcd(8, hidden)  # 16-byte vectors of 2-byte elements
    warps = -(-min(1024, hidden // vec) // 32)
    return (-(-warps // 4) * 4 + hidden) * 4


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


class FlashinferNormQuantBackend(OpNormQuantBackend):
    name: ClassVar[str] = "flashinfer"
    description: ClassVar[str] = "flashinfer rmsnorm_quant / fused_add_rmsnorm_quant (fused CUDA kernels, PDL)"
    requires: ClassVar[tuple[str, ...]] = ("torch", "flashinfer")
    install_hint: ClassVar[str] = common.INSTALL_HINT
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities(
        devices=frozenset({DeviceKind.CUDA}),
        min_sm=(8, 0),
        pdl=True,
        in_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16}),
        residual=True,
        hidden_align=1,
        strided_rows=True,  # flashinfer's kernels take x.stride(0); rows its vector loads cannot read are copied
        priority=20,
    )

    @classmethod
    def availability(cls) -> Availability:
        """Installed + CUDA present (no import), then the feature probe (imports flashinfer once)."""
        base = common.base_availability()
        if not base.ok:
            return base
        missing = common.missing_features(FEATURES)
        if isinstance(missing, str):
            return Availability.no(missing, common.INSTALL_HINT)
        if missing:
            return Availability.no(
                f"flashinfer {common.flashinfer_version()} lacks {', '.join(missing)}",
                "pip install -U fp8-backends[flashinfer]",
            )
        return Availability.yes()

    def extra_reasons(self, problem: NormQuantProblem | None, platform: Platform) -> list[str]:
        if problem is None or not problem.residual or not platform.is_cuda or platform.sm is None:
            return []
        need = fused_add_smem_bytes(problem.hidden)
        have = _SMEM_KIB.get(tuple(platform.sm), _SMEM_KIB_DEFAULT) * 1024
        if need > have:
            return [
                f"the fused residual add keeps the fp32 row in shared memory: hidden {problem.hidden} needs "
                f"{need} bytes, SM {platform.arch} allows {have}"
            ]
        return []

    def load_ops(self) -> tuple[Any, Any]:
        from . import norm_ops

        return norm_ops.rmsnorm_quant_op, norm_ops.fused_add_rmsnorm_quant_op
