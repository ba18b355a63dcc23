"""What a block GEMM point is read against beside bf16: the least time any kernel of the point can take on this GPU,
timed with the same CUDA-graph timer in the same rounds (``python -m bench.block_gemm --bounds``).

- ``bound:launch``: one Triton program that writes one int32 word: the cost of a kernel node in a CUDA graph, below
  which no launch goes however little it reads;
- ``bound:weight_read`` / ``bound:weight_read_64k``: one pass over the point's fp8 weight (``N x K`` bytes read as
  int32 words, 16 KiB / 64 KiB a program, each program's words xor-reduced into one output word, nothing else
  written): the least a GEMM that reads its weight once can take, launch and ramp included; the better of the two
  (:func:`bench.block_gemm.best_read`) is the weight-read floor's share that is reachable at all at this size;
- ``bound:fp8_tensor``: ``torch._scaled_mm`` of the same fp8 operands with one scale per tensor and fast accumulation
  (cuBLASLt, CUDA only): the FP8 GEMM without the work block scales add (a scale per 128-column group of every output
  tile, fp32 promotion), so the block-scaled kernels are not expected to beat it; checked against its own fp32
  reference (``x_q @ w_q.T``);
- ``bound:fp8_tensor_precise``: the same call without fast accumulation (cuBLASLt then promotes the tensor cores'
  partial sums to fp32 along K, as the block kernels do every 128 columns): the per-tensor GEMM with the block
  kernels' accumulation, not a bound but the cost of that accumulation alone.

The per-tensor GEMMs are timed at every M; the launch and the reads, which read nothing of the activation, at
``M <= 16`` (where the weight-read floor is a target).

Shapes, dtypes: the weight copies are ``float8_e4m3fn [N, K]`` contiguous (:class:`bench.block_gemm.GemmData`); a
weight whose byte count is not a multiple of 4 is read as bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

#: int32 words a program of the weight read loads: 16 KiB (``bound:weight_read``), 64 KiB (``..._64k``)
READ_WORDS = 4096
READ_WORDS_LARGE = 16384
READ_WARPS = 8
#: the M up to which the launch and weight-read bounds are timed
READ_MAX_M = 16


@triton.jit
def weight_read_kernel(src, out, n_words, BLOCK: tl.constexpr):
    """Program ``p`` loads words ``[p * BLOCK, (p + 1) * BLOCK)`` of ``src`` and writes their xor to ``out[p]``."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + pid, tl.xor_sum(words, axis=0))


@triton.jit
def launch_kernel(out):
    """One program, one word written: a launch that does nothing else."""
    tl.store(out, 1)


def _words(w: Any) -> Any:
    """The bytes of ``w`` as int32 words (as uint8 where the byte count is not a multiple of 4)."""
    import torch

    flat = w.reshape(-1).view(torch.uint8)
    return flat.view(torch.int32) if flat.numel() % 4 == 0 else flat


def weight_read(weights: list[Any], per_program: int = READ_WORDS) -> Callable[[int], Any]:
    """``call(i)``: one pass over ``weights[i]``'s bytes, ``per_program`` words a program; returns the per-program
    xor words (int32 or uint8)."""
    import torch

    words = [_words(w) for w in weights]
    n = words[0].numel()
    grid = (triton.cdiv(n, per_program),)

    def call(i: int) -> Any:
        out = torch.empty(grid[0], dtype=words[i].dtype, device=words[i].device)
        weight_read_kernel[grid](words[i], out, n, BLOCK=per_program, num_warps=READ_WARPS)
        return out

    return call


def launch_only(device: Any) -> Callable[[int], Any]:
    """``call(i)``: one launch of :func:`launch_kernel` (``i`` ignored)."""
    import torch

    def call(i: int) -> Any:
        out = torch.empty(1, dtype=torch.int32, device=device)
        launch_kernel[(1,)](out, num_warps=1)
        return out

    return call


def fp8_tensor(x_q: Any, weights: list[Any], fast_accum: bool = True
               ) -> tuple[Callable[[int], Any], Callable[[Any], tuple[float, str | None]]]:
    """``(call, check)``: ``torch._scaled_mm`` with unit per-tensor scales (and fast accumulation where
    ``fast_accum``) on ``x_q`` (``[M, K]``) and ``weights[i]`` (``[N, K]``), bf16 out, and the check against
    ``x_q @ weights[0].T`` in fp32 (every copy holds the same values)."""
    import torch

    one = torch.ones((), dtype=torch.float32, device=x_q.device)
    ref = x_q.float() @ weights[0].float().t()
    ref_norm = ref.norm().clamp_min(1e-30)

    def call(i: int) -> Any:
        return torch._scaled_mm(x_q, weights[i].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accum)

    def check(out: Any) -> tuple[float, str | None]:
        err = float(((out.float() - ref).norm() / ref_norm).item())
        return err, (None if err < 1e-2 else f"relative error {err:.3g} >= 0.01")

    return call, check


def bound_runs(x_q: Any, weights: list[Any], m: int) -> dict[str, Any]:
    """The bound variants of a point as :class:`fp8_backends.tuning.timing.Run` s, by label."""
    from fp8_backends.tuning.timing import Run

    runs: dict[str, Any] = {}
    if m <= READ_MAX_M:
        runs["bound:launch"] = Run(launch_only(x_q.device))
        runs["bound:weight_read"] = Run(weight_read(weights), len(weights))
        runs["bound:weight_read_64k"] = Run(weight_read(weights, READ_WORDS_LARGE), len(weights))
    if x_q.is_cuda:
        for label, fast in (("bound:fp8_tensor", True), ("bound:fp8_tensor_precise", False)):
            call, check = fp8_tensor(x_q, weights, fast)
            runs[label] = Run(call, len(weights), check)
    return runs
