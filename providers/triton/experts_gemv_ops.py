"""The block-scaled FP8 GEMV over routed experts: :func:`experts_gemv` (a MoE layer's decode, one launch per
projection for every (token, slot) pair; kernel contract in :mod:`.experts_gemv_kernels`).

``experts_gemv(x [R, K], w [E, N, K] fp8, w_scale [E, ceil(N/128), ceil(K/128)] fp32, ids [P] int, rw [P] fp32 or
None, token_div, out_dtype) -> [P, N]``: row ``p`` is ``x[p // token_div]`` (quantized per group of 128 inside the
launch) times expert ``ids[p]``'s weight, times ``rw[p]`` where given; ids outside ``[0, E)`` give zero rows.

Plain eager calls launch through the library's cached launcher (:mod:`.launcher`); under ``torch.compile`` the op
``fp8_backends::triton_experts_gemv`` is a ``triton_op`` whose body launches the same kernel through
``wrap_triton`` (Inductor launches it from its generated code). No host-device sync: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.oplib import LazyOps, TritonOpSpec
from fp8_backends.core.types import Fp8Dtype

from . import _support
from .block_gemm_args import row_align
from .block_gemm_configs import CONFIGS, WEIGHT_BLOCK, fused_shape_config
from .launcher import launch as _launch

OP_BASENAME = "triton_experts_gemv"
GROUP_SIZE = 128
_GRID_Y_MAX = 65535


def check_inputs(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor,
                 rw: torch.Tensor | None, token_div: int) -> None:
    """One :class:`~fp8_backends.core.errors.InvalidInputError` for operands :func:`experts_gemv` cannot take."""
    if w.dim() != 3 or w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise InvalidInputError(f"experts weight must be a 3-D float8 [E, N, K] tensor, got {w.dtype} "
                                f"{tuple(w.shape)}")
    e, n, k = w.shape
    want = (e, -(-n // WEIGHT_BLOCK[0]), -(-k // WEIGHT_BLOCK[1]))
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != want:
        raise InvalidInputError(f"experts weight scales must be float32 {want}, got {w_scale.dtype} "
                                f"{tuple(w_scale.shape)}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidInputError(f"experts input must be a bf16/fp16/fp32 [rows, {k}] tensor, got {x.dtype} "
                                f"{tuple(x.shape)}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise InvalidInputError(f"expert ids must be a 1-D int32/int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    if token_div < 1 or ids.shape[0] > x.shape[0] * token_div:
        raise InvalidInputError(f"{ids.shape[0]} pairs need {-(-ids.shape[0] // max(token_div, 1))} input rows "
                                f"(token_div {token_div}), got {x.shape[0]}")
    if rw is not None and (rw.dim() != 1 or rw.shape[0] != ids.shape[0] or rw.dtype != torch.float32):
        raise InvalidInputError(f"routing weights must be float32 [{ids.shape[0]}], got {rw.dtype} "
                                f"{tuple(rw.shape)}")
    if ids.shape[0] > _GRID_Y_MAX:
        raise InvalidInputError(f"the experts GEMV launches one program row per pair: at most {_GRID_Y_MAX}, got "
                                f"{ids.shape[0]}")
    devices = {t.device for t in (x, w, w_scale, ids) + (() if rw is None else (rw,))}
    if len(devices) != 1:
        raise InvalidInputError(f"experts GEMV operands on several devices: {sorted(map(str, devices))}")


def _kernel() -> Any:
    from .experts_gemv_kernels import experts_gemv_kernel

    return experts_gemv_kernel


def kernel_args(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor | None,
          token_div: int, out: torch.Tensor, config: str) -> tuple[Any, tuple[int, int], tuple[Any, ...], int]:
    e, n, k = w.shape
    cfg = CONFIGS[config if config in CONFIGS and CONFIGS[config].family == "gemv" else fused_shape_config(n, k)]
    step = cfg.groups * GROUP_SIZE
    args = (x, w, out, w_scale, ids, out if rw is None else rw, n, k, e, token_div,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
            w_scale.stride(0), w_scale.stride(1), w_scale.stride(2),
            cfg.block_n, cfg.groups, GROUP_SIZE, WEIGHT_BLOCK[0], WEIGHT_BLOCK[1], k % step == 0,
            row_align(k, x.stride(0), w.stride(1)), rw is not None, Fp8Dtype.of(w.dtype).max)
    return _kernel(), (-(-n // cfg.block_n), ids.shape[0]), args, cfg.warps


def launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor | None,
           token_div: int, out_dtype: torch.dtype, config: str = "auto") -> torch.Tensor:
    """The eager implementation (operands assumed checked: :func:`check_inputs`)."""
    out = x.new_empty((ids.shape[0], w.shape[1]), dtype=out_dtype)
    if ids.shape[0] == 0:
        return out
    kernel, grid, args, warps = kernel_args(x, w, w_scale, ids, rw, token_div, out, config)
    index = x.get_device()
    _support.on_device(index, _launch_on, kernel, grid, args, warps, index)
    return out


def _launch_on(kernel: Any, grid: tuple[int, int], args: tuple[Any, ...], warps: int, index: int) -> None:
    _launch(kernel, grid, args, num_warps=warps, num_stages=1, pdl=False, device_index=max(index, 0))


def _fake(x: Any, w: Any, w_scale: Any, ids: Any, rw: Any, token_div: int, out_dtype: Any, config: str) -> Any:
    return x.new_empty((ids.shape[0], w.shape[1]), dtype=out_dtype)


_SCHEMA = (f"{OP_BASENAME}(Tensor x, Tensor w, Tensor w_scale, Tensor ids, Tensor? rw, int token_div, "
           "ScalarType out_dtype, str config) -> Tensor")


def _specs() -> dict[str, Any]:
    # under the interpreter a plain opaque op: Inductor cannot launch interpreted kernels
    if _support.interpreting():
        return {OP_BASENAME: (_SCHEMA, launch, _fake)}
    from .experts_gemv_traced import triton_experts_gemv

    return {OP_BASENAME: TritonOpSpec(triton_experts_gemv, launch)}


def _dispatch_keys() -> tuple[str, ...]:
    return ("CUDA", "CPU") if _support.interpreting() else ("CUDA",)


_OPS = LazyOps(_specs, _dispatch_keys)


def load_op() -> Any:
    """Define the op now (load time, never inside ``torch.compile`` tracing); returns its hot-path callable."""
    _OPS.preload()
    return _OPS.call(OP_BASENAME)


def experts_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor,
                 rw: torch.Tensor | None = None, token_div: int = 1, out_dtype: torch.dtype | None = None,
                 config: str = "auto") -> torch.Tensor:
    """Checked call (module docstring): ``[ids.numel(), N]`` in ``out_dtype`` (default ``x``'s dtype)."""
    check_inputs(x, w, w_scale, ids, rw, token_div)
    return load_op()(x, w, w_scale, ids, rw, token_div, x.dtype if out_dtype is None else out_dtype, config)


__all__ = ["OP_BASENAME", "check_inputs", "experts_gemv", "launch", "load_op"]
