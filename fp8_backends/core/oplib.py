"""Defining the library's torch ops: ``torch.library.Library`` fragments with a fake implementation each.

Every kernel call goes through an op in the ``fp8_backends`` namespace so that ``torch.compile`` traces it
(the fake implementation gives shapes and dtypes without running anything). The ops are defined with
``Library.define`` + ``Library.impl`` per dispatch key, not with the ``torch.library.custom_op``
decorator: that decorator wraps each call in a Python autograd layer and an output-aliasing check, which
cost about 26 µs per call against 9 µs for the plain dispatcher path (measured on the 2-core CPU box,
2026-11-29). The ops are inference-only: no autograd formulas.

Mutated arguments are declared in the schema (``Tensor(a!) out``), which is what functionalization needs.
Definitions are idempotent: a second call (a reloaded module) reuses the ops already defined.

:func:`eager_fast` turns an op into the callable the providers use: it runs the op's implementation
directly for plain eager calls and goes through the op otherwise. The dispatcher costs 9-18 µs per call
(CPU box / H200 host), more than a decode kernel's GPU time, and buys nothing in a plain eager call:
no tracing, no dispatch mode, no tensor subclass. Under ``torch.compile`` (``is_compiling()``), a dispatch
mode (fake tensors, functionalization, FlopCounterMode, ...) or a tensor subclass as first argument, the op
is called, so tracing sees it and its fake implementation.

Ops whose kernels are Triton kernels are defined with :func:`torch.library.triton_op` instead
(:class:`TritonOpSpec`): their traced body launches the kernels through :func:`torch.library.wrap_triton`,
so under ``torch.compile`` AOTAutograd decomposes the op and Inductor launches the kernels from its own
generated code (no Python body per call, fusion and scheduling around them). Plain eager calls still run the
spec's ``eager`` implementation directly (:func:`eager_fast`), which launches the same kernels through the
library's cached launcher.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

NAMESPACE = "fp8_backends"

#: name -> (schema without the namespace, implementation, fake implementation)
OpSpec = tuple[str, Callable[..., Any], Callable[..., Any]]


class TritonOpSpec(NamedTuple):
    """An op defined with :func:`torch.library.triton_op`.

    - ``traced``: the op's body, with type hints (its schema is inferred from them). It launches its Triton
      kernels through ``torch.library.wrap_triton(kernel)[grid](...)`` and must be traceable with fake tensors
      (it is also the fake implementation): sizes, strides and dtypes only, no data reads.
    - ``eager``: what a plain eager call runs (:func:`eager_fast`): same arguments, same semantics, typically
      the same kernels through a faster launcher.
    - ``mutates_args``: names of the arguments the op writes in place.
    """

    traced: Callable[..., Any]
    eager: Callable[..., Any]
    mutates_args: tuple[str, ...] = ()

_libraries: list[Any] = []  # keep the fragments alive: dropping one unregisters its ops
_impls: dict[str, Callable[..., Any]] = {}  # "namespace::name" -> implementation (for eager_fast)
_lock = threading.Lock()


def _defined(name: str) -> bool:
    import torch

    try:
        return torch._C._dispatch_has_kernel(f"{NAMESPACE}::{name}") or bool(
            torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::{name}", ""))
    except Exception:
        return False


def define_ops(specs: Mapping[str, OpSpec | TritonOpSpec], dispatch_keys: Iterable[str]) -> dict[str, Any]:
    """Define each op of ``specs`` (once per process); return ``{name: OpOverload}``.

    An :data:`OpSpec` gets its implementation registered for every key of ``dispatch_keys`` (``"CUDA"``,
    ``"CPU"``) and its fake; a :class:`TritonOpSpec` is defined with :func:`torch.library.triton_op` (every
    device; its traced body is its fake)."""
    import torch

    keys = tuple(dispatch_keys)
    with _lock:
        pending = [name for name in specs if not _defined(name)]
        plain = [name for name in pending if not isinstance(specs[name], TritonOpSpec)]
        if plain:
            lib = torch.library.Library(NAMESPACE, "FRAGMENT")
            for name in plain:
                schema, impl, fake = specs[name]
                lib.define(schema)
                for key in keys:
                    lib.impl(name, impl, key)
                torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
            _libraries.append(lib)
        for name in pending:
            spec = specs[name]
            if isinstance(spec, TritonOpSpec):
                op_def = torch.library.triton_op(f"{NAMESPACE}::{name}", spec.traced, mutates_args=spec.mutates_args)
                # eager calls through the dispatcher (a dispatch mode, a subclass) run the fast launcher too;
                # tracing still decomposes the op into its wrap_triton kernels
                op_def.register_kernel(tuple(key.lower() for key in keys), spec.eager)
                _libraries.append(op_def)
        for name, spec in specs.items():
            _impls[f"{NAMESPACE}::{name}"] = spec.eager if isinstance(spec, TritonOpSpec) else spec[1]
        ns = getattr(torch.ops, NAMESPACE)
        return {name: getattr(ns, name).default for name in specs}


def eager_fast(op: Any) -> Callable[..., Any]:
    """``op`` (an OpOverload from :func:`define_ops`) as a callable that runs its implementation directly
    when the call is plain eager (not compiling, no dispatch mode active, first argument a plain
    ``torch.Tensor``) and calls ``op`` otherwise. The op's schema stays reachable as ``.op``."""
    import torch

    impl = _impls.get(op.name())
    if impl is None:
        return op
    compiling = torch.compiler.is_compiling
    modes = torch._C._len_torch_dispatch_stack
    plain = torch.Tensor

    def call(first: Any, *rest: Any) -> Any:
        if not compiling() and type(first) is plain and not modes():
            return impl(first, *rest)
        return op(first, *rest)

    call.op = op  # type: ignore[attr-defined]
    call.__name__ = call.__qualname__ = f"eager_fast({op.name()})"
    return call


class LazyOps:
    """Ops defined on first use (so a provider module imports without torch's op machinery running):
    ``op(name)`` is the OpOverload (schemas, opcheck, tests), ``call(name)`` the :func:`eager_fast` callable the
    hot path uses. ``specs`` and ``dispatch_keys`` may be callables, evaluated at definition time (a spec whose
    traced body lives in a module that imports torch and triton is then only imported when the op is defined)."""

    def __init__(
        self,
        specs: Mapping[str, OpSpec | TritonOpSpec] | Callable[[], Mapping[str, OpSpec | TritonOpSpec]],
        dispatch_keys: Iterable[str] | Callable[[], Iterable[str]],
    ) -> None:
        self._specs = specs if callable(specs) else dict(specs)
        self.dispatch_keys = dispatch_keys
        self._ops: dict[str, Any] | None = None
        self._calls: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    @property
    def specs(self) -> dict[str, OpSpec | TritonOpSpec]:
        if callable(self._specs):
            self._specs = dict(self._specs())
        return self._specs

    def ops(self) -> dict[str, Any]:
        ops = self._ops
        if ops is None:
            with self._lock:
                if self._ops is None:
                    keys = self.dispatch_keys() if callable(self.dispatch_keys) else self.dispatch_keys
                    self._ops = define_ops(self.specs, keys)
                ops = self._ops
        return ops

    def op(self, name: str) -> Any:
        return self.ops()[name]

    def preload(self) -> None:
        """Define every op and its hot-path callable now (load time), so that a first call made inside
        ``torch.compile`` tracing only reads them: Dynamo cannot trace the definition (its lock)."""
        for name in self.ops():
            self.call(name)

    def call(self, name: str) -> Callable[..., Any]:
        call = self._calls.get(name)
        if call is None:
            call = self._calls[name] = eager_fast(self.op(name))
        return call


#: the arguments every GEMM op of the library starts with (what :class:`fp8_backends.core.backend.OpGemmBackend` passes)
GEMM_ARGS = "Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, ScalarType out_dtype"


def gemm_schema(name: str, *options: str) -> str:
    """The schema of a GEMM op ``name``: :data:`GEMM_ARGS`, then the provider's ``options`` (``"str config"``, ...),
    returning the ``[M, N]`` output (:func:`gemm_fake` is its fake implementation)."""
    return f"{name}({', '.join((GEMM_ARGS, *options))}) -> Tensor"


def gemm_fake(x: Any, w: Any, x_scale: Any, w_scale: Any, bias: Any, out_dtype: Any, *options: Any) -> Any:
    """The fake implementation of every GEMM op ``(x [M, K], w [N, K], ..., out_dtype, *options) -> [M, N]``."""
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


__all__ = [
    "GEMM_ARGS", "NAMESPACE", "LazyOps", "OpSpec", "TritonOpSpec", "define_ops", "eager_fast", "gemm_fake",
    "gemm_schema",
]
