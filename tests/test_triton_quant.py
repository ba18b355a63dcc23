"""The Triton FP8 activation-quant kernels (``providers/triton/quant_kernels.py``) and the CUDA default of
``fp8_backends.quant``.

CPU part: the kernels on Triton's interpreter (CPU tensors, small sizes) against ``fp8_backends.core.reference``
(e4m3fn and e5m2; bf16/fp16/fp32; non-contiguous inputs; all-zero rows; M = 1; the chunked per-token
path), through the quant ops (the kernels registered for "cpu"), and the default-selection logic of
``fp8_backends.quant`` with the GPU facts monkeypatched. A module fixture makes the interpreter's float
conversions exact (see test_triton_norm_quant.py). Where a GPU is visible the same tests run on CUDA
tensors. GPU part (``gpu`` marker): real sizes, graph capture, no host syncs, the default in action.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fp8_backends import ActScale, quant  # noqa: E402
from fp8_backends.core import reference  # noqa: E402
from fp8_backends.providers.triton import _support  # noqa: E402
from fp8_backends.providers.triton import quant_kernels as qk  # noqa: E402

FP8S = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DEVICE = "cpu" if _support.interpreting() else "cuda"
needs_kernels = pytest.mark.skipif(
    not _support.interpreting() and not torch.cuda.is_available(),
    reason="the Triton kernels need a CUDA GPU or TRITON_INTERPRET=1",
)

#: the activation modes of the per-tensor / per-token machinery (block-wise FP8 has its own tests)
PLAIN_ACT_SCALES = [m for m in ActScale if m is not ActScale.PER_TOKEN_GROUP]
interpreter_only = pytest.mark.skipif(not _support.interpreting(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")


def _name(d) -> str:
    return str(d).removeprefix("torch.")


# ------------------------------------------------------------------------------------ exact interpreter casts
pytestmark = pytest.mark.usefixtures("exact_interpreter_casts")  # tests/conftest.py


@pytest.fixture(autouse=True)
def _restore_quant_state():
    saved = dict(quant._impls)
    quant.reset_default_impls()
    yield
    quant._impls.clear()
    quant._impls.update(saved)
    quant.reset_default_impls()


# ------------------------------------------------------------------------------------ helpers
def _ordinal(q: torch.Tensor) -> torch.Tensor:
    b = q.view(torch.uint8).to(torch.int16)
    mag = b & 0x7F
    return torch.where(b >= 0x80, -mag, mag)


def assert_codes_close(q: torch.Tensor, ref: torch.Tensor, max_fraction: float = 5e-3) -> None:
    """Codes at most one fp8 step from the reference's, and few off at all (reciprocal vs division)."""
    assert q.dtype == ref.dtype and q.shape == ref.shape, (q.dtype, q.shape, ref.dtype, ref.shape)
    assert q.is_contiguous()
    diff = (_ordinal(q.cpu()) - _ordinal(ref.cpu())).abs()
    worst = int(diff.max()) if diff.numel() else 0
    off = int((diff > 0).sum())
    assert worst <= 1, f"an fp8 code is {worst} steps from the reference"
    assert off <= max(1, int(max_fraction * diff.numel())), f"{off} of {diff.numel()} codes differ"


def assert_scales_equal(s: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-equal on the CPU (the interpreter and torch both divide exactly); within one fp32 ulp on CUDA,
    where torch divides a tensor by a Python scalar as a multiplication by its reciprocal and the kernel
    divides exactly (``div_rn``)."""
    assert s.shape == ref.shape and s.dtype == ref.dtype == torch.float32
    if s.device.type == "cpu":
        assert torch.equal(s, ref), (s, ref)
    else:
        torch.testing.assert_close(s, ref, rtol=2.4e-7, atol=0)


def _x(m, k, dtype=torch.bfloat16, device=DEVICE, seed=0, amplitude=3.0):
    g = torch.Generator().manual_seed(seed * 1000 + m * 7 + k)
    x = torch.randn(m, k, generator=g) * amplitude
    x[:, ::7] *= 50  # a few loud columns: per-token and per-tensor scales differ, some values saturate
    return x.to(dtype).to(device)


SHAPES = [(1, 33), (17, 1000), (5, 4096)]


# ------------------------------------------------------------------------------------ numerics
@needs_kernels
@pytest.mark.parametrize("fp8", FP8S, ids=_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_static_matches_reference(shape, dtype, fp8):
    x = _x(*shape, dtype)
    for value in (0.01, 1.0):  # saturating (e4m3) and not
        s = torch.tensor([value], device=DEVICE)
        q = qk.quant_static(x, s, fp8)
        assert q.dtype == fp8 and q.shape == x.shape and q.device == x.device
        assert_codes_close(q, reference.quantize_static(x, s, fp8))


@needs_kernels
@pytest.mark.parametrize("fp8", FP8S, ids=_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_dynamic_matches_reference(shape, dtype, fp8):
    x = _x(*shape, dtype, seed=1)
    q, s = qk.quant_dynamic(x, fp8)
    rq, rs = reference.quantize_dynamic_per_tensor(x, fp8)
    assert s.shape == (1,) and s.dtype == torch.float32 and s.device == x.device
    assert_scales_equal(s, rs)
    assert_codes_close(q, rq)
    assert q.float().abs().max().item() == (448.0 if fp8 == torch.float8_e4m3fn else 57344.0)


@needs_kernels
@pytest.mark.parametrize("fp8", FP8S, ids=_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_per_token_matches_reference(shape, dtype, fp8):
    x = _x(*shape, dtype, seed=2)
    x[0] *= 40  # one loud row must not flatten the others
    q, s = qk.quant_per_token(x, fp8)
    rq, rs = reference.quantize_per_token(x, fp8)
    assert s.shape == (shape[0], 1) and s.dtype == torch.float32 and s.is_contiguous()
    assert_scales_equal(s, rs)
    assert_codes_close(q, rq)


@needs_kernels
@pytest.mark.parametrize("k, block", [(1000, 128), (4096, 1024), (33, 16)])
def test_per_token_two_pass_path(k, block):
    cfg = qk.row_config(k, single_pass_max=block // 2, loop_block=block)
    assert cfg.path == "loop" and cfg.block == block
    x = _x(3, k, seed=3)
    q, s = qk.quant_per_token(x, torch.float8_e4m3fn, config=cfg)
    rq, rs = reference.quantize_per_token(x)
    assert_scales_equal(s, rs)
    assert_codes_close(q, rq)


@needs_kernels
@pytest.mark.parametrize("mode", PLAIN_ACT_SCALES)
@pytest.mark.parametrize("m, k, k_out, two_pass", [(3, 30, 32, False), (300, 70, 80, False), (4, 1000, 1008, True),
                                                    (1, 3, 16, False), (2, 48, 48, False), (5, 6840, 6912, False),
                                                    (3, 3420, 3456, True)])
def test_codes_written_padded(mode, m, k, k_out, two_pass):
    """``k_out``: the codes as row-major ``[M, k_out]``, zeros beyond K, the same codes and scales as without it (the
    layers whose provider padded the weight's K quantize straight into the padded width: one launch)."""
    x = _VIEWS["transposed"](_x(k, m, seed=5)) if m == 3 else _x(m, k, seed=5)
    s = torch.tensor([0.05], device=DEVICE)
    kw = {"config": qk.row_config(k_out, single_pass_max=256, loop_block=256)} if two_pass else {}
    if mode is ActScale.PER_TENSOR_STATIC:
        q, want = qk.quant_static(x, s, torch.float8_e4m3fn, k_out=k_out), qk.quant_static(x, s, torch.float8_e4m3fn)
    elif mode is ActScale.PER_TENSOR_DYNAMIC:
        (q, sc), (want, ws) = qk.quant_dynamic(x, torch.float8_e4m3fn, k_out=k_out), qk.quant_dynamic(
            x, torch.float8_e4m3fn)
        assert torch.equal(sc, ws)
    else:
        (q, sc), (want, ws) = qk.quant_per_token(x, torch.float8_e4m3fn, k_out=k_out, **kw), qk.quant_per_token(
            x, torch.float8_e4m3fn)
        assert torch.equal(sc, ws)
    assert q.shape == (m, k_out) and q.stride() == (k_out, 1)
    assert torch.equal(q[:, :k].view(torch.uint8), want.view(torch.uint8))
    assert not q[:, k:].view(torch.uint8).any()


def test_x_align_hints_only_what_holds():
    """The vector-width hint: 16 bytes' worth where K and the row stride allow it but are not multiples of 16 (6840),
    none for aligned shapes (Triton specializes those), strided columns or a base not 16-byte aligned."""
    def x(k, stride=None, offset=0, dtype=torch.bfloat16):
        buf = torch.zeros(4 * (stride or k) + 16, dtype=dtype)
        return buf[offset:offset + 4 * (stride or k)].view(4, stride or k)[:, :k]

    assert qk.x_align(x(6840)) == 8 and qk.x_align(x(3420)) == 4 and qk.x_align(x(6840, dtype=torch.float32)) == 4
    assert qk.x_align(x(6912)) == 1 and qk.x_align(x(6840, offset=3)) == 1 and qk.x_align(x(71)) == 1
    assert qk.x_align(x(6840, stride=6848)) == 8 and qk.x_align(x(6840).t().contiguous().t()) == 1


_VIEWS = {
    "transposed": lambda b: b.t(),  # [24, 40], strides (1, 24)
    "column slice": lambda b: b[:, 3:19],  # row stride 24 > K = 16
    "row step": lambda b: b[::3],  # row stride 72
    "expanded row": lambda b: b[:1].expand(5, 24),  # row stride 0
}


@needs_kernels
@pytest.mark.parametrize("view", list(_VIEWS))
@pytest.mark.parametrize("mode", PLAIN_ACT_SCALES)
def test_non_contiguous_inputs(mode, view):
    x = _VIEWS[view](_x(40, 24, torch.float16, seed=4))
    assert not x.is_contiguous()
    s = torch.tensor([0.05], device=DEVICE)
    if mode is ActScale.PER_TENSOR_STATIC:
        q, rq = qk.quant_static(x, s, torch.float8_e4m3fn), reference.quantize_static(x.contiguous(), s)
    elif mode is ActScale.PER_TENSOR_DYNAMIC:
        (q, sc), (rq, rs) = qk.quant_dynamic(x, torch.float8_e4m3fn), reference.quantize_dynamic_per_tensor(x)
        assert_scales_equal(sc, rs)
    else:
        (q, sc), (rq, rs) = qk.quant_per_token(x, torch.float8_e4m3fn), reference.quantize_per_token(x)
        assert_scales_equal(sc, rs)
    assert_codes_close(q, rq)


@needs_kernels
@pytest.mark.parametrize("fp8", FP8S, ids=_name)
def test_zero_rows_get_the_floor_scale(fp8):
    x = _x(4, 64, seed=5)
    x[1] = 0
    q, s = qk.quant_per_token(x, fp8)
    assert s[1].item() == pytest.approx(reference.MIN_DYNAMIC_SCALE) and torch.all(q[1].float() == 0)
    assert_scales_equal(s, reference.quantize_per_token(x, fp8)[1])
    zeros = torch.zeros(3, 50, dtype=torch.bfloat16, device=DEVICE)
    q, s = qk.quant_dynamic(zeros, fp8)
    assert_scales_equal(s, reference.quantize_dynamic_per_tensor(zeros, fp8)[1])
    assert torch.all(q.float() == 0)
    q, s = qk.quant_per_token(zeros, fp8)
    assert torch.all(s == torch.tensor(reference.MIN_DYNAMIC_SCALE, dtype=torch.float32))


@needs_kernels
def test_single_row_and_empty():
    x = _x(1, 4096, seed=6)
    q, s = qk.quant_per_token(x, torch.float8_e4m3fn)
    assert s.shape == (1, 1)
    assert_scales_equal(s, reference.quantize_per_token(x)[1])
    q, s = qk.quant_dynamic(x, torch.float8_e4m3fn)
    assert_scales_equal(s, reference.quantize_dynamic_per_tensor(x)[1])
    empty = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    assert qk.quant_static(empty, torch.ones(1, device=DEVICE), torch.float8_e4m3fn).shape == (0, 64)
    q, s = qk.quant_per_token(empty, torch.float8_e4m3fn)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    q, s = qk.quant_dynamic(empty, torch.float8_e4m3fn)
    assert q.shape == (0, 64) and s.shape == (1,) and s.item() == pytest.approx(reference.MIN_DYNAMIC_SCALE)


@needs_kernels
def test_many_row_tiles_fold_into_one_amax(monkeypatch):
    """More row tiles than AMAX_MAX_PROGRAMS: each absmax program loops over several of them."""
    monkeypatch.setattr(qk, "AMAX_MAX_PROGRAMS", 2)
    for row in (20, 44):  # the second step of the first program; the last row
        x = _x(45, 200, seed=7)  # tiles of 16 x 256: 3 row tiles -> 2 programs of 2 steps (the last one empty)
        x[row, 5] = -1e4
        q, s = qk.quant_dynamic(x, torch.float8_e4m3fn)
        rq, rs = reference.quantize_dynamic_per_tensor(x)
        assert_scales_equal(s, rs)
        assert_codes_close(q, rq)


@needs_kernels
def test_outputs_are_new_tensors():
    x = _x(4, 64, seed=8)
    s = torch.tensor([0.1], device=DEVICE)
    q = qk.quant_static(x, s, torch.float8_e4m3fn)
    q2, s2 = qk.quant_dynamic(x, torch.float8_e4m3fn)
    q3, s3 = qk.quant_per_token(x, torch.float8_e4m3fn)
    ptrs = {t.data_ptr() for t in (q, q2, s2, q3, s3)}
    assert len(ptrs) == 5 and not ptrs & {x.data_ptr(), s.data_ptr()}


def test_bad_fp8_dtype():
    with pytest.raises(ValueError, match="float8_e4m3fn or torch.float8_e5m2"):
        qk.quant_static(torch.ones(2, 4), torch.ones(1), torch.bfloat16)


def test_configs():
    assert qk.row_config(33) == qk.RowConfig("rows", qk.ROW_TILE // 64, 64, qk.ROW_TILE_WARPS)
    assert qk.row_config(1000).path == "rows" and qk.row_config(1000).block == 1024
    assert qk.row_config(2048).path == "row"
    big = qk.row_config(qk.SINGLE_PASS_MAX)
    assert big.path == "row" and big.rows == 1 and big.block == qk.SINGLE_PASS_MAX
    beyond = qk.row_config(qk.SINGLE_PASS_MAX + 1)
    assert beyond == qk.RowConfig("loop", 1, qk.LOOP_BLOCK, qk.LOOP_WARPS)
    assert qk.row_config(4096, True).num_warps < qk.row_config(4096, False).num_warps  # large: fewer warps
    assert qk.is_large(16384, 4096) and not qk.is_large(4096, 4096) and not qk.is_large(1, 100000)
    for k in (1, 33, 4096, 5120, 100000):
        for large in (False, True):
            cfg = qk.row_config(k, large)
            assert cfg.num_warps in (1, 2, 4, 8, 16, 32) and cfg.rows * cfg.block >= min(k, cfg.block)
        tile = qk.tile_config(k)
        assert tile.rows * tile.block_k == qk.TILE and tile.block_k >= min(k, qk.TILE_MAX_BLOCK_K)


@needs_kernels
@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("shape", [(1, 33), (2, 4096), (5, 3000)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dynamic_one_program_and_two_kernel_paths(monkeypatch, shape, one_program):
    assert (qk._one_program_block(*shape) is not None) == (shape != (5, 3000))
    if not one_program:
        monkeypatch.setattr(qk, "SMALL_DYNAMIC_MAX", 0)
    elif qk._one_program_block(*shape) is None:
        monkeypatch.setattr(qk, "SMALL_DYNAMIC_MAX", 1 << 20)
    x = _x(*shape, seed=14)
    for view in (x, x[:, : shape[1] // 2]):  # contiguous, and a column slice
        q, s = qk.quant_dynamic(view, torch.float8_e5m2)
        rq, rs = reference.quantize_dynamic_per_tensor(view, "e5m2")
        assert_scales_equal(s, rs)
        assert_codes_close(q, rq)


def _assert_nans_as_reference(q: torch.Tensor, ref: torch.Tensor) -> None:
    """NaN codes exactly where the reference has them; the other codes as :func:`assert_codes_close`."""
    nan, ref_nan = q.float().isnan().cpu(), ref.float().isnan().cpu()
    assert torch.equal(nan, ref_nan), f"NaN codes at {int(nan.sum())} places, the reference at {int(ref_nan.sum())}"
    keep = ~ref_nan
    assert_codes_close(q.cpu()[keep], ref.cpu()[keep])


@needs_kernels
@pytest.mark.parametrize("fp8", FP8S, ids=_name)
@pytest.mark.parametrize(
    "shape, small_dynamic_max, row_block",
    [((3, 64), None, None), ((40, 300), 0, None), ((4, 1000), None, 128)],
    ids=["one-program", "two-kernel", "per-token-two-pass"],
)
def test_nan_is_kept_as_the_reference_keeps_it(monkeypatch, shape, small_dynamic_max, row_block, fp8):
    """A NaN input element quantizes to a NaN code; a NaN in a dynamic scale's input makes that scale NaN (the whole
    tensor per tensor, its row per token), as ``torch.amax`` / ``clamp`` do in the reference. Triton's default
    ``tl.max`` / ``tl.maximum`` / ``tl.clamp`` would drop it (finite scales and codes)."""
    if small_dynamic_max is not None:
        monkeypatch.setattr(qk, "SMALL_DYNAMIC_MAX", small_dynamic_max)
    x = _x(*shape, seed=21)
    x[1, shape[1] // 3] = float("nan")
    s = torch.tensor([0.05], device=DEVICE)
    _assert_nans_as_reference(qk.quant_static(x, s, fp8), reference.quantize_static(x, s, fp8))
    q, sc = qk.quant_dynamic(x, fp8)
    rq, rs = reference.quantize_dynamic_per_tensor(x, fp8)
    assert sc.isnan().all() and rs.isnan().all()
    _assert_nans_as_reference(q, rq)
    config = None
    if row_block is not None:
        config = qk.row_config(shape[1], single_pass_max=row_block // 2, loop_block=row_block)
    q, sc = qk.quant_per_token(x, fp8, config=config)
    rq, rs = reference.quantize_per_token(x, fp8)
    assert torch.equal(sc.isnan().cpu(), rs.isnan().cpu()) and bool(sc[1].isnan())
    keep = ~rs.isnan().flatten().cpu()
    assert_scales_equal(sc.cpu()[keep], rs.cpu()[keep])
    _assert_nans_as_reference(q, rq)


# ------------------------------------------------------------------------------------ through the quant ops
@interpreter_only
def test_registered_for_cpu_through_the_ops():
    previous = qk.register("cpu")
    assert all(p is None for p in previous.values())
    for mode, fn in qk.impls().items():
        assert quant.registered_quant_impl(mode, "cpu") is fn
    x = _x(6, 96, seed=9)
    s = torch.tensor([0.02])
    assert_codes_close(quant.quantize_static(x, s), reference.quantize_static(x, s))
    q, sc = quant.quantize_dynamic(x, "e5m2")
    rq, rs = reference.quantize_dynamic_per_tensor(x, "e5m2")
    assert_scales_equal(sc, rs)
    assert_codes_close(q, rq)
    qa = quant.quantize(x.t(), ActScale.PER_TOKEN)  # non-contiguous through the op
    rq, rs = reference.quantize_per_token(x.t())
    assert_scales_equal(qa.scale, rs)
    assert_codes_close(qa.data, rq)
    for mode in PLAIN_ACT_SCALES:
        op = quant.quant_op(mode)
        args = (x, s, torch.float8_e4m3fn) if mode is ActScale.PER_TENSOR_STATIC else (x, torch.float8_e4m3fn)
        torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_register_returns_what_it_replaced():
    def mine(x, fp8_dtype):
        raise AssertionError("not called")

    quant.register_quant_impl("per_token", "cuda", mine)
    previous = qk.register("cuda")
    assert previous[ActScale.PER_TOKEN] is mine and previous[ActScale.PER_TENSOR_STATIC] is None
    assert quant.registered_quant_impl("per_token", "cuda") is qk.quant_per_token


# ------------------------------------------------------------------------------------ the CUDA default
def _fake_gpus(monkeypatch, sms):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(sms))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: sms[0 if i is None else i])


def test_cuda_default_is_triton_on_sm89_and_newer(monkeypatch):
    _fake_gpus(monkeypatch, [(9, 0), (8, 9)])
    kernels, who, reasons = quant._provider_kernels("cuda")
    assert kernels == qk.impls() and who == "triton (fp8-backends)" and reasons == []
    for mode, fn in qk.impls().items():
        assert quant.default_quant_impl(mode, "cuda") is fn
        assert quant._impl_for(mode, "cuda") is fn
    assert quant.registered_quant_impl("per_token", "cuda") is None, "the default is not a registration"


@pytest.mark.parametrize("sms", [[(8, 0)], [(9, 0), (8, 6)], []])
def test_cuda_default_is_the_reference_on_older_gpus(monkeypatch, sms):
    _fake_gpus(monkeypatch, sms)
    kernels, _, reasons = quant._provider_kernels("cuda")
    assert kernels == {} and len(reasons) == 1 and "SM >= 8.9" in reasons[0], reasons
    assert quant.default_quant_impl("per_token", "cuda") is quant._REFERENCE[ActScale.PER_TOKEN]


@pytest.mark.parametrize("value", ["triton", "torch,triton", "fp8-backends:triton", "fp8_backends:triton"])
def test_cuda_default_respects_disabled(monkeypatch, value):
    _fake_gpus(monkeypatch, [(9, 0)])
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", value)
    kernels, _, reasons = quant._provider_kernels("cuda")
    assert kernels == {} and "FP8_BACKENDS_DISABLED" in reasons[0]
    assert quant.default_quant_impl("per_tensor_static", "cuda") is quant._REFERENCE[ActScale.PER_TENSOR_STATIC]
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "otherdist:triton")  # someone else's provider named triton
    assert quant._provider_kernels("cuda")[0] == qk.impls()
    monkeypatch.setenv("FP8_BACKENDS_DISABLED", "gemm:triton")  # the GEMM provider only: the quant kernels stay
    assert quant._provider_kernels("cuda")[0] == qk.impls()


def test_cpu_never_uses_triton(monkeypatch):
    _fake_gpus(monkeypatch, [(9, 0)])
    for mode in ActScale:
        assert quant.default_quant_impl(mode, "cpu") is quant._REFERENCE[mode]
    x = _x(3, 32, device="cpu", seed=10)
    q, s = quant.quantize_per_token(x)
    rq, rs = reference.quantize_per_token(x)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


def test_decided_once_then_one_lookup(monkeypatch):
    calls = []
    monkeypatch.setattr(quant, "_provider_kernels", lambda device_type: calls.append(1) or ({}, "", ["not here"]))
    for _ in range(3):
        for mode in ActScale:
            assert quant._impl_for(mode, "cuda") is quant._REFERENCE[mode]
    assert calls == [1]
    quant.reset_default_impls()
    quant._impl_for(ActScale.PER_TOKEN, "cuda")
    assert calls == [1, 1]


def test_registered_entry_wins_over_the_default(monkeypatch):
    _fake_gpus(monkeypatch, [(9, 0)])

    def mine(x, scale, fp8_dtype):
        return "mine"

    assert quant._impl_for(ActScale.PER_TENSOR_STATIC, "cuda") is qk.quant_static
    quant.register_quant_impl("per_tensor_static", "cuda", mine)
    assert quant._impl_for(ActScale.PER_TENSOR_STATIC, "cuda") is mine
    quant.register_quant_impl("per_tensor_static", "cuda", None)
    assert quant._impl_for(ActScale.PER_TENSOR_STATIC, "cuda") is qk.quant_static


def test_broken_triton_falls_back_with_a_warning(monkeypatch, caplog):
    from fp8_backends.providers.triton.norm_quant import TritonNormQuantBackend

    def broken(cls, device_type):
        raise ImportError("libtriton.so: cannot open shared object file")

    _fake_gpus(monkeypatch, [(9, 0)])
    monkeypatch.setattr(TritonNormQuantBackend, "activation_quant_kernels", classmethod(broken))
    with caplog.at_level("WARNING", logger="fp8_backends"):
        fn = quant.default_quant_impl("per_token", "cuda")
    assert fn is quant._REFERENCE[ActScale.PER_TOKEN]
    assert "libtriton" in caplog.text


# ============================================================================================ GPU
GPU_SHAPES = [(1, 4096), (32, 5120), (4096, 4096), (333, 14336), (8, 40000)]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8S, ids=_name)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_gpu_matches_reference(dtype, fp8):
    for shape in GPU_SHAPES:
        x = _x(*shape, dtype, device="cuda", seed=11)
        s = torch.tensor([0.05], device="cuda")
        assert_codes_close(qk.quant_static(x, s, fp8), reference.quantize_static(x, s, fp8), 1e-3)
        q, sc = qk.quant_dynamic(x, fp8)
        rq, rs = reference.quantize_dynamic_per_tensor(x, fp8)
        assert_scales_equal(sc, rs)
        assert_codes_close(q, rq, 1e-3)
        q, sc = qk.quant_per_token(x, fp8)
        rq, rs = reference.quantize_per_token(x, fp8)
        assert_scales_equal(sc, rs)
        assert_codes_close(q, rq, 1e-3)


@pytest.mark.gpu
def test_gpu_default_is_triton_and_graph_capturable():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the Triton default needs SM >= 8.9")
    for mode, fn in qk.impls().items():
        assert quant.default_quant_impl(mode, "cuda") is fn
    x = _x(64, 4096, device="cuda", seed=12)
    s = torch.tensor([0.03], device="cuda")

    def run():
        return (quant.quantize_static(x, s), *quant.quantize_dynamic(x), *quant.quantize_per_token(x.t()))

    eager = run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run()
        x.mul_(0.5)
        graph.replay()
        expected = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for a, b in zip(captured, expected):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
    assert not torch.equal(captured[2], eager[2]), "replay must read the new x (the dynamic scale halves)"


@pytest.mark.gpu
def test_gpu_pdl_on_and_off_agree(monkeypatch):
    x = _x(512, 4096, device="cuda", seed=13)
    s = torch.tensor([0.05], device="cuda")
    runs = []
    for pdl in ("1", "0"):
        monkeypatch.setenv("FP8_BACKENDS_PDL", pdl)
        out = (qk.quant_static(x, s, torch.float8_e4m3fn), *qk.quant_dynamic(x, torch.float8_e4m3fn),
               *qk.quant_per_token(x, torch.float8_e4m3fn))
        torch.cuda.synchronize()
        runs.append([t.view(torch.uint8) if t.element_size() == 1 else t for t in out])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
@pytest.mark.parametrize("shape", [(1, 4096), (16, 4096), (512, 4096), (300, 1000)])
def test_gpu_replayed_quant_launches_stay_correct_and_skip_the_general_path(general_launches, shape):
    """The second call of each mode at the same size replays the first launch(es): no general-path launch, and
    the same codes and scales as the reference (the dynamic absmax partials included)."""
    from fp8_backends.core import reference

    fp8 = torch.float8_e4m3fn
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 3
    s = torch.tensor([0.05], device="cuda")
    calls = {"static": lambda t: (qk.quant_static(t, s, fp8), s), "dynamic": lambda t: qk.quant_dynamic(t, fp8),
             "per_token": lambda t: qk.quant_per_token(t, fp8)}
    refs = {"static": lambda t: (reference.quantize_static(t, s, fp8), s),
            "dynamic": lambda t: reference.quantize_dynamic_per_tensor(t, fp8),
            "per_token": lambda t: reference.quantize_per_token(t, fp8)}
    for mode, call in calls.items():
        call(x)
        torch.cuda.synchronize()
        before = len(general_launches)
        y = x * 0.5  # new data, same size and layout
        q, sc = call(y)
        torch.cuda.synchronize()
        assert len(general_launches) == before, f"{mode}: the second call took the general path"
        _, s_ref = refs[mode](y)
        # torch on CUDA divides amax by fmax as a product with 1/fmax: its scale may differ by an ulp, and an ulp
        # moves codes that sit on a rounding tie; so compare the scale within 2 ulps and the codes for our scale
        assert torch.allclose(sc, s_ref, rtol=2.5e-7, atol=0), mode
        q_ref = reference.quantize_static(y, sc, fp8)
        mismatch = (q.float() != q_ref.float()).float().mean().item()
        assert mismatch < 1e-4, f"{mode}: {mismatch:.3%} of the codes differ from the reference at this scale"
