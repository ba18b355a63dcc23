"""Per-token-group activation scales ``[M, G]`` in the layouts kernels read (:class:`~.types.ScaleLayout`).

A quantizer writes the layout its consumer reads (:func:`empty_group_scale`), so a layer's call never transposes
scales; :func:`to_layout` converts a scale that arrives in another layout (one small copy, for direct callers of a
provider's ``gemm`` with scales made elsewhere). Metadata only: nothing here syncs with the device.

Layouts of a ``[M, G]`` fp32 scale (``G = ceil(K / group_size)``):

- ``row_major``: strides ``(G, 1)``; ``[m, g]`` at ``m * G + g``.
- ``m_major``: strides ``(1, M)``: a ``[G, M]`` contiguous buffer seen transposed.
- ``m_major_tma``: strides ``(1, ceil(M / 4) * 4)``: a ``[G, ceil(M/4)*4]`` buffer, its first ``M`` columns seen
  transposed (16-byte aligned columns for TMA).

A dimension of size 1 has no meaningful stride, so a ``[M, 1]`` or ``[1, G]`` scale is in every layout whose other
stride rule it meets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .types import ScaleLayout

if TYPE_CHECKING:
    import torch

#: the column stride of an ``m_major_tma`` scale of ``m`` tokens: ``m`` rounded up to a multiple of 4
TMA_ALIGN = 4


def tma_stride(m: int) -> int:
    """``m`` rounded up to a multiple of :data:`TMA_ALIGN` (at least 1)."""
    return max(1, -(-m // TMA_ALIGN) * TMA_ALIGN)


def is_layout(scale: torch.Tensor, layout: ScaleLayout) -> bool:
    """Whether the 2-D ``scale [M, G]`` is laid out as ``layout`` (strides of size-1 dimensions ignored; an empty
    scale, no tokens or no groups, is in every layout)."""
    m, g = scale.shape
    if m == 0 or g == 0:
        return True
    s0, s1 = scale.stride()
    if layout is ScaleLayout.ROW_MAJOR:
        return (g <= 1 or s1 == 1) and (m <= 1 or s0 == g)
    lead = m if layout is ScaleLayout.M_MAJOR else tma_stride(m)
    return (m <= 1 or s0 == 1) and (g <= 1 or s1 == lead)


def empty_group_scale_buffer(m: int, groups: int, layout: ScaleLayout,
                             device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buffer, scale)``: an uninitialised contiguous fp32 buffer and the ``[m, groups]`` scale in ``layout`` that
    views it from its first element (the buffer itself for ``row_major``). A kernel traced into a compiled graph
    should be handed the buffer (with the scale's strides): a kernel that writes a view is recorded as writing a copy
    of it, which Inductor then copies back into the buffer (two more kernels for a padded ``m_major_tma`` view)."""
    import torch

    if layout is ScaleLayout.ROW_MAJOR:
        buffer = torch.empty((m, groups), dtype=torch.float32, device=device)
        return buffer, buffer
    lead = m if layout is ScaleLayout.M_MAJOR else tma_stride(m)
    buffer = torch.empty((groups, lead), dtype=torch.float32, device=device)
    return buffer, buffer[:, :m].t()


def empty_group_scale(m: int, groups: int, layout: ScaleLayout, device: torch.device | str) -> torch.Tensor:
    """An uninitialised fp32 ``[m, groups]`` scale in ``layout``."""
    return empty_group_scale_buffer(m, groups, layout, device)[1]


def to_layout(scale: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """``scale`` itself when it is in ``layout``, else a copy in it."""
    if is_layout(scale, layout):
        return scale
    out = empty_group_scale(scale.shape[0], scale.shape[1], layout, scale.device)
    out.copy_(scale)
    return out


__all__ = ["TMA_ALIGN", "empty_group_scale", "empty_group_scale_buffer", "is_layout", "tma_stride", "to_layout"]
