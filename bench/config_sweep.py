"""What the per-provider config sweeps share (``bench/cutlass_configs.py``, ``bench/triton_configs.py``).

A sweep times every kernel config of one provider, plus ``torch._scaled_mm`` (plain and fast
accumulation), on the Llama-3-8B GEMM shapes at several M, and turns the timings into an M-bucket
dispatch table (:class:`fp8_backends.core.bucket_tables.BucketTable` JSON) and a markdown report.

- :func:`measure_point`: one ``(N, K, M)``; candidates interleaved in CUDA graphs over input copies
  rotated past 4x L2 (:class:`fp8_backends.tuning.timing.CudaGraphTimer`), every output checked against
  :func:`fp8_backends.core.reference.fp8_gemm`; the caller supplies the provider's runs.
- :func:`summarize`: best config per point, the measured table (per shape, plus a ``default`` with the best
  geometric-mean speed over the shapes; bucket bounds at the geometric midpoints of the measured M), and
  speed ratios to torch per M class for several ways of picking.
- :func:`markdown`: the report.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.common import geomean

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
TORCH = "torch_scaled_mm"
TORCH_FA = "torch_scaled_mm_fast_accum"
M_CLASSES: dict[str, Callable[[int], bool]] = {
    "M<=16": lambda m: m <= 16,
    "M=64-256": lambda m: 64 <= m <= 256,
    "M<=256": lambda m: m <= 256,
    "M=1024": lambda m: m == 1024,
    "M>=4096": lambda m: m >= 4096,
}


@dataclass(frozen=True)
class SweepSpec:
    """How one provider's sweep names and tabulates its configs."""

    provider: str          # e.g. "cutlass"
    prefix: str            # result label prefix, e.g. "cutlass:"
    table_cls: Any         # a BucketTable subclass
    builtin: Any           # the provider's built-in table (an instance of table_cls)


def add_sweep_args(parser: Any, configs_default: str, ms: list[int]) -> None:
    """The options every config sweep takes: ``--out --configs --ms --shapes --rounds --replays --quick``."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--configs", default=configs_default)
    parser.add_argument("--ms", default=",".join(map(str, ms)))
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--replays", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="3 rounds x 2 replays")


def grid_and_timer(args: Any, device: str) -> tuple[list[int], list[tuple[int, int]], Any]:
    """``(ms, shapes, timer)`` from :func:`add_sweep_args`' options (the timer: interleaved CUDA graphs)."""
    from fp8_backends.tuning.timing import CudaGraphTimer, TimerConfig

    ms = [int(v) for v in args.ms.split(",")]
    shapes = [(int(n), int(k)) for n, _, k in (s.partition("x") for s in args.shapes.split(","))]
    cfg = TimerConfig(rounds=3, replays=2) if args.quick else TimerConfig(rounds=args.rounds, replays=args.replays)
    return ms, shapes, CudaGraphTimer(cfg, device)


def bounds(ms: list[int]) -> list[int | None]:
    """Upper bucket bounds: the geometric midpoint between neighbouring measured M values; last unbounded."""
    out: list[int | None] = [int(math.floor(math.sqrt(a * b))) for a, b in zip(ms, ms[1:])]
    return [*out, None]


def buckets(best_by_m: dict[int, str], ms: list[int]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for bound, m in zip(bounds(ms), ms):
        name = best_by_m[m]
        if out and out[-1][1] == name:
            out[-1][0] = bound
        else:
            out.append([bound, name])
    return out


def measure_point(n: int, k: int, m: int, runs_for: Callable[..., dict[str, Any]], timer: Any, l2: int,
                  device: str, rowwise: bool = False) -> dict[str, Any]:
    """Time torch._scaled_mm (both accumulations) and the provider's runs on one problem; check every output.

    ``runs_for(xsets, wsets, xs, ws, n_sets, check) -> {label: Run}`` builds the provider's runs over the
    rotated input copies (``xs``: ``[1]`` or ``[M, 1]``; ``ws``: ``[1]`` or ``[N]``)."""
    import torch

    from fp8_backends.core import reference
    from fp8_backends.tuning.timing import Run, rotation_count

    fp8 = torch.float8_e4m3fn
    n_sets = rotation_count(n * k + m * k + 2 * m * n, l2)
    g = torch.Generator(device=device).manual_seed(1000 * m + n + k)
    x0 = (torch.randn(m, k, device=device, generator=g) * 2).to(fp8)
    w0 = (torch.randn(n, k, device=device, generator=g) * 2).to(fp8)
    if rowwise:
        xs = torch.rand(m, 1, device=device, generator=g) * 0.05 + 0.01
        ws = torch.rand(n, device=device, generator=g) * 0.05 + 0.01
    else:
        xs = torch.tensor([0.05], device=device)
        ws = torch.tensor([0.02], device=device)
    ref = reference.fp8_gemm(x0, w0, xs, ws, torch.float32)
    ref_norm = ref.norm().item()
    xsets = [x0] + [x0.clone() for _ in range(n_sets - 1)]
    wsets = [w0] + [w0.clone() for _ in range(n_sets - 1)]
    sa, sb = (xs, ws.reshape(1, n)) if rowwise else (xs.reshape(()), ws.reshape(()))

    def check(out: Any) -> tuple[float, str | None]:
        err = ((out.float() - ref).norm() / ref_norm).item()
        return err, (None if err < 1e-2 else f"relerr {err:.3g}")

    def torch_run(fast_accum: bool) -> Run:
        return Run(lambda i: torch._scaled_mm(xsets[i], wsets[i].t(), scale_a=sa, scale_b=sb,
                                              out_dtype=torch.bfloat16, use_fast_accum=fast_accum), n_sets, check)

    runs = {TORCH: torch_run(False), TORCH_FA: torch_run(True)}
    runs.update(runs_for(xsets, wsets, xs, ws, n_sets, check))
    errors: dict[str, float] = {}
    for label, run in runs.items():  # eager correctness of set 0 (the timer re-checks the graph outputs)
        try:
            errors[label] = check(run.fn(0))[0]
        except Exception as exc:  # recorded; the run goes on
            errors[label] = float("nan")
            print(f"  {label} failed eagerly: {type(exc).__name__}: {exc}", flush=True)
    results = timer(runs)
    row: dict[str, Any] = {"n": n, "k": k, "m": m, "n_sets": n_sets, "results": {}}
    for label, meas in results.items():
        row["results"][label] = {**meas.to_json(), "relerr": errors.get(label)}
    return row


def us(row: dict[str, Any], label: str) -> float | None:
    """A candidate's median µs at one point, or None when it failed or was wrong."""
    r = row["results"].get(label)
    if not r or r.get("error") or r.get("median_us") is None:
        return None
    if r.get("relerr") is None or not (r["relerr"] < 1e-2):
        return None
    return r["median_us"]


def best(row: dict[str, Any], names: list[str], prefix: str) -> tuple[str, float] | None:
    cands = [(n, us(row, prefix + n)) for n in names]
    cands = [(n, t) for n, t in cands if t is not None]
    return min(cands, key=lambda c: c[1]) if cands else None


def summarize(rows: list[dict[str, Any]], names: list[str], ms: list[int], shapes: list[tuple],
              spec: SweepSpec, eligible: Callable[[str, int], bool] | None = None) -> dict[str, Any]:
    """The measured table and speed ratios (see the module docstring). ``eligible(name, m)``: whether a
    config may be picked for the default buckets at M (default: every config)."""
    eligible = eligible or (lambda name, m: True)
    by = {(r["n"], r["k"], r["m"]): r for r in rows}
    per_shape: dict[str, list[list[Any]]] = {}
    default_best: dict[int, str] = {}
    for n, k in shapes:
        best_by_m = {}
        for m in ms:
            b = best(by[(n, k, m)], names, spec.prefix)
            if b:
                best_by_m[m] = b[0]
        if len(best_by_m) == len(ms):
            per_shape[f"{n}x{k}"] = buckets(best_by_m, ms)
    for m in ms:  # the config with the best geometric-mean speed (relative to torch) over the shapes
        scores = {}
        for name in names:
            if not eligible(name, m):
                continue
            ratios = []
            for n, k in shapes:
                row = by[(n, k, m)]
                t, c = us(row, TORCH), us(row, spec.prefix + name)
                if t and c:
                    ratios.append(t / c)
            if len(ratios) == len(shapes):
                scores[name] = geomean(ratios)
        if scores:
            default_best[m] = max(scores, key=scores.get)
    table = {
        "format": spec.table_cls.FORMAT,
        "source": f"bench/{spec.provider}_configs.py measurement, {_dt.date.today().isoformat()}",
        "default": buckets(default_best, ms) if len(default_best) == len(ms) else None,
        "shapes": per_shape,
    }

    def ratios(pick: Callable[..., str | None]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for cls, sel in M_CLASSES.items():
            vals = []
            for (n, k, m), row in by.items():
                if not sel(m):
                    continue
                t = us(row, TORCH)
                name = pick(n, k, m, row)
                c = us(row, spec.prefix + name) if name else None
                if t and c:
                    vals.append(t / c)
            if vals:
                out[cls] = {"geomean": round(geomean(vals), 3), "min": round(min(vals), 3),
                            "max": round(max(vals), 3), "points": len(vals)}
        return out

    def pick_best(n, k, m, row):
        b = best(row, names, spec.prefix)
        return b[0] if b else None

    def pick_from(table_obj):
        return lambda n, k, m, row: table_obj.pick(m, n, k)

    measured = spec.table_cls.from_json(table) if table["default"] is not None else None
    measured_default = spec.table_cls.from_json({**table, "shapes": {}}) if measured else None
    builtin_names = spec.builtin.config_names()
    summary = {
        "table": table,
        "ratio_best_per_point": ratios(pick_best),
        "ratio_builtin_table": ratios(pick_from(spec.builtin)) if builtin_names <= set(names) else None,
        "ratio_measured_table": ratios(pick_from(measured)) if measured else None,
        "ratio_measured_default_only": ratios(pick_from(measured_default)) if measured else None,
        "torch_fast_accum_vs_torch": {},
    }
    fa = []
    for row in rows:
        t, f = us(row, TORCH), us(row, TORCH_FA)
        if t and f:
            fa.append(t / f)
    summary["torch_fast_accum_vs_torch"] = {"geomean": round(geomean(fa), 3)} if fa else {}
    return summary


def table_text(table: dict[str, Any]) -> str:
    """The table JSON with one line per bucket list."""
    lines = ["{", f' "format": {json.dumps(table["format"])},', f' "source": {json.dumps(table["source"])},',
             f' "default": {json.dumps(table["default"])},', ' "shapes": {']
    items = list(table["shapes"].items())
    for i, (shape, bucket_list) in enumerate(items):
        lines.append(f'  {json.dumps(shape)}: {json.dumps(bucket_list)}' + ("," if i < len(items) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines)


def markdown(report: dict[str, Any], names: list[str], spec: SweepSpec, title: str, header_lines: list[str],
             floor_us: Callable[[dict[str, Any]], float | None] | None = None) -> str:
    """The report: header lines, µs per config and point (with the best config, its ratio to torch and,
    when ``floor_us(row)`` is given, torch's and the best's % of that floor), then the ratio summary and
    the measured table."""
    lines = [f"# {title}", "", *header_lines, "", "## µs per call", ""]
    head = ["N,K", "M", "torch", "torch fa", *names, "best", "torch/best"]
    if floor_us:
        head += ["floor µs", "torch % floor", "best % floor"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    for row in report["rows"]:
        cells = [f"{row['n']},{row['k']}", str(row["m"])]
        for label in (TORCH, TORCH_FA, *(spec.prefix + n for n in names)):
            t = us(row, label)
            r = row["results"].get(label, {})
            cells.append(f"{t:.1f}" if t is not None else ("err" if r.get("error") or r else "-"))
        b = best(row, names, spec.prefix)
        t = us(row, TORCH)
        cells += [b[0] if b else "-", f"{t / b[1]:.2f}" if b and t else "-"]
        if floor_us:
            f = floor_us(row)
            cells += [f"{f:.2f}" if f else "-", f"{100 * f / t:.0f}%" if f and t else "-",
                      f"{100 * f / b[1]:.0f}%" if f and b else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    s = report["summary"]
    classes = list(M_CLASSES)
    lines += ["", "## Speed relative to torch._scaled_mm (geometric mean over points; min-max)", ""]
    lines.append("| pick | " + " | ".join(classes) + " |")
    lines.append("|" + "---|" * (len(classes) + 1))
    for label, key in (("best config per point", "ratio_best_per_point"),
                       ("measured table (per shape)", "ratio_measured_table"),
                       ("measured table (default buckets only)", "ratio_measured_default_only"),
                       ("built-in table at run time", "ratio_builtin_table")):
        data = s.get(key) or {}
        cells = []
        for cls in classes:
            d = data.get(cls)
            cells.append(f"{d['geomean']:.2f} ({d['min']:.2f}-{d['max']:.2f})" if d else "-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if s.get("torch_fast_accum_vs_torch"):
        lines.append(f"\ntorch._scaled_mm use_fast_accum=True vs False: {s['torch_fast_accum_vs_torch']['geomean']}x "
                     "(geomean over every point)")
    lines += ["", f"## Measured dispatch table ({spec.provider}_table.json)", "", "```json",
              table_text(s["table"]), "```", ""]
    return "\n".join(lines)


__all__ = ["SHAPES", "TORCH", "TORCH_FA", "SweepSpec", "add_sweep_args", "best", "buckets", "geomean", "grid_and_timer",
           "markdown", "measure_point",
           "summarize", "table_text", "us"]
