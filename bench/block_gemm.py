"""``python -m bench.block_gemm``: the block-scaled FP8 GEMM (128x128 weight blocks, 1x128 activation groups) on the
DeepSeek-V3, Qwen3-8B and Qwen3-32B linear shapes, against bf16 ``torch.mm``, ``torch._scaled_mm`` (cuBLASLt
blockwise) and flashinfer's ``fp8_blockscale_gemm_sm90``; and the fused RMSNorm + group quant against a
``torch.compile`` of the torch reference and the copy bandwidth.

    python -m bench.block_gemm --out DIR                  # 15 shapes x M 1..4096, every variant (~10+ min)
    python -m bench.block_gemm --out DIR --quick          # 4 shapes x M 1,16,256,4096, fewer repeats, no flashinfer
    python -m bench.block_gemm --out DIR --models deepseek-v3 --m 1,4,16    # a slice (fits a 10-minute command)
    python -m bench.block_gemm --out DIR --sweep          # also every shipped Triton config (writes a measured table)
    python -m bench.block_gemm --device cpu --smoke --out DIR   # tiny shapes on Triton's interpreter (CPU test)

Per (shape, M), all variants are timed in one :class:`fp8_backends.tuning.timing.CudaGraphTimer` call: a CUDA graph
per variant over weight copies rotated past L2 (the activation is shared), variants interleaved over rounds, median
µs per call; each variant's graph output is NaN-poisoned, replayed and checked against the fp32 reference first (a
wrong variant is reported failed, never timed). Variants:

- ``bf16``: ``torch.mm`` of the dequantized operands in bf16 (what the FP8 path must beat);
- ``triton``: the Triton block GEMM with ``config=auto`` (the M-bucket table), launched with programmatic dependent
  launch as the library does on SM90 (consecutive calls in the graph overlap their prologues), ``triton_nopdl``: the
  same kernel without it (like for like with cuBLAS), and ``triton:<config>`` per kernel family where it is eligible
  (GEMV, swap-AB, tiled, TMA), every shipped config with ``--sweep``;
- ``fused:<config>`` (M <= 4): the fused GEMV, which reads the bf16 activation and quantizes each group itself (the
  fused pick where it serves M, and every ``--fused-configs`` config), against ``quant+triton``: the Triton
  group-quant op, then the block GEMM (``auto``), the two launches it replaces;
- ``scaled_mm``: ``torch._scaled_mm(x_q, w_q.t(), scale_a, scale_b=w_scale.t())`` (SM90, cuBLASLt >= 12.9) called
  directly; the activation-scale layouts M-major, M-major padded to 4 and row-major are tried in that order and the
  first that torch accepts and computes right is timed; every refusal's text is recorded;
- ``auto``: the provider ``auto`` resolves for the problem (its label in the JSON notes), called as below;
- ``provider:<name>``: every other registered provider that serves the block problem (``torch_scaled_mm``, and
  ``cutlass`` or a flashinfer provider where installed), called as a layer calls it: ``prepare_weight`` once,
  ``gemm`` with the activation scales in the layout the provider declares (its M padding included);
- ``flashinfer``: ``flashinfer.gemm.fp8_blockscale_gemm_sm90(x_q, w_q, x_scale, w_scale, out_dtype=bf16)`` when it
  imports (its first call JIT-builds the module, about 130 s on the H200: done once, timed and logged), scale
  layouts probed the same way.
- ``bound:<name>`` (``--bounds``, :mod:`bench.bounds`): an empty launch and one read of the weight (M <= 16), the
  per-tensor FP8 GEMM with and without fast accumulation (every M): what the targets' misses are read against.

Columns: µs, TFLOP/s, % of the weight-read floor at M <= 16 (fp8 weight + fp32 block scales at the copy bandwidth
measured in the run), % of the roofline ceiling (:func:`add_ceilings`: bytes at the copy bandwidth or FLOPs at the
GPU's dense peak, whichever takes longer; bf16 against its own), the ratio to bf16 (``x bf16``: >1 faster) and to
each provider. ``--rerender JSON`` rewrites an earlier run's files with these derived columns. The norm part times
``triton_group`` (fused RMSNorm + group quant, row-major and TMA-padded M-major scales), ``triton_token`` (RMSNorm +
dynamic per-token quant) and ``compiled`` (``torch.compile`` of the reference, one static compile per shape), with
and without the residual add, at % of the copy bandwidth. Writes ``block_gemm.json`` and ``block_gemm.md`` under
``--out`` (and ``block_table.json`` with ``--sweep``: the fastest shipped config per M bucket, loadable with
:func:`fp8_backends.providers.triton.block_gemm_configs.use_table`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

MODELS: dict[str, tuple[tuple[str, int, int], ...]] = {
    # qkv_a: q_a and kv_a fused, as quantize_model / load_pretrained and the engines run them; q_a and kv_a apart for
    # models quantized with fuse=False
    "deepseek-v3": (("qkv_a", 2112, 7168), ("q_a", 1536, 7168), ("kv_a", 576, 7168), ("q_b", 24576, 1536),
                    ("kv_b", 32768, 512),
                    ("o", 7168, 16384), ("gate_up", 36864, 7168), ("down", 7168, 18432)),
    "qwen3-8b": (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)),
    "qwen3-32b": (("qkv", 10240, 5120), ("o", 5120, 8192), ("gate_up", 51200, 5120), ("down", 5120, 25600)),
}
HIDDEN = {"deepseek-v3": 7168, "qwen3-8b": 4096, "qwen3-32b": 5120}
M_VALUES = (1, 4, 16, 64, 256, 1024, 4096)
QUICK_SHAPES = (("deepseek-v3", "kv_a"), ("deepseek-v3", "o"), ("qwen3-8b", "qkv"), ("qwen3-32b", "gate_up"))
QUICK_M = (1, 16, 256, 4096)
TOKENS = (1, 16, 256, 4096, 16384)
QUICK_TOKENS = (16, 4096)
SMOKE_SHAPES = (("smoke", "ragged", 144, 272),)
SMOKE_M = (1, 5)
GROUP = 128
BLOCK = (128, 128)
#: relative Frobenius error bound of an FP8 variant's bf16 output against the fp32 reference (bf16 rounding ~1e-3),
#: and of bf16 torch.mm of the dequantized operands (which rounds its inputs to bf16 too)
FP8_TOL = 1e-2
BF16_TOL = 2e-2
#: dense tensor-core peaks (TFLOP/s: FP8, BF16) of the GPUs the roofline ceiling knows, by the name torch reports;
#: NVIDIA's H100 SXM / H200 datasheets (no sparsity)
PEAK_TFLOPS = {"NVIDIA H200": (1979.0, 989.0), "NVIDIA H100 80GB HBM3": (1979.0, 989.0)}
#: targets of issue 34 (measured against this run's numbers)
FLOOR_TARGET = 0.75
PREFILL_TARGET = 1.6
AUTO_GEOMEAN_TARGET = 0.98
AUTO_POINT_TARGET = 0.93
NORM_TARGET = 0.85


# ---------------------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.block_gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="output folder (default bench/results/<date>-<gpu>/block_gemm)")
    ap.add_argument("--models", nargs="+", default=None, choices=sorted(MODELS), help="model shape tables")
    ap.add_argument("--layers", nargs="+", default=None, help="only these layers (q_a, kv_a, o, gate_up, ...)")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="N,K",
                    help="weight shapes [N, K] to time instead of the model tables (an engine's own, or a grid: "
                    "rows are labelled 'shapes NxK')")
    ap.add_argument("--m", default=None, help="M values, comma-separated (default 1,4,16,64,256,1024,4096)")
    ap.add_argument("--tokens", default=None, help="norm token counts, comma-separated (default 1,16,256,4096,16384)")
    ap.add_argument("--quick", action="store_true", help="4 shapes x M 1,16,256,4096, fewer repeats, no flashinfer")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (with --device cpu: Triton's interpreter)")
    ap.add_argument("--sweep", action="store_true", help="time every shipped Triton config where it is eligible")
    ap.add_argument("--lean", action="store_true",
                    help="the library's variants only: bf16, auto, every provider as a layer calls it, Triton's own "
                    "pick and the raw torch._scaled_mm / flashinfer calls (no per-family Triton configs, no fused "
                    "GEMV, no no-PDL run): the grid of every model shape x M within one device call")
    ap.add_argument("--configs", default="",
                    help="comma-separated Triton configs to time beside the shipped ones, spelled as config names "
                    "(e.g. mm_n64_m64_s4_w4_g8_sk7: a fixed K split of 7); timed where eligible")
    ap.add_argument("--fused-configs", default="",
                    help="comma-separated gemv configs to time as the fused GEMV (the activation quantized in the "
                    "launch, from bf16) at M <= 4, beside the fused pick and quantize-then-GEMV")
    ap.add_argument("--flashinfer", choices=("auto", "on", "off"), default="auto",
                    help="time flashinfer's fp8_blockscale_gemm_sm90, directly and as the flashinfer_block provider "
                    "(auto: on unless --quick/--smoke)")
    ap.add_argument("--skip-providers", default="", help="comma-separated registered providers not to time "
                    "(e.g. cutlass where its kernels are not built yet: resolving it would build them)")
    ap.add_argument("--bounds", action="store_true",
                    help="also time each point's bounds (bench/bounds.py): an empty launch and one read of the "
                    "weight at M <= 16, the per-tensor FP8 GEMM with fast accumulation at every M; each miss of a "
                    "target names what its bound reaches")
    ap.add_argument("--no-norm", action="store_true", help="skip the fused norm + quant part")
    ap.add_argument("--no-gemm", action="store_true", help="skip the GEMM part")
    ap.add_argument("--no-compile-baseline", action="store_true", help="norm part without torch.compile")
    ap.add_argument("--norm-configs", action="store_true",
                    help="norm part: also time every launch shape (rows per program 1/2/4 x 4/8/16 warps) of the "
                    "one-pass kernel, and the static-scale kernel of the same bytes (what the dynamic part costs)")
    ap.add_argument("--rerender", default=None, metavar="JSON",
                    help="measure nothing: rewrite an earlier run's block_gemm.json(.gz) with what this version "
                    "derives from it (roofline ceilings) under --out")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--replays", type=int, default=None)
    return ap


def _ints(text: str | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return default if not text else tuple(int(v) for v in text.split(",") if v.strip())


def _shape(text: str) -> tuple[int, int]:
    """``"N,K"`` (or ``"NxK"``) as ``(N, K)``."""
    parts = text.replace("x", ",").split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--shapes takes N,K pairs of positive integers, got {text!r}")
    return int(parts[0]), int(parts[1])


def gemm_shapes(args: argparse.Namespace) -> list[tuple[str, str, int, int]]:
    """``(model, layer, N, K)`` of the run."""
    if args.smoke:
        return list(SMOKE_SHAPES)
    if args.shapes:
        return [("shapes", f"{n}x{k}", n, k) for n, k in (_shape(text) for text in args.shapes)]
    if args.quick and not args.models:
        pairs = QUICK_SHAPES
        table = {(model, layer): (n, k) for model, rows in MODELS.items() for layer, n, k in rows}
        shapes = [(model, layer, *table[(model, layer)]) for model, layer in pairs]
    else:
        shapes = [(model, layer, n, k) for model in (args.models or MODELS) for layer, n, k in MODELS[model]]
    if args.layers:
        shapes = [s for s in shapes if s[1] in args.layers]
    return shapes


# ---------------------------------------------------------------------------------------------- data
def _quantize_groups(x: Any, fp8: Any) -> tuple[Any, Any]:
    """Per-token-group quantization (G = 128) of ``x``: ``(x_q, scale [M, Kg] row-major)`` (the reference's), with
    each group's scale rounded to a power of two and its first code set to the type's largest value: the dequantized
    activation is then exact in bf16 and quantizes back to the same codes and scales (the fused variants read it)."""
    import torch

    from fp8_backends.core import reference

    x_q, scale = reference.quantize_per_token_group(x, GROUP, fp8)
    codes = x_q.float()
    codes[:, ::GROUP] = torch.finfo(fp8).max
    return codes.to(fp8), scale.log2().round().exp2()


def _quantize_blocks(w: Any, fp8: Any) -> tuple[Any, Any]:
    """128x128 block quantization of ``w``: ``(w_q, scale [Nb, Kb] row-major fp32)`` (the reference's)."""
    from fp8_backends.core import reference

    return reference.quantize_block(w, BLOCK, fp8)


def scale_layouts(xs: Any) -> dict[str, Any]:
    """``xs [M, Kg]`` (row-major) in the three layouts: ``m_major``, ``m_major_tma`` (M padded to 4), ``row_major``."""
    import torch

    m, kg = xs.shape
    padded = torch.zeros((kg, -(-m // 4) * 4), dtype=torch.float32, device=xs.device)
    padded[:, :m] = xs.t()
    return {"m_major": xs.t().contiguous().t(), "m_major_tma": padded[:, :m].t(), "row_major": xs.contiguous()}


class GemmData:
    """The operands of one (N, K) shape at one M: quantized activation (shared by every call), ``sets`` copies of the
    quantized weight and its scales (rotated past L2), the bf16 dequantized operands, and the fp32 reference."""

    def __init__(self, m: int, n: int, k: int, device: str, l2_bytes: int, seed: int = 0) -> None:
        import torch

        from fp8_backends.tuning.timing import rotation_count

        fp8 = torch.float8_e4m3fn
        g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + m * 131 + n * 7 + k)
        x = torch.randn(m, k, device=device, generator=g)
        w = torch.randn(n, k, device=device, generator=g) * 0.05
        self.x_q, xs = _quantize_groups(x, fp8)
        w_q, ws = _quantize_blocks(w, fp8)
        del x, w
        self.xs = scale_layouts(xs)
        x_deq = self.x_q.float() * xs.repeat_interleave(GROUP, 1)[:, :k]
        w_deq = w_q.float() * ws.repeat_interleave(BLOCK[0], 0)[:n].repeat_interleave(BLOCK[1], 1)[:, :k]
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            self.ref = x_deq @ w_deq.t()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        self.x_bf16 = x_deq.to(torch.bfloat16)
        w_bf16 = w_deq.to(torch.bfloat16)
        del x_deq, w_deq
        self.sets = rotation_count(n * k, l2_bytes) if device.startswith("cuda") else 1
        self.bf16_sets = rotation_count(2 * n * k, l2_bytes) if device.startswith("cuda") else 1
        self.w_q = [w_q] + [w_q.clone() for _ in range(self.sets - 1)]
        self.ws = [ws] + [ws.clone() for _ in range(self.sets - 1)]
        self.w_bf16 = [w_bf16] + [w_bf16.clone() for _ in range(self.bf16_sets - 1)]
        self.ref_norm = self.ref.norm().clamp_min(1e-30)

    def error(self, out: Any) -> float:
        return float(((out.float() - self.ref).norm() / self.ref_norm).item())

    def check(self, tol: float) -> Callable[[Any], tuple[float, str | None]]:
        def check(out: Any) -> tuple[float, str | None]:
            err = self.error(out)
            return err, (None if err < tol else f"relative error {err:.3g} >= {tol}")

        return check


# ---------------------------------------------------------------------------------------------- providers
def family_configs(m: int, n: int, k: int, sweep: bool, lean: bool = False) -> dict[str, str]:
    """``{label: config name}`` of the Triton variants at ``M x N x K``: ``triton`` (auto) and one config per eligible
    family (every eligible shipped config with ``sweep``; none with ``lean``)."""
    from fp8_backends.providers.triton import block_gemm_configs as bc

    out = {"triton": "auto"}
    if lean:
        return out
    names: list[str] = []
    if sweep:
        names = [c.name for c in bc.CONFIG_LIST if (c.max_m is None or m <= c.max_m)
                 and (c.family != "tma" or k % 16 == 0)]
    else:
        if m <= 4:
            names.append("gemv_n4_g4_w4" if k <= 2048 else "gemv_n2_g8_w2")
        if m <= 256:
            names.append("swap_n64_m16_s8_w4_sk0" if m <= 16 else "swap_n64_m32_s6_w4_sk0" if m <= 32 else
                         "swap_n64_m64_s5_w4_sk0" if m <= 64 else "swap_n128_m64_s4_w8_sk0")
        names.append("mm_n128_m64_s4_w4_g8_sk0" if m <= 512 else "mm_n128_m128_s4_w8_g8_sk0")
        if m >= 64 and k % 16 == 0:
            names.append("tma_n128_m64_s4_w4_g8_p2")
    for name in names:
        out[f"triton:{name}"] = name
    return out


def extra_configs(names: str, m: int, k: int) -> list[Any]:
    """The ``--configs`` configs (:meth:`BlockTileConfig.from_name`) eligible at ``M``, ``K`` (a config's ``max_m``,
    TMA's 16-byte rows)."""
    from fp8_backends.providers.triton import block_gemm_configs as bc

    cfgs = [bc.BlockTileConfig.from_name(name.strip()) for name in names.split(",") if name.strip()]
    return [c for c in cfgs if (c.max_m is None or m <= c.max_m) and (c.family != "tma" or k % 16 == 0)]


def _scaled_mm_call(data: GemmData, layout: str) -> Callable[[int], Any]:
    import torch

    xs = data.xs[layout]

    def call(i: int) -> Any:
        return torch._scaled_mm(data.x_q, data.w_q[i].t(), scale_a=xs, scale_b=data.ws[i].t(), out_dtype=torch.bfloat16)

    return call


class Flashinfer:
    """flashinfer's ``fp8_blockscale_gemm_sm90``: imported and JIT-built once per run (the build is timed)."""

    def __init__(self, enabled: bool, device: str) -> None:
        self.fn: Any = None
        self.status: dict[str, Any] = {"enabled": enabled}
        if not enabled or not device.startswith("cuda"):
            self.status["error"] = "off" if not enabled else "needs a CUDA device"
            return
        try:
            from flashinfer.gemm import fp8_blockscale_gemm_sm90
        except Exception as exc:  # not installed, or a broken install
            self.status["error"] = f"not importable: {type(exc).__name__}: {exc}"[:400]
            return
        import torch

        self.status["version"] = _dist_version("flashinfer-python")
        print("flashinfer: building fp8_blockscale_gemm_sm90 (JIT, about 130 s the first time on a machine) ...",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            x = torch.randn(16, 256, device=device).to(torch.float8_e4m3fn)
            w = torch.randn(128, 256, device=device).to(torch.float8_e4m3fn)
            xs = torch.ones(16, 2, device=device)
            ws = torch.ones(1, 2, device=device)
            fp8_blockscale_gemm_sm90(x, w, xs, ws, out_dtype=torch.bfloat16)
            torch.cuda.synchronize()
        except Exception as exc:
            self.status["error"] = f"first call failed: {type(exc).__name__}: {exc}"[:400]
            return
        self.status["build_s"] = round(time.perf_counter() - t0, 1)
        print(f"flashinfer: ready after {self.status['build_s']} s", file=sys.stderr, flush=True)
        self.fn = fp8_blockscale_gemm_sm90

    def call(self, data: GemmData, layout: str) -> Callable[[int], Any]:
        import torch

        xs, fn = data.xs[layout], self.fn

        def call(i: int) -> Any:
            return fn(data.x_q, data.w_q[i], xs, data.ws[i], out_dtype=torch.bfloat16)

        return call


def _dist_version(dist: str) -> str | None:
    from bench import common

    return common.dist_version(dist)


def probe_layouts(name: str, make: Callable[[str], Callable[[int], Any]], data: GemmData,
                  layouts: tuple[str, ...] = ("m_major", "m_major_tma", "row_major")
                  ) -> tuple[Callable[[int], Any] | None, str | None, dict[str, str]]:
    """The first activation-scale layout ``make(layout)`` accepts and computes right with: ``(call, layout,
    {layout: why not})`` (``call`` None when none works)."""
    import torch

    refused: dict[str, str] = {}
    for layout in layouts:
        call = make(layout)
        try:
            out = call(0)
            if data.x_q.is_cuda:
                torch.cuda.synchronize()
        except Exception as exc:
            refused[layout] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
            continue
        err = data.error(out)
        if err < FP8_TOL:
            return call, layout, refused
        refused[layout] = f"wrong result: relative error {err:.3g}"
    return None, None, refused


# ---------------------------------------------------------------------------------------------- the GEMM grid
def gemm_point(model: str, layer: str, n: int, k: int, m: int, device: str, timer: Any, args: argparse.Namespace,
               copy_gbps: float | None, flashinfer: Flashinfer, l2_bytes: int) -> dict[str, Any]:
    """Every variant at one (shape, M), timed together."""
    import torch

    from fp8_backends.providers.triton import block_gemm_ops as bg
    from fp8_backends.tuning.timing import Measurement, Run

    data = GemmData(m, n, k, device, l2_bytes)
    runs: dict[str, Run] = {}
    configs: dict[str, str] = {}
    notes: dict[str, Any] = {}
    runs["bf16"] = Run(lambda i: torch.mm(data.x_bf16, data.w_bf16[i].t()), data.bf16_sets, data.check(BF16_TOL))
    if args.bounds:
        from bench import bounds

        runs.update(bounds.bound_runs(data.x_q, data.w_q, m))
    xs_triton = data.xs["m_major_tma"]
    for label, config in family_configs(m, n, k, args.sweep, args.lean).items():
        configs[label] = bg.pick_config(config, m, n, k).name

        def call(i: int, config: str = config) -> Any:
            return bg.launch(data.x_q, data.w_q[i], xs_triton, data.ws[i], None, torch.bfloat16, GROUP, config)

        runs[label] = Run(call, data.sets, data.check(FP8_TOL))
    for cfg in extra_configs(args.configs, m, k):
        configs[f"triton:{cfg.name}"] = cfg.name

        def extra(i: int, cfg: Any = cfg) -> Any:
            out = data.x_q.new_empty((m, n), dtype=torch.bfloat16)
            bg.run_config(cfg, data.x_q, data.w_q[i], xs_triton, data.ws[i], None, out, GROUP)
            return out

        runs[f"triton:{cfg.name}"] = Run(extra, data.sets, data.check(FP8_TOL))
    if m <= 4 and (args.fused_configs or not args.lean):
        _fused_runs(runs, configs, data, m, n, k, args.fused_configs)
    # Triton's pick without programmatic dependent launch: like for like with cuBLAS
    if device.startswith("cuda") and not args.lean:
        auto_cfg = bg.pick_config("auto", m, n, k)
        configs["triton_nopdl"] = auto_cfg.name

        def nopdl(i: int) -> Any:
            out = data.x_q.new_empty((m, n), dtype=torch.bfloat16)
            bg.run_config(auto_cfg, data.x_q, data.w_q[i], xs_triton, data.ws[i], None, out, GROUP, pdl=False)
            return out

        runs["triton_nopdl"] = Run(nopdl, data.sets, data.check(FP8_TOL))
    call, layout, refused = probe_layouts("scaled_mm", lambda lay: _scaled_mm_call(data, lay), data)
    notes["scaled_mm"] = {"layout": layout, "refused": refused}
    if call is not None:
        runs["scaled_mm"] = Run(call, data.sets, data.check(FP8_TOL))
    skip = {p.strip() for p in args.skip_providers.split(",") if p}
    if flashinfer.fn is None:  # flashinfer off (--quick, or not importable): its provider too (its first call builds)
        skip |= {"flashinfer_block"}
    _provider_runs(runs, notes, data, m, n, k, device, skip)
    if flashinfer.fn is not None:
        if k % 128 or n % 64:
            notes["flashinfer"] = {"layout": None, "refused": {"all": "needs K % 128 == 0 and N % 64 == 0"}}
        else:
            call, layout, refused = probe_layouts("flashinfer", lambda lay: flashinfer.call(data, lay), data,
                                                  ("m_major_tma", "row_major", "m_major"))
            notes["flashinfer"] = {"layout": layout, "refused": refused}
            if call is not None:
                runs["flashinfer"] = Run(call, data.sets, data.check(FP8_TOL))
    if not device.startswith("cuda"):
        _check_first_calls(runs)  # the CPU timer checks nothing itself
    measured: dict[str, Measurement] = timer(runs)
    return analyse_point(model, layer, n, k, m, measured, configs, notes, copy_gbps)


def _fused_runs(runs: dict[str, Any], configs: dict[str, str], data: GemmData, m: int, n: int, k: int,
                names: str) -> None:
    """The fused GEMV from the bf16 activation (``fused:<config>``: the fused pick where it serves M, and every
    ``--fused-configs`` config) and what it replaces, ``quant+triton``: the Triton group-quant op (TMA-padded M-major
    scales), then the block GEMM with ``config=auto``."""
    import torch

    from fp8_backends.providers.triton import block_gemm_args as ba
    from fp8_backends.providers.triton import block_gemm_ops as bg
    from fp8_backends.providers.triton import group_quant_ops as gq
    from fp8_backends.providers.triton.block_gemm_configs import BlockTileConfig
    from fp8_backends.tuning.timing import Run

    picked = ba.fused_config("auto", m, n, k)
    wanted = ([picked.name] if picked is not None else []) + [c.strip() for c in names.split(",") if c.strip()]
    for name in dict.fromkeys(wanted):
        cfg = BlockTileConfig.from_name(name)
        if cfg.family != "gemv":
            raise SystemExit(f"--fused-configs takes gemv configs, got {name}")
        configs[f"fused:{name}"] = name

        def fused(i: int, cfg: Any = cfg) -> Any:
            out = data.x_bf16.new_empty((m, n))
            bg.run_config(cfg, data.x_bf16, data.w_q[i], data.ws[i], data.ws[i], None, out, GROUP, x_quant=True)
            return out

        runs[f"fused:{name}"] = Run(fused, data.sets, data.check(FP8_TOL))
    configs["quant+triton"] = bg.pick_config("auto", m, n, k).name

    def quant_then_gemm(i: int) -> Any:
        x_q, xs = gq.quant_per_token_group(data.x_bf16, GROUP, torch.float8_e4m3fn, "m_major_tma")
        return bg.launch(x_q, data.w_q[i], xs, data.ws[i], None, torch.bfloat16, GROUP)

    runs["quant+triton"] = Run(quant_then_gemm, data.sets, data.check(FP8_TOL))


def _provider_runs(runs: dict[str, Any], notes: dict[str, Any], data: GemmData, m: int, n: int, k: int,
                   device: str, skip: Collection[str] = ()) -> None:
    """``provider:<name>``: every registered GEMM provider but ``triton`` (timed per kernel family above) that serves
    the block problem, called as a layer calls it (``prepare_weight`` once per weight copy, ``gemm`` with the
    activation scales in the layout it declares); the refusals of the others in ``notes["providers"]``."""
    from fp8_backends.core import group_scales
    from fp8_backends.core.types import GemmProblem
    from fp8_backends.registry.discovery import discover
    from fp8_backends.registry.resolution import resolve_gemm_backend
    from fp8_backends.tuning.timing import Run

    problem = GemmProblem(n=n, k=k, m=m, act_scale="per_token_group", weight_scale="block",
                          device="cuda" if device.startswith("cuda") else "cpu")
    refused: dict[str, str] = {}
    picked = None
    for entry in [None, *discover("gemm")]:  # None: what ``auto`` resolves for the problem, timed as "auto"
        label = "auto" if entry is None else f"provider:{entry.name}"
        if entry is not None and (entry.name == "triton" or entry.name in skip or label in runs):
            continue
        try:
            backend = resolve_gemm_backend("auto" if entry is None else entry.name, problem=problem)
            if entry is None:
                picked = backend.label
                if backend.name in skip:
                    raise RuntimeError(f"auto picked {backend.label}, skipped by --skip-providers")
            prepared = [backend.prepare_weight(w, s) for w, s in zip(data.w_q, data.ws)]
            xs = group_scales.to_layout(data.xs["row_major"], backend.capabilities.group_scale_layout)
        except Exception as exc:  # refused (capabilities, platform) or broken: recorded, the run goes on
            text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
            refused["auto" if entry is None else entry.name] = text[:300]
            continue

        def call(i: int, backend: Any = backend, prepared: list = prepared, xs: Any = xs) -> Any:
            return backend.gemm(data.x_q, prepared[i], xs)

        runs[label] = Run(call, data.sets, data.check(FP8_TOL))
    notes["providers"] = {"layout": None, "refused": refused, "auto": picked}


def _check_first_calls(runs: dict[str, Any]) -> None:
    """Make each run check its first output (``Run.check``) and raise on a wrong one (the CPU timer then records the
    variant failed)."""
    for run in runs.values():
        if run.check is None:
            continue

        def checked(i: int, fn: Any = run.fn, check: Any = run.check, done: list[bool] = []) -> Any:  # noqa: B006
            out = fn(i)
            if not done:
                done.append(True)
                _, why = check(out)
                if why:
                    raise AssertionError(f"wrong output: {why}")
            return out

        run.fn = checked


def add_ceilings(point: dict[str, Any], copy_gbps: float | None, gpu: str | None) -> dict[str, Any]:
    """The roofline ceiling of a GEMM point, in place: ``ceiling_us`` for the FP8 variants (the larger of the bytes at
    the run's copy bandwidth, fp8 activation and weight + fp32 scales + bf16 output, and the FLOPs at the GPU's dense
    FP8 peak), ``bf16_ceiling_us`` the same for bf16 (2-byte operands, the BF16 peak), and each timed variant's
    ``pct_ceiling`` against its own. Nothing where the copy bandwidth or the GPU's peaks are unknown
    (:data:`PEAK_TFLOPS`). Works on a point read back from ``block_gemm.json`` too."""
    peaks = PEAK_TFLOPS.get(gpu or "")
    if not copy_gbps or peaks is None:
        return point
    m, n, k = point["m"], point["n"], point["k"]
    flops = 2.0 * m * n * k
    fp8_bytes = m * k + 4 * m * math.ceil(k / GROUP) + point["weight_bytes"] + 2 * m * n
    bf16_bytes = 2 * (m * k + n * k + m * n)
    bw = copy_gbps * 1e3  # bytes per µs
    point["ceiling_us"] = max(fp8_bytes / bw, flops / (peaks[0] * 1e6))
    point["bf16_ceiling_us"] = max(bf16_bytes / bw, flops / (peaks[1] * 1e6))
    for label, row in point["variants"].items():
        if row.get("us"):
            ceiling = point["bf16_ceiling_us"] if label == "bf16" else point["ceiling_us"]
            row["pct_ceiling"] = 100.0 * ceiling / row["us"]
    return point


def analyse_point(model: str, layer: str, n: int, k: int, m: int, measured: dict[str, Any], configs: dict[str, str],
                  notes: dict[str, Any], copy_gbps: float | None) -> dict[str, Any]:
    flops = 2.0 * m * n * k
    weight_bytes = n * k + 4 * math.ceil(n / BLOCK[0]) * math.ceil(k / BLOCK[1])
    floor_us = weight_bytes / (copy_gbps * 1e3) if copy_gbps else None
    variants: dict[str, dict[str, Any]] = {}
    for label, meas in measured.items():
        row: dict[str, Any] = meas.to_json()
        row["config"] = configs.get(label)
        if meas.ok:
            us = meas.median_us
            row["us"] = us
            row["tflops"] = flops / (us * 1e-6) / 1e12
            if floor_us is not None and m <= 16 and label != "bf16":
                row["pct_floor"] = 100.0 * floor_us / us
        variants[label] = row
    point = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "flops": flops, "weight_bytes": weight_bytes,
             "floor_us": floor_us, "variants": variants, "notes": notes}
    return point | point_ratios(variants, notes)


def point_ratios(variants: dict[str, dict[str, Any]], notes: dict[str, Any]) -> dict[str, Any]:
    """A point's comparisons from its variants' µs: Triton's pick and best family against bf16 and the raw calls;
    ``auto`` (what a layer runs) against bf16 and against the fastest provider called as a layer calls it
    (``triton``: its own config pick, ``provider:<name>``: every other provider)."""
    us = {label: v["us"] for label, v in variants.items() if "us" in v}
    triton_labels = [lab for lab in us if lab.startswith("triton")]
    best_triton = min(triton_labels, key=us.get) if triton_labels else None
    auto = us.get("triton")
    out: dict[str, Any] = {"best_triton": best_triton,
                           "triton_over_bf16": us["bf16"] / auto if auto and "bf16" in us else None,
                           "best_triton_over_bf16": us["bf16"] / us[best_triton] if best_triton and "bf16" in us
                           else None}
    for other in ("scaled_mm", "flashinfer"):
        out[f"triton_vs_{other}"] = us[other] / auto if auto and other in us else None
    providers = {lab: v for lab, v in us.items() if lab == "triton" or lab.startswith("provider:")}
    fastest = min(providers, key=providers.get) if providers else None
    lib = us.get("auto")
    out["auto_pick"] = (notes.get("providers") or {}).get("auto")
    out["fastest_provider"] = fastest
    out["auto_of_fastest"] = providers[fastest] / lib if lib and fastest else None
    out["auto_over_bf16"] = us["bf16"] / lib if lib and "bf16" in us else None
    return out


# ---------------------------------------------------------------------------------------------- the norm part
def _norm_reference(x: Any, weight: Any, eps: float, residual: Any, per_token: bool) -> tuple[Any, Any]:
    """RMSNorm (+ residual add, in place) + dynamic per-token(-group) quant in plain torch: what ``torch.compile``
    fuses for a user without the library (row-major scales)."""
    import torch

    total = x.float() if residual is None else x.float() + residual.float()
    if residual is not None:
        residual.copy_(total.to(residual.dtype))
    y = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    t, h = y.shape
    if per_token:
        scale = (y.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
        return (y / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    kg = -(-h // GROUP)
    padded = torch.nn.functional.pad(y, (0, kg * GROUP - h)).view(t, kg, GROUP)
    scale = (padded.abs().amax(-1) / 448.0).clamp_min(1e-12)
    q = (y / scale.repeat_interleave(GROUP, 1)[:, :h]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale  # written out as torch ops (not the reference's functions) so torch.compile sees plain code


#: ``--norm-configs`` launch shapes of the dynamic kernel: (path, rows per program or groups per chunk, warps).
#: Launched through Triton's JIT (the graph timer replays them: its host cost is not timed). ``packed`` shapes
#: whose block would exceed :data:`PACKED_MAX_ELEMENTS` are skipped.
NORM_SHAPES = (("block", 1, 4), ("block", 1, 8), ("block", 2, 8), ("packed", 1, 4), ("packed", 1, 8),
               ("packed", 2, 8), ("packed", 3, 8), ("packed", 3, 16), ("packed", 6, 16), ("parts", 1, 2),
               ("parts", 1, 4), ("parts", 1, 8))
PACKED_MAX_ELEMENTS = 16384


def _config_runs(nd: Any, xs: list, rs: list, w: Any, eps: float, tokens: int, hidden: int, residual: bool,
                 sets: int, code_check: Callable[[bool], Any]) -> dict[str, Any]:
    """``--norm-configs``: the dynamic kernel at every launch shape of :data:`NORM_SHAPES`, group and token modes
    (labels ``group_block_r1w8``, ``group_packed_r3w8``, ``group_parts_w4``, ``group_loop_c8w4``), and ``static``:
    the static-scale RMSNorm + quant kernel over the same rows (the same bytes, one fixed scale: what computing the
    dynamic scales costs)."""
    import torch

    from fp8_backends.providers.triton import norm_kernels
    from fp8_backends.providers.triton.group_quant_kernels import group_scale_empty
    from fp8_backends.tuning.timing import Run

    runs: dict[str, Any] = {}
    dev = xs[0].device
    qs = [torch.empty(tokens, hidden, device=dev, dtype=torch.float8_e4m3fn) for _ in range(sets)]
    for mode, per_token in (("group", False), ("token", True)):
        scales = [torch.empty(tokens, 1, device=dev) if per_token else
                  group_scale_empty(tokens, -(-hidden // GROUP), "row_major", xs[0]) for _ in range(sets)]
        base = nd.dyn_config(tokens, hidden, residual, GROUP, per_token)
        for path, n, warps in NORM_SHAPES:
            if path == "loop":
                cfg = nd.DynConfig("loop", 1, n, GROUP, warps)
                label = f"{mode}_loop_c{n}w{warps}"
            elif path == "packed":
                groups = -(-hidden // GROUP)
                if (1 << (n * groups - 1).bit_length()) * GROUP > PACKED_MAX_ELEMENTS:
                    continue
                cfg = nd.DynConfig("packed", n, groups, GROUP, warps)
                label = f"{mode}_packed_r{n}w{warps}"
            elif path == "parts":
                if base.path == "loop":
                    continue
                cfg = nd.DynConfig("parts", 1, -(-hidden // GROUP), GROUP, warps)
                label = f"{mode}_parts_w{warps}"
            elif base.path == "loop":
                continue
            else:
                cfg = base._replace(rows=n, num_warps=warps)
                label = f"{mode}_block_r{n}w{warps}"

            def call(i: int, per_token: bool = per_token, cfg: Any = cfg, scales: list = scales) -> Any:
                kernel, grid, args = nd.kernel_args(cfg, xs[i], rs[i], w, qs[i], scales[i], eps, per_token, False)
                kernel[grid](*args, num_warps=cfg.num_warps)
                return qs[i]

            runs[label] = Run(call, sets, None if residual else code_check(per_token))
    outs = [torch.empty(tokens, hidden, device=dev, dtype=torch.float8_e4m3fn) for _ in range(sets)]
    scale = torch.full((1,), 0.05, device=dev)

    def static(i: int) -> Any:
        if rs[i] is None:
            norm_kernels.rmsnorm_quant(outs[i], xs[i], w, scale, eps)
        else:
            norm_kernels.fused_add_rmsnorm_quant(outs[i], xs[i], rs[i], w, scale, eps)
        return outs[i]

    runs["static"] = Run(static, sets, None)
    return runs


def norm_point(hidden: int, tokens: int, residual: bool, device: str, timer: Any, args: argparse.Namespace,
               copy_gbps: float | None, l2_bytes: int) -> dict[str, Any]:
    import torch

    from bench.compiled_baseline import _raise_recompile_limits
    from fp8_backends.providers.triton import norm_dynamic_ops as nd
    from fp8_backends.tuning.timing import Run, rotation_count

    g = torch.Generator(device=device).manual_seed(tokens * 7 + hidden)
    per_elem = 2 + 1 + (4 if residual else 0)
    sets = rotation_count(tokens * hidden * (2 + (2 if residual else 0)), l2_bytes) if device.startswith("cuda") else 1
    # copies of one input at distinct addresses (rotated past L2): every set's output is then checked against the
    # one reference (different contents per set made every set but the first read as wrong under graph replay)
    x0 = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    r0 = torch.randn(tokens, hidden, device=device, generator=g).to(torch.bfloat16)
    xs = [x0.clone() for _ in range(sets)]
    rs = [r0.clone() for _ in range(sets)] if residual else [None] * sets
    w = (1 + 0.1 * torch.randn(hidden, device=device, generator=g)).to(torch.bfloat16)
    eps = 1e-6
    ref_q = {}
    for per_token in (False, True):
        r = None if rs[0] is None else rs[0].clone()
        ref_q[per_token] = _norm_reference(xs[0], w, eps, r, per_token)[0]

    def code_check(per_token: bool) -> Callable[[Any], tuple[float, str | None]]:
        want = ref_q[per_token].view(torch.uint8)

        def check(q: Any) -> tuple[float, str | None]:
            off = float((q.view(torch.uint8) != want).float().mean().item())
            return off, (None if off < 1e-3 else f"{off:.2%} of the codes differ from the reference")

        return check

    runs: dict[str, Run] = {}
    variants = [("triton_group", False, "row_major"), ("triton_group_tma", False, "m_major_tma"),
                ("triton_token", True, "row_major")]
    for label, per_token, layout in variants:
        def call(i: int, per_token: bool = per_token, layout: str = layout) -> Any:
            return nd.rmsnorm_quant_dynamic(xs[i], w, eps, rs[i], act_scale="per_token" if per_token else
                                            "per_token_group", scale_layout=layout)[0]

        runs[label] = Run(call, sets, None if residual else code_check(per_token))
    if getattr(args, "norm_configs", False):
        runs.update(_config_runs(nd, xs, rs, w, eps, tokens, hidden, residual, sets, code_check))
    if not args.no_compile_baseline:
        _raise_recompile_limits(torch)
        for label, per_token in (("compiled_group", False), ("compiled_token", True)):
            compiled = torch.compile(_norm_reference, dynamic=False)

            def ccall(i: int, compiled: Any = compiled, per_token: bool = per_token) -> Any:
                return compiled(xs[i], w, eps, rs[i], per_token)[0]

            runs[label] = Run(ccall, sets, None if residual else code_check(per_token))
    measured = timer(runs)
    bytes_moved = tokens * hidden * per_elem + 4 * tokens * math.ceil(hidden / GROUP) + 2 * hidden
    rows: dict[str, dict[str, Any]] = {}
    for label, meas in measured.items():
        row = meas.to_json()
        if meas.ok:
            row["us"] = meas.median_us
            row["gbps"] = bytes_moved / (meas.median_us * 1e-6) / 1e9
            if copy_gbps:
                row["pct_copy"] = 100.0 * row["gbps"] / copy_gbps
        rows[label] = row
    point = {"hidden": hidden, "tokens": tokens, "residual": residual, "bytes": bytes_moved, "variants": rows}
    for mode in ("group", "token"):
        t, c = rows.get(f"triton_{mode}", {}).get("us"), rows.get(f"compiled_{mode}", {}).get("us")
        point[f"{mode}_compiled_over_triton"] = c / t if t and c else None
    return point


# ---------------------------------------------------------------------------------------------- report
def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def targets(gemm: list[dict[str, Any]], norm: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The issue's targets, measured on ``auto`` (what a layer runs), with every point that misses one."""
    out: dict[str, list[str]] = {"auto_below_93pct_of_fastest": [], "auto_slower_than_bf16": [],
                                 "auto_below_75pct_floor": [], "auto_below_1.6x_bf16": [],
                                 "norm_below_85pct_copy": [], "norm_slower_than_compiled": []}
    for p in gemm:
        where = f"{p['model']} {p['layer']} {p['n']}x{p['k']} M={p['m']}"
        of_fastest = p.get("auto_of_fastest")
        if of_fastest is not None and of_fastest < AUTO_POINT_TARGET:
            out["auto_below_93pct_of_fastest"].append(f"{where}: {of_fastest:.3f} ({p['fastest_provider']})")
        ratio = p.get("auto_over_bf16")
        if ratio is not None and ratio < 1.0:
            out["auto_slower_than_bf16"].append(f"{where}: {ratio:.3f}x{_bound_note(p, 'gemm')}")
        pct = p["variants"].get("auto", {}).get("pct_floor")
        if pct is not None and pct < 100 * FLOOR_TARGET:
            out["auto_below_75pct_floor"].append(f"{where}: {pct:.1f}%{_bound_note(p, 'floor')}")
        if p["m"] >= 1024 and ratio is not None and ratio < PREFILL_TARGET:
            out["auto_below_1.6x_bf16"].append(f"{where}: {ratio:.3f}x{_bound_note(p, 'gemm')}")
    for p in norm:
        where = f"H={p['hidden']} T={p['tokens']}{' +res' if p['residual'] else ''}"
        for mode in ("group", "token"):
            row = p["variants"].get(f"triton_{mode}", {})
            if p["tokens"] >= 4096 and row.get("pct_copy") is not None and row["pct_copy"] < 100 * NORM_TARGET:
                out["norm_below_85pct_copy"].append(f"{where} {mode}: {row['pct_copy']:.1f}%")
            ratio = p.get(f"{mode}_compiled_over_triton")
            if ratio is not None and ratio < 1.0:
                out["norm_slower_than_compiled"].append(f"{where} {mode}: {ratio:.3f}x")
    return out


def _bound_note(point: dict[str, Any], kind: str) -> str:
    """What the point's bounds (``--bounds``) reach, for a miss of a ``"floor"`` or a ``"gemm"`` (x bf16) target;
    empty where they were not timed."""
    v = point["variants"]
    parts = []
    if kind == "floor":
        read, launch = best_read(point), _us(point, "bound:launch")
        if read is not None:
            parts.append(f"one read of the weight {read:.1f}%")
        if launch is not None:
            parts.append(f"an empty launch {launch:.2f} µs")
    else:
        tensor, bf16 = _us(point, "bound:fp8_tensor"), v.get("bf16", {}).get("us")
        precise = _us(point, "bound:fp8_tensor_precise")
        if tensor and bf16:
            parts.append(f"per-tensor fp8 {bf16 / tensor:.3f}x")
        if precise and bf16:
            parts.append(f"without fast accumulation {bf16 / precise:.3f}x")
    return f" ({'; '.join(parts)})" if parts else ""


def _pct_floor(point: dict[str, Any], label: str) -> float | None:
    return point["variants"].get(label, {}).get("pct_floor")


def best_read(point: dict[str, Any]) -> float | None:
    """The larger ``% floor`` of the point's weight-read bounds (``bound:weight_read*``: 16 / 64 KiB a program);
    ``None`` where none was timed."""
    reads = [v["pct_floor"] for label, v in point["variants"].items()
             if label.startswith("bound:weight_read") and v.get("pct_floor") is not None]
    return max(reads) if reads else None


def bound_summary(gemm: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per GEMM target of ``auto``, how many points miss it and at how many of those the point's bound misses it too:
    one read of the weight below 75% of the floor (M <= 16), the per-tensor FP8 GEMM slower than bf16 or below 1.6x
    bf16 (M >= 1024). Points without the bound timed count as misses without a bound."""
    out = {name: {"misses": 0, "bound_timed": 0, "bound_misses_too": 0}
           for name in ("auto_below_75pct_floor", "auto_slower_than_bf16", "auto_below_1.6x_bf16")}
    for p in gemm:
        ratio, pct = p.get("auto_over_bf16"), _pct_floor(p, "auto")
        tensor, bf16, read = _us(p, "bound:fp8_tensor"), _us(p, "bf16"), best_read(p)
        tensor_ratio = bf16 / tensor if tensor and bf16 else None
        checks = (("auto_below_75pct_floor", pct is not None and pct < 100 * FLOOR_TARGET, read,
                   lambda b: b < 100 * FLOOR_TARGET),
                  ("auto_slower_than_bf16", ratio is not None and ratio < 1.0, tensor_ratio, lambda b: b < 1.0),
                  ("auto_below_1.6x_bf16", p["m"] >= 1024 and ratio is not None and ratio < PREFILL_TARGET,
                   tensor_ratio, lambda b: b < PREFILL_TARGET))
        for name, missed, bound, misses_too in checks:
            if not missed:
                continue
            row = out[name]
            row["misses"] += 1
            if bound is not None:
                row["bound_timed"] += 1
                row["bound_misses_too"] += int(misses_too(bound))
    return out


def auto_geomeans(gemm: list[dict[str, Any]]) -> dict[str, Any]:
    """``auto``'s share of the fastest provider's speed, geomean over every point and per M."""
    from bench import common

    per_m: dict[int, list[float]] = {}
    for p in gemm:
        if p.get("auto_of_fastest"):
            per_m.setdefault(p["m"], []).append(p["auto_of_fastest"])
    every = [v for values in per_m.values() for v in values]
    return {"all": common.geomean(every), "points": len(every),
            "per_m": {m: common.geomean(values) for m, values in sorted(per_m.items())}}


def markdown(result: dict[str, Any]) -> str:
    from bench import common

    lines = common.header_markdown(result["meta"], "Block-scaled FP8 GEMM (128x128 weight blocks, 1x128 groups)")
    if result.get("rerendered_from"):
        lines += [f"- re-rendered from `{result['rerendered_from']}` by `block_gemm.py --rerender` (no new "
                  "measurement: the derived columns of this version added)"]
    lines += [f"- copy bandwidth: {fmt(result['copy_gbps'], '.0f')} GB/s (read + write, measured in this run)",
              f"- flashinfer: {result['flashinfer']}", f"- method: {result['method']}", "", "## Targets", ""]
    geo = result.get("auto_geomean") or {}
    if geo.get("all") is not None:
        per_m = ", ".join(f"M={m} {v:.3f}" for m, v in geo["per_m"].items())
        lines.append(f"- auto at {geo['all']:.3f} of the fastest provider (geomean of {geo['points']} points; target "
                     f">= {AUTO_GEOMEAN_TARGET}): {per_m}")
    for name, misses in result["targets"].items():
        lines.append(f"- {name}: {'none' if not misses else len(misses)}")
        lines += [f"  - {miss}" for miss in misses]
    bounded = {name: row for name, row in (result.get("bounds") or {}).items() if row["bound_timed"]}
    if bounded:
        lines += ["", "Misses against the points' bounds (`--bounds`: one read of the weight for the floor, the "
                  "per-tensor FP8 GEMM with fast accumulation against bf16):", ""]
        lines += [f"- {name}: the bound misses too at {row['bound_misses_too']} of the {row['bound_timed']} misses "
                  f"where it was timed ({row['misses']} misses)" for name, row in bounded.items()]
    if result["gemm"]:
        lines += ["", "## GEMM: auto (what a layer runs) against the fastest provider and bf16 torch.mm", ""]
        lines += common.md_table(
            ["shape", "M", "bf16 µs", "bf16 % ceiling", "auto µs", "auto picked", "TFLOP/s", "% floor", "% ceiling",
             "x bf16", "fastest provider", "its µs", "auto / fastest"],
            [[f"{p['model']} {p['layer']} {p['n']}x{p['k']}", p["m"], fmt(_us(p, "bf16")),
              fmt(p["variants"].get("bf16", {}).get("pct_ceiling"), ".0f"), fmt(_us(p, "auto")),
              p.get("auto_pick") or "-", fmt(p["variants"].get("auto", {}).get("tflops"), ".0f"),
              fmt(p["variants"].get("auto", {}).get("pct_floor"), ".1f"),
              fmt(p["variants"].get("auto", {}).get("pct_ceiling"), ".0f"), fmt(p.get("auto_over_bf16"), ".3f"),
              p.get("fastest_provider") or "-", fmt(_us(p, p.get("fastest_provider"))),
              fmt(p.get("auto_of_fastest"), ".3f")]
             for p in result["gemm"]])
        lines += ["", "## GEMM: Triton (auto) against bf16 torch.mm and the providers", ""]
        lines += common.md_table(
            ["shape", "M", "bf16 µs", "triton µs", "config", "TFLOP/s", "% floor", "x bf16", "best family",
             "best µs", "scaled_mm µs", "x scaled_mm", "flashinfer µs", "x flashinfer"],
            [[f"{p['model']} {p['layer']} {p['n']}x{p['k']}", p["m"], fmt(_us(p, "bf16")), fmt(_us(p, "triton")),
              p["variants"].get("triton", {}).get("config") or "-",
              fmt(p["variants"].get("triton", {}).get("tflops"), ".0f"),
              fmt(p["variants"].get("triton", {}).get("pct_floor"), ".1f"), fmt(p["triton_over_bf16"], ".3f"),
              p["best_triton"] or "-", fmt(_us(p, p["best_triton"])), fmt(_us(p, "scaled_mm")),
              fmt(p["triton_vs_scaled_mm"], ".3f"), fmt(_us(p, "flashinfer")), fmt(p["triton_vs_flashinfer"], ".3f")]
             for p in result["gemm"]])
        lines += ["", "## GEMM: every variant", ""]
        rows = []
        for p in result["gemm"]:
            base = _us(p, "bf16")
            for label, v in p["variants"].items():
                rows.append([f"{p['model']} {p['layer']}", p["m"], label, v.get("config") or "-", fmt(v.get("us")),
                             fmt(v.get("tflops"), ".0f"), fmt(v.get("pct_floor"), ".1f"),
                             fmt(base / v["us"] if base and v.get("us") else None, ".3f"),
                             v.get("method") or "", (v.get("error") or "")[:120]])
        lines += common.md_table(["shape", "M", "variant", "config", "µs", "TFLOP/s", "% floor", "x bf16", "timed",
                                  "error"], rows)
        refusals = sorted({f"{name} ({lay}): {why}" for p in result["gemm"] for name, note in p["notes"].items()
                           for lay, why in note["refused"].items()})
        if refusals:
            lines += ["", "## Refusals (scale layouts a provider did not take)", ""] + [f"- {r}" for r in refusals]
    if result["norm"]:
        lines += ["", "## Fused RMSNorm + dynamic quant (bf16 in, e4m3 out) against torch.compile of the reference",
                  ""]
        rows = []
        for p in result["norm"]:
            for label, v in p["variants"].items():
                rows.append([p["hidden"], p["tokens"], "yes" if p["residual"] else "no", label, fmt(v.get("us")),
                             fmt(v.get("gbps"), ".0f"), fmt(v.get("pct_copy"), ".1f"), (v.get("error") or "")[:100]])
        lines += common.md_table(["H", "T", "residual", "variant", "µs", "GB/s", "% copy", "error"], rows)
    return "\n".join(lines) + "\n"


def _us(point: dict[str, Any], label: str | None) -> float | None:
    return None if label is None else point["variants"].get(label, {}).get("us")


def sweep_table(gemm: list[dict[str, Any]]) -> Any:
    """The fastest shipped config per measured (N, K) and M as a :class:`BlockTable` (bucket bounds at the geometric
    midpoints of the measured M values)."""
    from fp8_backends.providers.triton import block_gemm_configs as bc

    per_shape: dict[tuple[int, int], dict[int, str]] = {}
    for p in gemm:
        timed = {v["config"]: v["us"] for lab, v in p["variants"].items() if lab.startswith("triton:") and "us" in v}
        if timed:
            per_shape.setdefault((p["n"], p["k"]), {})[p["m"]] = min(timed, key=timed.get)
    shapes = {}
    for shape, picks in per_shape.items():
        ms = sorted(picks)
        buckets: list[tuple[int | None, str]] = []
        for a, b in zip(ms, ms[1:]):
            bound = int(math.sqrt(a * b))
            if buckets and buckets[-1][1] == picks[a]:
                buckets[-1] = (bound, picks[a])
            else:
                buckets.append((bound, picks[a]))
        if buckets and buckets[-1][1] == picks[ms[-1]]:
            buckets[-1] = (None, picks[ms[-1]])
        else:
            buckets.append((None, picks[ms[-1]]))
        shapes[shape] = tuple(buckets)
    return bc.BlockTable(default=bc.DEFAULT_TABLE.default, shapes={**bc.DEFAULT_TABLE.shapes, **shapes},
                         source="bench/block_gemm.py --sweep")


# ---------------------------------------------------------------------------------------------- main
def _release(device: str) -> None:
    """Give the previous point's buffers back (weights of up to 1 GB per copy)."""
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def rerender(source: Path, out: Path) -> int:
    """``--rerender``: read a ``block_gemm.json`` (or ``.json.gz``) written by an earlier run, add what this version
    derives from its numbers (the roofline ceilings) and write ``block_gemm.json`` / ``block_gemm.md`` under ``out``;
    nothing is measured."""
    import gzip
    import json

    from bench import common

    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt", encoding="utf-8") as f:
        result = json.load(f)
    for point in result["gemm"]:
        add_ceilings(point, result.get("copy_gbps"), result["meta"].get("gpu"))
    result["rerendered_from"] = str(source)
    common.write_json(out / "block_gemm.json", result)
    (out / "block_gemm.md").write_text(markdown(result), encoding="utf-8")
    print(f"results: {out}/block_gemm.json, block_gemm.md (from {source})")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.rerender:
        if not args.out:
            ap.error("--rerender needs --out")
        return rerender(Path(args.rerender), Path(args.out))
    try:
        extra_configs(args.configs, 1, 16)
        for text in args.shapes or ():
            _shape(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        ap.error(f"--configs / --shapes: {exc}")
    if args.device == "cpu" and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
    import torch

    from bench import common
    from fp8_backends.registry.platform import detect_platform
    from fp8_backends.tuning.timing import CpuTimer, CudaGraphTimer, TimerConfig, l2_cache_bytes

    platform = detect_platform(args.device)
    device = "cpu" if platform.kind.value == "cpu" else platform.torch_device
    if device == "cpu" and not args.smoke:
        print("no CUDA device: pass --smoke (tiny shapes on Triton's interpreter)", file=sys.stderr)
        return 2
    config = TimerConfig.quick() if args.quick or args.smoke else TimerConfig()
    if args.smoke:
        config.rounds, config.replays = 1, 1
    if args.rounds:
        config.rounds = args.rounds
    if args.replays:
        config.replays = args.replays
    timer = CudaGraphTimer(config, device) if device.startswith("cuda") else CpuTimer(config)
    out = Path(args.out) if args.out else common.default_out_dir(platform) / "block_gemm"
    header = common.run_header(platform, device)
    ms = _ints(args.m, SMOKE_M if args.smoke else (QUICK_M if args.quick else M_VALUES))
    tokens = _ints(args.tokens, (3,) if args.smoke else (QUICK_TOKENS if args.quick else TOKENS))
    shapes = [] if args.no_gemm else gemm_shapes(args)
    l2 = l2_cache_bytes(device) if device.startswith("cuda") else 0
    copy_gbps = common.copy_ceiling(device)
    fi_on = args.flashinfer == "on" or (args.flashinfer == "auto" and not (args.quick or args.smoke))
    flashinfer = Flashinfer(fi_on, device)
    print(f"bench.block_gemm on {platform.describe()}: {len(shapes)} shapes x {len(ms)} M -> {out}", file=sys.stderr)

    method = (f"CUDA graph per variant over weight copies rotated past L2 (> 4x), activation shared, "
              f"{config.rounds} interleaved rounds x {config.replays} replays, median per call; every variant's graph "
              "output checked against the fp32 reference first" if device.startswith("cuda")
              else "CPU wall clock on Triton's interpreter (smoke run: numbers mean nothing)")
    gemm: list[dict[str, Any]] = []
    norm: list[dict[str, Any]] = []

    def write() -> dict[str, Any]:
        """The results so far (after every point: a run cut short keeps what it measured)."""
        result = {"schema": "fp8_backends.bench.block_gemm/1", "meta": header, "copy_gbps": copy_gbps,
                  "method": method, "m_values": list(ms), "flashinfer": flashinfer.status,
                  "torch_cuda": getattr(torch.version, "cuda", None), "gemm": gemm, "norm": norm,
                  "targets": targets(gemm, norm), "bounds": bound_summary(gemm), "auto_geomean": auto_geomeans(gemm)}
        common.write_json(out / "block_gemm.json", result)
        (out / "block_gemm.md").write_text(markdown(result), encoding="utf-8")
        return result

    for model, layer, n, k in shapes:
        for m in ms:
            t0 = time.perf_counter()
            point = gemm_point(model, layer, n, k, m, device, timer, args, copy_gbps, flashinfer, l2)
            gemm.append(add_ceilings(point, copy_gbps, header.get("gpu")))
            write()
            _release(device)
            print(f"{model} {layer} {n}x{k} M={m}: " + ", ".join(
                f"{lab} {v['us']:.2f}" for lab, v in point["variants"].items() if "us" in v)
                + f" ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    if not args.no_norm:
        hiddens = (200,) if args.smoke else ((7168,) if args.quick else tuple(dict.fromkeys(HIDDEN.values())))
        for hidden in hiddens:
            for t in tokens:
                for residual in (False, True):
                    point = norm_point(hidden, t, residual, device, timer, args, copy_gbps, l2)
                    norm.append(point)
                    write()
                    _release(device)
                    print(f"norm H={hidden} T={t} residual={residual}: " + ", ".join(
                        f"{lab} {v['us']:.2f}" for lab, v in point["variants"].items() if "us" in v),
                        file=sys.stderr, flush=True)
    result = write()
    if args.sweep and gemm:
        common.write_json(out / "block_table.json", sweep_table(gemm).to_json())
    for name, misses in result["targets"].items():
        print(f"target {name}: {len(misses)} miss(es)" + "".join(f"\n  {m}" for m in misses[:20]))
    print(f"results: {out}/block_gemm.json, block_gemm.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
