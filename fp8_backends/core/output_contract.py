"""The provider output contract: what a provider's result must look like, and the error when it does not.

A GEMM provider's ``gemm_impl`` returns a ``torch.Tensor`` ``[M, N]`` in the requested output dtype on the input's
device; a norm-quant provider's ``*_impl`` hooks write into the ``out`` buffer the base class allocated and return
``None`` (or that buffer). The callers (:meth:`Fp8GemmBackend.gemm <fp8_backends.core.backend.Fp8GemmBackend.gemm>`,
the norm-quant methods and a layer's :class:`~fp8_backends.layers.eager_plan.EagerPlan`) test this inline, with a few
attribute comparisons (metadata only, never a host-device sync), and call this module only when a comparison
fails. It then explains the failure as a :class:`~fp8_backends.core.errors.ProviderOutputError` naming the provider and
the distribution that installed it, or accepts the result (a tensor subclass, e.g. a fake tensor, with the right
metadata).

Under ``torch.compile`` the inline test runs on the provider's *fake* output while Dynamo traces: a fake
implementation with the wrong shape or dtype reaches :func:`gemm_output_failed` at trace time, which calls the
``fp8_backends::output_contract_violation`` op. Its fake implementation raises the library error, so tracing fails
with it (Dynamo reports it as the cause of a ``TorchRuntimeError``) in every mode, ``fullgraph`` or not, instead of
falling back to eager. The op is defined at load time (:func:`preload`, from ``prepare_weight``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .errors import ProviderOutputError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("fp8_backends")

_VIOLATION_OP = "output_contract_violation"


# ------------------------------------------------------------------------------------------ who broke it
#: ``[lookup(cls) -> "dist version" or None]``: the distribution that registers a provider class, from the registry's
#: entry points; the registry installs it when its discovery module is imported (:func:`set_distribution_lookup`):
#: this floor never imports the registry
_DISTRIBUTION_LOOKUP: list[Callable[[type], str | None] | None] = [None]


def set_distribution_lookup(lookup: Callable[[type], str | None] | None) -> None:
    """Make ``lookup(cls)`` the first answer of :func:`distribution_of` (the registry's discovery sets it on import)."""
    _DISTRIBUTION_LOOKUP[0] = lookup
    distribution_of.cache_clear()


@functools.lru_cache(maxsize=64)
def distribution_of(cls: type) -> str:
    """``"acme-fp8 1.2.0"``: the distribution that registers provider class ``cls`` (from the registry's entry
    points, else from the package that holds its module), or ``"no installed distribution"``. Error path only."""
    lookup = _DISTRIBUTION_LOOKUP[0]
    try:
        found = lookup(cls) if lookup is not None else None
        if found:
            return found
    except Exception:  # explaining an error must not raise another one
        logger.debug("cannot look up the distribution of %r", cls, exc_info=True)
    try:
        from importlib.metadata import packages_distributions, version

        top = cls.__module__.split(".")[0]
        dists = packages_distributions().get(top) or []
        if dists:
            return f"{dists[0]} {version(dists[0])}"
    except Exception:
        logger.debug("cannot find the package of %r", cls, exc_info=True)
    return "no installed distribution"


def _error(provider: str, label: str, cls: type | None, cls_path: str, what: str) -> ProviderOutputError:
    dist = distribution_of(cls) if cls is not None else "unknown distribution"
    return ProviderOutputError(
        f"provider {label!r} (distribution {dist}, class {cls_path}) broke the output contract: {what}",
        provider=provider, distribution=dist,
    )


def _backend_error(backend: Any, what: str) -> ProviderOutputError:
    cls = type(backend)
    name = str(getattr(backend, "name", cls.__name__))
    return _error(name, str(getattr(backend, "label", name)), cls, f"{cls.__module__}.{cls.__qualname__}", what)


# ------------------------------------------------------------------------------------------ GEMM
def describe_gemm_mismatch(y: Any, m: int, n: int, out_dtype: torch.dtype, device: torch.device) -> str | None:
    """What is wrong with ``y`` as a GEMM result (``[m, n]`` in ``out_dtype`` on ``device``), or ``None``."""
    import torch

    if not isinstance(y, torch.Tensor):
        return f"gemm returned {type(y).__name__}, not a torch.Tensor [M, N] = [{m}, {n}]"
    wrong = []
    if tuple(y.shape) != (m, n):
        wrong.append(f"shape {list(y.shape)} instead of [M, N] = [{m}, {n}]")
    if y.dtype != out_dtype:
        wrong.append(f"dtype {y.dtype} instead of {out_dtype}")
    if y.device != device:
        wrong.append(f"device {y.device} instead of {device} (the input's)")
    return "gemm returned " + ", ".join(wrong) if wrong else None


def gemm_output_failed(backend: Any, y: Any, x_q: torch.Tensor, n: int, out_dtype: torch.dtype) -> Any:
    """Called when the inline output test of a GEMM call failed: raise :class:`ProviderOutputError` if ``y``
    breaks the contract (at trace time under ``torch.compile``), else return ``y`` (e.g. a tensor subclass with the
    right metadata)."""
    import torch

    if torch.compiler.is_compiling():
        if isinstance(y, torch.Tensor):  # the violation op's fake raises the library error at trace time
            cls = type(backend)
            getattr(torch.ops.fp8_backends, _VIOLATION_OP)(
                y, x_q, n, out_dtype, backend.name, cls.__module__ + ":" + cls.__qualname__)
            return y
        raise ProviderOutputError(f"provider {backend.name!r} broke the output contract: gemm returned no tensor")
    what = describe_gemm_mismatch(y, x_q.shape[0], n, out_dtype, x_q.device)
    if what is None:
        return y
    raise _backend_error(backend, what)


def _violation(y: Any, x_q: Any, n: int, out_dtype: Any, provider: str, cls_path: str) -> None:
    """The violation op's implementation and fake: re-check ``y`` and raise the library error."""
    what = describe_gemm_mismatch(y, x_q.shape[0], n, out_dtype, x_q.device)
    if what is None:
        return
    module, _, qualname = cls_path.partition(":")
    raise _error(provider, provider, _find_class(module, qualname), f"{module}.{qualname}", what)


def _find_class(module: str, qualname: str) -> type | None:
    import sys

    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) else None


def preload() -> None:
    """Define the ``fp8_backends::output_contract_violation`` op (once per process; load time: Dynamo cannot trace
    op definitions)."""
    _ops()


@functools.lru_cache(maxsize=1)
def _ops() -> dict[str, Any]:
    from .oplib import define_ops

    schema = (f"{_VIOLATION_OP}(Tensor y, Tensor x_q, SymInt n, ScalarType out_dtype, str provider, "
              "str cls_path) -> ()")
    return define_ops({_VIOLATION_OP: (schema, _violation, _violation)}, ("CPU", "CUDA"))


# ------------------------------------------------------------------------------------------ norm-quant
def norm_quant_output_failed(backend: Any, returned: Any, hook: str) -> None:
    """A norm-quant hook returned something other than ``None`` or the ``out`` buffer it was given: it computed
    its result elsewhere and left ``out`` unwritten."""
    raise _backend_error(backend, f"{hook} returned a {type(returned).__name__} instead of writing its result "
                                  "into `out` (return None, or `out` itself)")


def check_norm_quant_dynamic(backend: Any, q: Any, scale: Any, x: Any, mode: Any, group_size: int,
                             layout: Any) -> None:
    """A dynamic norm-quant hook's ``(q, scale)``, from metadata: ``q`` a float8_e4m3fn ``[T, H]`` row-major tensor
    on ``x``'s device; ``scale`` fp32 ``[T, 1]`` (per token) or ``[T, ceil(H/G)]`` in ``layout`` (per group)."""
    import torch

    from .group_scales import is_layout
    from .types import ActScale

    t, h = x.shape
    groups = 1 if mode is ActScale.PER_TOKEN else -(-h // group_size)
    problems = []
    if not isinstance(q, torch.Tensor) or q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (t, h) \
            or q.device != x.device or not q.is_contiguous():
        problems.append(f"q must be a row-major float8_e4m3fn [{t}, {h}] tensor on {x.device}, got "
                        f"{_describe(q)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != (t, groups) \
            or scale.device != x.device:
        problems.append(f"scale must be a float32 [{t}, {groups}] tensor on {x.device}, got {_describe(scale)}")
    elif mode is ActScale.PER_TOKEN_GROUP and not is_layout(scale, layout):
        problems.append(f"scale must be laid out {layout.value}, got strides {tuple(scale.stride())}")
    if problems:
        raise _backend_error(backend, "rmsnorm_quant_dynamic_impl broke the output contract: " + "; ".join(problems))


def _describe(t: Any) -> str:
    import torch

    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} strides {tuple(t.stride())} on {t.device}"


__all__ = ["check_norm_quant_dynamic", "describe_gemm_mismatch", "distribution_of", "gemm_output_failed",
           "norm_quant_output_failed", "preload", "set_distribution_lookup"]
