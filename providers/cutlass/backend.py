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

Block-scaled problems (weight scale ``block`` 128x128, activation scale ``per_token_group`` with G = 128): a second
kernel family (``fp8_blockwise_gemm_sm90.cu``, :mod:`.block_configs`, :mod:`.block_ops`) with CUTLASS's blockwise
mainloop, which applies the scales per 128-deep K block in fp32. ``prepare_weight`` keeps ``w_q`` and converts the
checkpoint's ``[ceil(N/128), ceil(K/128)]`` scale once to fp32 row-major (what the kernels read); the activation
scales ``[M, ceil(K/128)]`` are read without a copy in the ``m_major_tma`` layout (M-major, column stride a multiple
of 4: ``capabilities.group_scale_layout``, what the quantizer feeding this provider writes); ``gemm`` copies any
other layout into it. Ragged N and K
(not multiples of 128) are served (the last block's scale covers its rows / columns); K and N stay multiples of 16
(TMA); G = 64 and other blocks are refused (the mainloop promotes per 128-deep K tile). Bias is fused as in the other
family. ``config`` takes ``auto`` (the block M-bucket table) or a ``bw_*`` name; a per-tensor config name refuses
block problems and a ``bw_*`` name refuses the others.

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
from fp8_backends.core.errors import ConfigurationError, InvalidInputError
from fp8_backends.core.types import (
    ActScale,
    Availability,
    BiasMode,
    DeviceKind,
    Fp8Dtype,
    GemmProblem,
    OutDtype,
    PreparedWeight,
    ScaleLayout,
    WeightScale,
)

from .block_configs import BLOCK_CONFIG_NAMES, BLOCK_CONFIGS, GROUP_K, WEIGHT_BLOCK
from .block_configs import active_block_table as _active_block_table
from .configs import CONFIG_NAMES, active_table

#: the activation modes the per-tensor / row-wise kernels serve, the ones the C++ op quantizes itself
_VECTOR_ACT_SCALES = frozenset({ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC, ActScale.PER_TOKEN})
#: with the block-scaled family's groups of 128 (the C++ block linear op)
_FUSED_ACT_SCALES = _VECTOR_ACT_SCALES | {ActScale.PER_TOKEN_GROUP}
#: the largest M the C++ block linear op quantizes itself. Its group-quantization kernel reaches 26-40% of the copy
#: bandwidth where the library's Triton kernel reaches 47-87% (M = 512-8192, H200,
#: bench/results/group_quant/2026-12-04-h200/): below ~1k tokens a compiled or eager step is host-bound and the op's
#: one call saves more than its kernel loses (Qwen3-8B prefill 512 compiled: 0.989x bf16 against 1.030x quantizing
#: first; decode: 0.969x against 1.188x), above it the GPU decides (prefill 2048: 0.814x against 0.783x;
#: bench/results/hf_model/2026-12-04-h200-qwen3-block-cpp-quant/), so larger M quantize with the Triton kernel first
FUSED_BLOCK_MAX_M = 1024
_BLOCK = WeightScale.BLOCK

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "pip install 'fp8-backends[cutlass]' and a CUDA toolkit with nvcc (CUDA_HOME or PATH)"


class CutlassSm90Backend(OpGemmBackend):
    """CUTLASS 3.x SM90 FP8 GEMM; options ``config`` (``auto`` or a config name), ``fast_accum`` and ``fused_quant``."""

    name: ClassVar[str] = "cutlass"
    description: ClassVar[str] = "CUTLASS 3.x SM90 TMA warp-specialized FP8 GEMM, fused scale/bias epilogue (JIT)"
    requires: ClassVar[tuple[str, ...]] = ("torch",)
    install_hint: ClassVar[str] = INSTALL_HINT
    options: ClassVar[dict[str, tuple[str, ...]]] = {
        "config": ("auto", *CONFIG_NAMES, *BLOCK_CONFIG_NAMES),
        "fast_accum": ("true", "false"),
        # the C++ ops' own quantization of the unquantized activation (eager: every mode; compiled: block weights'
        # groups); false: the library's quantization op, then the GEMM op (an A/B of that call)
        "fused_quant": ("true", "false"),
    }
    # the tuner times each config by name; precise accumulation is slower and never wins on time
    tunable_options: ClassVar[tuple[str, ...]] = ("config",)
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CUDA}),
        archs=("9.0a",),
        pdl=False,
        act_scales=frozenset({*_VECTOR_ACT_SCALES, ActScale.PER_TOKEN_GROUP}),
        weight_scales=frozenset({WeightScale.PER_TENSOR, WeightScale.PER_CHANNEL, WeightScale.BLOCK}),
        input_dtypes=frozenset({Fp8Dtype.E4M3FN}),
        mixed_inputs=False,
        out_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16, OutDtype.FP32}),
        bias=BiasMode.FUSED,
        k_align=16,
        n_align=16,
        align_reason="the CUTLASS kernels load tiles through TMA, which needs 16-byte aligned rows",
        priority=8,
        # block-wise FP8: the blockwise mainloop promotes per 128-deep K tile, so groups of 128 and 128x128 blocks
        group_sizes=frozenset({GROUP_K}),
        weight_blocks=frozenset({WEIGHT_BLOCK}),
        group_scale_layout=ScaleLayout.M_MAJOR_TMA,
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
        """:attr:`native_host_us` where the C++ ops are expected to serve (enabled, not failed, nvcc found), else
        :attr:`host_us` (the per-tensor / row-wise and the block-scaled families alike)."""
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
        except ValueError as exc:  # a bad table variable: the user's to fix, raised by auto (Availability.error)
            return Availability.no(str(exc), error=exc if isinstance(exc, ConfigurationError) else None)
        st = build.status(build.specs_for(sorted(table.config_names())))
        if not st.ok:
            return Availability.no(st.reason, cls.install_hint)
        from . import native_op

        return Availability.yes("; ".join(part for part in (st.reason, native_op.status(), cls._block_note(build))
                                          if part))

    @classmethod
    def _block_note(cls, build: Any) -> str:
        """The block-scaled family's state for the listing (runs nothing)."""
        names = sorted(_active_block_table().config_names())
        st = build.status(build.block_specs_for(names))
        what = f"block-scaled {WEIGHT_BLOCK[0]}x{WEIGHT_BLOCK[1]} / 1x{GROUP_K} kernels"
        if not st.ok:
            return f"{what} unavailable: {st.reason}"
        if st.missing:
            return (f"{what}: {len(st.missing)} of {len(names)} not built yet (built at the first block GEMM, "
                    f"~{st.estimate_s} s)")
        return f"{what}: built"

    # ------------------------------------------------------------------ the op
    contiguous_vectors: ClassVar[bool] = True
    #: the C++ op's fused quantize + GEMM (set by :meth:`load_op` where it loads)
    _linear_op: Any = None
    #: the C++ op's fused per-token-group quantize + block GEMM (set by :meth:`load_op` where it loads)
    _block_linear_op: Any = None
    #: inside a CUDA graph (no host time per launch) block weights' groups are quantized by the library's Triton kernel,
    #: 1.7-2.6x faster than the op's own (bench/results/group_quant/2026-12-04-h200/); the vector modes stay fused
    fused_act_quant_in_graphs: ClassVar[frozenset[ActScale] | None] = _VECTOR_ACT_SCALES

    #: the block-scaled op's hot-path callable (set by :meth:`load_op`)
    _block_op: Any = None

    def load_op(self) -> Any:
        """The C++ op (:mod:`.native_op`, built at first use) where it loads, else the Python op; both defined now,
        at load time (see ProviderBase.preload), with the block-scaled op (:mod:`.block_ops`; its C++ form where the
        C++ op loads). The C++ ops hand what they cannot serve to the Python ones."""
        import torch

        from fp8_backends.core.oplib import eager_fast

        from . import block_ops
        from .ops import load_op

        self._block_op = eager_fast(block_ops.load_op())
        python_op = load_op()
        if not torch.cuda.is_available():
            return python_op
        from . import native_op

        native = native_op.try_load()
        if native is None:
            return python_op
        self._block_op = native.block_op
        if self.config["fused_quant"] == "true":
            self._linear_op = native.linear_op
            self._block_linear_op = native.block_linear_op
            # the C++ ops quantize in their own kernels (one call per linear), block weights' groups included
            self.fused_act_quant = _FUSED_ACT_SCALES
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
        if prepared.weight_scale is _BLOCK:
            return self._bind_block_linear(prepared, act_scale, out_dtype, bias)
        op = self._linear_op
        if op is None or act_scale not in _VECTOR_ACT_SCALES:
            return super().bind_fused_quant_gemm(prepared, act_scale, input_scale, out_dtype, bias)
        call = getattr(op, "_op", op)
        w, w_scale, mode = prepared.data, prepared.scale, act_scale.value
        config, fast_accum = self.op_args

        def fused(x: torch.Tensor) -> torch.Tensor | None:
            return call(x, w, w_scale, input_scale, bias, out_dtype, mode, config, fast_accum)

        return fused

    def _bind_block_linear(self, prepared: PreparedWeight, act_scale: ActScale, out_dtype: torch.dtype,
                           bias: torch.Tensor | None) -> Callable[[torch.Tensor], Any]:
        """Block weights: the C++ block linear op (per-token-group quantization + the block GEMM) bound, or a call
        that declines (no C++ op, or activations not in groups of 128)."""
        op = self._block_linear_op
        if op is None or act_scale is not ActScale.PER_TOKEN_GROUP or prepared.group_size != GROUP_K:
            def declined(x: torch.Tensor) -> None:
                return None

            return declined
        call = getattr(op, "_op", op)
        w, w_scale, config = prepared.data, prepared.scale, self.block_config

        def fused(x: torch.Tensor) -> torch.Tensor | None:
            if x.shape[0] > FUSED_BLOCK_MAX_M:  # declined: the library's quantization, then the GEMM
                return None
            return call(x, w, w_scale, bias, out_dtype, config)

        return fused

    # ------------------------------------------------------------------ compiled: the fused block linear
    #: host µs of a compiled call of the fused block linear op. The other block calls' figures leave out the group
    #: quantization's launch before them (Triton's launcher, from Inductor's code); the triton provider's fused GEMV
    #: declares its one Inductor launch (5). This op is one dispatcher call that launches two kernels from C++: more
    #: than that GEMV (so one token stays on the one-kernel GEMV where their kernels tie; declared at 5, a compiled
    #: Qwen3-8B decode step moved 16 of its linears from the GEMV to this op and ran 0.86x bf16 against 0.76-0.79x,
    #: H200, bench/results/hf_model/2026-12-04-h200-qwen3-block-cpp-quant/), less than the unfused call
    #: (:attr:`native_host_us` plus the quantization's launch)
    block_fused_host_us: ClassVar[float] = 10.0

    @classmethod
    def block_fused_host_us_for(cls, m: int, options: Mapping[str, str]) -> float | None:
        """M up to :data:`FUSED_BLOCK_MAX_M`, where the C++ op is expected (:func:`.native_op.expected`),
        ``fused_quant`` is on and the config is ``auto`` or a block one: the fused block linear quantizes the
        activation in its own call."""
        from . import native_op

        config = options.get("config", "auto")
        if (m > FUSED_BLOCK_MAX_M or not native_op.expected() or options.get("fused_quant", "true") != "true"
                or (config != "auto" and config not in BLOCK_CONFIGS)):
            return None
        return cls.block_fused_host_us

    def traced_fused_quant_max_m(self, prepared: PreparedWeight, act_scale: ActScale) -> int:
        """Block weights with activation groups of 128, where the C++ op loaded: M up to :data:`FUSED_BLOCK_MAX_M`
        (a compiled layer hands the bf16 activation to :meth:`traced_fused_quant_gemm_impl`, one opaque call in place
        of the group quantization's launch and the block GEMM's)."""
        if (self._block_linear_op is None or prepared.weight_scale is not _BLOCK
                or act_scale is not ActScale.PER_TOKEN_GROUP or prepared.group_size != GROUP_K):
            return 0
        return FUSED_BLOCK_MAX_M

    def traced_fused_quant_gemm_impl(self, x: torch.Tensor, prepared: PreparedWeight, act_scale: ActScale,
                                     input_scale: torch.Tensor | None, out_dtype: torch.dtype,
                                     bias: torch.Tensor | None) -> torch.Tensor:
        """The C++ block linear op on ``x [M, K]`` (bf16 / fp16 / fp32, any strides): opaque to Inductor, which calls
        it through the dispatcher (its fake gives ``[M, N]`` in ``out_dtype``)."""
        return self._block_linear_op(x, prepared.data, prepared.scale, bias, out_dtype, self.block_config)

    def op_arguments(self) -> tuple[str, bool]:
        config = self.config["config"]
        # a bw_* config runs only block problems (extra_reasons refuses the others): the per-tensor op never sees it
        return (config if config not in BLOCK_CONFIGS else "auto"), self.config["fast_accum"] == "true"

    @property
    def block_config(self) -> str:
        """The block op's ``config`` argument: the ``bw_*`` option, else ``auto``."""
        config = self.config["config"]
        return config if config in BLOCK_CONFIGS else "auto"

    def extra_reasons(self, problem: Any, platform: Any) -> list[str]:
        """A ``bw_*`` config serves block-wise problems only (the block ones get :meth:`block_reasons`)."""
        config = self.config["config"]
        if problem is not None and not problem.block_scaled and config in BLOCK_CONFIGS:
            return [f"config={config} is a block-scaled kernel (block weights x per-token-group activations only)"]
        return []

    def first_use_build(self, problem: Any, platform: Any) -> str | None:
        """Block-wise problems: the block-scaled kernel libraries this config needs that are not built yet (built
        with nvcc at the first block GEMM, about 100 s each; runs nothing)."""
        if problem is None or not getattr(problem, "block_scaled", False):
            return None
        from . import build

        config = self.config.get("config", "auto")
        names = sorted(_active_block_table().config_names()) if config not in BLOCK_CONFIGS else [config]
        try:
            st = build.status(build.block_specs_for(names, (problem.out_dtype.value,)))
        except Exception:  # noqa: BLE001 - a listing or a default must not break on a build-state probe
            return None
        if not st.ok or not st.missing:
            return None
        return (f"its block-scaled kernels are not built ({len(st.missing)} of {len(names)} libraries; the first "
                f"call builds them with nvcc, ~{st.estimate_s} s; build ahead: python -m fp8_backends.build cutlass "
                "--epilogue block)")

    def block_reasons(self, problem: GemmProblem) -> list[str]:
        """A per-tensor / row-wise ``config`` refuses block-wise problems (and :meth:`prepare_weight` block weights);
        ``auto`` and the ``bw_*`` configs serve any M, N and K the capabilities let through (K and N multiples of 16
        for TMA; N or K not multiples of 128 included)."""
        config = self.config["config"]
        if config != "auto" and config not in BLOCK_CONFIGS:
            return [f"config={config} is a per-tensor / row-wise kernel; block-wise FP8 takes config=auto or a bw_* "
                    "config"]
        return []

    def prepare_weight_impl(
        self, w_q: torch.Tensor, w_scale: torch.Tensor, weight_scale: WeightScale
    ) -> PreparedWeight:
        if w_q.data_ptr() % 16:
            raise InvalidInputError("cutlass needs w_q 16-byte aligned (TMA); pass a tensor that starts its allocation")
        config = self.config["config"]
        if weight_scale is _BLOCK:  # the base checked block_reasons and made the scale fp32 contiguous
            from .block_ops import prepare_block_scale

            n, k = w_q.shape
            return PreparedWeight(data=w_q, scale=prepare_block_scale(w_scale, n, k), n=n, k=k,
                                  dtype=Fp8Dtype.of(w_q.dtype), weight_scale=weight_scale, backend=self.name)
        if config in BLOCK_CONFIGS:
            raise InvalidInputError(f"cutlass[config={config}] is a block-scaled kernel; prepare {weight_scale.value} "
                                    "weights with config=auto or a per-tensor / row-wise config")
        return self.prepare_k_major(w_q, w_scale, weight_scale)  # the kernels read [N, K] K-major as it is

    def gemm_impl(self, x_q: torch.Tensor, prepared: PreparedWeight, x_scale: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """Block weights: the block op (``x_scale [M, ceil(K/128)]``, any layout: see :mod:`.block_ops`); the
        others: the per-tensor / row-wise op (:meth:`OpGemmBackend.gemm_impl`)."""
        if prepared.weight_scale is _BLOCK:
            op = self._block_op
            if op is None:
                self._loaded_op()
                op = self._block_op
            return op(x_q, prepared.data, x_scale, prepared.scale, bias, out_dtype, self.block_config)
        return super().gemm_impl(x_q, prepared, x_scale, out_dtype, bias)


__all__ = ["CutlassSm90Backend"]
