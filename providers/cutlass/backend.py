"""``cutlass``: FP8 GEMM with CUTLASS 3.x SM90 kernels (TMA, warp-specialized wgmma), JIT-built with nvcc.

Kernels: the configs of :mod:`.configs` (swapped-operand decode tiles, ping-pong mid-size tiles,
cooperative and stream-K prefill tiles), chosen per M bucket by a data table (option ``config=auto``)
or forced by name (``config=<name>``, for the tuner). The epilogue computes
``out = (s_x · s_w) · acc (+ bias)`` with both scales read from device memory (per-tensor), or
``s_x[m] · s_w[n] · acc (+ bias[n])`` through an epilogue visitor tree (per-token activations and/or
per-channel weights); bias is fused; bf16, fp16 and fp32 outputs.

Shapes and layouts: ``x_q [M, K]`` and ``w_q [N, K]`` float8_e4m3fn, row-major, 16-byte aligned; K and
N multiples of 16; any M (odd included). The prepared weight is ``w_q`` itself (no copy) with its scale
as fp32 ``[1]`` or ``[N]``.

Builds: each (config, epilogue, out dtype, accumulation) is one shared library compiled on first use
(a few minutes for a family on 2 cores; ``python -m fp8_backends.build cutlass`` prebuilds) and cached
on disk (see :mod:`.build`). :meth:`availability` never builds: it reports missing nvcc or headers as
unavailable, and libraries not built yet as available with a note.

Hardware: SM 9.0 only (the ``sm_90a`` target: wgmma and TMA multicast). SM100 (Blackwell) kernels
need separate tcgen05 instantiations and are not part of this provider.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from fp8_backends.core.backend import OpGemmBackend
from fp8_backends.core.capabilities import GemmCapabilities
from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.types import (
    ActScale,
    Availability,
    BiasMode,
    DeviceKind,
    Fp8Dtype,
    OutDtype,
    PreparedWeight,
    WeightScale,
)

from .configs import CONFIG_NAMES, active_table

_ALL_ACT_SCALES = frozenset(ActScale)

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "pip install 'fp8-backends[cutlass]' and a CUDA toolkit with nvcc (CUDA_HOME or PATH)"


class CutlassSm90Backend(OpGemmBackend):
    """CUTLASS 3.x SM90 FP8 GEMM; options ``config`` (``auto`` or a config name) and ``fast_accum``."""

    name: ClassVar[str] = "cutlass"
    description: ClassVar[str] = "CUTLASS 3.x SM90 TMA warp-specialized FP8 GEMM, fused scale/bias epilogue (JIT)"
    requires: ClassVar[tuple[str, ...]] = ("torch",)
    install_hint: ClassVar[str] = INSTALL_HINT
    options: ClassVar[dict[str, tuple[str, ...]]] = {
        "config": ("auto", *CONFIG_NAMES),
        "fast_accum": ("true", "false"),
    }
    # the tuner times each config by name; precise accumulation is slower and never wins on time
    tunable_options: ClassVar[tuple[str, ...]] = ("config",)
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CUDA}),
        archs=("9.0a",),
        pdl=False,
        act_scales=frozenset(ActScale),
        weight_scales=frozenset(WeightScale),
        input_dtypes=frozenset({Fp8Dtype.E4M3FN}),
        mixed_inputs=False,
        out_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16, OutDtype.FP32}),
        bias=BiasMode.FUSED,
        k_align=16,
        n_align=16,
        align_reason="the CUTLASS kernels load tiles through TMA, which needs 16-byte aligned rows",
        priority=8,
    )
    # host µs per call on the compiled path (an opaque custom op: config pick, output allocation, a ctypes call): 5 +
    # the 58 µs a compiled Fp8Linear on it costs more than on the triton op (median over 6 shapes x M, H200, 2026-12-01,
    # bench/results/compiled_host/2026-12-01-h200-cutlass/compiled_host_sl-off.md; the triton op counted at 5)
    host_us: ClassVar[float | None] = 60.0
    #: the same through the C++ op (:mod:`.native_op`): ~8 µs over the triton op's call (median of the per-call minima
    #: over 2 shapes x M = 1 / 16 / 512, H200, bench/results/compiled_host/2026-12-02-h200/cpp_op.md), against ~50 on
    #: the Python op in the same measurement (python_op.md there)
    native_host_us: ClassVar[float] = 13.0

    @classmethod
    def host_us_for(cls, m: int, n: int, k: int, options: Mapping[str, str]) -> float | None:
        """:attr:`native_host_us` where the C++ op is expected to serve (enabled, not failed, nvcc found), else
        :attr:`host_us`."""
        from . import native_op

        return cls.native_host_us if native_op.expected() else cls.host_us

    @classmethod
    def availability(cls) -> Availability:
        """OK when the default kernels are built, or can be (nvcc and CUTLASS headers found; the note
        says a first use builds them, and how calls reach them: :func:`.native_op.status`); not OK without a
        toolchain and prebuilt libraries, or after a failed build in this process (the reason carries the compiler
        log's path). Runs nothing."""
        base = super().availability()
        if not base.ok:
            return base
        from . import build

        try:
            table = active_table()
        except ValueError as exc:
            return Availability.no(str(exc))
        st = build.status(build.specs_for(sorted(table.config_names())))
        if not st.ok:
            return Availability.no(st.reason, cls.install_hint)
        from . import native_op

        return Availability.yes("; ".join(part for part in (st.reason, native_op.status()) if part))

    # ------------------------------------------------------------------ the op
    contiguous_vectors: ClassVar[bool] = True
    #: the C++ op's fused quantize + GEMM (set by :meth:`load_op` where it loads)
    _linear_op: Any = None

    def load_op(self) -> Any:
        """The C++ op (:mod:`.native_op`, built at first use) where it loads, else the Python op; both defined now,
        at load time (see ProviderBase.preload). The C++ op hands what it cannot serve to the Python op."""
        import torch

        from .ops import load_op

        python_op = load_op()
        if not torch.cuda.is_available():
            return python_op
        from . import native_op

        native = native_op.try_load()
        if native is None:
            return python_op
        self._linear_op = native.linear_op
        self.fused_act_quant = _ALL_ACT_SCALES  # the C++ op quantizes in its own kernels (one call per linear)
        return native.op

    def fused_quant_gemm_impl(self, x: torch.Tensor, prepared: PreparedWeight, act_scale: ActScale,
                              input_scale: torch.Tensor | None, out_dtype: torch.dtype,
                              bias: torch.Tensor | None) -> torch.Tensor | None:
        """The C++ op's quantize + GEMM in one dispatcher call (:mod:`.native_op`; ``None`` without it): what an
        eager :class:`~fp8_backends.layers.Fp8Linear` on this provider runs. Same numbers as
        :func:`fp8_backends.quant.quantize` then :meth:`gemm_impl`, for an ``x`` of any strides (its quantization
        kernels read them and write row-major codes). The call :meth:`bind_fused_quant_gemm` binds."""
        if self._linear_op is None:
            return None
        return self.bind_fused_quant_gemm(prepared, act_scale, input_scale, out_dtype, bias)(x)

    def bind_fused_quant_gemm(self, prepared: PreparedWeight, act_scale: ActScale, input_scale: torch.Tensor | None,
                              out_dtype: torch.dtype, bias: torch.Tensor | None) -> Callable[[torch.Tensor], Any]:
        """The fused call bound once: the C++ linear op's overload entry (``OpOverload._op``, one Python frame less
        than the overload) with the weight, scales, bias, mode and config bound. Without the C++ op, the base class's
        binding of the hook (which declines every call)."""
        op = self._linear_op
        if op is None:
            return super().bind_fused_quant_gemm(prepared, act_scale, input_scale, out_dtype, bias)
        call = getattr(op, "_op", op)
        w, w_scale, mode = prepared.data, prepared.scale, act_scale.value
        config, fast_accum = self.op_args

        def fused(x: torch.Tensor) -> torch.Tensor | None:
            return call(x, w, w_scale, input_scale, bias, out_dtype, mode, config, fast_accum)

        return fused

    def op_arguments(self) -> tuple[str, bool]:
        return self.config["config"], self.config["fast_accum"] == "true"

    def prepare_weight_impl(
        self, w_q: torch.Tensor, w_scale: torch.Tensor, weight_scale: WeightScale
    ) -> PreparedWeight:
        if w_q.data_ptr() % 16:
            raise InvalidInputError("cutlass needs w_q 16-byte aligned (TMA); pass a tensor that starts its allocation")
        return self.prepare_k_major(w_q, w_scale, weight_scale)  # the kernels read [N, K] K-major as it is


__all__ = ["CutlassSm90Backend"]
