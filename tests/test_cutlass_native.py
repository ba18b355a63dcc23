"""The cutlass provider's C++ ops (``providers/cutlass/native_op.cu``), on the CPU.

The CPU build (``cpu-test``) registers the op for CPU tensors with a null stream; its "kernels" are three functions of a
small C library that record the arguments they receive. A child process (a process loads one build of the op, and the
GPU suite loads the CUDA one) checks what the op hands them: the M bucket of each registered (N, K), the epilogue key,
bias and scale pointers, the stream-K workspace; and that everything it cannot serve reaches the fallback op with the
same arguments (an unknown shape, an unregistered kernel, an unaligned pointer, a non-zero return code) and that the
fallback's exception reaches the caller as it was raised. The block-scaled op serves its registered libraries
and block-table buckets for operands the kernels read as they are, and hands every other layout, shape, dtype and
failure to its fallback. The fused linear op quantizes its input as the reference does
(static, dynamic, per-token; NaN kept; a row stride, a transposed view, a column stride, broadcast rows) before the
same routing, and the fused block linear op quantizes per token in groups of 128 (NaN kept, a ragged last group, any
strides, bf16 / fp16 / fp32) into M-major scales padded to 4 tokens before the block routing. Also:
``torch.compile`` (``aot_eager``, ``fullgraph``) traces the ops through their fakes. On the GPU,
``tests/test_cutlass.py`` and ``tests/test_cutlass_block.py`` run the provider's real kernels through them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from fp8_backends.providers.cutlass import native_op

FAKE_KERNELS = r"""
#include <stddef.h>
#include <stdint.h>
#include <string.h>
typedef struct {
  int which, calls; int64_t m, n, k; const void *x, *w; void *out; const void *xs; int xv; const void *ws; int wv;
  const void *bias; void *work; size_t work_bytes; void *stream;
} rec_t;
rec_t rec;
int rc_next = 0;
unsigned char x_bytes[4096];  /* the first bytes of x_q and scales the last call received */
float x_scales[64];
static int record(int which, const void *x, const void *w, void *out, int64_t m, int64_t n, int64_t k, const void *xs,
                  int xv, const void *ws, int wv, const void *bias, void *work, size_t wb, void *stream) {
  rec.which = which; rec.calls++; rec.m = m; rec.n = n; rec.k = k; rec.x = x; rec.w = w; rec.out = out; rec.xs = xs;
  rec.xv = xv; rec.ws = ws; rec.wv = wv; rec.bias = bias; rec.work = work; rec.work_bytes = wb; rec.stream = stream;
  size_t nb = (size_t)(m * k) < sizeof(x_bytes) ? (size_t)(m * k) : sizeof(x_bytes);
  memcpy(x_bytes, x, nb);
  size_t ns = xv ? ((size_t)m < 64 ? (size_t)m : 64) : 1;
  memcpy(x_scales, xs, ns * sizeof(float));
  return rc_next;
}
#define KERNEL(name, id) int name(const void *x, const void *w, void *o, int64_t m, int64_t n, int64_t k, \
  const void *xs, int xv, const void *ws, int wv, const void *b, void *wk, size_t wb, void *s) \
  { return record(id, x, w, o, m, n, k, xs, xv, ws, wv, b, wk, wb, s); }
KERNEL(gemm_a, 1)
KERNEL(gemm_b, 2)
KERNEL(gemm_c, 3)
size_t ws_size(int64_t m, int64_t n, int64_t k) { return (size_t)(m * 64 + n); }
typedef struct {
  int which, calls; int64_t m, n, k; const void *x, *w; void *out; const float *xs; int64_t xs_ld;
  const float *ws; int64_t ws_ld; const void *bias; void *work; size_t work_bytes; void *stream;
} brec_t;
brec_t brec;
unsigned char bx_bytes[8192];  /* the first bytes of x_q and of its M-major scales the last block call received */
float bx_scales[256];
static void block_copy(const void *x, int64_t m, int64_t k, const float *xs, int64_t xl) {
  size_t nb = (size_t)(m * k) < sizeof(bx_bytes) ? (size_t)(m * k) : sizeof(bx_bytes);
  size_t ns = (size_t)(((k + 127) / 128) * xl);
  memcpy(bx_bytes, x, nb);
  memcpy(bx_scales, xs, (ns < 256 ? ns : 256) * sizeof(float));
}
#define BLOCK_KERNEL(name, id) int name(const void *x, const void *w, void *o, int64_t m, int64_t n, int64_t k, \
  const float *xs, int64_t xl, const float *ws, int64_t wl, const void *b, void *wk, size_t wb, void *s) { \
  brec.which = id; brec.calls++; brec.m = m; brec.n = n; brec.k = k; brec.x = x; brec.w = w; brec.out = o; \
  brec.xs = xs; brec.xs_ld = xl; brec.ws = ws; brec.ws_ld = wl; brec.bias = b; brec.work = wk; brec.work_bytes = wb; \
  brec.stream = s; block_copy(x, m, k, xs, xl); return rc_next; }
BLOCK_KERNEL(block_a, 11)
BLOCK_KERNEL(block_b, 12)
"""

CHILD = r"""
import ctypes, sys, torch
from fp8_backends.providers.cutlass import native_op

fake = ctypes.CDLL(sys.argv[1])
class Rec(ctypes.Structure):
    _fields_ = [("which", ctypes.c_int), ("calls", ctypes.c_int), ("m", ctypes.c_int64), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("x", ctypes.c_void_p), ("w", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("xs", ctypes.c_void_p), ("xv", ctypes.c_int), ("ws", ctypes.c_void_p), ("wv", ctypes.c_int),
                ("bias", ctypes.c_void_p), ("work", ctypes.c_void_p), ("work_bytes", ctypes.c_size_t),
                ("stream", ctypes.c_void_p)]
rec = Rec.in_dll(fake, "rec")
rc_next = ctypes.c_int.in_dll(fake, "rc_next")
addr = {name: ctypes.cast(getattr(fake, name), ctypes.c_void_p).value
        for name in ("gemm_a", "gemm_b", "gemm_c", "ws_size")}

class FallbackRaised(Exception):
    pass

seen = []
operands = []  # (x, x_scale) copies as the fallback received them
def fallback(x, w, xs, ws, bias, out_dtype, config, fast_accum):
    seen.append((tuple(x.shape), tuple(w.shape), config, fast_accum, bias is not None, out_dtype))
    operands.append((x.clone(), xs.clone()))
    if config == "raise":
        raise FallbackRaised("from the fallback")
    return torch.full((x.shape[0], w.shape[0]), 7.0, dtype=out_dtype)

lib = torch.library.Library("fp8b_test", "DEF")
lib.define("fallback(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, ScalarType out_dtype, "
           "str config, bool fast_accum) -> Tensor")
lib.impl("fallback", fallback, "CPU")

native = native_op.load("cpu-test")
native.set_fallback("fp8b_test::fallback")
op = native.op
f8 = torch.float8_e4m3fn
def data(m, n, k):
    return torch.zeros(m, k, dtype=f8), torch.zeros(n, k, dtype=f8), torch.ones(1), torch.ones(1)
def refused(call, cases, describe=repr):
    # every case makes call(case) raise (the op's own check, or the library's error raised by the fallback)
    for case in cases:
        try:
            call(case)
        except RuntimeError:
            continue
        raise AssertionError(f"accepted {describe(case)}")

# 1. nothing registered: the fallback serves, with the same arguments
x, w, xs, ws = data(5, 32, 64)
y = op(x, w, xs, ws, None, torch.bfloat16, "auto", True)
assert seen == [((5, 64), (32, 64), "auto", True, False, torch.bfloat16)], seen
assert (y == 7).all() and y.dtype == torch.bfloat16
assert native.calls() == (0, 1), native.calls()

# 2. buckets and kernels registered: each M reaches its bucket's kernel, with the caller's pointers
native.register_buckets(32, 64, [(16, "a"), (256, "b"), (None, "c")])
for name in "abc":
    native.register_kernel(f"{name}|tensor|bfloat16|1", addr[f"gemm_{name}"], addr["ws_size"], False)
for m, which in ((1, 1), (16, 1), (17, 2), (256, 2), (257, 3), (4096, 3)):
    x, w, xs, ws = data(m, 32, 64)
    calls = rec.calls
    y = op(x, w, xs, ws, None, torch.bfloat16, "auto", True)
    assert rec.calls == calls + 1 and rec.which == which, (m, rec.which)
    assert (rec.m, rec.n, rec.k) == (m, 32, 64)
    assert rec.x == x.data_ptr() and rec.w == w.data_ptr() and rec.out == y.data_ptr()
    assert rec.xs == xs.data_ptr() and rec.ws == ws.data_ptr() and rec.xv == 0 and rec.wv == 0
    assert rec.bias is None and rec.work is None and rec.work_bytes == 0 and rec.stream is None
    assert y.shape == (m, 32) and y.dtype == torch.bfloat16
assert len(seen) == 1, seen

# 3. another epilogue, output dtype or accumulation is another key: not registered, so the fallback serves
x, w, xs, ws = data(8, 32, 64)
op(x, w, torch.ones(8, 1), ws, None, torch.bfloat16, "auto", True)      # per-token: rowwise
op(x, w, xs, ws, None, torch.float16, "auto", True)                     # fp16 out
op(x, w, xs, ws, None, torch.bfloat16, "auto", False)                   # precise accumulation
op(x, w, xs, ws, None, torch.bfloat16, "d", True)                       # an explicit config not registered
op(data(8, 48, 64)[0], torch.zeros(48, 64, dtype=f8), xs, ws, None, torch.bfloat16, "auto", True)  # other N
assert len(seen) == 6, seen

# 4. rowwise kernel with bias and per-channel scales; an explicit config name; stream-K workspace
native.register_kernel("b|rowwise|float32|1", addr["gemm_b"], addr["ws_size"], True)
bias = torch.ones(32)
wsv = torch.ones(32)
y = op(x, w, xs, wsv, bias, torch.float32, "b", True)
assert rec.which == 2 and rec.wv == 1 and rec.xv == 0 and rec.bias == bias.data_ptr()
assert rec.work_bytes == 8 * 64 + 32 and rec.work is not None, (rec.work_bytes, rec.work)
assert y.dtype == torch.float32 and len(seen) == 6

# 5. a failed launch or an unaligned pointer goes to the fallback (which raises the library's errors)
rc_next.value = 3
y = op(x, w, xs, ws, None, torch.bfloat16, "auto", True)
assert len(seen) == 7 and (y == 7).all()
rc_next.value = 0
raw = torch.zeros(8 * 64 + 1, dtype=torch.uint8)
odd = raw[1:].view(f8).view(8, 64)
op(odd, w, xs, ws, None, torch.bfloat16, "auto", True)
assert len(seen) == 8, seen

# 6. the fallback's exception reaches the caller as raised
native.register_buckets(32, 64, [(None, "nothing")])
try:
    op(x, w, xs, ws, None, torch.bfloat16, "raise", True)
except FallbackRaised as exc:
    assert "from the fallback" in str(exc)
else:
    raise AssertionError("the fallback's exception was lost")

# 7. M = 0: an empty output, no kernel call; reset forgets every registration
native.register_buckets(32, 64, [(None, "a")])
calls = rec.calls
y = op(torch.zeros(0, 64, dtype=f8), w, xs, ws, None, torch.bfloat16, "auto", True)
assert y.shape == (0, 32) and rec.calls == calls
native.reset()
op(x, w, xs, ws, None, torch.bfloat16, "auto", True)
assert len(seen) == 10 and rec.calls == calls, (len(seen), rec.calls)

# 8. torch.compile traces the op through its fake, without a graph break, and runs it
native.register_buckets(32, 64, [(None, "a")])
native.register_kernel("a|tensor|bfloat16|1", addr["gemm_a"], addr["ws_size"], False)
@torch.compile(backend="aot_eager", fullgraph=True)
def f(x, w, xs, ws):
    return op(x, w, xs, ws, None, torch.bfloat16, "auto", True) + 1
calls = rec.calls
out = f(x, w, xs, ws)
assert rec.calls == calls + 1 and out.shape == (8, 32), rec.calls
# 9. the fused linear op: quantizes x itself (static, dynamic, per-token) to what the reference computes, then the
#    same GEMM routing (per-token: the rowwise key); a kernel it does not know goes to the fallback with x_q
from fp8_backends.core import reference
x_bytes = (ctypes.c_ubyte * 4096).in_dll(fake, "x_bytes")
x_scales = (ctypes.c_float * 64).in_dll(fake, "x_scales")
lin = native.linear_op
native.register_buckets(32, 64, [(None, "a")])
native.register_kernel("a|rowwise|bfloat16|1", addr["gemm_a"], addr["ws_size"], False)
wide = torch.randn(8, 80, dtype=torch.bfloat16) * 3
wide[3, 5] = float("nan")
xin = wide[:, :64]  # a row stride of 80
s_in = torch.tensor([0.02])
for mode, ref_mode in (("per_tensor_static", "PER_TENSOR_STATIC"), ("per_tensor_dynamic", "PER_TENSOR_DYNAMIC"),
                       ("per_token", "PER_TOKEN")):
    calls = rec.calls
    y = lin(xin, w, ws, s_in if mode == "per_tensor_static" else None, None, torch.bfloat16, mode, "auto", True)
    assert rec.calls == calls + 1 and y.shape == (8, 32) and y.dtype == torch.bfloat16, mode
    q_ref, s_ref = reference.quantize(xin.contiguous(), reference.ActScale[ref_mode],
                                      s_in if mode == "per_tensor_static" else None)
    got = torch.tensor(list(x_bytes[:8 * 64]), dtype=torch.uint8).view(torch.float8_e4m3fn).view(8, 64)
    same = (got.float() == q_ref.float()) | (got.float().isnan() & q_ref.float().isnan())
    assert bool(same.all()), (mode, int((~same).sum()))
    n_s = 8 if mode == "per_token" else 1
    assert rec.xv == int(mode == "per_token"), mode
    got_s = torch.tensor(list(x_scales[:n_s]))
    assert torch.equal(got_s.isnan(), s_ref.reshape(-1).isnan()) and torch.allclose(
        got_s.nan_to_num(), s_ref.reshape(-1).nan_to_num(), rtol=0, atol=0), (mode, got_s, s_ref)
    if mode == "per_tensor_static":
        assert rec.xs == s_in.data_ptr()  # the layer's own scale, never copied
# a miss hands the fallback the op's own x_q and scale (views of its one buffer): the reference's codes and scales
for mode, ref_mode in (("per_tensor_dynamic", "PER_TENSOR_DYNAMIC"), ("per_token", "PER_TOKEN"),
                       ("per_tensor_static", "PER_TENSOR_STATIC")):
    before = len(seen)
    s_arg = s_in if mode == "per_tensor_static" else None
    lin(xin, w, ws, s_arg, None, torch.float16, mode, "auto", True)  # fp16 out: not registered
    assert len(seen) == before + 1 and seen[-1][0] == (8, 64), seen[-1]
    got_q, got_s = operands[-1]
    q_ref, s_ref = reference.quantize(xin.contiguous(), reference.ActScale[ref_mode], s_arg)
    assert got_q.dtype == torch.float8_e4m3fn and got_s.shape == s_ref.shape and got_s.dtype == torch.float32, mode
    same = (got_q.float() == q_ref.float()) | (got_q.float().isnan() & q_ref.float().isnan())
    assert bool(same.all()) and torch.equal(got_s.isnan(), s_ref.isnan()), mode
    assert torch.equal(got_s.nan_to_num(), s_ref.nan_to_num()), (mode, got_s, s_ref)
# a key of another form is refused at registration
for bad_key in ("a|tensor|bfloat16", "a|colwise|bfloat16|1", "a|tensor|int8|1", "a|tensor|bfloat16|2",
                "|tensor|float16|0"):
    try:
        native.register_kernel(bad_key, addr["gemm_a"], addr["ws_size"], False)
    except ValueError:
        pass
    else:
        raise AssertionError(f"registered {bad_key}")
assert lin(xin[:0], w, ws, None, None, torch.bfloat16, "per_token", "auto", True).shape == (0, 32)
# any strides: the codes the GEMM receives are those of the row-major copy
one_row = torch.randn(64, 3, dtype=torch.bfloat16)[:, 1].unsqueeze(0)  # M = 1, a column stride of 3
wide3 = torch.randn(8, 192, dtype=torch.bfloat16)
for name, view in (("transposed", xin.t().contiguous().t()), ("column stride", one_row),
                   ("column slice with a column stride", wide3[:, ::3]), ("broadcast rows", xin[:1].expand(8, 64))):
    for mode, ref_mode in (("per_tensor_dynamic", "PER_TENSOR_DYNAMIC"), ("per_token", "PER_TOKEN")):
        calls = rec.calls
        y = lin(view, w, ws, None, None, torch.bfloat16, mode, "auto", True)
        m = view.shape[0]
        assert rec.calls == calls + 1 and y.shape == (m, 32), (name, mode)
        q_ref, _ = reference.quantize(view.contiguous(), reference.ActScale[ref_mode])
        got = torch.tensor(list(x_bytes[:m * 64]), dtype=torch.uint8).view(torch.float8_e4m3fn).view(m, 64)
        same = (got.float() == q_ref.float()) | (got.float().isnan() & q_ref.float().isnan())
        assert bool(same.all()), (name, mode, int((~same).sum()))
refused(lambda bad: lin(bad.get("x", xin), w, ws, bad.get("scale", s_in), None, torch.bfloat16,
                        bad.get("mode", "per_tensor_static"), "auto", True),
        (dict(mode="per_channel"), dict(mode="per_tensor_static", scale=None), dict(x=xin.to(torch.float8_e4m3fn)),
         dict(x=xin.unsqueeze(0))))
@torch.compile(backend="aot_eager", fullgraph=True)
def g(x):
    return lin(x, w, ws, s_in, None, torch.bfloat16, "per_tensor_static", "auto", True)
calls = rec.calls
assert g(xin).shape == (8, 32) and rec.calls == calls + 1

# 10. the block-scaled op: registered block libraries and buckets serve row-major operands whose activation scales
#     are M-major in a layout the config reads as it is; everything else reaches the block fallback unchanged
class BRec(ctypes.Structure):
    _fields_ = [("which", ctypes.c_int), ("calls", ctypes.c_int), ("m", ctypes.c_int64), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("x", ctypes.c_void_p), ("w", ctypes.c_void_p), ("out", ctypes.c_void_p),
                ("xs", ctypes.c_void_p), ("xs_ld", ctypes.c_int64), ("ws", ctypes.c_void_p), ("ws_ld", ctypes.c_int64),
                ("bias", ctypes.c_void_p), ("work", ctypes.c_void_p), ("work_bytes", ctypes.c_size_t),
                ("stream", ctypes.c_void_p)]
brec = BRec.in_dll(fake, "brec")
baddr = {name: ctypes.cast(getattr(fake, name), ctypes.c_void_p).value for name in ("block_a", "block_b")}
bseen = []
boperands = []  # (x, x_scale) copies as the block fallback received them
def block_fallback(x, w, xs, ws, bias, out_dtype, config):
    bseen.append((tuple(x.shape), tuple(xs.shape), xs.stride(), config, bias is not None, out_dtype))
    boperands.append((x.clone(), xs.clone()))
    if config == "raise":
        raise FallbackRaised("from the block fallback")
    return torch.full((x.shape[0], w.shape[0]), 5.0, dtype=out_dtype)
lib.define("block_fallback(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, ScalarType out_dtype, "
           "str config) -> Tensor")
lib.impl("block_fallback", block_fallback, "CPU")
native.set_block_fallback("fp8b_test::block_fallback")
bop = native.block_op
N, K = 256, 320   # Nb = 2, Kb = 3 (a ragged last group)
def m_major(m, kb, lead):
    return torch.ones(kb, lead)[:, :m].t()
wq = torch.zeros(N, K, dtype=f8)
wsb = torch.ones(2, 3)
def bcall(m, xs=None, config="auto", out=torch.bfloat16, bias=None, x=None, w=wq, ws=wsb):
    x = torch.zeros(m, K, dtype=f8) if x is None else x
    xs = m_major(m, 3, -(-m // 4) * 4) if xs is None else xs
    return bop(x, w, xs, ws, bias, out, config), x, xs
# nothing registered: the fallback
y, _, _ = bcall(8)
assert len(bseen) == 1 and (y == 5).all() and bseen[0][3] == "auto"
native.register_block_buckets(N, K, [(16, "bw_a"), (None, "bw_b")])
native.register_block_kernel("bw_a|bfloat16", baddr["block_a"], addr["ws_size"], True, False)   # cp.async scales
native.register_block_kernel("bw_b|bfloat16", baddr["block_b"], addr["ws_size"], False, True)   # TMA scales
for m, which in ((1, 11), (5, 11), (16, 11), (17, 12), (64, 12)):
    calls = brec.calls
    y, x, xs = bcall(m)
    assert brec.calls == calls + 1 and brec.which == which, (m, brec.which, bseen)
    assert (brec.m, brec.n, brec.k) == (m, N, K) and brec.x == x.data_ptr() and brec.out == y.data_ptr()
    assert brec.xs == xs.data_ptr() and brec.xs_ld == xs.stride(1) and brec.ws == wsb.data_ptr() and brec.ws_ld == 3
    assert (brec.work_bytes > 0) == (which == 11) and brec.stream is None and y.shape == (m, N)
assert len(bseen) == 1, bseen
# the cp.async config takes an unpadded M-major layout; the TMA one does not (the fallback copies it)
calls = brec.calls
bcall(5, xs=m_major(5, 3, 5))
assert brec.calls == calls + 1 and brec.xs_ld == 5 and len(bseen) == 1
bcall(18, xs=m_major(18, 3, 18))
assert brec.calls == calls + 1 and len(bseen) == 2 and bseen[-1][2] == (1, 18)
# row-major activation scales, a transposed or strided x, an unaligned x, ragged shapes, another dtype: the fallback
bcall(32, xs=torch.ones(32, 3))
bcall(32, x=torch.zeros(K, 32, dtype=f8).t())
raw = torch.zeros(32 * K + 1, dtype=torch.uint8)
bcall(32, x=raw[1:].view(f8).view(32, K))
bcall(32, ws=torch.ones(3, 2).t())                                  # weight scales not K-major
bcall(32, xs=m_major(32, 2, 32))                                    # wrong scale shape
bcall(32, out=torch.float16)                                        # no float16 library registered
bcall(32, bias=torch.ones(N, dtype=torch.float32))                  # bias not in the output dtype
bcall(32, x=torch.zeros(32, K, dtype=torch.float8_e5m2))
assert len(bseen) == 10 and brec.calls == calls + 1, (len(bseen), brec.calls)
# a bias in the output dtype, an explicit config, M = 1 with TMA: the padded stride of one group
bias = torch.ones(N, dtype=torch.bfloat16)
y, _, _ = bcall(40, bias=bias, config="bw_b")
assert brec.which == 12 and brec.bias == bias.data_ptr() and len(bseen) == 10
one = torch.ones(1, 4)[:, :1]  # Kb = 1 needs K <= 128
w1, ws1 = torch.zeros(N, 128, dtype=f8), torch.ones(2, 1)
native.register_block_buckets(N, 128, [(None, "bw_b")])
bop(torch.zeros(1, 128, dtype=f8), w1, one, ws1, None, torch.bfloat16, "auto")
assert brec.m == 1 and brec.xs_ld == 4 and len(bseen) == 10, (brec.xs_ld, bseen[-1:])
bop(torch.zeros(1, 128, dtype=f8), w1, torch.ones(1, 1), ws1, None, torch.bfloat16, "auto")  # no padding storage
assert len(bseen) == 11
# a failed launch and an exception reach the fallback / the caller
rc_next.value = 3
bcall(64)
assert len(bseen) == 12
rc_next.value = 0
try:
    bcall(64, config="raise")
except FallbackRaised:
    pass
else:
    raise AssertionError("the block fallback's exception was lost")
for bad_key in ("bw_a", "bw_a|int8", "|bfloat16"):
    try:
        native.register_block_kernel(bad_key, baddr["block_a"], addr["ws_size"], False, False)
    except ValueError:
        pass
    else:
        raise AssertionError(f"registered {bad_key}")
@torch.compile(backend="aot_eager", fullgraph=True)
def h(x, xs):
    return bop(x, wq, xs, wsb, None, torch.bfloat16, "auto") * 2
calls = brec.calls
assert h(torch.zeros(64, K, dtype=f8), m_major(64, 3, 64)).shape == (64, N) and brec.calls == calls + 1
native.reset()
bcall(64)
assert brec.calls == calls + 1 and len(bseen) == 14, (brec.calls, len(bseen))

# 11. the fused block linear op: x quantized per token in groups of 128 as the reference quantizes it (NaN kept, a
#     ragged last group, any strides, bf16 / fp16 / fp32), the scales M-major with the column stride rounded up to 4
#     tokens, then the block routing; a miss hands the block fallback the op's own codes and scales (views of its one
#     buffer)
bx_bytes = (ctypes.c_ubyte * 8192).in_dll(fake, "bx_bytes")
bx_scales = (ctypes.c_float * 256).in_dll(fake, "bx_scales")
blin = native.block_linear_op
native.register_block_buckets(N, K, [(16, "bw_a"), (None, "bw_b")])
native.register_block_kernel("bw_a|bfloat16", baddr["block_a"], addr["ws_size"], True, False)
native.register_block_kernel("bw_b|bfloat16", baddr["block_b"], addr["ws_size"], False, True)
wide = torch.randn(20, 400, dtype=torch.bfloat16) * 5
wide[2, 130] = float("nan")
wide[3, :128] = 0  # an all-zero group: the smallest scale
def same_bits(a, b):
    return bool(((a.float() == b.float()) | (a.float().isnan() & b.float().isnan())).all())
cases = (("row stride", wide[:6, :K]), ("transposed", wide[:6, :K].t().contiguous().t()),
         ("fp32", wide[:6, :K].float()), ("fp16", wide[:6, :K].half()), ("one row", wide[2:3, :K]),
         ("column stride", torch.randn(K, 3, dtype=torch.bfloat16)[:, 1].unsqueeze(0)), ("M = 20", wide[:, :K]))
for name, xin in cases:
    m = xin.shape[0]
    calls = brec.calls
    y = blin(xin, wq, wsb, None, torch.bfloat16, "auto")
    ld = -(-m // 4) * 4
    assert brec.calls == calls + 1 and brec.which == (11 if m <= 16 else 12) and y.shape == (m, N), name
    assert (brec.m, brec.n, brec.k, brec.xs_ld, brec.ws, brec.ws_ld) == (m, N, K, ld, wsb.data_ptr(), 3), name
    q_ref, s_ref = reference.quantize_groups(xin.contiguous(), 128, f8, 448.0)
    got = torch.tensor(list(bx_bytes[:m * K]), dtype=torch.uint8).view(f8).view(m, K)
    got_s = torch.tensor(list(bx_scales[:3 * ld])).view(3, ld)[:, :m].t()
    assert same_bits(got, q_ref), (name, int((got.float() != q_ref.float()).sum()))
    assert same_bits(got_s, s_ref) and got_s.isnan().any() == s_ref.isnan().any(), (name, got_s, s_ref)
before = len(bseen)
y = blin(wide[:6, :K], wq, wsb, None, torch.float16, "auto")  # no float16 library: the fallback, with views
assert len(bseen) == before + 1 and (y == 5).all() and y.dtype == torch.float16
got_q, got_s = boperands[-1]
q_ref, s_ref = reference.quantize_groups(wide[:6, :K].contiguous(), 128, f8, 448.0)
assert bseen[-1][:3] == ((6, K), (6, 3), (1, 8)) and same_bits(got_q, q_ref) and same_bits(got_s, s_ref)
assert blin(wide[:0, :K], wq, wsb, None, torch.bfloat16, "auto").shape == (0, N)
refused(lambda bad: blin(bad, wq, wsb, None, torch.bfloat16, "auto"),
        (wide[:6, :K].to(f8), wide[:6, :K].unsqueeze(0), wide[:6, :K - 16]),
        lambda bad: f"x {tuple(bad.shape)} {bad.dtype}")
@torch.compile(backend="aot_eager", fullgraph=True)
def bl(x):
    return blin(x, wq, wsb, None, torch.bfloat16, "auto") * 2
calls = brec.calls
assert bl(wide[:, :K]).shape == (20, N) and brec.calls == calls + 1
print("native op checks passed", native.calls())
"""


def _cxx() -> str | None:
    return os.environ.get("CXX", "").strip() or shutil.which("c++") or shutil.which("g++")


needs_cxx = pytest.mark.skipif(_cxx() is None or shutil.which("cc") is None and shutil.which("gcc") is None,
                               reason="no C/C++ compiler on this machine (the C++ op builds with one)")


@needs_cxx
def test_cpu_build_serves_registered_kernels_and_hands_the_rest_to_the_fallback(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    src = tmp_path / "fake_kernels.c"
    src.write_text(FAKE_KERNELS, encoding="utf-8")
    fake = tmp_path / "libfake_kernels.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", str(src), "-o", str(fake)], check=True, capture_output=True)
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD), encoding="utf-8")
    env = {**os.environ, "FP8_BACKENDS_CUTLASS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, str(script), str(fake)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "native op checks passed (" in proc.stdout
    # the build is cached: a second load finds it (same key) without compiling
    assert len(list((tmp_path / "cache").glob("native-cpu-test-*/libfp8b_cutlass_native.so"))) == 1


def test_compile_command_links_what_each_build_needs(monkeypatch, tmp_path):
    from fp8_backends.providers.cutlass import build

    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n", encoding="utf-8")
    nvcc.chmod(0o755)
    monkeypatch.setattr(build, "find_nvcc", lambda: str(nvcc))
    cuda = native_op.compile_command("cuda", tmp_path / "out.so")
    assert cuda[0] == str(nvcc) and "-lc10_cuda" in cuda and "-DFP8B_CPU_TEST" not in cuda
    assert "-gencode=arch=compute_90,code=sm_90" in cuda
    at = cuda.index(str(native_op.SOURCE))
    assert cuda[at + 1:at + 3] == ["-o", str(tmp_path / "out.so")] and cuda.index("-lc10") > at
    if _cxx() is not None:
        cpu = native_op.compile_command("cpu-test", tmp_path / "out.so")
        assert "-DFP8B_CPU_TEST" in cpu and "-lc10_cuda" not in cpu
    with pytest.raises(ValueError, match="variant"):
        native_op.compile_command("rocm", tmp_path / "out.so")
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(native_op.NativeBuildError, match="nvcc not found"):
        native_op.compile_command("cuda", tmp_path / "out.so")


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setattr(native_op, "_loaded", None)
    monkeypatch.setattr(native_op, "_failure", None)
    assert native_op.status() == "calls through its C++ op (built at first use)"
    monkeypatch.setenv("FP8_BACKENDS_CUTLASS_NATIVE", "0")
    assert native_op.enabled() is False and native_op.try_load() is None
    assert native_op.status() == "calls through its Python op (FP8_BACKENDS_CUTLASS_NATIVE=0)"
    monkeypatch.setenv("FP8_BACKENDS_CUTLASS_NATIVE", "maybe")
    from fp8_backends.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        native_op.enabled()
    assert "FP8_BACKENDS_CUTLASS_NATIVE" in native_op.status()  # said, not raised: the listing must not break
    monkeypatch.delenv("FP8_BACKENDS_CUTLASS_NATIVE")
    monkeypatch.setattr(native_op, "_failure", "nvcc exploded")
    assert native_op.status() == "calls through its Python op (the C++ op failed: nvcc exploded)"


def test_bucket_registration_refuses_unordered_bounds():
    native = native_op.NativeOp.__new__(native_op.NativeOp)  # only register_buckets' checks run
    with pytest.raises(ValueError, match="ascending"):
        native.register_buckets(32, 64, [(256, "a"), (16, "b"), (None, "c")])
    with pytest.raises(ValueError, match="non-empty"):
        native.register_buckets(32, 64, [])


def test_host_cost_model_follows_the_op_that_will_serve(monkeypatch, tmp_path):
    from fp8_backends.providers.cutlass import build
    from fp8_backends.providers.cutlass.backend import CutlassSm90Backend
    from fp8_backends.registry.host_aware import host_us_of

    monkeypatch.setattr(build, "find_nvcc", lambda: str(tmp_path / "nvcc"))
    if native_op._failure is None:
        assert host_us_of(CutlassSm90Backend, 16, 4096, 4096) == CutlassSm90Backend.native_host_us
    monkeypatch.setenv("FP8_BACKENDS_CUTLASS_NATIVE", "0")
    assert host_us_of(CutlassSm90Backend, 16, 4096, 4096) == CutlassSm90Backend.host_us
    monkeypatch.delenv("FP8_BACKENDS_CUTLASS_NATIVE")
    monkeypatch.setattr(native_op, "_loaded", None)
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    assert host_us_of(CutlassSm90Backend, 16, 4096, 4096) == CutlassSm90Backend.host_us
    assert CutlassSm90Backend.native_host_us < CutlassSm90Backend.host_us


def test_fused_hook_serves_any_strides():
    """The C++ linear op's quantization reads any strides and writes row-major codes: the provider's eager hook hands
    it every input, a column-strided one (M = 1 included) and a row-strided one alike."""
    import torch

    from fp8_backends.core.types import ActScale
    from fp8_backends.providers.cutlass.backend import CutlassSm90Backend

    calls = []
    b = CutlassSm90Backend()
    b._linear_op = lambda *args: calls.append(args) or "served"
    prepared = type("P", (), {"data": None, "scale": None, "weight_scale": None})()
    strided = torch.randn(64, 3, dtype=torch.bfloat16)[:, 1].unsqueeze(0)
    assert strided.shape == (1, 64) and strided.stride(1) == 3
    assert b.fused_quant_gemm_impl(strided, prepared, ActScale.PER_TENSOR_DYNAMIC, None, torch.bfloat16,
                                   None) == "served"
    assert calls[0][0] is strided and calls[0][6] == "per_tensor_dynamic"
    rows = torch.randn(4, 80, dtype=torch.bfloat16)[:, :64]  # a row stride, unit column stride: served
    assert b.fused_quant_gemm_impl(rows, prepared, ActScale.PER_TENSOR_DYNAMIC, None, torch.bfloat16, None) == "served"
    # the call an eager layer binds: the same op arguments, the mode and config bound once
    bound = b.bind_fused_quant_gemm(prepared, ActScale.PER_TOKEN, None, torch.bfloat16, None)
    assert bound(strided) == "served" and calls[2][0] is strided
    assert bound(rows) == "served" and calls[3][0] is rows
    assert calls[3][1:] == (None, None, None, None, torch.bfloat16, "per_token", *b.op_args)
