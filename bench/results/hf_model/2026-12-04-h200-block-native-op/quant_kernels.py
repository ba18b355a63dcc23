"""Which Inductor kernels a compiled producer (a transformers-style RMSNorm, or SiLU·mul) + per-token-group quant (+ the
m_major_tma relayout) make, for the traced form the layers use now and a one-reduction form; and whether the two
give the same bits."""
import torch
import torch.nn.functional as F
from fp8_backends.layers import traced_plan
from fp8_backends.core import reference
from fp8_backends.core.types import ActScale

FP8, FMAX = torch.float8_e4m3fn, 448.0
import os
DEV = os.environ.get("DEV", "cuda")


def current(x, g):  # the form the layers traced before reference.quantize_groups
    m, k = x.shape
    groups = -(-k // g)
    padded = F.pad(x.detach().float().abs(), (0, groups * g - k))
    scale = (padded.reshape(m, groups, g).amax(dim=-1) / FMAX).clamp_min(reference.MIN_DYNAMIC_SCALE).contiguous()
    return reference.row_major(reference._groupwise(x, scale, g, "div").clamp(-FMAX, FMAX).to(FP8)), scale


def one_pass(x, g):
    return reference.quantize_groups(x, g, FP8, FMAX)


def make(kind, producer, layout, h):
    w = torch.randn(h, dtype=torch.bfloat16, device=DEV)

    def norm(x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        y = x.float() * torch.rsqrt(v + 1e-6)
        return w * y.to(torch.bfloat16)

    def silu_mul(x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b

    def f(x):
        y = norm(x) if producer == "norm" else silu_mul(x)
        q, s = (current if kind == "current" else one_pass)(y, 128)
        if layout != "none":
            s = traced_plan.relayout(s, layout)
        return q, s
    return torch.compile(f, fullgraph=True, dynamic=False)


def kernels(c, x):
    if DEV != "cuda":
        return []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        c(x)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


torch.manual_seed(0)
for producer, h in (("norm", 4096), ("norm", 4160), ("silu_mul", 12288), ("norm", 100)):
    for layout in ("none", "m_major_tma"):
        for m in (128, 130):
            width = h if producer == "norm" else 2 * h
            x = torch.randn(m, width, dtype=torch.bfloat16, device=DEV) * 3
            x[1, 7] = float("nan")
            res = {}
            for kind in ("current", "one_pass"):
                torch._dynamo.reset()
                torch.manual_seed(1)
                c = make(kind, producer, layout, h)
                out = c(x)
                names = kernels(c, x)
                res[kind] = (out, names)
            (qa, sa), na = res["current"]
            (qb, sb), nb = res["one_pass"]
            same = (qa.view(torch.uint8).equal(qb.view(torch.uint8)) and torch.equal(sa.isnan(), sb.isnan())
                    and torch.equal(sa.nan_to_num(), sb.nan_to_num()) and sa.stride() == sb.stride())
            print(f"{producer:8s} H={h:5d} {layout:11s} M={m}: current {len(na)} one_pass {len(nb)} kernels; "
                  f"same bits {same}; {nb}")
