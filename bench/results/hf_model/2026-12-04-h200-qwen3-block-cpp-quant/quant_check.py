# the C++ block linear op's quantization against the reference, on the GPU (codes and scales through a recording
# fallback op), and the GEMM's determinism
import torch
from fp8_backends.core import reference, group_scales
from fp8_backends.core.types import ScaleLayout
from fp8_backends.providers.cutlass import native_op
from fp8_backends.providers.cutlass.backend import CutlassSm90Backend

native = native_op.load("cuda")
seen = []
lib = torch.library.Library("diag", "DEF")
lib.define("fb(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias, ScalarType out_dtype, str config) -> Tensor")
def fb(x, w, xs, ws, bias, out_dtype, config):
    seen.append((x.clone(), xs.clone()))
    return torch.zeros(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
lib.impl("fb", fb, "CUDA")
f8 = torch.float8_e4m3fn
b = CutlassSm90Backend()
b._loaded_op()
for m, n, k, dt in ((1, 2112, 7168, torch.bfloat16), (37, 576, 7168, torch.float16), (300, 208, 1008, torch.float32),
                    (1000, 6144, 4096, torch.bfloat16)):
    x = (torch.randn(m, k, device="cuda") * 3).to(dt)
    q_ref, s_ref = reference.quantize_groups(x, 128, f8, 448.0)
    native.set_block_fallback("diag::fb")
    native.block_linear_op(x, torch.zeros(n, k, dtype=f8, device="cuda"), torch.ones(-(-n // 128), -(-k // 128), device="cuda"),
                           None, torch.bfloat16, "no-such-config")
    native.set_block_fallback("fp8_backends::cutlass_sm90_block_gemm")
    q, s = seen[-1]
    dq = (q.float() != q_ref.float()).sum().item()
    ds = (s != s_ref).sum().item()
    print(f"M={m} N={n} K={k} {dt}: codes differ {dq} of {q.numel()}, scales differ {ds} of {s.numel()}, strides {tuple(s.stride())}", flush=True)
    if dq:
        idx = (q.float() != q_ref.float()).nonzero()[:5]
        for r, c in idx.tolist():
            print("   ", r, c, float(x[r, c]), float(q[r, c].float()), float(q_ref[r, c].float()), float(s[r, c // 128]), float(s_ref[r, c // 128]))
    w = (torch.randn(n, k, device="cuda") * 0.02)
    w_q, ws = reference.quantize_groups(w, 128, f8, 448.0)  # not block scales: only for determinism
    wq = torch.randn(n, k, device="cuda").mul(0.1).to(f8)
    wsb = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 0.01 + 0.001
    prepared = b.prepare_weight(wq, wsb)
    tma = group_scales.to_layout(s_ref, ScaleLayout.M_MAJOR_TMA)
    y1 = b.gemm(q_ref, prepared, tma)
    y2 = b.gemm(q_ref, prepared, tma)
    y3 = native.block_linear_op(x, wq, prepared.scale, None, torch.bfloat16, "auto")
    print(f"   gemm twice equal {torch.equal(y1, y2)}; linear op equal {torch.equal(y1, y3)}; max diff {(y1.float()-y3.float()).abs().max().item():.4g}", flush=True)
