"""What one launch of the Triton GEMM is, shared by the eager launcher (:mod:`.gemm_ops`) and the op body
``torch.compile`` traces (:mod:`.traced_ops`): the tile config picked for ``M x N x K``, the kernel of its family, and
the grid with every kernel argument. Pure host arithmetic on shapes and strides (no launch, no device sync); the
kernels' module (and triton) is imported when a kernel is first asked for."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from fp8_backends.core.errors import InvalidInputError

from ._support import GRID_Y_MAX
from .gemm_configs import CONFIGS, TileConfig, active_table

if TYPE_CHECKING:
    import torch


def pick_config(config: str, m: int, n: int, k: int) -> TileConfig:
    """The :class:`TileConfig` for ``config`` (a name, or ``auto``: the active table's pick for M x N x K)."""
    return CONFIGS[active_table().pick(m, n, k) if config == "auto" else config]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def kernel_of(family: str) -> Any:
    """The ``@triton.jit`` kernel of a pointer-kernel family (``mm``, ``swap`` or ``gemv``)."""
    from . import gemm_kernels as K

    return {"mm": K.fp8_gemm_mm_kernel, "swap": K.fp8_gemm_swap_kernel, "gemv": K.fp8_gemv_kernel}[family]


def pointer_kernel_args(cfg: TileConfig, x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor,
                        w_scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                        use_pdl: bool, x_quant: int = 0) -> tuple[tuple[int, ...], tuple[Any, ...]]:
    """``(grid, args)`` of ``cfg``'s kernel (family ``mm``, ``swap`` or ``gemv``): every parameter in
    declaration order, constexprs included, as :func:`.launcher.launch` takes them. ``x_quant`` (``swap`` and
    ``gemv``): see :func:`.gemm_ops.run_config`."""
    m, k = x.shape
    n = w.shape[0]
    head = (x, w, out, x_scale, w_scale, out if bias is None else bias, m, n, k, x.stride(0), w.stride(0),
            out.stride(0))  # the arguments run_config's replays pass themselves
    tail = (x_scale.numel() > 1 and not x_quant, w_scale.numel() > 1, bias is not None, k % cfg.block_k == 0,
            use_pdl)
    if cfg.family != "mm":
        from .quant_kernels import FMAX  # the general path only (replays keep their tail)

        tail = (*tail, x_quant, FMAX[w.dtype])
    elif x_quant:
        raise ValueError(f"config {cfg.name}: only the swap and gemv kernels quantize their input")
    if cfg.family == "mm":
        return (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n),), (*head, cfg.block_m, cfg.block_n, cfg.block_k,
                                                                 cfg.group_m, *tail)
    if cfg.family == "swap":
        _check_grid_y(cdiv(m, cfg.block_m), cfg)
        return (cdiv(n, cfg.block_n), cdiv(m, cfg.block_m)), (*head, cfg.block_m, cfg.block_n, cfg.block_k, *tail)
    _check_grid_y(m, cfg)
    return (cdiv(n, cfg.block_n), m), (*head, cfg.block_n, cfg.block_k, *tail)


def _check_grid_y(programs: int, cfg: TileConfig) -> None:
    if programs > GRID_Y_MAX:
        raise InvalidInputError(f"triton config {cfg.name} cannot launch {programs} token blocks (CUDA limit "
                                f"{GRID_Y_MAX}); use config=auto or an mm config for this M")


__all__ = ["cdiv", "kernel_of", "pick_config", "pointer_kernel_args"]
