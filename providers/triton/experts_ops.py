"""The block-scaled FP8 GEMMs over routed experts (kernel contracts in :mod:`.experts_kernels`):
:func:`experts_gemv` for few (token, slot) pairs (a MoE layer's decode, one launch per projection) and
:func:`experts_gemm` for many (prefill: the pairs sorted by expert into tiles of tensor-core MMAs).

``experts_gemv(x [R, K], w [E, N, K] fp8, w_scale [E, ceil(N/128), ceil(K/128)] fp32, ids [P] int, rw [P] fp32 or
None, token_div, out_dtype) -> [P, N]``: row ``p`` is ``x[p // token_div]`` (quantized per group of 128 inside the
launch) times expert ``ids[p]``'s weight, times ``rw[p]`` where given; ids outside ``[0, E)`` give zero rows. The
weight scales may also be one per output row, ``w_scale [E, N]`` (per-channel checkpoints; per-tensor ones with the
value repeated over the rows).

``experts_gemm`` computes the same (``x`` quantized per group of 128 first by the Triton group quantization): the
pairs sorted by expert and cut into tiles of one expert each (:func:`tile_plan`: one launch on the device, no host
sync), then one launch over ``cdiv(P, BLOCK_M) + min(E + 1, P)`` tile rows (the most tiles any routing needs; the
unused ones exit at once, those of pairs without an expert write their zero rows).

Plain eager calls launch through the library's cached launcher (:mod:`.launcher`); under ``torch.compile`` the ops
``fp8_backends::triton_experts_gemv`` / ``triton_experts_gemm`` / ``triton_experts_route`` are ``triton_op`` s
whose bodies launch the same kernels through ``wrap_triton`` (Inductor launches them from its generated code). No
host-device sync: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.oplib import LazyOps, TritonOpSpec

from . import _support
from ._support import GRID_Y_MAX
from .block_gemm_configs import WEIGHT_BLOCK
from .experts_args import (
    BLOCK_MS,
    GROUP_SIZE,
    block_m_for,
    gemm_kernel_args,
    kernel_args,
    route_buffer_len,
    route_launches,
    route_sizes,
    route_views,
)
from .launcher import launch as _launch

OP_BASENAME = "triton_experts_gemv"
GEMM_OP_BASENAME = "triton_experts_gemm"
ROUTE_OP_BASENAME = "triton_experts_route"


_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_inputs(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor,
                 rw: torch.Tensor | None, token_div: int, out_dtype: torch.dtype | None = None,
                 gemv: bool = True) -> None:
    """One :class:`~fp8_backends.core.errors.InvalidInputError` for operands :func:`experts_gemv` (``gemv``) or
    :func:`experts_gemm` cannot take."""
    named = {"x": x, "w": w, "w_scale": w_scale, "ids": ids} | ({} if rw is None else {"rw": rw})
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise InvalidInputError(f"{name} must be a tensor, got {type(t).__name__}")
    if w.dim() != 3 or w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or w.shape[0] < 1:
        raise InvalidInputError(f"experts weight must be a 3-D float8 [E, N, K] tensor, got {w.dtype} "
                                f"{tuple(w.shape)}")
    e, n, k = w.shape
    want = (e, -(-n // WEIGHT_BLOCK[0]), -(-k // WEIGHT_BLOCK[1]))
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) not in (want, (e, n)):
        raise InvalidInputError(f"experts weight scales must be float32 {want} (128x128 blocks) or {(e, n)} (one per "
                                f"output row), got {w_scale.dtype} {tuple(w_scale.shape)}")
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InvalidInputError(f"experts input must be a bf16/fp16/fp32 [rows, {k}] tensor, got {x.dtype} "
                                f"{tuple(x.shape)}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64) or ids.stride(0) != 1:
        raise InvalidInputError(f"expert ids must be a contiguous 1-D int32/int64 tensor, got {ids.dtype} "
                                f"{tuple(ids.shape)} strides {ids.stride()}")
    if out_dtype is not None and out_dtype not in _OUT_DTYPES:
        raise InvalidInputError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if token_div < 1 or ids.shape[0] > x.shape[0] * token_div:
        raise InvalidInputError(f"{ids.shape[0]} pairs need {-(-ids.shape[0] // max(token_div, 1))} input rows "
                                f"(token_div {token_div}), got {x.shape[0]}")
    if rw is not None and (rw.dim() != 1 or rw.shape[0] != ids.shape[0] or rw.dtype != torch.float32
                           or rw.stride(0) != 1):
        raise InvalidInputError(f"routing weights must be contiguous float32 [{ids.shape[0]}], got {rw.dtype} "
                                f"{tuple(rw.shape)}")
    if gemv and ids.shape[0] > GRID_Y_MAX:
        raise InvalidInputError(f"the experts GEMV launches one program row per pair: at most {GRID_Y_MAX}, got "
                                f"{ids.shape[0]}")
    devices = {t.device for t in (x, w, w_scale, ids) + (() if rw is None else (rw,))}
    if len(devices) != 1:
        raise InvalidInputError(f"experts GEMV operands on several devices: {sorted(map(str, devices))}")
    device = next(iter(devices))
    if device.type not in {d.value for d in _support.DEVICES}:
        raise InvalidInputError(f"the experts kernels run on CUDA tensors (CPU ones only under Triton's interpreter, "
                                f"TRITON_INTERPRET=1), got {device.type}")


def launch(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor, rw: torch.Tensor | None,
           token_div: int, out_dtype: torch.dtype, config: str = "auto") -> torch.Tensor:
    """The eager implementation (operands assumed checked: :func:`check_inputs`)."""
    out = x.new_empty((ids.shape[0], w.shape[1]), dtype=out_dtype)
    if ids.shape[0] == 0:
        return out
    kernel, grid, args, warps = kernel_args(x, w, w_scale, ids, rw, token_div, out, config)
    index = x.get_device()
    _support.on_device(index, _launch_on, kernel, grid, args, warps, 1, index)
    return out


def _launch_on(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], warps: int, stages: int,
               index: int) -> None:
    """Launch through the library's cached launcher (no PDL); ``index``: the tensors' device (-1: the interpreter)."""
    _launch(kernel, grid, args, num_warps=warps, num_stages=stages, pdl=False, device_index=max(index, 0))


# ------------------------------------------------------------------------------------------ the tiled GEMM
def tile_plan(ids: torch.Tensor, experts: int, block_m: int, route_op: Any = None) -> tuple[torch.Tensor, ...]:
    """``(order, tile_expert, tile_row0, tile_end)`` of :func:`.experts_kernels.experts_gemm_kernel` for the expert
    ids ``ids [P]`` (contiguous int32/int64): the pairs sorted by expert (ids outside ``[0, E)`` last, in tiles of
    expert ``E`` that write their zero rows), and for each of :func:`.experts_args.route_sizes`' ``max_tiles`` tiles
    its expert (``> E``: unused), first sorted row and its segment's row end; int32 views of one tensor. One launch
    of :func:`.experts_kernels.experts_route_kernel`, two over many programs above
    :data:`.experts_args.ROUTE_ONE_PROGRAM_MAX` pairs (the op ``fp8_backends::triton_experts_route``, which
    ``torch.compile`` launches itself; ``route_op``: its callable, :func:`load_route_op`'s by default), no host
    sync: CUDA-graph capturable."""
    p = ids.shape[0]
    buf = (route_op or load_route_op())(ids, experts, block_m)
    return route_views(buf, p, route_sizes(p, experts, block_m)[0])[:4]


def route_launch(ids: torch.Tensor, experts: int, block_m: int) -> torch.Tensor:
    """The eager implementation of ``triton_experts_route``: one int32 tensor holding the order, the tile plan and
    the kernel's scratch (:func:`.experts_args.route_views`)."""
    buf = ids.new_empty((route_buffer_len(ids.shape[0], experts, block_m),), dtype=torch.int32)
    if ids.shape[0]:
        index = ids.get_device()
        for kernel, grid, args, warps in route_launches(ids, experts, block_m, buf):
            _support.on_device(index, _launch_on, kernel, grid, args, warps, 1, index)
    return buf


def _fake_route(ids: Any, experts: int, block_m: int) -> Any:
    return ids.new_empty((route_buffer_len(ids.shape[0], experts, block_m),), dtype=torch.int32)


def gemm_launch(x_q: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                order: torch.Tensor, tile_expert: torch.Tensor, tile_row0: torch.Tensor, tile_end: torch.Tensor,
                rw: torch.Tensor | None, token_div: int, block_m: int, out_dtype: torch.dtype,
                n_first: bool | None = None) -> torch.Tensor:
    """The eager implementation of the tiled GEMM: ``[P, N]`` (rows of pairs without an expert zero, written by
    their tiles); ``n_first``: the grid order (:func:`.experts_args.gemm_kernel_args`)."""
    out = x_q.new_empty((order.shape[0], w.shape[1]), dtype=out_dtype)
    if order.shape[0] == 0:
        return out
    kernel, grid, args, warps, stages = gemm_kernel_args(x_q, x_scale, w, w_scale, order, tile_expert, tile_row0,
                                                         tile_end, rw, token_div, block_m, out, n_first)
    index = x_q.get_device()
    _support.on_device(index, _launch_on, kernel, grid, args, warps, stages, index)
    return out


def _fake_gemm(x_q: Any, x_scale: Any, w: Any, w_scale: Any, order: Any, tile_expert: Any, tile_row0: Any,
               tile_end: Any, rw: Any, token_div: int, block_m: int, out_dtype: Any) -> Any:
    return x_q.new_empty((order.shape[0], w.shape[1]), dtype=out_dtype)


def experts_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor,
                 rw: torch.Tensor | None = None, token_div: int = 1, out_dtype: torch.dtype | None = None,
                 block_m: int | None = None) -> torch.Tensor:
    """Checked call of the tiled GEMM (module docstring): what :func:`experts_gemv` computes, for many pairs."""
    from .group_quant_ops import triton_quant_per_token_group

    check_inputs(x, w, w_scale, ids, rw, token_div, out_dtype, gemv=False)
    if block_m is not None and block_m not in BLOCK_MS:
        raise InvalidInputError(f"block_m must be one of {BLOCK_MS}, got {block_m!r}")
    bm = block_m_for(ids.shape[0], w.shape[0]) if block_m is None else block_m
    plan = tile_plan(ids, w.shape[0], bm)
    x_q, x_scale = triton_quant_per_token_group(x, GROUP_SIZE, w.dtype, "row_major")
    return load_gemm_op()(x_q, x_scale, w, w_scale, *plan, rw, token_div, bm,
                          x.dtype if out_dtype is None else out_dtype)


def _fake(x: Any, w: Any, w_scale: Any, ids: Any, rw: Any, token_div: int, out_dtype: Any, config: str) -> Any:
    return x.new_empty((ids.shape[0], w.shape[1]), dtype=out_dtype)


_SCHEMA = (f"{OP_BASENAME}(Tensor x, Tensor w, Tensor w_scale, Tensor ids, Tensor? rw, int token_div, "
           "ScalarType out_dtype, str config) -> Tensor")


_ROUTE_SCHEMA = f"{ROUTE_OP_BASENAME}(Tensor ids, int experts, int block_m) -> Tensor"


_GEMM_SCHEMA = (f"{GEMM_OP_BASENAME}(Tensor x_q, Tensor x_scale, Tensor w, Tensor w_scale, Tensor order, "
                "Tensor tile_expert, Tensor tile_row0, Tensor tile_end, Tensor? rw, int token_div, int block_m, "
                "ScalarType out_dtype) -> Tensor")


def _specs() -> dict[str, Any]:
    # under the interpreter plain opaque ops: Inductor cannot launch interpreted kernels
    if _support.interpreting():
        return {OP_BASENAME: (_SCHEMA, launch, _fake), GEMM_OP_BASENAME: (_GEMM_SCHEMA, gemm_launch, _fake_gemm),
                ROUTE_OP_BASENAME: (_ROUTE_SCHEMA, route_launch, _fake_route)}
    from .experts_traced import triton_experts_gemm, triton_experts_gemv, triton_experts_route

    return {OP_BASENAME: TritonOpSpec(triton_experts_gemv, launch),
            GEMM_OP_BASENAME: TritonOpSpec(triton_experts_gemm, gemm_launch),
            ROUTE_OP_BASENAME: TritonOpSpec(triton_experts_route, route_launch)}


def _dispatch_keys() -> tuple[str, ...]:
    return ("CUDA", "CPU") if _support.interpreting() else ("CUDA",)


_OPS = LazyOps(_specs, _dispatch_keys)


def load_op() -> Any:
    """Define the ops now (load time, never inside ``torch.compile`` tracing); returns the GEMV's hot-path callable."""
    _OPS.preload()
    return _OPS.call(OP_BASENAME)


def load_gemm_op() -> Any:
    """Define the ops now (load time); returns the tiled GEMM's hot-path callable (``(x_q, x_scale, w, w_scale,
    order, tile_expert, tile_row0, tile_end, rw, token_div, block_m, out_dtype) -> [P, N]``)."""
    _OPS.preload()
    return _OPS.call(GEMM_OP_BASENAME)


def load_route_op() -> Any:
    """Define the ops now (load time); returns the routing op's hot-path callable (``(ids, experts, block_m) ->``
    int32 ``[route_buffer_len(P, E, block_m)]``, :func:`tile_plan`'s views of it)."""
    _OPS.preload()
    return _OPS.call(ROUTE_OP_BASENAME)


def experts_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor,
                 rw: torch.Tensor | None = None, token_div: int = 1, out_dtype: torch.dtype | None = None,
                 config: str = "auto") -> torch.Tensor:
    """Checked call (module docstring): ``[ids.numel(), N]`` in ``out_dtype`` (default ``x``'s dtype)."""
    check_inputs(x, w, w_scale, ids, rw, token_div, out_dtype)
    return load_op()(x, w, w_scale, ids, rw, token_div, x.dtype if out_dtype is None else out_dtype, config)


class TritonExpertsKernels:
    """The :class:`~fp8_backends.core.backend.ExpertsKernels` of the ``triton`` provider: the experts GEMV up to
    ``gemv_pairs`` pairs, the tiled experts GEMM above (its tile plan made once a layer call, shared by both
    projections). Define the ops at construction (load time)."""

    #: weight scales one per output row (``[E, N]``) served besides 128x128 blocks
    row_scales = True

    def __init__(self) -> None:
        from .group_quant_ops import load_op as load_quant_op
        from .group_quant_ops import triton_quant_per_token_group

        load_quant_op()
        self._gemv, self._gemm, self._quant = load_op(), load_gemm_op(), triton_quant_per_token_group
        self._route = load_route_op()

    def plan(self, ids: torch.Tensor, experts: int, gemv_pairs: int) -> Any:
        if ids.shape[0] <= min(gemv_pairs, GRID_Y_MAX):
            return None
        bm = block_m_for(ids.shape[0], experts)
        return (bm, *tile_plan(ids, experts, bm, self._route))

    def matmul(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor,
               rw: torch.Tensor | None, token_div: int, out_dtype: torch.dtype, plan: Any) -> torch.Tensor:
        if plan is None:
            return self._gemv(x, w, w_scale, ids, rw, token_div, out_dtype, "auto")
        bm, *tiles = plan
        x_q, x_s = self._quant(x, GROUP_SIZE, w.dtype, "row_major")
        return self._gemm(x_q, x_s, w, w_scale, *tiles, rw, token_div, bm, out_dtype)


__all__ = ["GEMM_OP_BASENAME", "OP_BASENAME", "ROUTE_OP_BASENAME", "TritonExpertsKernels", "check_inputs",
           "experts_gemm", "experts_gemv", "gemm_launch", "launch", "load_gemm_op", "load_op", "load_route_op",
           "route_launch", "tile_plan"]
