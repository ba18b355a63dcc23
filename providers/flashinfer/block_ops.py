"""The torch op around flashinfer's block-scaled FP8 GEMM runner (``fp8_blockscale_gemm_sm90``, DeepGEMM kernels).

Importing this module imports torch and registers one op in the ``fp8_backends`` namespace (the provider imports it
lazily, at :meth:`~.block.FlashinferBlockBackend.preload`):

- ``fp8_backends::flashinfer_block_gemm(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, ScalarType out_dtype)
  -> Tensor``: ``x [M, K]`` float8_e4m3fn row-major contiguous, ``w [N, K]`` float8_e4m3fn row-major contiguous,
  ``x_scale [M, K/128]`` fp32 per token and 128-column group in the ``m_major_tma`` layout (strides
  ``(1, ceil(M/4)*4)``: the kernel's TMA reads the ``[K/128, ceil(M/4)*4]`` buffer behind it; another layout is
  copied into it first), ``w_scale [ceil(N/128), K/128]`` fp32 row-major contiguous; returns ``[M, N]`` bfloat16
  (the only output the fp8 path of the binding writes). K % 128 == 0, N % 64 == 0.

The op has a fake implementation, so ``torch.compile(fullgraph=True)`` traces through it; it is inference-only.

Host path. flashinfer's public ``fp8_blockscale_gemm_sm90`` validates in Python and allocates a workspace per call
(``runner.get_workspace_size(M, N, K)``: the largest of its three runners' needs, driven by the bf16-input runners
that quantize into it: ``ceil(M/4)*4*K + N*K`` bytes and their scales, ~80 MB at M=4096, N=K=7168, growing with M).
The fp8 x fp8 path reads no workspace at all (``fp8_blockscale_gemm.cu``: only the bf16 paths carve buffers out of
it); the binding only checks that one is configured. So:

- load time (:func:`load_module`, :func:`device_state`): build or load flashinfer's module (:mod:`.block_jit`), point
  DeepGEMM's kernel compiler at flashinfer's headers, and create one runner per device of our own (``module.init()``,
  not flashinfer's process-wide cached runner, whose workspace its Python API re-points at every call) with a
  256-byte workspace configured once.
- first call per ``(device, M, N, K)`` (:func:`_first_run`): the module compiles a DeepGEMM kernel if this shape's
  tile config (:func:`.block_jit.kernel_config`) is new in this process (nvcc, seconds, logged; cached on disk by
  DeepGEMM), so it is refused during CUDA-graph capture with the advice to run that M once eagerly first; a config
  already run here may be captured at any M that maps to it.
- every call: the checks below (metadata only), one ``torch.empty`` for the output, a dict lookup, the runner's
  ``run_gemm`` (tvm-ffi: DLPack hand-over; inside it the config choice, four TMA descriptors and the launch on
  torch's current stream). No host sync, no other allocation.

On a flashinfer other than 0.7.x (whose binding these facts were read from) the calls go through flashinfer's public
function instead (a warning says so; same numbers, its per-call workspace and checks), and capture needs the exact
shape run eagerly first. The calls run on the current CUDA device: keep it the tensors' device (flashinfer's rule too).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fp8_backends.core.errors import (
    BackendUnavailableError,
    BuildError,
    InvalidInputError,
    UnsupportedProblemError,
)
from fp8_backends.core.group_scales import empty_group_scale, is_layout
from fp8_backends.core.oplib import define_ops
from fp8_backends.core.types import ScaleLayout

from . import _support as support
from . import block_jit, common

logger = logging.getLogger("fp8_backends")

OP = "flashinfer_block_gemm"
#: the runner's workspace: never read on the fp8 x fp8 path, only required to be configured
WORKSPACE_BYTES = 256
_GROUP = block_jit.K_MULTIPLE
_TMA = ScaleLayout.M_MAJOR_TMA
_E4M3 = torch.float8_e4m3fn
_BF16 = torch.bfloat16
_F32 = torch.float32


# ----------------------------------------------------------------------------------------- module and devices
class BlockModule:
    """flashinfer's built and loaded ``fp8_blockscale_gemm_90`` module, once per process."""

    def __init__(self) -> None:
        fi = support.require_flashinfer(())
        reason = block_jit.feature_reason(fi)
        if reason:
            raise BackendUnavailableError(f"flashinfer_block: {reason}")
        self.fi = fi
        self.version = common.flashinfer_version()
        try:
            self.module = block_jit.build_module()
        except Exception as exc:  # unusable for this process: resolution marks it so and auto moves on
            raise BackendUnavailableError(
                f"flashinfer_block: building or loading flashinfer's fp8_blockscale_gemm_sm90 module failed "
                f"({type(exc).__name__}: {str(exc)[:400]}); flashinfer's JIT log is in {self._folder()}") from exc
        from flashinfer.jit import env as jit_env

        include = jit_env.FLASHINFER_CSRC_DIR / block_jit.DEEPGEMM_INCLUDE
        self.module.set_deepgemm_jit_include_dirs([str(include)])
        #: the binding and config rule these calls rely on are flashinfer 0.7's
        self.direct = block_jit.config_rule_known(self.version)
        if not self.direct:
            logger.warning(
                "flashinfer_block: flashinfer %s is not a version whose fp8_blockscale_gemm_sm90 binding this "
                "provider was written against (0.7.x); calling flashinfer's public function (same results, its "
                "per-call workspace and checks)", self.version)


    @staticmethod
    def _folder() -> str:
        try:
            return str(block_jit.module_state(block_jit.module_spec())[1])
        except Exception:
            return "flashinfer's JIT folder"


_MODULE: list[BlockModule] = []


def load_module() -> BlockModule:
    """Build (first time: about 2 minutes, logged) and load flashinfer's module; once per process, never during
    CUDA-graph capture. Called at load time (the provider's ``preload``)."""
    if _MODULE:
        return _MODULE[0]
    with support.lock:
        if not _MODULE:
            support.refuse_in_capture("building/loading flashinfer's fp8_blockscale_gemm_sm90 module")
            _MODULE.append(BlockModule())
    return _MODULE[0]


class BlockDevice:
    """Per-device state: our runner and its workspace, the SM count DeepGEMM's config choice depends on."""

    def __init__(self, device: torch.device) -> None:
        self.mod = load_module()
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(self.index)
        self.sm = (props.major, props.minor)
        if self.sm != (9, 0):
            reason = (f"flashinfer's fp8_blockscale_gemm_sm90 (DeepGEMM) runs on SM 9.0 only; cuda:{self.index} is "
                      f"SM {self.sm[0]}.{self.sm[1]}")
            raise UnsupportedProblemError(f"flashinfer_block: {reason}", reasons=[reason])
        self.num_sms = int(props.multi_processor_count)
        #: the kernels are JIT-compiled per config (TRTLLM_DG_ENABLED=0 selects the module's precompiled ones)
        self.jit = os.environ.get("TRTLLM_DG_ENABLED", "1") != "0"
        #: whether kernel_config names the kernel a shape needs (flashinfer 0.7's rule)
        self.predictable = self.mod.direct and self.jit
        if self.mod.direct:
            self.runner = self.mod.module.init()
            self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=torch.device("cuda", self.index))
            self.runner.configure_workspace(self.workspace)
            self.run: Callable[..., Any] = self.runner.run_gemm
            self.kind = "direct"
        else:
            api = self.mod.fi.gemm.fp8_blockscale_gemm_sm90

            def run(x, w, out, x_scale, w_scale) -> None:
                api(x, w, x_scale, w_scale, out=out)

            self.run = run
            self.kind = "api"


_DEVICES: dict[int, BlockDevice] = {}


def device_state(device: torch.device) -> BlockDevice:
    """Load (once) what the op needs on ``device`` (the module, a runner); at prepare_weight time."""
    return support.per_device(_DEVICES, BlockDevice, device, "loading flashinfer's fp8_blockscale_gemm_sm90 runner")


# ----------------------------------------------------------------------------------------- shapes run here
#: (device, M, N, K) -> the run function, for every shape run in this process (the hot path's lookup)
_SEEN: dict[tuple[int, int, int, int], Callable[..., Any]] = {}
#: (device, N, K, KernelConfig) of every DeepGEMM kernel run in this process
_KERNELS: set[tuple[int, int, int, block_jit.KernelConfig]] = set()


def _describe(m: int, n: int, k: int) -> str:
    return f"M={m} N={n} K={k}"


def kernel_ready(device_index: int, m: int, n: int, k: int) -> bool:
    """Whether a call of this shape runs without compiling anything (the exact shape, or its kernel config, ran here
    before): what CUDA-graph capture needs."""
    if (device_index, m, n, k) in _SEEN:
        return True
    state = _DEVICES.get(device_index)
    if state is None:
        return False
    if not state.jit:
        return True
    if not state.predictable:
        return False
    return (device_index, n, k, block_jit.kernel_config(m, n, k, state.num_sms)) in _KERNELS


def _first_run(key: tuple[int, int, int, int], x, w, out, x_scale, w_scale) -> None:
    """The first call of a shape: refuse it during capture if it would compile a kernel; log a compile."""
    dev, m, n, k = key
    with support.lock:
        state = _DEVICES.get(dev) or device_state(x.device)
        config = block_jit.kernel_config(m, n, k, state.num_sms) if state.predictable else None
        ready = kernel_ready(dev, m, n, k)
        what = f"{_describe(m, n, k)}" + (f" ({config.describe()})" if config is not None else "")
        if not ready and support.capturing():
            raise UnsupportedProblemError(
                f"flashinfer_block's first call for {what} may compile a DeepGEMM kernel, which must happen outside "
                f"CUDA graph capture: run this M once eagerly (a model: fp8_backends.warm_up(model, [batch sizes]), "
                f"which runs the providers captured calls take; preparing the weight warms M < "
                f"{block_jit.SWAP_AB_BELOW}) before capturing",
                reasons=[f"flashinfer_block: an un-warmed shape {_describe(m, n, k)} during CUDA graph capture"],
            )
        compiles = not ready and state.jit and not (
            config is not None and block_jit.kernel_cached_on_disk(config, n, k))
        if compiles:
            logger.info("flashinfer_block: compiling a DeepGEMM kernel for %s on cuda:%d with nvcc (once per shape "
                        "and config; cached in %s)", what, dev, block_jit.kernel_cache_dir())
        start = time.monotonic()
        try:
            state.run(x, w, out, x_scale, w_scale)
        except Exception as exc:
            if not compiles:
                raise
            raise BuildError(
                f"flashinfer_block: compiling or loading the DeepGEMM kernel for {what} failed ({type(exc).__name__}: "
                f"{str(exc)[:300]}); nvcc: {block_jit.find_nvcc() or 'not found (set CUDA_HOME)'}") from exc
        if compiles:
            logger.info("flashinfer_block: compiled the DeepGEMM kernel for %s in %.1f s", what,
                        time.monotonic() - start)
        if config is not None:
            _KERNELS.add((dev, n, k, config))
        _SEEN[key] = state.run


def reset() -> None:
    """Forget which shapes and kernels ran here (tests). DeepGEMM's own caches keep the kernels."""
    with support.lock:
        _SEEN.clear()
        _KERNELS.clear()


def shapes_run() -> dict[str, str]:
    """For logs and tests: ``{"cuda:0 M=.. N=.. K=..": "direct" or "api"}`` for every shape run here."""
    out = {}
    for (dev, m, n, k) in list(_SEEN):
        state = _DEVICES.get(dev)
        out[f"cuda:{dev} {_describe(m, n, k)}"] = state.kind if state is not None else "?"
    return out


# ----------------------------------------------------------------------------------------- the op
def _gemm_impl(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    if out_dtype != _BF16:
        raise InvalidInputError(f"flashinfer_block writes bfloat16 only, not {out_dtype}")
    out = torch.empty((m, n), dtype=_BF16, device=x.device)
    if m == 0:
        return out
    if x.dtype != _E4M3 or w.dtype != _E4M3:
        raise InvalidInputError(f"flashinfer_block takes float8_e4m3fn x and w, got {x.dtype} and {w.dtype}")
    if w.dim() != 2 or w.shape[1] != k or not w.is_contiguous() or w.data_ptr() % 16:
        raise InvalidInputError(f"flashinfer_block needs w [N, K={k}] row-major contiguous, 16-byte aligned; got "
                                f"{tuple(w.shape)} strides {w.stride()}")
    groups = k // _GROUP
    if k % _GROUP or n % block_jit.N_MULTIPLE:
        raise InvalidInputError("; ".join(block_jit.shape_reasons(n, k)))
    if x_scale.dtype != _F32 or x_scale.shape != (m, groups):
        raise InvalidInputError(f"flashinfer_block needs x_scale fp32 [M, K/128] = [{m}, {groups}]; got "
                                f"{x_scale.dtype} {tuple(x_scale.shape)}")
    if w_scale.dtype != _F32 or w_scale.shape != (-(-n // _GROUP), groups) or not w_scale.is_contiguous():
        raise InvalidInputError(f"flashinfer_block needs w_scale fp32 [ceil(N/128), K/128] = [{-(-n // _GROUP)}, "
                                f"{groups}] contiguous; got {w_scale.dtype} {tuple(w_scale.shape)}")
    if not x.is_contiguous() or x.data_ptr() % 16:  # the binding passes K as x's row stride; TMA wants 16 B
        x = x.clone(memory_format=torch.contiguous_format)
    if not is_layout(x_scale, _TMA) or x_scale.data_ptr() % 16:
        fixed = empty_group_scale(m, groups, _TMA, x.device)
        fixed.copy_(x_scale)
        x_scale = fixed
    key = (x.get_device(), m, n, k)
    run = _SEEN.get(key)
    if run is None:
        _first_run(key, x, w, out, x_scale, w_scale)
    else:
        run(x, w, out, x_scale, w_scale)
    return out


def _gemm_fake(x, w, x_scale, w_scale, out_dtype):
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


def warm_up(w: torch.Tensor, w_scale: torch.Tensor, ms: Iterable[int]) -> list[tuple[int, str, float]]:
    """Run the kernels the ``M`` values ``ms`` need for the weight ``w [N, K]`` (``w_scale`` its fp32 block scales)
    once each, on zeros, compiling those not run in this process yet: ``[(M, config, seconds)]`` of what ran. Load
    time only (refused during capture). With flashinfer 0.7's config rule one ``M`` per distinct kernel runs; else
    every ``M`` not run before."""
    n, k = w.shape
    state = device_state(w.device)
    dev = state.index
    todo: list[int]
    if state.predictable:
        todo = [m for config, m in block_jit.configs_for(ms, n, k, state.num_sms).items()
                if (dev, n, k, config) not in _KERNELS]
    else:
        todo = [m for m in dict.fromkeys(ms) if (dev, m, n, k) not in _SEEN]
    done = []
    groups = k // _GROUP
    for m in todo:
        support.refuse_in_capture(f"flashinfer_block's warm-up of {_describe(m, n, k)}")
        x = torch.zeros((m, k), dtype=_E4M3, device=w.device)
        x_scale = empty_group_scale(m, groups, _TMA, w.device).fill_(1.0)
        start = time.monotonic()
        _gemm_impl(x, w, x_scale, w_scale, _BF16)
        config = block_jit.kernel_config(m, n, k, state.num_sms).describe() if state.predictable else "?"
        done.append((m, config, time.monotonic() - start))
    return done


# ------------------------------------------------------------------------------------- registration
_SCHEMA = f"{OP}(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, ScalarType out_dtype) -> Tensor"

gemm_op = define_ops({OP: (_SCHEMA, _gemm_impl, _gemm_fake)}, ("CUDA",))[OP]

__all__ = ["OP", "WORKSPACE_BYTES", "BlockDevice", "BlockModule", "device_state", "gemm_op", "kernel_ready",
           "load_module", "reset", "shapes_run", "warm_up"]
