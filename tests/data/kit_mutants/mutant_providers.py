"""Providers with one deliberate bug each: the conformance kit must fail each on the test named in
``EXPECTED_FAILURES`` (tests/test_testing_kit.py checks it). Import-light like a real provider module."""

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
    WeightScale,
)


class GoodGemm(Fp8GemmBackend):
    """Correct: dequantize in fp32, matmul, add bias (the reference), on the CPU."""

    name: ClassVar[str] = "good_gemm"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU}), act_scales=frozenset(ActScale), weight_scales=frozenset(WeightScale),
        out_dtypes=frozenset(OutDtype), bias=BiasMode.ADDED_AFTER, k_align=1, n_align=1,
    )

    def prepare_weight_impl(self, w_q, w_scale, weight_scale):
        return self.prepare_k_major(w_q, w_scale, weight_scale)

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        from fp8_backends.core import reference

        return reference.fp8_gemm(x_q, prepared.data, x_scale, prepared.scale, out_dtype, bias)


class IgnoresWeightScale(GoodGemm):
    name: ClassVar[str] = "ignores_weight_scale"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        from fp8_backends.core import reference

        return reference.fp8_gemm(x_q, prepared.data, x_scale, prepared.scale.new_ones(1), out_dtype, bias)


class DropsBias(GoodGemm):
    name: ClassVar[str] = "drops_bias"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        return super().gemm_impl(x_q, prepared, x_scale, out_dtype, None)


class LosesLastRow(GoodGemm):
    """Leaves the last row of odd batches unwritten (an M-tail bug)."""

    name: ClassVar[str] = "loses_last_row"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        y = super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)
        if y.shape[0] > 1 and y.shape[0] % 2:
            y[-1] = 0
        return y


class FirstRowScaleOnly(GoodGemm):
    """Declares per-token scales but applies the first row's to every row."""

    name: ClassVar[str] = "first_row_scale_only"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        return super().gemm_impl(x_q, prepared, x_scale.reshape(-1)[:1], out_dtype, bias)


class SkipsValidation(GoodGemm):
    """Calls its kernel without the library's input checks."""

    name: ClassVar[str] = "skips_validation"

    def gemm(self, x_q, prepared, x_scale, *, out_dtype="bfloat16", bias=None):
        import torch

        return self.gemm_impl(x_q, prepared, x_scale, getattr(torch, str(out_dtype).removeprefix("torch.")), bias)


class AcceptsUndeclared(GoodGemm):
    """Declares bf16 output only, but its validation lets any output dtype through to the kernel."""

    name: ClassVar[str] = "accepts_undeclared"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU}), out_dtypes=frozenset({OutDtype.BF16}), k_align=1, n_align=1,
    )

    def validate_gemm_inputs(self, x_q, prepared, x_scale, out_dtype, bias):
        return OutDtype.of(out_dtype)


class ReadsScaleOnHost(GoodGemm):
    """Branches on a scale's value on the host: breaks fake tensors and torch.compile(fullgraph=True)."""

    name: ClassVar[str] = "reads_scale_on_host"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        if bool((x_scale > 1e6).any()):
            raise ValueError("scale out of range")
        return super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)


class InstanceAvailability(GoodGemm):
    """Overrides availability() as an instance method (the README's first trap)."""

    name: ClassVar[str] = "instance_availability"

    def availability(self):  # type: ignore[override]
        return Availability.yes()


class NegativeHostCost(GoodGemm):
    """Prices its large-M calls at a negative host time (``host_us_for``), which would make it win every host-bound
    decision."""

    name: ClassVar[str] = "negative_host_cost"
    host_us: ClassVar[float | None] = 5.0

    @classmethod
    def host_us_for(cls, m, n, k, options):
        return 5.0 if m < 1024 else -80.0


class NotRegistered(GoodGemm):
    name: ClassVar[str] = "not_registered"


_BLOCK = {"group_sizes": frozenset({64, 128}), "weight_blocks": frozenset({(128, 128)})}


class GoodBlockGemm(GoodGemm):
    """Correct, block-wise FP8 too (groups of 64 and 128, 128x128 blocks)."""

    name: ClassVar[str] = "good_block_gemm"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU}), act_scales=frozenset(ActScale), weight_scales=frozenset(WeightScale),
        out_dtypes=frozenset(OutDtype), bias=BiasMode.ADDED_AFTER, k_align=1, n_align=1, **_BLOCK,
    )

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        from fp8_backends.core import reference

        if prepared.block is None:
            return super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)
        return reference.fp8_gemm(x_q, prepared.data, x_scale, prepared.scale, out_dtype, bias,
                                  group_size=prepared.group_size, weight_block=prepared.block)


class GoodBlockOnlyGemm(GoodBlockGemm):
    """Correct, block-wise FP8 only (no per-tensor or per-token mode)."""

    name: ClassVar[str] = "good_block_only_gemm"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU}), act_scales=frozenset({ActScale.PER_TOKEN_GROUP}),
        weight_scales=frozenset({WeightScale.BLOCK}), out_dtypes=frozenset(OutDtype), bias=BiasMode.ADDED_AFTER,
        k_align=1, n_align=1, **_BLOCK,
    )


class BlockIgnoresWeightScale(GoodBlockGemm):
    """Block-wise: multiplies by no weight scale (the per-tensor modes are right)."""

    name: ClassVar[str] = "block_ignores_weight_scale"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        import dataclasses

        if prepared.block is not None:
            prepared = dataclasses.replace(prepared, scale=prepared.scale.new_ones(prepared.scale.shape))
        return super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)


class BlockFirstGroupScale(GoodBlockGemm):
    """Block-wise: applies each token's first group scale to all its groups."""

    name: ClassVar[str] = "block_first_group_scale"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        if prepared.block is not None:
            x_scale = x_scale[:, :1].expand(x_scale.shape).contiguous()
        return super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)


class BlockDecodeFirstBlockScale(GoodBlockGemm):
    """Block-wise at M = 1 only (a decode kernel): applies the first weight block's scale to every block."""

    name: ClassVar[str] = "block_decode_first_block_scale"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        import dataclasses

        if prepared.block is not None and x_q.shape[0] == 1:
            prepared = dataclasses.replace(prepared, scale=prepared.scale[:1, :1].expand(prepared.scale.shape))
        return super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)


class BlockLargeMFirstGroupScale(GoodBlockGemm):
    """Block-wise past M = 16 only (a large-tile kernel): applies each token's first group scale to all its groups."""

    name: ClassVar[str] = "block_large_m_first_group_scale"

    def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
        if prepared.block is not None and x_q.shape[0] > 16:
            x_scale = x_scale[:, :1].expand(x_scale.shape).contiguous()
        return super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)


class GoodNorm(NormQuantBackend):
    """Correct: the reference, on the CPU."""

    name: ClassVar[str] = "good_norm"
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities(
        devices=frozenset({DeviceKind.CPU}), in_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16}),
    )

    def rmsnorm_quant_impl(self, out, x, weight, scale, eps):
        from fp8_backends.core import reference

        out.copy_(reference.rmsnorm_quant(x, weight, scale, eps))

    def fused_add_rmsnorm_quant_impl(self, out, x, residual, weight, scale, eps):
        from fp8_backends.core import reference

        q, r = reference.fused_add_rmsnorm_quant(x, residual, weight, scale, eps)
        out.copy_(q)
        residual.copy_(r)


class GoodDynamicNorm(GoodNorm):
    """Correct, the dynamic modes too (per token, per token group of 64 / 128): the reference."""

    name: ClassVar[str] = "good_dynamic_norm"
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities(
        devices=frozenset({DeviceKind.CPU}), in_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16}),
        act_scales=frozenset({ActScale.PER_TENSOR_STATIC, ActScale.PER_TOKEN, ActScale.PER_TOKEN_GROUP}),
        group_sizes=frozenset({64, 128}),
    )

    def rmsnorm_quant_dynamic_impl(self, x, weight, eps, residual, act_scale, group_size, scale_layout):
        from fp8_backends.core import group_scales, reference

        q, scale, summed = reference.rmsnorm_quant_dynamic(x, weight, eps, act_scale=act_scale,
                                                           group_size=group_size, residual=residual)
        if residual is not None:
            residual.copy_(summed)
        if act_scale is ActScale.PER_TOKEN_GROUP:
            scale = group_scales.to_layout(scale, scale_layout)
        return q, scale


class DynamicScaleDoubled(GoodDynamicNorm):
    """Dynamic modes: returns twice the scale (the codes are right)."""

    name: ClassVar[str] = "dynamic_scale_doubled"

    def rmsnorm_quant_dynamic_impl(self, x, weight, eps, residual, act_scale, group_size, scale_layout):
        q, scale = super().rmsnorm_quant_dynamic_impl(x, weight, eps, residual, act_scale, group_size, scale_layout)
        return q, scale.mul_(2)


class DynamicResidualNotWritten(GoodDynamicNorm):
    """Dynamic modes: normalizes x + residual but leaves the residual as it was."""

    name: ClassVar[str] = "dynamic_residual_not_written"

    def rmsnorm_quant_dynamic_impl(self, x, weight, eps, residual, act_scale, group_size, scale_layout):
        kept = None if residual is None else residual.clone()
        return super().rmsnorm_quant_dynamic_impl(x, weight, eps, kept, act_scale, group_size, scale_layout)


class NormIgnoresWeight(GoodNorm):
    name: ClassVar[str] = "norm_ignores_weight"

    def rmsnorm_quant_impl(self, out, x, weight, scale, eps):
        super().rmsnorm_quant_impl(out, x, weight.new_ones(weight.shape), scale, eps)


class ResidualNotWritten(GoodNorm):
    name: ClassVar[str] = "residual_not_written"

    def fused_add_rmsnorm_quant_impl(self, out, x, residual, weight, scale, eps):
        super().fused_add_rmsnorm_quant_impl(out, x, residual.clone(), weight, scale, eps)


class WritesPastOut(GoodNorm):
    """Writes a few bytes after ``out`` (an unmasked tail), when there is room in its storage."""

    name: ClassVar[str] = "writes_past_out"

    def rmsnorm_quant_impl(self, out, x, weight, scale, eps):
        import torch

        super().rmsnorm_quant_impl(out, x, weight, scale, eps)
        raw = torch.empty(0, dtype=torch.uint8, device=out.device).set_(out.untyped_storage())
        end = out.storage_offset() + out.numel()
        raw[end:end + 4] = 0


class IgnoresEps(GoodNorm):
    name: ClassVar[str] = "ignores_eps"

    def rmsnorm_quant_impl(self, out, x, weight, scale, eps):
        super().rmsnorm_quant_impl(out, x, weight, scale, 1e-6)


class MultipliesByScale(GoodNorm):
    name: ClassVar[str] = "multiplies_by_scale"

    def rmsnorm_quant_impl(self, out, x, weight, scale, eps):
        from fp8_backends.core import reference

        out.copy_(reference.quantize_static(reference.rmsnorm(x, weight, eps), 1 / scale))
