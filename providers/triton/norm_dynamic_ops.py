"""The torch side of the Triton fused RMSNorm (+ residual add) + dynamic FP8 quantization
(:mod:`.norm_dynamic_kernels`): the eager call (:func:`rmsnorm_quant_dynamic`, launched through :mod:`.launcher` with
replays) and the two ``triton_op`` ops ``fp8_backends::triton_rmsnorm_quant_dynamic`` /
``triton_fused_add_rmsnorm_quant_dynamic``, whose traced bodies (:mod:`.norm_dynamic_traced`) launch the same kernels
from Inductor's code under ``torch.compile``. No host-device synchronisation and no allocation besides the outputs:
CUDA-graph capturable. This module imports torch and triton: import it lazily.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.oplib import LazyOps, TritonOpSpec

from . import _support
from .group_quant_kernels import FMAX, group_scale_empty
from .launcher import ReplayCache, launcher_for, raw_stream
from .norm_dynamic_kernels import (
    PDL_MAX_ELEMENTS,
    PER_TOKEN,
    PER_TOKEN_GROUP,
    DynConfig,
    dyn_config,
    kernel_args,
    outputs_like,
    per_token_mode,
)

#: replays of earlier launches, one cache per kernel (:class:`.norm_dynamic_kernels.DynConfig` paths)
_REPLAYS = {path: ReplayCache(head=5) for path in ("block", "loop", "packed", "parts")}


def _launch(cfg: DynConfig, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, q: torch.Tensor,
            scale: torch.Tensor, eps: float, per_token: bool, index: int) -> None:
    use_pdl = _support.pdl_on(index) and x.shape[0] * x.shape[1] < PDL_MAX_ELEMENTS
    r = x if residual is None else residual
    replays = _REPLAYS[cfg.path]
    key = None
    if index >= 0:
        ptrs = (x.data_ptr(), r.data_ptr(), weight.data_ptr(), q.data_ptr(), scale.data_ptr())
        if not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
            key = (cfg, x.shape, x.stride(0), r.stride(0), q.stride(0), weight.stride(0), scale.stride(), x.dtype,
                   r.dtype, weight.dtype, q.dtype, residual is None, per_token, eps, use_pdl, index)
            hit = replays.lookup(key)
            if hit is not None and index == _support.current_device():
                rp = hit[0]
                rp.run(rp.g0, rp.g1, rp.g2, raw_stream(index), rp.function, rp.packed, None, None, None, *ptrs,
                       *hit[1])
                return
    kernel, grid, args = kernel_args(cfg, x, residual, weight, q, scale, eps, per_token, use_pdl)
    kernel_launcher = launcher_for(kernel)
    options = {"num_warps": cfg.num_warps, "pdl": use_pdl, "device_index": max(index, 0)}
    kernel_launcher(grid, args, **options)
    if key is not None:
        replays.record(key, kernel_launcher, grid, args, **options)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """What the kernels rely on (metadata only): ``x`` and ``residual`` read with a unit column stride, one weight
    per column, a residual of ``x``'s shape."""
    t, h = x.shape
    if h > 1 and x.stride(1) != 1:
        raise InvalidInputError(f"x must have a unit column stride (rows may be strided), got strides {x.stride()}")
    if weight.dim() != 1 or weight.shape[0] != h:
        raise InvalidInputError(f"weight must be [H] = [{h}], got {list(weight.shape)}")
    if residual is not None and (tuple(residual.shape) != (t, h) or (h > 1 and residual.stride(1) != 1)):
        raise InvalidInputError(f"residual must be [T, H] = [{t}, {h}] with a unit column stride, got "
                                f"{list(residual.shape)} strides {residual.stride()}")


def _check_config(cfg: DynConfig, h: int, group_size: int, per_token: bool) -> None:
    """A launch shape given by the caller (``config=``) that computes this problem: groups of ``group_size`` (per
    group), one group spanning the row (the one-pass block per token), a block that covers the row."""
    if cfg.path not in _REPLAYS or cfg.rows < 1 or cfg.ng < 1 or cfg.gb < 1:
        raise InvalidInputError(f"config {cfg} is not a launch shape of the dynamic norm")
    if not per_token and cfg.gb != group_size:
        raise InvalidInputError(f"config {cfg}: its groups of {cfg.gb} columns are not the group size {group_size}")
    if cfg.path == "block" and (cfg.ng * cfg.gb < h or (per_token and cfg.ng != 1)):
        raise InvalidInputError(f"config {cfg}: a one-pass block of {cfg.ng} x {cfg.gb} columns does not hold a row "
                                f"of {h}" + (" as one group (per token)" if per_token else ""))
    if cfg.path in ("packed", "parts") and cfg.ng != -(-h // cfg.gb):
        raise InvalidInputError(f"config {cfg}: a row of {h} columns has {-(-h // cfg.gb)} groups of {cfg.gb}")


def rmsnorm_quant_dynamic(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    act_scale: object = PER_TOKEN_GROUP, group_size: int = 128, scale_layout: str = "row_major",
    fp8_dtype: torch.dtype = torch.float8_e4m3fn, q_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None, config: DynConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(q [T, H], scale, residual or None)``: the fused RMSNorm (+ residual add, in place) + dynamic quantization of
    the module docstring. ``act_scale``: ``per_token_group`` (``scale [T, ceil(H / group_size)]`` in
    ``scale_layout``) or ``per_token`` (``scale [T, 1]``). ``q_out`` / ``scale_out``: tensors to write instead of new
    ones. ``config`` overrides :func:`dyn_config` (tests). Checks its operands (the ops, whose callers validated
    them, skip those checks: :func:`_run`)."""
    if x.dim() == 2:  # else _run's error
        _check_operands(x, weight, residual)
        if config is not None:
            _check_config(config, x.shape[1], group_size, per_token_mode(act_scale))
    return _run(x, weight, eps, residual, act_scale, group_size, scale_layout, fp8_dtype, q_out, scale_out, config)


def _run(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, act_scale: object,
         group_size: int, scale_layout: str, fp8_dtype: torch.dtype, q_out: torch.Tensor | None,
         scale_out: torch.Tensor | None, config: DynConfig | None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`rmsnorm_quant_dynamic` without the operand checks (the ops' eager body: a provider validated them)."""
    per_token = per_token_mode(act_scale)
    if fp8_dtype not in FMAX:
        raise InvalidInputError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if x.dim() != 2:
        raise InvalidInputError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    if not per_token and (group_size < 16 or group_size & (group_size - 1)):
        raise InvalidInputError(f"group_size must be a power of two >= 16 (64 or 128), got {group_size}")
    q = q_out if q_out is not None else x.new_empty((t, h), dtype=fp8_dtype)
    if scale_out is not None:
        scale = scale_out
    elif per_token:
        scale = x.new_empty((t, 1), dtype=torch.float32)
    else:
        scale = group_scale_empty(t, -(-h // group_size), scale_layout, x)
    if t == 0 or h == 0:
        return q, scale, residual
    cfg = config if config is not None else dyn_config(t, h, residual is not None, group_size, per_token)
    index = x.get_device()
    _support.on_device(index, _launch, cfg, x, residual, weight, q, scale, float(eps), per_token, index)
    return q, scale, residual


# ---------------------------------------------------------------------------------------------- the torch ops
NORM_OP = "triton_rmsnorm_quant_dynamic"
ADD_NORM_OP = "triton_fused_add_rmsnorm_quant_dynamic"
#: ``group_size = 0``: per token (scale ``[T, 1]``); else per token group in ``scale_layout``
SCHEMAS = {
    NORM_OP: (f"{NORM_OP}(Tensor x, Tensor weight, float eps, int group_size, str scale_layout, "
              "ScalarType fp8_dtype) -> (Tensor, Tensor)"),
    ADD_NORM_OP: (f"{ADD_NORM_OP}(Tensor x, Tensor(a!) residual, Tensor weight, float eps, int group_size, "
                  "str scale_layout, ScalarType fp8_dtype) -> (Tensor, Tensor)"),
}


def _eager_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, scale_layout: str,
                fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, s, _ = _run(x, weight, eps, None, PER_TOKEN if group_size == 0 else PER_TOKEN_GROUP, group_size or 128,
                   scale_layout, fp8_dtype, None, None, None)
    return q, s


def _eager_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                    scale_layout: str, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, s, _ = _run(x, weight, eps, residual, PER_TOKEN if group_size == 0 else PER_TOKEN_GROUP, group_size or 128,
                   scale_layout, fp8_dtype, None, None, None)
    return q, s


def _fake_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int, scale_layout: str,
               fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return outputs_like(x, group_size, scale_layout, fp8_dtype)


def _fake_add_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                   scale_layout: str, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return outputs_like(x, group_size, scale_layout, fp8_dtype)


def _dispatch_keys() -> tuple[str, ...]:
    return ("CUDA", "CPU") if _support.interpreting() else ("CUDA",)


def _specs() -> dict[str, Any]:
    if _support.interpreting():
        return {NORM_OP: (SCHEMAS[NORM_OP], _eager_norm, _fake_norm),
                ADD_NORM_OP: (SCHEMAS[ADD_NORM_OP], _eager_add_norm, _fake_add_norm)}
    from . import norm_dynamic_traced

    return {NORM_OP: TritonOpSpec(norm_dynamic_traced.triton_rmsnorm_quant_dynamic, _eager_norm),
            ADD_NORM_OP: TritonOpSpec(norm_dynamic_traced.triton_fused_add_rmsnorm_quant_dynamic, _eager_add_norm,
                                      ("residual",))}


_OPS = LazyOps(_specs, _dispatch_keys)


def load_ops() -> tuple[Any, Any]:
    """Define the two ops now (load time) and return their OpOverloads ``(rmsnorm, fused_add)``."""
    _OPS.preload()
    return _OPS.op(NORM_OP), _OPS.op(ADD_NORM_OP)


def triton_rmsnorm_quant_dynamic(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                                 group_size: int, scale_layout: str = "row_major",
                                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Through the ops (``group_size = 0``: per token): the eager launcher for plain calls, the traced bodies under
    ``torch.compile``. ``residual`` is updated in place."""
    if residual is None:
        return _OPS.call(NORM_OP)(x, weight, eps, group_size, scale_layout, fp8_dtype)
    return _OPS.call(ADD_NORM_OP)(x, residual, weight, eps, group_size, scale_layout, fp8_dtype)


__all__ = ["ADD_NORM_OP", "NORM_OP", "PER_TOKEN", "PER_TOKEN_GROUP", "load_ops", "rmsnorm_quant_dynamic",
           "triton_rmsnorm_quant_dynamic"]
