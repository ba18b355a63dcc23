"""Block-wise FP8 through torch: ``torch._scaled_mm``'s cuBLASLt block-scaled GEMM on CUDA, torch ops on the CPU.

The ``torch_scaled_mm`` provider serves per-token-group activations (groups of 128 along K) times 128x128 weight
blocks here:

- CUDA: ``torch._scaled_mm(x_q, w_q.t(), scale_a, scale_b)`` with ``scale_a [M, ceil(K/128)]`` M-major (strides
  ``(1, M)``) and ``scale_b`` the ``[ceil(K/128), ceil(N/128)]`` transpose of the row-major block grid (some torch
  builds want that grid's rows padded to a multiple of 4: :func:`cuda_block_support` finds which by computing with
  both; where neither computes right, weights whose ``ceil(K/128)`` is not a multiple of 4 are refused with that
  reason).
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
from typing import TYPE_CHECKING, Any, NamedTuple

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


#: the probes' bound on the relative error against the dequantized fp32 product (bf16 output: ~1e-3)
_PROBE_TOL = 1e-2


class BlockSupport(NamedTuple):
    """What this torch's ``_scaled_mm`` computes right with block scales on a device (:func:`cuda_block_support`).

    ``padded``: the weight-scale form to prepare (:func:`prepare_scale`'s ``padded_rows``), None where the mode is not
    served at all (``why`` says what failed); ``ragged``: whether weights whose ``ceil(K/128)`` is not a multiple of 4
    compute right (``ragged_why`` says what failed where not)."""

    padded: bool | None
    ragged: bool
    why: str = ""
    ragged_why: str = ""

    def reason_for(self, k: int) -> str | None:
        """Why a weight of ``K`` columns cannot be served here, or None."""
        if self.padded is None:
            return self.why
        kb = -(-k // 128)
        if kb % M_ALIGN and not self.ragged:
            return (f"ceil(K/128)={kb} is not a multiple of {M_ALIGN}: this torch's _scaled_mm does not compute block "
                    f"scales right there ({self.ragged_why})")
        return None


def _probe(device: Any, k: int, padded: bool) -> tuple[float | None, str]:
    """One 8 x 256 x ``k`` block-scaled call with distinct scales per group and block: its relative error against
    the dequantized fp32 product, or ``(None, why)`` where torch refuses it."""
    import torch

    m, n = 8, 256
    gen = torch.Generator(device="cpu").manual_seed(k)
    x = (torch.randn((m, k), generator=gen) * 8).to(torch.float8_e4m3fn).to(device)
    w = (torch.randn((n, k), generator=gen) * 8).to(torch.float8_e4m3fn).to(device)
    x_groups = torch.rand((m, k // 128), generator=gen).add_(0.5).to(device)
    grid = torch.rand((n // 128, k // 128), generator=gen).add_(0.5).to(device)
    ref = ((x.float() * x_groups.repeat_interleave(128, 1))
           @ (w.float() * grid.repeat_interleave(128, 0).repeat_interleave(128, 1)).t())
    try:
        y = torch._scaled_mm(x, w.t(), scale_a=x_groups.t().contiguous().t(), scale_b=prepare_scale(grid, padded),
                             out_dtype=torch.bfloat16)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError / NotImplementedError by build
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return float(((y.float() - ref).norm() / ref.norm()).item()), ""


@functools.cache
def cuda_block_support(device_index: int) -> BlockSupport:
    """Whether and how this torch's ``_scaled_mm`` serves 1x128 x 128x128 block scales on the device, found by
    computing (capability, not version strings), once per device and process (at the first resolution of a block
    problem there): an 8 x 256 x 512 call (4 column blocks, where the weight-scale grid's two forms coincide) checked
    against the dequantized fp32 product, then 8 x 256 x 384 (3 column blocks) with the grid's rows unpadded and
    padded to 4. cuBLASLt reads the grid with its rows padded to 4 columns: a form it accepts but reads differently
    computes wrong numbers wherever ``ceil(K/128)`` is not a multiple of 4 (on the H200 with torch 2.11 the unpadded
    form is accepted and wrong there, the padded one refused), so only a form that computes right counts."""
    import torch

    device = torch.device("cuda", device_index)
    try:
        err, refused = _probe(device, 512, False)
    except Exception as exc:  # noqa: BLE001 - no usable device: the reason says so
        return BlockSupport(None, False, f"cannot run a probe on cuda:{device_index} ({type(exc).__name__}: {exc})")
    if err is None or err >= _PROBE_TOL:
        why = refused or f"relative error {err:.3g}"
        return BlockSupport(None, False, f"this torch's _scaled_mm did not compute 1x128 x 128x128 block scales right "
                                         f"here ({why[:300]}); cuBLASLt serves them on SM 9.0 from CUDA 12.9")
    failed = []
    for padded in (False, True):
        err, refused = _probe(device, 384, padded)
        if err is not None and err < _PROBE_TOL:
            logger.debug("torch_scaled_mm: cuBLASLt block scales served on cuda:%d (padded grid rows: %s)",
                         device_index, padded)
            return BlockSupport(padded, True)
        form = "padded" if padded else "unpadded"
        failed.append(f"{form} scale rows: {refused[:150]}" if err is None else f"{form} scale rows: relative error "
                      f"{err:.3g}")
    logger.debug("torch_scaled_mm: block scales on cuda:%d only where ceil(K/128) is a multiple of 4 (%s)",
                 device_index, "; ".join(failed))
    return BlockSupport(False, False, ragged_why="; ".join(failed))


__all__ = ["M_ALIGN", "OP_NAME", "BlockSupport", "cpu_gemm", "cuda_block_support", "cuda_gemm", "load_op",
           "prepare_scale", "traced_gemm", "traced_support"]
