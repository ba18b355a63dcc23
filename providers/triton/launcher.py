"""Low-host-cost launches of ``@triton.jit`` kernels.

Triton's own ``kernel[grid](...)`` binds the arguments, computes its specialization key, looks the
compiled kernel up and launches it: about 40 µs of Python per call on the H200 machine (2026-11-29),
more than the decode GEMMs it launches take on the GPU. :class:`KernelLauncher` keeps the compiled kernel
Triton returns for each specialization and launches it directly afterwards (``compiled[grid](*args,
stream=...)``, the same call Triton's JIT makes at its end).

The specialization key mirrors what Triton specializes on, so a cached kernel is only reused where
Triton would have picked the same one: for each non-constexpr argument, a tensor's dtype and whether
its data pointer is 16-byte aligned; an int's ``== 1``, ``% 16 == 0`` and whether it fits 32 bits; plus
the value of every constexpr argument and the launch options (``num_warps``, ``num_stages``, PDL) and
the device. Under the interpreter (``TRITON_INTERPRET=1``) every call goes through Triton's JIT path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import _support

_I32 = 2**31


def _spec(arg: Any) -> Any:
    t = type(arg)
    if t is int:
        return (arg == 1, arg % 16 == 0, -_I32 <= arg < _I32)
    if t is bool or arg is None:
        return arg
    if t is float:
        return float
    ptr = getattr(arg, "data_ptr", None)
    if ptr is not None:
        return (arg.dtype, ptr() % 16 == 0)
    return (t, arg)


class KernelLauncher:
    """``launcher(grid, args, num_warps=..., num_stages=..., pdl=..., device_index=...)`` for one kernel.

    ``args``: every kernel parameter in declaration order (constexprs included, as values)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = getattr(fn, "params", None)
        self.constexpr = tuple(bool(p.is_constexpr) for p in params) if params else None
        self.direct = self.constexpr is not None and not _support.interpreting()
        self._compiled: dict[tuple, Any] = {}
        self._stream: Any = None

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any], *, num_warps: int, num_stages: int | None = None,
                 pdl: bool, device_index: int) -> None:
        options: dict[str, Any] = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        if pdl:
            options["launch_pdl"] = True
        if not self.direct:
            self.fn[grid](*args, **options)
            return
        key = (num_warps, num_stages, pdl, device_index,
               *(a if c else _spec(a) for a, c in zip(args, self.constexpr)))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.fn[grid](*args, **options)  # compiles (or loads from Triton's cache) and launches
            if compiled is not None and hasattr(compiled, "__getitem__"):
                self._compiled[key] = compiled
            return
        stream = self._stream
        if stream is None:
            import torch

            stream = self._stream = torch._C._cuda_getCurrentRawStream
        if len(grid) < 3:  # the compiled kernel's runner indexes grid[0..2] (Triton's JIT pads it)
            grid = (*grid, 1, 1)[:3]
        compiled[grid](*args, stream=stream(device_index))

    def clear(self) -> None:
        self._compiled.clear()


_launchers: dict[Any, KernelLauncher] = {}


def launcher_for(fn: Any) -> KernelLauncher:
    """The process-wide :class:`KernelLauncher` of a ``@triton.jit`` function."""
    launcher = _launchers.get(fn)
    if launcher is None:
        launcher = _launchers[fn] = KernelLauncher(fn)
    return launcher


def launch(fn: Any, grid: tuple[int, ...], args: Sequence[Any], *, num_warps: int, num_stages: int | None = None,
           pdl: bool, device_index: int) -> None:
    """Launch ``fn`` through its cached :class:`KernelLauncher` (``args``: every parameter, in order)."""
    launcher = _launchers.get(fn) or launcher_for(fn)
    launcher(grid, args, num_warps=num_warps, num_stages=num_stages, pdl=pdl, device_index=device_index)


__all__ = ["KernelLauncher", "launch", "launcher_for"]
