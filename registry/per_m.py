"""One weight's GEMM, per batch size: the composite provider a layer (or a functional caller) chooses once.

``auto`` can prefer one provider for decode batches and another for prefill (a tuned lockfile, the shipped
selection data, the measured defaults: whichever selection policy distinguishes M buckets for the weight, see
:func:`~.resolution.resolve_gemm_buckets`). :func:`init_fp8_gemm` makes that choice once per weight, as vLLM's
``init_fp8_linear_kernel`` does per layer: it resolves the provider for the weight, asks for the per-bucket
table, prepares the weight once per distinct provider (the built-ins prepare views: no copies) and returns a
:class:`PerMGemm`: rows of ``(bucket, provider, prepared weight)``, ascending, a batch of ``M`` rows served by the
first bucket ``>= M`` (the last row by every larger M too). One row when one provider serves every M (an explicit
choice, a provider instance, or no policy splitting M).

Selection objective (:mod:`fp8_backends.core.objective`; ``objective=``, default ``FP8_SELECTION_OBJECTIVE``, else
``auto``): with ``kernel`` or ``host`` the rows are that objective's choices. With ``auto`` the composite keeps two
row sets when the objectives disagree: :attr:`PerMGemm.rows` (``host``: what eager and compiled calls run, where the
host enqueues every call) and :attr:`PerMGemm.graph_rows` (``kernel``: what calls made while a CUDA graph is
captured run), sharing the prepared weights; :meth:`PerMGemm.pick` takes ``graph=``. When they agree both names hold
one tuple (:attr:`PerMGemm.split` is False) and no call ever asks whether a graph is being captured.

Consumers: :class:`~fp8_backends.layers.Fp8Linear` holds one (``layer.kernel``), binds its rows into its eager plan
at load time (:func:`fp8_backends.layers.eager_plan.bind_per_m`: no per-call cost) and hands it to
:func:`~fp8_backends.layers.general_path.apply_fp8_linear` on every other path (``torch.compile`` traces
:meth:`PerMGemm.pick` with M static); :func:`~fp8_backends.functional.fp8_linear` takes one in place of a prepared
weight.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from fp8_backends.core import settings
from fp8_backends.core.errors import InvalidInputError
from fp8_backends.core.objective import SelectionObjective

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

    - :attr:`rows`: :class:`PerMRow` by increasing bucket, never empty; :meth:`pick` finds the one for ``M``. Under
      the ``auto`` objective these are the ``host`` choices (eager and compiled calls).
    - :attr:`graph_rows`: the rows of calls made while a CUDA graph is captured (the ``kernel`` choices under
      ``auto``); the same tuple as :attr:`rows` unless the two objectives disagree (:attr:`split`).
    - :attr:`default`: the provider resolved for the weight with M unknown and its prepared weight (what serves
      every M when :attr:`per_m` is False; :attr:`backend` / :attr:`prepared` name it).
    - :attr:`per_m`: whether the rows came from a selection policy's per-bucket table.
    - :attr:`objective`: the selection objective the rows were chosen by (None: not said, e.g. :meth:`single`).
    """

    __slots__ = ("default", "graph_rows", "k", "n", "objective", "per_m", "rows", "split")

    def __init__(self, default: PerMRow, rows: Sequence[PerMRow] = (), graph_rows: Sequence[PerMRow] | None = None,
                 objective: SelectionObjective | None = None) -> None:
        self.default = default
        single = (PerMRow(ANY_M, default.backend, default.prepared),)
        self.rows: tuple[PerMRow, ...] = tuple(rows) or single
        graph = self.rows if graph_rows is None else tuple(graph_rows) or single
        #: the same tuple as ``rows`` when every bucket has the same provider in both
        self.graph_rows: tuple[PerMRow, ...] = self.rows if _same_rows(graph, self.rows) else graph
        #: whether CUDA-graph captures run other providers than eager and compiled calls (the ``auto`` objective,
        #: its ``kernel`` and ``host`` choices differing for some bucket); a plain bool: torch.compile traces it
        self.split = self.graph_rows is not self.rows
        self.per_m = bool(rows) or bool(graph_rows)
        self.objective = objective
        self.n, self.k = default.prepared.n, default.prepared.k

    @classmethod
    def single(cls, backend: Fp8GemmBackend, prepared: PreparedWeight) -> PerMGemm:
        """One provider for every M (a weight ``backend`` prepared)."""
        return cls(PerMRow(ANY_M, backend, prepared))

    @classmethod
    def prepare(cls, default: Fp8GemmBackend, w_q: torch.Tensor, w_scale: torch.Tensor,
                table: Sequence[tuple[int, Fp8GemmBackend]] = (),
                graph_table: Sequence[tuple[int, Fp8GemmBackend]] | None = None,
                objective: SelectionObjective | None = None, **weight_kw: Any) -> PerMGemm:
        """Prepare ``w_q`` / ``w_scale`` for ``default`` and for every provider of ``table`` (``[(bucket,
        provider), ...]`` ascending, as :func:`~.resolution.resolve_gemm_buckets` returns it) and of
        ``graph_table`` (the rows of CUDA-graph captures, when they differ: ``None`` means ``table``), once per
        distinct provider. A table that names only ``default`` (or none) gives one row. ``weight_kw``: what
        :meth:`~fp8_backends.core.backend.Fp8GemmBackend.prepare_weight` takes besides the tensors (a block weight's
        ``block`` and ``group_size``)."""
        prepared = {id(default): default.prepare_weight(w_q, w_scale, **weight_kw)}
        base = PerMRow(ANY_M, default, prepared[id(default)])

        def rows_of(tab: Sequence[tuple[int, Fp8GemmBackend]]) -> list[PerMRow]:
            if all(b is default for _, b in tab):
                return []
            out = []
            for bucket, backend in tab:
                if id(backend) not in prepared:
                    prepared[id(backend)] = backend.prepare_weight(w_q, w_scale, **weight_kw)
                out.append(PerMRow(int(bucket), backend, prepared[id(backend)]))
            return out

        rows = rows_of(table)
        graph = None if graph_table is None else rows_of(graph_table)
        return cls(base, rows, graph, objective)

    @property
    def backend(self) -> Fp8GemmBackend:
        """The default provider (the weight's provider when M is unknown)."""
        return self.default.backend

    @property
    def prepared(self) -> PreparedWeight:
        """The default provider's prepared weight."""
        return self.default.prepared

    def pick(self, m: int, graph: bool = False) -> PerMRow:
        """The row serving a batch of ``m`` rows: the first bucket ``>= m``, else the last; of :attr:`graph_rows`
        when ``graph`` (a call made while a CUDA graph is captured), else of :attr:`rows`."""
        rows = self.graph_rows if graph else self.rows
        for row in rows:
            if m <= row.bucket:
                return row
        return rows[-1]

    def gemm(self, x_q: torch.Tensor, x_scale: torch.Tensor, *, out_dtype: Any = "bfloat16",
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """``[M, N]``: :meth:`~fp8_backends.core.backend.Fp8GemmBackend.gemm` of the provider of ``x_q``'s M bucket,
        with its prepared weight (validated as that method validates)."""
        backend, prepared = self.pick(x_q.shape[0], self.split and capturing())[1:]
        return backend.gemm(x_q, prepared, x_scale, out_dtype=out_dtype, bias=bias)

    def describe(self) -> str:
        """``"M<=16:triton[config=auto],M>16:torch_scaled_mm[fast_accum=false]"`` when M is split, else the one
        provider's label; when CUDA-graph captures run other rows (:attr:`split`), those follow after
        ``"; in CUDA graphs: "``."""
        if not self.per_m:
            return self.backend.label
        text = _describe_rows(self.rows)
        if self.split:
            text += f"; in CUDA graphs: {_describe_rows(self.graph_rows)}"
        return text

    def __repr__(self) -> str:
        return f"PerMGemm(n={self.n}, k={self.k}, {self.describe()})"


def _describe_rows(rows: Sequence[PerMRow]) -> str:
    if len(rows) == 1 and rows[0].bucket == ANY_M:
        return rows[0].backend.label
    return resolution.describe_buckets([(row.bucket, row.backend.label) for row in rows])


def _same_rows(a: Sequence[PerMRow], b: Sequence[PerMRow]) -> bool:
    """Whether two row sets have the same buckets and the same provider instance in each."""
    return len(a) == len(b) and all(x.bucket == y.bucket and x.backend is y.backend for x, y in zip(a, b))


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a CUDA graph (``torch.cuda.is_current_stream_capturing``);
    False where torch has no CUDA, and while ``torch.compile`` traces. Asked only by composites whose rows differ in
    graphs (:attr:`PerMGemm.split`)."""
    import torch

    if torch.compiler.is_compiling():  # Dynamo traces before any capture: the traced code runs the host rows
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:  # a CPU-only build of torch
        return False


def layer_objective(objective: SelectionObjective | str | None) -> SelectionObjective:
    """A layer's selection objective: ``objective``, else ``FP8_SELECTION_OBJECTIVE``, else ``auto``."""
    if objective is None:
        return settings.selection_objective(SelectionObjective.AUTO)
    return SelectionObjective.of(objective)


def init_fp8_gemm(
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    problem: GemmProblem,
    backend: str | Fp8GemmBackend | None = None,
    platform: Platform | None = None,
    default: Fp8GemmBackend | None = None,
    objective: SelectionObjective | str | None = None,
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
    - ``objective``: what ``auto`` optimizes per bucket (:mod:`fp8_backends.core.objective`): ``"kernel"`` (the
      fastest kernel in CUDA graphs), ``"host"`` (a host-enqueued call's cost), or ``"auto"`` (the default, unless
      ``FP8_SELECTION_OBJECTIVE`` says otherwise): host rows for eager and compiled calls, kernel rows for calls
      made while a CUDA graph is captured, both kept when they differ (:attr:`PerMGemm.graph_rows`). An explicit
      choice (one provider) ignores it.

    Raises the library's errors (:class:`~fp8_backends.core.errors.UnsupportedProblemError`, ...) as resolution does.
    """
    from fp8_backends.core.backend import Fp8GemmBackend
    from fp8_backends.core.types import GemmProblem

    if not isinstance(problem, GemmProblem):
        raise InvalidInputError(f"init_fp8_gemm needs problem=GemmProblem(...), got {type(problem).__name__}")
    problem = problem.with_m(None)
    _check_weight_fits(w_q, w_scale, problem)
    objective = layer_objective(objective)
    if default is None:
        default = resolution.resolve_or_check("gemm", backend, problem, platform)  # M unknown: every objective agrees
    table: list[tuple[int, Fp8GemmBackend]] = []
    graph_table = None
    if not isinstance(backend, Fp8GemmBackend):
        if objective is SelectionObjective.AUTO:
            table = resolution.resolve_gemm_buckets(backend, problem=problem, platform=platform,
                                                    objective=SelectionObjective.HOST)
            graph_table = resolution.resolve_gemm_buckets(backend, problem=problem, platform=platform,
                                                          objective=SelectionObjective.KERNEL)
        else:
            table = resolution.resolve_gemm_buckets(backend, problem=problem, platform=platform, objective=objective)
    weight_kw = {"block": problem.weight_block, "group_size": problem.group_size} if problem.block_scaled else {}
    kernel = PerMGemm.prepare(default, w_q, w_scale, table, graph_table, objective, **weight_kw)
    logger.debug("GEMM %dx%d prepared for %s (%s)", kernel.n, kernel.k, kernel.describe(), problem.describe())
    return kernel


def _check_weight_fits(w_q: Any, w_scale: Any, problem: GemmProblem) -> None:
    """Raise :class:`InvalidInputError` where ``w_q [N, K]`` / ``w_scale`` are not the weight ``problem`` describes
    (its N and K; one scale per tensor, per output row, or per ``block``): resolution chose providers for the
    problem, so a weight of another shape or scale mode must not be prepared in its place. The providers'
    ``prepare_weight`` checks the rest (dtypes, layouts, values)."""
    import torch

    from fp8_backends.core.types import WeightScale

    if not isinstance(w_q, torch.Tensor) or w_q.dim() != 2:
        raise InvalidInputError(f"w_q must be a 2-D [N, K] tensor, got "
                                f"{tuple(w_q.shape) if isinstance(w_q, torch.Tensor) else type(w_q).__name__}")
    if tuple(w_q.shape) != (problem.n, problem.k):
        raise InvalidInputError(f"w_q is {list(w_q.shape)} but the problem's weight is [N={problem.n}, K={problem.k}]")
    if not isinstance(w_scale, torch.Tensor):
        raise InvalidInputError(f"w_scale must be a tensor, got {type(w_scale).__name__}")
    mode = problem.weight_scale
    if mode is WeightScale.BLOCK:
        bn, bk = problem.weight_block
        want = (-(-problem.n // bn), -(-problem.k // bk))
        if tuple(w_scale.shape) != want:
            raise InvalidInputError(f"w_scale is {list(w_scale.shape)} but {bn}x{bk} blocks of a [{problem.n}, "
                                    f"{problem.k}] weight take {list(want)}")
    elif mode is WeightScale.PER_TENSOR and w_scale.numel() != 1:
        raise InvalidInputError(f"w_scale holds {w_scale.numel()} values but the problem's weight scale is per-tensor "
                                "(one value)")
    elif mode is WeightScale.PER_CHANNEL and (w_scale.numel() != problem.n or w_scale.dim() > 2):
        raise InvalidInputError(f"w_scale is {list(w_scale.shape)} but the problem's weight scale is per-channel "
                                f"(one value per output row: [{problem.n}])")


__all__ = ["ANY_M", "PerMGemm", "PerMRow", "capturing", "init_fp8_gemm", "layer_objective"]
