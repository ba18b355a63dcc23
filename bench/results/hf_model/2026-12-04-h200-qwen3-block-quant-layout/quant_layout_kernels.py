"""CUDA kernels a compiled producer (a transformers-style RMSNorm at H = 4096, or SiLU·mul at 12288) + per-token-group
quantization launch when the scale is wanted in the m_major_tma layout (M-major, column stride padded to 4 tokens):
re-laid out after a row-major quantization (the traced plans' form before traced_quantize_groups) against written in
the layout by the quantization over zero-padded rows (fp8_backends.quant.traced_quantize_groups), and the Triton
kernel's triton_op after the producer (fp8_backends.quant.traced_group_kernel); static M = 1, 4, 130 and dynamic M
(128, 130); whether they give the same codes and scales."""
import torch
import torch.nn.functional as F

from fp8_backends.core import group_scales, reference
from fp8_backends.core.types import ScaleLayout
from fp8_backends.quant import traced_group_kernel, traced_quantize_groups

FP8, FMAX = torch.float8_e4m3fn, 448.0
torch._dynamo.config.recompile_limit = 64  # every form and M compiles the same code object
TMA = ScaleLayout.M_MAJOR_TMA


def relayout(y):
    q, s = reference.quantize_groups(y, 128, FP8, FMAX)
    return q, group_scales.to_layout(s, TMA)


def in_layout(y):
    return traced_quantize_groups(y, 128, FP8, FMAX, TMA)


KERNEL = traced_group_kernel("cuda")


def triton_op(y):
    return KERNEL(y, 128, TMA.value, FP8)


FORMS = {"relayout": relayout, "in_layout": in_layout, "triton_op": triton_op}


def make(form, producer, h, dynamic):
    w = torch.randn(h, dtype=torch.bfloat16, device="cuda")

    def norm(x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return w * (x.float() * torch.rsqrt(v + 1e-6)).to(torch.bfloat16)

    def silu_mul(x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    def f(x):
        return FORMS[form](norm(x) if producer == "norm" else silu_mul(x))
    return torch.compile(f, fullgraph=True, dynamic=dynamic)


def kernels(c, x):
    c(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = c(x)
        torch.cuda.synchronize()
    return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


torch.manual_seed(0)
for producer, h in (("norm", 4096), ("silu_mul", 12288)):
    for dynamic, ms in ((False, (1, 4, 130)), (True, (128, 130))):
        comp = {}
        for form in FORMS:
            torch._dynamo.reset()
            torch.manual_seed(1)
            comp[form] = make(form, producer, h, dynamic)
        for m in ms:
            x = torch.randn(m, h if producer == "norm" else 2 * h, dtype=torch.bfloat16, device="cuda") * 3
            (qa, sa), na = kernels(comp["relayout"], x)
            (qb, sb), nb = kernels(comp["in_layout"], x)
            (qc, sc), nc = kernels(comp["triton_op"], x)
            same = (qa.view(torch.uint8).equal(qb.view(torch.uint8)) and torch.equal(sa, sb)
                    and sa.stride() == sb.stride() and group_scales.is_layout(sb, TMA))
            # the Triton kernel divides as torch on the CPU does; Inductor's code may differ by an fp32 ulp
            close = ((qc.float() - qa.float()).abs().max().item() <= 32 and group_scales.is_layout(sc, TMA)
                     and torch.allclose(sc, sa, rtol=2.4e-7, atol=0))
            print(f"{producer:8s} H={h:5d} {'dynamic' if dynamic else 'static '} M={m:3d}: relayout {len(na)} "
                  f"in_layout {len(nb)} triton_op {len(nc)} kernels; in_layout same bits and layout {same}, "
                  f"triton_op close {close}; in_layout: {nb}; triton_op: {nc}", flush=True)
