"""One weight's GEMM, per batch size: the composite provider a layer (or a functional caller) chooses once.

``auto`` can prefer one provider for decode batches and another for prefill (a tuned lockfile, the shipped
selection data, the measured defaults: whichever selection policy distinguishes M buckets for the weight, see
:func:`~.resolution.resolve_gemm_buckets`). :func:`init_fp8_gemm` makes that choice once per weight, as vLLM's
``init_fp8_linear_kernel`` does per layer: it resolves the provider for the weight, asks for the per-bucket
table, prepares the weight once per distinct provider (the built-ins prepare views: no copies) and returns a
:class:`PerMGemm`: rows of ``(bucket, provider, prepared weight)``, ascending, a batch of ``M`` rows served by the
first bucket ``>= M`` (the last row by every larger M too). One row when one provider serves every M (an explicit
choice, a provider instance, or no policy splitting M).

Consumers: :class:`~fp8_backends.layers.Fp8Linear` holds one (``layer.kernel``), binds its rows into its eager plan
at load time (:func:`fp8_backends.eager_plan.bind_per_m`: no per-call cost) and hands it to
:func:`~fp8_backends.functional.apply_fp8_linear` on every other path (``torch.compile`` traces :meth:`PerMGemm.pick`
with M static); :func:`~fp8_backends.functional.fp8_linear` takes one in place of a prepared weight.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from fp8_backends.core.errors import InvalidInputError

from . import resolution

if TYPE_CHECKING:
    import torch

    from fp8_backends.core.backend import Fp8GemmBackend
    from fp8_backends.core.types import GemmProblem, PreparedWeight

    from .platform import Platform

logger = logging.getLogger("fp8_backends")

#: the bucket of a composite's only row: it serves every M
ANY_M = 1 << 62


class PerMRow(NamedTuple):
    """Batches of at most ``bucket`` rows (the last row: any number) run on ``backend`` with ``prepared``."""

    bucket: int
    backend: Fp8GemmBackend
    prepared: PreparedWeight


class PerMGemm:
    """The GEMM of one prepared weight, with a provider per M bucket.

    - :attr:`rows`: :class:`PerMRow` by increasing bucket, never empty; :meth:`pick` finds the one for ``M``.
    - :attr:`default`: the provider resolved for the weight with M unknown and its prepared weight (what serves
      every M when :attr:`per_m` is False; :attr:`backend` / :attr:`prepared` name it).
    - :attr:`per_m`: whether the rows came from a selection policy's per-bucket table.
    """

    __slots__ = ("default", "k", "n", "per_m", "rows")

    def __init__(self, default: PerMRow, rows: Sequence[PerMRow] = ()) -> None:
        self.default = default
        self.rows: tuple[PerMRow, ...] = tuple(rows) or (PerMRow(ANY_M, default.backend, default.prepared),)
        self.per_m = bool(rows)
        self.n, self.k = default.prepared.n, default.prepared.k

    @classmethod
    def single(cls, backend: Fp8GemmBackend, prepared: PreparedWeight) -> PerMGemm:
        """One provider for every M (a weight ``backend`` prepared)."""
        return cls(PerMRow(ANY_M, backend, prepared))

    @classmethod
    def prepare(cls, default: Fp8GemmBackend, w_q: torch.Tensor, w_scale: torch.Tensor,
                table: Sequence[tuple[int, Fp8GemmBackend]] = ()) -> PerMGemm:
        """Prepare ``w_q`` / ``w_scale`` for ``default`` and for every provider of ``table`` (``[(bucket,
        provider), ...]`` ascending, as :func:`~.resolution.resolve_gemm_buckets` returns it), once per distinct
        provider. A table that names only ``default`` (or none) gives one row."""
        prepared = {id(default): default.prepare_weight(w_q, w_scale)}
        base = PerMRow(ANY_M, default, prepared[id(default)])
        if all(b is default for _, b in table):
            return cls(base)
        rows = []
        for bucket, backend in table:
            if id(backend) not in prepared:
                prepared[id(backend)] = backend.prepare_weight(w_q, w_scale)
            rows.append(PerMRow(int(bucket), backend, prepared[id(backend)]))
        return cls(base, rows)

    @property
    def backend(self) -> Fp8GemmBackend:
        """The default provider (the weight's provider when M is unknown)."""
        return self.default.backend

    @property
    def prepared(self) -> PreparedWeight:
        """The default provider's prepared weight."""
        return self.default.prepared

    def pick(self, m: int) -> PerMRow:
        """The row serving a batch of ``m`` rows: the first bucket ``>= m``, else the last."""
        rows = self.rows
        for row in rows:
            if m <= row.bucket:
                return row
        return rows[-1]

    def gemm(self, x_q: torch.Tensor, x_scale: torch.Tensor, *, out_dtype: Any = "bfloat16",
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """``[M, N]``: :meth:`~fp8_backends.core.backend.Fp8GemmBackend.gemm` of the provider of ``x_q``'s M bucket,
        with its prepared weight (validated as that method validates)."""
        backend, prepared = self.pick(x_q.shape[0])[1:]
        return backend.gemm(x_q, prepared, x_scale, out_dtype=out_dtype, bias=bias)

    def describe(self) -> str:
        """``"M<=16:triton[config=auto],M>16:torch_scaled_mm[fast_accum=false]"`` when M is split, else the one
        provider's label."""
        if not self.per_m:
            return self.backend.label
        return resolution.describe_buckets([(row.bucket, row.backend.label) for row in self.rows])

    def __repr__(self) -> str:
        return f"PerMGemm(n={self.n}, k={self.k}, {self.describe()})"


def init_fp8_gemm(
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    problem: GemmProblem,
    backend: str | Fp8GemmBackend | None = None,
    platform: Platform | None = None,
    default: Fp8GemmBackend | None = None,
) -> PerMGemm:
    """Choose and prepare ``w_q [N, K]`` fp8 / ``w_scale`` fp32 once, at load time: the composite provider of
    this weight (:class:`PerMGemm`).

    - ``problem``: the weight's :class:`~fp8_backends.core.types.GemmProblem` (``n``, ``k``, dtypes, scale modes, bias,
      device; its ``m`` is ignored).
    - ``backend``: a request (``"auto"``, a name, ``"DIST:NAME@opt=v"``; ``None``: ``FP8_GEMM_BACKEND``, else
      ``auto``) or a provider instance (checked: it must serve ``problem``). With ``auto`` each M bucket a
      selection policy distinguishes gets its own provider; otherwise one provider serves every M.
    - ``default``: the provider already resolved for ``problem`` (a layer that needed it earlier), or None to
      resolve it here.

    Raises the library's errors (:class:`~fp8_backends.core.errors.UnsupportedProblemError`, ...) as resolution does.
    """
    from fp8_backends.core.backend import Fp8GemmBackend
    from fp8_backends.core.types import GemmProblem

    if not isinstance(problem, GemmProblem):
        raise InvalidInputError(f"init_fp8_gemm needs problem=GemmProblem(...), got {type(problem).__name__}")
    problem = problem.with_m(None)
    if default is None:
        default = resolution.resolve_or_check("gemm", backend, problem, platform)
    table = [] if isinstance(backend, Fp8GemmBackend) else resolution.resolve_gemm_buckets(
        backend, problem=problem, platform=platform)
    kernel = PerMGemm.prepare(default, w_q, w_scale, table)
    logger.debug("GEMM %dx%d prepared for %s (%s)", kernel.n, kernel.k, kernel.describe(), problem.describe())
    return kernel


__all__ = ["ANY_M", "PerMGemm", "PerMRow", "init_fp8_gemm"]
