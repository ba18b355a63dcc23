"""What an engine author gets for free: the unfused torch code under ``torch.compile`` (benchmark baselines).

``TorchCompileNormQuant`` is a norm-quant "provider" for the benchmarks only (never registered): the
reference RMSNorm + static quant (and residual add) written as plain torch ops, compiled by Inductor
with ``dynamic=False`` (one compile per shape, as ../shared/notes/device-baseline.md §8 measured it; the
recompile limits are raised so that every shape of a grid gets its compile: the 2026-11-29 run hit the default
limit of 8 and measured the last H = 8192 shapes eagerly). The
compiled functions write into the caller's ``out`` (and ``residual``) so Inductor emits one fused
kernel that stores in place, with no extra copy. :func:`entry` wraps it as a
:class:`~fp8_backends.registry.discovery.ProviderEntry` for :func:`bench.common.run_grid`.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

from fp8_backends.providers.torch_norm_quant import TorchNormQuantBackend

NAME = "torch_compile"


#: one static compile per shape: a grid of 2 ops x 2 hidden sizes x many token counts recompiles the same code
#: object far past dynamo's default limit (8), after which it silently runs the code eagerly
RECOMPILE_LIMIT = 256


def _raise_recompile_limits(torch: Any) -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)


@functools.cache
def _compiled(residual: bool) -> Any:
    import torch

    from fp8_backends.core import reference

    _raise_recompile_limits(torch)

    if residual:
        def add_norm_quant(out, x, res, weight, scale, eps: float):
            q, new_res = reference.fused_add_rmsnorm_quant(x, res, weight, scale, eps)
            out.copy_(q)
            res.copy_(new_res)

        return torch.compile(add_norm_quant, dynamic=False)

    def norm_quant(out, x, weight, scale, eps: float):
        out.copy_(reference.rmsnorm_quant(x, weight, scale, eps))

    return torch.compile(norm_quant, dynamic=False)


class TorchCompileNormQuant(TorchNormQuantBackend):
    """The unfused reference code compiled by Inductor (benchmark baseline, not a registered provider)."""

    name: ClassVar[str] = NAME
    aliases: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = "torch.compile of the unfused torch code (baseline)"

    def rmsnorm_quant_impl(self, out, x, weight, scale, eps) -> None:
        _compiled(False)(out, x, weight, scale, eps)

    def fused_add_rmsnorm_quant_impl(self, out, x, residual, weight, scale, eps) -> None:
        _compiled(True)(out, x, residual, weight, scale, eps)


def entry() -> Any:
    """A loaded :class:`ProviderEntry` for :class:`TorchCompileNormQuant`."""
    from fp8_backends.registry.discovery import LOADED, ProviderEntry

    return ProviderEntry(kind="norm_quant", name=NAME, target=f"{__name__}:TorchCompileNormQuant", dist="bench",
                         dist_version=None, status=LOADED, cls=TorchCompileNormQuant)


__all__ = ["NAME", "TorchCompileNormQuant", "entry"]
