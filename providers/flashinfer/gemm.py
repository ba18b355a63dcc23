"""``flashinfer_bmm`` (alias ``flashinfer``): FP8 GEMM through flashinfer's ``bmm_fp8`` kernels.

What it computes: ``y[M, N] = (x_q·s_x) @ (w_q·s_w)ᵀ (+ bias)`` with

- ``x_q``: ``[M, K]`` fp8 (e4m3fn; e5m2 against an e4m3fn weight or the reverse), row-major; passed to
  the kernel as ``A = x_q[None]`` (``[1, M, K]``).
- ``w_q``: ``[N, K]`` fp8 row-major, prepared once as ``B = w_q[None].transpose(1, 2)``: the ``[1, K, N]``
  column-major view bmm_fp8 wants (no copy).
- ``s_x``, ``s_w``: one fp32 value each (0-d, ``[1]`` or ``[1, 1]``), read on the device by the kernel
  (CUDA-graph safe). Per-token activation and per-channel weight scales are refused.
- out: bfloat16 or float16 (no fp32). ``bias`` ``[N]`` is added after the kernel (one extra
  elementwise kernel): the capability record says ``BiasMode.ADDED_AFTER``.

Options (``flashinfer_bmm@runner=cudnn,autotune=cache``):

- ``runner``: ``cublas`` (default; cuBLASLt with fast accumulation, SM 8.9-12.1), ``cudnn`` (a cuDNN
  graph per exact shape, built at the first call of each M), ``cutlass`` (SM >= 10.0 only, e4m3fn
  only; refused elsewhere), ``auto`` (flashinfer's candidate list: CUTLASS where it exists, then
  cuBLASLt, then cuDNN; untuned it takes the first, tuned the fastest).
- ``autotune``: ``off`` (default: never tune, never read tuning data), ``cache`` (look each shape up
  in the persisted flashinfer autotuner file; never profiles), ``tune`` (profile every not-yet-tuned
  M bucket at its first call, seconds per shape, and save the file: for offline warm-up runs, not
  for serving). The default comes from ``FP8_BACKENDS_FLASHINFER_AUTOTUNE`` when the option is not
  given. The file is ``<cache dir>/flashinfer/autotune-<flashinfer version>-sm<XY>.json`` with the
  cache dir ``$FP8_BACKENDS_CACHE_DIR``, else ``$XDG_CACHE_HOME/fp8_backends``, else
  ``~/.cache/fp8_backends`` (see ``common.autotune_cache_path``). ``tune`` enters
  flashinfer's ``autotune(True, cache=...)`` context, which replaces the file-loaded configs of
  flashinfer's process-wide AutoTuner; ``cache`` only merges the file into them.

Host path: see ``gemm_ops``. The first call for each new M with ``runner`` other than
``cublas`` or with ``autotune`` on builds a plan (cuDNN graph, tactic lookup): run each M once
eagerly before capturing a CUDA graph (capture of an unplanned M raises with that advice). All
calls share flashinfer's per-device bmm_fp8 workspace, so do not run them concurrently on two
streams of one device (flashinfer has the same rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from fp8_backends.core.backend import OpGemmBackend
from fp8_backends.core.capabilities import GemmCapabilities
from fp8_backends.core.errors import InvalidInputError, UnsupportedProblemError
from fp8_backends.core.types import (
    ActScale,
    Availability,
    BiasMode,
    DeviceKind,
    Fp8Dtype,
    GemmProblem,
    OutDtype,
    PreparedWeight,
    WeightScale,
)

from . import common

if TYPE_CHECKING:
    import torch

    from fp8_backends.registry.platform import Platform


class FlashinferBmmBackend(OpGemmBackend):
    name: ClassVar[str] = "flashinfer_bmm"
    aliases: ClassVar[tuple[str, ...]] = ("flashinfer",)
    description: ClassVar[str] = (
        "flashinfer.bmm_fp8 (cuBLASLt / cuDNN / CUTLASS runners), per-tensor scales, bias added after"
    )
    requires: ClassVar[tuple[str, ...]] = ("torch", "flashinfer")
    install_hint: ClassVar[str] = common.INSTALL_HINT
    options: ClassVar[dict[str, tuple[str, ...]]] = {
        "runner": ("cublas", "cudnn", "cutlass", "auto"),
        "autotune": common.AUTOTUNE_MODES,
    }
    #: ``python -m fp8_backends.tune`` times cublas / cudnn / cutlass per shape (``auto`` is skipped)
    tunable_options: ClassVar[tuple[str, ...]] = ("runner",)
    #: its runners are cuBLAS, cuDNN and CUTLASS kernels that torch._scaled_mm and the cutlass provider also reach, at
    #: 1.55x torch._scaled_mm's host time per call (bench/results/flashinfer_host/2026-11-29-h200/) and an import of
    #: flashinfer at model load (1.3-1.5 s after torch on the H200 box,
    #: bench/results/checkpoints/2026-12-03-h200-load-phases/imports.txt): it is chosen where it measures more than 2%
    #: faster than every other candidate
    win_margin: ClassVar[float] = 0.02
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CUDA}),
        min_sm=(8, 9),
        pdl=False,
        act_scales=frozenset({ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC}),
        weight_scales=frozenset({WeightScale.PER_TENSOR}),
        input_dtypes=frozenset({Fp8Dtype.E4M3FN, Fp8Dtype.E5M2}),
        mixed_inputs=True,
        out_dtypes=frozenset({OutDtype.BF16, OutDtype.FP16}),
        bias=BiasMode.ADDED_AFTER,
        k_align=16,
        n_align=16,
        align_reason="flashinfer's bmm_fp8 runners (cuBLASLt, cuDNN, CUTLASS) need 16-byte aligned rows",
        priority=5,
    )
    # host µs per call on the compiled path (an opaque custom op): 5 + the 34-40 µs a compiled Fp8Linear on it costs
    # more than on the triton op (median over 6 shapes x M, H200, 2026-12-01,
    # bench/results/compiled_host/2026-12-01-h200-static-launcher/compiled_host_sl-*.md; eager:
    # bench/results/flashinfer_host/2026-11-29-h200/flashinfer_host.md)
    host_us: ClassVar[float | None] = 40.0

    def __init__(self, **options: str) -> None:
        if "autotune" not in options:
            try:
                options["autotune"] = common.autotune_default()
            except ValueError as exc:
                raise InvalidInputError(f"{self.name}: {exc}") from None
        super().__init__(**options)
        self._mode: str = self.op_args[0]  # "<runner>/<autotune>": what the op's plans are keyed by
        self._e4m3_only = self.config["runner"] == "cutlass"

    @classmethod
    def availability(cls) -> Availability:
        """flashinfer and torch importable (not imported here) and a CUDA device present."""
        return common.base_availability()

    def extra_reasons(self, problem: GemmProblem | None, platform: Platform) -> list[str]:
        if problem is not None and problem.device is not DeviceKind.CUDA:
            return []
        sm = platform.sm if platform.is_cuda else None
        if problem is None:
            return common.runner_reasons(self.config["runner"], sm)
        return common.runner_reasons(self.config["runner"], sm, problem.input_dtype, problem.weight_dtype)

    # ------------------------------------------------------------------ the op
    def load_op(self) -> Any:
        from . import gemm_ops  # imports torch and defines the op

        return gemm_ops.gemm_op

    def op_arguments(self) -> tuple[str]:
        return (f"{self.config['runner']}/{self.config['autotune']}",)  # the op's ``mode``

    def prepare_weight_impl(
        self, w_q: torch.Tensor, w_scale: torch.Tensor, weight_scale: WeightScale
    ) -> PreparedWeight:
        """Checks the runner against the weight's GPU, loads flashinfer's gemm module and workspace
        for that device, and returns the ``[1, K, N]`` column-major view of ``w_q`` (no copy)."""
        from . import gemm_ops

        n, k = w_q.shape
        dtype = Fp8Dtype.of(w_q.dtype)
        if w_q.data_ptr() % 16:
            raise InvalidInputError(f"{self.name} needs w_q's data pointer 16-byte aligned")
        state = gemm_ops.gemm_device(w_q.device)  # the real GPU, whatever is simulated
        reasons = common.runner_reasons(self.config["runner"], state.sm, dtype, dtype)
        # an e5m2 weight is fine as long as x_q is e4m3fn: refuse only what no x_q could fix
        reasons = [r for r in reasons if "e5m2 x e5m2" not in r]
        if reasons:
            raise UnsupportedProblemError(f"{self.label} cannot serve this weight: " + "; ".join(reasons),
                                          reasons=reasons)
        return PreparedWeight(
            data=w_q.unsqueeze(0).transpose(1, 2),  # [1, K, N], strides (N*K, 1, K): column-major B
            scale=w_scale.reshape(()),
            n=n,
            k=k,
            dtype=dtype,
            weight_scale=weight_scale,
            backend=self.name,
        )

    # ------------------------------------------------------------------ hot path
    def gemm_impl(
        self,
        x_q: torch.Tensor,
        prepared: PreparedWeight,
        x_scale: torch.Tensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        if prepared.dtype is Fp8Dtype.E5M2 and x_q.dtype == prepared.data.dtype:
            raise InvalidInputError(f"{self.name}: cuBLASLt/cuDNN have no e5m2 x e5m2 FP8 GEMM")
        if self._e4m3_only and x_q.dtype != prepared.data.dtype:
            raise InvalidInputError(f"{self.label}: flashinfer's CUTLASS runner takes e4m3fn x_q only")
        # op(x_q, [1, K, N] weight, scales, out_dtype, mode); BiasMode.ADDED_AFTER: bmm_fp8 has no bias epilogue
        return OpGemmBackend.gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias)
