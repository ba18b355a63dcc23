"""Minimal third-party providers, written the way the README tells a kernel author to."""

from __future__ import annotations

from typing import ClassVar

from fp8_backends import (
    ActScale,
    Availability,
    BiasMode,
    DeviceKind,
    Fp8GemmBackend,
    GemmCapabilities,
    NormQuantBackend,
    NormQuantCapabilities,
    OutDtype,
    PreparedWeight,
    WeightScale,
)

NOT_A_PROVIDER = 42


class ToyGemmBackend(Fp8GemmBackend):
    """Dequantize and matmul in fp32; CPU only, high priority so that `auto` prefers it on the CPU."""

    name: ClassVar[str] = "toy"
    aliases: ClassVar[tuple[str, ...]] = ("toy_alias",)
    description: ClassVar[str] = "test plugin: fp32 dequantize + matmul"
    options: ClassVar[dict[str, tuple[str, ...]]] = {"flavour": ("plain", "spicy")}
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU}),
        act_scales=frozenset(ActScale),
        weight_scales=frozenset(WeightScale),
        out_dtypes=frozenset(OutDtype),
        bias=BiasMode.ADDED_AFTER,
        k_align=1,
        n_align=1,
        priority=100,
    )

    def prepare_weight_impl(self, w_q, w_scale, weight_scale):
        return PreparedWeight(data=w_q, scale=w_scale, n=w_q.shape[0], k=w_q.shape[1],
                              dtype=self.fp8_of(w_q), weight_scale=weight_scale, backend=self.name)

    @staticmethod
    def fp8_of(t):
        from fp8_backends.core.types import Fp8Dtype

        return Fp8Dtype.of(t.dtype)

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        from fp8_backends.core import reference

        return reference.fp8_gemm(x_q, prepared.data, x_scale, prepared.scale, out_dtype, bias)


class ClashingGemmBackend(ToyGemmBackend):
    name: ClassVar[str] = "torch_scaled_mm"
    aliases: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU}), k_align=1, n_align=1, priority=1
    )


class RaisingGemmBackend(ToyGemmBackend):
    name: ClassVar[str] = "raising"
    aliases: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def availability(cls) -> Availability:
        raise RuntimeError("probe exploded")


class BadCheckGemmBackend(ToyGemmBackend):
    """Its support check raises: never offered as usable, never breaks resolution."""

    name: ClassVar[str] = "badcheck"
    aliases: ClassVar[tuple[str, ...]] = ()

    def extra_reasons(self, problem, platform) -> list[str]:
        raise ZeroDivisionError("support check exploded")


class ToyNormQuantBackend(NormQuantBackend):
    name: ClassVar[str] = "toy_norm"
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities(
        devices=frozenset({DeviceKind.CPU}), priority=50
    )

    def rmsnorm_quant_impl(self, out, x, weight, scale, eps):
        from fp8_backends.core import reference

        out.copy_(reference.rmsnorm_quant(x, weight, scale, eps))

    def fused_add_rmsnorm_quant_impl(self, out, x, residual, weight, scale, eps):
        from fp8_backends.core import reference

        q, r = reference.fused_add_rmsnorm_quant(x, residual, weight, scale, eps)
        out.copy_(q)
        residual.copy_(r)
