"""Does torch._scaled_mm's block-scaled path (1x128 x 128x128) trace under torch.compile (its meta function), which
activation-scale strides does it accept (M-major, M-major padded to 4 tokens), and what does a compiled call cost on
the host against the library's opaque op?"""
import time

import torch

from fp8_backends.core import reference as R
from fp8_backends.providers import torch_block

torch.manual_seed(0)
dev = "cuda"
N, K = 6144, 4096
w = torch.randn(N, K, device=dev) * 0.05
w_q, ws = R.quantize_block(w)
w_t = w_q.t()
padded, why = torch_block.cuda_block_support(0)
print("support", padded, why)
ws_t = torch_block.prepare_scale(ws, bool(padded))
print("w_scale_t", tuple(ws_t.shape), ws_t.stride())


def scales(m, kind):
    x = torch.randn(m, K, device=dev)
    xq, xs = R.quantize_per_token_group(x)
    if kind == "m_major":
        s = xs.t().contiguous().t()
    else:
        mp = -(-m // 4) * 4
        buf = torch.zeros(xs.shape[1], mp, device=dev)
        buf[:, :m] = xs.t()
        s = buf[:, :m].t()
    return xq, xs, s


def ref(xq, xs):
    return R.fp8_gemm(xq, w_q, xs, ws, torch.float32)


for m in (4, 5, 512):
    for kind in ("m_major", "m_major_tma"):
        xq, xs, s = scales(m, kind)
        try:
            y = torch._scaled_mm(xq, w_t, scale_a=s, scale_b=ws_t, out_dtype=torch.bfloat16)
            err = ((y.float() - ref(xq, xs)).norm() / ref(xq, xs).norm()).item()
            print(f"eager M={m} {kind}: ok err {err:.2e}")
        except Exception as e:
            print(f"eager M={m} {kind}: {type(e).__name__}: {str(e)[:200]}")

torch._dynamo.config.recompile_limit = 64


def f(xq, s):
    return torch._scaled_mm(xq, w_t, scale_a=s, scale_b=ws_t, out_dtype=torch.bfloat16)


for dyn in (False, True):
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, dynamic=dyn)
    for m in (512, 128):
        xq, xs, s = scales(m, "m_major")
        try:
            y = cf(xq, s)
            err = ((y.float() - ref(xq, xs)).norm() / ref(xq, xs).norm()).item()
            print(f"compiled dynamic={dyn} M={m}: ok err {err:.2e}")
        except Exception as e:
            print(f"compiled dynamic={dyn} M={m}: {type(e).__name__}: {str(e)[:300]}")

# host cost per call, compiled: torch._scaled_mm direct vs the library's opaque op
torch._dynamo.reset()
op = torch_block.load_op()
xq, xs, s = scales(512, "m_major")


def g(xq, s):
    return torch_block.cuda_gemm(xq, w_t, s, ws_t, None, torch.bfloat16)


variants = {}
for name, fn in (("direct", f), ("opaque_op", g)):
    try:
        c = torch.compile(fn, fullgraph=True)
        c(xq, s)
        variants[name] = c
    except Exception as e:
        print(name, "compile failed", type(e).__name__, str(e)[:200])
for r in range(5):
    row = []
    for name, c in (variants.items() if r % 2 == 0 else reversed(list(variants.items()))):
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        t0 = time.perf_counter()
        for _ in range(200):
            c(xq, s)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        row.append(f"{name} {(t1 - t0) / 200 * 1e6:.1f} us")
    print("host per compiled call:", ", ".join(row))
