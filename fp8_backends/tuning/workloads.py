"""What the tuner and the benchmarks run: candidates (provider x tunable option values) and inputs.

- :func:`expand_candidates`: every discovered provider that can serve a problem, once per combination
  of the values of its ``tunable_options`` (``"auto"`` values skipped unless *pinned*: ``pins`` holds options
  at one value, e.g. ``{"cutlass": {"config": "auto"}}``; combinations whose ``supports()``
  fails, or that ``auto`` may not pick for the problem, are skipped with their reasons), each with a
  *static rank*: the order ``auto`` would prefer without measurements (provider priority, then option
  values in declared order). Near-ties are broken by this rank.
- :class:`GemmWorkload`: one weight shape (N, K, dtypes, scale modes, bias) on one device. Weight
  copies for L2 rotation are made once, each candidate's ``prepare_weight`` runs once per copy, and
  per-M activations with their fp32 reference are made when an M is first asked for.
- :class:`NormQuantWorkload`: the same for RMSNorm + static FP8 quant (hidden size, dtype, residual).

Inputs are ``randn`` data quantized with :mod:`fp8_backends.core.reference`; every copy of a set holds the
same values, so one reference checks every output. torch is imported inside functions only.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fp8_backends.core.types import ActScale, GemmProblem, NormQuantProblem, WeightScale
from fp8_backends.registry.candidates import provider_instance, rank_key
from fp8_backends.registry.discovery import ProviderEntry, discover
from fp8_backends.registry.lockfile import candidate_label
from fp8_backends.registry.platform import Platform
from fp8_backends.tuning.timing import Run, l2_cache_bytes, rotation_count

DEFAULT_RTOL = 1e-2  # relative Frobenius error vs the fp32 reference (bf16 output rounding gives ~2-3e-3)
NORM_CODE_MISMATCH = 1e-2  # fraction of fp8 codes allowed to differ from the reference (rounding flips)


@dataclass
class CandidateSpec:
    """One provider with one set of option values, ready to run."""

    entry: ProviderEntry
    options: dict[str, str]
    backend: Any
    rank: tuple[int, tuple[int, ...]]
    label: str

    @property
    def provider(self) -> str:
        return self.entry.name


def option_combos(cls: Any, pinned: Mapping[str, str] | None = None) -> list[dict[str, str]]:
    """Every combination of the values of ``cls.tunable_options`` (``"auto"`` left out), in declared
    order; ``[{}]`` when nothing is tunable. ``pinned`` options take only their given value (tunable or not)."""
    options = getattr(cls, "options", {}) or {}
    pinned = dict(pinned or {})
    bad = [f"{k}={v}" for k, v in pinned.items() if str(v) not in options.get(k, ())]
    if bad:
        declared = ", ".join(f"{k}={'|'.join(v)}" for k, v in options.items()) or "none"
        raise ValueError(f"{getattr(cls, 'name', cls)}: no option value {', '.join(bad)} (options: {declared})")
    names = [n for n in getattr(cls, "tunable_options", ()) or () if n in options and n not in pinned]
    values = [[v for v in options[n] if v != "auto"] for n in names]
    if any(not v for v in values):
        names = [n for n, v in zip(names, values) if v]
        values = [v for v in values if v]
    fixed = {k: str(v) for k, v in pinned.items()}
    return [{**dict(zip(names, combo)), **fixed} for combo in itertools.product(*values)]


def _option_rank(cls: Any, options: dict[str, str]) -> tuple[int, ...]:
    declared = getattr(cls, "options", {}) or {}
    return tuple(declared[k].index(v) if v in declared.get(k, ()) else 99 for k, v in options.items())


def make_candidate(
    entry: ProviderEntry, options: dict[str, str], problem: Any, platform: Platform, order: int = 0,
    qualified: bool = False,
) -> tuple[CandidateSpec | None, str]:
    """A candidate for ``entry`` with ``options``, or ``(None, reasons)`` when it cannot serve."""
    try:
        backend = provider_instance(entry, tuple(sorted(options.items())))
        reasons = list(backend.supports(problem, platform))
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if reasons:
        return None, "; ".join(reasons)
    rank = (order, _option_rank(entry.cls, options))
    label = backend.label  # name[every option], as `auto` reports it
    if qualified:
        label = f"{entry.dist}:{label}"
    return CandidateSpec(entry, dict(options), backend, rank, label), ""


def expand_candidates(
    kind: str,
    problem: Any,
    platform: Platform,
    *,
    only: Collection[str] | None = None,
    entries: Sequence[ProviderEntry] | None = None,
    pins: Mapping[str, Mapping[str, str]] | None = None,
    allow_builds: bool = False,
) -> tuple[list[CandidateSpec], list[tuple[str, str]]]:
    """``(candidates in static-rank order, [(label, why skipped), ...])`` for one problem.

    ``only``: provider names (or aliases) to keep; others are left out silently. ``pins``: provider name ->
    options held at one value (see :func:`option_combos`). A candidate whose first call would build for minutes
    (:meth:`~fp8_backends.core.backend.ProviderBase.first_use_build`: flashinfer's block module, cutlass libraries not
    built) is skipped with that reason unless ``allow_builds``: a timed run never stalls on a build.
    """
    ordered = sorted(entries if entries is not None else discover(kind), key=rank_key)
    counts: dict[str, int] = {}
    for e in ordered:
        counts[e.name] = counts.get(e.name, 0) + 1
    out: list[CandidateSpec] = []
    skipped: list[tuple[str, str]] = []
    for order, entry in enumerate(ordered):
        if only is not None and entry.name not in only and not (set(entry.aliases) & set(only)):
            continue
        reason = entry.unusable_reason()
        if reason:
            skipped.append((entry.name, reason))
            continue
        for combo in option_combos(entry.cls, (pins or {}).get(entry.name)):
            cand, why = make_candidate(entry, combo, problem, platform, order, qualified=counts[entry.name] > 1)
            if cand is not None:
                why = cand.backend.explicit_only_reason(problem, platform) or ""
                if not why and not allow_builds:
                    build = getattr(cand.backend, "first_use_build", None)
                    why = (build(problem, platform) or "") if build is not None else ""
                if not why:
                    out.append(cand)
                    continue
            skipped.append((candidate_label(entry.name, combo), why))
    return out, skipped


#: how a verification reason starts when the candidate's output broke the output contract (the tuner reports it so)
CONTRACT_BROKEN = "broke the output contract"


def _relative_error(torch: Any, out: Any, ref: Any) -> tuple[float, str | None]:
    if tuple(out.shape) != tuple(ref.shape):
        return float("inf"), f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    o = out.float()
    if not bool(torch.isfinite(o).all()):
        return float("inf"), "output has NaN or inf"
    denom = float(ref.norm())
    err = float((o - ref).norm()) / (denom if denom > 0 else 1.0)
    return err, None


class GemmWorkload:
    """Inputs for one GEMM weight shape on one device (see the module docstring).

    ``problem``: the shape, dtypes and scale modes (its ``m`` is ignored). Per-tensor weight scales are
    one fp32 value; per-channel ones ``[N]``; block ones ``[ceil(N/BN), ceil(K/BK)]`` (``problem.weight_block``).
    Activations: ``[M, K]`` in ``problem.input_dtype`` with a ``[1]`` (per-tensor), ``[M, 1]`` (per-token) or
    ``[M, ceil(K/G)]`` (per-token-group, ``G = problem.group_size``) fp32 scale; group scales are handed to each
    candidate in the layout its capabilities declare (``group_scale_layout``), converted once, outside the timing,
    as the quantizer feeding a layer writes them.
    """

    kind = "gemm"

    def __init__(
        self, problem: GemmProblem, device: Any, *, rtol: float = DEFAULT_RTOL, seed: int = 0,
        l2_bytes: int | None = None, max_sets: int = 32,
    ) -> None:
        import torch

        from fp8_backends.core import reference

        self.torch, self.reference = torch, reference
        self.base = problem.with_m(None)
        self.device = torch.device(device)
        self.rtol = rtol
        self.seed = seed
        self.max_sets = max_sets
        self.l2 = l2_cache_bytes(self.device) if l2_bytes is None else l2_bytes
        p = self.base
        gen = torch.Generator(device=self.device).manual_seed(seed)
        w = torch.randn(p.n, p.k, device=self.device, generator=gen) * 2
        if p.weight_scale is WeightScale.PER_CHANNEL:
            w_q, w_scale = reference.quantize_per_token(w, p.weight_dtype.value)
            w_scale = w_scale.reshape(p.n).contiguous()
        elif p.weight_scale is WeightScale.BLOCK:
            w_q, w_scale = reference.quantize_block(w, p.weight_block, p.weight_dtype.value)
        else:
            w_q, w_scale = reference.quantize_dynamic_per_tensor(w, p.weight_dtype.value)
        del w
        self.w_scale = w_scale
        self.bias = (
            torch.randn(p.n, device=self.device, generator=gen).to(p.out_dtype.torch_dtype()) if p.has_bias else None
        )
        n_w = self.n_sets(1)
        self.w_sets = [w_q] + [w_q.clone() for _ in range(n_w - 1)]
        self._prepared: dict[str, list[Any]] = {}
        self._m: int | None = None
        self._acts: tuple[list[Any], list[Any], Any] | None = None
        self._laid_out: dict[Any, list[Any]] = {}

    # ---------------------------------------------------------------- sizes
    def problem(self, m: int) -> GemmProblem:
        return self.base.with_m(m)

    def flops(self, m: int) -> float:
        return 2.0 * m * self.base.n * self.base.k

    def bytes_moved(self, m: int) -> float:
        """Minimum DRAM traffic of one call: x + w + y (+ bias)."""
        p = self.base
        out = self.torch.empty((), dtype=p.out_dtype.torch_dtype()).element_size()
        return m * p.k + p.n * p.k + m * p.n * out + (p.n * out if p.has_bias else 0)

    def n_sets(self, m: int) -> int:
        if self.device.type != "cuda":
            return 1
        return rotation_count(self.bytes_moved(m), self.l2, maximum=self.max_sets)

    # ---------------------------------------------------------------- inputs
    def prepared(self, cand: CandidateSpec) -> list[Any]:
        """The candidate's prepared weights, one per weight copy (made once per workload)."""
        if cand.label not in self._prepared:
            block = self.base.weight_block if self.base.block_scaled else None
            group = self.base.group_size if self.base.block_scaled else None
            self._prepared[cand.label] = [cand.backend.prepare_weight(w, self.w_scale, block=block, group_size=group)
                                          for w in self.w_sets]
        return self._prepared[cand.label]

    def activations(self, m: int) -> tuple[list[Any], list[Any], Any]:
        """``(x copies, x_scale copies, fp32 reference [M, N])`` for ``m`` (the last M is cached)."""
        if self._m != m or self._acts is None:
            self._acts = None
            torch, ref_mod, p = self.torch, self.reference, self.base
            gen = torch.Generator(device=self.device).manual_seed(self.seed + 7919 * m + 1)
            x = torch.randn(m, p.k, device=self.device, generator=gen) * 2
            if p.act_scale is ActScale.PER_TOKEN:
                x_q, x_scale = ref_mod.quantize_per_token(x, p.input_dtype.value)
            elif p.act_scale is ActScale.PER_TOKEN_GROUP:
                x_q, x_scale = ref_mod.quantize_per_token_group(x, p.group_size, p.input_dtype.value)
            else:
                x_q, x_scale = ref_mod.quantize_dynamic_per_tensor(x, p.input_dtype.value)
            del x
            n = self.n_sets(m)
            xs = [x_q] + [x_q.clone() for _ in range(n - 1)]
            scales = [x_scale] + [x_scale.clone() for _ in range(n - 1)]
            expected = ref_mod.fp8_gemm(x_q, self.w_sets[0], x_scale, self.w_scale, torch.float32, self.bias,
                                        group_size=p.group_size, weight_block=p.weight_block)
            self._m, self._acts = m, (xs, scales, expected)
            self._laid_out = {}
        return self._acts

    def scales_for(self, cand: CandidateSpec, m: int) -> list[Any]:
        """The activation scale copies for ``m`` as ``cand`` reads them: per-token-group scales in its declared
        ``group_scale_layout`` (made once per layout and M), the others as they are."""
        scales = self.activations(m)[1]
        if self.base.act_scale is not ActScale.PER_TOKEN_GROUP:
            return scales
        from fp8_backends.core.group_scales import to_layout

        layout = cand.backend.capabilities.group_scale_layout
        if layout not in self._laid_out:
            self._laid_out[layout] = [to_layout(s, layout) for s in scales]
        return self._laid_out[layout]

    def release(self) -> None:
        """Drop the cached activations (keeps weights and prepared weights)."""
        self._m, self._acts, self._laid_out = None, None, {}

    def forget(self, cand: CandidateSpec) -> None:
        self._prepared.pop(cand.label, None)

    def close(self) -> None:
        self.release()
        self._prepared.clear()
        self.w_sets.clear()

    # ---------------------------------------------------------------- runs
    def check(self, out: Any, m: int) -> tuple[float, str | None]:
        """The output contract first (a plain tensor ``[M, N]`` in the problem's output dtype on this device: a
        provider that overrides ``gemm`` itself skips the base class's check), then the reference."""
        from fp8_backends.core.output_contract import describe_gemm_mismatch

        contract = describe_gemm_mismatch(out, m, self.base.n, self.base.out_dtype.torch_dtype(), self.device)
        if contract is not None:
            return float("inf"), f"{CONTRACT_BROKEN}: {contract}"
        expected = self.activations(m)[2]
        err, reason = _relative_error(self.torch, out, expected)
        if reason is None and not err <= self.rtol:
            reason = f"relative error {err:.3g} > {self.rtol:g} against the reference"
        return err, reason

    def run(self, cand: CandidateSpec, m: int) -> Run:
        xs = self.activations(m)[0]
        scales = self.scales_for(cand, m)
        ws = self.prepared(cand)
        n = min(len(xs), len(ws))
        backend, bias = cand.backend, self.bias
        out_dtype = self.base.out_dtype.torch_dtype()

        def fn(i: int) -> Any:
            return backend.gemm(xs[i], ws[i], scales[i], out_dtype=out_dtype, bias=bias)

        return Run(fn, n, lambda out: self.check(out, m))

    def verify(self, cand: CandidateSpec, m: int) -> tuple[float, str | None]:
        """Run the candidate once (eagerly) and compare it with the reference."""
        run = self.run(cand, m)
        return self.check(run.fn(0), m)


class NormQuantWorkload:
    """Inputs for one RMSNorm + static FP8 quant problem (hidden size, dtype, residual) on one device.

    ``x`` / ``residual``: ``[T, H]`` in ``problem.in_dtype``; ``weight``: ``[H]``; ``scale``: ``[1]``
    fp32 chosen from the data (amax / 448); outputs ``[T, H]`` float8_e4m3fn, preallocated.
    """

    kind = "norm_quant"

    def __init__(
        self, problem: NormQuantProblem, device: Any, *, rtol: float = DEFAULT_RTOL, seed: int = 0,
        l2_bytes: int | None = None, max_sets: int = 32, eps: float = 1e-6,
    ) -> None:
        import torch

        from fp8_backends.core import reference

        self.torch, self.reference = torch, reference
        self.base = dataclasses.replace(problem, tokens=None)
        self.device = torch.device(device)
        self.rtol, self.seed, self.max_sets, self.eps = rtol, seed, max_sets, eps
        self.l2 = l2_cache_bytes(self.device) if l2_bytes is None else l2_bytes
        p = self.base
        self.dtype = p.in_dtype.torch_dtype()
        gen = torch.Generator(device=self.device).manual_seed(seed)
        self.weight = (1 + 0.1 * torch.randn(p.hidden, device=self.device, generator=gen)).to(self.dtype)
        sample = torch.randn(64, p.hidden, device=self.device, generator=gen).to(self.dtype)
        amax = reference.rmsnorm(sample, self.weight, eps).abs().amax().float()
        self.scale = (amax / p.out_fp8.max).reshape(1).contiguous()
        self._t: int | None = None
        self._acts: dict[str, Any] | None = None

    def problem(self, t: int) -> NormQuantProblem:
        return dataclasses.replace(self.base, tokens=t)

    def flops(self, t: int) -> float:
        return 6.0 * t * self.base.hidden  # square, sum, scale, weight, divide, clamp: nominal

    def bytes_moved(self, t: int) -> float:
        """x read + fp8 write (+ residual read and write) + weight."""
        el = self.torch.empty((), dtype=self.dtype).element_size()
        per_row = self.base.hidden * (el + 1 + (2 * el if self.base.residual else 0))
        return t * per_row + self.base.hidden * el

    def n_sets(self, t: int) -> int:
        if self.device.type != "cuda":
            return 1
        return rotation_count(self.bytes_moved(t), self.l2, maximum=self.max_sets)

    def activations(self, t: int) -> dict[str, Any]:
        if self._t != t or self._acts is None:
            self._acts = None
            torch, ref = self.torch, self.reference
            gen = torch.Generator(device=self.device).manual_seed(self.seed + 7919 * t + 3)
            h = self.base.hidden
            x = torch.randn(t, h, device=self.device, generator=gen).to(self.dtype)
            res = torch.randn(t, h, device=self.device, generator=gen).to(self.dtype) if self.base.residual else None
            n = self.n_sets(t)
            acts: dict[str, Any] = {
                "x": [x] + [x.clone() for _ in range(n - 1)],
                "out": [torch.empty(t, h, dtype=torch.float8_e4m3fn, device=self.device) for _ in range(n)],
                "res0": res,
            }
            if res is not None:
                acts["res"] = [res.clone() for _ in range(n)]
                acts["ref_q"], acts["ref_res"] = ref.fused_add_rmsnorm_quant(x, res, self.weight, self.scale, self.eps)
            else:
                acts["ref_q"] = ref.rmsnorm_quant(x, self.weight, self.scale, self.eps)
            self._t, self._acts = t, acts
        return self._acts

    def release(self) -> None:
        self._t, self._acts = None, None

    def forget(self, cand: CandidateSpec) -> None:
        pass

    def close(self) -> None:
        self.release()

    def check(self, out: Any, t: int) -> tuple[float, str | None]:
        """Dequantized relative error against the reference codes, and the share of differing codes."""
        torch, acts = self.torch, self.activations(t)
        ref_q = acts["ref_q"]
        if (not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref_q.shape) or out.dtype != ref_q.dtype
                or out.device != ref_q.device):
            got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else \
                type(out).__name__
            return float("inf"), (f"{CONTRACT_BROKEN}: output {got}, expected {ref_q.dtype} {tuple(ref_q.shape)} on "
                                  f"{ref_q.device}")
        o = out.float()
        if not bool(torch.isfinite(o).all()):
            return float("inf"), "output has NaN"
        r = ref_q.float()
        denom = float(r.norm())
        err = float((o - r).norm()) / (denom if denom > 0 else 1.0)
        mismatch = float((out.view(torch.uint8) != ref_q.view(torch.uint8)).float().mean()) if out.numel() else 0.0
        if err > self.rtol or mismatch > NORM_CODE_MISMATCH:
            return err, f"dequantized relative error {err:.3g}, {100 * mismatch:.3g}% of fp8 codes differ"
        return err, None

    def run(self, cand: CandidateSpec, t: int) -> Run:
        acts = self.activations(t)
        backend, weight, scale, eps = cand.backend, self.weight, self.scale, self.eps
        xs, outs = acts["x"], acts["out"]
        if self.base.residual:
            residuals = acts["res"]

            def fn(i: int) -> Any:
                backend.fused_add_rmsnorm_quant(xs[i], residuals[i], weight, scale, eps, out=outs[i])
                return outs[i]

            return Run(fn, len(xs), None)  # in-place residual: outputs change every call, no graph check

        def fn_plain(i: int) -> Any:
            backend.rmsnorm_quant(xs[i], weight, scale, eps, out=outs[i])
            return outs[i]

        return Run(fn_plain, len(xs), lambda out: self.check(out, t))

    def verify(self, cand: CandidateSpec, t: int) -> tuple[float, str | None]:
        """One eager call on fresh buffers, compared with the reference (and the updated residual)."""
        torch, acts, backend = self.torch, self.activations(t), cand.backend
        x = acts["x"][0]
        out = torch.empty_like(acts["out"][0])
        if not self.base.residual:
            backend.rmsnorm_quant(x, self.weight, self.scale, self.eps, out=out)
            return self.check(out, t)
        res = acts["res0"].clone()
        backend.fused_add_rmsnorm_quant(x, res, self.weight, self.scale, self.eps, out=out)
        err, reason = self.check(out, t)
        if reason is None and not torch.allclose(res.float(), acts["ref_res"].float(), rtol=1e-2, atol=1e-2):
            reason = "updated residual differs from x + residual"
        return err, reason


def make_workload(kind: str, problem: Any, device: Any, **kw: Any) -> GemmWorkload | NormQuantWorkload:
    if kind == "gemm":
        return GemmWorkload(problem, device, **kw)
    if kind == "norm_quant":
        return NormQuantWorkload(problem, device, **kw)
    raise ValueError(f"unknown provider kind {kind!r}")


def kind_of(problem: Any) -> str:
    if isinstance(problem, GemmProblem):
        return "gemm"
    if isinstance(problem, NormQuantProblem):
        return "norm_quant"
    raise TypeError(f"not a GemmProblem or NormQuantProblem: {type(problem).__name__}")


__all__ = [
    "CandidateSpec",
    "GemmWorkload",
    "NormQuantWorkload",
    "expand_candidates",
    "kind_of",
    "make_candidate",
    "make_workload",
    "option_combos",
]
