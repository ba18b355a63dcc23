"""Property-based fuzzing (hypothesis) of every provider, the functional linear, the quant ops and the norm-quant
against a float64 reference with worst-case error bounds.

**Why float64 and these bounds.** FP8 inputs, fp32 scales and bf16/fp16/fp32 biases are exact in float64, and so
are their products and sums at these sizes to within ``γ_K(2^-53)`` (kept in the bound anyway). A provider computes
in fp32 (or, on Hopper tensor cores, with a narrower accumulator), so its only errors are the roundings of the
computation and of the output:

- GEMM (``y = (x_q·s_x)(w_q·s_w)ᵀ + b``): with ``S_ij = Σ_k |x_ik s_x w_jk s_w| + |b_j|`` and ``r`` the float64
  result, ``|y_ij − r_ij| ≤ E + 2u_out(|r_ij| + E) + tiny_out`` where ``E = γ_{K+8}(u_acc)·S_ij + γ_K(2^-53)·S_ij``
  (``γ_n(u) = nu / (1 − nu)``: K accumulations plus up to 8 roundings for scaling, scale products, the epilogue
  and the bias; Higham's bound, valid in any summation order), ``u_acc = 2^-24`` (fp32) on the CPU and ``2^-13`` on
  GPUs (Hopper's FP8 tensor cores keep about 14 bits in their partial sums), ``2u_out`` one ulp of the output type
  (round-to-nearest needs half; the Triton interpreter truncates) and ``tiny_out`` its smallest subnormal.
- Quantization: ``q = clamp(x/s, ±max) → fp8`` is within ``½ ulp_fp8 + 2^-24·|x/s|`` of the exact ``clamp(x/s)``
  (the fp32 division first); dynamic scales are ``max(amax/max, 1e-12)`` to within 2^-22 relative.
- The functional linear adds the quantization error of its input: ``Σ_k qerr_ik |w_jk s_w|`` with
  ``qerr ≤ s·(2^-(p+1)·|x/s| + ½ subnormal ulp)·(1 + 2^-20) + saturation`` (``p`` mantissa bits).
- RMSNorm + quant: ``q`` is within ``½ ulp_fp8(|v|(1+δ)) + δ|v|`` of ``v = clamp(rmsnorm(x)·w / s, ±448)``, with
  ``δ = (H + 24)·2^-24`` for fp32 math (H squares summed, rsqrt, three products, the division; plus ``2^-7`` on
  GPUs for kernels that round an intermediate to the input type); the updated residual within one ulp of
  ``x + residual``.

**How many.** Each hypothesis example draws a list of problems; GEMM problems are packed block-diagonally into one
call (``x`` ``[Σm, Σk]``, ``w`` ``[Σn, Σk]``: each problem's result is a diagonal block and every off-diagonal block
must be exactly the bias), some run alone (odd shapes, M = 1 paths); RMSNorm rows are independent problems, several
per call. Every run counts the problems per provider and prints them at the end of the session ("fuzz cases").
``FP8_FUZZ_SEED`` (default 20261130) seeds every test; a failure prints the seed, hypothesis' ``@reproduce_failure``
blob and the failing problem. ``FP8_FUZZ_SCALE`` multiplies the example counts (``0.1`` for a quick run).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")

from fuzz_support import NORM_TARGETS, SEED, Target, fuzz, provider  # noqa: E402
from fuzz_support import target as _target  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fp8_backends import fp8_linear, quant  # noqa: E402
from fp8_backends.core.types import ActScale, Fp8Dtype, GemmProblem, WeightScale  # noqa: E402

CUDA = torch.cuda.is_available()
F64 = torch.float64

FP8 = {"e4m3fn": (torch.float8_e4m3fn, 448.0, 3, -6), "e5m2": (torch.float8_e5m2, 57344.0, 2, -14)}
OUT = {torch.bfloat16: (2.0**-8, 2.0**-133), torch.float16: (2.0**-11, 2.0**-24), torch.float32: (2.0**-24, 2.0**-149)}
STYLES = ("normal", "wide", "saturate", "tiny", "sparse", "integers")


def gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u)


def fp8_ulp(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Spacing of the FP8 grid at ``|v|`` (float64), subnormals included."""
    _, _, mant, emin = FP8[fmt]
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**emin)))
    return torch.pow(2.0, e - mant)


def data(gen: torch.Generator, shape: tuple[int, ...], style: str, amp: float = 1.0) -> torch.Tensor:
    """fp32 test data of one style (special values included: saturating, subnormal, zeros, exact integers)."""
    if style == "normal":
        t = torch.randn(shape, generator=gen)
    elif style == "wide":  # values spread over 2^-12 .. 2^10
        t = torch.randn(shape, generator=gen).sign() * torch.pow(2.0, torch.rand(shape, generator=gen) * 22 - 12)
    elif style == "saturate":
        t = torch.randn(shape, generator=gen) * 4000
    elif style == "tiny":
        t = torch.randn(shape, generator=gen) * 2.0**-8
    elif style == "sparse":
        t = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.15)
    else:
        t = torch.randint(-8, 9, shape, generator=gen).float()
    return t * amp


def random_scale(gen: torch.Generator, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Positive fp32 scales with random mantissas over 2^lo .. 2^hi."""
    mant = 1 + torch.rand(shape, generator=gen)
    return (mant * torch.pow(2.0, torch.randint(lo, hi + 1, shape, generator=gen).float())).float()


# ------------------------------------------------------------------------------------------ providers
GEMM_TARGETS = [
    _target("gemm", "torch_scaled_mm", "cpu"),
    _target("gemm", "triton", "cpu"),
    _target("gemm", "torch_scaled_mm", "cuda"),
    _target("gemm", "triton", "cuda"),
    _target("gemm", "flashinfer_bmm", "cuda"),
    # one small-M config: its 6 libraries (2 epilogues x 3 output types) build in ~1-2 min on first use
    _target("gemm", "cutlass@config=ws64x16_swap", "cuda", pytest.mark.build),
]


# ------------------------------------------------------------------------------------------ GEMM
@dataclass
class Limits:
    """Pack limits per call (sum of the packed problems' sizes) and per problem."""

    m: int
    n: int
    k: int
    problems: int
    solo_m: int  # a problem run alone: M up to this


#: torch._scaled_mm on the CPU costs ~M·N·K (its per-tensor path ~30 M MAC/s): packing would only add work, so
#: its problems run one per call; a Triton interpreter call costs ~6 ms per 16x64x256 program: fill one with 4
CPU_LIMITS = {"torch_scaled_mm": Limits(16, 64, 128, 1, 32), "triton": Limits(16, 64, 256, 4, 16)}
GPU_LIMITS = Limits(64, 256, 512, 8, 300)
#: (examples, calls per example) per test: >= 10,000 problems per CPU provider
GEMM_EXAMPLES = {"torch_scaled_mm": (1000, 10), "triton": (700, 4)}


@st.composite
def gemm_calls(draw, combos: list[tuple], limits: Limits, n_calls: int, align: tuple[int, int] = (16, 16)
               ) -> list[dict]:
    """``n_calls`` calls; each: one supported (act, weight, out, fp8, bias) combination and ``limits.problems``
    problems packed (one in a tenth of the calls: a solo problem, up to ``limits.solo_m`` rows), each problem's N and
    K multiples of ``align`` (the provider's alignment on the device: 1 where it serves any N and K)."""
    na, ka = align
    calls = []
    for _ in range(n_calls):
        act, wsc, out, fp8, bias = draw(st.sampled_from(combos))
        solo = draw(st.integers(0, 9)) == 0
        count = 1 if solo else limits.problems
        m_cap = limits.solo_m if solo else max(1, limits.m // count)
        n_cap, k_cap = max(1, limits.n // count // na), max(1, limits.k // count // ka)
        problems = [dict(m=draw(st.integers(1, m_cap)), n=na * draw(st.integers(1, n_cap)),
                         k=ka * draw(st.integers(1, k_cap)), x_style=draw(st.sampled_from(STYLES)),
                         w_style=draw(st.sampled_from(STYLES))) for _ in range(count)]
        calls.append(dict(act=act, wsc=wsc, out=out, fp8=fp8, bias=bias, problems=problems,
                          seed=draw(st.integers(0, 2**31 - 1))))
    return calls


def _gemm_combos(backend, device: str) -> list[tuple]:
    from fp8_backends.registry.platform import detect_platform

    caps, platform, combos = backend.capabilities, detect_platform(device), []
    for act in (ActScale.PER_TENSOR_STATIC, ActScale.PER_TOKEN):
        for wsc in caps.weight_scales - {WeightScale.BLOCK}:  # block-wise FP8: test_fuzz_block_gemm
            for out in caps.out_dtypes:
                for fp8 in caps.input_dtypes:
                    for bias in (False, True):
                        problem = GemmProblem(n=64, k=64, m=8, act_scale=act, weight_scale=wsc, out_dtype=out,
                                              input_dtype=fp8, weight_dtype=fp8, has_bias=bias, device=device)
                        if not backend.supports(problem, platform):
                            combos.append((act, wsc, out, fp8, bias))
    assert combos, f"{backend.label} serves nothing here"
    return sorted(combos, key=str)


def build_gemm_call(call: dict, device: str):
    """Packed operands (fp8 x / w with zeros off the diagonal blocks, scales, bias) and the float64 reference."""
    gen = torch.Generator().manual_seed(call["seed"])
    fp8_dtype, fmax, _, _ = FP8[call["fp8"].value]
    out = call["out"].torch_dtype()
    probs = call["problems"]
    mt, nt, kt = (sum(p[d] for p in probs) for d in "mnk")
    x = torch.zeros(mt, kt)
    w = torch.zeros(nt, kt)
    mo = no = ko = 0
    for p in probs:
        x[mo:mo + p["m"], ko:ko + p["k"]] = data(gen, (p["m"], p["k"]), p["x_style"], fmax / 8)
        w[no:no + p["n"], ko:ko + p["k"]] = data(gen, (p["n"], p["k"]), p["w_style"], fmax / 8)
        mo, no, ko = mo + p["m"], no + p["n"], ko + p["k"]
    x_q, w_q = x.clamp(-fmax, fmax).to(fp8_dtype), w.clamp(-fmax, fmax).to(fp8_dtype)  # e5m2 has inf: clamp first
    per_token = call["act"] is ActScale.PER_TOKEN
    x_s = random_scale(gen, (mt, 1) if per_token else (1,), -14, -2)
    w_s = random_scale(gen, (nt,) if call["wsc"].value == "per_channel" else (1,), -14, -2)
    bias = (data(gen, (nt,), "normal", 4.0).to(out) if call["bias"] else None)
    xd, wd = x_q.to(F64) * x_s.to(F64).reshape(-1, 1), w_q.to(F64) * w_s.to(F64).reshape(-1, 1)
    if out == torch.float16:  # keep |y| inside fp16's range: scale x_s down by a power of two (exact)
        peak = float((xd.abs() @ wd.abs().t()).max()) + (float(bias.abs().max()) if bias is not None else 0.0)
        if peak > 3e4:
            shift = 2.0 ** -math.ceil(math.log2(peak / 3e4))
            x_s, xd = x_s * shift, xd * shift
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    if bias is not None:
        ref, mag = ref + bias.to(F64), mag + bias.to(F64).abs()
    to = {"device": device}
    return (x_q.to(**to), w_q.to(**to), x_s.to(**to), w_s.to(**to), None if bias is None else bias.to(**to),
            out, ref, mag, kt)


def gemm_bound(ref: torch.Tensor, mag: torch.Tensor, k: int, out: torch.dtype, gpu: bool) -> torch.Tensor:
    """The worst-case error bound of the module docstring, elementwise."""
    u_acc = 2.0**-13 if gpu else 2.0**-24
    u_out, tiny = OUT[out]
    e = (gamma(k + 8, u_acc) + gamma(k, 2.0**-53)) * mag
    return e + 2 * u_out * (ref.abs() + e) + tiny


def check_close(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (y.to(F64).cpu() - ref).abs()
    bad = ~(err <= bound)  # NaN fails too
    if bool(bad.any()):
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} outside the bound; first at {i}: got {float(y[i])}, "
            f"float64 reference {float(ref[i])}, bound {float(bound[i]):.3g} (FP8_FUZZ_SEED={SEED})")


# the interpreter converts whole fp16 tiles, masked-out lanes included (never stored): numpy warns about those
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("target", GEMM_TARGETS)
def test_fuzz_gemm(target: Target, fuzz_cases, exact_interpreter_casts):
    backend = provider(target)
    name = backend.name
    limits = GPU_LIMITS if target.gpu else CPU_LIMITS[name]
    combos = _gemm_combos(backend, target.device)
    examples, n_calls = (300, 10) if target.gpu else GEMM_EXAMPLES[name]

    @fuzz(examples)
    @given(gemm_calls(combos, limits, n_calls, alignment(backend, target.device)))
    def run(calls):
        for call in calls:
            x_q, w_q, x_s, w_s, bias, out, ref, mag, k = build_gemm_call(call, target.device)
            prepared = backend.prepare_weight(w_q, w_s)
            y = backend.gemm(x_q, prepared, x_s, out_dtype=out, bias=bias)
            what = (f"{backend.label} on {target.device}: {call['act'].value} x {call['wsc'].value} "
                    f"{call['fp8'].value} -> {out}, bias={call['bias']}, problems "
                    f"{[(p['m'], p['n'], p['k'], p['x_style'], p['w_style']) for p in call['problems']]}, "
                    f"data seed {call['seed']}")
            check_close(y, ref, gemm_bound(ref, mag, k, out, target.gpu), what)
            fuzz_cases(target.label, len(call["problems"]))

    run()


# ------------------------------------------------------------------------------------------ block-wise GEMM
BLOCK_TARGETS = [
    _target("gemm", "torch_scaled_mm", "cpu"),
    _target("gemm", "triton", "cpu"),
    _target("gemm", "torch_scaled_mm", "cuda"),
    _target("gemm", "triton", "cuda"),
    _target("gemm", "cutlass", "cuda", pytest.mark.build),
    # each new (N, K) and tile config compiles a DeepGEMM kernel (seconds): no decode warm-up of every fuzzed weight
    _target("gemm", "flashinfer_block@warmup=off", "cuda"),
]
#: (examples, problems per example) per target: CPU problems are small (600 per CPU provider, a tenth of that under
#: Triton's interpreter)
BLOCK_EXAMPLES = {"cpu": (60, 10), "cuda": (60, 10)}


def _block_backend(target: Target):
    """The provider for block problems, or a skip with the registry's reasons."""
    from fp8_backends.core.errors import Fp8BackendError
    from fp8_backends.registry.resolution import resolve_gemm_backend

    if target.device == "cpu" and "triton" in target.spec and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the triton providers run on the CPU only under TRITON_INTERPRET=1 (conftest sets it)")
    try:
        return resolve_gemm_backend(target.spec, problem=GemmProblem(
            n=256, k=256, m=8, act_scale="per_token_group", weight_scale="block", device=target.device))
    except Fp8BackendError as exc:
        pytest.skip(f"{target.spec} on {target.device}: {exc}")


def alignment(backend, device: str) -> tuple[int, int]:
    """``(N, K)`` multiples the provider needs on ``device`` (its capabilities' alignment where it applies, else 1)."""
    from fp8_backends.core.types import DeviceKind

    caps = backend.capabilities
    return (caps.n_align, caps.k_align) if DeviceKind(device) in caps.align_devices else (1, 1)


@st.composite
def block_problems(draw, gpu: bool, n_problems: int, align: int = 16) -> list[dict]:
    """Shapes with ragged 128-blocks where the provider's alignment allows (N, K multiples of ``align``: 1 for
    torch's CPU path, which serves any N and K), any M, every output type it declares, a bias or not, and the scale
    layouts a caller may hand it."""
    m_cap, nk_cap = (300, 24) if gpu else (24, 12)
    return [dict(m=draw(st.integers(1, m_cap)), n=align * draw(st.integers(1, nk_cap * 16 // align)),
                 k=align * draw(st.integers(1, nk_cap * 16 // align)),
                 x_style=draw(st.sampled_from(STYLES)), w_style=draw(st.sampled_from(STYLES)),
                 layout=draw(st.sampled_from(("row_major", "m_major", "m_major_tma"))), bias=draw(st.booleans()),
                 out=draw(st.sampled_from(("bfloat16", "float16", "float32"))), seed=draw(st.integers(0, 2**31 - 1)))
            for _ in range(n_problems)]


def build_block_call(p: dict, device: str):
    """fp8 operands, per-token-group activation scales [M, ceil(K/128)] and 128x128 weight block scales with random
    powers of two, and the float64 reference with its magnitude sums (the fuzz's error-bound inputs)."""
    from fp8_backends.core import group_scales
    from fp8_backends.core.types import ScaleLayout

    gen = torch.Generator().manual_seed(p["seed"])
    m, n, k = p["m"], p["n"], p["k"]
    kb, nb = -(-k // 128), -(-n // 128)
    x_q = data(gen, (m, k), p["x_style"], 56.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    w_q = data(gen, (n, k), p["w_style"], 56.0).clamp(-448, 448).to(torch.float8_e4m3fn)
    x_s, w_s = random_scale(gen, (m, kb), -14, -4), random_scale(gen, (nb, kb), -14, -4)
    out = getattr(torch, p["out"])
    bias = data(gen, (n,), "normal", 4.0).to(out) if p["bias"] else None
    xd = x_q.to(F64) * x_s.to(F64).repeat_interleave(128, 1)[:, :k]
    wd = w_q.to(F64) * w_s.to(F64).repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    if out == torch.float16:  # keep |y| inside fp16's range (exact power-of-two rescale of x's scales)
        peak = float((xd.abs() @ wd.abs().t()).max()) + (float(bias.abs().max()) if bias is not None else 0.0)
        if peak > 3e4:
            shift = 2.0 ** -math.ceil(math.log2(peak / 3e4))
            x_s, xd = x_s * shift, xd * shift
    ref, mag = xd @ wd.t(), xd.abs() @ wd.abs().t()
    if bias is not None:
        ref, mag = ref + bias.to(F64), mag + bias.to(F64).abs()
    x_s = group_scales.to_layout(x_s.to(device), ScaleLayout(p["layout"]))
    return (x_q.to(device), w_q.to(device), x_s, w_s.to(device), None if bias is None else bias.to(device), out,
            ref, mag)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("target", BLOCK_TARGETS)
def test_fuzz_block_gemm(target: Target, fuzz_cases, exact_interpreter_casts):
    """Block-wise FP8 (1x128 activation groups x 128x128 weight blocks) against float64, every scale layout, ragged
    edges, bias, every output type the provider serves (others must be refused with the library's error)."""
    from fp8_backends.core.errors import InvalidInputError

    backend = _block_backend(target)
    examples, per_example = BLOCK_EXAMPLES[target.device]
    if target.device == "cpu" and "triton" in target.spec:
        examples = max(1, examples // 5)

    @fuzz(examples)
    @given(block_problems(target.gpu, per_example, max(alignment(backend, target.device))))
    def run(problems):
        for p in problems:
            problem = GemmProblem(n=p["n"], k=p["k"], m=p["m"], act_scale="per_token_group", weight_scale="block",
                                  out_dtype=p["out"], has_bias=p["bias"], device=target.device)
            x_q, w_q, x_s, w_s, bias, out, ref, mag = build_block_call(p, target.device)
            if backend.supports(problem):
                with pytest.raises(InvalidInputError):
                    backend.gemm(x_q, backend.prepare_weight(w_q, w_s), x_s, out_dtype=out, bias=bias)
                continue
            y = backend.gemm(x_q, backend.prepare_weight(w_q, w_s), x_s, out_dtype=out, bias=bias)
            what = (f"{backend.label} on {target.device}: block M={p['m']} N={p['n']} K={p['k']} -> {out}, "
                    f"bias={p['bias']}, scales {p['layout']}, styles {p['x_style']}/{p['w_style']}, seed {p['seed']}")
            check_close(y, ref, gemm_bound(ref, mag, p["k"], out, target.gpu), what)
            fuzz_cases(target.label + "-block", 1)

    run()


# ------------------------------------------------------------------------------------------ functional linear
@st.composite
def linear_cases(draw, combos: list[tuple]) -> list[dict]:
    return [dict(combo=draw(st.sampled_from(combos)), m=draw(st.integers(1, 8)), n=16 * draw(st.integers(1, 3)),
                 k=16 * draw(st.integers(1, 4)), x_style=draw(st.sampled_from(STYLES)),
                 w_style=draw(st.sampled_from(("normal", "wide", "integers", "sparse"))),
                 seed=draw(st.integers(0, 2**31 - 1))) for _ in range(10)]


def _quant_error(x: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    """Upper bound of ``|q·s − x|`` for ``q = fp8(clamp(x/s))`` (float64; ``s`` broadcast, already an upper bound
    of the library's scale)."""
    _, fmax, mant, emin = FP8[fmt]
    v = x / s
    sat = (v.abs() - fmax).clamp_min(0) * s
    half_sub = 2.0 ** (emin - mant - 1)
    return sat + s * (2.0 ** -(mant + 1) * v.abs().clamp_max(fmax) + half_sub) * (1 + 2.0**-20) + 2.0**-24 * x.abs()


@pytest.mark.parametrize("target", [t for t in GEMM_TARGETS if "torch_scaled_mm" in t.values[0].spec])
def test_fuzz_functional_linear(target: Target, fuzz_cases):
    """``fp8_linear(x, prepared, backend=...)`` in every activation mode (static, dynamic, per-token) against
    ``x @ Wᵀ + b`` in float64 with the input's quantization error in the bound."""
    from fp8_backends.core import reference

    backend = provider(target)
    modes = (ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC, ActScale.PER_TOKEN)
    combos = [(mode, wsc, out, bias) for mode in modes for (act, wsc, out, fp8, bias) in
              _gemm_combos(backend, target.device) if fp8 is Fp8Dtype.E4M3FN
              and (act is ActScale.PER_TOKEN) == (mode is ActScale.PER_TOKEN)]

    @fuzz(300 if target.gpu else 1000)
    @given(linear_cases(combos))
    def run(cases):
        for c in cases:
            mode, wsc, out, has_bias = c["combo"]
            dtype = out.torch_dtype()
            gen = torch.Generator().manual_seed(c["seed"])
            x = data(gen, (c["m"], c["k"]), c["x_style"])
            w = data(gen, (c["n"], c["k"]), c["w_style"])
            w_q, w_s = (reference.quantize_per_token(w) if wsc.value == "per_channel"
                        else reference.quantize_dynamic_per_tensor(w))
            w_s = w_s.reshape(-1)
            peak = float((x.abs() @ (w_q.float() * w_s.reshape(-1, 1)).abs().t()).max())
            if dtype == torch.float16 and peak > 1e4:  # keep |y| inside fp16's range (a power of two: exact)
                x = x * 2.0 ** -math.ceil(math.log2(peak / 1e4))
            x = x.to(dtype)
            bias = data(gen, (c["n"],), "normal").to(dtype) if has_bias else None
            x64 = x.to(F64)
            if mode is ActScale.PER_TENSOR_STATIC:
                s_in = random_scale(gen, (1,), -9, 0)
                s_hi = s_in.to(F64)
            elif mode is ActScale.PER_TENSOR_DYNAMIC:
                s_in, s_hi = None, (x64.abs().amax() / 448).clamp_min(1e-12) * (1 + 2.0**-21)
            else:
                s_in, s_hi = None, (x64.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-12) * (1 + 2.0**-21)
            dev = target.device
            prepared = backend.prepare_weight(w_q.to(dev), w_s.to(dev))
            y = fp8_linear(x.to(dev), prepared, backend=backend, act_scale=mode,
                           input_scale=None if s_in is None else s_in.to(dev),
                           bias=None if bias is None else bias.to(dev))
            wd = w_q.to(F64) * w_s.to(F64).reshape(-1, 1)
            ref = x64 @ wd.t() + (bias.to(F64) if bias is not None else 0)
            qerr = _quant_error(x64, s_hi, "e4m3fn")
            mag = (x64.abs() + qerr) @ wd.abs().t() + (bias.to(F64).abs() if bias is not None else 0)
            u_acc = 2.0**-13 if target.gpu else 2.0**-24
            e = qerr @ wd.abs().t() + (gamma(c["k"] + 8, u_acc) + gamma(c["k"], 2.0**-53)) * mag
            u_out, tiny = OUT[dtype]
            bound = e + 2 * u_out * (ref.abs() + e) + tiny
            check_close(y, ref, bound, f"fp8_linear {backend.label} {mode.value} x {wsc.value} -> {dtype}, "
                                       f"bias={has_bias}, case {c}")
            fuzz_cases(f"fp8_linear[{target.spec}]@{dev}", 1)

    run()


# ------------------------------------------------------------------------------------------ quant ops
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["per_tensor_static", "per_tensor_dynamic", "per_token"])
def test_fuzz_quant_ops(mode: str, device: str, fuzz_cases):
    """``fp8_backends.quant.quantize`` (the library's quant ops: the reference on the CPU, the Triton kernels on
    CUDA): scales and codes against float64."""
    act = ActScale(mode)

    @fuzz(500 if device == "cpu" else 150)
    @given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 96), st.sampled_from(STYLES),
                              st.sampled_from((torch.bfloat16, torch.float16, torch.float32)),
                              st.sampled_from(tuple(FP8)), st.integers(0, 2**31 - 1)), min_size=20, max_size=20))
    def run(cases):
        for m, k, style, dtype, fmt, data_seed in cases:
            gen = torch.Generator().manual_seed(data_seed)
            x = data(gen, (m, k), style).to(dtype)
            x64 = x.to(F64)
            fp8_dtype, fmax, _, _ = FP8[fmt]
            scale = random_scale(gen, (1,), -9, 0) if act is ActScale.PER_TENSOR_STATIC else None
            qa = quant.quantize(x.to(device), act, None if scale is None else scale.to(device), fmt)
            s = qa.scale.to(F64).cpu()
            what = f"quantize {mode} {fmt} {dtype} [{m}, {k}] style {style} data seed {data_seed} (seed {SEED})"
            if act is not ActScale.PER_TENSOR_STATIC:
                amax = x64.abs().amax(-1, keepdim=True) if act is ActScale.PER_TOKEN else x64.abs().amax()
                want = (amax / fmax).clamp_min(1e-12)
                assert bool((((s.reshape(want.shape) - want).abs() <= 2.0**-22 * want)).all()), what
            assert qa.data.dtype == fp8_dtype and tuple(qa.data.shape) == (m, k), what
            v = (x64 / s.reshape(-1, 1) if s.numel() > 1 else x64 / s).clamp(-fmax, fmax)
            q = qa.data.cpu().to(F64)
            bound = 0.5 * fp8_ulp(torch.maximum(v.abs(), q.abs()), fmt) * (1 + 2.0**-20) + 2.0**-24 * v.abs()
            check_close(q, v, bound, what)
            fuzz_cases(f"quant[{mode}]@{device}", 1)

    run()


# ------------------------------------------------------------------------------------------ norm-quant
NORM_EXAMPLES = {"torch": 60, "triton": 75}  # x 4 calls x ~3/4 max_t rows: >= 10,000 rows


@st.composite
def norm_calls(draw, dtypes: list, residual: bool, max_t: int) -> list[dict]:
    return [dict(t=draw(st.integers(max_t // 2, max_t)), h=draw(st.integers(1, 160)),
                 dtype=draw(st.sampled_from(dtypes)),
                 x_style=draw(st.sampled_from(STYLES)), w_style=draw(st.sampled_from(("normal", "wide", "integers"))),
                 eps=draw(st.sampled_from((1e-6, 1e-5, 1e-3, 0.5))), residual=residual and draw(st.booleans()),
                 scale_exp=draw(st.integers(-12, 3)), seed=draw(st.integers(0, 2**31 - 1)))
            for _ in range(4)]


@pytest.mark.parametrize("target", NORM_TARGETS)
def test_fuzz_norm_quant(target: Target, fuzz_cases, exact_interpreter_casts):
    """``rmsnorm_quant`` / ``fused_add_rmsnorm_quant``: every row is one problem (its own values; weight, scale and
    eps shared by the call's rows)."""
    backend = provider(target)
    caps = backend.capabilities
    dtypes = sorted((d.torch_dtype() for d in caps.in_dtypes), key=str)
    max_t = 64 if target.gpu else {"torch": 64, "triton": 48}[backend.name]
    examples = 100 if target.gpu else NORM_EXAMPLES[backend.name]
    dev = target.device

    @fuzz(examples)
    @given(norm_calls(dtypes, caps.residual, max_t))
    def run(calls):
        for c in calls:
            gen = torch.Generator().manual_seed(c["seed"])
            t, h, dtype = c["t"], c["h"], c["dtype"]
            x = data(gen, (t, h), c["x_style"]).to(dtype)
            w = data(gen, (h,), c["w_style"]).to(dtype)
            scale = random_scale(gen, (1,), c["scale_exp"], c["scale_exp"])
            x64, w64 = x.to(F64), w.to(F64)
            if c["residual"]:
                r = data(gen, (t, h), "normal").to(dtype)
                total = x64 + r.to(F64)
                res = r.to(dev)
                qa, res = backend.fused_add_rmsnorm_quant(x.to(dev), res, w.to(dev), scale.to(dev), c["eps"])
                u, tiny = OUT[dtype]
                check_close(res, total, 2 * u * total.abs() + tiny, f"{backend.label} residual {c}")
            else:
                total = x64
                qa = backend.rmsnorm_quant(x.to(dev), w.to(dev), scale.to(dev), c["eps"])
            normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + c["eps"]) * w64
            v = (normed / scale.to(F64)).clamp(-448, 448)
            delta = (h + 24) * 2.0**-24 + (2.0**-7 if target.gpu else 0.0) + (2.0**-24 if c["residual"] else 0)
            q = qa.data.cpu().to(F64)
            bound = 0.5 * fp8_ulp(torch.maximum(v.abs() * (1 + delta), q.abs()), "e4m3fn") + delta * v.abs()
            check_close(q, v, bound, f"{backend.label} on {dev}: {c} (seed {SEED})")
            fuzz_cases(target.label, t)

    run()

