"""A Llama-style decoder block on fp8_backends: fused vs unfused, eager vs compiled vs CUDA graph.

    RMSNorm -> QKV (Fp8Linear) -> attention (scaled_dot_product_attention, GQA, causal)
      -> O proj -> residual RMSNorm -> gate_up (Fp8Linear) -> SiLU·mul -> down (Fp8Linear)

Random weights at Llama-3-8B sizes (hidden 4096, 32 heads / 8 KV heads, intermediate 14336), or a
small block with ``--small`` (the default on the CPU). No rotary embedding and no KV cache: the block
attends over the tokens it is given, which is all the FP8 path needs to be exercised. The block is
vLLM-shaped: ``forward(hidden, residual) -> (hidden, residual)``, the residual add fused into each norm.

Every FP8 linear takes a static per-tensor input scale calibrated on the bf16 block. "fused": each
RMSNormFp8Quant hands its linear a QuantizedActivation from the norm-quant provider; "unfused": the
norms return bf16/fp16 and each linear quantizes its own input.

    python examples/decoder_block.py                      # CPU: small block, reference providers
    python examples/decoder_block.py --device cuda        # GPU: Llama-3-8B sizes, providers chosen by auto
    python examples/decoder_block.py --shards             # QKV / gate-up from separately scaled shards

The classes here are reused by ``bench/decoder_block.py``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8_backends.layers import Fp8Linear, RMSNormFp8Quant, process_weights_after_loading

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEARS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class BlockConfig:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 14336
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def qkv_sizes(self) -> tuple[int, int, int]:
        return self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``name -> (N, K)`` of the four linears."""
        return {"qkv": (sum(self.qkv_sizes), self.hidden), "o": (self.hidden, self.hidden),
                "gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}

    def fp8_weight_bytes(self) -> int:
        return sum(n * k for n, k in self.linear_shapes().values())


LLAMA3_8B = BlockConfig()
SMALL = BlockConfig(hidden=256, heads=4, kv_heads=2, intermediate=512)


# ------------------------------------------------------------------------------------------ shared pieces
def random_weights(cfg: BlockConfig, dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """High-precision weights: linears ``[N, K]`` ~ N(0, 0.02²), norm weights ~ 1 ± 0.1."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {name: (torch.randn(n, k, generator=g) * 0.02).to(dtype=dtype, device=device)
           for name, (n, k) in cfg.linear_shapes().items()}
    for name in ("norm1", "norm2"):
        out[name] = (1 + 0.1 * torch.randn(cfg.hidden, generator=g)).to(dtype=dtype, device=device)
    return out


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_q fp8 [N, K], scale fp32 [1])`` with ``scale = amax / 448``."""
    s = (w.abs().amax().float() / FP8_MAX).clamp_min(1e-12).reshape(1)
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def attention(qkv: torch.Tensor, cfg: BlockConfig) -> torch.Tensor:
    """``qkv: [T, (H + 2·KV)·D]`` -> causal GQA attention over the T tokens -> ``[T, hidden]``."""
    t, d = qkv.shape[0], cfg.head_dim
    q, k, v = qkv.split(cfg.qkv_sizes, dim=-1)
    q = q.view(t, cfg.heads, d).transpose(0, 1).unsqueeze(0)
    k = k.view(t, cfg.kv_heads, d).transpose(0, 1).unsqueeze(0)
    v = v.view(t, cfg.kv_heads, d).transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1).reshape(t, cfg.hidden)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Functional residual add + RMSNorm with the library's semantics: ``r = x + residual`` (fp32,
    stored in the model dtype), ``rmsnorm(r)·weight`` in fp32. Returns ``(normalized fp32, r)``."""
    total = x.float() + residual.float()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed, total.to(x.dtype)


# ------------------------------------------------------------------------------------------ the blocks
class Bf16Block(nn.Module):
    """The high-precision block with ``nn.Linear`` (bf16 or fp16)."""

    def __init__(self, cfg: BlockConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        dtype, device = weights["qkv"].dtype, weights["qkv"].device
        for name, (n, k) in cfg.linear_shapes().items():
            lin = nn.Linear(k, n, bias=False, dtype=dtype, device=device)
            with torch.no_grad():
                lin.weight.copy_(weights[name])
            setattr(self, name, lin)
        self.register_buffer("norm1", weights["norm1"].clone())
        self.register_buffer("norm2", weights["norm2"].clone())

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = add_rmsnorm(hidden, residual, self.norm1, self.cfg.eps)
        a = attention(self.qkv(h.to(hidden.dtype)), self.cfg)
        h, residual = add_rmsnorm(self.o(a), residual, self.norm2, self.cfg.eps)
        g, u = self.gate_up(h.to(hidden.dtype)).chunk(2, dim=-1)
        return self.down(F.silu(g) * u), residual


class PlainFp8Block(nn.Module):
    """FP8 written with torch ops only, as an engine author would: static per-tensor input scales,
    divide / clamp / cast, ``torch._scaled_mm`` on the column-major view of each ``[N, K]`` weight."""

    def __init__(self, cfg: BlockConfig, qweights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 input_scales: dict[str, torch.Tensor], norms: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.cfg = cfg
        for name in LINEARS:
            w_q, w_s = qweights[name]
            self.register_buffer(f"{name}_w", w_q)
            self.register_buffer(f"{name}_ws", w_s.reshape(()).clone())
            self.register_buffer(f"{name}_in", input_scales[name].reshape(()).clone())
        self.register_buffer("norm1", norms["norm1"].clone())
        self.register_buffer("norm2", norms["norm2"].clone())

    def lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        s = getattr(self, f"{name}_in")
        x_q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return torch._scaled_mm(x_q, getattr(self, f"{name}_w").t(), scale_a=s, scale_b=getattr(self, f"{name}_ws"),
                                out_dtype=x.dtype)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = hidden.dtype
        h, residual = add_rmsnorm(hidden, residual, self.norm1, self.cfg.eps)
        a = attention(self.lin(h.to(dtype), "qkv"), self.cfg)
        h, residual = add_rmsnorm(self.lin(a, "o"), residual, self.norm2, self.cfg.eps)
        g, u = self.lin(h.to(dtype), "gate_up").chunk(2, dim=-1)
        return self.lin(F.silu(g) * u, "down"), residual


class Fp8Block(nn.Module):
    """The block on the library: four :class:`Fp8Linear` and two :class:`RMSNormFp8Quant`.

    ``fused=True``: each norm emits a QuantizedActivation for its linear (static input scale).
    ``fused=False``: the norms return the model dtype and the linears quantize. ``shards``: build
    QKV and gate-up from separately quantized shards (``{"qkv": [(w_q, s), ...], ...}``), combined
    as the resolved provider allows. The norms update ``residual`` in place (as vLLM's do).
    """

    def __init__(self, cfg: BlockConfig, qweights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 input_scales: dict[str, torch.Tensor], norms: dict[str, torch.Tensor], *, fused: bool,
                 backend: str | None = None, norm_backend: str | None = None,
                 shards: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        dtype, device = norms["norm1"].dtype, norms["norm1"].device
        for name, (n, k) in cfg.linear_shapes().items():
            if shards and name in shards:
                layer = Fp8Linear.from_fused_shards(shards[name], input_scales=[input_scales[name]] * len(shards[name]),
                                                    dtype=dtype, backend=backend, process=False)
            else:
                layer = Fp8Linear(k, n, act_scale="per_tensor_static", dtype=dtype, backend=backend, device=device)
                layer.load_weights(*qweights[name], input_scale=input_scales[name])
            setattr(self, name, layer)
        self.norm1 = RMSNormFp8Quant(cfg.hidden, cfg.eps, quant_linear=self.qkv if fused else None,
                                     backend=norm_backend, dtype=dtype, device=device)
        self.norm2 = RMSNormFp8Quant(cfg.hidden, cfg.eps, quant_linear=self.gate_up if fused else None,
                                     backend=norm_backend, dtype=dtype, device=device)
        with torch.no_grad():
            self.norm1.weight.copy_(norms["norm1"])
            self.norm2.weight.copy_(norms["norm2"])
        process_weights_after_loading(self)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.norm1(hidden, residual)
        a = attention(self.qkv(h), self.cfg)
        h, residual = self.norm2(self.o(a), residual)
        g, u = self.gate_up(h).chunk(2, dim=-1)
        return self.down(F.silu(g) * u), residual

    def providers(self) -> dict[str, str]:
        out = {name: f"{getattr(self, name).backends_text} ({getattr(self, name).weight_scale_mode.value})"
               for name in LINEARS}
        for name in ("norm1", "norm2"):
            norm = getattr(self, name)
            out[name] = norm.norm_backend.label if norm.norm_backend is not None else "unfused (torch ops)"
        return out


# ------------------------------------------------------------------------------------------ building
@torch.no_grad()
def calibrate_input_scales(block: Bf16Block, hidden: torch.Tensor, residual: torch.Tensor) -> dict[str, torch.Tensor]:
    """Static input scales ``amax / 448`` of each linear's input, from one bf16 forward."""
    amax: dict[str, torch.Tensor] = {}
    hooks = [getattr(block, name).register_forward_pre_hook(
        lambda mod, args, name=name: amax.__setitem__(name, args[0].detach().abs().amax().float()))
        for name in LINEARS]
    try:
        block(hidden, residual.clone())
    finally:
        for h in hooks:
            h.remove()
    return {name: (amax[name] / FP8_MAX).clamp_min(1e-12).reshape(1) for name in LINEARS}


def build_blocks(cfg: BlockConfig, dtype: torch.dtype, device: str, *, backend: str | None = None,
                 norm_backend: str | None = None, shards: bool = False, seed: int = 0,
                 calib_tokens: int = 64) -> dict[str, nn.Module]:
    """``{"bf16", "plain_fp8", "lib_unfused", "lib_fused"}`` blocks sharing one set of random weights."""
    weights = random_weights(cfg, dtype, device, seed)
    bf16 = Bf16Block(cfg, weights)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    calib_h = torch.randn(calib_tokens, cfg.hidden, generator=g).to(dtype=dtype, device=device)
    calib_r = torch.randn(calib_tokens, cfg.hidden, generator=g).to(dtype=dtype, device=device)
    scales = calibrate_input_scales(bf16, calib_h, calib_r)
    qweights = {name: quantize_per_tensor(weights[name]) for name in LINEARS}
    shard_q = None
    if shards:
        q, k, v = weights["qkv"].split(cfg.qkv_sizes, dim=0)
        gate, up = weights["gate_up"].chunk(2, dim=0)
        shard_q = {"qkv": [quantize_per_tensor(w) for w in (q, k, v)],
                   "gate_up": [quantize_per_tensor(w) for w in (gate, up)]}
    norms = {"norm1": weights["norm1"], "norm2": weights["norm2"]}
    blocks = {
        "bf16": bf16,
        "plain_fp8": PlainFp8Block(cfg, qweights, scales, norms),
        "lib_unfused": Fp8Block(cfg, qweights, scales, norms, fused=False, backend=backend,
                                norm_backend=norm_backend, shards=shard_q),
        "lib_fused": Fp8Block(cfg, qweights, scales, norms, fused=True, backend=backend,
                              norm_backend=norm_backend, shards=shard_q),
    }
    del weights
    return blocks


def make_inputs(cfg: BlockConfig, tokens: int, dtype: torch.dtype, device: str,
                seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(tokens, cfg.hidden, generator=g).to(dtype=dtype, device=device)
    residual = torch.randn(tokens, cfg.hidden, generator=g).to(dtype=dtype, device=device)
    return hidden, residual


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------ timing
def time_eager_us(fn: Callable[[], object], device: str, iters: int = 20, warmup: int = 3) -> float:
    """Median µs of one call, each call timed alone (CUDA events on the GPU, wall clock on the CPU)."""
    return time_interleaved_us({"fn": fn}, device, iters, warmup)["fn"]


def time_interleaved_us(fns: dict[str, Callable[[], object]], device: str, iters: int = 20, warmup: int = 3,
                        errors: dict[str, Exception] | None = None) -> dict[str, float]:
    """Median µs of one call of each function, the calls interleaved: each iteration calls every function once, in
    turn, each call timed alone (CUDA events on the GPU, wall clock on the CPU). A change of the GPU's clocks or of the
    host's speed over the run then reaches every function alike, instead of whichever ran its calls during it.
    ``errors``: a function that raises is recorded there and dropped (the others go on); without it the exception
    propagates."""
    live = dict(fns)
    times: dict[str, list[float]] = {key: [] for key in fns}
    start = end = None
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(warmup + iters):
        for key, fn in list(live.items()):
            try:
                if start is not None:
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    us = start.elapsed_time(end) * 1e3
                else:
                    t0 = time.perf_counter()
                    fn()
                    us = (time.perf_counter() - t0) * 1e6
            except Exception as exc:
                if errors is None:
                    raise
                errors[key] = exc
                del live[key]
                continue
            if step >= warmup:
                times[key].append(us)
    return {key: statistics.median(ts) for key, ts in times.items() if ts}


def capture_graph(fn: Callable[[], object], reps: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph holding ``reps`` back-to-back calls of ``fn`` (warmed up on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    torch.cuda.synchronize()
    return graph


def time_graph_us(fn: Callable[[], object], reps: int = 8, iters: int = 20) -> float:
    """Median µs per call inside a CUDA graph of ``reps`` calls (no launch gaps, no host time)."""
    graph = capture_graph(fn, reps)
    us = time_eager_us(graph.replay, "cuda", iters=iters) / reps
    del graph
    return us


# ------------------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> None:
    """Command-line entry; restores the grad mode and the fp8_backends log level it changes."""
    logger = logging.getLogger("fp8_backends")
    level, grad = logger.level, torch.is_grad_enabled()
    try:
        return _main(argv)
    finally:
        logger.setLevel(level)
        torch.set_grad_enabled(grad)


def _main(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--small", action="store_true", default=None, help="small block (default on the CPU)")
    ap.add_argument("--full", dest="small", action="store_false", help="Llama-3-8B sizes even on the CPU")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default: 1 16 (CPU), 1 256 (GPU)")
    ap.add_argument("--backend", default=None, help="GEMM provider (default: FP8_GEMM_BACKEND or auto)")
    ap.add_argument("--norm-backend", default=None,
                    help="norm-quant provider (default: FP8_NORM_QUANT_BACKEND or auto)")
    ap.add_argument("--shards", action="store_true", help="build QKV / gate-up from separately scaled shards")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor on the GPU, "
                    "aot_eager on the CPU)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("fp8_backends").setLevel(logging.INFO)

    device, dtype = args.device, getattr(torch, args.dtype)
    small = args.small if args.small is not None else device == "cpu"
    cfg = SMALL if small else LLAMA3_8B
    tokens = args.tokens or ((1, 16) if device == "cpu" else (1, 256))
    compile_backend = args.compile_backend or ("inductor" if device == "cuda" else "aot_eager")
    torch.set_grad_enabled(False)

    blocks = build_blocks(cfg, dtype, device, backend=args.backend, norm_backend=args.norm_backend,
                          shards=args.shards)
    print(f"block: hidden {cfg.hidden}, heads {cfg.heads}/{cfg.kv_heads}, intermediate {cfg.intermediate}, "
          f"{args.dtype}, {device}; FP8 weights {cfg.fp8_weight_bytes() / 1e6:.1f} MB")
    for variant in ("lib_unfused", "lib_fused"):
        print(f"providers ({variant}):")
        for layer, label in blocks[variant].providers().items():
            print(f"  {layer:8s} {label}")

    rows = []
    for t in tokens:
        hidden, residual = make_inputs(cfg, t, dtype, device)
        ref, _ = blocks["bf16"](hidden, residual.clone())
        for variant in ("bf16", "plain_fp8", "lib_unfused", "lib_fused"):
            block = blocks[variant]
            out, _ = block(hidden, residual.clone())
            assert out.dtype == dtype, (variant, out.dtype)  # fp16 in, fp16 out
            modes = {"eager": block}
            if not args.no_compile:
                torch._dynamo.reset()
                modes["compiled"] = torch.compile(block, backend=compile_backend, fullgraph=True, dynamic=False)
            for mode, fn in modes.items():
                call = functools.partial(fn, hidden, residual.clone())  # the residual is updated in place
                row = {"T": t, "variant": variant, "mode": mode, "relerr_vs_bf16": relerr(call()[0], ref),
                       "eager_us": time_eager_us(call, device, args.iters)}
                if device == "cuda":
                    row["graph_us"] = time_graph_us(call, iters=args.iters)
                rows.append(row)
                graph = f"  in a CUDA graph {row['graph_us']:9.1f} µs" if "graph_us" in row else ""
                print(f"T={t:5d} {variant:12s} {mode:9s} per call {row['eager_us']:9.1f} µs{graph}"
                      f"  relerr vs bf16 {row['relerr_vs_bf16']:.4f}", flush=True)
    fused_vs_unfused = [relerr(blocks["lib_fused"](*make_inputs(cfg, t, dtype, device))[0],
                               blocks["lib_unfused"](*make_inputs(cfg, t, dtype, device))[0]) for t in tokens]
    print("fused vs unfused relerr per T:", ", ".join(f"{e:.4f}" for e in fused_vs_unfused))


if __name__ == "__main__":
    main()
