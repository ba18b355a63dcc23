"""Property-based tests over strided activations (hypothesis): every path takes any view of the right shape, dtype and
device, and gives what it gives the view's row-major copy, bit for bit.

A model hands a linear or a norm whatever its last op made: a transposed activation (``a.t().contiguous().t()``,
strides ``(1, M)``), a column slice of a wider buffer (row stride > K, a start at any element), every other row, a
column step, an ``as_strided`` view (rows apart or overlapping), broadcast rows or columns (stride 0), 3-D and 4-D
batch views whose flattening is a view or a copy. Each example draws one such view and checks, per provider:

- ``Fp8Linear`` (eager: the eager plan, with the provider's fused quantize+GEMM where it has one; compiled: the traced
  plan under ``torch.compile(fullgraph=True)``) and ``fp8_linear`` over the same layer's per-M composite (the general
  path), in every activation x weight scale mode the provider serves on the device (block-wise FP8 included);
- the quant ops (:func:`fp8_backends.quant.quantize`: their kernels eagerly; under ``torch.compile`` the traced
  reference in compile mode ``"inline"`` and the op in mode ``"op"``): row-major codes equal to the copy's;
- norm-quant (``rmsnorm_quant`` and ``fused_add_rmsnorm_quant``, the static mode and the provider's dynamic ones),
  eager and compiled.

The result for the view must equal the result for ``view.contiguous()`` through the same path (the same kernels on the
same operands), and stay within a loose float64 bound (relative error < 0.1: the layout bugs these tests guard against
gave 1.3-1.4), so a path wrong for both layouts does not pass either. Each example counts one view case per provider
and path, printed at the end of the session under "view cases". ``FP8_FUZZ_SCALE`` scales the example counts,
``FP8_FUZZ_SEED`` seeds them (``tests/fuzz_support.py``).
"""

from __future__ import annotations

import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")

from fuzz_support import NORM_TARGETS, SEED, Target, fuzz, provider, target  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fp8_backends import fp8_linear, quant  # noqa: E402
from fp8_backends.core.errors import Fp8BackendError, UnsupportedProblemError  # noqa: E402
from fp8_backends.core.types import ActScale, GemmProblem, OutDtype, WeightScale  # noqa: E402

F64 = torch.float64

#: views of a 2-D ``[M, K]`` input (what the quant ops and the norm providers take)
KINDS_2D = ("contiguous", "transposed", "column_slice", "every_other_row", "column_step", "as_strided",
            "overlapping_rows", "broadcast_rows", "broadcast_columns")
#: ``[..., K]`` batch views (what a linear takes): their flattening to ``[M, K]`` is a view or a copy
KINDS_ND = ("batch3d", "batch3d_transposed", "batch3d_last_transposed", "batch3d_broadcast", "batch4d_permuted")


@st.composite
def view_specs(draw, batch: bool) -> dict:
    return dict(kind=draw(st.sampled_from(KINDS_2D + (KINDS_ND if batch else ()))), offset=draw(st.integers(0, 5)),
                step=draw(st.integers(2, 3)), split=draw(st.integers(0, 7)))


def _divisor(m: int, pick: int) -> int:
    divisors = [d for d in range(1, m + 1) if m % d == 0]
    return divisors[pick % len(divisors)]


def make_view(spec: dict, m: int, k: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``m`` rows of ``k`` normal values (``[..., K]`` with ``m`` rows in all for the batch kinds), laid out
    as ``spec["kind"]`` says: never row-major except ``contiguous`` and ``batch3d``."""
    kind, off, step = spec["kind"], spec["offset"], spec["step"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    if kind == "contiguous":
        return rand(m, k)
    if kind == "transposed":  # strides (1, M)
        return rand(k, m).t()
    if kind == "column_slice":  # row stride > K, a start at any element (misaligned)
        return rand(m, k + off + 3)[:, off:off + k]
    if kind == "every_other_row":
        return rand(step * m, k)[::step]
    if kind == "column_step":  # a column stride of 2 or 3
        return rand(m, step * k)[:, ::step]
    if kind in ("as_strided", "overlapping_rows"):
        col = step if kind == "as_strided" else 1
        row = k * col + off if kind == "as_strided" else max(1, k // step)  # overlapping: rows share elements
        return rand(off + (m - 1) * row + (k - 1) * col + 1).as_strided((m, k), (row, col), off)
    if kind == "broadcast_rows":  # strides (0, 1)
        return rand(1, k).expand(m, k)
    if kind == "broadcast_columns":  # strides (1, 0)
        return rand(m, 1).expand(m, k)
    b = _divisor(m, spec["split"])
    r = m // b
    if kind == "batch3d":
        return rand(b, r, k)
    if kind == "batch3d_transposed":  # the lead dims swapped: flattening copies
        return rand(r, b, k).transpose(0, 1)
    if kind == "batch3d_last_transposed":  # each batch transposed
        return rand(b, k, r).transpose(1, 2)
    if kind == "batch3d_broadcast":
        return rand(1, r, k).expand(b, r, k)
    r1 = _divisor(r, spec["split"] // 2)
    return rand(r // r1, b, r1, k).permute(1, 2, 0, 3)  # batch4d_permuted: [b, r1, r // r1, k]


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-for-bit equality (the data holds no NaN), shapes and dtypes included."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()[0].tolist()
        raise AssertionError(f"{what}: the view's result differs from its row-major copy's, first at {bad}: "
                             f"{got[tuple(bad)].item()} vs {want[tuple(bad)].item()} (FP8_FUZZ_SEED={SEED})")


def describe(spec: dict, v: torch.Tensor) -> str:
    return f"{spec['kind']} view {tuple(v.shape)} strides {v.stride()} offset {v.storage_offset()}"


# ------------------------------------------------------------------------------------------ linear
LINEAR_TARGETS = [
    target("gemm", "torch_scaled_mm", "cpu"),
    target("gemm", "triton", "cpu"),
    target("gemm", "auto", "cuda"),  # what the users ran into: auto under torch.compile
    target("gemm", "torch_scaled_mm", "cuda"),
    target("gemm", "triton", "cuda"),
    target("gemm", "flashinfer_bmm", "cuda"),
    target("gemm", "cutlass", "cuda", pytest.mark.build),
    target("gemm", "flashinfer_block@warmup=off", "cuda"),
]
#: (act, weight) scale modes a linear may be built in
MODES = ((ActScale.PER_TENSOR_STATIC, WeightScale.PER_TENSOR), (ActScale.PER_TENSOR_DYNAMIC, WeightScale.PER_TENSOR),
         (ActScale.PER_TENSOR_DYNAMIC, WeightScale.PER_CHANNEL), (ActScale.PER_TOKEN, WeightScale.PER_CHANNEL),
         (ActScale.PER_TOKEN, WeightScale.PER_TENSOR), (ActScale.PER_TOKEN_GROUP, WeightScale.BLOCK))
#: examples per (device, path); the interpreter's a fifth of the CPU's
LINEAR_EXAMPLES = {("cpu", "eager"): 60, ("cpu", "compiled"): 12, ("cuda", "eager"): 150, ("cuda", "compiled"): 25}


def _serves(spec: str, problem: GemmProblem) -> bool:
    """Whether ``spec`` resolves for ``problem`` (a skip with the registry's reason where it cannot run at all)."""
    from fp8_backends.registry.resolution import resolve_gemm_backend

    if problem.device.value == "cpu" and "triton" in spec and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton providers run on the CPU only under TRITON_INTERPRET=1 (conftest sets it)")
    try:
        resolve_gemm_backend(spec, problem=problem)
    except UnsupportedProblemError:
        return False
    except Fp8BackendError as exc:
        pytest.skip(f"{spec} on {problem.device.value}: {exc}")
    return True


def _combos(t: Target) -> list[tuple[ActScale, WeightScale, OutDtype]]:
    """The (act, weight, output dtype) combinations the target serves at an aligned shape (skip when none)."""
    combos = [(act, wsc, out) for act, wsc in MODES for out in OutDtype
              if _serves(t.spec, GemmProblem(n=256, k=256, m=8, act_scale=act, weight_scale=wsc, out_dtype=out,
                                             has_bias=True, device=t.device))]
    if not combos:
        pytest.skip(f"{t.spec} serves no linear on {t.device} here")
    return combos


@st.composite
def linear_cases(draw, combos: list, gpu: bool) -> dict:
    act, wsc, out = draw(st.sampled_from(combos))
    m_cap, nk_cap = (300, 512) if gpu else (24, 96)
    return dict(act=act, wsc=wsc, out=out, m=draw(st.integers(1, m_cap)), n=draw(st.integers(1, nk_cap)),
                k=draw(st.integers(1, nk_cap)), bias=draw(st.booleans()), view=draw(view_specs(True)),
                seed=draw(st.integers(0, 2**31 - 1)))


def _shape(t: Target, c: dict) -> tuple[int, int]:
    """The drawn N and K where the target serves them (any N and K on the CPU and for triton), else the first of
    them rounded up to 16, 64 or 128 that it serves (cuBLASLt and CUTLASS: 16; flashinfer's block kernel: N % 64,
    K % 128)."""
    n, k = c["n"], c["k"]
    for align in (1, 16, 64, 128):
        shape = (-(-n // align) * align, -(-k // align) * align)
        problem = GemmProblem(n=shape[0], k=shape[1], m=c["m"], act_scale=c["act"], weight_scale=c["wsc"],
                              out_dtype=c["out"], has_bias=c["bias"], device=t.device)
        if _serves(t.spec, problem):
            break
    return shape


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("target", LINEAR_TARGETS)
def test_fuzz_views_linear(target: Target, path: str, view_cases, exact_interpreter_casts):
    """``Fp8Linear`` and ``fp8_linear`` on a strided activation give the result of its row-major copy."""
    from fp8_backends.layers import Fp8Linear

    combos = _combos(target)
    examples = LINEAR_EXAMPLES[(target.device, path)]
    if target.device == "cpu" and target.spec == "triton":
        examples = max(1, examples // 5)

    @fuzz(examples)
    @given(linear_cases(combos, target.gpu))
    def run(c):
        gen = torch.Generator().manual_seed(c["seed"])
        n, k = _shape(target, c)
        dtype = c["out"].torch_dtype()
        v = make_view(c["view"], c["m"], k, dtype, target.device, gen)
        lin = torch.nn.Linear(k, n, bias=c["bias"]).to(dtype).to(target.device).requires_grad_(False)
        static = c["act"] is ActScale.PER_TENSOR_STATIC
        s_in = (v.float().abs().amax().clamp_min(1e-4) / 448).reshape(1) if static else None
        layer = Fp8Linear.from_linear(lin, act_scale=c["act"], weight_scale=c["wsc"], backend=target.spec,
                                      input_scale=s_in)

        def functional(t):
            return fp8_linear(t, layer.kernel, act_scale=c["act"], input_scale=layer.input_scale if static else None,
                              bias=layer.bias)

        paths = {"Fp8Linear": layer, "fp8_linear": functional}
        if path == "compiled":
            torch._dynamo.reset()
            paths = {name: torch.compile(fn, fullgraph=True) for name, fn in paths.items()}
        what = (f"{target.spec} on {target.device} ({path}): {c['act'].value} x {c['wsc'].value} -> {dtype}, "
                f"N={n} K={k} bias={c['bias']}, {describe(c['view'], v)}, data seed {c['seed']}")
        ref = v.to(F64) @ lin.weight.to(F64).t() + (lin.bias.to(F64) if c["bias"] else 0)
        # FP8 rounding errs per product term by a fraction of |x||w|: measured against the cancellation-free
        # magnitude |v| @ |W|ᵀ (+ |bias|), a few outputs that nearly cancel do not inflate the bound
        size = (v.to(F64).abs() @ lin.weight.to(F64).abs().t() + (lin.bias.to(F64).abs() if c["bias"] else 0)).norm()
        for name, fn in paths.items():
            y = fn(v)
            assert_same(y, fn(v.contiguous()), f"{name} {what}")
            err = ((y.to(F64) - ref).norm() / size.clamp_min(1e-30)).item()
            assert err < 0.1, f"{name} {what}: error {err:.3g} of the magnitude |v| @ |W|ᵀ"
            view_cases(f"{target.label}:{name}[{path}]", 1)

    with torch._dynamo.config.patch(recompile_limit=64):  # each example compiles its own graphs
        run()


# ------------------------------------------------------------------------------------------ quant ops
@st.composite
def quant_cases(draw, gpu: bool) -> dict:
    m_cap, k_cap = (300, 1024) if gpu else (40, 300)
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    return dict(mode=draw(st.sampled_from(tuple(ActScale))), m=draw(st.integers(1, m_cap)),
                k=draw(st.integers(1, k_cap)), dtype=draw(st.sampled_from(dtypes)),
                fp8=draw(st.sampled_from(("e4m3fn", "e5m2"))), group=draw(st.sampled_from((64, 128))),
                layout=draw(st.sampled_from(("row_major", "m_major", "m_major_tma"))), view=draw(view_specs(False)),
                seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("path", ["eager", "compiled-inline", "compiled-op"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fuzz_views_quant(device: str, path: str, view_cases):
    """The quant ops on a strided ``x [M, K]``: row-major codes, equal (with the scales) to its row-major copy's."""
    examples = {"eager": 150, "compiled-inline": 15, "compiled-op": 15}[path] * (2 if device == "cuda" else 1)

    @fuzz(examples)
    @given(quant_cases(device == "cuda"))
    def run(c):
        gen = torch.Generator().manual_seed(c["seed"])
        v = make_view(c["view"], c["m"], c["k"], c["dtype"], device, gen)
        static = c["mode"] is ActScale.PER_TENSOR_STATIC
        scale = (v.float().abs().amax().clamp_min(1e-4) / 448).reshape(1) if static else None

        def fn(t):
            qa = quant.quantize(t, c["mode"], scale, c["fp8"], group_size=c["group"], scale_layout=c["layout"])
            return qa.data, qa.scale

        if path != "eager":
            previous = quant.set_compile_mode(path.removeprefix("compiled-"))
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True)
        try:
            (q, s), (q0, s0) = fn(v), fn(v.contiguous())
        finally:
            if path != "eager":
                quant.set_compile_mode(previous)
        what = f"quantize {c['mode'].value} {c['fp8']} {c['dtype']} ({path}) {describe(c['view'], v)}, seed {c['seed']}"
        assert q.is_contiguous(), f"{what}: codes with strides {q.stride()}"
        assert_same(q, q0, what)
        assert_same(s, s0, f"{what} (scale)")
        view_cases(f"quant@{device}[{path}]", 1)

    with torch._dynamo.config.patch(recompile_limit=64):  # each example compiles its own graphs
        run()


# ------------------------------------------------------------------------------------------ norm-quant


@st.composite
def norm_cases(draw, dtypes: list, modes: list, residual: bool, gpu: bool) -> dict:
    t_cap, h_cap = (300, 2048) if gpu else (24, 160)
    return dict(t=draw(st.integers(1, t_cap)), h=draw(st.integers(1, h_cap)), dtype=draw(st.sampled_from(dtypes)),
                mode=draw(st.sampled_from(modes)), residual=residual and draw(st.booleans()),
                group=draw(st.sampled_from((64, 128))), view=draw(view_specs(False)),
                seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("target", NORM_TARGETS)
def test_fuzz_views_norm_quant(target: Target, path: str, view_cases, exact_interpreter_casts):
    """``rmsnorm_quant`` / ``fused_add_rmsnorm_quant`` on a strided ``x [T, H]`` give the codes (and scales, and the
    updated residual) of its row-major copy."""
    backend = provider(target)
    caps = backend.capabilities
    dtypes = sorted((d.torch_dtype() for d in caps.in_dtypes), key=str)
    modes = sorted((m for m in caps.act_scales if m is not ActScale.PER_TOKEN_GROUP or caps.group_sizes >= {64, 128}),
                   key=lambda m: m.value)
    examples = (100 if target.gpu else 60) if path == "eager" else (20 if target.gpu else 10)
    if target.device == "cpu" and backend.name == "triton":  # the interpreter: ~25 s an example on 2 CPU cores
        examples = 3 if path == "eager" else 1

    @fuzz(examples)
    @given(norm_cases(dtypes, modes, caps.residual, target.gpu))
    def run(c):
        gen = torch.Generator().manual_seed(c["seed"])
        dev, dtype = target.device, c["dtype"]
        v = make_view(c["view"], c["t"], c["h"], dtype, dev, gen)
        w = torch.randn(c["h"], generator=gen).to(dtype).to(dev)
        r = torch.randn(c["t"], c["h"], generator=gen).to(dtype).to(dev)
        static = c["mode"] is ActScale.PER_TENSOR_STATIC
        s = torch.full((1,), 0.02, device=dev) if static else None
        kw = {} if static else {"act_scale": c["mode"], "group_size": c["group"]}

        def fn(x, residual):
            if residual is None:
                qa = backend.rmsnorm_quant(x, w, s, 1e-5, **kw)
                return qa.data, qa.scale
            qa, residual = backend.fused_add_rmsnorm_quant(x, residual, w, s, 1e-5, **kw)
            return qa.data, qa.scale, residual

        if path == "compiled":
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True)
        before = v.clone()
        got = fn(v, r.clone() if c["residual"] else None)
        want = fn(v.contiguous(), r.clone() if c["residual"] else None)
        what = (f"{backend.label} on {dev} ({path}): {c['mode'].value} {dtype} T={c['t']} H={c['h']} residual="
                f"{c['residual']}, {describe(c['view'], v)}, seed {c['seed']}")
        assert got[0].is_contiguous(), f"{what}: codes with strides {got[0].stride()}"
        for name, a, b in zip(("codes", "scale", "residual"), got, want):
            assert_same(a, b, f"{what} ({name})")
        assert_same(v, before, f"{what}: x was written")
        view_cases(f"{target.label}[{path}]", 1)

    with torch._dynamo.config.patch(recompile_limit=64):  # each example compiles its own graphs
        run()
