"""``flashinfer_block``: block-wise FP8 GEMM through flashinfer's ``fp8_blockscale_gemm_sm90`` (DeepGEMM, SM 9.0).

What it computes: ``y[M, N] = dequant(x_q) @ dequant(w_q)ᵀ (+ bias)`` with

- ``x_q``: ``[M, K]`` float8_e4m3fn row-major, scaled per token and group of 128 columns: ``x_scale [M, K/128]`` fp32
  in the ``m_major_tma`` layout (strides ``(1, ceil(M/4)*4)``), what the quantizer feeding this provider writes
  (:attr:`GemmCapabilities.group_scale_layout`); ``gemm`` copies a scale in another layout into it first.
- ``w_q``: ``[N, K]`` float8_e4m3fn row-major (kept as it is, no copy), scaled per 128x128 block: ``w_scale
  [ceil(N/128), K/128]`` fp32 row-major (checkpoints' bf16/fp16 scales are made fp32 once at ``prepare_weight``).
- out: bfloat16 only. ``bias [N]`` is added after the kernel (``BiasMode.ADDED_AFTER``: the kernel has none).
- shapes: K % 128 == 0 and N % 64 == 0 (:meth:`block_reasons` says so for others); M any (M < 32 runs DeepGEMM's
  swap-AB kernels, M >= 32 its normal ones).

Builds, both logged at INFO on the ``fp8_backends`` logger and cached on disk (:mod:`.block_jit`):

- flashinfer's module, at :meth:`preload` (load time: the registry's resolution of this provider, or the first
  ``prepare_weight``), about 2 minutes the first time on an H200 box; ``python -m fp8_backends.build
  flashinfer_block`` builds it ahead.
- one DeepGEMM kernel per ``(N, K)`` and tile config, compiled with nvcc at its first call (seconds). The tile config
  follows ``M``: ``prepare_weight`` runs the weight's swap-AB kernels (M = 1..31, decode; one kernel for most
  shapes, up to three for very wide N) unless the ``warmup`` option is ``off``; other M compile at their first eager
  call, or ahead with ``python -m fp8_backends.build flashinfer_block --shapes NxK,... --m 1-4096`` on the GPU.
  A CUDA-graph capture never compiles: a shape whose kernel has not run in the process is refused there with the
  advice to run it once eagerly first.

Options: ``warmup`` = ``decode`` (default: compile and run the M < 32 kernels at ``prepare_weight``) or ``off``.
"""

from __future__ import annotations

import sys
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
    GemmProblem,
    OutDtype,
    PreparedWeight,
    ScaleLayout,
    WeightScale,
)

from . import block_jit, common

if TYPE_CHECKING:
    import torch


class FlashinferBlockBackend(OpGemmBackend):
    name: ClassVar[str] = "flashinfer_block"
    description: ClassVar[str] = (
        "flashinfer fp8_blockscale_gemm_sm90 (DeepGEMM kernels JIT-compiled per shape, SM 9.0): 1x128 activation "
        "groups x 128x128 weight blocks, bf16 out, bias added after"
    )
    requires: ClassVar[tuple[str, ...]] = ("torch", "flashinfer")
    install_hint: ClassVar[str] = common.INSTALL_HINT
    options: ClassVar[dict[str, tuple[str, ...]]] = {"warmup": ("decode", "off")}
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CUDA}),
        archs=("9.0a",),
        pdl=False,
        act_scales=frozenset({ActScale.PER_TOKEN_GROUP}),
        weight_scales=frozenset({WeightScale.BLOCK}),
        input_dtypes=frozenset({Fp8Dtype.E4M3FN}),
        out_dtypes=frozenset({OutDtype.BF16}),
        bias=BiasMode.ADDED_AFTER,
        k_align=16,  # the kernels' own rules (K % 128, N % 64) are stated by block_reasons
        n_align=16,
        align_reason="DeepGEMM's kernels load tiles through TMA, which needs 16-byte aligned rows",
        group_sizes=frozenset({128}),
        weight_blocks=frozenset({(128, 128)}),
        group_scale_layout=ScaleLayout.M_MAJOR_TMA,
        priority=4,  # below flashinfer_bmm (5) until measured data steers auto
    )
    #: host µs per call (its only problems are block-wise): the op (a Python custom op: checks, one output
    #: allocation, the runner's tvm-ffi call) measured 9-20 µs (median 17) more than the cutlass provider's block GEMM
    #: C++ op, which is declared at 13 (Qwen3-8B's four GEMMs x M = 128 / 512, H200,
    #: bench/results/op_host/2026-12-04-h200-flashinfer-block/)
    host_us: ClassVar[float | None] = 30.0

    @classmethod
    def availability(cls) -> Availability:
        """torch and flashinfer installed, a CUDA device, the module's JIT sources and DeepGEMM's headers in the
        install, an nvcc for the per-shape kernels, all without importing flashinfer (1.3-1.5 s): every GEMM resolution
        asks each provider's availability, so an import here made loading a model that has no block-wise layer
        seconds slower. The imported module's features (``flashinfer.gemm.fp8_blockscale_gemm_sm90`` and its JIT
        spec) are checked where they matter: for a block-wise problem (:meth:`block_reasons`) and in the listing's
        general view (:meth:`extra_reasons` without a problem)."""
        base = common.base_availability()
        if not base.ok:
            return base
        missing = block_jit.missing_sources()
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            return Availability.no(
                f"this flashinfer install lacks the JIT sources of fp8_blockscale_gemm_sm90 ({shown} under "
                "flashinfer/data/csrc)", "pip install -U flashinfer-python (the full wheel ships them)")
        if block_jit.find_nvcc() is None:
            return Availability.no(
                "no nvcc: flashinfer's fp8_blockscale_gemm_sm90 compiles its module and a DeepGEMM kernel per shape "
                "with nvcc (looked for $TRTLLM_DG_NVCC_COMPILER, $CUDA_HOME/bin/nvcc, nvcc on the PATH)",
                "install the CUDA toolkit and set CUDA_HOME")
        return Availability.yes()

    @staticmethod
    def feature_reasons(*, import_now: bool = True) -> list[str]:
        """Why the installed flashinfer cannot serve block-wise problems once imported (imports it once: 1.3-1.5 s), or
        ``[]``: importable, with ``fp8_blockscale_gemm_sm90`` and its JIT spec. ``import_now=False`` (resolving a
        problem): where flashinfer is not imported yet, only its version is checked
        (:func:`.block_jit.version_reason`); the exact check then runs where the module is loaded, which raises
        :class:`~fp8_backends.core.errors.BackendUnavailableError` with the same reason."""
        if not import_now and "flashinfer" not in sys.modules:
            reason = block_jit.version_reason(common.flashinfer_version())
            return [f"{reason} (install: pip install -U fp8-backends[flashinfer])"] if reason else []
        module, reason = common.import_flashinfer()
        if module is None:
            return [f"{reason or 'import flashinfer failed'} (install: {common.INSTALL_HINT})"]
        reason = block_jit.feature_reason(module)
        return [f"{reason} (install: pip install -U fp8-backends[flashinfer])"] if reason else []

    def extra_reasons(self, problem: GemmProblem | None, platform: Any) -> list[str]:
        """The listing's general view (no problem) includes :meth:`feature_reasons`; a problem's own check adds them
        only for block-wise problems (:meth:`block_reasons`), the only ones this provider can serve."""
        return self.feature_reasons() if problem is None else []

    def first_use_build(self, problem: Any, platform: Any) -> str | None:
        """flashinfer's module when it is not built yet (about 2 minutes at the first use; runs nothing). Its per-shape
        DeepGEMM kernels (about 2 s each, cached on disk) do not count."""
        if "flashinfer" not in sys.modules and not block_jit.built_library_may_exist():
            built, folder = False, "flashinfer's JIT cache"  # known without importing flashinfer (1.3-1.5 s)
        else:
            try:
                built, folder = block_jit.module_state(block_jit.module_spec())
            except Exception:  # noqa: BLE001 - flashinfer missing or changed: availability says so
                return None
        if built:
            return None
        return (f"flashinfer's fp8_blockscale_gemm_sm90 module is not built (the first call builds it, "
                f"~{round(block_jit.MODULE_BUILD_SECONDS / 60)} min, into {folder}; build ahead: python -m "
                "fp8_backends.build flashinfer_block)")

    def block_reasons(self, problem: GemmProblem) -> list[str]:
        """flashinfer's features (:meth:`feature_reasons`; by its version where it is not imported yet: resolving a
        model's layers never imports it for a provider ``auto`` may pass over), then K % 128 and N % 64 (the DeepGEMM
        kernels' tiles)."""
        return self.feature_reasons(import_now=False) or block_jit.shape_reasons(problem.n, problem.k)

    # ------------------------------------------------------------------ load time
    def load_op(self) -> Any:
        """Builds (first time, logged) and loads flashinfer's module, then returns the op."""
        from . import block_ops

        block_ops.load_module()
        return block_ops.gemm_op

    def prepare_weight_impl(
        self, w_q: torch.Tensor, w_scale: torch.Tensor, weight_scale: WeightScale
    ) -> PreparedWeight:
        """Loads the runner for the weight's GPU, keeps ``w_q`` as it is and its block scales fp32 contiguous, and
        (``warmup=decode``) runs the weight's swap-AB kernels once, compiling those not built yet (logged)."""
        from . import block_ops

        if weight_scale is not WeightScale.BLOCK:  # the capabilities never let another mode here
            raise InvalidInputError(f"{self.name} serves block-scaled weights only")
        if w_q.data_ptr() % 16:
            raise InvalidInputError(f"{self.name} needs w_q's data pointer 16-byte aligned (TMA)")
        block_ops.device_state(w_q.device)  # the real GPU must be SM 9.0, whatever is simulated
        prepared = self.prepare_k_major(w_q, w_scale, weight_scale)
        if self.config["warmup"] == "decode":
            block_ops.warm_up(prepared.data, prepared.scale, block_jit.decode_ms())
        return prepared

    def warm_up(self, prepared: PreparedWeight, ms: Any) -> list[tuple[int, str, float]]:
        """Compile (if needed) and run once the kernels the batch sizes ``ms`` need for ``prepared``, e.g. every
        prefill size a server will capture in CUDA graphs: ``[(M, kernel config, seconds)]`` of what ran. Load time
        only."""
        from . import block_ops

        if not isinstance(prepared, PreparedWeight) or prepared.backend != self.name:
            raise InvalidInputError(f"{self.name}.warm_up needs a weight prepared by {self.name}.prepare_weight")
        return block_ops.warm_up(prepared.data, prepared.scale, ms)
