"""Zero padding of FP8 operands to 16-byte aligned rows, for kernels that need them.

Rows of an FP8 ``[N, K]`` weight or ``[M, K]`` activation whose byte length is not a multiple of 16 cannot be read
with vector loads (every load becomes a byte load) nor addressed by TMA, and cuBLASLt refuses them. A provider that
serves such shapes pads: the weight once, at ``prepare_weight`` (:func:`pad_weight`: ``[N16, K16]`` zeros around the
codes, :attr:`~fp8_backends.core.types.PreparedWeight.k_pad` records the padded K), and the activation per call to
the same K (zeros add nothing to a dot product). Layers quantize their own activations straight into the padded
width (:func:`fp8_backends.quant.padded_quantizer`), so the pad costs no launch of its own; an activation that
arrives already quantized is padded by :func:`pad_columns`. A padded N is cut off the output as a column view.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the row alignment, in FP8 elements (bytes), that vector loads, TMA and cuBLASLt want
ROW_ALIGN = 16


#: the multiple a padded dimension of at least :data:`TILE_PAD_MIN` is rounded up to instead: GEMM libraries pick their
#: kernels by shape, and an N or K of 3424 / 6848 (16-aligned) ran 6-14% slower in cuBLASLt than the 3456 / 6912 it
#: fits in (bench/results/unaligned/2026-12-03-h200-layers/); at these sizes the extra bytes are at most 6%
TILE_PAD = 128
TILE_PAD_MIN = 2048


def padded_size(size: int) -> int:
    """The size a padding provider pads a dimension of ``size`` to: :data:`TILE_PAD` multiples from
    :data:`TILE_PAD_MIN` on, :data:`ROW_ALIGN` multiples below (``size`` itself when already 16-aligned)."""
    if size % ROW_ALIGN == 0:
        return size
    return round_up(size, TILE_PAD if size >= TILE_PAD_MIN else ROW_ALIGN)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def pad_weight(w_q: torch.Tensor, n_pad: int, k_pad: int) -> torch.Tensor:
    """``w_q [N, K]`` (float8) as a new row-major ``[n_pad, k_pad]`` tensor, zeros beyond ``N`` rows and ``K``
    columns (load time: one copy of the weight)."""
    n, k = w_q.shape
    padded = w_q.new_zeros((n_pad, k_pad))
    padded[:n, :k] = w_q
    return padded


def pad_columns(x_q: torch.Tensor, k_pad: int) -> torch.Tensor:
    """``x_q [M, K]`` (float8) zero-padded to a new row-major ``[M, k_pad]``. float8 has no pad kernel of its own:
    eagerly the bytes are padded as the widest integer that divides K (a quarter or an eighth of the elements for the
    pad kernel to index: K = 3420 pads as int32, 6840 as int64); under ``torch.compile`` as bytes, which Inductor
    writes in a kernel of its own (or fuses into the quantization that produces ``x_q``)."""
    import torch

    k = x_q.shape[1]
    raw = (x_q if x_q.is_contiguous() else x_q.contiguous()).view(torch.uint8)
    if not torch.compiler.is_compiling() and raw.storage_offset() % 8 == 0:
        for wide, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            if k % size == 0:
                padded = torch.nn.functional.pad(raw.view(wide), (0, (k_pad - k) // size))
                return padded.view(torch.uint8).view(x_q.dtype)
    return torch.nn.functional.pad(raw, (0, k_pad - k)).view(x_q.dtype)


def match_k(x_q: torch.Tensor, k_pad: int | None) -> torch.Tensor:
    """``x_q`` as the kernel of a weight padded to ``k_pad`` reads it: as it is when it already has that width (a
    layer's quantizer wrote it padded) or no pad applies (``k_pad`` None), else :func:`pad_columns`."""
    if k_pad is None or x_q.shape[1] == k_pad:
        return x_q
    return pad_columns(x_q, k_pad)


__all__ = ["ROW_ALIGN", "TILE_PAD", "TILE_PAD_MIN", "match_k", "pad_columns", "pad_weight", "padded_size", "round_up"]
