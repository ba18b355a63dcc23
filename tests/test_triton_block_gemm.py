"""The block-scaled Triton FP8 GEMM (``providers/triton/block_gemm_*.py``): configs, table and launch plan, and every
kernel family against the fp32 reference (``tests/block_reference.py``).

CPU part: the kernels on Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py without a GPU) at small
sizes: ragged M, N and K (N = 200, 342, 576-like; K = 200, 520, 684: not multiples of 16 or 128), every activation
scale layout, strided operands, group size 64, bias, bf16/fp16/fp32 outputs, e5m2, NaN rows, split K. A module fixture
makes the interpreter's float conversions exact, so the bounds are the accumulation's: fp32 output ~1e-6 relative,
bf16 output its rounding (~1e-3). GPU part (``gpu`` marker): the DeepSeek-V3 / Qwen3 shapes per config and M, CUDA
graphs, PDL on and off, ``torch.compile`` through the ``triton_op``.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import block_reference as R  # noqa: E402
from triton_kernel_support import DEVICE, needs_kernels, relerr  # noqa: E402

from fp8_backends.core.errors import InvalidInputError  # noqa: E402
from fp8_backends.providers.triton import block_gemm_args as ba  # noqa: E402
from fp8_backends.providers.triton import block_gemm_configs as bc  # noqa: E402
from fp8_backends.providers.triton import block_gemm_ops as bg  # noqa: E402
from fp8_backends.providers.triton.block_gemm_configs import BlockTileConfig as C  # noqa: E402

pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")  # tests/conftest.py

#: small tiles per family (the interpreter's cost grows with programs x K steps)
SMALL = {
    "gemv": C("gemv", 1, 16, 1, 2, groups=2),
    "swap": C("swap", 16, 64, 2, 4),
    "swap_split": C("swap", 16, 64, 2, 4, split_k=3),
    "mm": C("mm", 32, 64, 2, 4),
    "mm_split": C("mm", 32, 64, 2, 4, split_k=2),
    "mm_wide": C("mm", 32, 256, 2, 4),
    "tma": C("tma", 32, 128, 2, 4),
    "tma_persistent": C("tma", 32, 64, 2, 4, persistent=1),
}
#: bounds on the relative Frobenius error against the fp32 reference, by output dtype
TOL = {torch.float32: 2e-5, torch.float16: 1.5e-3, torch.bfloat16: 4e-3}


# ------------------------------------------------------------------------------------ operands and checks
def _xs_layout(xs: torch.Tensor, layout: str) -> torch.Tensor:
    """``xs [M, Kg]`` fp32 in one of the layouts (values equal)."""
    m, kg = xs.shape
    if layout == "row_major":
        return xs.contiguous()
    if layout == "m_major":
        return xs.t().contiguous().t()
    if layout == "m_major_tma":
        buf = torch.full((kg, -(-m // 4) * 4), float("nan"), device=xs.device)  # padding poisoned: never read
        buf[:, :m] = xs.t()
        return buf[:, :m].t()
    raise AssertionError(layout)


def _operands(m, n, k, group=128, fp8=torch.float8_e4m3fn, seed=0, layout="row_major", device=DEVICE):
    """Realistic operands: x quantized per token group, w per 128x128 block (both from normal data)."""
    g = torch.Generator().manual_seed(seed * 7919 + m * 31 + n * 7 + k)
    x = torch.randn(m, k, generator=g) * 2
    x[:, ::5] *= 8  # loud columns: the group scales differ
    w = torch.randn(n, k, generator=g) * 0.05
    x_q, xs = R.quantize_per_token_group(x, group, fp8)
    w_q, ws = R.quantize_block(w, (128, 128), fp8)
    return x_q.to(device), w_q.to(device), _xs_layout(xs.to(device), layout), ws.to(device)


def _check(cfg, m, n, k, *, group=128, out_dtype=torch.bfloat16, bias=False, layout="row_major",
           fp8=torch.float8_e4m3fn, x_view=None, ws_view=None):
    x_q, w_q, xs, ws = _operands(m, n, k, group, fp8, layout=layout)
    if x_view is not None:
        x_q = x_view(x_q)
    if ws_view is not None:
        ws = ws_view(ws)
    b = (torch.randn(n) * 2).to(out_dtype).to(DEVICE) if bias else None
    out = torch.full((m, n), float("nan"), dtype=out_dtype, device=DEVICE)
    bg.run_config(cfg, x_q, w_q, xs, ws, b, out, group)
    ref = R.block_fp8_gemm(x_q, w_q, xs, ws, torch.float32, b, group)
    err = relerr(out, ref)
    assert torch.isfinite(out.float()).all(), (cfg.name, m, n, k)
    assert err < TOL[out_dtype], (cfg.name, m, n, k, out_dtype, err)
    return out


# ------------------------------------------------------------------------------------ configs, table, plan
def test_configs_are_valid_and_named_uniquely():
    assert len(bc.CONFIGS) == len(bc.CONFIG_LIST)
    for name, cfg in bc.CONFIGS.items():
        assert cfg.name == name and name.isidentifier()
    with pytest.raises(ValueError, match="power of two"):
        C("mm", 48, 64, 3, 4)
    with pytest.raises(ValueError, match="family"):
        C("splitk", 16, 64, 3, 4)
    with pytest.raises(ValueError, match="tensor-core"):
        C("swap", 8, 64, 3, 4)
    with pytest.raises(ValueError, match="weight block"):
        C("swap", 16, 256, 3, 4)
    with pytest.raises(ValueError, match="split"):
        C("tma", 64, 128, 3, 4, split_k=2)
    with pytest.raises(ValueError, match="persistent"):
        C("mm", 64, 128, 3, 4, persistent=1)


def test_a_config_name_spells_its_config():
    for cfg in bc.CONFIG_LIST:
        assert bc.BlockTileConfig.from_name(cfg.name) == dataclasses.replace(cfg, note="")
    assert bc.BlockTileConfig.from_name("mm_n64_m64_s4_w4_g8_sk7") == C("mm", 64, 64, 4, 4, split_k=7)
    with pytest.raises(ValueError, match="stages = 1"):
        C("gemv", 1, 2, 2, 2, groups=8)
    with pytest.raises(ValueError, match="spells no"):
        bc.BlockTileConfig.from_name("mm_n64_m64")
    with pytest.raises(ValueError, match="not spelled as"):  # the grouped order is part of a tiled config's name
        bc.BlockTileConfig.from_name("mm_n64_m64_s4_w4_sk7")
    with pytest.raises(ValueError, match="split"):  # the config's own checks
        bc.BlockTileConfig.from_name("tma_n64_m64_s4_w4_g8_sk2")
    for name in ("gemv_n8_g8_w4_pf", "swap_n64_m16_s8_w4_sk0_pf", "mm_n128_m64_s3_w4_g8_sk0_pf"):
        cfg = bc.BlockTileConfig.from_name(name)
        assert cfg.prefetch and cfg.name == name
        assert dataclasses.replace(cfg, prefetch=False).name == name.removesuffix("_pf")
    with pytest.raises(ValueError, match="prefetch"):
        bc.BlockTileConfig.from_name("tma_n128_m64_s4_w4_g8_p2_pf")


def test_prefetch_chunks_only_with_pdl_and_contiguous_rows():
    """About one bulk prefetch per thread of a program; none without PDL (the interpreter, SM < 9.0, switched off),
    on rows that are not contiguous, or for a config that does not ask."""
    gemv = bc.BlockTileConfig.from_name("gemv_n8_g8_w4_pf")
    assert ba.prefetch_chunks(gemv, True, 1) == 16  # 8 rows x 16 = 128 threads
    assert ba.prefetch_chunks(bc.BlockTileConfig.from_name("gemv_n1_g32_w2_pf"), True, 1) == 64
    assert ba.prefetch_chunks(bc.BlockTileConfig.from_name("swap_n64_m16_s8_w4_sk0_pf"), True, 1) == 2
    assert ba.prefetch_chunks(bc.BlockTileConfig.from_name("mm_n128_m64_s3_w4_g8_sk0_pf"), True, 1) == 1
    assert ba.prefetch_chunks(gemv, False, 1) == 0
    assert ba.prefetch_chunks(gemv, True, 7168) == 0
    assert ba.prefetch_chunks(bc.CONFIGS["gemv_n8_g8_w4"], True, 1) == 0


def test_default_table_covers_every_m_with_a_known_config():
    table = bc.DEFAULT_TABLE
    assert table.config_names() <= set(bc.CONFIGS)
    shapes = [*table.shapes, (4096, 4096), (7168, 18432), (3420, 6840)]
    for n, k in shapes:
        picks = {m: bc.CONFIGS[table.pick(m, n, k)] for m in (1, 2, 4, 16, 17, 64, 256, 1024, 4096, 1 << 20)}
        assert picks[1].family in ("gemv", "swap")
        # one tile over the tokens: swap-AB, or the 128x64 tiles on the short-K weights (q_b, kv_b)
        assert all(picks[m].family in ("swap", "mm") and picks[m].block_m >= m for m in (2, 4, 16))
        assert picks[1 << 20].family in ("mm", "tma")
        for m, cfg in picks.items():
            assert cfg.max_m is None or m <= cfg.max_m, (n, k, m, cfg.name)


def test_default_table_at_one_token_follows_the_h200_measurements():
    """The M = 1 bucket per weight as measured (bench/results/block_gemm/2026-12-05-h200-gemv-long-steps/ and
    2026-12-05-h200-gemv-prefetch/): GEMVs with long K steps on DeepSeek-V3's narrow q_a / kv_a, eight rows a program
    on Qwen3-8B's o / down, the 512-column step on q_b, swap-AB on kv_b's K = 512, the 2-row GEMV elsewhere; from
    M = 2 on kv_a swap-AB with the weight's L2 prefetch (bench/results/block_gemm/2026-12-06-h100-weight-prefetch/)."""
    pick = bc.DEFAULT_TABLE.pick
    assert pick(1, 576, 7168) == "gemv_n1_g32_w2" and pick(2, 576, 7168) == "swap_n64_m16_s8_w4_sk0_pf"
    assert pick(1, 1536, 7168) == "gemv_n2_g16_w4" and pick(2, 1536, 7168) == "swap_n64_m16_s8_w4_sk0"
    assert pick(1, 4096, 4096) == pick(1, 4096, 12288) == "gemv_n8_g8_w4"
    assert [pick(m, 4096, 4096) for m in (2, 64, 4096)] == [pick(m, 4096, 6144) for m in (2, 64, 4096)]
    assert pick(1, 6144, 4096) == pick(1, 4096, 6144) == pick(1, 7168, 18432) == "gemv_n2_g8_w2"
    assert pick(1, 24576, 1536) == "gemv_n4_g4_w4" and pick(1, 32768, 512) == "swap_n64_m16_s8_w4_sk0"
    assert pick(256, 576, 7168) == "mm_n64_m64_s3_w4_g8_sk6"


def test_table_json_round_trip_and_override():
    table = bc.BlockTable(default=((16, "swap_n64_m16_s8_w4_sk0"), (None, "tma_n128_m64_s4_w4_g8_p2")),
                          shapes={(576, 7168): ((None, "mm_n128_m64_s4_w4_g8_sk0"),)}, source="test")
    again = bc.BlockTable.from_json(table.to_json())
    assert again == table and again.pick(1, 576, 7168) == "mm_n128_m64_s4_w4_g8_sk0"
    previous = bc.use_table(again)
    try:
        assert bg.pick_config("auto", 1, 4096, 4096).name == "swap_n64_m16_s8_w4_sk0"
    finally:
        bc.use_table(previous)
    assert bc.active_table() is bc.DEFAULT_TABLE
    with pytest.raises(ValueError, match="unknown config"):
        bc.BlockTable(default=((None, "swap_n64_m16_k256_s6_w4"),))  # a per-tensor name


@pytest.mark.parametrize(("tiles", "groups", "sms", "split"), [
    (9, 56, 132, 14),      # kv_a 576x7168, 64-row tiles: 126 programs, 4 groups each
    (24, 56, 132, 6),      # q_a 1536x7168: 144 programs, 10 groups each
    (112, 144, 132, 2),    # down 7168x18432
    (576, 56, 132, 1),     # gate_up: enough tiles
    (64, 32, 132, 3),      # 4096x4096: 192 programs
    (9, 4, 132, 1),        # K = 512: too few groups to split
])
def test_auto_split(tiles, groups, sms, split):
    got = bc.auto_split(tiles, groups, sms)
    assert got == split
    per = -(-groups // got)
    assert -(-groups // per) == got  # no empty split
    assert per >= bc.MIN_GROUPS_PER_SPLIT or got == 1


def test_plan_launch():
    swap = C("swap", 16, 64, 8, 4, split_k=0)
    plan = bg.plan_launch(swap, 4, 576, 7168, 128, 132)
    assert plan.split == 14 and plan.groups_per_split == 4
    assert bg.plan_launch(swap, 4, 36864, 7168, 128, 132).split == 1
    fixed = C("swap", 16, 64, 8, 4, split_k=8)
    assert bg.plan_launch(fixed, 4, 576, 640, 128, 132) == bg.Plan(fixed, 5, 1)  # never more splits than groups
    assert bg.plan_launch(C("gemv", 1, 2, 1, 2, groups=8), 1, 576, 7168, 128, 132).split == 1
    many = C("mm", 16, 16, 2, 4, split_k=2)
    assert bg.plan_launch(many, 16 * 200, 16 * 100, 512, 128, 132).split == 1  # tiles > COUNTER_SLOTS


def test_row_align():
    assert bg.row_align(7168, 7168, 7168) == 16
    assert bg.row_align(6840, 6840) == 8
    assert bg.row_align(684, 1000) == 4
    assert bg.row_align(201) == 1


# ------------------------------------------------------------------------------------ numerics (interpreter)
@needs_kernels
@pytest.mark.parametrize("family", list(SMALL))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 520), (5, 192, 256), (17, 130, 384)])
def test_every_family_matches_reference(family, m, n, k):
    cfg = SMALL[family]
    if family == "gemv" and m > 5:
        pytest.skip("the GEMV streams the weight per token (slow on the interpreter)")
    _check(cfg, m, n, k, bias=True)


@needs_kernels
@pytest.mark.parametrize("family", ["gemv", "swap_split", "mm_split"])
def test_prefetch_configs_compute_the_same(family):
    """A ``_pf`` config runs its plain kernel where PDL is off (here: the interpreter) and computes the same."""
    cfg = dataclasses.replace(SMALL[family], prefetch=True)
    assert torch.equal(_check(cfg, 3, 130, 392), _check(SMALL[family], 3, 130, 392))


@needs_kernels
@pytest.mark.parametrize("family", ["swap", "mm"])
@pytest.mark.parametrize(("k", "split"), [(384, 3), (392, 4), (640, 2)])
def test_splits_of_one_group_and_ragged_last_groups(family, k, split):
    """The scales loaded a step ahead: a split of one group (its next-step load clamps to its own group), a ragged
    last group in a split of its own (392 = 3 x 128 + 8), splits of several groups."""
    cfg = C(family, 16 if family == "swap" else 32, 64, 2, 4, split_k=split)
    assert bg.plan_launch(cfg, 5, 130, k, 128, 132).split == split
    _check(cfg, 5, 130, k, bias=True)


@needs_kernels
@pytest.mark.parametrize("family", ["gemv", "swap_split", "mm_split", "tma"])
def test_ragged_n_and_k_not_multiples_of_16(family):
    """Small variants of N=3420, K=6840 (4 x 855: 8-byte rows) and N=576-like edges: masked loads, never wrong."""
    _check(SMALL[family], 3, 342, 684, bias=True)
    _check(SMALL[family], 2, 90, 200, group=64)


@needs_kernels
@pytest.mark.parametrize("layout", ["row_major", "m_major", "m_major_tma"])
@pytest.mark.parametrize("family", ["gemv", "swap", "mm", "tma"])
def test_every_activation_scale_layout(layout, family):
    m = 2 if family == "gemv" else 7
    _check(SMALL[family], m, 128, 384, layout=layout)


@needs_kernels
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", ["gemv", "swap_split", "mm", "tma_persistent"])
def test_out_dtypes_with_bias(out_dtype, family):
    _check(SMALL[family], 3, 136, 260, out_dtype=out_dtype, bias=True)


@needs_kernels
@pytest.mark.parametrize("family", ["gemv", "swap", "mm_split", "tma"])
def test_group_size_64_spans_two_groups_per_weight_block(family):
    _check(SMALL[family], 3, 130, 448, group=64, bias=True)


@needs_kernels
@pytest.mark.parametrize("family", ["gemv", "swap", "mm"])
def test_e5m2(family):
    _check(SMALL[family], 3, 64, 256, fp8=torch.float8_e5m2, out_dtype=torch.float32)


@needs_kernels
@pytest.mark.parametrize("family", ["gemv", "swap_split", "mm", "tma"])
def test_strided_operands(family):
    """x as a column slice of a wider row-major buffer (row stride > K), w_scale as a transposed view, the output
    a column slice of a wider buffer."""
    m, n, k = 3, 96, 256
    x_q, w_q, xs, ws = _operands(m, n, k)
    wide = torch.zeros(m, k + 48, dtype=x_q.dtype, device=DEVICE)
    wide[:, 16:16 + k] = x_q
    x_view = wide[:, 16:16 + k]
    ws_t = ws.t().contiguous().t()
    out_buf = torch.full((m, n + 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = out_buf[:, 8:8 + n]
    bg.run_config(SMALL[family], x_view, w_q, xs, ws_t, None, out, 128)
    ref = R.block_fp8_gemm(x_q, w_q, xs, ws)
    assert relerr(out, ref) < TOL[torch.bfloat16]
    assert torch.isnan(out_buf[:, :8].float()).all() and torch.isnan(out_buf[:, 8 + n:].float()).all()


@needs_kernels
@pytest.mark.parametrize("family", ["gemv", "swap_split", "mm", "tma"])
def test_a_nan_row_stays_in_its_row(family):
    """A NaN code in one token and a NaN activation scale in another make exactly those rows NaN, as the fp32
    reference does; the other rows stay right."""
    m, n, k = 4, 64, 256
    x_q, w_q, xs, ws = _operands(m, n, k)
    x_q[1, 7] = float("nan")
    xs[3, 1] = float("nan")
    out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    bg.run_config(SMALL[family], x_q, w_q, xs, ws, None, out, 128)
    ref = R.block_fp8_gemm(x_q, w_q, xs, ws)
    assert torch.isnan(out[1].float()).all() and torch.isnan(out[3].float()).all()
    assert torch.isnan(ref[1]).all() and torch.isnan(ref[3]).all()
    keep = [0, 2]
    assert relerr(out[keep], ref[keep]) < TOL[torch.bfloat16]


@needs_kernels
def test_split_k_counters_are_left_at_zero_and_repeat_calls_agree():
    bg.reset_buffers()
    cfg = SMALL["swap_split"]
    x_q, w_q, xs, ws = _operands(5, 130, 640)
    outs = []
    for _ in range(3):
        out = torch.empty(5, 130, dtype=torch.float32, device=DEVICE)
        bg.run_config(cfg, x_q, w_q, xs, ws, None, out, 128)
        outs.append(out)
    counters = bg.counters_for(x_q.device)
    assert int(counters.abs().sum()) == 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])  # fixed summation order
    assert relerr(outs[0], R.block_fp8_gemm(x_q, w_q, xs, ws)) < TOL[torch.float32]


@needs_kernels
def test_block_gemm_auto_and_named_configs():
    x_q, w_q, xs, ws = _operands(3, 200, 520)
    ref = R.block_fp8_gemm(x_q, w_q, xs, ws)
    y = bg.block_gemm(x_q, w_q, xs, ws, out_dtype=torch.float32, config="swap_n64_m16_s8_w4_sk0")
    assert y.shape == (3, 200) and y.dtype == torch.float32 and relerr(y, ref) < TOL[torch.float32]
    out = torch.empty(3, 200, dtype=torch.bfloat16, device=DEVICE)
    assert bg.block_gemm(x_q, w_q, xs, ws, out=out) is out
    assert relerr(out, ref) < TOL[torch.bfloat16]


@needs_kernels
@needs_kernels
def test_weight_blocks_shorter_than_a_swap_tile():
    """32-row weight blocks: ``auto``'s swap-AB pick (64-row tiles read one weight scale per K step) becomes a tiled
    config, which computes right; naming the swap-AB config is refused."""
    x_q, xs = R.quantize_per_token_group(torch.randn(5, 520), 128)
    w_q, ws = R.quantize_block(torch.randn(200, 520) * 0.1, (32, 128))
    x_q, xs, w_q, ws = (t.to(DEVICE) for t in (x_q, xs, w_q, ws))
    ref = R.block_fp8_gemm(x_q, w_q, xs, ws, torch.float32, None, 128, (32, 128))
    assert bc.active_table().pick(5, 200, 520).startswith("swap")
    out = bg.block_gemm(x_q, w_q, xs, ws, None, torch.float32, weight_block=(32, 128))
    assert relerr(out, ref) < TOL[torch.float32]
    with pytest.raises(InvalidInputError, match="do not fit 32x128 weight blocks"):
        bg.block_gemm(x_q, w_q, xs, ws, None, torch.float32, config="swap_n64_m16_s8_w4_sk0", weight_block=(32, 128))


def test_empty_and_zero_k():
    x_q, w_q, xs, ws = _operands(0, 64, 128)
    assert bg.block_gemm(x_q, w_q, xs, ws).shape == (0, 64)
    x0 = torch.empty(3, 0, dtype=torch.float8_e4m3fn, device=DEVICE)
    w0 = torch.empty(64, 0, dtype=torch.float8_e4m3fn, device=DEVICE)
    b = torch.arange(64, dtype=torch.float32, device=DEVICE)
    y = bg.block_gemm(x0, w0, torch.empty(3, 0, device=DEVICE), torch.empty(1, 0, device=DEVICE), b, torch.float32)
    assert torch.equal(y, b.expand(3, 64))


def test_bad_inputs_raise_one_library_error():
    x_q, w_q, xs, ws = _operands(3, 200, 520, device="cpu")
    cases = [
        ((x_q, w_q[:, :256], xs, ws), "K="),
        ((x_q.float(), w_q, xs, ws), "float8"),
        ((x_q, w_q.to(torch.float8_e5m2), xs, ws), "float8"),
        ((x_q, w_q, xs[:, :4], ws), "x_scale"),
        ((x_q, w_q, xs.double(), ws), "x_scale"),
        ((x_q, w_q, xs, ws[:1]), "w_scale"),
        ((x_q, w_q, xs, ws.to(torch.bfloat16)), "w_scale"),
    ]
    for args, match in cases:
        with pytest.raises(InvalidInputError, match=match):
            bg.block_gemm(*args)
    with pytest.raises(InvalidInputError, match="group_size"):
        bg.block_gemm(x_q, w_q, xs, ws, group_size=96)
    with pytest.raises(InvalidInputError, match="bias"):
        bg.block_gemm(x_q, w_q, xs, ws, torch.zeros(7))
    with pytest.raises(InvalidInputError, match="out_dtype"):
        bg.block_gemm(x_q, w_q, xs, ws, out_dtype=torch.float64)
    with pytest.raises(InvalidInputError, match="config"):
        bg.block_gemm(x_q, w_q, xs, ws, config="nope")
    with pytest.raises(InvalidInputError, match="out must"):
        bg.block_gemm(x_q, w_q, xs, ws, out=torch.empty(3, 199, dtype=torch.bfloat16))


def test_prepare_weight_scale():
    ws = torch.rand(5, 7, dtype=torch.bfloat16)
    prepared = bg.prepare_weight_scale(ws.t().contiguous().t())
    assert prepared.dtype == torch.float32 and prepared.is_contiguous() and torch.equal(prepared, ws.float())
    with pytest.raises(InvalidInputError):
        bg.prepare_weight_scale(torch.rand(5))


@needs_kernels
def test_op_matches_the_eager_call_and_has_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = bg.load_op()
    assert "int group_size" in str(op._schema) and "str config" in str(op._schema)
    x_q, w_q, xs, ws = _operands(3, 64, 256)
    y = op(x_q, w_q, xs, ws, None, torch.bfloat16, 128, "mm_n128_m64_s4_w4_g8_sk0")
    assert relerr(y, R.block_fp8_gemm(x_q, w_q, xs, ws)) < TOL[torch.bfloat16]
    with FakeTensorMode():
        fx = torch.empty(5, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
        fw = torch.empty(64, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
        out = bg.triton_block_gemm(fx, fw, torch.empty(5, 2, device=DEVICE), torch.empty(1, 2, device=DEVICE), None,
                                   torch.float16)
    assert tuple(out.shape) == (5, 64) and out.dtype == torch.float16


# ------------------------------------------------------------------------------------ the fused GEMV
def _unquantized(m, n, k, seed=0, dtype=torch.bfloat16, device=DEVICE):
    """``(x [M, K] unquantized, w_q, ws)``: normal activations with loud columns (the group scales differ)."""
    g = torch.Generator().manual_seed(seed * 7919 + m * 31 + n * 7 + k + 1)
    x = torch.randn(m, k, generator=g) * 2
    x[:, ::5] *= 8
    w_q, ws = R.quantize_block(torch.randn(n, k, generator=g) * 0.05, (128, 128), torch.float8_e4m3fn)
    return x.to(dtype).to(device), w_q.to(device), ws.to(device)


def _quantize_then_gemv(cfg, x, w_q, ws, group=128, out_dtype=torch.bfloat16, bias=None):
    """What the fused launch replaces: the Triton group quantization (what a layer runs: IEEE divisions, where torch's
    CUDA division by a Python scalar multiplies by its reciprocal), then ``cfg``'s GEMV on the codes."""
    from fp8_backends.providers.triton import group_quant_ops as gq

    x_q, xs = gq.quant_per_token_group(x, group, w_q.dtype)
    out = torch.full((x.shape[0], w_q.shape[0]), float("nan"), dtype=out_dtype, device=x.device)
    bg.run_config(cfg, x_q, w_q, xs, ws, bias, out, group)
    return out


@needs_kernels
@pytest.mark.parametrize(("m", "n", "k"), [(1, 200, 520), (3, 130, 384), (1, 256, 1024), (2, 64, 100)])
@pytest.mark.parametrize("config", ["gemv_n8_g8_w4", "gemv_n16_g2_w2", "gemv_n2_g8_w2"])
def test_fused_gemv_equals_quantize_then_gemv_bit_for_bit(m, n, k, config):
    """The fused GEMV quantizes each group as the reference does (the same codes and scales), so its output is the
    quantize-then-GEMV output exactly, ragged N and K included; and both stay within the reference's bound."""
    cfg = bc.CONFIGS[config]
    x, w_q, ws = _unquantized(m, n, k)
    y = bg.fused_launch(x, w_q, ws, None, torch.bfloat16, 128, config)
    assert torch.equal(y, _quantize_then_gemv(cfg, x, w_q, ws))
    x_q, xs = R.quantize_per_token_group(x, 128)
    assert relerr(y, R.block_fp8_gemm(x_q, w_q, xs, ws)) < TOL[torch.bfloat16]


@needs_kernels
@pytest.mark.parametrize("case", ["fp16_in_fp32_out_bias", "group_64", "e5m2", "strided_x", "fp32_in_fp16_out"])
def test_fused_gemv_modes_and_layouts(case):
    cfg = bc.CONFIGS[bc.FUSED_GEMV_SHORT_K]
    m, n, k = 1, 144, 640
    dtype = {"fp16_in_fp32_out_bias": torch.float16, "fp32_in_fp16_out": torch.float32}.get(case, torch.bfloat16)
    out_dtype = {"fp16_in_fp32_out_bias": torch.float32, "fp32_in_fp16_out": torch.float16}.get(case, torch.bfloat16)
    group = 64 if case == "group_64" else 128
    x, w_q, ws = _unquantized(m, n, k, dtype=dtype)
    if case == "e5m2":
        w_q = w_q.float().to(torch.float8_e5m2)
    if case == "strided_x":  # a column slice of a wider row: row stride 2K
        x = torch.cat([x, x.flip(1)], dim=1)[:, :k]
    bias = (torch.randn(n) * 2).to(out_dtype).to(DEVICE) if "bias" in case else None
    y = bg.fused_launch(x, w_q, ws, bias, out_dtype, group, cfg.name)
    assert y.dtype == out_dtype
    assert torch.equal(y, _quantize_then_gemv(cfg, x, w_q, ws, group, out_dtype, bias))


@needs_kernels
def test_fused_gemv_nan_and_edges():
    """A NaN in a group reaches the output (as the reference's amax and clamp keep it); no tokens or no output
    columns give an empty result; K = 0 gives the bias."""
    x, w_q, ws = _unquantized(1, 64, 256)
    x[0, 3] = float("nan")
    assert torch.isnan(bg.fused_launch(x, w_q, ws, None, torch.float32, 128, "auto")).all()
    empty = bg.fused_launch(x[:0], w_q, ws, None, torch.bfloat16)
    assert empty is not None and tuple(empty.shape) == (0, 64)
    bias = torch.arange(64, dtype=torch.float32, device=DEVICE)
    zero_k = bg.fused_launch(x[:, :0], w_q[:, :0], ws[:, :0], bias, torch.float32)
    assert torch.equal(zero_k, bias[None])


def test_fused_config_follows_the_fused_pick_and_named_gemv_configs():
    assert ba.fused_config("auto", 1, 4096, 4096).name == bc.FUSED_GEMV == bc.fused_pick(1, 4096, 4096)
    assert ba.fused_config("auto", 1, 24576, 1536).name == bc.FUSED_GEMV_SHORT_K
    assert ba.fused_config("auto", bc.FUSED_MAX_M + 1, 4096, 4096) is None  # quantize, then the table's kernel
    assert ba.fused_config("gemv_n2_g8_w2", 4, 4096, 4096).name == "gemv_n2_g8_w2"
    assert ba.fused_config("gemv_n2_g8_w2", 5, 4096, 4096) is None  # past the GEMV's own bound
    assert ba.fused_config("swap_n64_m16_s8_w4_sk0", 1, 4096, 4096) is None  # only GEMVs quantize in the launch
    assert ba.fused_config("auto", 64, 4096, 4096, any_m=True).name == bc.FUSED_GEMV  # the op: whatever M
    assert ba.fused_config("auto", 64, 512, 512, any_m=True).name == bc.FUSED_GEMV_SHORT_K
    with pytest.raises(InvalidInputError, match="only the gemv configs"):
        x_q, w_q, xs, ws = _operands(2, 64, 256)
        plan = ba.plan_launch(bc.CONFIGS["mm_n128_m64_s4_w4_g8_sk0"], 2, 64, 256, 128, 4)
        ba.kernel_args(plan, x_q, w_q, xs, ws, None, torch.empty(2, 64), None, None, 128, (128, 128), False, True)


@needs_kernels
def test_fused_op_matches_the_fused_launch_and_has_a_fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = bg.load_fused_op()
    assert "Tensor w_scale" in str(op._schema) and "x_scale" not in str(op._schema)
    x, w_q, ws = _unquantized(1, 200, 520)
    assert torch.equal(op(x, w_q, ws, None, torch.bfloat16, 128, "auto"),
                       bg.fused_launch(x, w_q, ws, None, torch.bfloat16))
    x3 = torch.cat([x, x * 2, -x])  # the op serves every M (its caller chose to fuse)
    y3 = op(x3, w_q, ws, None, torch.bfloat16, 128, "auto")
    assert torch.equal(y3, _quantize_then_gemv(bc.CONFIGS[bc.fused_shape_config(200, 520)], x3, w_q, ws))
    with FakeTensorMode():
        fx = torch.empty(1, 256, dtype=torch.bfloat16, device=DEVICE)
        fw = torch.empty(64, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
        out = op(fx, fw, torch.empty(1, 2, device=DEVICE), None, torch.float16, 128, "auto")
    assert tuple(out.shape) == (1, 64) and out.dtype == torch.float16


# ------------------------------------------------------------------------------------ GPU
SHAPES = {  # (N, K) of DeepSeek-V3, Qwen3-8B and Qwen3-32B linear layers, and ragged TP splits
    "dsv3_q_a": (1536, 7168), "dsv3_kv_a": (576, 7168), "dsv3_q_b": (24576, 1536), "dsv3_kv_b": (32768, 512),
    "dsv3_o": (7168, 16384), "dsv3_down": (7168, 18432), "qwen3_8b_qkv": (6144, 4096),
    "qwen3_32b_o": (5120, 8192), "ragged": (3420, 6840), "ragged2": (1000, 2000),
}


#: two M values per family (each case compiles its own specialization: the list must fit a device call)
GPU_MS = {"gemv": (1, 3), "swap": (5, 64), "mm": (48, 1024), "tma": (200, 1024)}


def _gpu_cases():
    for i, name in enumerate(bc.CONFIG_NAMES):
        cfg = bc.CONFIGS[name]
        for j, m in enumerate(GPU_MS[cfg.family]):
            shape = list(SHAPES)[(i + j) % len(SHAPES)]
            yield pytest.param(name, m, shape, id=f"{name}-M{m}-{shape}")


@pytest.mark.gpu
@pytest.mark.parametrize(("name", "m", "shape"), list(_gpu_cases()))
def test_gpu_every_config_on_model_shapes(name, m, shape):
    n, k = SHAPES[shape]
    _check(bc.CONFIGS[name], m, n, k, bias=True, layout="m_major_tma")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 2048])
@pytest.mark.parametrize("shape", ["dsv3_kv_a", "dsv3_q_b", "ragged"])
def test_gpu_auto_fp16_and_row_major_scales(m, shape):
    n, k = SHAPES[shape]
    x_q, w_q, xs, ws = _operands(m, n, k)
    y = bg.block_gemm(x_q, w_q, xs, ws, out_dtype=torch.float16)
    assert relerr(y, R.block_fp8_gemm(x_q, w_q, xs, ws)) < TOL[torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 64, 1024])
def test_gpu_cuda_graph_capture_and_replay(m):
    """auto (GEMV, split-K swap-AB, split-K tiled, TMA by M) inside a CUDA graph: new inputs copied in, replayed,
    right; the split-K counters survive replays."""
    n, k = SHAPES["dsv3_kv_a"]
    x_q, w_q, xs, ws = _operands(m, n, k, layout="m_major_tma")
    static_x, static_s = x_q.clone(), xs.clone()
    bg.block_gemm(static_x, w_q, static_s, ws)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bg.block_gemm(static_x, w_q, static_s, ws)
    for seed in (1, 2, 3):
        x2, _, xs2, _ = _operands(m, n, k, seed=seed, layout="m_major_tma")
        static_x.copy_(x2)
        static_s.copy_(xs2)
        graph.replay()
        torch.cuda.synchronize()
        assert relerr(y, R.block_fp8_gemm(x2, w_q, xs2, ws)) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 2048])
def test_gpu_pdl_on_and_off_agree(m, monkeypatch):
    n, k = SHAPES["qwen3_8b_qkv"]
    x_q, w_q, xs, ws = _operands(m, n, k)
    cfg = bg.pick_config("auto", m, n, k)
    outs = []
    for pdl in (True, False):
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
        bg.run_config(cfg, x_q, w_q, xs, ws, None, out, 128, pdl=pdl)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gemv_n8_g8_w4", "gemv_n1_g32_w2", "swap_n64_m16_s8_w4_sk0",
                                  "mm_n128_m64_s3_w4_g8_sk0"])
@pytest.mark.parametrize("shape", ["dsv3_kv_a", "dsv3_kv_b", "ragged", "ragged2"])
def test_gpu_weight_prefetch_matches_its_plain_twin(name, shape):
    """The L2 prefetch ahead of the PDL wait (``_pf``) against the same config without it: 16-byte rows, ragged rows
    (K = 6840, 2000), a weight view starting 5 bytes into its rows (prefetches widened to 16-byte bounds), split K;
    eager, in a CUDA graph (new activations copied in), and the fused GEMV. The tensor-core kernels (swap-AB, tiled)
    give the same bits; the GEMV's did not on kv_b and the ragged shapes on an H100 (presumably its sums over the
    ``[BLOCK_N, GROUPS, GROUP_K]`` block taken in another order once the prefetch is compiled in,
    bench/results/block_gemm/2026-12-06-h100-weight-prefetch/), so it is held to the reference's bound instead."""
    cfg = bc.CONFIGS[name]
    pf = dataclasses.replace(cfg, prefetch=True)
    n, k = SHAPES[shape]
    m = 1 if cfg.family == "gemv" else 5
    x_q, w_q, xs, ws = _operands(m, n, k)
    padded = torch.zeros(n, k + 40, dtype=torch.uint8, device=DEVICE)
    w_off = padded[:, 5:5 + k].view(torch.float8_e4m3fn)
    w_off.copy_(w_q)

    def run(c, w, x=x_q, s=xs, x_quant=False):
        out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
        bg.run_config(c, x, w, s, ws, None, out, 128, pdl=True, x_quant=x_quant)
        return out

    def same(got, want, ref):
        if cfg.family == "gemv":
            assert relerr(got, ref) < TOL[torch.bfloat16] and relerr(got, want) < TOL[torch.bfloat16]
        else:
            assert torch.equal(got, want)

    ref = R.block_fp8_gemm(x_q, w_q, xs, ws)
    want = run(cfg, w_q)
    assert relerr(want, ref) < TOL[torch.bfloat16]
    same(run(pf, w_q), want, ref)
    same(run(pf, w_off), want, ref)
    static_x, static_s = x_q.clone(), xs.clone()
    run(pf, w_off, static_x, static_s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run(pf, w_off, static_x, static_s)
    x2, _, xs2, _ = _operands(m, n, k, seed=3)
    static_x.copy_(x2)
    static_s.copy_(xs2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, run(pf, w_off, x2, xs2))  # the graph replays what the eager call computes
    same(y, run(cfg, w_q, x2, xs2), R.block_fp8_gemm(x2, w_q, xs2, ws))
    if cfg.family == "gemv":
        x, _, _ = _unquantized(1, n, k)
        fused = run(pf, w_off, x, ws, x_quant=True)
        plain = run(cfg, w_q, x, ws, x_quant=True)
        assert relerr(fused, plain) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 2048])
def test_gpu_inductor_launches_the_kernel_itself(m):
    """Under torch.compile the op decomposes into its kernel launch (no opaque op in the graph for pointer
    configs); the result equals the eager call's."""
    from torch._inductor.utils import run_and_get_code

    n, k = SHAPES["dsv3_q_a"]
    x_q, w_q, xs, ws = _operands(m, n, k)
    bg.load_op()

    def f(x, s):
        return bg.triton_block_gemm(x, w_q, s, ws, None, torch.bfloat16, 128, "auto") * 2

    compiled = torch.compile(f, fullgraph=True)
    y, codes = run_and_get_code(compiled, x_q, xs)
    eager = bg.block_gemm(x_q, w_q, xs, ws) * 2
    assert torch.equal(y, eager)
    if bg.pick_config("auto", m, n, k).family != "tma":
        assert "block_gemm_" in "\n".join(codes) and "triton_block_gemm.default" not in "\n".join(codes)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["dsv3_q_a", "dsv3_kv_b", "dsv3_down", "qwen3_8b_qkv", "ragged"])
def test_gpu_fused_gemv_equals_quantize_then_gemv(shape):
    """On the GPU, random activations: the fused pick's launch equals the group quantization (the Triton op, the
    kernel a layer runs) followed by the same GEMV, bit for bit; eager, in a CUDA graph and compiled (Inductor
    launches the fused kernel itself: no opaque op)."""
    from torch._inductor.utils import run_and_get_code

    from fp8_backends.providers.triton import group_quant_ops as gq

    n, k = SHAPES[shape]
    x, w_q, ws = _unquantized(1, n, k)
    cfg = bc.CONFIGS[bc.fused_pick(1, n, k)]
    x_q, xs = gq.quant_per_token_group(x, 128, torch.float8_e4m3fn, "m_major_tma")
    want = torch.empty(1, n, dtype=torch.bfloat16, device=DEVICE)
    bg.run_config(cfg, x_q, w_q, xs, ws, None, want, 128)
    assert torch.equal(bg.fused_launch(x, w_q, ws, None, torch.bfloat16), want)
    static_x = x.clone()
    bg.fused_launch(static_x, w_q, ws, None, torch.bfloat16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = bg.fused_launch(static_x, w_q, ws, None, torch.bfloat16)
    x2, _, _ = _unquantized(1, n, k, seed=5)
    static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, bg.fused_launch(x2, w_q, ws, None, torch.bfloat16))
    op = bg.load_fused_op()
    compiled = torch.compile(lambda t: op(t * 1, w_q, ws, None, torch.bfloat16, 128, "auto"), fullgraph=True)
    got, codes = run_and_get_code(compiled, x)
    assert torch.equal(got, want)
    assert "block_gemv_kernel" in "\n".join(codes) and "triton_block_gemm_quant.default" not in "\n".join(codes)


def test_traced_bodies_give_the_op_schemas():
    """The triton_op bodies (what torch.compile traces on a GPU) infer the schemas of the eager/opaque ops."""
    from fp8_backends.providers.triton import block_gemm_traced, group_quant_traced, norm_dynamic_traced

    schemas = {
        block_gemm_traced.triton_block_gemm: (
            "(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, ScalarType out_dtype, "
            "SymInt group_size, str config) -> Tensor"),
        group_quant_traced.triton_quant_per_token_group: (
            "(Tensor x, SymInt group_size, ScalarType fp8_dtype, str scale_layout) -> (Tensor, Tensor)"),
        norm_dynamic_traced.triton_rmsnorm_quant_dynamic: (
            "(Tensor x, Tensor weight, float eps, SymInt group_size, str scale_layout, ScalarType fp8_dtype) -> "
            "(Tensor, Tensor)"),
    }
    for fn, schema in schemas.items():
        assert torch.library.infer_schema(fn, mutates_args=()) == schema
    add = torch.library.infer_schema(norm_dynamic_traced.triton_fused_add_rmsnorm_quant_dynamic,
                                     mutates_args=("residual",))
    assert "Tensor(a1!) residual" in add


@pytest.mark.slow
def test_kernels_lower_for_sm90_without_spills():
    """The interpreter never lowers the kernels: compile one variant of each for sm_90a (Triton's bundled ptxas, no
    GPU) and require wgmma, the load pipelines, PDL and no register spills (bench/block_kernels_sm90.py)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = (f"import sys; sys.path.append({str(root)!r}); from bench.block_kernels_sm90 import main; "
            "sys.exit(main(['--quick']))")
    run = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "0 failing variant(s)" in run.stdout
