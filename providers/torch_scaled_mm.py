"""``torch_scaled_mm``: FP8 GEMM through ``torch._scaled_mm`` (cuBLASLt / CUTLASS inside torch).

Per-tensor scales on CUDA SM >= 8.9 and on the CPU; row-wise scales (per-token activation x
per-channel weight) through torch's row-wise path; block-wise FP8 (1x128 activation groups x 128x128 weight
blocks) through cuBLASLt's block-scaled GEMM on SM 9.0 where this torch serves it, and torch ops on the CPU
(:mod:`.torch_block`). The weight is prepared once as the column-major ``[K, N]`` view ``_scaled_mm`` wants
(``w_q.t()`` of a row-major ``[N, K]``: no copy). On CUDA, N or K not a multiple of 16 (cuBLASLt's row alignment)
is served by padding: the weight zero-padded once (to multiples of 16; of 128 from 2048 on:
:func:`~fp8_backends.core.padding.padded_size`), the activation to the padded K (written so by a layer's quantizer,
else padded per call) and the output returned as the ``[M, N]`` column view of the padded result.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, ClassVar

from fp8_backends.core.backend import Fp8GemmBackend
from fp8_backends.core.capabilities import GemmCapabilities
from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.padding import ROW_ALIGN, match_k, pad_weight, padded_size
from fp8_backends.core.types import (
    ActScale,
    BiasMode,
    DeviceKind,
    Fp8Dtype,
    GemmProblem,
    OutDtype,
    PreparedWeight,
    ScaleLayout,
    WeightScale,
)

if TYPE_CHECKING:
    import torch

    from fp8_backends.registry.platform import Platform


logger = logging.getLogger("fp8_backends")

#: the option does nothing there (torch's CPU _scaled_mm accumulates in fp32 whatever it says): refused, not ignored
_CPU_FAST_ACCUM = "fast_accum=true has no effect on the CPU (torch's CPU _scaled_mm ignores it); use fast_accum=false"
_CPU_NO_ROWWISE = ("this torch's CPU _scaled_mm takes per-tensor scales only (torch 2.11 raises 'only supports "
                   "per-tensor scaling for CPU backend'); per-token / per-channel problems on the CPU need a newer "
                   "torch")


@functools.cache
def cpu_rowwise_supported() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (``[M, 1]`` x ``[1, N]``): one 16x16 call, made
    once per process when a CPU problem with per-token or per-channel scales is first resolved."""
    import torch

    a = torch.zeros((16, 16), dtype=torch.float8_e4m3fn)
    b = torch.zeros((16, 16), dtype=torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones((16, 1)), scale_b=torch.ones((1, 16)), out_dtype=torch.bfloat16)
    except Exception as exc:  # torch 2.11: an INTERNAL ASSERT (RuntimeError); others may raise other types
        logger.debug("torch_scaled_mm: no row-wise scales on the CPU in torch %s (%s)", torch.__version__,
                     str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    return True


def pads_rows(device_type: str) -> bool:
    """Whether ``_scaled_mm`` on ``device_type`` tensors needs 16-byte aligned rows (a weight of another N or K is
    padded): CUDA's cuBLASLt does, the CPU's does not."""
    return device_type != "cpu"


class TorchScaledMMBackend(Fp8GemmBackend):
    name: ClassVar[str] = "torch_scaled_mm"
    aliases: ClassVar[tuple[str, ...]] = ("torch",)
    description: ClassVar[str] = "torch._scaled_mm (cuBLASLt per-tensor, torch's row-wise kernel)"
    requires: ClassVar[tuple[str, ...]] = ("torch",)
    install_hint: ClassVar[str] = "pip install torch"
    options: ClassVar[dict[str, tuple[str, ...]]] = {"fast_accum": ("false", "true")}
    # fast accumulation passes the tuner's accuracy check (rel. error ~2.6e-3 vs 1.7e-3 at 8192^3)
    tunable_options: ClassVar[tuple[str, ...]] = ("fast_accum",)
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CUDA, DeviceKind.CPU}),
        min_sm=(8, 9),
        pdl=False,
        act_scales=frozenset(ActScale),
        weight_scales=frozenset(WeightScale),
        input_dtypes=frozenset({Fp8Dtype.E4M3FN, Fp8Dtype.E5M2}),
        mixed_inputs=True,
        out_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16, OutDtype.FP32}),
        bias=BiasMode.FUSED,
        # any N and K: the CPU's _scaled_mm takes them (fp32 math); on CUDA, where cuBLASLt wants 16-byte aligned
        # rows (torch checks it before the call), the weight is zero-padded once (prepare_weight_impl); block-wise
        # FP8 on CUDA keeps cuBLASLt's rule (_block_platform_reasons)
        k_align=1,
        n_align=1,
        priority=10,
        group_sizes=frozenset({128}),
        weight_blocks=frozenset({(128, 128)}),
        group_scale_layout=ScaleLayout.M_MAJOR,
    )
    # host µs per call on the compiled path (cuBLASLt's heuristics run at every call): 5 + the 16 µs a compiled
    # Fp8Linear on torch._scaled_mm costs more than on the triton op (median over 6 shapes x M, H200, 2026-12-01,
    # bench/results/compiled_host/2026-12-01-h200-static-launcher/compiled_host_sl-*.md; the triton op counted at 5)
    host_us: ClassVar[float | None] = 20.0
    #: block-scaled problems went through the opaque op ``fp8_backends::scaled_mm_block`` (M padding in Python, then
    #: cuBLASLt): a compiled block linear measured 22-107 µs more host time per call than on the cutlass provider's
    #: C++ op (median ~66; Qwen3-8B qkv and down shapes x M = 16 / 128 / 512, H200,
    #: bench/results/compiled_host/2026-12-04-h200-block/), which is declared at 13. Compiled calls now trace
    #: ``torch._scaled_mm`` itself where torch's meta serves block scales, ~22 µs less per call
    #: (bench/results/compiled_host/2026-12-04-h200-scaled-mm-block/); the figure stays until a model run measures
    #: what re-pricing moves (at 53 the Qwen3-8B gate/up M <= 256 bucket and o's M > 1024 go to torch_scaled_mm)
    block_host_us: ClassVar[float | None] = 75.0

    def extra_reasons(self, problem: GemmProblem | None, platform: Platform) -> list[str]:
        if problem is not None and problem.device is DeviceKind.CPU and self.config["fast_accum"] == "true":
            return [_CPU_FAST_ACCUM]
        if problem is None:
            return []
        if problem.block_scaled:
            return self._block_platform_reasons(problem, platform)
        rowwise = problem.act_scale is ActScale.PER_TOKEN or problem.weight_scale is WeightScale.PER_CHANNEL
        if problem.device is DeviceKind.CPU:
            return [_CPU_NO_ROWWISE] if rowwise and not cpu_rowwise_supported() else []
        reasons = []
        if problem.input_dtype is Fp8Dtype.E5M2 and problem.weight_dtype is Fp8Dtype.E5M2:
            reasons.append("cuBLASLt has no e5m2 x e5m2 FP8 GEMM")
        if rowwise:
            if problem.input_dtype is not Fp8Dtype.E4M3FN or problem.weight_dtype is not Fp8Dtype.E4M3FN:
                reasons.append("torch's row-wise FP8 kernel takes e4m3fn inputs only")
            if problem.out_dtype is not OutDtype.BF16:
                reasons.append("torch's row-wise FP8 kernel writes bfloat16 only")
        return reasons

    def _block_platform_reasons(self, problem: GemmProblem, platform: Platform) -> list[str]:
        """Block-wise FP8: the CPU path serves every shape; on CUDA cuBLASLt's block-scaled GEMM on SM 9.0 where
        this torch serves it (probed once per device), bfloat16 out, precise accumulation."""
        if problem.device is DeviceKind.CPU:
            return [_CPU_FAST_ACCUM] if self.config["fast_accum"] == "true" else []
        reasons = [f"{dim}={size} is not a multiple of {ROW_ALIGN} (cuBLASLt's block-scaled FP8 GEMM needs 16-byte "
                   "aligned rows)" for dim, size in (("K", problem.k), ("N", problem.n)) if size % ROW_ALIGN]
        if self.config["fast_accum"] == "true":
            reasons.append("block-scaled FP8 accumulates precisely (fast_accum=true does not apply)")
        if problem.input_dtype is not Fp8Dtype.E4M3FN or problem.weight_dtype is not Fp8Dtype.E4M3FN:
            reasons.append("cuBLASLt's block-scaled FP8 GEMM takes e4m3fn inputs only")
        if problem.out_dtype is not OutDtype.BF16:
            reasons.append("cuBLASLt's block-scaled FP8 GEMM is served here for bfloat16 output only")
        if platform.sm is not None and platform.sm != (9, 0):
            reasons.append(f"cuBLASLt's block-scaled FP8 GEMM runs on SM 9.0 only; this GPU is SM {platform.arch}")
        elif platform.sm is not None and not platform.simulated and platform.device_index is not None:
            from .torch_block import cuda_block_support

            why = cuda_block_support(platform.device_index).reason_for(problem.k)
            if why:
                reasons.append(why)
        return reasons

    def block_reasons(self, problem: GemmProblem) -> list[str]:
        return []

    def prepare_weight_impl(
        self, w_q: torch.Tensor, w_scale: torch.Tensor, weight_scale: WeightScale
    ) -> PreparedWeight:
        if w_q.device.type == "cpu" and self.config["fast_accum"] == "true":
            raise InvalidInputError(_CPU_FAST_ACCUM)
        if weight_scale is WeightScale.BLOCK:
            return self._prepare_block_weight(w_q, w_scale)
        import torch

        n, k = w_q.shape
        k_pad = n_pad = None
        if pads_rows(w_q.device.type) and (n % ROW_ALIGN or k % ROW_ALIGN):
            # cuBLASLt wants 16-byte aligned rows: a zero-padded copy, once, to 16 multiples (128 from 2048 on:
            # padded_size); activations are padded to match as they are quantized, the output's padded columns cut
            # off as a view (gemm_impl)
            n_pad, k_pad = padded_size(n), padded_size(k)
            w_q = pad_weight(w_q, n_pad, k_pad)
        # row-wise B scale [1, N], used whenever either operand is scaled per row; built once here (padded columns
        # scale zero weights: any finite value, 1)
        row_scale = w_scale.reshape(-1).expand(n).reshape(1, n)
        if n_pad is not None:
            row_scale = torch.nn.functional.pad(row_scale, (0, n_pad - n), value=1.0)
        row_scale = row_scale.contiguous()
        return PreparedWeight(
            data=w_q.t(),  # [K, N] column-major view: what _scaled_mm wants for B
            scale=w_scale.reshape(()).contiguous() if weight_scale is WeightScale.PER_TENSOR else row_scale,
            n=n,
            k=k,
            dtype=Fp8Dtype.of(w_q.dtype),
            weight_scale=weight_scale,
            backend=self.name,
            extra={"row_scale": row_scale},
            k_pad=k_pad if k_pad != k else None,
        )

    def _prepare_block_weight(self, w_q: torch.Tensor, w_scale: torch.Tensor) -> PreparedWeight:
        n, k = w_q.shape
        if w_q.device.type == "cuda":
            from .torch_block import cuda_block_support, load_op, prepare_scale, traced_support

            if self.config["fast_accum"] == "true":
                raise InvalidInputError("block-scaled FP8 accumulates precisely: use torch_scaled_mm@fast_accum=false")
            support = cuda_block_support(w_q.get_device())
            why = support.reason_for(k)
            if why:
                raise InvalidInputError(f"{self.name}: {why}")
            load_op()
            traced_support(bool(support.padded))  # asked now, at load time: compiled calls read the answer
            scale = prepare_scale(w_scale, bool(support.padded))
        else:
            scale = w_scale.contiguous()
        return PreparedWeight(data=w_q.t(), scale=scale, n=n, k=k, dtype=Fp8Dtype.of(w_q.dtype),
                              weight_scale=WeightScale.BLOCK, backend=self.name)

    def traced_extra_keys(self, prepared: PreparedWeight, act_scale: ActScale) -> frozenset[str]:
        # the row-wise B scale is read only when either operand is scaled per row (see gemm_impl)
        rowwise = act_scale is ActScale.PER_TOKEN or prepared.weight_scale is WeightScale.PER_CHANNEL
        return frozenset({"row_scale"}) if rowwise else frozenset()

    def gemm_impl(
        self,
        x_q: torch.Tensor,
        prepared: PreparedWeight,
        x_scale: torch.Tensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        import torch

        if prepared.block is not None:
            from . import torch_block

            if x_q.device.type == "cpu":
                return torch_block.cpu_gemm(x_q, prepared.data.t(), x_scale, prepared.scale, bias, out_dtype,
                                            prepared.group_size, prepared.block)
            if torch.compiler.is_compiling():  # torch._scaled_mm itself where this torch's meta serves block scales
                return torch_block.traced_gemm(x_q, prepared.data, x_scale, prepared.scale, bias, out_dtype)
            return torch_block.cuda_gemm(x_q, prepared.data, x_scale, prepared.scale, bias, out_dtype)
        if x_scale.numel() != 1 or prepared.weight_scale is WeightScale.PER_CHANNEL:
            # row-wise path: scale_a [M, 1], scale_b [1, N]. A per-tensor x_scale with a
            # per-channel weight is broadcast to [M, 1] here (M floats, the only per-call copy).
            a_scale = x_scale if x_scale.numel() > 1 else x_scale.reshape(1, 1).expand(x_q.shape[0], 1).contiguous()
            w_scale = prepared.extra["row_scale"]
        else:
            a_scale, w_scale = x_scale.reshape(()), prepared.scale
        n, n_pad = prepared.n, prepared.data.shape[1]
        fused_bias = bias if out_dtype != torch.float32 else None
        if fused_bias is not None and n_pad != n:
            fused_bias = torch.nn.functional.pad(fused_bias, (0, n_pad - n))
        y = torch._scaled_mm(
            match_k(x_q, prepared.k_pad),
            prepared.data,
            scale_a=a_scale,
            scale_b=w_scale,
            bias=fused_bias,
            out_dtype=out_dtype,
            use_fast_accum=self.config["fast_accum"] == "true",
        )
        if n_pad != n:  # a padded weight: its N columns of the output, as a view (row stride n_pad)
            y = y[:, :n]
        if bias is not None and fused_bias is None:
            y.add_(bias)
        return y
