"""num_warps of the Triton RMSNorm + FP8 quant kernels per hidden size and token count (device benchmark).

    python -m bench.norm_configs --out DIR [--hidden 4096,8192] [--tokens 512,1024,2048,4096,8192,16384]
                                 [--warps 4,8,16] [--rows 1,2] [--quick]

For each (H, T) and each variant (``rmsnorm_quant``, ``fused_add_rmsnorm_quant``) it times the one-row
kernel with every ``--warps`` value (and, with ``--rows 1,2,...``, programs of several whole rows: labels
``r2w4`` = 2 rows, 4 warps), plus the config :func:`providers.triton.quant_kernels.row_config`
picks (``auto``), in CUDA graphs over input copies rotated past 4x L2, interleaved
(:class:`fp8_backends.tuning.timing.CudaGraphTimer`). The copy bandwidth is measured at the start; % copy = bytes
moved (x read, fp8 written; the add variant also reads and writes the residual) / time / copy GB/s.
Outputs of ``rmsnorm_quant`` are compared with ``auto``'s (the warps change the order of the fp32 sum of
squares, so fewer than 0.1% of the fp8 codes may differ).
Writes ``norm_configs.json`` and ``norm_configs.md``: the data behind ``ROW_WARPS_SMALL`` /
``ROW_WARPS_LARGE``, ``LARGE_LAUNCH`` and ``LARGE_LAUNCH_NORM``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def labels(warps: list[int], rows: list[int]) -> list[tuple[str, int, int]]:
    """``(label, rows per program, num_warps)`` for every combination (one-row labels stay ``w<warps>``)."""
    return [(f"w{w}" if r == 1 else f"r{r}w{w}", r, w) for r in rows for w in warps]


def measure(h: int, t: int, add: bool, warps: list[int], timer: Any, l2: int,
            rows: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """Time ``auto`` and each (rows per program, ``num_warps``) at ``[t, h]`` (bf16), outputs checked against
    ``auto``'s. Multi-row programs need ``H`` within one block (the one-pass paths)."""
    import torch

    from fp8_backends.providers.triton import norm_kernels
    from fp8_backends.providers.triton.quant_kernels import RowConfig
    from fp8_backends.tuning.timing import Run, rotation_count

    device = "cuda"
    nbytes = t * h * (2 + 1 + (4 if add else 0))
    sets = rotation_count(nbytes, l2)
    xs = [torch.randn(t, h, device=device, dtype=torch.bfloat16) for _ in range(sets)]
    rs = [torch.randn(t, h, device=device, dtype=torch.bfloat16) for _ in range(sets)]
    outs = [torch.empty(t, h, device=device, dtype=torch.float8_e4m3fn) for _ in range(sets)]
    weight = torch.rand(h, device=device, dtype=torch.bfloat16) + 0.5
    scale = torch.full((1,), 0.05, device=device)
    auto = norm_kernels.default_config(t, h, add)
    one = norm_kernels.one_row_config(t, h, add)  # the shape that the r1 labels vary the warps of
    cfgs: dict[str, Any] = {"auto": None}
    for label, r, w in labels(warps, list(rows)):
        if r == 1:
            cfgs[label] = RowConfig(one.path, one.rows, one.block, w)
        elif one.path != "loop":
            cfgs[label] = RowConfig("rows", r, one.block, w)

    def call(i: int, cfg: Any, out: Any) -> Any:
        if add:  # the residual is updated in place: every call sees another one (timing, not values, matters)
            norm_kernels.fused_add_rmsnorm_quant(out, xs[i], rs[i], weight, scale, 1e-6, config=cfg)
        else:
            norm_kernels.rmsnorm_quant(out, xs[i], weight, scale, 1e-6, config=cfg)
        return out

    ref = None
    if not add:
        ref = call(0, None, torch.empty_like(outs[0])).float()

    def check(out: Any) -> tuple[float, str | None]:
        if ref is None:
            return 0.0, None
        if out is not outs[0]:
            return 0.0, None
        diff = (out.float() != ref).float().mean().item()
        return diff, None if diff < 1e-3 else f"{100 * diff:.2f}% of the fp8 codes differ from auto's"

    def run_of(cfg: Any) -> Run:
        return Run(lambda i: call(i, cfg, outs[i]), sets, check)

    res = timer({label: run_of(cfg) for label, cfg in cfgs.items()})
    return {"hidden": h, "tokens": t, "add": add, "auto": list(auto), "bytes": nbytes,
            "results": {k: v.to_json() for k, v in res.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--hidden", default="4096,8192")
    parser.add_argument("--tokens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--warps", default="4,8,16")
    parser.add_argument("--rows", default="1", help="rows per program to try besides 1 (e.g. 1,2,4)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from bench.common import copy_ceiling, header_markdown, md_table, progress, run_header, write_json, write_markdown
    from fp8_backends.registry.platform import detect_platform
    from fp8_backends.tuning.timing import CudaGraphTimer, TimerConfig, l2_cache_bytes

    device = "cuda"
    header = run_header(detect_platform(device), device)
    copy = copy_ceiling(device)
    header["copy_gbps"] = copy
    timer = CudaGraphTimer(TimerConfig(rounds=3, replays=2) if args.quick else TimerConfig(rounds=5, replays=3),
                           device)
    l2 = l2_cache_bytes(device)
    hiddens = [int(v) for v in args.hidden.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    warps = [int(v) for v in args.warps.split(",")]
    rows_per = tuple(int(v) for v in args.rows.split(","))
    names = [label for label, _, _ in labels(warps, list(rows_per))]
    rows: list[dict[str, Any]] = []
    table: list[list[Any]] = []
    bar = progress(len(hiddens) * len(tokens) * 2, "norm configs")
    for h in hiddens:
        for t in tokens:
            for add in (False, True):
                row = measure(h, t, add, warps, timer, l2, rows_per)
                rows.append(row)
                res = row["results"]
                nbytes = row["bytes"]
                timed = {k: v["median_us"] for k, v in res.items() if v.get("median_us") and not v.get("error")}
                best = min((us, k) for k, us in timed.items() if k != "auto")
                au = timed.get("auto")
                path, n_rows, _, n_warps = row["auto"]
                auto_label = (f"r{n_rows}" if path == "rows" and n_rows > 1 else "") + f"w{n_warps}"
                table.append([h, t, "add" if add else "plain", auto_label,
                              *[f"{timed[name]:.2f}" if name in timed else "-" for name in names],
                              best[1], f"{100 * nbytes / au / 1e3 / copy:.0f}" if au else "-",
                              f"{100 * nbytes / best[0] / 1e3 / copy:.0f}"])
                bar.update(1)
                torch.cuda.empty_cache()
    bar.close()
    out = Path(args.out)
    write_json(out / "norm_configs.json", {"header": header, "rows": rows})
    md = header_markdown(header, "Triton RMSNorm + FP8 quant: num_warps per (H, T)")
    md += [f"Copy bandwidth {copy:.0f} GB/s. µs per call, CUDA graphs, interleaved; bf16 in, e4m3 out.", ""]
    md += md_table(["H", "T", "variant", "auto", *[f"{name} µs" for name in names], "fastest", "auto % copy",
                    "best % copy"], table)
    write_markdown(out / "norm_configs.md", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
