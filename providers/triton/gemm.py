"""``triton``: FP8 GEMM written in Triton, with a decode path (GEMV and swap-AB kernels) and PDL; block-wise FP8 too.

Kernels (:mod:`.gemm_kernels`): a CUDA-core GEMV for M = 1, a swap-AB tensor-core kernel for small M
(weight rows on the MMA's 64-row side) and a grouped tiled kernel for prefill; fp32 accumulation; the
epilogue applies per-tensor or per-token activation scales, per-tensor or per-channel weight scales
(read on the device) and the bias, and writes bf16, fp16 or fp32. The tile config comes from an
M-bucket table measured on the H200 (option ``config=auto``) or is forced by name (the tuner times
each). Launched with programmatic dependent launch on SM >= 9.0 (``FP8_BACKENDS_PDL=0`` turns it off).

Shapes and layouts: ``x_q [M, K]`` and ``w_q [N, K]`` float8 (e4m3fn, or e5m2 for both), row-major; any M, N
and K: the pointer kernels mask K and wrap N and M, so N and K need not be multiples of 16 (3420, 6840: TP splits).
Where K is not a multiple of 16 the weight is zero-padded along K once at ``prepare_weight`` and the activation to
match (by a layer's quantizer as it writes the codes, else per call: :mod:`fp8_backends.core.padding`), so the kernels
(TMA ones included) read 16-byte aligned rows. The prepared weight is ``w_q`` itself otherwise (no copy), with its
scale as fp32 ``[1]`` or ``[N]``.

Block-wise FP8 (``per_token_group`` activations x ``block`` weights: 1x128 or 1x64 groups, 128x128 weight blocks):
its own kernel family (:mod:`.block_gemm_kernels`: GEMV, swap-AB with split K, tiled with split K, persistent TMA)
with its own M-bucket table (:mod:`.block_gemm_configs`), through the op ``fp8_backends::triton_block_gemm``. The
prepared weight is ``w_q`` with its block scales as fp32 ``[ceil(N/128), ceil(K/128)]`` row-major; the kernels read
activation scales in any layout and declare ``m_major_tma`` (the tokens of a group adjacent: one coalesced load per
K step and tile, and the layout flashinfer's and DeepGEMM's block kernels share). Option ``config``: ``auto`` picks
from the table of the problem's mode; a named config serves the mode its family belongs to.

Runs on any NVIDIA GPU with FP8 tensor cores (SM >= 8.9), and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``: slow, for tests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from fp8_backends.core.backend import OpGemmBackend
from fp8_backends.core.capabilities import GemmCapabilities
from fp8_backends.core.errors import BackendUnavailableError, ConfigurationError, InvalidInputError
from fp8_backends.core.padding import ROW_ALIGN, match_k, pad_weight, round_up
from fp8_backends.core.types import (
    ActScale,
    Availability,
    BiasMode,
    Fp8Dtype,
    GemmProblem,
    OutDtype,
    PreparedWeight,
    ScaleLayout,
    WeightScale,
)

from . import _support
from . import block_gemm_configs as block_configs
from .gemm_configs import CONFIG_NAMES, CONFIGS, active_table

if TYPE_CHECKING:
    import torch

    from fp8_backends.registry.platform import Platform

#: beyond these M a forced config is refused: it would compute correctly but waste the weight reads
#: (GEMV re-reads the weight per token; swap-AB tiles are at most 64 tokens wide)
_FORCED_MAX_M = {"gemv": 8, "swap": 512}


def _fused_bound(config: str) -> int:
    """The largest M at which the block-wise call with ``config`` quantizes the activation in its launch: the fused
    pick's for ``auto``, a GEMV config's own bound, 0 for any other config."""
    if config == "auto":
        return block_configs.FUSED_MAX_M
    cfg = block_configs.CONFIGS.get(config)
    return (cfg.max_m or 0) if cfg is not None and cfg.family == "gemv" else 0


def _decline(x: torch.Tensor) -> None:
    """A fused call that never fuses (the caller quantizes, then calls ``gemm_impl``)."""
    return None


class TritonGemmBackend(OpGemmBackend):
    """Triton FP8 GEMM; option ``config`` (``auto`` or a tile config name)."""

    name: ClassVar[str] = "triton"
    description: ClassVar[str] = ("Triton FP8 GEMM: GEMV / swap-AB decode kernels, tiled prefill, fused epilogue, PDL; "
                                  "block-wise FP8 (split-K decode, TMA prefill)")
    requires: ClassVar[tuple[str, ...]] = _support.REQUIRES
    install_hint: ClassVar[str] = _support.INSTALL_HINT
    options: ClassVar[dict[str, tuple[str, ...]]] = {"config": ("auto", *CONFIG_NAMES, *block_configs.CONFIG_NAMES)}
    tunable_options: ClassVar[tuple[str, ...]] = ("config",)
    #: MoE grouped experts (:mod:`.experts_ops`): CUDA, and the CPU under Triton's interpreter (tests)
    experts_devices: ClassVar[frozenset[str]] = frozenset(d.value for d in _support.DEVICES)
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=_support.DEVICES,
        min_sm=_support.MIN_SM,
        pdl=True,
        act_scales=frozenset({ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC, ActScale.PER_TOKEN,
                              ActScale.PER_TOKEN_GROUP}),
        weight_scales=frozenset({WeightScale.PER_TENSOR, WeightScale.PER_CHANNEL, WeightScale.BLOCK}),
        input_dtypes=frozenset({Fp8Dtype.E4M3FN, Fp8Dtype.E5M2}),
        mixed_inputs=False,
        out_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16, OutDtype.FP32}),
        bias=BiasMode.FUSED,
        k_align=1,  # masked pointer kernels; the TMA configs' own rule is in extra_reasons
        n_align=1,
        priority=6,
        group_sizes=frozenset({64, 128}),
        weight_blocks=frozenset({block_configs.WEIGHT_BLOCK}),
        group_scale_layout=ScaleLayout.M_MAJOR_TMA,
    )
    # host µs per call when Inductor launches the kernel (torch.compile, static launcher): a few µs; the reference
    # point of the other providers' figures (bench/results/compiled_host/2026-12-01-h200-static-launcher/)
    host_us: ClassVar[float | None] = 5.0
    #: host µs per call of the persistent TMA configs (prefill M), which stay an opaque op under torch.compile: its
    #: Python body builds two tensor descriptors and launches through Triton's JIT. Measured (H200,
    #: bench/results/compiled_host/2026-12-01-h200/, M = 1024): 195-232 µs a compiled linear against 108-141 through
    #: torch._scaled_mm (declared 20), so ~90 µs more
    tma_host_us: ClassVar[float] = 110.0
    #: block-scaled problems launch the block kernels through Triton's launcher: a compiled block linear measured
    #: -20 to +49 µs host time per call against the cutlass provider's C++ op (median ~+17; Qwen3-8B qkv and down
    #: shapes x M = 16 / 128 / 512, H200, bench/results/compiled_host/2026-12-04-h200-block/), declared at 13
    block_host_us: ClassVar[float | None] = 30.0
    #: block-scaled, one token, ``config=auto`` (or a named GEMV config up to its M): the fused GEMV quantizes the
    #: activation in its launch, one kernel Inductor launches where every other provider's call follows the 2-3
    #: kernels of the group quantization. Declared as the per-tensor kernels' one Inductor launch: measured (H200,
    #: Qwen3-8B layers, compiled decode, bench/results/hf_model/2026-12-04-h200-qwen3-block-fused-gemv/), moving the
    #: 16 gate/up and down linears of a step from quantize + cutlass to the fused GEMV took 887 µs of host time off
    #: the step (55 µs per linear, the cutlass op's own call included) and 40 of its 170 kernels
    block_fused_host_us: ClassVar[float] = 5.0

    @classmethod
    def block_fused_host_us_for(cls, m: int, options: Mapping[str, str]) -> float | None:
        return cls.block_fused_host_us if m <= _fused_bound(options.get("config", "auto")) else None

    @classmethod
    def host_us_for(cls, m: int, n: int, k: int, options: Mapping[str, str]) -> float | None:
        """:attr:`tma_host_us` where the config (``auto``: the active table's pick for M x N x K) is a TMA one, else
        :attr:`host_us`."""
        config = options.get("config", "auto")
        tile = CONFIGS.get(active_table().pick(m, n, k) if config == "auto" else config) or block_configs.CONFIGS.get(
            config)
        return cls.tma_host_us if tile is not None and tile.family == "tma" else cls.host_us

    def __init__(self, **options: str) -> None:
        super().__init__(**options)
        config = self.config["config"]
        #: the config of block problems: ``auto`` (the block table) unless a block config is named
        self._block_config = config if config in block_configs.CONFIGS else "auto"
        tile = CONFIGS.get(config) or block_configs.CONFIGS.get(config)
        if tile is not None and tile.family == "tma":
            # a forced TMA config never runs another kernel family: misaligned operands are refused (auto's own
            # TMA picks fall back to the same tiles without TMA). An instance attribute, so that no other config
            # pays for the check on the hot path.
            self.gemm_impl = self._forced_tma_gemm  # type: ignore[method-assign]

    def _forced_tma_gemm(
        self, x_q: torch.Tensor, prepared: PreparedWeight, x_scale: torch.Tensor, out_dtype: torch.dtype,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``gemm_impl`` of a forced TMA config: refuse operands TMA cannot address (16-byte aligned bases and rows)."""
        for what, t in (("x_q", x_q), ("the prepared weight", prepared.data)):
            if t.data_ptr() % 16 or t.stride(0) % 16:
                raise InvalidInputError(
                    f"triton@config={self.config['config']}: {what} starts at an address or has rows (K={t.shape[1]}) "
                    "that are not 16-byte aligned, which TMA cannot load; pass an aligned tensor (e.g. .clone()) or "
                    "use config=auto (which runs these tiles without TMA then)"
                )
        return TritonGemmBackend.gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias)

    @classmethod
    def availability(cls) -> Availability:
        base = super().availability()
        if not base.ok:
            return base
        try:
            active_table()
        except ValueError as exc:  # a bad table variable: the user's to fix, raised by auto (Availability.error)
            return Availability.no(str(exc), error=exc if isinstance(exc, ConfigurationError) else None)
        if _support.interpreting():
            return Availability.yes("TRITON_INTERPRET=1: kernels run on Triton's CPU interpreter (slow)")
        return Availability.yes()

    def explicit_only_reason(self, problem: GemmProblem | None, platform: Platform) -> str | None:
        return _support.explicit_only_on_cpu(problem, platform)

    def extra_reasons(self, problem: GemmProblem | None, platform: Platform) -> list[str]:
        config = self.config["config"]
        if problem is None or config == "auto":
            return []
        block = config in block_configs.CONFIGS
        if problem.block_scaled != block:
            return [f"config {config} is a {'block-wise' if block else 'per-tensor / per-token / per-channel'} "
                    f"FP8 kernel; this problem is {'block-wise' if problem.block_scaled else 'not block-wise'}"]
        reasons = []
        if block:
            family, limit = block_configs.CONFIGS[config].family, block_configs.CONFIGS[config].max_m
        else:
            family = CONFIGS[config].family
            limit = _FORCED_MAX_M.get(family)
        if block and family == "tma" and problem.k % 16:  # (other weights are K-padded: prepare_weight_impl)
            reasons.append(f"config {config} loads tiles through TMA, which needs 16-byte aligned rows: K={problem.k} "
                           "is not a multiple of 16 (config=auto runs these tiles without TMA)")
        if limit is not None and problem.m is not None and problem.m > limit:
            reasons.append(f"config {config} is a small-M kernel (M <= {limit}); M={problem.m} would re-read the "
                           "weight")
        return reasons

    # ---------------------------------------------- the op (gemm_impl and prepare_weight_impl: OpGemmBackend's)
    contiguous_vectors: ClassVar[bool] = True  # the kernels index x_scale [M, 1] and bias [N] with unit stride

    def load_op(self) -> Any:
        from .gemm_ops import load_op

        return load_op()  # defines triton_gemm and triton_gemm_tma now (see ProviderBase.preload)

    _block_op: Any = None  # triton_block_gemm as the hot path calls it (defined at preload)

    def preload(self) -> None:
        """Define the ops now (load time): ``triton_gemm``, the block-wise ``triton_block_gemm`` and its fused GEMV
        ``triton_block_gemm_quant``."""
        super().preload()
        self._loaded_block_op()
        if self._fused_block_op is None:
            from .block_gemm_ops import load_fused_op

            self._fused_block_op = load_fused_op()

    def _loaded_block_op(self) -> Any:
        op = self._block_op
        if op is None:
            from fp8_backends.core.oplib import eager_fast

            from .block_gemm_ops import load_op as load_block_op

            op = self._block_op = eager_fast(load_block_op())
        return op

    def op_arguments(self) -> tuple[str]:
        # a block config is never passed to the per-tensor op (extra_reasons refuses those problems)
        return (self.config["config"] if self.config["config"] in CONFIGS else "auto",)

    @classmethod
    def experts_kernels(cls, device_type: str) -> Any:
        """The experts GEMV and tiled GEMM (:class:`.experts_ops.TritonExpertsKernels`) on CUDA GPUs of SM >= 8.9
        (FP8 conversions) and, under Triton's interpreter, on the CPU; defines their ops (load time)."""
        if device_type == "cuda":
            import torch

            sms = [tuple(torch.cuda.get_device_capability(i)) for i in range(torch.cuda.device_count())]
            if not sms or min(sms) < _support.MIN_SM:
                raise BackendUnavailableError(f"the Triton experts kernels need SM >= 8.9 on every GPU, found {sms}")
        elif device_type not in cls.experts_devices:
            return None
        from .experts_ops import TritonExpertsKernels

        return TritonExpertsKernels()

    def prepare_weight_impl(self, w_q: torch.Tensor, w_scale: torch.Tensor,
                            weight_scale: WeightScale) -> PreparedWeight:
        """The row-major ``[N, K]`` weight as it is, except where K is not a multiple of
        :data:`~fp8_backends.core.padding.ROW_ALIGN` (per-tensor / per-channel weights): then a zero-padded
        ``[N, K16]`` copy, made once here (``prepared.k_pad``), so that the kernels read 16-byte aligned rows with
        vector loads (rows of an odd byte length make every load a byte load: ~100x slower at K = 6840 on the H200,
        ``bench/results/unaligned/2026-12-03-h200-byte-loads/``); activations reach the kernel padded to match."""
        prepared = self.prepare_k_major(w_q, w_scale, weight_scale)
        n, k = w_q.shape
        if weight_scale is not WeightScale.BLOCK and k % ROW_ALIGN:
            prepared.k_pad = round_up(k, ROW_ALIGN)
            prepared.data = pad_weight(w_q, n, prepared.k_pad)
        return prepared

    def gemm_impl(self, x_q: torch.Tensor, prepared: PreparedWeight, x_scale: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """Block weights go to ``triton_block_gemm`` (activation scales ``[M, ceil(K/G)]`` in any layout), the rest
        to ``triton_gemm`` (:meth:`OpGemmBackend.gemm_impl`), with ``x_q`` zero-padded along K to the prepared
        weight's padded K where :meth:`prepare_weight_impl` padded it, unless a layer's quantizer wrote it so
        (:func:`~fp8_backends.core.padding.match_k`; under ``torch.compile`` the pad is a torch op Inductor fuses
        into the quantization that produces ``x_q``)."""
        if prepared.block is None:
            return OpGemmBackend.gemm_impl(self, match_k(x_q, prepared.k_pad), prepared, x_scale, out_dtype, bias)
        op = self._block_op or self._loaded_block_op()
        return op(x_q, prepared.data, x_scale, prepared.scale, bias, out_dtype, prepared.group_size,
                  self._block_config)

    # the swap-AB and GEMV kernels (small M) quantize the activation themselves: one launch per eager linear (the
    # per-tensor / per-token modes; block-wise FP8: the GEMV at one token, block_gemm_ops.fused_launch)
    fused_act_quant = frozenset({ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC, ActScale.PER_TOKEN,
                                 ActScale.PER_TOKEN_GROUP})
    # the dynamic modes' fused kernels compute the scale (the amax of the whole activation, or of each row) in every
    # program: in a CUDA graph quantize + GEMM is faster (H200, per-tensor dynamic layers in CUDA graphs: 3456x6912
    # fused 21.3 µs at M = 1 and 57.3 at M = 16, against 10.7 and 15.3 for a 3420x6840 layer padded to that size,
    # which quantizes, then runs the GEMM; bench/results/unaligned/2026-12-03-h200-x-align/)
    fused_act_quant_in_graphs = frozenset({ActScale.PER_TENSOR_STATIC})

    def fuses_act_quant_for(self, prepared: PreparedWeight, act_scale: ActScale, in_graph: bool) -> bool:
        """Block-wise weights in per-token-group mode also fuse inside CUDA graphs where the fused GEMV is the launch
        the GEMM itself runs at one token (:func:`.block_gemm_args.fused_is_gemm_launch`): the quantization kernel
        it saves is then the whole difference."""
        if in_graph and act_scale is ActScale.PER_TOKEN_GROUP and prepared.block is not None:
            from .block_gemm_args import fused_is_gemm_launch

            return (_fused_bound(self._block_config) >= 1
                    and fused_is_gemm_launch(self._block_config, prepared.n, prepared.k))
        return super().fuses_act_quant_for(prepared, act_scale, in_graph)

    def fused_quant_gemm_impl(
        self,
        x: torch.Tensor,
        prepared: PreparedWeight,
        act_scale: ActScale,
        input_scale: torch.Tensor | None,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
    ) -> torch.Tensor | None:
        return self.bind_fused_quant_gemm(prepared, act_scale, input_scale, out_dtype, bias)(x)

    def bind_fused_quant_gemm(self, prepared: PreparedWeight, act_scale: ActScale, input_scale: torch.Tensor | None,
                              out_dtype: torch.dtype, bias: torch.Tensor | None) -> Callable[[torch.Tensor], Any]:
        """The fused launch (:func:`.gemm_ops.fused_launch`, ``None`` where its config does not fuse) with every
        argument but ``x`` bound once; :meth:`fused_quant_gemm_impl` calls it too."""
        if prepared.block is not None or act_scale is ActScale.PER_TOKEN_GROUP:  # block weights with group scales
            if prepared.block is None or act_scale is not ActScale.PER_TOKEN_GROUP:
                return _decline
            return self._bind_fused_block(prepared, out_dtype, bias)
        from .gemm_ops import fused_launch

        w, w_scale, config, mode = prepared.data, prepared.scale, self.config["config"], act_scale.value
        if prepared.k_pad is not None:  # a K-padded weight: its [N, K] view, rows still 16-byte aligned
            w = w[:, :prepared.k]

        def fused(x: torch.Tensor) -> torch.Tensor | None:
            return fused_launch(x, w, input_scale, w_scale, bias, out_dtype, config, mode)

        return fused

    def _bind_fused_block(self, prepared: PreparedWeight, out_dtype: torch.dtype,
                          bias: torch.Tensor | None) -> Callable[[torch.Tensor], Any]:
        """The block-wise fused GEMV (:func:`.block_gemm_ops.fused_launch`: one token's group quantization inside
        the launch; ``None`` at the M it does not serve) bound to ``prepared``, its config chosen here."""
        from .block_gemm_args import fused_config
        from .block_gemm_ops import fused_run

        upto = _fused_bound(self._block_config)
        if upto < 1:
            return _decline
        w, w_scale, group = prepared.data, prepared.scale, prepared.group_size
        cfg = fused_config(self._block_config, 1, prepared.n, prepared.k, any_m=True)

        def fused(x: torch.Tensor) -> torch.Tensor | None:
            return fused_run(cfg, x, w, w_scale, bias, out_dtype, group) if x.shape[0] <= upto else None

        return fused

    _fused_block_op: Any = None  # triton_block_gemm_quant as compiled layers call it (defined at preload)

    def traced_fused_quant_max_m(self, prepared: PreparedWeight, act_scale: ActScale) -> int:
        """Block-wise weights in per-token-group mode: up to the fused GEMV's M (one token with ``config=auto``, a
        named GEMV config's own bound); no other config or mode (Inductor fuses their quantization into the producer
        in one kernel)."""
        if prepared.block is None or act_scale is not ActScale.PER_TOKEN_GROUP:
            return 0
        return _fused_bound(self._block_config)

    def traced_fused_quant_gemm_impl(self, x: torch.Tensor, prepared: PreparedWeight, act_scale: ActScale,
                                     input_scale: torch.Tensor | None, out_dtype: torch.dtype,
                                     bias: torch.Tensor | None) -> torch.Tensor:
        """``fp8_backends::triton_block_gemm_quant`` (a ``triton_op``: Inductor launches the fused GEMV itself)."""
        op = self._fused_block_op
        if op is None:
            from .block_gemm_ops import load_fused_op

            op = self._fused_block_op = load_fused_op()
        return op(x, prepared.data, prepared.scale, bias, out_dtype, prepared.group_size, self._block_config)


__all__ = ["TritonGemmBackend"]
