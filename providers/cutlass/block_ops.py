"""The torch side of the block-scaled CUTLASS GEMM: the ``fp8_backends::cutlass_sm90_block_gemm`` custom op.

``cutlass_sm90_block_gemm(x, w, x_scale, w_scale, bias, out_dtype, config) -> out`` computes

    out[m, n] = Σ_kb x_scale[m, kb] · w_scale[n // 128, kb] · (x[m, kb·128 : (kb+1)·128] · w[n, same]) (+ bias[n])

for ``x: [M, K]`` and ``w: [N, K]`` float8_e4m3fn row-major, ``x_scale: [M, ceil(K/128)]`` fp32 (1x128 groups) and
``w_scale: [ceil(N/128), ceil(K/128)]`` fp32 (128x128 blocks), in bf16 / fp16 / fp32. It is defined lazily, with a
fake implementation so that ``torch.compile`` traces it without running it; its real implementation picks the config
(``auto``: :data:`.block_configs.DEFAULT_BLOCK_TABLE`, at run time, so compiled graphs carry no M guards), gets the
library (building it at first use, announced in the log), allocates the output (and a stream-K workspace where the
config needs one) and calls ``fp8b_block_gemm`` through ctypes on torch's current stream. No host-device
synchronisation; CUDA-graph capturable. Where the C++ op loads (:mod:`.native_op`), the provider calls its
``cutlass_sm90_block_gemm_native`` instead, which does the same without a Python frame and hands this op the calls it
cannot serve (a shape or library not registered yet, a scale layout to copy, an error to raise): each one registers
its library and the (N, K) buckets with the C++ op here, so the next call of that shape stays in C++.

Scale layouts. The kernels read activation scales M-major (token ``t`` of group ``kb`` at ``ptr[kb·ld + t]``) and
weight scales K-major (block ``(nb, kb)`` at ``ptr[nb·ld + kb]``). :func:`act_scale_operand` takes ``x_scale`` as it
comes: in the layout :data:`.block_configs.ACT_SCALE_LAYOUT` (M-major, ``ld`` a multiple of 4, 16-byte aligned: what
the quantizer produces for this provider) it is passed as it is, to every config; M-major with another ``ld`` is
passed as it is to the configs that load scales with ``cp.async``; anything else (row-major, or an unpadded M-major
layout for a TMA config) is first copied into a fresh padded M-major buffer — one small extra kernel per call, logged
once per process. The prepared weight scale is K-major already (:func:`prepare_block_scale`).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.oplib import LazyOps, gemm_fake, gemm_schema
from fp8_backends.core.padding import round_up

from . import build, native_op
from .block_configs import BLOCK_CONFIGS, GROUP_K, WEIGHT_BLOCK, active_block_table
from .ops import _TMA_ALIGN, CutlassKernelError, _check_aligned

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("fp8_backends")

OP_BASENAME = "cutlass_sm90_block_gemm"
OP_NAME = f"fp8_backends::{OP_BASENAME}"
#: the op's options after the GEMM arguments (:func:`fp8_backends.core.oplib.gemm_schema`)
OP_OPTIONS = ("str config",)
_F32_BYTES = 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _out_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=256)
def _spec(config: str, out: str) -> build.BlockLibrarySpec:
    return build.BlockLibrarySpec(config, out)


def block_library_for(
    m: int, n: int, k: int, out_dtype: torch.dtype, config: str
) -> tuple[build.BlockLibrarySpec, build.BlockKernelLibrary]:
    """Pick the block config (``auto``: the active block table) and return its spec and loaded library.

    With ``auto``, a first build also builds every other config the table may pick for this output dtype, in
    parallel, so that later batch sizes do not stall on a compile. A name that is not a block config raises
    :class:`~fp8_backends.core.errors.InvalidInputError`.
    """
    table = active_block_table() if config == "auto" else None
    name = table.pick(m, n, k) if table is not None else config
    if name not in BLOCK_CONFIGS:
        raise InvalidInputError(
            f"cutlass: {name!r} is not a block-scaled config (block configs: {', '.join(BLOCK_CONFIGS)}, or auto)"
        )
    out = _out_name(out_dtype)
    spec = _spec(name, out)
    lib = build.loaded(spec)
    if lib is not None:  # the hot path: no list building, no file system
        return spec, lib  # type: ignore[return-value]
    family = [] if table is None else [_spec(c, out) for c in sorted(table.config_names())]
    return spec, build.get_library(spec, also=family)  # type: ignore[return-value]


def prepare_block_scale(w_scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weight's block scales as the kernels read them: fp32 ``[ceil(N/128), ceil(K/128)]`` row-major (K-major),
    converted once at load time (a bf16 checkpoint scale becomes fp32; an fp32 contiguous one is kept as it is)."""
    import torch

    want = (_ceil_div(n, WEIGHT_BLOCK[0]), _ceil_div(k, WEIGHT_BLOCK[1]))
    if tuple(w_scale.shape) != want:
        raise InvalidInputError(
            f"cutlass: block weight scales must have shape [ceil(N/{WEIGHT_BLOCK[0]}), ceil(K/{WEIGHT_BLOCK[1]})] = "
            f"{list(want)} for N={n}, K={k}; got {list(w_scale.shape)}"
        )
    if w_scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidInputError(f"cutlass: block weight scales must be fp32 (or bf16 / fp16), got {w_scale.dtype}")
    scale = w_scale.to(torch.float32).contiguous()
    if scale.data_ptr() % _F32_BYTES:
        scale = scale.clone()
    return scale


_copy_logged = False


def _log_copy_once(reason: str) -> None:
    global _copy_logged
    if not _copy_logged:
        _copy_logged = True
        logger.info(
            "cutlass: block GEMM activation scales %s: copied into the m_major_tma layout at each call (quantize "
            "with scale_layout='m_major_tma' for the cutlass provider to avoid the copy)", reason
        )


def _storage_floats(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes() // _F32_BYTES - t.storage_offset()


def act_scale_operand(x_scale: torch.Tensor, m: int, kb: int, tma: bool) -> tuple[torch.Tensor, int]:
    """``(tensor, ld)`` of the activation scales ``x_scale [M, Kb]`` as a config reads them: M-major, token ``t`` of
    group ``kb`` at ``tensor.data_ptr() + 4·(kb·ld + t)``. ``x_scale`` itself when its layout serves the config
    (M-major; for a TMA config also ``ld % 4 == 0``, a 16-byte aligned pointer and storage for the padding rows), else
    a fresh ``[Kb, round_up(M, 4)]`` copy (logged once)."""
    import torch

    s_m, s_k = x_scale.stride()
    if m == 1 or s_m == 1:
        ld = s_k if kb > 1 else (round_up(m, 4) if tma else m)
        if tma:
            rows = round_up(m, 4)
            if (ld % 4 == 0 and ld >= m and x_scale.data_ptr() % _TMA_ALIGN == 0
                    and (rows == m or _storage_floats(x_scale) >= (kb - 1) * ld + rows)):
                return x_scale, ld
            reason = f"strides {(s_m, s_k)} are M-major but not padded to 4 rows (M={m}), which this config needs"
        elif ld >= m:
            return x_scale, ld
        else:
            reason = f"strides {(s_m, s_k)} overlap"
    else:
        reason = f"strides {(s_m, s_k)} are not M-major"
    _log_copy_once(reason)
    rows = round_up(m, 4)
    buf = torch.empty((kb, rows), dtype=torch.float32, device=x_scale.device)
    buf[:, :m].copy_(x_scale.t())
    return buf, rows


def _weight_scale_operand(w_scale: torch.Tensor, nb: int, kb: int) -> tuple[torch.Tensor, int]:
    if w_scale.stride(1) == 1 or kb == 1:
        ld = w_scale.stride(0) if nb > 1 else kb
        if ld >= kb:
            return w_scale, ld
    w_scale = w_scale.contiguous()
    return w_scale, kb


def _register_native(native: native_op.NativeOp, spec: build.BlockLibrarySpec, lib: build.BlockKernelLibrary,
                     n: int, k: int, config: str) -> None:
    """Tell the C++ op about ``lib`` and, for ``config=auto``, the block table's M buckets of ``N x K`` (read now)."""
    native_op.register_loaded_block(native, spec, lib, BLOCK_CONFIGS[spec.config].stream_k)
    if config == "auto":
        table = active_block_table()
        native.note(("block buckets", n, k, id(table)),
                    lambda: native.register_block_buckets(n, k, table.buckets_for(n, k)))


def _run(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: str,
) -> torch.Tensor:
    import torch

    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    kb = _ceil_div(k, GROUP_K)
    nb = _ceil_div(n, WEIGHT_BLOCK[0])
    f32, e4m3 = torch.float32, torch.float8_e4m3fn
    if x.dtype != e4m3 or w.dtype != e4m3 or x_scale.dtype != f32 or w_scale.dtype != f32 or w.shape[1] != k:
        raise InvalidInputError(
            f"cutlass block GEMM: x [M, K] and w [N, K] float8_e4m3fn, both scales fp32; got x {x.dtype} "
            f"{list(x.shape)}, w {w.dtype} {list(w.shape)}, x_scale {x_scale.dtype}, w_scale {w_scale.dtype}"
        )
    if tuple(x_scale.shape) != (m, kb) or tuple(w_scale.shape) != (nb, kb):
        raise InvalidInputError(
            f"cutlass block GEMM: x_scale must be [M, ceil(K/{GROUP_K})] = [{m}, {kb}] and w_scale "
            f"[ceil(N/{WEIGHT_BLOCK[0]}), ceil(K/{WEIGHT_BLOCK[1]})] = [{nb}, {kb}]; got {list(x_scale.shape)} and "
            f"{list(w_scale.shape)}"
        )
    spec, lib = block_library_for(m, n, k, out_dtype, config)
    native = native_op.loaded()
    if native is not None:  # the C++ op handed this call over: let it serve the next ones itself
        _register_native(native, spec, lib, n, k, config)
    _check_aligned(x, "x_q")
    _check_aligned(w, "the weight")
    guard = torch.cuda.device(x.device) if x.device.index != torch.cuda.current_device() else None
    if guard is not None:
        guard.__enter__()
    try:
        xs, x_ld = act_scale_operand(x_scale, m, kb, lib.act_scale_tma)
        ws, w_ld = _weight_scale_operand(w_scale, nb, kb)
        ws_bytes = int(lib.workspace_size(m, n, k)) if BLOCK_CONFIGS[spec.config].stream_k else 0
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=x.device) if ws_bytes else None
        rc = lib.gemm(
            x.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            xs.data_ptr(),
            x_ld,
            ws.data_ptr(),
            w_ld,
            None if bias is None else bias.data_ptr(),
            None if workspace is None else workspace.data_ptr(),
            ws_bytes,
            torch.cuda.current_stream(x.device).cuda_stream,
        )
    finally:
        if guard is not None:
            guard.__exit__(None, None, None)
    if rc != 0:
        what = build.BLOCK_RETURN_CODES.get(rc, "unknown error")
        raise CutlassKernelError(
            f"cutlass {spec.name}: fp8b_block_gemm returned {rc} ({what}) for M={m} N={n} K={k}"
        )
    return out


_OPS = LazyOps({OP_BASENAME: (gemm_schema(OP_BASENAME, *OP_OPTIONS), _run, gemm_fake)}, ("CUDA",))


def load_op() -> Any:
    """The op's OpOverload, defined now with its hot-path callable (load time, never inside ``torch.compile``
    tracing: :meth:`fp8_backends.core.oplib.LazyOps.preload`)."""
    _OPS.preload()
    return _OPS.op(OP_BASENAME)


def cutlass_block_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: str = "auto",
) -> torch.Tensor:
    """``out[M, N]`` of the block-scaled GEMM through the custom op (see the module docstring for the formula).

    - ``x: [M, K]``, ``w: [N, K]``: float8_e4m3fn, row-major, CUDA, 16-byte aligned; K % 16 == 0, N % 8 == 0
      (N % 4 for fp32 output).
    - ``x_scale: [M, ceil(K/128)]`` fp32, any strides (M-major padded to 4 rows is read without a copy).
    - ``w_scale: [ceil(N/128), ceil(K/128)]`` fp32 (:func:`prepare_block_scale` converts a checkpoint's).
    - ``bias``: ``[N]`` in ``out_dtype`` or ``None``; ``out_dtype``: bf16 (default), fp16 or fp32.
    - ``config``: ``auto`` or a name of :data:`.block_configs.BLOCK_CONFIGS`.
    """
    import torch

    return _OPS.call(OP_BASENAME)(x, w, x_scale, w_scale, bias, out_dtype or torch.bfloat16, config)


__all__ = [
    "OP_NAME",
    "act_scale_operand",
    "block_library_for",
    "cutlass_block_gemm",
    "load_op",
    "prepare_block_scale",
]
