"""Low-host-cost launches of ``@triton.jit`` kernels.

Triton's own ``kernel[grid](...)`` binds the arguments, computes its specialization key, looks the
compiled kernel up and launches it: about 40 µs of Python per call on the H200 machine (2026-11-29),
more than the decode GEMMs it launches take on the GPU. :class:`KernelLauncher` keeps the compiled kernel
Triton returns for each specialization and afterwards calls its launcher directly: ``compiled.run(grid
x, y, z, stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)``, the call
Triton's own runner makes (``compiled[grid](*args, stream=...)`` where a Triton build lacks those
attributes).

The specialization key mirrors what Triton specializes on, so a cached kernel is only reused where
Triton would have picked the same one: for each non-constexpr argument, a tensor's dtype and whether
its data pointer is 16-byte aligned; an int's ``== 1``, ``% 16 == 0`` and its integer width (32-bit,
64-bit signed, 64-bit unsigned); a bool's or ``None``'s value; plus the value of every constexpr argument,
the launch options (``num_warps``, ``num_stages``, PDL) and the device.

The key is built by a function generated for the argument kinds seen at the first call (one flat tuple
expression instead of a loop over the arguments: about 2 µs instead of 6 µs for the GEMM's 20 arguments
on the 2-core CPU box). Calls whose argument kinds differ from that first call (a tensor where an int was,
``None`` where a tensor was) take the generic per-argument path; both give the same key for the same
arguments. Under the interpreter (``TRITON_INTERPRET=1``) every call goes through Triton's JIT path.

The generated function also returns the launch arguments with every tensor replaced by its data pointer,
read once for the key. Triton's C launcher takes an int as a device pointer as it is; for a tensor it calls
``data_ptr()`` again and asks the driver (``cuPointerGetAttribute``) whether the pointer is a device
pointer, one driver call per tensor argument and launch. The providers validate their inputs (device,
dtype, layout) before any launch, so that check is redundant here. Launches with Triton launch hooks set,
and calls on the generic path, pass the tensors themselves.

Call sites with a fixed argument layout go one step further with a :class:`ReplayCache`: after a launch
they keep the compiled kernel's launcher and grid (:class:`Replay`) under a key of their own that fixes
everything the specialization and the grid depend on; a later call with that key passes its data pointers
and scalars straight to the compiled launcher, without building the argument tuple or the specialization
key (the GEMM and the norm-quant kernels: about 20% less host time than ``torch._scaled_mm`` on the H200
machine, 2026-11-29).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from . import _support

_I32 = 2**31
_U64 = 2**63


def _int_spec(arg: int) -> tuple[bool, bool, int]:
    width = 0 if -_I32 <= arg < _I32 else (1 if -_U64 <= arg < _U64 else 2)
    return (arg == 1, arg % 16 == 0, width)


def _spec(arg: Any) -> Any:
    """One non-constexpr argument's part of the key (the generic path)."""
    t = type(arg)
    if t is int:
        return _int_spec(arg)
    if t is bool or arg is None:
        return arg
    if t is float:
        return float
    ptr = getattr(arg, "data_ptr", None)
    if ptr is not None:
        return (arg.dtype, ptr() % 16 == 0)
    return (t, arg)


def generic_key(args: Sequence[Any], constexpr: Sequence[bool]) -> tuple:
    return tuple(a if c else _spec(a) for a, c in zip(args, constexpr))


def make_key_fn(args: Sequence[Any], constexpr: Sequence[bool]
                ) -> Callable[[Sequence[Any]], tuple[tuple, tuple] | None]:
    """A function ``plan(args) -> (key, run_args)`` for calls whose arguments have the kinds of ``args``:
    ``key`` is the tuple :func:`generic_key` gives, ``run_args`` is ``args`` with every tensor replaced by its
    ``data_ptr()`` (what the compiled kernel's launcher receives). ``None`` when a call's argument kinds differ
    (the caller then uses the generic path)."""
    guards: list[str] = [f"len(a) == {len(args)}"]
    reads: list[str] = []
    parts: list[str] = []
    run: list[str] = []
    for i, (arg, const) in enumerate(zip(args, constexpr)):
        v = f"a[{i}]"
        t = type(arg)
        run.append(v)
        if const:
            parts.append(v)
        elif t is int:
            guards.append(f"type({v}) is int")
            # the generic path's (== 1, % 16 == 0, width), with the common 32-bit width inlined
            parts.append(f"(({v} == 1, {v} % 16 == 0, 0) if -I32 <= {v} < I32 else int_spec({v}))")
        elif t is bool:
            guards.append(f"type({v}) is bool")
            parts.append(v)
        elif arg is None:
            guards.append(f"{v} is None")
            parts.append("None")
        elif t is float:
            guards.append(f"type({v}) is float")
            parts.append("float")
        elif hasattr(arg, "data_ptr"):
            guards.append(f"type({v}) is T{i}")
            reads.append(f"    p{i} = {v}.data_ptr()\n")
            parts.append(f"({v}.dtype, p{i} % 16 == 0)")
            run[-1] = f"p{i}"
        else:
            return lambda a: None  # an unusual kind: always the generic path
    names = {"I32": _I32, "int_spec": _int_spec}
    names.update({f"T{i}": type(a) for i, (a, c) in enumerate(zip(args, constexpr)) if not c and hasattr(a, "data_ptr")
                  and type(a) not in (int, bool, float)})
    body = (f"def plan(a):\n    if not ({' and '.join(guards)}):\n        return None\n{''.join(reads)}"
            f"    return ({', '.join(parts)},), ({', '.join(run)},)\n")
    namespace: dict[str, Any] = {}
    exec(compile(body, "<fp8_backends.launcher key>", "exec"), names, namespace)  # noqa: S102 (generated above)
    return namespace["plan"]


def _runtime_knobs() -> Any:
    try:
        from triton import knobs

        return knobs.runtime
    except (ImportError, AttributeError):
        return None


def _no_hooks(hook: Any) -> bool:
    """True for an unset launch hook: ``None`` or an empty Triton ``HookChain`` (its ``calls`` list)."""
    return hook is None or (type(hook).__name__ == "HookChain" and not getattr(hook, "calls", True))


class _Entry:
    """A cached compiled kernel and what calling its launcher directly needs."""

    __slots__ = ("compiled", "run", "function", "packed")

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.run = self.function = self.packed = None
        try:
            run = compiled.run  # a property that loads the module's handles if it has not yet
            function, packed = compiled.function, compiled.packed_metadata
        except AttributeError:
            return  # another Triton: launch through compiled[grid]
        if callable(run) and function is not None:
            self.run, self.function, self.packed = run, function, packed


class Replay(NamedTuple):
    """A compiled kernel's launcher and a fixed grid: ``replay.run(g0, g1, g2, stream, replay.function,
    replay.packed, None, None, None, *run_args)`` launches it (``run_args`` as :func:`make_key_fn` makes them)."""

    run: Any
    function: Any
    packed: Any
    g0: int
    g1: int
    g2: int


class KernelLauncher:
    """``launcher(grid, args, num_warps=..., num_stages=..., pdl=..., device_index=...)`` for one kernel.

    ``args``: every kernel parameter in declaration order (constexprs included, as values)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = getattr(fn, "params", None)
        self.constexpr = tuple(bool(p.is_constexpr) for p in params) if params else None
        self.direct = self.constexpr is not None and not _support.interpreting()
        self._compiled: dict[tuple, _Entry] = {}
        self._stream: Any = None
        self._key_fn: Callable[[Sequence[Any]], tuple | None] | None = None
        self._knobs = _runtime_knobs()

    def plan(self, args: Sequence[Any]) -> tuple[tuple, Sequence[Any]]:
        """``(key, run_args)``: the specialization part of the cache key for ``args`` (launch options not
        included) and the arguments for the compiled kernel's launcher (see :func:`make_key_fn`)."""
        key_fn = self._key_fn
        if key_fn is None:
            key_fn = self._key_fn = make_key_fn(args, self.constexpr or ())
        planned = key_fn(args)
        return planned if planned is not None else (generic_key(args, self.constexpr or ()), args)

    def key(self, args: Sequence[Any]) -> tuple:
        """The specialization part of the cache key for ``args`` (launch options not included)."""
        return self.plan(args)[0]

    def __call__(self, grid: tuple[int, ...], args: Sequence[Any], *, num_warps: int, num_stages: int | None = None,
                 pdl: bool, device_index: int) -> None:
        if not self.direct:
            self.fn[grid](*args, **self._options(num_warps, num_stages, pdl))
            return
        spec, run_args = self.plan(args)
        key = (num_warps, num_stages, pdl, device_index, spec)
        entry = self._compiled.get(key)
        if entry is None:
            # compiles (or loads from Triton's cache) and launches
            compiled = self.fn[grid](*args, **self._options(num_warps, num_stages, pdl))
            if compiled is not None and hasattr(compiled, "__getitem__"):
                self._compiled[key] = _Entry(compiled)
            return
        s = (self._stream or raw_stream)(device_index)  # _stream: a stand-in tests set
        n = len(grid)
        g0 = grid[0]
        g1 = grid[1] if n > 1 else 1
        g2 = grid[2] if n > 2 else 1
        knobs = self._knobs
        if entry.run is None or knobs is None:
            entry.compiled[(g0, g1, g2)](*args, stream=s)
            return
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
        if _no_hooks(enter) and _no_hooks(leave):  # skip the metadata dict and two empty hook-chain calls
            entry.run(g0, g1, g2, s, entry.function, entry.packed, None, None, None, *run_args)
        else:
            meta = entry.compiled.launch_metadata((g0, g1, g2), s, *args)
            entry.run(g0, g1, g2, s, entry.function, entry.packed, meta, enter, leave, *args)

    def hooks_clear(self) -> bool:
        """True when no Triton launch hook is set (what a :class:`Replay` needs: it passes none)."""
        knobs = self._knobs
        return knobs is not None and _no_hooks(knobs.launch_enter_hook) and _no_hooks(knobs.launch_exit_hook)

    def replay_for(self, grid: tuple[int, ...], args: Sequence[Any], *, num_warps: int, num_stages: int | None = None,
                   pdl: bool, device_index: int) -> Replay | None:
        """After a launch with these arguments: what launching the same compiled kernel with the same grid
        again needs, for a caller that keeps it under a key of its own that fixes every specialization input
        (dtypes, pointer alignment, int values, constexprs, launch options, device). ``None`` when the
        launches go through Triton's JIT path (the interpreter, another Triton) or nothing is compiled yet."""
        if not self.direct or self._knobs is None:
            return None
        entry = self._compiled.get((num_warps, num_stages, pdl, device_index, self.plan(args)[0]))
        if entry is None or entry.run is None:
            return None
        n = len(grid)
        return Replay(entry.run, entry.function, entry.packed, grid[0], grid[1] if n > 1 else 1,
                      grid[2] if n > 2 else 1)

    @staticmethod
    def _options(num_warps: int, num_stages: int | None, pdl: bool) -> dict[str, Any]:
        options: dict[str, Any] = {"num_warps": num_warps}
        if num_stages is not None:
            options["num_stages"] = num_stages
        if pdl:
            options["launch_pdl"] = True
        return options

    def clear(self) -> None:
        self._compiled.clear()
        self._key_fn = None


class ReplayCache:
    """One call site's replays: a key the caller builds -> ``(Replay, tail, launcher)``.

    The key must fix everything the launch's specialization and grid depend on (dtypes, int values, every
    data pointer 16-byte aligned, constexprs, launch options, device). ``tail`` holds the kernel arguments
    after the first ``head`` (the ones the caller passes itself at each replay, pointers first): the
    constexprs and flags, fixed by the key. :meth:`lookup` answers only while no Triton launch hook is set
    (a replay passes none). At most ``maxsize`` keys are kept; the cache is emptied when full."""

    def __init__(self, head: int, maxsize: int = 4096) -> None:
        self.head = head
        self.maxsize = maxsize
        self._entries: dict[Any, tuple[Replay, tuple[Any, ...], KernelLauncher]] = {}

    def lookup(self, key: Any) -> tuple[Replay, tuple[Any, ...], KernelLauncher] | None:
        hit = self._entries.get(key)
        if hit is None or not hit[2].hooks_clear():
            return None
        return hit

    def record(self, key: Any, launcher: KernelLauncher, grid: tuple[int, ...], args: Sequence[Any], *,
               num_warps: int, num_stages: int | None = None, pdl: bool, device_index: int) -> None:
        """After ``launcher(grid, args, ...)``: keep its replay under ``key`` (nothing under the JIT path)."""
        replay = launcher.replay_for(grid, args, num_warps=num_warps, num_stages=num_stages, pdl=pdl,
                                     device_index=device_index)
        if replay is None:
            return
        if len(self._entries) >= self.maxsize:
            self._entries.clear()
        self._entries[key] = (replay, tuple(args[self.head:]), launcher)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_raw_stream: Any = None


def raw_stream(device_index: int) -> int:
    """torch's current CUDA stream of a device, as the handle a compiled kernel's launcher takes."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        _raw_stream = torch._C._cuda_getCurrentRawStream
    return _raw_stream(device_index)


#: by ``id(fn)``: hashing a JITFunction hashes its source-derived cache key (about 1 µs per call); the launcher
#: holds ``fn``, so the id is not reused while the entry exists
_launchers: dict[int, KernelLauncher] = {}


def launcher_for(fn: Any) -> KernelLauncher:
    """The process-wide :class:`KernelLauncher` of a ``@triton.jit`` function."""
    launcher = _launchers.get(id(fn))
    if launcher is None:
        launcher = _launchers[id(fn)] = KernelLauncher(fn)
    return launcher


def launch(fn: Any, grid: tuple[int, ...], args: Sequence[Any], *, num_warps: int, num_stages: int | None = None,
           pdl: bool, device_index: int) -> None:
    """Launch ``fn`` through its cached :class:`KernelLauncher` (``args``: every parameter, in order)."""
    launcher = _launchers.get(id(fn)) or launcher_for(fn)
    launcher(grid, args, num_warps=num_warps, num_stages=num_stages, pdl=pdl, device_index=device_index)


__all__ = ["KernelLauncher", "Replay", "ReplayCache", "generic_key", "launch", "launcher_for", "make_key_fn",
           "raw_stream"]
