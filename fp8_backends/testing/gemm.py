"""The FP8 GEMM provider contract: subclass :class:`GemmProviderContract` in a test module.

::

    from fp8_backends.testing import GemmProviderContract
    from my_fp8_kernels.provider import MyGemmBackend


    class TestMyGemm(GemmProviderContract):
        def make_provider(self):
            return MyGemmBackend()

Every test reads what the provider declares (its :class:`~fp8_backends.GemmCapabilities`) and checks it:
declared scale modes (block-wise FP8 too: per-token-group activation scales in each declared group size, block weight
scales in each declared block, over several blocks and groups with ragged last ones), FP8 types, output dtypes and
bias match :func:`fp8_backends.core.reference.fp8_gemm` (see
:mod:`fp8_backends.testing.compare` for the tolerances) on random data and edge shapes; everything undeclared
is refused with reasons by ``supports()`` and with :class:`~fp8_backends.InvalidInputError` before any
kernel runs; malformed inputs raise the library's errors; the module imports no heavy library; the entry
point carries the class's name; shapes propagate under fake tensors and ``torch.compile(fullgraph=True)``;
and, marked ``gpu``, CUDA-graph capture, Inductor and the absence of host syncs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import pytest

from fp8_backends.core.capabilities import GemmCapabilities
from fp8_backends.core.padding import round_up
from fp8_backends.core.types import (
    DEFAULT_WEIGHT_BLOCK,
    ActScale,
    BiasMode,
    DeviceKind,
    Fp8Dtype,
    GemmProblem,
    OutDtype,
    ScaleLayout,
    WeightScale,
)

from ._base import ContractBase, expect_refusal, no_kernel_runs, platform_for
from .compare import GEMM_RTOL, assert_gemm_close, relative_error

_HOOKS = ("prepare_weight_impl", "gemm_impl")
_OUT_ORDER = (OutDtype.BF16, OutDtype.FP16, OutDtype.FP32)
_PER_TENSOR_SHAPES = ((), (1,), (1, 1))  # every shape a per-tensor scale may take


@dataclass(frozen=True)
class GemmCase:
    """One combination of what a GEMM provider may declare, and the scale shapes used for it."""

    act: str  # "tensor" (one x_scale value), "token" ([M, 1]) or "group" ([M, ceil(K/G)], with block weights)
    weight: WeightScale
    x_dtype: Fp8Dtype
    w_dtype: Fp8Dtype
    out: OutDtype
    bias: bool
    shape_variant: int = 0  # rotates through the accepted scale shapes
    group_size: int = 128  # block-wise: the activation group G
    block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK  # block-wise: the weight block (BN, BK)
    layout: ScaleLayout = ScaleLayout.ROW_MAJOR  # block-wise: the layout of x_scale

    @property
    def block_scaled(self) -> bool:
        return self.act == "group"

    @property
    def id(self) -> str:
        types = self.x_dtype.value if self.x_dtype is self.w_dtype else f"{self.x_dtype.value}x{self.w_dtype.value}"
        if self.block_scaled:
            scales = f"x-group{self.group_size}-{self.layout.value}_w-block{self.block[0]}x{self.block[1]}"
        else:
            scales = f"x-{self.act}_w-{self.weight.value.removeprefix('per_')}"
        return f"{scales}_{types}_{self.out.value}" + ("_bias" if self.bias else "")

    def act_scale(self, caps: GemmCapabilities) -> ActScale:
        if self.act == "group":
            return ActScale.PER_TOKEN_GROUP
        if self.act == "token":
            return ActScale.PER_TOKEN
        return ActScale.PER_TENSOR_DYNAMIC if ActScale.PER_TENSOR_DYNAMIC in caps.act_scales else (
            ActScale.PER_TENSOR_STATIC)

    def problem(self, caps: GemmCapabilities, m: int | None, n: int, k: int, device: str) -> GemmProblem:
        block = {"group_size": self.group_size, "weight_block": self.block} if self.block_scaled else {}
        return GemmProblem(n=n, k=k, m=m, input_dtype=self.x_dtype, weight_dtype=self.w_dtype, out_dtype=self.out,
                           act_scale=self.act_scale(caps), weight_scale=self.weight, has_bias=self.bias,
                           device=DeviceKind(device), **block)

    def prepare_kwargs(self) -> dict[str, Any]:
        """What ``prepare_weight`` is told besides the tensors: the block and group size of a block weight."""
        return {"block": self.block, "group_size": self.group_size} if self.weight is WeightScale.BLOCK else {}

    def data(self, m: int, n: int, k: int, device: str, seed: int = 0) -> dict[str, Any]:
        """Random inputs: ``x [M, K]``, ``w [N, K]`` (FP8 from N(0, 2²)), scales in [0.01, 0.06], bias N(0, 4²)
        in the output dtype. Drawn on the CPU with a seeded generator (the same data on every device)."""
        import torch

        g = torch.Generator().manual_seed(seed * 7919 + m * 131 + n * 17 + k)
        x = (torch.randn(m, k, generator=g) * 2).to(self.x_dtype.torch_dtype())
        w = (torch.randn(n, k, generator=g) * 2).to(self.w_dtype.torch_dtype())
        if self.act == "group":  # one scale per token and group, in [0.01, 0.06]
            xs = torch.rand(m, -(-k // self.group_size), generator=g) * 0.05 + 0.01
        elif self.act == "token":
            xs = torch.rand(m, 1, generator=g) * 0.05 + 0.01
        else:
            xs = torch.tensor(0.03).reshape(_PER_TENSOR_SHAPES[self.shape_variant % 3])
        if self.weight is WeightScale.BLOCK:
            bn, bk = self.block
            ws = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 0.05 + 0.01
        elif self.weight is WeightScale.PER_CHANNEL:
            ws = (torch.rand(n, generator=g) * 0.05 + 0.01).reshape((n,) if self.shape_variant % 2 == 0 else (n, 1))
        else:
            ws = torch.tensor(0.02).reshape(_PER_TENSOR_SHAPES[(self.shape_variant + 1) % 3])
        bias = (torch.randn(n, generator=g) * 4).to(self.out.torch_dtype()) if self.bias else None
        moved = {key: None if t is None else t.to(device) for key, t in
                 (("x", x), ("w", w), ("xs", xs), ("ws", ws), ("bias", bias))}
        if self.act == "group":
            from fp8_backends.core import group_scales

            moved["xs"] = group_scales.to_layout(moved["xs"], self.layout)
        return {**moved, "out": self.out.torch_dtype(), "prep": self.prepare_kwargs(), "group_size": self.group_size,
                "block": self.block}


def reference_output(d: dict[str, Any]) -> Any:
    """:func:`fp8_backends.core.reference.fp8_gemm` in fp32 for the inputs of :meth:`GemmCase.data`."""
    import torch

    from fp8_backends.core import reference

    if d["x"].shape[0] == 0:
        return torch.zeros(0, d["w"].shape[0], device=d["x"].device)
    return reference.fp8_gemm(d["x"], d["w"], d["xs"], d["ws"], torch.float32, d["bias"],
                              group_size=d.get("group_size", 128), weight_block=d.get("block", DEFAULT_WEIGHT_BLOCK))


def gemm_cases(caps: GemmCapabilities) -> list[GemmCase]:
    """Every declared combination of activation scale kind x weight scale x output dtype x bias with the
    default FP8 pair (e4m3fn x e4m3fn where declared), then each other declared FP8 pair (mixed ones where
    ``mixed_inputs``) once, rotating through those combinations; then, where the provider serves block-wise FP8,
    each declared (group size, weight block) pair x output dtype x bias, the activation scales' layout rotating from
    the declared ``group_scale_layout`` through the others (a provider is handed any layout), and each other FP8
    pair once."""
    acts = [a for a, ok in (("tensor", bool(caps.act_scales & {ActScale.PER_TENSOR_STATIC,
                                                                ActScale.PER_TENSOR_DYNAMIC})),
                            ("token", ActScale.PER_TOKEN in caps.act_scales)) if ok]
    weights = [w for w in (WeightScale.PER_TENSOR, WeightScale.PER_CHANNEL) if w in caps.weight_scales]
    dtypes = [d for d in (Fp8Dtype.E4M3FN, Fp8Dtype.E5M2) if d in caps.input_dtypes]
    pairs = [(d, d) for d in dtypes] + ([(a, b) for a in dtypes for b in dtypes if a is not b]
                                        if caps.mixed_inputs else [])
    outs = [o for o in _OUT_ORDER if o in caps.out_dtypes]
    biases = [False, True] if caps.bias is not BiasMode.NONE else [False]
    if not pairs:
        return []
    main = list(itertools.product(acts, weights, outs, biases))
    cases = [GemmCase(a, w, *pairs[0], o, b, i) for i, (a, w, o, b) in enumerate(main)]
    for j, pair in enumerate(pairs[1:] if main else []):
        a, w, o, b = main[(5 * j + 3) % len(main)]
        cases.append(GemmCase(a, w, *pair, o, b, j))
    return cases + _block_cases(caps, pairs, outs, biases)


def _block_cases(caps: GemmCapabilities, pairs: list[tuple[Fp8Dtype, Fp8Dtype]], outs: list[OutDtype],
                 biases: list[bool]) -> list[GemmCase]:
    """The block-wise cases of :func:`gemm_cases` (none where the provider does not serve the mode)."""
    if not caps.block_scaled:
        return []
    modes = [(g, b) for b in sorted(caps.weight_blocks) for g in sorted(caps.group_sizes) if b[1] % g == 0]
    layouts = [caps.group_scale_layout, *(lay for lay in ScaleLayout if lay is not caps.group_scale_layout)]
    main = list(itertools.product(modes, outs, biases))
    cases = [GemmCase("group", WeightScale.BLOCK, *pairs[0], o, b, i, group_size=g, block=blk,
                      layout=layouts[i % len(layouts)]) for i, ((g, blk), o, b) in enumerate(main)]
    for j, pair in enumerate(pairs[1:] if main else []):
        (g, blk), o, b = main[(3 * j + 1) % len(main)]
        cases.append(GemmCase("group", WeightScale.BLOCK, *pair, o, b, j, group_size=g, block=blk,
                              layout=caps.group_scale_layout))
    return cases


class EdgeShape(NamedTuple):
    """One run of :meth:`GemmProviderContract.test_edge_shapes`: a combination at ``M x N x K``."""

    case: GemmCase
    m: int
    n: int
    k: int

    @property
    def id(self) -> str:
        return f"{self.case.id}-M{self.m}-N{self.n}-K{self.k}"


@dataclass(frozen=True)
class Refusal:
    """Something the provider does not declare, how to ask for it, and what ``supports()`` is shown."""

    id: str
    device: str  # where the call is made
    problem: dict[str, Any]  # GemmProblem overrides
    call: str  # "prepare" or "gemm"
    override: dict[str, Any]  # what changes in the inputs (see GemmProviderContract._refused_call)


class GemmProviderContract(ContractBase):
    """Conformance tests for an FP8 GEMM provider (:class:`~fp8_backends.Fp8GemmBackend`).

    Subclass it in a test module (name the subclass ``Test...``) and define :meth:`make_provider`
    (or set :attr:`provider_spec`). The class attributes below tune the checks; the defaults suit a
    provider that runs small problems quickly.
    """

    kind: ClassVar[str] = "gemm"
    #: relative tolerance of :func:`~fp8_backends.testing.compare.assert_gemm_close`
    rtol: ClassVar[float] = GEMM_RTOL
    #: batch sizes of the edge-shape test (0 and 1 and odd ones; the kernels' M tails)
    m_values: ClassVar[tuple[int, ...]] = (0, 1, 2, 17, 65)
    #: (N, K) of most tests before alignment (rounded up to ``n_align`` / ``k_align``)
    base_nk: ClassVar[tuple[int, int]] = (37, 71)
    #: (M, N, K) run under the ``gpu`` marker at LLM sizes (Llama-3-8B projections)
    gpu_shapes: ClassVar[tuple[tuple[int, int, int], ...]] = (
        (1, 4096, 4096), (16, 6144, 4096), (257, 4096, 14336), (1000, 28672, 4096))

    def include_case(self, case: GemmCase) -> bool:
        """Whether to exercise this declared combination (default: all). Override to leave out combinations
        that cost a kernel build each, and say why in your test module."""
        return True

    def cases(self, caps: GemmCapabilities) -> list[GemmCase]:
        """:func:`gemm_cases` of the record, filtered by :meth:`include_case`."""
        return [c for c in gemm_cases(caps) if self.include_case(c)]

    def default_case(self, caps: GemmCapabilities) -> GemmCase:
        """The first included combination, with a bias where the provider takes one."""
        cases = self.cases(caps)
        if not cases:
            pytest.skip("include_case() leaves no declared combination to test")
        return next((c for c in cases if c.bias), cases[0])

    def edge_cases(self, caps: GemmCapabilities) -> list[GemmCase]:
        """The combinations :meth:`test_edge_shapes` runs: :meth:`default_case`, then one included combination of each
        other declared activation-scale family (per-token, where it prefers per-channel weights; block-wise: per-token
        groups x block weights, in the declared scale layout), without a bias (the bias, N(0, 4²), would outweigh an
        error of the scales). Each family is its own kernel path, with its own M tails (decode at M = 1, tiles past
        M = 16)."""
        default = self.default_case(caps)
        picked = {default.act: default}
        ranked = sorted(self.cases(caps), key=lambda c: (c.bias, c.weight is not WeightScale.PER_CHANNEL,
                                                         c.layout is not caps.group_scale_layout))
        for case in ranked:
            picked.setdefault(case.act, case)
        return list(picked.values())

    # ------------------------------------------------------------------ parametrization
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        provider, error = self._collected_provider()
        caps = None if error is not None else provider.capabilities
        gpu = metafunc.definition.get_closest_marker("gpu") is not None
        names = metafunc.fixturenames
        if "device" in names:
            devices = self.device_params(gpu_only=gpu)
            metafunc.parametrize("device", devices)
            if not any(d.values[0] is not None for d in devices):  # skipped anyway: one test, one reason
                for name in ("case", "shape", "gpu_shape", "bad"):
                    if name in names:
                        metafunc.parametrize(name, [None], ids=["-"])
                return
        if "case" in names:
            cases = self.cases(caps) if isinstance(caps, GemmCapabilities) else []
            metafunc.parametrize("case", cases or [None], ids=[c.id for c in cases] or ["none"])
        if "shape" in names:
            shapes = self._edge_shapes(caps) if isinstance(caps, GemmCapabilities) else []
            metafunc.parametrize("shape", shapes or [None], ids=[s.id for s in shapes] or ["none"])
        if "gpu_shape" in names:
            metafunc.parametrize("gpu_shape", self.gpu_shapes, ids=[f"M{m}-N{n}-K{k}" for m, n, k in self.gpu_shapes])
        if "refusal" in names:
            refusals = self._refusals(provider) if error is None else []
            if refusals:
                metafunc.parametrize("refusal", refusals, ids=[r.id for r in refusals])
            else:
                metafunc.parametrize("refusal", [pytest.param(None, id="none", marks=pytest.mark.skip(
                    reason="the provider declares every combination this kit knows"))])
        if "bad" in names:
            metafunc.parametrize("bad", list(_BAD_INPUTS))

    def _base(self, caps: GemmCapabilities) -> tuple[int, int]:
        return round_up(self.base_nk[0], caps.n_align), round_up(self.base_nk[1], caps.k_align)

    def _base_for(self, caps: GemmCapabilities, case: GemmCase) -> tuple[int, int]:
        """:meth:`_base`, or for a block-wise case a weight of three block rows and three groups of K, the last of
        each ragged where the alignment allows (a kernel that reads one block's or one group's scale for all fails)."""
        if not case.block_scaled:
            return self._base(caps)
        bn, bk = case.block
        return round_up(2 * bn + self.base_nk[0], caps.n_align), round_up(2 * bk + self.base_nk[1], caps.k_align)

    def _edge_shapes(self, caps: GemmCapabilities) -> list[EdgeShape]:
        """:attr:`m_values` for each of :meth:`edge_cases` (at its base N and K: several blocks and groups for a
        block-wise one), and N and K at their alignment and odd multiples of it for the default combination."""
        if not self.cases(caps):
            return []
        default, *others = self.edge_cases(caps)
        n, k = self._base(caps)
        na, ka = caps.n_align, caps.k_align
        nk_edges = [(na, ka), (3 * na, 5 * ka), (9 * na, 2 * ka)]
        shapes = [EdgeShape(default, m, n, k) for m in self.m_values]
        shapes += [EdgeShape(default, 3, en, ek) for en, ek in nk_edges if (en, ek) != (n, k)]
        for case in others:
            n, k = self._base_for(caps, case)
            shapes += [EdgeShape(case, m, n, k) for m in self.m_values]
        return shapes

    def _refusals(self, provider: Any) -> list[Refusal]:
        """What the provider does not declare, each with a device where it can be asked."""
        caps: GemmCapabilities = provider.capabilities
        declared = [d.value for d in caps.devices]
        run = [p.values[0] for p in self.device_params() if p.values[0] not in (None, "error")]
        here = run[0] if run else None
        out: list[Refusal] = []
        if here is not None:
            for od in _OUT_ORDER:
                if od not in caps.out_dtypes:
                    out.append(Refusal(f"out-{od.value}", here, {"out_dtype": od}, "gemm", {"out": od}))
            if ActScale.PER_TOKEN not in caps.act_scales:
                out.append(Refusal("act-per_token", here, {"act_scale": ActScale.PER_TOKEN}, "gemm",
                                   {"act": "token"}))
            if not caps.act_scales & {ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC}:
                out.append(Refusal("act-per_tensor", here, {"act_scale": ActScale.PER_TENSOR_DYNAMIC}, "gemm",
                                   {"act": "tensor"}))
            for ws in (WeightScale.PER_TENSOR, WeightScale.PER_CHANNEL):
                if ws not in caps.weight_scales:
                    out.append(Refusal(f"weight-{ws.value}", here, {"weight_scale": ws}, "prepare", {"weight": ws}))
            out += _block_refusals(caps, here)
            for dt in Fp8Dtype:
                if dt not in caps.input_dtypes:
                    out.append(Refusal(f"weight-{dt.value}", here, {"weight_dtype": dt, "input_dtype": dt}, "prepare",
                                       {"w_dtype": dt}))
                    out.append(Refusal(f"input-{dt.value}", here, {"input_dtype": dt}, "gemm", {"x_dtype": dt}))
            if not caps.mixed_inputs and len(caps.input_dtypes) > 1:
                a, b = sorted(caps.input_dtypes, key=lambda d: d.value)
                out.append(Refusal("mixed-fp8", here, {"input_dtype": a, "weight_dtype": b}, "gemm",
                                   {"x_dtype": a, "w_dtype": b}))
            if caps.bias is BiasMode.NONE:
                out.append(Refusal("bias", here, {"has_bias": True}, "gemm", {"bias": True}))
        # the alignment, on a device where it applies (capabilities.align_devices)
        aligned = next((d for d in run if DeviceKind(d) in caps.align_devices), None)
        if aligned is not None:
            if caps.k_align > 1:
                k_bad = caps.k_align * 3 + max(1, caps.k_align // 2)
                out.append(Refusal("k-misaligned", aligned, {"k": k_bad}, "prepare", {"k": k_bad}))
            if caps.n_align > 1:
                n_bad = caps.n_align * 3 + max(1, caps.n_align // 2)
                out.append(Refusal("n-misaligned", aligned, {"n": n_bad}, "prepare", {"n": n_bad}))
        for dev in ("cpu", "cuda"):
            if dev not in declared and (dev == "cpu" or _cuda_here()):
                out.append(Refusal(f"device-{dev}", dev, {"device": DeviceKind(dev)}, "prepare", {}))
        return out

    # ------------------------------------------------------------------ declaration and packaging
    def test_declaration(self) -> None:
        """Identity, options, capability record and an ``availability()`` classmethod that answers."""
        from fp8_backends.core.backend import Fp8GemmBackend

        provider = self.check_identity(Fp8GemmBackend, GemmCapabilities)
        caps = provider.capabilities
        for field in ("act_scales", "weight_scales", "input_dtypes", "out_dtypes"):
            assert getattr(caps, field), f"capabilities.{field} is empty: the provider could serve nothing"
        assert isinstance(caps.bias, BiasMode)
        assert isinstance(caps.k_align, int) and caps.k_align > 0 and isinstance(caps.n_align, int) and caps.n_align > 0
        for attr in ("host_us", "block_host_us"):
            host = getattr(type(provider), attr, None)
            assert host is None or (isinstance(host, (int, float)) and not isinstance(host, bool) and
                                    0 <= host < 1e6), (
                f"{attr} must be None or a number of µs >= 0 (host time per call on the compiled path), got {host!r}")
        # host_us_for: pure Python at resolution time, per M bucket; None or a number for every M of a problem
        base_n, base_k = self._base(caps)
        options = dict(getattr(provider, "config", {}) or {})
        for m in (1, 16, 256, 1024, 4096):
            per = type(provider).host_us_for(m, base_n, base_k, options)
            assert per is None or (isinstance(per, (int, float)) and not isinstance(per, bool) and 0 <= per < 1e6), (
                f"host_us_for({m}, {base_n}, {base_k}, {options}) must be None or a number of µs >= 0, got {per!r}")

    # ------------------------------------------------------------------ numerics
    def test_matches_reference(self, device: str, case: GemmCase) -> None:
        """Each declared combination, at ``M = 5`` and the base (N, K) (block-wise: several blocks and groups), against
        the reference."""
        self._run_case(device, case, 5, *self._base_for(self.make_provider().capabilities, case))

    def test_edge_shapes(self, device: str, shape: EdgeShape | None) -> None:
        """M = 0, 1, odd, past 16 and 64 for the default combination and one of each other declared activation-scale
        family (:meth:`edge_cases`: per-token, block-wise); N and K at their alignment (and odd multiples of it) for
        the default combination."""
        if shape is None:
            pytest.skip("include_case() leaves no declared combination to test")
        self._run_case(device, shape.case, shape.m, shape.n, shape.k)

    def test_scales_are_applied(self, device: str) -> None:
        """Doubling ``x_scale`` or ``w_scale`` doubles the output (exact in binary floating point): a kernel that
        drops, swaps or caches a scale fails."""
        provider = self.provider()
        caps = provider.capabilities
        platform = platform_for(device)
        outs = {c.out for c in self.cases(caps)}
        out = OutDtype.FP32 if OutDtype.FP32 in outs else min(outs, key=_OUT_ORDER.index, default=None)
        for case in self.cases(caps):
            if case.out is not out or case.bias or case.x_dtype is not case.w_dtype:
                continue
            n, k = self._base_for(caps, case)
            if provider.supports(case.problem(caps, 7, n, k, device), platform):
                continue
            d = case.data(7, n, k, device, seed=3)
            prep = d["prep"]
            y1 = provider.gemm(d["x"], provider.prepare_weight(d["w"], d["ws"], **prep), d["xs"], out_dtype=d["out"])
            y_w = provider.gemm(d["x"], provider.prepare_weight(d["w"], d["ws"] * 2, **prep), d["xs"],
                                out_dtype=d["out"])
            y_x = provider.gemm(d["x"], provider.prepare_weight(d["w"], d["ws"], **prep), d["xs"] * 2,
                                out_dtype=d["out"])
            for label, y2 in (("w_scale", y_w), ("x_scale", y_x)):
                err = relative_error(y2, 2 * y1.float())
                assert err <= 1e-6, f"{case.id}: doubling {label} changed the output by {err:.3g}, not 2x"

    # ------------------------------------------------------------------ refusals
    def test_undeclared_is_refused_before_any_kernel(self, refusal: Refusal) -> None:
        """For everything undeclared: ``supports()`` gives reasons, and the call raises InvalidInputError
        before ``prepare_weight_impl`` / ``gemm_impl`` run."""
        provider = self.provider()
        caps = provider.capabilities
        n, k = self._base(caps)
        problem_kw = {"n": n, "k": k, "m": 4, "device": DeviceKind(refusal.device), **refusal.problem}
        reasons = provider.supports(GemmProblem(**problem_kw), platform_for(refusal.device))
        assert reasons and all(isinstance(r, str) and r for r in reasons), (refusal.id, reasons)
        if refusal.device != "cpu" and not _cuda_here():
            return
        cases = gemm_cases(caps)
        ok_case = next((c for c in cases if not c.block_scaled), cases[0])
        n, k = self._base_for(caps, ok_case)
        over = refusal.override
        case = GemmCase(over.get("act", ok_case.act), over.get("weight", ok_case.weight),
                        over.get("x_dtype", ok_case.x_dtype), over.get("w_dtype", ok_case.w_dtype),
                        over.get("out", ok_case.out), over.get("bias", ok_case.bias),
                        group_size=over.get("group_size", ok_case.group_size), block=over.get("block", ok_case.block),
                        layout=ok_case.layout)
        d = case.data(4, over.get("n", n), over.get("k", k), refusal.device)
        with no_kernel_runs(provider, _HOOKS) as calls:
            if refusal.call == "prepare":
                expect_refusal(lambda: provider.prepare_weight(d["w"], d["ws"], **d["prep"]), calls, None, refusal.id)
                return
            good = ok_case.data(4, n, k, refusal.device)
            w = d["w"] if case.w_dtype is not ok_case.w_dtype else good["w"]
            prepared = provider.prepare_weight(w, good["ws"], **good["prep"])
            calls.clear()
            expect_refusal(lambda: provider.gemm(d["x"], prepared, d["xs"], out_dtype=d["out"], bias=d["bias"]),
                           calls, None, refusal.id)

    def test_bad_inputs_raise_library_errors(self, device: str, bad: str) -> None:
        """Malformed tensors raise :class:`~fp8_backends.InvalidInputError` naming the argument, before any
        kernel."""
        provider = self.provider()
        caps = provider.capabilities
        need, build, match = _BAD_INPUTS[bad]
        if not need(caps, device):
            pytest.skip(f"{bad}: not applicable to this provider on {device}")
        cases = gemm_cases(caps)
        classic = [c for c in cases if not c.block_scaled]
        pool = {"classic": classic, "block": [c for c in cases if c.block_scaled]}.get(_BAD_MODES.get(bad), classic or
                                                                                     cases)
        if not pool:
            pytest.skip(f"{bad}: for {_BAD_MODES[bad]} scales, which this provider does not declare")
        case = pool[0]
        n, k = self._base_for(caps, case)
        d = case.data(4, n, k, device)
        with no_kernel_runs(provider, _HOOKS) as calls:
            prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])
            calls.clear()
            ctx = {"p": provider, "prepared": prepared, "device": device, "caps": caps, "n": n, "k": k, **d}
            expect_refusal(build(ctx), calls, match, bad)

    # ------------------------------------------------------------------ tracing
    def test_fake_tensor_shapes(self, device: str) -> None:
        """Under ``FakeTensorMode`` (what torch.compile propagates) the output has shape ``[M, N]``, the
        requested dtype and the input's device, for each declared activation-scale kind and output dtype."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        provider = self.provider()
        n, k = self._base(provider.capabilities)
        served = self._served_kinds(provider, device, n, k, lambda c: (c.act, c.weight, c.out))
        for case in served:
            for m in (0, 1, 17) if case.act == "tensor" else (1, 17):
                d = case.data(m, n, k, device)
                prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])  # load time: eager, real tensors
                mode = FakeTensorMode(allow_non_fake_inputs=False)
                fake = _fakeify(mode, {**d, "prepared": prepared})
                with mode:
                    y = provider.gemm(fake["x"], fake["prepared"], fake["xs"], out_dtype=d["out"], bias=fake["bias"])
                assert tuple(y.shape) == (m, n) and y.dtype == d["out"] and y.device == d["x"].device, (
                    case.id, m, tuple(y.shape), y.dtype, y.device)
        assert served, "no declared combination was served here"

    def test_traced_extra_keys_cover_what_gemm_reads(self, device: str) -> None:
        """A compiled ``Fp8Linear`` hands ``gemm_impl`` only the entries of ``prepared.extra`` that
        :meth:`~fp8_backends.core.backend.Fp8GemmBackend.traced_extra_keys` names for the activation mode: with the
        rest left out, ``gemm_impl`` computes the same output, for each declared activation and weight scale kind."""
        import dataclasses

        import torch

        from ..core.types import PreparedWeight

        provider = self.provider()
        caps = provider.capabilities
        n, k = self._base(caps)
        for case in self._served_kinds(provider, device, n, k, lambda c: (c.act, c.weight)):
            d = case.data(5, n, k, device)
            prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])
            keys = provider.traced_extra_keys(prepared, case.problem(caps, 5, n, k, device).act_scale)
            if keys is None or type(prepared) is not PreparedWeight:
                continue
            assert set(keys) <= set(prepared.extra), (case.id, sorted(keys), sorted(prepared.extra))
            kept = dataclasses.replace(prepared, extra={name: prepared.extra[name] for name in keys})
            with torch.no_grad():
                want = provider.gemm_impl(d["x"], prepared, d["xs"], d["out"], d["bias"])
                got = provider.gemm_impl(d["x"], kept, d["xs"], d["out"], d["bias"])
            assert torch.equal(got, want), f"{case.id}: gemm_impl read an extra entry traced_extra_keys left out"

    def test_traced_fused_quant_max_m_is_a_small_int(self, device: str) -> None:
        """:meth:`~fp8_backends.core.backend.Fp8GemmBackend.traced_fused_quant_max_m` answers an int >= 0 for every
        served kind and activation mode (a compiled layer compares M bucket bounds with it at load time)."""
        provider = self.provider()
        caps = provider.capabilities
        n, k = self._base(caps)
        for case in self._served_kinds(provider, device, n, k, lambda c: (c.act, c.weight)):
            d = case.data(5, n, k, device)
            prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])
            for mode in caps.act_scales:
                got = provider.traced_fused_quant_max_m(prepared, mode)
                assert type(got) is int and got >= 0, (case.id, mode, got)

    @pytest.mark.gpu
    def test_gpu_traced_fused_quant_gemm_matches_quantize_then_gemm(self, device: str) -> None:
        """Where :meth:`~fp8_backends.core.backend.Fp8GemmBackend.traced_fused_quant_max_m` is positive, the traced
        hook (what a compiled layer calls with the unquantized input) equals :func:`fp8_backends.quant.quantize` then
        ``gemm_impl``, eager and compiled, at M = 1 and at that bound; nothing to check where no kind fuses."""
        import torch

        from fp8_backends import quant

        provider = self.provider()
        provider.preload()
        caps = provider.capabilities
        n, k = self._base(caps)
        answered = 0
        for case in self._served_kinds(provider, device, n, k, lambda c: (c.act, c.weight, c.out)):
            if case.x_dtype is not Fp8Dtype.E4M3FN:
                continue
            d = case.data(1, n, k, device)
            prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])
            for mode in sorted(caps.act_scales, key=lambda mode: mode.value):
                bound = provider.traced_fused_quant_max_m(prepared, mode)
                if not bound:
                    continue
                static = mode is ActScale.PER_TENSOR_STATIC
                input_scale = torch.tensor([0.02], device=device) if static else None
                for m in sorted({1, bound}):
                    g = torch.Generator().manual_seed(m * 31 + n)
                    x = (torch.randn(m, k, generator=g) * 3).to(d["out"]).to(device)
                    with torch.no_grad():
                        y = provider.traced_fused_quant_gemm_impl(x, prepared, mode, input_scale, d["out"], d["bias"])
                        torch._dynamo.reset()  # one compile per case: never the recompile limit's eager fallback
                        compiled = torch.compile(provider.traced_fused_quant_gemm_impl, fullgraph=True)
                        yc = compiled(x, prepared, mode, input_scale, d["out"], d["bias"])
                        x_q, x_scale = quant.quantize(x, mode, input_scale)[:2]
                        want = provider.gemm_impl(x_q, prepared, x_scale, d["out"], d["bias"])
                    answered += 1
                    assert y.shape == want.shape and y.dtype == want.dtype, (case.id, mode, m, y.shape, y.dtype)
                    assert_gemm_close(y, want.float(), d["out"], self.rtol, f"{case.id} {mode.value} M={m}")
                    assert_gemm_close(yc, want.float(), d["out"], self.rtol, f"{case.id} {mode.value} M={m} compiled")
        if not answered:
            pytest.skip(f"{provider.label} quantizes no activation inside a traced launch")

    @pytest.mark.gpu
    def test_gpu_fused_quant_gemm_matches_quantize_then_gemm(self, device: str) -> None:
        """:meth:`~fp8_backends.core.backend.Fp8GemmBackend.fused_quant_gemm_impl` (the eager hook that quantizes inside
        the provider's own launch) and the call :meth:`~.Fp8GemmBackend.bind_fused_quant_gemm` binds from it (what an
        eager layer runs: the same answers, the same declines), for each mode in ``fused_act_quant`` once the provider
        is preloaded, and each declared weight scale kind and output dtype: the output of
        :func:`fp8_backends.quant.quantize` then ``gemm_impl`` on the same unquantized input, at a few M (a row-strided
        input among them). A call may decline (``None``); one that answers must be right. Nothing to check when it
        declares no mode. GPU only: Triton's CPU interpreter rounds fp32 -> fp8 casts differently from torch
        (``../shared/notes/cpu-ci.md``)."""
        import torch

        from fp8_backends import quant

        provider = self.provider()
        provider.preload()
        modes = sorted(provider.fused_act_quant, key=lambda mode: mode.value)
        if not modes:
            pytest.skip(f"{provider.label} declares no fused activation quantization")
        caps = provider.capabilities
        n, k = self._base(caps)
        answered = 0
        for case in self._served_kinds(provider, device, n, k, lambda c: (c.weight, c.out, c.bias)):
            if case.x_dtype is not Fp8Dtype.E4M3FN:
                continue
            for mode in modes:
                if (mode is ActScale.PER_TOKEN) != (case.act == "token") and ActScale.PER_TOKEN in caps.act_scales:
                    continue
                for m in (1, 5, 33):
                    d = case.data(m, n, k, device)
                    g = torch.Generator().manual_seed(m * 31 + n)
                    wide = (torch.randn(m, k + 16, generator=g) * 3).to(d["out"]).to(device)
                    x = wide[:, :k] if m == 5 else wide[:, :k].contiguous()
                    static = mode is ActScale.PER_TENSOR_STATIC
                    input_scale = torch.tensor([0.02], device=device) if static else None
                    prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])
                    with torch.no_grad():
                        y = provider.fused_quant_gemm_impl(x, prepared, mode, input_scale, d["out"], d["bias"])
                        bound = provider.bind_fused_quant_gemm(prepared, mode, input_scale, d["out"], d["bias"])(x)
                        assert (bound is None) == (y is None), f"{case.id} {mode.value} M={m}: bound call and hook " \
                            f"disagree on declining ({bound is None} / {y is None})"
                        if y is None:
                            continue
                        assert torch.equal(bound, y), f"{case.id} {mode.value} M={m}: bind_fused_quant_gemm's call " \
                            "differs from fused_quant_gemm_impl"
                        x_q, x_scale = quant.quantize(x.contiguous(), mode, input_scale)[:2]
                        want = provider.gemm_impl(x_q, prepared, x_scale, d["out"], d["bias"])
                    answered += 1
                    assert y.shape == want.shape and y.dtype == want.dtype, (case.id, mode, m, y.shape, y.dtype)
                    assert_gemm_close(y, want.float(), d["out"], self.rtol, f"{case.id} {mode.value} M={m}")
        if not answered:
            pytest.skip(f"{provider.label} declined every fused call here (its configs for these shapes do not fuse)")

    def test_torch_compile_fullgraph(self, device: str) -> None:
        """``torch.compile(fullgraph=True)`` traces ``gemm`` without a graph break (AOT eager backend: no
        compiler needed) and computes the same result."""
        import torch

        provider = self.provider()
        caps = provider.capabilities
        n, k = self._base(caps)
        case = self._served_case(provider, device, n, k)
        d = case.data(5, n, k, device)
        prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])

        def f(x: Any, xs: Any) -> Any:
            return provider.gemm(x, prepared, xs, out_dtype=d["out"], bias=d["bias"]) * 2

        torch._dynamo.reset()
        try:
            y = torch.compile(f, fullgraph=True, backend="aot_eager")(d["x"], d["xs"])
        finally:
            torch._dynamo.reset()
        assert_gemm_close(y, 2 * reference_output(d), d["out"], self.rtol, case.id)

    # ------------------------------------------------------------------ GPU
    @pytest.mark.gpu
    def test_gpu_cuda_graph_capture_and_replay(self, device: str) -> None:
        """Captured after an eager warm-up, a replay reads new values written into the captured inputs."""
        import torch

        provider = self.provider()
        caps = provider.capabilities
        n, k = round_up(1024, caps.n_align), round_up(2048, caps.k_align)
        platform = platform_for(device)
        for case in self._gpu_cases(provider, n, k):
            for m in (1, 16, 300):
                if provider.supports(case.problem(caps, m, n, k, device), platform):
                    continue  # e.g. a small-M kernel forced by an option
                d = case.data(m, n, k, device)
                prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        provider.gemm(d["x"], prepared, d["xs"], out_dtype=d["out"], bias=d["bias"])
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    y = provider.gemm(d["x"], prepared, d["xs"], out_dtype=d["out"], bias=d["bias"])
                new = case.data(m, n, k, device, seed=1)
                d["x"].copy_(new["x"])
                d["xs"].copy_(new["xs"])
                graph.replay()
                torch.cuda.synchronize()
                assert_gemm_close(y, reference_output({**d, "x": new["x"], "xs": new["xs"]}), d["out"], self.rtol,
                                  f"{case.id} M={m} (graph replay)")

    @pytest.mark.gpu
    def test_gpu_torch_compile_inductor(self, device: str) -> None:
        """``torch.compile(fullgraph=True)`` with Inductor, on CUDA tensors."""
        import torch

        provider = self.provider()
        caps = provider.capabilities
        n, k = round_up(1024, caps.n_align), round_up(2048, caps.k_align)
        for case in self._gpu_cases(provider, n, k):
            d = case.data(5, n, k, device)
            prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])

            def f(x: Any, xs: Any, prepared: Any = prepared, d: dict[str, Any] = d) -> Any:
                return provider.gemm(x, prepared, xs, out_dtype=d["out"], bias=d["bias"]) * 2

            torch._dynamo.reset()
            try:
                y = torch.compile(f, fullgraph=True)(d["x"], d["xs"])
            finally:
                torch._dynamo.reset()
            assert_gemm_close(y, 2 * reference_output(d), d["out"], self.rtol, f"{case.id} (inductor)")

    @pytest.mark.gpu
    def test_gpu_no_host_sync(self, device: str) -> None:
        """After the first call of a shape, ``gemm`` never synchronizes with the host."""
        import torch

        provider = self.provider()
        caps = provider.capabilities
        n, k = round_up(1024, caps.n_align), round_up(2048, caps.k_align)
        for case in self._gpu_cases(provider, n, k):
            d = case.data(5, n, k, device)
            prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])  # checks scale values: may sync
            provider.gemm(d["x"], prepared, d["xs"], out_dtype=d["out"], bias=d["bias"])
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                provider.gemm(d["x"], prepared, d["xs"], out_dtype=d["out"], bias=d["bias"])
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()

    @pytest.mark.gpu
    def test_gpu_llm_shapes(self, device: str, gpu_shape: tuple[int, int, int]) -> None:
        """:attr:`gpu_shapes` against the reference (per-tensor, and per-token x per-channel where declared)."""
        provider = self.provider()
        caps = provider.capabilities
        m, n, k = gpu_shape
        n, k = round_up(n, caps.n_align), round_up(k, caps.k_align)
        for case in self._gpu_cases(provider, n, k):
            self._run_case(device, case, m, n, k, provider)

    # ------------------------------------------------------------------ helpers
    def _run_case(self, device: str, case: GemmCase, m: int, n: int, k: int, provider: Any = None) -> None:
        provider = provider or self.provider()
        caps = provider.capabilities
        reasons = provider.supports(case.problem(caps, m, n, k, device), platform_for(device))
        assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons), reasons
        if reasons:
            pytest.skip(f"{provider.label} refuses {case.id} at M={m} N={n} K={k} on {device}: {'; '.join(reasons)}")
        d = case.data(m, n, k, device)
        prepared = provider.prepare_weight(d["w"], d["ws"], **d["prep"])
        assert prepared.n == n and prepared.k == k and prepared.backend == provider.name
        assert prepared.dtype is case.w_dtype and prepared.weight_scale is case.weight
        y = provider.gemm(d["x"], prepared, d["xs"], out_dtype=d["out"], bias=d["bias"])
        assert_gemm_close(y, reference_output(d), d["out"], self.rtol, f"{case.id} M={m} N={n} K={k}")

    def _served_case(self, provider: Any, device: str, n: int, k: int, m: int = 5) -> GemmCase:
        """The first included combination the provider serves here, one with a bias if it can."""
        platform = platform_for(device)
        for case in sorted(self.cases(provider.capabilities), key=lambda c: not c.bias):
            if not provider.supports(case.problem(provider.capabilities, m, n, k, device), platform):
                return case
        pytest.skip(f"{provider.label} serves none of its declared combinations on {device}")

    def _served_kinds(self, provider: Any, device: str, n: int, k: int,
                      kind: Callable[[GemmCase], Any]) -> list[GemmCase]:
        """The first included combination of each ``kind`` (e.g. activation x weight scale) with one FP8 type for
        both operands that the provider serves here at M = 5."""
        caps = provider.capabilities
        platform = platform_for(device)
        out: dict[Any, GemmCase] = {}
        for case in self.cases(caps):
            if kind(case) in out or case.x_dtype is not case.w_dtype or provider.supports(
                    case.problem(caps, 5, n, k, device), platform):
                continue
            out[kind(case)] = case
        return list(out.values())

    def _gpu_cases(self, provider: Any, n: int, k: int) -> list[GemmCase]:
        """The default combination and, where declared and served, per-token x per-channel with bias and block-wise
        (per-token groups x block weights, its declared scale layout) with bias."""
        caps = provider.capabilities
        platform = platform_for("cuda")
        cases = self.cases(caps)
        picked = [self._served_case(provider, "cuda", n, k)]
        for wanted in (lambda c: c.act == "token" and c.weight is WeightScale.PER_CHANNEL,
                       lambda c: c.block_scaled and c.layout is caps.group_scale_layout):
            served = [c for c in cases if wanted(c) and not provider.supports(c.problem(caps, 5, n, k, "cuda"),
                                                                              platform)]
            if served and not any(wanted(c) for c in picked):
                picked.append(max(served, key=lambda c: c.bias))
        return picked


def _block_refusals(caps: GemmCapabilities, device: str) -> list[Refusal]:
    """Block-wise FP8 where the provider does not serve it: the whole mode, or the 128 / 64 activation groups of
    128x128 blocks it does not declare (asked of ``prepare_weight``, which takes the block and group size)."""
    mode = {"act_scale": ActScale.PER_TOKEN_GROUP, "weight_scale": WeightScale.BLOCK}
    override = {"act": "group", "weight": WeightScale.BLOCK}
    if not caps.block_scaled:
        return [Refusal("block", device, mode, "prepare", override)]
    out = []
    for group in (128, 64):
        if group not in caps.group_sizes or DEFAULT_WEIGHT_BLOCK not in caps.weight_blocks:
            out.append(Refusal(f"block-group-{group}", device, {**mode, "group_size": group,
                                                                "weight_block": DEFAULT_WEIGHT_BLOCK},
                               "prepare", {**override, "group_size": group, "block": DEFAULT_WEIGHT_BLOCK}))
    return out


def _cuda_here() -> bool:
    from ._base import _cuda_visible

    return _cuda_visible()


def _fakeify(mode: Any, d: dict[str, Any]) -> dict[str, Any]:
    """Fake copies of the inputs and of the prepared weight's tensors (its ``extra`` dict included)."""
    import dataclasses

    import torch

    def fake(t: Any) -> Any:
        return mode.from_tensor(t) if isinstance(t, torch.Tensor) else t

    prepared = d["prepared"]
    fake_prepared = dataclasses.replace(prepared, data=fake(prepared.data), scale=fake(prepared.scale),
                                        extra={key: fake(v) for key, v in prepared.extra.items()})
    return {**{key: fake(v) for key, v in d.items() if key != "prepared"}, "prepared": fake_prepared}


def _always(caps: GemmCapabilities, device: str) -> bool:
    return True


def _other_device(device: str) -> str | None:
    if device == "cuda":
        return "cpu"
    return "cuda" if _cuda_here() else None


# name -> (applies(caps, device), build(ctx) -> the failing call, message pattern)
_BAD_INPUTS: dict[str, tuple[Any, Any, str]] = {
    "w_q-not-fp8": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"].float(), c["ws"]),
                    "w_q must be float8_e4m3fn or float8_e5m2"),
    "w_q-not-a-tensor": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"].tolist(), c["ws"]),
                         "w_q must be a torch.Tensor"),
    "w_q-3d": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"][None], c["ws"]), "w_q must be 2-D"),
    "w_q-column-major": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"].t().contiguous().t(), c["ws"]),
                         "w_q must be row-major contiguous"),
    "w_scale-fp64": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"], c["ws"].double(), **c["prep"]),
                     "w_scale must be (a float32 tensor|float32, bfloat16 or float16)"),
    "w_scale-python-float": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"], 0.5),
                             "w_scale must be a torch.Tensor"),
    "w_scale-wrong-count": (_always, lambda c: lambda: c["p"].prepare_weight(
        c["w"], c["ws"].new_ones(c["n"] + 1)), r"w_scale must have one value \(per-tensor\) or N="),
    "w_scale-inf": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"], c["ws"] * float("inf"), **c["prep"]),
                    "w_scale must be finite and > 0"),
    "w_scale-negative": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"], -c["ws"], **c["prep"]),
                         "w_scale must be finite and > 0"),
    "w_scale-wrong-grid": (_always, lambda c: lambda: c["p"].prepare_weight(c["w"], c["ws"][:-1], **c["prep"]),
                           r"block w_scale for a \[N, K\] = .* must be \[ceil\(N/"),
    "x_q-not-fp8": (_always, lambda c: lambda: c["p"].gemm(c["x"].float(), c["prepared"], c["xs"], out_dtype=c["out"]),
                    "x_q must be float8_e4m3fn or float8_e5m2"),
    "x_q-wrong-k": (_always, lambda c: lambda: c["p"].gemm(c["x"][:, : c["k"] // 2].contiguous(), c["prepared"],
                                                           c["xs"], out_dtype=c["out"]), "x_q has K="),
    "x_q-3d": (_always, lambda c: lambda: c["p"].gemm(c["x"][None], c["prepared"], c["xs"], out_dtype=c["out"]),
               "x_q must be 2-D"),
    "x_q-column-major": (_always, lambda c: lambda: c["p"].gemm(
        c["x"].t().contiguous().t(), c["prepared"], c["xs"], out_dtype=c["out"]), "x_q must be row-major contiguous"),
    "x_scale-bf16": (_always, lambda c: lambda: c["p"].gemm(c["x"], c["prepared"], c["xs"].bfloat16(),
                                                            out_dtype=c["out"]), "x_scale must be a float32 tensor"),
    "x_scale-python-float": (_always, lambda c: lambda: c["p"].gemm(c["x"], c["prepared"], 0.5, out_dtype=c["out"]),
                             "x_scale must be a torch.Tensor"),
    "x_scale-wrong-rows": (_always, lambda c: lambda: c["p"].gemm(
        c["x"], c["prepared"], c["xs"].new_ones(c["x"].shape[0] + 1, 1), out_dtype=c["out"]),
        r"x_scale must have one value \(per-tensor\) or shape \[M, 1\]"),
    "x_scale-wrong-groups": (_always, lambda c: lambda: c["p"].gemm(c["x"], c["prepared"], c["xs"][:, :-1],
                                                                    out_dtype=c["out"]),
                             r"needs per-token-group activation scales x_scale \[M, ceil\(K/"),
    "x_scale-per-token-for-block": (_always, lambda c: lambda: c["p"].gemm(
        c["x"], c["prepared"], c["xs"][:, :1].contiguous(), out_dtype=c["out"]),
        r"needs per-token-group activation scales x_scale \[M, ceil\(K/"),
    "x_scale-wrong-rows-for-block": (_always, lambda c: lambda: c["p"].gemm(
        c["x"], c["prepared"], c["xs"].new_ones(c["x"].shape[0] + 1, c["xs"].shape[1]), out_dtype=c["out"]),
        r"needs per-token-group activation scales x_scale \[M, ceil\(K/"),
    "x_scale-nan-on-cpu": (lambda caps, dev: dev == "cpu", lambda c: lambda: c["p"].gemm(
        c["x"], c["prepared"], c["xs"] * float("nan"), out_dtype=c["out"]), "x_scale must be finite and > 0"),
    "x_scale-zero-on-cpu": (lambda caps, dev: dev == "cpu", lambda c: lambda: c["p"].gemm(
        c["x"], c["prepared"], c["xs"] * 0, out_dtype=c["out"]), "x_scale must be finite and > 0"),
    "x_scale-other-device": (lambda caps, dev: _other_device(dev) is not None, lambda c: lambda: c["p"].gemm(
        c["x"], c["prepared"], c["xs"].to(_other_device(c["device"])), out_dtype=c["out"]),
        "x_scale is on .* but the operands are on"),
    "x_q-other-device": (lambda caps, dev: _other_device(dev) is not None, lambda c: lambda: c["p"].gemm(
        c["x"].to(_other_device(c["device"])), c["prepared"], c["xs"], out_dtype=c["out"]),
        "is on .* but the operands are on|runs on .* tensors"),
    "out_dtype-int8": (_always, lambda c: lambda: c["p"].gemm(c["x"], c["prepared"], c["xs"], out_dtype="int8"),
                       "unsupported output dtype"),
    "bias-wrong-shape": (lambda caps, dev: caps.bias is not BiasMode.NONE, lambda c: lambda: c["p"].gemm(
        c["x"], c["prepared"], c["xs"], out_dtype=c["out"], bias=c["x"].new_zeros(c["n"] + 1, dtype=c["out"])),
        r"bias must have shape \[N\]"),
    "bias-wrong-dtype": (lambda caps, dev: caps.bias is not BiasMode.NONE, lambda c: lambda: c["p"].gemm(
        c["x"], c["prepared"], c["xs"], out_dtype=c["out"],
        bias=c["x"].new_zeros(c["n"], dtype=_other_float(c["out"]))), "bias must be"),
    "prepared-not-prepared": (_always, lambda c: lambda: c["p"].gemm(c["x"], object(), c["xs"], out_dtype=c["out"]),
                              "needs a weight prepared by"),
    "prepared-by-another-provider": (_always, lambda c: lambda: c["p"].gemm(
        c["x"], _foreign(c["prepared"]), c["xs"], out_dtype=c["out"]), "needs a weight prepared by"),
}


#: the bad inputs that need one kind of case (the others take the first classic case, else the first block-wise one)
_BAD_MODES = {"w_scale-wrong-count": "classic", "x_scale-wrong-rows": "classic", "w_scale-wrong-grid": "block",
              "x_scale-wrong-groups": "block", "x_scale-per-token-for-block": "block",
              "x_scale-wrong-rows-for-block": "block"}


def _other_float(dtype: Any) -> Any:
    import torch

    return torch.float16 if dtype != torch.float16 else torch.bfloat16


def _foreign(prepared: Any) -> Any:
    import dataclasses

    return dataclasses.replace(prepared, backend=f"not_{prepared.backend}")


__all__ = ["EdgeShape", "GemmCase", "GemmProviderContract", "Refusal", "gemm_cases", "reference_output"]
