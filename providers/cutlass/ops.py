"""The torch side of the CUTLASS provider: the ``fp8_backends::cutlass_sm90_gemm`` custom op.

The op is defined lazily (first call of :func:`cutlass_gemm`, through
:func:`fp8_backends.core.oplib.define_ops`), with a fake implementation so that torch.compile traces it
without running it. Its real implementation picks the config (``auto``: the
M-bucket table, at run time, so compiled graphs carry no M guards), gets the library (building it on
first use), allocates the output (and a stream-K workspace where the config needs one) and calls
``fp8b_gemm`` through ctypes on torch's current stream. No host-device synchronisation.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from fp8_backends.core.errors import Fp8BackendError, InvalidInputError
from fp8_backends.core.oplib import LazyOps, gemm_fake, gemm_schema

from . import build, native_op
from .configs import CONFIGS, active_table

if TYPE_CHECKING:
    import torch

OP_BASENAME = "cutlass_sm90_gemm"
OP_NAME = f"fp8_backends::{OP_BASENAME}"
#: the op's options after the GEMM arguments (:func:`fp8_backends.core.oplib.gemm_schema`)
OP_OPTIONS = ("str config", "bool fast_accum")
_TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned global addresses


class CutlassKernelError(Fp8BackendError, RuntimeError):
    """``fp8b_gemm`` refused or failed to launch (the message names the return code)."""


def _out_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def library_for(
    m: int, n: int, k: int, per_vector: bool, out_dtype: torch.dtype, config: str, fast_accum: bool
) -> tuple[build.LibrarySpec, build.KernelLibrary]:
    """Pick the config (``auto``: the active table) and return its spec and loaded library.

    With ``auto``, a first build also builds every other config the table may pick for this family, in
    parallel, so that later batch sizes do not stall on a compile.
    """
    epilogue = "rowwise" if per_vector else "tensor"
    out = _out_name(out_dtype)
    table = active_table() if config == "auto" else None
    name = table.pick(m, n, k) if table is not None else config
    spec = _spec(name, epilogue, out, fast_accum)
    lib = build.loaded(spec)
    if lib is not None:  # the hot path: no list building, no file system
        return spec, lib
    family = [] if table is None else [_spec(c, epilogue, out, fast_accum) for c in sorted(table.config_names())]
    return spec, build.get_library(spec, also=family)


@functools.lru_cache(maxsize=512)
def _spec(config: str, epilogue: str, out: str, fast_accum: bool) -> build.LibrarySpec:
    return build.LibrarySpec(config, epilogue, out, fast_accum)


def _register_native(native: native_op.NativeOp, spec: build.LibrarySpec, lib: build.KernelLibrary, n: int, k: int,
                     config: str) -> None:
    """Tell the C++ op (:mod:`.native_op`) about ``lib`` and, for ``config=auto``, the M buckets of ``N x K`` in the
    active table (read now: a table file changed later reaches the C++ op after :meth:`NativeOp.reset`)."""
    native_op.register_loaded(native, [(spec, lib)], lambda name: CONFIGS[name].stream_k)
    if config == "auto":
        table = active_table()
        native.note(("buckets", n, k, id(table)), lambda: native.register_buckets(n, k, table.buckets_for(n, k)))


def _check_aligned(t: torch.Tensor, what: str) -> None:
    if t.data_ptr() % _TMA_ALIGN:
        raise InvalidInputError(
            f"cutlass needs {what} 16-byte aligned (TMA); its data pointer is {t.data_ptr():#x} "
            "(a view at an odd offset): pass a tensor that starts its own allocation"
        )


def _run(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: str,
    fast_accum: bool,
) -> torch.Tensor:
    import torch

    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    x_vec = x_scale.numel() > 1
    w_vec = w_scale.numel() > 1
    spec, lib = library_for(m, n, k, x_vec or w_vec, out_dtype, config, fast_accum)
    native = native_op.loaded()
    if native is not None:  # the C++ op handed this call over: let it serve the next ones itself
        _register_native(native, spec, lib, n, k, config)
    _check_aligned(x, "x_q")
    _check_aligned(w, "the weight")
    guard = torch.cuda.device(x.device) if x.device.index != torch.cuda.current_device() else None
    if guard is not None:
        guard.__enter__()
    try:
        ws_bytes = int(lib.workspace_size(m, n, k)) if CONFIGS[spec.config].stream_k else 0
        workspace = torch.empty(ws_bytes, dtype=torch.uint8, device=x.device) if ws_bytes else None
        rc = lib.gemm(
            x.data_ptr(),
            w.data_ptr(),
            out.data_ptr(),
            m,
            n,
            k,
            x_scale.data_ptr(),
            int(x_vec),
            w_scale.data_ptr(),
            int(w_vec),
            None if bias is None else bias.data_ptr(),
            None if workspace is None else workspace.data_ptr(),
            ws_bytes,
            torch.cuda.current_stream(x.device).cuda_stream,
        )
    finally:
        if guard is not None:
            guard.__exit__(None, None, None)
    if rc != 0:
        what = build.RETURN_CODES.get(rc, "unknown error")
        raise CutlassKernelError(f"cutlass {spec.name}: fp8b_gemm returned {rc} ({what}) for M={m} N={n} K={k}")
    return out


_OPS = LazyOps({OP_BASENAME: (gemm_schema(OP_BASENAME, *OP_OPTIONS), _run, gemm_fake)}, ("CUDA",))


def load_op() -> Any:
    """The op's OpOverload (what the provider's ``load_op`` returns), defined now with its hot-path callable
    (:meth:`fp8_backends.core.oplib.LazyOps.preload`: load time, never inside ``torch.compile`` tracing)."""
    _OPS.preload()
    return _OPS.op(OP_BASENAME)


def cutlass_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: str = "auto",
    fast_accum: bool = True,
) -> torch.Tensor:
    """``out[M, N] = x_scale * w_scale * (x @ wᵀ) (+ bias)`` through the custom op.

    ``x: [M, K]`` and ``w: [N, K]`` float8_e4m3fn row-major CUDA tensors (16-byte aligned); ``x_scale``
    fp32 one value or ``[M, 1]`` contiguous; ``w_scale`` fp32 ``[1]`` or ``[N]`` contiguous; ``bias``
    ``[N]`` in ``out_dtype`` (bf16, fp16 or fp32) or ``None``. Inputs are assumed validated.
    """
    return _OPS.call(OP_BASENAME)(x, w, x_scale, w_scale, bias, out_dtype, config, fast_accum)


__all__ = ["OP_NAME", "CutlassKernelError", "cutlass_gemm", "library_for", "load_op"]
