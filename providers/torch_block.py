"""Block-wise FP8 through torch: ``torch._scaled_mm``'s cuBLASLt block-scaled GEMM on CUDA, torch ops on the CPU.

The ``torch_scaled_mm`` provider serves per-token-group activations (groups of 128 along K) times 128x128 weight
blocks here:

- CUDA: ``torch._scaled_mm(x_q, w_q.t(), scale_a, scale_b)`` with ``scale_a [M, ceil(K/128)]`` M-major (strides
  ``(1, M)``) and ``scale_b`` the ``[ceil(K/128), ceil(N/128)]`` transpose of the row-major block grid (some torch
  builds want that grid's rows padded to a multiple of 4: :func:`cuda_block_support` finds which by trying both).
  cuBLASLt wants M-major activation-scale columns 16-byte aligned, so a batch whose M is not a multiple of 4 is
  padded to the next one (a copy of at most 3 rows of ``x_q`` and its scales; the output keeps M rows). Whether
  this torch and cuBLAS(Lt) serve the mode is found by calling it once per device (capability, not version
  strings). An eager call is the op ``fp8_backends::scaled_mm_block``. Under ``torch.compile`` the same torch code
  (:func:`traced_gemm`) is traced where this torch's own meta function knows block scales (:func:`traced_support`,
  asked once at load time): Inductor then calls ``torch._scaled_mm`` from its generated code, ~22 µs of host time
  less per call than the op's Python body (H200, torch 2.11: 80 against 102-110 µs for a compiled 512 x 6144 x 4096
  call, ``bench/results/compiled_host/2026-12-04-h200-scaled-mm-block/``); elsewhere the op (a fake implementation
  gives ``torch.compile`` its shape).
- CPU: each operand is dequantized by its scales in fp32 and multiplied with ``torch.matmul`` (the reference's
  arithmetic); slow, for tests and CPU-only machines.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

from fp8_backends.core.oplib import LazyOps

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("fp8_backends")

OP_NAME = "scaled_mm_block"
_SCHEMA = (f"{OP_NAME}(Tensor x, Tensor w_t, Tensor x_scale, Tensor w_scale_t, Tensor? bias, ScalarType out_dtype)"
           " -> Tensor")
#: cuBLASLt's column alignment of M-major activation scales (in rows of M)
M_ALIGN = 4


def _run(x: torch.Tensor, w_t: torch.Tensor, x_scale: torch.Tensor, w_scale_t: torch.Tensor,
         bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The call (torch ops only): M padded to a multiple of :data:`M_ALIGN` where it is not, ``torch._scaled_mm``,
    the output's first M rows, + bias."""
    import torch

    m = x.shape[0]
    if m % M_ALIGN:
        pad = M_ALIGN - m % M_ALIGN
        x = torch.cat((x, x.new_zeros((pad, x.shape[1]))))
        padded = x_scale.new_ones((x_scale.shape[1], m + pad))
        padded[:, :m].copy_(x_scale.t())
        x_scale = padded.t()
    y = torch._scaled_mm(x, w_t, scale_a=x_scale, scale_b=w_scale_t, out_dtype=out_dtype)
    if y.shape[0] != m:
        y = y[:m]
    if bias is not None:
        y = y + bias
    return y


def _fake(x: Any, w_t: Any, x_scale: Any, w_scale_t: Any, bias: Any, out_dtype: Any) -> Any:
    return x.new_empty((x.shape[0], w_t.shape[1]), dtype=out_dtype)


_OPS = LazyOps({OP_NAME: (_SCHEMA, _run, _fake)}, ("CUDA",))


def load_op() -> Any:
    """Define the op (load time, never inside ``torch.compile`` tracing)."""
    _OPS.preload()
    return _OPS.op(OP_NAME)


def cuda_gemm(x_q: torch.Tensor, w_t: torch.Tensor, x_scale: torch.Tensor, w_scale_t: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``y [M, N]`` through cuBLASLt: ``x_q [M, K]`` e4m3 row-major, ``w_t [K, N]`` (the ``[N, K]`` weight's
    transpose), ``x_scale [M, Kb]`` M-major, ``w_scale_t [Kb, Nb]`` (what :func:`prepare_scale` made)."""
    return _OPS.call(OP_NAME)(x_q, w_t, x_scale, w_scale_t, bias, out_dtype)


#: whether this torch's ``_scaled_mm`` meta function serves block scales (:func:`traced_support`); None: not asked
_traced: list[bool | None] = [None]


def traced_support(padded_rows: bool) -> bool:
    """Whether ``torch.compile`` can trace ``torch._scaled_mm`` with 1x128 x 128x128 block scales here (the weight's
    block grid as :func:`prepare_scale` lays it out with ``padded_rows``): its meta function, run once on fake CUDA
    tensors (load time: a provider preparing a block weight asks). Cached: the first answer stands for the process."""
    if _traced[0] is None:
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        try:
            with FakeTensorMode():
                x = torch.empty((8, 256), dtype=torch.float8_e4m3fn, device="cuda")
                w_t = torch.empty((128, 256), dtype=torch.float8_e4m3fn, device="cuda").t()
                x_scale = torch.empty((2, 8), device="cuda").t()
                grid = prepare_scale(torch.empty((1, 2), device="cuda"), padded_rows)
                y = torch._scaled_mm(x, w_t, scale_a=x_scale, scale_b=grid, out_dtype=torch.bfloat16)
            _traced[0] = tuple(y.shape) == (8, 128)
        except Exception as exc:  # noqa: BLE001 - a torch build whose meta knows no block scales (or no CUDA)
            logger.debug("torch_scaled_mm: torch.compile traces the block op (its meta: %s: %s)",
                         type(exc).__name__, exc)
            _traced[0] = False
    return bool(_traced[0])


def traced_gemm(x_q: torch.Tensor, w_t: torch.Tensor, x_scale: torch.Tensor, w_scale_t: torch.Tensor,
                bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`cuda_gemm` as ``torch.compile`` traces it: the torch code itself where :func:`traced_support` said so
    at load time (Inductor calls ``torch._scaled_mm``; an M not a multiple of 4 is padded by torch ops), else the op."""
    if _traced[0]:
        return _run(x_q, w_t, x_scale, w_scale_t, bias, out_dtype)
    return cuda_gemm(x_q, w_t, x_scale, w_scale_t, bias, out_dtype)


def cpu_gemm(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None, out_dtype: torch.dtype, group_size: int,
             block: tuple[int, int]) -> torch.Tensor:
    """The CPU path: fp32 dequantization of both operands by their group / block scales, fp32 matmul, + bias."""
    from fp8_backends.core import reference

    return reference.fp8_gemm(x_q, w_q, x_scale, w_scale, out_dtype, bias, group_size=group_size,
                              weight_block=block)


def prepare_scale(w_scale: torch.Tensor, padded_rows: bool) -> torch.Tensor:
    """The weight's ``[Nb, Kb]`` fp32 block grid as ``_scaled_mm`` takes ``scale_b``: its ``[Kb, Nb]`` transpose,
    from a buffer whose rows are padded to a multiple of 4 when ``padded_rows`` (once, at load time)."""
    import torch

    nb, kb = w_scale.shape
    if not padded_rows:
        return w_scale.contiguous().t()
    lead = -(-kb // M_ALIGN) * M_ALIGN
    buf = torch.ones((nb, lead), dtype=torch.float32, device=w_scale.device)
    buf[:, :kb].copy_(w_scale)
    return buf[:, :kb].t()


@functools.cache
def cuda_block_support(device_index: int) -> tuple[bool | None, str]:
    """``(padded_rows, "")`` when this torch's ``_scaled_mm`` serves 1x128 x 128x128 block scales on the device
    (``padded_rows``: the weight's block grid must have its rows padded to a multiple of 4), else ``(None, why)``.
    One 128x128x256 call per scale form, once per device and process (at the first resolution of a block problem
    there)."""
    import torch

    device = torch.device("cuda", device_index)
    errors = []
    try:
        x = torch.ones((M_ALIGN * 32, 256), device=device).to(torch.float8_e4m3fn)
        w = torch.ones((128, 256), device=device).to(torch.float8_e4m3fn)
        x_scale = torch.ones((2, x.shape[0]), device=device).t()
        grid = torch.ones((1, 2), device=device)
    except Exception as exc:  # noqa: BLE001 - no usable device: the reason says so
        return None, f"cannot allocate on cuda:{device_index} ({type(exc).__name__}: {exc})"
    for padded in (False, True):
        try:
            y = torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=prepare_scale(grid, padded),
                                 out_dtype=torch.bfloat16)
            torch.cuda.synchronize(device)
            if y.shape == (x.shape[0], 128):
                logger.debug("torch_scaled_mm: cuBLASLt block scales served on cuda:%d (padded grid rows: %s)",
                             device_index, padded)
                return padded, ""
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError / NotImplementedError by build
            errors.append(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return None, ("this torch's _scaled_mm refused 1x128 x 128x128 block scales here (" + "; ".join(errors)[:300]
                  + "); cuBLASLt serves them on SM 9.0 from CUDA 12.9")


__all__ = ["M_ALIGN", "OP_NAME", "cpu_gemm", "cuda_block_support", "cuda_gemm", "load_op", "prepare_scale",
           "traced_gemm", "traced_support"]
