"""Block-wise FP8 in the contract: per-token-group activation scales x 128x128 block weight scales.

The problem and capability vocabulary, the reference's semantics, the group-scale layouts, the activation
quantizer, the ``torch_scaled_mm`` provider's CPU path and the ``torch`` norm-quant provider's dynamic modes.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8_backends import GemmProblem, NormQuantProblem, resolve_gemm_backend, resolve_norm_quant_backend
from fp8_backends.core import group_scales, reference
from fp8_backends.core.capabilities import GemmCapabilities
from fp8_backends.core.errors import Fp8BackendError, InvalidInputError
from fp8_backends.core.types import ActScale, DeviceKind, ScaleLayout, WeightScale
from fp8_backends.quant import quantize, quantize_per_token_group, traced_quantize_groups
from fp8_backends.registry.platform import detect_platform

FP8 = torch.float8_e4m3fn
BLOCK = {"act_scale": "per_token_group", "weight_scale": "block"}


def _loops_group_scale(x: torch.Tensor, g: int) -> torch.Tensor:
    m, k = x.shape
    out = torch.empty(m, math.ceil(k / g))
    for i in range(m):
        for j in range(out.shape[1]):
            chunk = x[i, j * g:(j + 1) * g].float()
            out[i, j] = max(chunk.abs().max().item() / 448.0, 1e-12)
    return out


# ------------------------------------------------------------------------------------------- problem
def test_block_problem_pairs_group_activations_with_block_weights():
    p = GemmProblem(n=576, k=7168, **BLOCK)
    assert p.block_scaled and p.group_size == 128 and p.weight_block == (128, 128)
    assert "per_token_group/128" in p.describe() and "block/128x128" in p.describe()
    with pytest.raises(InvalidInputError, match="pair"):
        GemmProblem(n=256, k=256, act_scale="per_token_group", weight_scale="per_tensor")
    with pytest.raises(InvalidInputError, match="pair"):
        GemmProblem(n=256, k=256, act_scale="per_token", weight_scale="block")
    with pytest.raises(InvalidInputError, match="group_size"):
        GemmProblem(n=256, k=256, group_size=32, **BLOCK)
    with pytest.raises(InvalidInputError, match="multiple of the activation group"):
        GemmProblem(n=256, k=256, group_size=128, weight_block=(128, 64), **BLOCK)
    assert GemmProblem(n=256, k=256, group_size=64, **BLOCK).group_size == 64
    # the other modes ignore the block fields
    assert GemmProblem(n=256, k=256, group_size=32).group_size == 32


def test_per_tensor_property_is_exact():
    assert ActScale.PER_TENSOR_STATIC.per_tensor and ActScale.PER_TENSOR_DYNAMIC.per_tensor
    assert not ActScale.PER_TOKEN.per_tensor and not ActScale.PER_TOKEN_GROUP.per_tensor
    assert ActScale.PER_TOKEN_GROUP.dynamic and not ActScale.PER_TENSOR_STATIC.dynamic


def test_block_mode_is_opt_in_in_capabilities():
    """A provider declaring every ActScale / WeightScale member (as one written before the mode did) but no
    group size or weight block never claims block problems."""
    old_style = GemmCapabilities(devices=frozenset({DeviceKind.CPU}), act_scales=frozenset(ActScale),
                                 weight_scales=frozenset(WeightScale))
    platform = detect_platform("cpu")
    reasons = old_style.check(GemmProblem(n=256, k=256, device="cpu", **BLOCK), platform)
    assert reasons == ["block-wise FP8 (per_token_group activations x block weights) not supported"]
    assert old_style.check(GemmProblem(n=256, k=256, device="cpu", act_scale="per_token",
                                       weight_scale="per_channel"), platform) == []
    new_style = GemmCapabilities(devices=frozenset({DeviceKind.CPU}), act_scales=frozenset(ActScale),
                                 weight_scales=frozenset(WeightScale), group_sizes=frozenset({128}),
                                 weight_blocks=frozenset({(128, 128)}))
    assert new_style.check(GemmProblem(n=256, k=256, device="cpu", **BLOCK), platform) == []
    reasons = new_style.check(GemmProblem(n=256, k=256, device="cpu", group_size=64, **BLOCK), platform)
    assert reasons == ["activation group size 64 not supported (supports 128)"]


def test_norm_problem_dynamic_modes():
    assert NormQuantProblem(hidden=64, act_scale="per_token_group").describe().endswith("per_token_group/128 on cuda")
    with pytest.raises(InvalidInputError, match="not a norm-quant mode"):
        NormQuantProblem(hidden=64, act_scale="per_tensor_dynamic")
    with pytest.raises(InvalidInputError, match="group_size"):
        NormQuantProblem(hidden=64, act_scale="per_token_group", group_size=100)


# ------------------------------------------------------------------------------------------ reference
@pytest.mark.parametrize("k", [1, 127, 128, 200, 384])
@pytest.mark.parametrize("g", [64, 128])
def test_reference_group_quant_matches_loops(k, g):
    torch.manual_seed(k + g)
    x = torch.randn(5, k, dtype=torch.bfloat16) * 3
    q, s = reference.quantize_per_token_group(x, g)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (5, math.ceil(k / g)) and s.is_contiguous()
    torch.testing.assert_close(s, _loops_group_scale(x, g), rtol=0, atol=0)
    expect = (x.float() / s.repeat_interleave(g, dim=1)[:, :k]).clamp(-448, 448).to(FP8)
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8))


def test_reference_group_quant_edges():
    x = torch.zeros(3, 130)
    x[1, 5] = float("nan")
    q, s = reference.quantize_per_token_group(x)
    assert s.shape == (3, 2) and torch.isnan(s[1, 0]) and s[1, 1] == 1e-12 and (s[0] == 1e-12).all()
    q, s = reference.quantize_per_token_group(torch.zeros(4, 0))
    assert q.shape == (4, 0) and s.shape == (4, 0)
    q, s = reference.quantize_per_token_group(torch.zeros(0, 256))
    assert q.shape == (0, 256) and s.shape == (0, 2)


@pytest.mark.parametrize("k", [256, 384, 300, 100])
def test_one_pass_group_quant_is_the_two_step_form_eager_and_compiled(k):
    """``quantize_groups`` (one reduction per group where K % G == 0) gives the bits of the scale-then-apply form
    (:func:`reference.group_scale` then :func:`reference.scaled_cast_groups`), eager and compiled by Inductor, NaN
    groups included."""
    torch.manual_seed(k)
    x = (torch.randn(5, k) * 3).to(torch.bfloat16)
    x[2, 7] = float("nan")
    fp8, fmax = torch.float8_e4m3fn, 448.0

    def two_step(x):
        scale = reference.group_scale(x, 128, fmax)
        return reference.scaled_cast_groups(x, scale, 128, fp8, fmax), scale

    want_q, want_s = two_step(x)
    compiled = torch.compile(lambda t: reference.quantize_groups(t, 128, fp8, fmax), fullgraph=True)
    for q, s in (reference.quantize_groups(x, 128, fp8, fmax), compiled(x)):
        assert q.is_contiguous() and s.is_contiguous() and s.shape == (5, -(-k // 128))
        same = (q.float() == want_q.float()) | (q.float().isnan() & want_q.float().isnan())  # a NaN's sign may differ
        assert bool(same.all()) and int(q.float().isnan().sum()) == min(128, k)  # the NaN's group, whole
        assert torch.equal(s.isnan(), want_s.isnan()) and torch.equal(s.nan_to_num(), want_s.nan_to_num())


@pytest.mark.parametrize("shape", [(128, 128), (200, 300), (576, 256), (1, 7)])
def test_reference_block_quant_round_trip(shape):
    torch.manual_seed(sum(shape))
    w = torch.randn(shape) * 0.05
    w_q, s = reference.quantize_block(w)
    n, k = shape
    assert s.shape == (math.ceil(n / 128), math.ceil(k / 128)) and w_q.is_contiguous()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j].item() == pytest.approx(max(blk.abs().max().item() / 448, 1e-12), rel=1e-6)
    back = reference.dequantize_block(w_q, s)
    assert ((back - w).abs() <= 0.0625 * w.abs() + 1e-6 + s.max() * 2 ** -9).all()


def test_reference_block_gemm_is_dequantize_then_matmul():
    torch.manual_seed(1)
    x, w = torch.randn(7, 300), torch.randn(200, 300)
    x_q, xs = reference.quantize_per_token_group(x)
    w_q, ws = reference.quantize_block(w)
    bias = torch.randn(200)
    y = reference.fp8_gemm(x_q, w_q, xs, ws, torch.float32, bias)
    xd = torch.stack([x_q[i].float() * xs[i].repeat_interleave(128)[:300] for i in range(7)])
    wd = w_q.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    torch.testing.assert_close(y, xd @ wd.t() + bias, rtol=1e-5, atol=1e-4)
    # group scales in any layout mean the same numbers
    y2 = reference.fp8_gemm(x_q, w_q, group_scales.to_layout(xs, ScaleLayout.M_MAJOR), ws, torch.float32, bias)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)


# ------------------------------------------------------------------------------------- scale layouts
@pytest.mark.parametrize("m", [0, 1, 3, 4, 9])
@pytest.mark.parametrize("layout", list(ScaleLayout))
def test_group_scale_layouts(m, layout):
    """Every layout, no tokens included (an empty scale is in every layout: its strides mean nothing)."""
    s = group_scales.empty_group_scale(m, 3, layout, "cpu")
    assert s.shape == (m, 3) and group_scales.is_layout(s, layout)
    if layout is ScaleLayout.M_MAJOR_TMA and m > 1:
        assert s.stride() == (1, group_scales.tma_stride(m)) and s.stride(1) % 4 == 0
    src = torch.arange(m * 3, dtype=torch.float32).reshape(m, 3)
    moved = group_scales.to_layout(src, layout)
    assert torch.equal(moved, src) and group_scales.is_layout(moved, layout)
    assert group_scales.to_layout(moved, layout) is moved  # already there: no copy


def test_row_major_is_not_m_major():
    s = torch.zeros(5, 3)
    assert group_scales.is_layout(s, ScaleLayout.ROW_MAJOR)
    assert not group_scales.is_layout(s, ScaleLayout.M_MAJOR)
    assert group_scales.is_layout(s.t().contiguous().t(), ScaleLayout.M_MAJOR)
    assert group_scales.is_layout(torch.zeros(5, 1), ScaleLayout.M_MAJOR)  # one group: every layout


# ---------------------------------------------------------------------------------- activation quant
@pytest.mark.parametrize("layout", list(ScaleLayout))
@pytest.mark.parametrize("g", [64, 128])
def test_quant_op_per_token_group(layout, g):
    torch.manual_seed(3)
    x = torch.randn(300, 6, dtype=torch.bfloat16).t()  # a transposed (column-major) view
    q, s = quantize_per_token_group(x, g, scale_layout=layout)
    q_ref, s_ref = reference.quantize_per_token_group(x, g)
    assert group_scales.is_layout(s, layout) and q.is_contiguous()
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    qa = quantize(x, "per_token_group", group_size=g, scale_layout=layout)
    assert qa.mode is ActScale.PER_TOKEN_GROUP and torch.equal(qa.scale, s_ref)


def test_quant_group_errors():
    with pytest.raises(InvalidInputError, match="group_size"):
        quantize_per_token_group(torch.zeros(2, 128), 32)
    with pytest.raises(InvalidInputError, match="scale layout"):
        quantize_per_token_group(torch.zeros(2, 128), 128, scale_layout="column")
    with pytest.raises(InvalidInputError, match="computes its own scale"):
        quantize(torch.zeros(2, 128), "per_token_group", torch.ones(1))


@pytest.mark.parametrize("layout", list(ScaleLayout))
def test_quant_group_compiles_to_the_same_numbers(layout):
    torch.manual_seed(4)

    def fn(x):
        return quantize_per_token_group(x * 2, 128, scale_layout=layout)

    compiled = torch.compile(fn, backend="inductor", fullgraph=True, dynamic=True)
    for m, k in [(5, 256), (8, 256), (130, 256), (3, 304)]:  # M not a multiple of 4 (m_major_tma pads), ragged K
        x = torch.randn(m, k)
        q, s = compiled(x)
        q_e, s_e = fn(x)
        assert torch.equal(s, s_e) and torch.equal(q.view(torch.uint8), q_e.view(torch.uint8))
        assert group_scales.is_layout(s, ScaleLayout(layout)) and q.shape == (m, k) and q.stride() == (k, 1)


@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 130])
@pytest.mark.parametrize("k", [256, 304])
@pytest.mark.parametrize("layout", list(ScaleLayout))
def test_traced_group_quant_writes_the_reference_in_each_layout(m, k, layout):
    """What compiled calls trace (``traced_quantize_groups``), run eagerly: the reference's bits in ``layout``, the
    codes ``[M, K]`` row-major (a view of the padded rows for ``m_major_tma``)."""
    torch.manual_seed(m + k)
    x = torch.randn(m, k, dtype=torch.bfloat16) * 3
    q, s = traced_quantize_groups(x, 128, torch.float8_e4m3fn, 448.0, layout)
    q_ref, s_ref = reference.quantize_per_token_group(x, 128)
    assert q.shape == (m, k) and (m <= 1 or q.stride() == (k, 1)) and (m == 0 or group_scales.is_layout(s, layout))
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", list(ScaleLayout))
def test_gpu_compiled_group_quant_is_its_producers_one_kernel(layout):
    """Compiled after a pointwise producer with a static M, the traced group quantization writes the codes and the
    scale in every layout from the producer's one kernel, ``m_major_tma``'s padded columns included: a layout written
    by a copy of its own would be a second launch per linear. (With a dynamic M Inductor splits it into 3 kernels
    whatever the layout: compiled layers quantize more than one token with the Triton kernel.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none visible to torch)")
    from triton_kernel_support import fp8_ordinal

    def fn(a):
        return traced_quantize_groups(a * 2, 128, torch.float8_e4m3fn, 448.0, layout)  # an exact producer

    torch._dynamo.reset()  # each layout's fn is the same code object: its compiles for the 4 M add up otherwise
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    for m in (1, 6, 128, 130):
        a = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda")
        q, s = compiled(a)  # compiles for this M
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            q, s = compiled(a)
            torch.cuda.synchronize()
        launched = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(launched) == 1, (m, launched)
        q_e, s_e = fn(a)  # eager CUDA torch divides through a reciprocal: an fp32 ulp, codes one fp8 step, rarely
        assert group_scales.is_layout(s, layout)
        torch.testing.assert_close(s, s_e, rtol=2.4e-7, atol=0)
        steps = (fp8_ordinal(q) - fp8_ordinal(q_e)).abs()
        assert int(steps.max()) <= 1 and int((steps > 0).sum()) <= max(1, q.numel() // 100)


# ------------------------------------------------------------------------------ torch_scaled_mm, CPU
def _block_weight(n, k, seed=0):
    torch.manual_seed(seed)
    return reference.quantize_block(torch.randn(n, k) * 0.05)


@pytest.mark.parametrize("n,k", [(256, 256), (208, 304), (576, 384)])
@pytest.mark.parametrize("layout", list(ScaleLayout))
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_provider_block_gemm_on_cpu(n, k, layout, out):
    backend = resolve_gemm_backend("torch_scaled_mm", problem=GemmProblem(n=n, k=k, device="cpu", **BLOCK))
    w_q, w_s = _block_weight(n, k)
    prepared = backend.prepare_weight(w_q, w_s)
    assert prepared.block == (128, 128) and prepared.group_size == 128
    x_q, x_s = reference.quantize_per_token_group(torch.randn(9, k))
    bias = torch.randn(n).to(out)
    y = backend.gemm(x_q, prepared, group_scales.to_layout(x_s, layout), out_dtype=out, bias=bias)
    ref = reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32, bias)
    assert y.dtype == out and y.shape == (9, n)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)


def test_torch_provider_block_weight_scales_may_be_bf16_and_explicit():
    backend = resolve_gemm_backend("torch", problem=GemmProblem(n=256, k=256, device="cpu", **BLOCK))
    w_q, w_s = _block_weight(256, 256)
    prepared = backend.prepare_weight(w_q, w_s.bfloat16())
    assert prepared.scale.dtype == torch.float32
    prepared = backend.prepare_weight(w_q, w_s, block=(128, 128), group_size=128)
    assert prepared.block == (128, 128)
    # an explicit block reads a [1, 1] grid as block scales (the shape alone would say per-tensor)
    small_q, small_s = reference.quantize_block(torch.randn(96, 112))
    assert backend.prepare_weight(small_q, small_s, block=(128, 128)).block == (128, 128)
    assert backend.prepare_weight(small_q, small_s).block is None


def test_torch_block_support_refuses_only_the_shapes_it_computes_wrong():
    from fp8_backends.providers.torch_block import BlockSupport

    ragged_wrong = BlockSupport(padded=False, ragged=False, ragged_why="unpadded scale rows: relative error 0.406")
    assert ragged_wrong.reason_for(512) is None and ragged_wrong.reason_for(7168) is None  # 4 and 56 column blocks
    why = ragged_wrong.reason_for(3200)  # 25 column blocks
    assert why and "ceil(K/128)=25 is not a multiple of 4" in why and "0.406" in why
    assert BlockSupport(padded=True, ragged=True).reason_for(384) is None
    none = BlockSupport(padded=None, ragged=False, why="this torch's _scaled_mm did not compute ...")
    assert none.reason_for(512) == none.reason_for(384) == "this torch's _scaled_mm did not compute ..."


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(256, 384), (640, 2432), (1024, 768), (5120, 3200), (512, 512), (576, 7168)])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_gpu_torch_provider_block_gemm_where_k_blocks_are_not_a_multiple_of_4(n, k, m):
    """cuBLASLt reads the weight's block-scale grid with rows padded to 4 columns: ceil(K/128) = 3, 19, 6, 25 are the
    shapes where a grid passed unpadded computes wrong numbers (Qwen3 TP splits, DeepSeek-V3's narrow K); the
    provider computes them right or refuses them with a reason."""
    try:
        backend = resolve_gemm_backend("torch_scaled_mm", problem=GemmProblem(n=n, k=k, m=m, **BLOCK))
    except Fp8BackendError as exc:  # refused: with the reason that says which shapes (or the whole mode)
        assert ("ceil(K/128)" in str(exc) and -(-k // 128) % 4) or "did not compute" in str(exc), str(exc)
        pytest.skip(f"torch_scaled_mm refuses this block problem here: {exc}")
    w_q, w_s = _block_weight(n, k)
    x_q, x_s = reference.quantize_per_token_group(torch.randn(m, k))
    prepared = backend.prepare_weight(w_q.cuda(), w_s.cuda())
    x_s = group_scales.to_layout(x_s.cuda(), backend.capabilities.group_scale_layout)
    y = backend.gemm(x_q.cuda(), prepared, x_s, out_dtype=torch.bfloat16)
    ref = reference.fp8_gemm(x_q, w_q, x_s.cpu(), w_s, torch.float32)
    err = float((y.float().cpu() - ref).norm() / ref.norm())
    assert err < 1e-2, f"relative error {err:.3g}"


@pytest.mark.parametrize("bad, match", [
    (lambda w_q, w_s: (w_q, w_s[:, :1]), "per-channel"),
    (lambda w_q, w_s: (w_q, w_s.double()), "float32, bfloat16 or float16"),
    (lambda w_q, w_s: (w_q, w_s.masked_fill(torch.ones_like(w_s, dtype=torch.bool), float("nan"))), "finite"),
    (lambda w_q, w_s: (w_q, -w_s), "finite and > 0"),
])
def test_torch_provider_block_prepare_errors(bad, match):
    backend = resolve_gemm_backend("torch", problem=GemmProblem(n=256, k=384, device="cpu", **BLOCK))
    w_q, w_s = _block_weight(256, 384)
    with pytest.raises(InvalidInputError, match=match):
        backend.prepare_weight(*bad(w_q, w_s))


def test_torch_provider_block_gemm_errors():
    backend = resolve_gemm_backend("torch", problem=GemmProblem(n=256, k=384, device="cpu", **BLOCK))
    w_q, w_s = _block_weight(256, 384)
    prepared = backend.prepare_weight(w_q, w_s)
    x_q, x_s = reference.quantize_per_token_group(torch.randn(4, 384))
    with pytest.raises(InvalidInputError, match="per-token-group"):
        backend.gemm(x_q, prepared, torch.ones(4, 1))
    with pytest.raises(InvalidInputError, match="per-token-group"):
        backend.gemm(x_q, prepared, torch.ones(1))
    with pytest.raises(InvalidInputError, match="float32"):
        backend.gemm(x_q, prepared, x_s.bfloat16())
    assert backend.gemm(x_q[:0], prepared, x_s[:0]).shape == (0, 256)


def test_block_problem_on_cpu_resolves_to_the_torch_provider_with_reasons_for_the_rest():
    from fp8_backends.registry import resolution

    res = resolution.explain("gemm", "auto", problem=GemmProblem(n=256, k=256, device="cpu", **BLOCK))
    assert res.backend.name == "torch_scaled_mm"
    with pytest.raises(Fp8BackendError, match="block-wise FP8"):
        resolve_gemm_backend("flashinfer_bmm", problem=GemmProblem(n=256, k=256, device="cpu", **BLOCK))


# ---------------------------------------------------------------------------- norm-quant, dynamic modes
@pytest.mark.parametrize("mode", ["per_token", "per_token_group"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("layout", ["row_major", "m_major_tma"])
def test_torch_norm_quant_dynamic_modes(mode, residual, layout):
    torch.manual_seed(5)
    h = 320
    buf = torch.randn(6, h + 64, dtype=torch.bfloat16)
    x = buf[:, :h]  # a row-strided view of a wider buffer
    w = torch.randn(h, dtype=torch.bfloat16)
    res = torch.randn(6, h, dtype=torch.bfloat16)
    res_in = res.clone()
    problem = NormQuantProblem(hidden=h, device="cpu", act_scale=mode, residual=residual)
    norm = resolve_norm_quant_backend("torch", problem=problem)
    if residual:
        qa, out_res = norm.fused_add_rmsnorm_quant(x, res, w, None, act_scale=mode, scale_layout=layout)
        assert out_res is res and torch.equal(res, (x.float() + res_in.float()).to(torch.bfloat16))
    else:
        qa = norm.rmsnorm_quant(x, w, None, act_scale=mode, scale_layout=layout)
    q, s, _ = reference.rmsnorm_quant_dynamic(x, w, 1e-6, act_scale=mode, residual=res_in if residual else None)
    assert qa.mode is ActScale(mode) and torch.equal(qa.scale, s)
    assert torch.equal(qa.data.view(torch.uint8), q.view(torch.uint8))
    if mode == "per_token_group":
        assert group_scales.is_layout(qa.scale, ScaleLayout(layout))


def test_norm_quant_dynamic_refusals():
    norm = resolve_norm_quant_backend("torch", problem=NormQuantProblem(hidden=128, device="cpu"))
    x, w = torch.randn(2, 128), torch.randn(128)
    with pytest.raises(InvalidInputError, match="must be None"):
        norm.rmsnorm_quant(x, w, torch.ones(1), act_scale="per_token")
    with pytest.raises(InvalidInputError, match="not a norm-quant mode"):
        norm.rmsnorm_quant(x, w, None, act_scale="per_tensor_dynamic")
    with pytest.raises(InvalidInputError, match="group size"):
        norm.rmsnorm_quant(x, w, None, act_scale="per_token_group", group_size=32)
    # a transposed input is no refusal: it is quantized as its row-major copy
    xt = torch.randn(128, 2).t()
    got, want = (norm.rmsnorm_quant(v, w, None, act_scale="per_token") for v in (xt, xt.contiguous()))
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(got.scale, want.scale)


def test_torch_scaled_mm_block_path_traces_scaled_mm_where_the_load_time_answer_allows(monkeypatch):
    """Compiled calls of ``torch_scaled_mm``'s block path trace the torch code (``torch._scaled_mm``) when the meta
    check made at load time passed, the op otherwise; the check answers a bool (never raises) where no CUDA is."""
    from fp8_backends.providers import torch_block

    calls: list[str] = []
    monkeypatch.setattr(torch_block, "_run", lambda *args: calls.append("torch code") or "torch code")
    monkeypatch.setattr(torch_block, "cuda_gemm", lambda *args: calls.append("op") or "op")
    args = (None, None, None, None, None, torch.bfloat16)
    monkeypatch.setattr(torch_block, "_traced", [True])
    assert torch_block.traced_gemm(*args) == "torch code"
    monkeypatch.setattr(torch_block, "_traced", [False])
    assert torch_block.traced_gemm(*args) == "op"
    assert calls == ["torch code", "op"]
    monkeypatch.setattr(torch_block, "_traced", [None])
    assert torch_block.traced_support(False) in (True, False)


@pytest.mark.parametrize("k", [96, 128, 256])
def test_the_reference_gemm_takes_no_tokens_with_one_scale_column(k):
    """``M = 0`` with an activation scale of one column (groups: ``K <= 128``; per token: ``[0, 1]``)."""
    w_q, w_s = reference.quantize_block(torch.randn(160, k))
    x_q, x_s = reference.quantize_per_token_group(torch.randn(0, k))
    assert reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.bfloat16).shape == (0, 160)
    t_q, t_s = reference.quantize_per_token(torch.randn(0, k))
    c_q, c_s = reference.quantize_per_token(torch.randn(64, k))
    assert reference.fp8_gemm(t_q, c_q, t_s, c_s.reshape(-1), torch.bfloat16).shape == (0, 64)
