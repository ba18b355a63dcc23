"""Block-wise FP8 through the ``triton`` providers: the GEMM provider (capabilities, prepare_weight with block scales,
gemm with group scales in every layout, config selection per mode), the norm-quant provider's dynamic modes and the
per-token-group quant op, against :mod:`fp8_backends.core.reference`.

CPU part: Triton's interpreter (named providers: ``auto`` never picks the interpreter). GPU part (``gpu`` marker): the
same calls at model sizes, ``torch.compile`` of a block linear and of the dynamic norm.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from triton_kernel_support import DEVICE, needs_kernels, relerr  # noqa: E402

from fp8_backends import quant  # noqa: E402
from fp8_backends.core import group_scales, reference  # noqa: E402
from fp8_backends.core.errors import InvalidInputError  # noqa: E402
from fp8_backends.core.types import ActScale, GemmProblem, NormQuantProblem, ScaleLayout, WeightScale  # noqa: E402
from fp8_backends.providers.triton import _support  # noqa: E402
from fp8_backends.providers.triton import block_gemm_configs as bc  # noqa: E402
from fp8_backends.providers.triton.gemm import TritonGemmBackend  # noqa: E402
from fp8_backends.providers.triton.norm_quant import TritonNormQuantBackend  # noqa: E402
from fp8_backends.registry.platform import simulate_platform  # noqa: E402
from fp8_backends.registry.resolution import resolve_gemm_backend, resolve_norm_quant_backend  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")
BLOCK = dict(act_scale="per_token_group", weight_scale="block")


def _operands(m, n, k, group=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_q, w_s = reference.quantize_block(torch.randn(n, k, generator=g) * 0.05)
    x_q, x_s = reference.quantize_per_token_group(torch.randn(m, k, generator=g) * 2, group)
    return x_q.to(DEVICE), w_q.to(DEVICE), x_s.to(DEVICE), w_s.to(DEVICE)


def _backend(config="auto", **problem):
    spec = "triton" if config == "auto" else f"triton@config={config}"
    return resolve_gemm_backend(spec, problem=GemmProblem(device=DEVICE, **{**dict(n=256, k=256, m=4, **BLOCK),
                                                                             **problem}))


# ------------------------------------------------------------------------------------ capabilities and refusals
@needs_kernels
def test_block_provider_quantizes_one_token_in_its_gemv_launch():
    """The block GEMV fuses one token's group quantization (``config=auto``: M = 1; a named GEMV config: up to its
    M; no other config, no other mode): the eager hook and the traced hook give quantize-then-``gemm_impl``'s output,
    a larger M is declined, and the host objective prices the fused call where it fuses."""
    from fp8_backends.providers.triton import group_quant_ops as gq
    from fp8_backends.registry import host_aware

    provider = _backend()
    x_q, w_q, x_s, w_s = _operands(1, 256, 384)
    prepared = provider.prepare_weight(w_q, w_s)
    assert provider.traced_fused_quant_max_m(prepared, ActScale.PER_TOKEN_GROUP) == bc.FUSED_MAX_M == 1
    assert provider.traced_fused_quant_max_m(prepared, ActScale.PER_TOKEN) == 0
    assert _backend("gemv_n2_g8_w2").traced_fused_quant_max_m(prepared, ActScale.PER_TOKEN_GROUP) == 4
    assert _backend("mm_n128_m64_s4_w4_g8_sk0").traced_fused_quant_max_m(prepared, ActScale.PER_TOKEN_GROUP) == 0
    x = (torch.randn(1, 384) * 3).to(torch.bfloat16).to(DEVICE)
    xq, xs = gq.quant_per_token_group(x, 128, torch.float8_e4m3fn, "m_major_tma")
    # bit for bit: the fused launch is its GEMV config's plain launch with the quantization inside
    want = _backend(bc.fused_shape_config(256, 384)).gemm_impl(xq, prepared, xs, torch.bfloat16, None)
    bound = provider.bind_fused_quant_gemm(prepared, ActScale.PER_TOKEN_GROUP, None, torch.bfloat16, None)
    assert torch.equal(bound(x), want)
    assert torch.equal(provider.traced_fused_quant_gemm_impl(x, prepared, ActScale.PER_TOKEN_GROUP, None,
                                                             torch.bfloat16, None), want)
    assert bound(torch.cat([x, x])) is None  # two tokens: quantize, then the table's kernel
    declined = provider.bind_fused_quant_gemm(prepared, ActScale.PER_TOKEN, None, torch.bfloat16, None)
    assert declined(x) is None  # a block weight with another activation mode never fuses
    cls = TritonGemmBackend
    assert host_aware.host_us_of(cls, 1, 256, 384, {}, block=True) == cls.block_fused_host_us
    assert host_aware.host_us_of(cls, 2, 256, 384, {}, block=True) == cls.block_host_us
    assert host_aware.host_us_of(cls, 1, 256, 384, {"config": "mm_n128_m64_s4_w4_g8_sk0"}, block=True) == \
        cls.block_host_us



@needs_kernels
def test_block_provider_fuses_in_cuda_graphs_only_where_the_fused_launch_is_the_gemm_launch():
    """Eager calls of a one-token block linear always take the fused GEMV; calls captured into a CUDA graph take it
    only where it is the launch the GEMM runs there with 8 or more rows a program (the saved quantization is then
    the whole difference); elsewhere they quantize, then run the table's GEMM."""
    provider = _backend()
    x_q, w_q, x_s, w_s = _operands(1, 256, 384)
    prepared = provider.prepare_weight(w_q, w_s)
    group = ActScale.PER_TOKEN_GROUP
    fused = bc.fused_shape_config(256, 384)
    for plain, in_graph in ((fused, True), ("gemv_n2_g8_w2", False), ("swap_n64_m16_s8_w4_sk0", False)):
        previous = bc.use_table(bc.BlockTable(default=((1, plain), (None, "mm_n128_m64_s4_w4_g8_sk0")), source="test"))
        try:
            assert provider.fuses_act_quant_for(prepared, group, False)
            assert provider.fuses_act_quant_for(prepared, group, True) is in_graph, plain
        finally:
            bc.use_table(previous)
    assert not _backend("mm_n128_m64_s4_w4_g8_sk0").fuses_act_quant_for(prepared, group, True)
    assert _backend("gemv_n8_g8_w4").fuses_act_quant_for(prepared, group, True)
    assert not _backend("gemv_n4_g4_w4").fuses_act_quant_for(prepared, group, True)  # 4 rows a program
    assert not provider.fuses_act_quant_for(prepared, ActScale.PER_TOKEN, True)


def test_capabilities_declare_block_wise_fp8_explicitly():
    caps = TritonGemmBackend.capabilities
    assert caps.block_scaled and caps.group_sizes == {64, 128} and caps.weight_blocks == {(128, 128)}
    assert caps.group_scale_layout is ScaleLayout.M_MAJOR_TMA
    assert caps.act_scales == {ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC, ActScale.PER_TOKEN,
                               ActScale.PER_TOKEN_GROUP}
    assert caps.weight_scales == {WeightScale.PER_TENSOR, WeightScale.PER_CHANNEL, WeightScale.BLOCK}
    h100 = simulate_platform("9.0")
    for group in (64, 128):
        problem = GemmProblem(n=576, k=7168, m=4, group_size=group, has_bias=True, out_dtype="float16", **BLOCK)
        assert caps.check(problem, h100) == []
    assert any("8.9" in r for r in caps.check(GemmProblem(n=576, k=7168, **BLOCK), simulate_platform("8.0")))
    assert any("weight block" in r for r in caps.check(GemmProblem(n=576, k=7168, weight_block=(64, 128), **BLOCK),
                                                       h100))
    # N, K that are not multiples of 16 (TP splits such as 3420 x 6840): served, the kernels mask them
    assert caps.check(GemmProblem(n=3420, k=6840, **BLOCK), h100) == []


def test_named_configs_serve_their_own_mode_only():
    h100 = simulate_platform("9.0")
    block_cfg = TritonGemmBackend(config="swap_n64_m16_s8_w4_sk0")
    plain_cfg = TritonGemmBackend(config="swap_n64_m16_k256_s6_w4")
    block_problem = GemmProblem(n=1536, k=7168, m=8, **BLOCK)
    plain_problem = GemmProblem(n=1536, k=7168, m=8)
    assert block_cfg.supports(block_problem, h100) == []
    assert any("this problem is not block-wise" in r for r in block_cfg.supports(plain_problem, h100))
    assert plain_cfg.supports(plain_problem, h100) == []
    assert any("this problem is block-wise" in r for r in plain_cfg.supports(block_problem, h100))
    gemv = TritonGemmBackend(config="gemv_n2_g8_w2")
    assert any("small-M" in r for r in gemv.supports(GemmProblem(n=1536, k=7168, m=64, **BLOCK), h100))
    assert TritonGemmBackend().supports(block_problem, h100) == []
    tma = TritonGemmBackend(config="tma_n128_m64_s4_w4_g8_p2")
    assert tma.gemm_impl == tma._forced_tma_gemm
    assert TritonGemmBackend.host_us_for(4096, 1536, 7168, {"config": "tma_n128_m64_s4_w4_g8_p2"}) == \
        TritonGemmBackend.tma_host_us


def test_tuner_candidates_of_a_block_problem_are_the_block_configs():
    from fp8_backends.tuning.workloads import option_combos

    h100 = simulate_platform("9.0")
    problem = GemmProblem(n=1536, k=7168, m=8, **BLOCK)
    serving = [c["config"] for c in option_combos(TritonGemmBackend)
               if TritonGemmBackend(**c).supports(problem, h100) == []]
    assert serving and set(serving) <= set(bc.CONFIG_NAMES)
    assert {bc.CONFIGS[name].family for name in serving} == {"swap", "mm", "tma"}  # GEMV stops at M = 4


# ------------------------------------------------------------------------------------ the GEMM provider (numerics)
@needs_kernels
@pytest.mark.parametrize("layout", list(ScaleLayout))
@pytest.mark.parametrize("out", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_block_gemm_through_the_provider(layout, out):
    backend = _backend()
    x_q, w_q, x_s, w_s = _operands(5, 208, 304)
    prepared = backend.prepare_weight(w_q, w_s)
    assert prepared.block == (128, 128) and prepared.group_size == 128 and prepared.scale.is_contiguous()
    bias = torch.randn(208).to(out).to(DEVICE)
    y = backend.gemm(x_q, prepared, group_scales.to_layout(x_s, layout), out_dtype=out, bias=bias)
    ref = reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32, bias)
    assert y.shape == (5, 208) and y.dtype == out
    assert relerr(y, ref) < {torch.float32: 2e-5, torch.float16: 1.5e-3, torch.bfloat16: 4e-3}[out]


@needs_kernels
@pytest.mark.parametrize("config", ["auto", "gemv_n4_g4_w4", "swap_n64_m16_s8_w4_sk0", "mm_n128_m64_s4_w4_g8_sk0",
                                    "tma_n128_m64_s4_w4_g8_p2"])
def test_block_gemm_named_configs_and_group_64(config):
    m = 1 if config.startswith("gemv") else 3
    backend = _backend(config, m=m)
    x_q, w_q, x_s, w_s = _operands(m, 144, 384, group=64)
    prepared = backend.prepare_weight(w_q, w_s.bfloat16().float(), group_size=64)
    assert prepared.group_size == 64
    y = backend.gemm(x_q, prepared, x_s, out_dtype=torch.float32)
    ref = reference.fp8_gemm(x_q, w_q, x_s, prepared.scale, torch.float32, group_size=64)
    assert relerr(y, ref) < 2e-5


@needs_kernels
def test_block_gemm_bf16_checkpoint_scales_and_errors():
    backend = _backend()
    x_q, w_q, x_s, w_s = _operands(4, 256, 384)
    prepared = backend.prepare_weight(w_q, w_s.bfloat16())
    assert prepared.scale.dtype == torch.float32
    with pytest.raises(InvalidInputError, match="per-token-group"):
        backend.gemm(x_q, prepared, torch.ones(4, 1, device=DEVICE))
    assert backend.gemm(x_q[:0], prepared, x_s[:0]).shape == (0, 256)


@needs_kernels
def test_block_gemm_unaligned_n_and_k():
    """N = 40, K = 200 (rows not 16-byte aligned, a ragged last group and block): the reference's answer."""
    backend = _backend(n=40, k=200)
    x_q, w_q, x_s, w_s = _operands(3, 40, 200)
    prepared = backend.prepare_weight(w_q, w_s)
    y = backend.gemm(x_q, prepared, x_s, out_dtype=torch.float32)
    assert relerr(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32)) < 2e-5


# ------------------------------------------------------------------------------------ norm-quant, dynamic modes
@needs_kernels
@pytest.mark.parametrize("mode", ["per_token", "per_token_group"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("layout", ["row_major", "m_major_tma"])
def test_norm_quant_dynamic_modes_through_the_provider(mode, residual, layout):
    norm = resolve_norm_quant_backend("triton", problem=NormQuantProblem(hidden=320, device=DEVICE, act_scale=mode,
                                                                         residual=residual))
    assert isinstance(norm, TritonNormQuantBackend)
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(6, 384, generator=g).to(torch.bfloat16).to(DEVICE)
    x = buf[:, :320]  # row-strided
    w = (1 + 0.2 * torch.randn(320, generator=g)).to(torch.bfloat16).to(DEVICE)
    res = torch.randn(6, 320, generator=g).to(torch.bfloat16).to(DEVICE)
    res_in = res.clone()
    if residual:
        qa, out_res = norm.fused_add_rmsnorm_quant(x, res, w, None, act_scale=mode, scale_layout=layout)
        assert out_res is res
    else:
        qa = norm.rmsnorm_quant(x, w, None, act_scale=mode, scale_layout=layout)
    q, s, new_res = reference.rmsnorm_quant_dynamic(x, w, 1e-6, act_scale=mode,
                                                    residual=res_in if residual else None)
    assert qa.mode is ActScale(mode)
    torch.testing.assert_close(qa.scale, s, rtol=4e-7, atol=0)
    off = (qa.data.view(torch.uint8) != q.view(torch.uint8)).sum().item()
    assert off <= max(2, q.numel() // 200)
    if residual:
        assert torch.equal(res, new_res)
    if mode == "per_token_group":
        assert group_scales.is_layout(qa.scale, ScaleLayout(layout))


def test_norm_quant_capabilities():
    caps = TritonNormQuantBackend.capabilities
    assert caps.act_scales == {ActScale.PER_TENSOR_STATIC, ActScale.PER_TOKEN, ActScale.PER_TOKEN_GROUP}
    assert caps.group_sizes == {64, 128}
    h100 = simulate_platform("9.0")
    assert caps.check(NormQuantProblem(hidden=7168, act_scale="per_token_group", group_size=64), h100) == []
    assert caps.check(NormQuantProblem(hidden=7168, act_scale="per_token", residual=True), h100) == []


# ------------------------------------------------------------------------------ the layers on the triton providers
@needs_kernels
@pytest.mark.parametrize("residual", [False, True])
def test_block_layers_on_the_triton_providers(residual):
    """A norm handing a block linear its group-quantized activation, both on the triton providers: the norm writes the
    layout the Triton GEMM declares (m_major_tma), the linear matches the reference."""
    from torch import nn

    from fp8_backends import QuantizedActivation
    from fp8_backends.layers import Fp8Linear, RMSNormFp8Quant

    torch.manual_seed(2)
    lin = nn.Linear(320, 256, bias=True).to(torch.bfloat16).to(DEVICE)
    layer = Fp8Linear.from_linear(lin, weight_scale="block", backend="triton")
    norm = RMSNormFp8Quant(320, quant_linear=layer, backend="triton").to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(320) + 0.5)
    norm.process_weights_after_loading()
    assert layer.gemm_backend.name == "triton" and norm.emits_quantized
    x = torch.randn(5, 320, dtype=torch.bfloat16, device=DEVICE)
    res = torch.randn(5, 320, dtype=torch.bfloat16, device=DEVICE) if residual else None
    res_in = None if res is None else res.clone()
    out = norm(x, res) if residual else norm(x)
    qa = out[0] if residual else out
    assert isinstance(qa, QuantizedActivation) and group_scales.is_layout(qa.scale, ScaleLayout.M_MAJOR_TMA)
    q, s, _ = reference.rmsnorm_quant_dynamic(x, norm.weight, norm.eps, act_scale="per_token_group", residual=res_in)
    torch.testing.assert_close(qa.scale, s, rtol=4e-7, atol=0)
    y = layer(qa)
    ref = reference.fp8_gemm(qa.data, layer.weight, qa.scale, layer.weight_scale, torch.float32, layer.bias.float())
    assert y.shape == (5, 256) and relerr(y, ref) < 4e-3


# ------------------------------------------------------------------------------------ the quant op
@pytest.mark.skipif(not _support.interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")
@pytest.mark.parametrize("layout", list(ScaleLayout))
def test_quant_op_per_token_group_with_the_triton_kernels_registered(layout):
    from fp8_backends.providers.triton import quant_kernels as qk

    saved = dict(quant._impls)
    try:
        qk.register("cpu")
        x = torch.randn(7, 300, dtype=torch.bfloat16) * 3
        q, s = quant.quantize_per_token_group(x, 128, scale_layout=layout)
        rq, rs = reference.quantize_per_token_group(x, 128)
        assert group_scales.is_layout(s, layout) and torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    finally:
        quant._impls.clear()
        quant._impls.update(saved)
        quant.reset_default_impls()


# ------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 256, 2048])
@pytest.mark.parametrize(("n", "k"), [(576, 7168), (24576, 1536), (7168, 18432)])
def test_gpu_provider_block_gemm_model_shapes(m, n, k):
    backend = _backend(n=n, k=k, m=m)
    x_q, w_q, x_s, w_s = _operands(m, n, k)
    prepared = backend.prepare_weight(w_q, w_s)
    x_s = group_scales.to_layout(x_s, ScaleLayout.M_MAJOR_TMA)
    y = backend.gemm(x_q, prepared, x_s)
    assert relerr(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32)) < 4e-3


@pytest.mark.gpu
def test_gpu_compiled_block_linear_launches_the_triton_kernel():
    from torch._inductor.utils import run_and_get_code

    backend = _backend(n=1536, k=7168, m=8)
    x = torch.randn(8, 7168, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = reference.quantize_block(torch.randn(1536, 7168, device="cuda") * 0.05)
    prepared = backend.prepare_weight(w_q, w_s)

    def linear(a):
        qa = quant.quantize(a, "per_token_group", scale_layout="m_major_tma")
        return backend.gemm(qa.data, prepared, qa.scale)

    y, codes = run_and_get_code(torch.compile(linear, fullgraph=True), x)
    x_q, x_s = reference.quantize_per_token_group(x)
    assert relerr(y, reference.fp8_gemm(x_q, w_q, x_s, w_s, torch.float32)) < 4e-3
    assert "block_gemm_" in "\n".join(codes)
