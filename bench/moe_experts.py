"""Benchmark: one MoE layer's routed experts, block-scaled FP8 served by the library against ``transformers``' bf16
experts (its default ``grouped_mm`` implementation and its ``eager`` loop), at decode and small-prefill token counts.

Variants (one layer of ``--model``'s sizes, random weights, random top-k routing, the same inputs for all):

- ``bf16/grouped_mm``: ``transformers``' experts module as a bf16 model runs it by default (``torch._grouped_mm``).
- ``bf16/eager``: the same module with ``experts_implementation="eager"`` (a loop over the experts hit).
- ``fp8/gemv``: :class:`~fp8_backends.layers.experts.PerExpertLinears` on the stacked FP8 experts, the Triton
  experts GEMV (two launches around the gating) whatever the token count (timed up to 64 tokens).
- ``fp8/tiles``: the same module's tiled experts GEMM (pairs sorted by expert, tensor-core tiles; the sort and the
  tile plan in one launch of the library's routing kernel).
- ``fp8/tiles_torch_plan``: the same tiles with the sort and the tile plan made by torch ops instead
  (:class:`TorchPlanKernels`: ``argsort``, a scatter-add count, cumulative sums and a ``searchsorted``), what the
  library ran before its routing kernel; the baseline of that kernel.
- ``fp8/tiles_m<rows>`` (``--block-ms``): the tiled GEMM with its tile height fixed (:class:`TiledVariantKernels`),
  what the library's choice of tile height per pairs an expert gets is read from.
- ``fp8/tiles_n_first`` / ``fp8/tiles_tiles_first`` (``--grid-orders``): the tiled GEMM launched eagerly in either
  grid order (:class:`TiledVariantKernels`), what the library's grid order is read from.
- ``fp8/loop``: the same module's per-expert loop (one FP8 GEMM per expert hit and projection, one host sync).
- The library's default takes ``fp8/gemv`` up to 64 (token, slot) pairs, ``fp8/tiles`` above.
- ``.../graph``: the step captured in a CUDA graph and replayed (the variants that can be captured).
- ``.../compiled`` (``--compiled``): the module call under ``torch.compile`` (no CUDA graphs; host time per launch
  counts), for ``bf16/grouped_mm`` and the two tiled variants.

Timing: ``--rounds`` interleaved rounds, the order rotated each round, CUDA events around ``--iters`` calls (median);
ratios are the median over rounds of the per-round ratio. Writes ``moe_experts.json`` / ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from bench import common
from bench.hf_bench import capture, cuda_time_us

#: (experts, hidden, moe intermediate, experts per token) of the layers timed
MODELS = {"qwen3-30b-a3b": (128, 2048, 768, 8), "deepseek-v3": (256, 7168, 2048, 8),
          "tiny": (4, 256, 128, 2)}  # tiny: a CPU smoke test (Triton's interpreter)


def build(model: str, device: str, weight_scale: str = "block") -> dict[str, Any]:
    """``{"bf16": transformers experts module, "fp8": PerExpertLinears}`` on the same weights, quantized by
    ``quantize_model(weight_scale=...)`` (``block``, ``per_channel`` or ``per_tensor``)."""
    import transformers

    from fp8_backends import quantize_model
    from fp8_backends.layers import process_weights_after_loading
    from fp8_backends.layers.experts import PerExpertLinears

    e, h, i, k = MODELS[model]
    config = transformers.Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e,
                                         num_experts_per_tok=k, hidden_act="silu")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    with torch.device(device):
        bf16 = Qwen3MoeExperts(config).to(torch.bfloat16)
        torch.nn.init.normal_(bf16.gate_up_proj, std=h ** -0.5)
        torch.nn.init.normal_(bf16.down_proj, std=i ** -0.5)
    with torch.device("meta"):  # only its gating and shape: PerExpertLinears allocates its own linears
        donor = Qwen3MoeExperts(config).to(torch.bfloat16)
    gate_up, down = bf16.gate_up_proj.detach(), bf16.down_proj.detach()
    fp8 = PerExpertLinears.from_fused(donor).to_empty(device=device)
    with torch.no_grad():
        for x in range(e):
            ex = fp8.expert(x)
            ex.gate_proj.weight.copy_(gate_up[x, :i])
            ex.up_proj.weight.copy_(gate_up[x, i:])
            ex.down_proj.weight.copy_(down[x])
    holder = torch.nn.Module()
    holder.experts = fp8
    summary = quantize_model(holder, weight_scale=weight_scale)
    process_weights_after_loading(holder)
    served = (f"{summary.count} linears swapped, {len(summary.fused)} gate/up groups fused, "
              f"{fp8.expert(0).down_proj.backends_text}; grouped: {fp8.grouped_reason or 'stacked'}")
    return {"bf16": bf16, "fp8": fp8, "config": config, "summary": served}


class TorchPlanKernels:
    """The library's grouped-experts kernels with the tiled GEMM's routing (the pairs sorted by expert and the tile
    plan, the contract of :func:`fp8_backends.providers.triton.experts_ops.tile_plan`) made by torch ops: the
    baseline of its routing kernel."""

    row_scales = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def plan(self, ids: torch.Tensor, experts: int, gemv_pairs: int) -> Any:
        from fp8_backends.providers.triton.experts_args import block_m_for, route_sizes

        p = ids.shape[0]
        if p <= gemv_pairs:
            return None
        bm = block_m_for(p, experts)
        n_tiles = route_sizes(p, experts, bm)[0]
        clean = torch.where((ids >= 0) & (ids < experts), ids, experts).to(torch.int64)
        order = torch.argsort(clean).to(torch.int32)
        counts = torch.zeros(experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(
            0, clean, torch.ones_like(clean))
        tiles = (counts + bm - 1) // bm
        tiles_end = torch.cumsum(tiles, 0)
        seg_start = torch.cumsum(counts, 0) - counts
        b = torch.arange(n_tiles, device=ids.device, dtype=torch.int64)
        tile_expert = torch.searchsorted(tiles_end, b, right=True)  # E + 1 past the used tiles
        e = tile_expert.clamp(max=experts)
        tile_row0 = seg_start[e] + (b - (tiles_end[e] - tiles[e])) * bm
        tile_end = seg_start[e] + counts[e]
        return bm, order, tile_expert.to(torch.int32), tile_row0.to(torch.int32), tile_end.to(torch.int32)

    def matmul(self, *args: Any) -> torch.Tensor:
        return self.inner.matmul(*args)


class TiledVariantKernels:
    """The library's grouped-experts kernels with the tiled GEMM's tile height (``block_m`` rows, whatever the pairs
    per expert) or grid order (``n_first``: a tile's row blocks launched together, else a row block's tiles; eager
    launches) fixed: the variants the library's choices are read from. ``None`` keeps the library's."""

    row_scales = True

    def __init__(self, inner: Any, block_m: int | None = None, n_first: bool | None = None) -> None:
        self.inner, self.block_m, self.n_first = inner, block_m, n_first

    def plan(self, ids: torch.Tensor, experts: int, gemv_pairs: int) -> Any:
        from fp8_backends.providers.triton.experts_ops import tile_plan

        if self.block_m is None or ids.shape[0] <= gemv_pairs:
            return self.inner.plan(ids, experts, gemv_pairs)
        return (self.block_m, *tile_plan(ids, experts, self.block_m))

    def matmul(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor, rw: Any,
               token_div: int, out_dtype: torch.dtype, plan: Any) -> torch.Tensor:
        from fp8_backends.providers.triton import experts_ops
        from fp8_backends.providers.triton.experts_args import GROUP_SIZE
        from fp8_backends.providers.triton.group_quant_ops import triton_quant_per_token_group

        if plan is None or self.n_first is None:
            return self.inner.matmul(x, w, w_scale, ids, rw, token_div, out_dtype, plan)
        bm, *tiles = plan
        x_q, x_s = triton_quant_per_token_group(x, GROUP_SIZE, w.dtype, "row_major")
        return experts_ops.gemm_launch(x_q, x_s, w, w_scale, *tiles, rw, token_div, bm, out_dtype, self.n_first)


def routing(tokens: int, config: Any, device: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(tokens)
    hidden = torch.randn(tokens, config.hidden_size, generator=g).to(device, torch.bfloat16)
    logits = torch.randn(tokens, config.num_experts, generator=g)
    weights, index = torch.topk(torch.softmax(logits, -1), config.num_experts_per_tok, dim=-1)
    return hidden, index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device, torch.bfloat16)


def steps_for(mods: dict[str, Any], tokens: int, device: str, graphs: bool,
              compiled: dict[str, Any] | None = None, block_ms: tuple[int, ...] = (),
              grid_orders: bool = False) -> dict[str, Any]:
    """``{"steps": {variant: step}, "errors": {variant: relative error against bf16/grouped_mm}}``; ``compiled``
    (``{"bf16": ..., "fp8": ...}``, the modules under ``torch.compile``) adds the ``/compiled`` variants, each of
    ``block_ms`` a ``fp8/tiles_m<rows>`` variant in every mode, ``grid_orders`` the ``fp8/tiles_n_first`` /
    ``fp8/tiles_tiles_first`` variants (:class:`TiledVariantKernels`)."""
    from fp8_backends.layers import experts as experts_mod

    bf16, fp8, config = mods["bf16"], mods["fp8"], mods["config"]
    hidden, index, weights = routing(tokens, config, device)
    own = experts_mod.experts_kernels(hidden.device.type)[0]
    torch_plan = TorchPlanKernels(own) if own is not None else None

    def bf16_impl(name: str, module: Any = bf16) -> Any:
        def step() -> Any:
            config._experts_implementation = name
            return module(hidden, index, weights)
        return step

    def fp8_impl(max_pairs: int, grouped: bool | None = None, kernels: Any = None, module: Any = fp8) -> Any:
        def step() -> Any:
            fp8.grouped_max_pairs, fp8.grouped = max_pairs, grouped
            experts_mod._kernels[hidden.device.type] = (kernels or own, "")
            try:
                return module(hidden, index, weights)
            finally:
                experts_mod._kernels[hidden.device.type] = (own, "")
        return step

    steps = {"bf16/grouped_mm": bf16_impl("grouped_mm"), "bf16/eager": bf16_impl("eager")}
    if tokens <= 64:
        steps["fp8/gemv"] = fp8_impl(1 << 30)
    steps |= {"fp8/tiles": fp8_impl(0), "fp8/loop": fp8_impl(0, False)}
    if torch_plan is not None:
        steps["fp8/tiles_torch_plan"] = fp8_impl(0, kernels=torch_plan)
    fixed = {f"fp8/tiles_m{bm}": TiledVariantKernels(own, block_m=bm) for bm in block_ms if own is not None}
    if grid_orders and own is not None:
        fixed |= {"fp8/tiles_n_first": TiledVariantKernels(own, n_first=True),
                  "fp8/tiles_tiles_first": TiledVariantKernels(own, n_first=False)}
    for name, kernels in fixed.items():
        steps[name] = fp8_impl(0, kernels=kernels)
    if compiled:
        steps["bf16/grouped_mm/compiled"] = bf16_impl("grouped_mm", compiled["bf16"])
        steps["fp8/tiles/compiled"] = fp8_impl(0, module=compiled["fp8"])
        if torch_plan is not None:
            steps["fp8/tiles_torch_plan/compiled"] = fp8_impl(0, kernels=torch_plan, module=compiled["fp8"])
        for name, kernels in fixed.items():
            steps[f"{name}/compiled"] = fp8_impl(0, kernels=kernels, module=compiled["fp8"])
    outs = {}
    with torch.no_grad():
        for name, fn in steps.items():
            outs[name] = fn().float()
        if graphs:
            for name in ("bf16/grouped_mm", "fp8/gemv", "fp8/tiles", "fp8/tiles_torch_plan", *fixed):
                if name not in steps:
                    continue
                try:
                    steps[f"{name}/graph"] = capture(steps[name])
                except Exception as exc:  # reported, not timed
                    print(f"{name}: no CUDA graph ({type(exc).__name__}: {exc})", file=sys.stderr)
    ref = outs["bf16/grouped_mm"]
    errors = {name: float((o - ref).norm() / ref.norm()) for name, o in outs.items()}
    return {"steps": steps, "errors": errors}


def run(args: Any) -> dict[str, Any]:
    from fp8_backends.registry.platform import detect_platform

    platform = detect_platform()
    result: dict[str, Any] = {"header": common.run_header(platform, args.device), "model": args.model, "rows": []}
    mods = build(args.model, args.device, args.weight_scale)
    result["fp8_layer"] = mods["summary"]
    result["weight_scale"] = args.weight_scale
    compiled = None
    if args.compiled:  # Dynamo guards on the kernels each call was traced with: one graph per routing variant
        compiled = {name: torch.compile(mods[name], dynamic=False) for name in ("bf16", "fp8")}
    for tokens in args.tokens:
        got = steps_for(mods, tokens, args.device, args.device == "cuda", compiled, tuple(args.block_ms),
                        args.grid_orders)
        steps = got["steps"]
        samples: dict[str, list[float]] = {name: [] for name in steps}
        with torch.no_grad():
            for fn in steps.values():  # warm up (compile, first launches) outside the timing
                for _ in range(3):
                    fn()
            for r in range(args.rounds):
                order = list(steps)
                order = order[r % len(order):] + order[:r % len(order)]
                for name in order:
                    samples[name].append(cuda_time_us(steps[name], args.iters, args.device))
        row = {"tokens": tokens, "us": {n: statistics.median(v) for n, v in samples.items()}, "us_rounds": samples,
               "rel_err_vs_bf16": got["errors"]}
        result["rows"].append(row)
        print(f"T={tokens}: " + ", ".join(f"{n} {u:.1f}" for n, u in row["us"].items()), file=sys.stderr)
    return result


def ratio(row: dict[str, Any], a: str, b: str) -> str:
    ra, rb = row["us_rounds"].get(a), row["us_rounds"].get(b)
    if not ra or not rb:
        return "-"
    values = [x / y for x, y in zip(ra, rb)]
    return f"{statistics.median(values):.3f} ({min(values):.2f}-{max(values):.2f})"


def render(result: dict[str, Any]) -> list[str]:
    e, h, i, k = MODELS[result["model"]]
    lines = common.header_markdown(result["header"], f"MoE experts, one layer of {result['model']} sizes "
                                   f"({e} experts, hidden {h}, intermediate {i}, top-{k})")
    names = list(dict.fromkeys(n for row in result["rows"] for n in row["us"]))
    lines += ["µs per call (median of interleaved rounds); ratios: the median over rounds of the per-round ratio "
              "(range); < 1 is faster. `/graph`: replay of a CUDA-graph capture.", ""]
    pairs = [("fp8/gemv", "bf16/grouped_mm"), ("fp8/tiles", "bf16/grouped_mm"), ("fp8/gemv", "fp8/tiles"),
             ("fp8/tiles", "fp8/tiles_torch_plan"),
             ("fp8/gemv/graph", "bf16/grouped_mm/graph"), ("fp8/tiles/graph", "bf16/grouped_mm/graph"),
             ("fp8/tiles/graph", "fp8/tiles_torch_plan/graph"),
             ("fp8/tiles/compiled", "bf16/grouped_mm/compiled"),
             ("fp8/tiles/compiled", "fp8/tiles_torch_plan/compiled")]
    pairs = [(a, b) for a, b in pairs if a in names and b in names]
    header = ["tokens", *names, *[f"{a} / {b}" for a, b in pairs]]
    rows = [[row["tokens"], *[common.fmt(row["us"].get(n), ".1f") for n in names],
             *[ratio(row, a, b) for a, b in pairs]] for row in result["rows"]]
    lines += common.md_table(header, rows)
    lines += ["", "Relative error of each variant's output against bf16/grouped_mm (same inputs): "
              + "; ".join(f"T={row['tokens']}: " + ", ".join(f"{n} {v:.4f}" for n, v in row["rel_err_vs_bf16"].items()
                                                           if n != "bf16/grouped_mm")
                          for row in result["rows"][:2])]
    lines += ["", f"FP8 layer: {result['fp8_layer']}"]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from fp8_backends.providers.triton.experts_args import BLOCK_MS

    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512, 2048])
    ap.add_argument("--weight-scale", choices=["block", "per_channel", "per_tensor"], default="block",
                    help="how the experts' weights are quantized (the grouped paths serve all three)")
    ap.add_argument("--block-ms", type=int, nargs="*", default=[], choices=BLOCK_MS,
                    help="tile heights of the tiled GEMM to time fixed, beside the library's pick (fp8/tiles_m<rows>)")
    ap.add_argument("--grid-orders", action="store_true",
                    help="also time the tiled GEMM in either grid order (fp8/tiles_n_first, fp8/tiles_tiles_first)")
    ap.add_argument("--compiled", action="store_true",
                    help="also time bf16/grouped_mm and the tiled variants under torch.compile (no CUDA graphs)")
    common.add_rounds_device_out(ap, iters=30)
    args = ap.parse_args(argv)
    result = run(args)
    common.write_report(args.out, "moe_experts", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
