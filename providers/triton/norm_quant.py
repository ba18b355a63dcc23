"""``triton`` norm-quant provider: fused RMSNorm + FP8 quant written in Triton: static per-tensor, and the dynamic
per-token and per-token-group modes (:mod:`.norm_dynamic_kernels`).

- ``rmsnorm_quant``: ``x [T, H]`` bf16/fp16/fp32 with unit column stride (rows may be strided: ``x[:, :H]`` of a
  wider buffer), ``weight [H]`` same dtype, ``scale`` one fp32
  value on x's device -> ``out [T, H]`` float8_e4m3fn = ``clamp(rmsnorm(x)·weight · (1/scale), ±448)``,
  RMSNorm in fp32.
- ``fused_add_rmsnorm_quant``: ``residual <- x + residual`` **in place** (summed in fp32, stored in the
  residual's dtype), then the same on the fp32 sum.

Any hidden size (masked; no alignment needed). The kernels (``norm_kernels``) take several rows per
program for ``H <= 1024``, one whole row per program in one pass up to 32768, and two passes over the row
above that. ``scale`` is read on the device (CUDA-graph safe; no host sync, no allocation besides the
output the base class makes). Launches use programmatic dependent launch on SM >= 9.0 unless
``FP8_BACKENDS_PDL=0``.

Both calls run as ``torch.library`` ops, defined on first use through :func:`fp8_backends.core.oplib.define_ops` as
``triton_op`` ops: under ``torch.compile`` they decompose into their kernel launches (:mod:`.traced_ops`), which
Inductor makes from its generated code; plain eager calls take the cached launcher with PDL and replays:

- ``fp8_backends::triton_rmsnorm_quant(Tensor(a!) out, Tensor x, Tensor weight, Tensor scale, float eps) -> ()``
- ``fp8_backends::triton_fused_add_rmsnorm_quant(Tensor(a!) out, Tensor x, Tensor(b!) residual,
  Tensor weight, Tensor scale, float eps) -> ()``

registered for CUDA, and also for CPU when Triton's interpreter runs (``TRITON_INTERPRET=1``: CPU-only CI
tests the kernels through the ops).

Numerics: the kernel multiplies by ``1/scale`` where the reference divides, and sums squares in another
order, so an fp8 code can rarely land one step away from ``fp8_backends.core.reference``.

Dynamic modes (``rmsnorm_quant(..., act_scale="per_token" | "per_token_group")``): ``scale`` is computed from the
normalized rows (``[T, 1]`` per token, ``[T, ceil(H/G)]`` per group of 64 or 128 in the requested scale layout) with
IEEE divisions as the reference, and the codes multiply by each scale's reciprocal as in the static mode (a code may
rarely sit one step away); ``x`` may be row-strided. Through the ``triton_op`` ops
``fp8_backends::triton_rmsnorm_quant_dynamic`` and ``triton_fused_add_rmsnorm_quant_dynamic``.

This module imports neither torch nor triton at import time (stevedore imports it during discovery).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from fp8_backends.core.backend import OpNormQuantBackend
from fp8_backends.core.capabilities import NormQuantCapabilities
from fp8_backends.core.errors import BackendUnavailableError
from fp8_backends.core.oplib import LazyOps, TritonOpSpec
from fp8_backends.core.types import ActScale, OutDtype, ScaleLayout

from . import _support

if TYPE_CHECKING:
    import torch

NORM_OP = "triton_rmsnorm_quant"
ADD_NORM_OP = "triton_fused_add_rmsnorm_quant"
SCHEMAS = {
    NORM_OP: "triton_rmsnorm_quant(Tensor(a!) out, Tensor x, Tensor weight, Tensor scale, float eps) -> ()",
    ADD_NORM_OP: (
        "triton_fused_add_rmsnorm_quant(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, "
        "Tensor scale, float eps) -> ()"
    ),
}

def _rmsnorm_quant_impl(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        eps: float) -> None:
    _kernels().rmsnorm_quant(out, x, weight, scale, eps)


def _fused_add_rmsnorm_quant_impl(out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor,
                                  weight: torch.Tensor, scale: torch.Tensor, eps: float) -> None:
    _kernels().fused_add_rmsnorm_quant(out, x, residual, weight, scale, eps)


_kernels_module: Any = None


def _kernels() -> Any:
    """:mod:`.norm_kernels` (imports torch and triton: loaded at the first call, then one global read)."""
    global _kernels_module
    if _kernels_module is None:
        from . import norm_kernels

        _kernels_module = norm_kernels
    return _kernels_module


def _fake(*args: Any) -> None:
    return None


def _dispatch_keys() -> tuple[str, ...]:
    return ("CUDA", "CPU") if _support.interpreting() else ("CUDA",)


def _specs() -> dict[str, Any]:
    """The two ops as ``triton_op`` ops (torch.compile launches the kernels itself, see :mod:`.traced_ops`), or, under
    Triton's interpreter (CPU tests), as opaque ops: Inductor cannot launch interpreted kernels."""
    if _support.interpreting():
        return {NORM_OP: (SCHEMAS[NORM_OP], _rmsnorm_quant_impl, _fake),
                ADD_NORM_OP: (SCHEMAS[ADD_NORM_OP], _fused_add_rmsnorm_quant_impl, _fake)}
    from . import traced_ops

    return {NORM_OP: TritonOpSpec(traced_ops.triton_rmsnorm_quant, _rmsnorm_quant_impl, ("out",)),
            ADD_NORM_OP: TritonOpSpec(traced_ops.triton_fused_add_rmsnorm_quant, _fused_add_rmsnorm_quant_impl,
                                      ("out", "residual"))}


_OPS = LazyOps(_specs, _dispatch_keys)


def load_ops() -> tuple[Any, Any]:
    """Define the two ops once (first use) and return their OpOverloads ``(rmsnorm_quant, fused_add)``."""
    return _OPS.op(NORM_OP), _OPS.op(ADD_NORM_OP)


class TritonNormQuantBackend(OpNormQuantBackend):
    name: ClassVar[str] = "triton"
    description: ClassVar[str] = (
        "Triton fused RMSNorm (+ residual add) + static FP8 quant: any hidden size, bf16/fp16/fp32, "
        "multi-row / whole-row / two-pass kernels, PDL"
    )
    requires: ClassVar[tuple[str, ...]] = _support.REQUIRES
    install_hint: ClassVar[str] = _support.INSTALL_HINT
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities(
        devices=_support.DEVICES,
        min_sm=_support.MIN_SM,
        pdl=True,
        in_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16, OutDtype.FP32}),
        residual=True,
        hidden_align=1,
        strided_rows=True,  # the kernels address rows by x.stride(0)
        priority=25,
        act_scales=frozenset({ActScale.PER_TENSOR_STATIC, ActScale.PER_TOKEN, ActScale.PER_TOKEN_GROUP}),
        group_sizes=frozenset({64, 128}),
    )

    def explicit_only_reason(self, problem: Any, platform: Any) -> str | None:
        return _support.explicit_only_on_cpu(problem, platform)

    #: the Triton activation-quant kernels (:mod:`.quant_kernels`) are the CUDA default of fp8_backends.quant's ops
    activation_quant_devices: ClassVar[frozenset[str]] = frozenset({"cuda"})

    @classmethod
    def activation_quant_kernels(cls, device_type: str) -> dict[ActScale, Any]:
        """:mod:`.quant_kernels` for CUDA tensors when every visible GPU is SM >= 8.9 (FP8 conversions); imports
        triton."""
        if device_type != "cuda":
            return {}
        import torch

        sms = [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
        if not sms or min(sms) < _support.MIN_SM:
            raise BackendUnavailableError(f"the Triton quant kernels need SM >= 8.9 on every GPU, found {sms}")
        from . import quant_kernels

        return quant_kernels.impls()

    def load_ops(self) -> tuple[Any, Any]:
        return load_ops()

    def preload(self) -> None:
        super().preload()
        self._dynamic_call()

    _dynamic_op: Any = None  # the dynamic modes' entry point (through their ops), bound at preload

    def _dynamic_call(self) -> Any:
        call = self._dynamic_op
        if call is None:
            from .norm_dynamic_ops import load_ops as load_dynamic_ops
            from .norm_dynamic_ops import triton_rmsnorm_quant_dynamic

            load_dynamic_ops()
            call = self._dynamic_op = triton_rmsnorm_quant_dynamic
        return call

    def rmsnorm_quant_dynamic_impl(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, act_scale: ActScale,
        group_size: int, scale_layout: ScaleLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused RMSNorm (+ residual add, in place) + per-token or per-token-group quant (one kernel)."""
        import torch

        call = self._dynamic_op or self._dynamic_call()
        group = 0 if act_scale is ActScale.PER_TOKEN else group_size
        return call(x, weight, eps, residual, group, scale_layout.value, torch.float8_e4m3fn)


__all__ = ["ADD_NORM_OP", "NORM_OP", "TritonNormQuantBackend", "load_ops"]
