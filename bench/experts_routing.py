"""Benchmark: the tiled MoE experts GEMM's routing (the (token, slot) pairs sorted by expert and the tile plan) made
by the library's Triton kernels (one launch, or two over many programs for many pairs) against the same plan made by
torch ops (``argsort``, a scatter-add count, cumulative sums and a ``searchsorted``:
:class:`bench.moe_experts.TorchPlanKernels`, what the library ran before).

For each pair count, random top-k routing over ``--experts`` experts (the same ids for every variant), each variant
captured in a CUDA graph (GPU time) and called eagerly (the time one call takes with its launches); variants: the
kernel at its defaults, each form of it at every P with ``--forms`` (``kernel_one``: one program, ``kernel_many``: a
program per chunk of ids in two launches), at each ``--chunks`` x ``--warps`` setting (the ids per step and the
warps), and the torch ops. Interleaved rounds, the order rotated each round; every variant's plan checked first (a
permutation sorted by expert, each pair in one tile of its expert). Writes ``experts_routing.json`` / ``.md`` under
``--out``.

    python -m bench.experts_routing --pairs 512 4096 16384 65536 --forms --out DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from bench import common
from bench.hf_bench import capture, cuda_time_us


def kernel_plan(ids: torch.Tensor, experts: int, block_m: int, chunk: int, warps: int,
                one_program_max: int | None = None) -> tuple[torch.Tensor, ...]:
    """The library's routing at ``chunk`` ids a step and ``warps`` warps; ``one_program_max`` the most pairs the
    one-program kernel takes (0: the many-program form whatever P; None: the library's bound)."""
    from fp8_backends.providers.triton import experts_ops
    from fp8_backends.providers.triton.experts_args import (
        ROUTE_ONE_PROGRAM_MAX,
        route_buffer_len,
        route_launches,
        route_sizes,
        route_views,
    )

    most = ROUTE_ONE_PROGRAM_MAX if one_program_max is None else one_program_max
    buf = ids.new_empty((route_buffer_len(ids.shape[0], experts, block_m, chunk, most),), dtype=torch.int32)
    for kernel, grid, args, w in route_launches(ids, experts, block_m, buf, chunk, warps, most):
        experts_ops._launch_on(kernel, grid, args, w, 1, max(ids.get_device(), 0))
    return route_views(buf, ids.shape[0], route_sizes(ids.shape[0], experts, block_m)[0])[:4]


def check(plan: tuple[torch.Tensor, ...], ids: torch.Tensor, experts: int, block_m: int) -> str | None:
    """Why ``plan`` is wrong for ``ids`` (None: right)."""
    order, tile_expert, tile_row0, tile_end = (t.cpu().long() for t in plan)
    ids = ids.cpu().long()
    clean = torch.where((ids >= 0) & (ids < experts), ids, experts)
    if not torch.equal(order.sort().values, torch.arange(ids.shape[0])):
        return "the order is not a permutation"
    if bool((clean[order].diff() < 0).any()):
        return "the order is not sorted by expert"
    seen = torch.zeros(ids.shape[0], dtype=torch.int64)
    for t in (tile_expert <= experts).nonzero().flatten().tolist():
        rows = order[int(tile_row0[t]):min(int(tile_row0[t]) + block_m, int(tile_end[t]))]
        if not rows.numel() or bool((clean[rows] != tile_expert[t]).any()):
            return f"tile {t} is not one expert's pairs"
        seen[rows] += 1
    return None if bool((seen == 1).all()) else "a pair is in no tile or in two"


def run(args: Any) -> dict[str, Any]:
    from bench.moe_experts import TorchPlanKernels
    from fp8_backends.providers.triton import experts_ops
    from fp8_backends.providers.triton.experts_args import (
        ROUTE_CHUNK,
        ROUTE_ONE_PROGRAM_MAX,
        ROUTE_WARPS,
        block_m_for,
    )
    from fp8_backends.registry.platform import detect_platform

    torch_plan = TorchPlanKernels(None)
    result: dict[str, Any] = {"header": common.run_header(detect_platform(), args.device), "experts": args.experts,
                              "top_k": args.top_k, "defaults": {"chunk": ROUTE_CHUNK, "warps": ROUTE_WARPS,
                                                                  "one_program_max": ROUTE_ONE_PROGRAM_MAX}, "rows": []}
    for pairs in args.pairs:
        g = torch.Generator().manual_seed(pairs)
        tokens = -(-pairs // args.top_k)
        ids = torch.rand(tokens, args.experts, generator=g).topk(args.top_k, dim=-1).indices.reshape(-1)[:pairs]
        ids = ids.to(args.device)
        bm = block_m_for(pairs, args.experts)
        variants = {"kernel": lambda ids=ids, bm=bm: experts_ops.tile_plan(ids, args.experts, bm),
                    "torch_ops": lambda ids=ids: torch_plan.plan(ids, args.experts, 0)[1:]}
        if args.forms:  # each form of the kernel whatever P: where the library's bound between them belongs
            variants["kernel_one"] = lambda ids=ids, bm=bm: kernel_plan(ids, args.experts, bm, ROUTE_CHUNK,
                                                                        ROUTE_WARPS, 1 << 62)
            variants["kernel_many"] = lambda ids=ids, bm=bm: kernel_plan(ids, args.experts, bm, ROUTE_CHUNK,
                                                                         ROUTE_WARPS, 0)
        for chunk in args.chunks:
            for warps in args.warps:
                if (chunk, warps) != (ROUTE_CHUNK, ROUTE_WARPS):
                    variants[f"kernel_c{chunk}_w{warps}"] = (
                        lambda ids=ids, bm=bm, c=chunk, w=warps: kernel_plan(ids, args.experts, bm, c, w))
        errors = {name: check(fn(), ids, args.experts, bm) for name, fn in variants.items()}
        steps = {}
        for name, fn in variants.items():
            if errors[name] is None:
                steps[f"{name}/eager"] = fn
                if args.device == "cuda":
                    steps[f"{name}/graph"] = capture(fn)
        samples: dict[str, list[float]] = {name: [] for name in steps}
        for r in range(args.rounds):
            order = list(steps)
            order = order[r % len(order):] + order[:r % len(order)]
            for name in order:
                samples[name].append(cuda_time_us(steps[name], args.iters, args.device))
        row = {"pairs": pairs, "block_m": bm, "us": {n: statistics.median(v) for n, v in samples.items()},
               "us_rounds": samples, "errors": {n: e for n, e in errors.items() if e}}
        result["rows"].append(row)
        print(f"P={pairs}: " + ", ".join(f"{n} {u:.1f}" for n, u in row["us"].items()), file=sys.stderr)
    return result


def render(result: dict[str, Any]) -> list[str]:
    lines = common.header_markdown(result["header"], f"MoE routing: pairs sorted by expert and the tile plan "
                                   f"({result['experts']} experts, top-{result['top_k']})")
    d = result["defaults"]
    lines += [f"µs per call (median of interleaved rounds); `/graph`: replay of a CUDA-graph capture (GPU time), "
              f"`/eager`: a plain call (launches included). `kernel`: the library's routing at its defaults "
              f"(chunk {d['chunk']}, {d['warps']} warps, one program up to {d.get('one_program_max', '-')} pairs, "
              f"else two launches of a program per chunk; `kernel_one` / `kernel_many`: either form at every P); "
              f"`torch_ops`: the same plan by torch ops. Ratio: the "
              f"kernel's to the torch ops', median over rounds of the per-round ratio.", ""]
    names = list(dict.fromkeys(n for row in result["rows"] for n in row["us"]))
    header = ["pairs", "tile rows", *names, "kernel / torch_ops (graph)", "kernel / torch_ops (eager)"]
    rows = []
    for row in result["rows"]:
        ratios = []
        for mode in ("graph", "eager"):
            a, b = row["us_rounds"].get(f"kernel/{mode}"), row["us_rounds"].get(f"torch_ops/{mode}")
            ratios.append(common.fmt(statistics.median(x / y for x, y in zip(a, b)), ".3f") if a and b else "-")
        rows.append([row["pairs"], row["block_m"], *[common.fmt(row["us"].get(n), ".1f") for n in names], *ratios])
    lines += common.md_table(header, rows)
    wrong = [f"P={row['pairs']} {n}: {e}" for row in result["rows"] for n, e in row["errors"].items()]
    lines += ["", "Plans checked before timing: " + ("all right" if not wrong else "; ".join(wrong))]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, nargs="+", default=[512, 4096, 16384, 65536])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--forms", action="store_true",
                    help="also time the one-program kernel and the two-launch many-program kernels at every P")
    ap.add_argument("--chunks", type=int, nargs="*", default=[])
    ap.add_argument("--warps", type=int, nargs="*", default=[])
    common.add_rounds_device_out(ap, iters=20)
    args = ap.parse_args(argv)
    result = run(args)
    common.write_report(args.out, "experts_routing", result, render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
