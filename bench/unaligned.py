"""``python -m bench.unaligned``: FP8 GEMMs whose N or K is not a multiple of 16, beside their aligned neighbours.

    python -m bench.unaligned                                   # 4 shape pairs x M = 1 ... 4096
    python -m bench.unaligned --pairs 3420,6840:3456,6912 --m 1,16,256
    python -m bench.unaligned --quick                           # 2 pairs x M 1, 16, 256, 4096, fewer repeats
    python -m bench.unaligned --device cpu --pairs 40,72:48,80 --m 1,4   # CPU smoke run

A pair is an unaligned ``N,K`` (TP splits of real models: vLLM's and flashinfer's tests use 3420 and 6840) and the
aligned neighbour a padding provider would compute instead (``N,K`` rounded up). Per M, every provider that serves a
shape (with its default options) and what ``auto`` picks for it are checked against the fp32 reference, then timed on
both shapes of the pair in one interleaved timing (the same rounds: :mod:`fp8_backends.tuning.timing`, CUDA graphs over
inputs rotated past L2 on the GPU). Providers that refuse the unaligned shape are listed with their reasons.

Per provider and M the table gives µs on both shapes, ``time ratio`` (unaligned / aligned) and ``bytes ratio`` (x + w
+ y bytes, unaligned / aligned). These GEMM calls take an activation already quantized to K columns, so a provider that
pads pays the activation's pad per call there.

The layer table is what a model runs: ``Fp8Linear(backend="auto")`` of both shapes (bf16 in, bf16 out, the layer's
quantization included: a padding provider's activation is quantized straight into the padded width), per scale mode
(``--layer-modes``: per-tensor dynamic, the ``quantize_model`` default, and per-token x per-channel), timed the same
way.
The target, on the layers: no cliff, that is the unaligned shape costs at most what its aligned neighbour costs (``time
ratio <= 1`` within the timing's 3%: serving it is never slower than padding to the neighbour); and ``auto`` serves
every unaligned point. Writes ``unaligned.json`` and ``unaligned.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fp8_backends.core.types import GemmProblem
from fp8_backends.registry.discovery import discover
from fp8_backends.registry.platform import Platform
from fp8_backends.tuning.plan import parse_m_list
from fp8_backends.tuning.workloads import CandidateSpec, GemmWorkload, expand_candidates

from . import common

#: (unaligned N, K), (aligned neighbour N, K): both dims, N only, K only, and the transposed pair
DEFAULT_PAIRS = (((3420, 6840), (3456, 6912)), ((6840, 3420), (6912, 3456)), ((3420, 4096), (3456, 4096)),
                 ((4096, 6840), (4096, 6912)))
DEFAULT_M = (1, 16, 64, 256, 1024, 4096)
QUICK_M = (1, 16, 256, 4096)
#: a time ratio above 1 + this is a cliff (the timing's own noise is about this size)
CLIFF_TOLERANCE = 0.03
#: the layers' scale modes: (activation, weight)
LAYER_MODES = {"per_tensor_dynamic": ("per_tensor_dynamic", "per_tensor"), "per_token": ("per_token", "per_channel")}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.unaligned", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", default=None, metavar="N,K:N,K",
                    help="unaligned shape and its aligned neighbour (default: the 3420 / 6840 pairs)")
    ap.add_argument("--m", default=None, help="M values: '1,16,256' or '1-4096' (powers of two)")
    ap.add_argument("--quick", action="store_true", help="2 pairs x M 1,16,256,4096, fewer repeats")
    ap.add_argument("--layer-modes", nargs="*", default=list(LAYER_MODES), choices=list(LAYER_MODES),
                    help="scale modes of the Fp8Linear table (none: no layer table)")
    common.add_run_options(ap, "pairs")
    return ap


def parse_pair(text: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``"N,K:N,K"`` -> ``((N, K), (N, K))``."""
    try:
        a, b = text.split(":")
        (n1, k1), (n2, k2) = (tuple(int(v) for v in side.split(",")) for side in (a, b))
    except ValueError:
        raise ValueError(f"a pair is N,K:N,K (the unaligned shape, then its aligned neighbour), got {text!r}") from None
    if min(n1, k1, n2, k2) < 1:
        raise ValueError(f"sizes must be >= 1, got {text!r}")
    return (n1, k1), (n2, k2)


def _default_pins() -> dict[str, dict[str, str]]:
    """Every provider's tunable options held at their defaults (``triton@config=auto``: what a layer runs)."""
    pins: dict[str, dict[str, str]] = {}
    for entry in discover("gemm"):
        cls = entry.cls
        if cls is not None:
            options = getattr(cls, "options", {}) or {}
            tunable = [name for name in getattr(cls, "tunable_options", ()) if name in options]
            pins[entry.name] = {name: options[name][0] for name in tunable}
    return pins


def _candidates(problem: GemmProblem, platform: Platform, providers: set[str] | None
                ) -> tuple[list[CandidateSpec], list[tuple[str, str]], str | None]:
    """Each serving provider at its default options, plus ``auto``'s pick: ``(candidates, refused, auto label)``."""
    cands, refused = expand_candidates("gemm", problem, platform, only=providers, pins=_default_pins())
    auto, _, _, error = common._auto_candidate("gemm", problem, platform)
    if auto is not None and auto.label not in {c.label for c in cands}:
        cands.append(auto)
    return cands, refused, (auto.label if auto is not None else None) if error is None else None


def measure_pair(pair: tuple[tuple[int, int], tuple[int, int]], m: int, workloads: dict[tuple[int, int], GemmWorkload],
                 platform: Platform, timer: Any, providers: set[str] | None) -> dict[str, Any]:
    """One pair at one M: every candidate of both shapes checked, then timed in one interleaved timing."""
    runs: dict[str, Any] = {}
    point: dict[str, Any] = {"pair": [list(pair[0]), list(pair[1])], "m": m, "refused": {}, "failed": {},
                             "auto": {}, "bytes": {}}
    for side, (n, k) in zip(("unaligned", "aligned"), pair):
        work = workloads[(n, k)]
        problem = work.problem(m)
        cands, refused, auto = _candidates(problem, platform, providers)
        point["auto"][side] = auto
        point["bytes"][side] = work.bytes_moved(m)
        point["refused"][side] = {label: why for label, why in refused}
        for cand in cands:
            key = f"{side} {cand.label}"
            try:
                _, reason = work.verify(cand, m)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            if reason is None:
                runs[key] = work.run(cand, m)
            else:
                point["failed"][key] = reason
    measured = timer(runs) if runs else {}
    point["us"] = {key: (mm.median_us if mm.ok else None) for key, mm in measured.items()}
    point["errors"] = {key: mm.error for key, mm in measured.items() if not mm.ok}
    return point


class LayerWorkload:
    """``Fp8Linear(backend="auto")`` layers of one ``[N, K]`` bf16 weight in each scale mode, on bf16 activations
    ``[M, K]`` rotated past L2 (as :class:`~fp8_backends.tuning.workloads.GemmWorkload`'s)."""

    def __init__(self, n: int, k: int, device: str, modes: list[str], seed: int = 0) -> None:
        import torch

        from fp8_backends.layers import Fp8Linear
        from fp8_backends.tuning.timing import l2_cache_bytes

        self.torch, self.n, self.k, self.device = torch, n, k, torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        self.linear = torch.nn.Linear(k, n, bias=False).to(self.device, torch.bfloat16)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        self.layers = {}
        for mode in modes:
            act, wscale = LAYER_MODES[mode]
            self.layers[mode] = Fp8Linear.from_linear(self.linear, act_scale=act, weight_scale=wscale, backend="auto")
        self.l2 = l2_cache_bytes(self.device) if self.device.type == "cuda" else 0

    def provider(self, mode: str, m: int) -> str:
        """The provider ``auto`` runs for ``m`` rows (the layer's per-M composite; on the GPU the rows of CUDA-graph
        captures, which the timing replays)."""
        kernel = self.layers[mode].kernel
        rows = kernel.graph_rows if self.device.type == "cuda" else kernel.rows
        return next((row.backend.name for row in rows if m <= row.bucket), rows[-1].backend.name)

    def bytes_moved(self, m: int) -> float:
        return m * self.k * 2 + self.n * self.k + m * self.n * 2

    def run(self, mode: str, m: int) -> Any:
        from fp8_backends.tuning.timing import Run, rotation_count

        torch = self.torch
        sets = rotation_count(self.bytes_moved(m), self.l2, maximum=32) if self.device.type == "cuda" else 1
        x = torch.randn(m, self.k, generator=torch.Generator().manual_seed(m)).to(self.device, torch.bfloat16)
        xs = [x.clone() for _ in range(sets)]  # copies: the timer checks the output of any set
        with torch.no_grad():
            want = self.linear(xs[0]).float()
        layer = self.layers[mode]

        def fn(i: int) -> Any:
            return layer(xs[i])

        def check(out: Any) -> tuple[float, str | None]:
            err = float((out.float() - want).norm() / want.norm().clamp_min(1e-30))
            return err, None if err < 0.1 else f"relative error {err:.3g} against the bf16 linear"

        return Run(lambda i: fn(i % sets), sets, check)


def measure_layers(pair: tuple[tuple[int, int], tuple[int, int]], m: int, layers: dict[tuple[int, int], LayerWorkload],
                   modes: list[str], timer: Any) -> list[dict[str, Any]]:
    """Per scale mode, the ``auto`` layers of both shapes of the pair in one interleaved timing."""
    runs: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for mode in modes:
        for side, nk in zip(("unaligned", "aligned"), pair):
            run = layers[nk].run(mode, m)
            err, reason = run.check(run.fn(0))
            key = f"{side} {mode}"
            if reason is None:
                runs[key] = run
            else:
                failed[key] = reason
    measured = timer(runs) if runs else {}
    us = {key: (mm.median_us if mm.ok else None) for key, mm in measured.items()}
    failed.update({key: mm.error for key, mm in measured.items() if not mm.ok})
    rows = []
    for mode in modes:
        u, a = us.get(f"unaligned {mode}"), us.get(f"aligned {mode}")
        rows.append({"pair": [list(pair[0]), list(pair[1])], "m": m, "mode": mode,
                     "provider": {"unaligned": layers[pair[0]].provider(mode, m),
                                  "aligned": layers[pair[1]].provider(mode, m)},
                     "unaligned_us": u, "aligned_us": a, "time_ratio": u / a if u and a else None,
                     "failed": {k: v for k, v in failed.items() if k.endswith(f" {mode}")}})
    return rows


def rows_of(point: dict[str, Any]) -> list[dict[str, Any]]:
    """Per provider label seen on either side: µs on both shapes, the time and bytes ratios."""
    us = point["us"]
    labels = sorted({key.split(" ", 1)[1] for key in us})
    bytes_ratio = point["bytes"]["unaligned"] / point["bytes"]["aligned"]
    rows = []
    for label in labels:
        u, a = us.get(f"unaligned {label}"), us.get(f"aligned {label}")
        rows.append({"pair": point["pair"], "m": point["m"], "provider": label, "unaligned_us": u, "aligned_us": a,
                     "time_ratio": u / a if u and a else None, "bytes_ratio": bytes_ratio,
                     "auto": [side for side in ("unaligned", "aligned") if point["auto"].get(side) == label]})
    return rows


def targets(points: list[dict[str, Any]], layer_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``no_cliff`` on the layers (what a model runs), ``auto_serves_unaligned`` on the GEMM points."""
    cliffs = [f"{r['pair'][0]} M={r['m']} {r['mode']} (auto: {r['provider']['unaligned']}): {r['time_ratio']:.3f}x "
              "its aligned neighbour" for r in layer_rows
              if r["time_ratio"] is not None and r["time_ratio"] > 1 + CLIFF_TOLERANCE]
    unserved = [f"{p['pair'][0]} M={p['m']}" for p in points if not p["auto"].get("unaligned")]
    timed = [r for r in layer_rows if r["time_ratio"] is not None]
    return {"no_cliff": {"points": len(timed), "met": len(timed) - len(cliffs), "violations": cliffs},
            "auto_serves_unaligned": {"points": len(points), "met": len(points) - len(unserved),
                                      "violations": unserved}}


def _shape(nk: list[int]) -> str:
    return f"{nk[0]}x{nk[1]}"


def markdown(header: dict[str, Any], result: dict[str, Any], method: str) -> str:
    fmt = common.fmt
    lines = common.header_markdown(header, "FP8 GEMM at unaligned N, K beside their aligned neighbours")
    lines += [f"Method: {method}", "", "## Targets", ""]
    for name, t in result["targets"].items():
        lines.append(f"- {name}: {t['met']}/{t['points']}" + ("" if not t["violations"] else ":"))
        lines += [f"  - {v}" for v in t["violations"]]
    if result["layer_rows"]:
        lines += ["", "## Fp8Linear(backend=\"auto\"): the layer a model runs (bf16 in, quantization included)", ""]
        lines += common.md_table(
            ["unaligned", "aligned", "M", "mode", "auto runs (unaligned / aligned)", "unaligned µs", "aligned µs",
             "time ratio"],
            [[_shape(r["pair"][0]), _shape(r["pair"][1]), r["m"], r["mode"],
              f"{r['provider']['unaligned']} / {r['provider']['aligned']}", fmt(r["unaligned_us"]),
              fmt(r["aligned_us"]), fmt(r["time_ratio"], ".3f")] for r in result["layer_rows"]])
    lines += ["", "## Every provider (GEMM calls on an activation already quantized to K columns)", ""]
    lines += common.md_table(
        ["unaligned", "aligned", "M", "provider", "unaligned µs", "aligned µs", "time ratio", "bytes ratio", "auto"],
        [[_shape(r["pair"][0]), _shape(r["pair"][1]), r["m"], r["provider"], fmt(r["unaligned_us"]),
          fmt(r["aligned_us"]), fmt(r["time_ratio"], ".3f"), fmt(r["bytes_ratio"], ".3f"), ", ".join(r["auto"]) or "-"]
         for r in result["rows"]])
    refused = sorted({(_shape(p["pair"][0]), label, why) for p in result["points"]
                      for label, why in p["refused"].get("unaligned", {}).items()})
    if refused:
        lines += ["", "## Providers that refuse the unaligned shapes", ""]
        lines += [f"- {shape} {label}: {why}" for shape, label, why in refused]
    failed = sorted({(key, why) for p in result["points"] for key, why in {**p["failed"], **p["errors"]}.items()}
                    | {(f"layer {key}", why) for r in result["layer_rows"] for key, why in r["failed"].items()})
    if failed:
        lines += ["", "## Failures", ""] + [f"- {key}: {why}" for key, why in failed]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, platform, device = common.parse_run_args(ap, argv, "pairs", "small --pairs")
    try:
        pairs = [parse_pair(p) for p in args.pairs] if args.pairs else list(DEFAULT_PAIRS[:2] if args.quick
                                                                             else DEFAULT_PAIRS)
        buckets = parse_m_list(args.m) if args.m else list(QUICK_M if args.quick else DEFAULT_M)
    except ValueError as exc:
        ap.error(str(exc))
    providers, timer, out, header = common.run_setup(args, platform, device)
    kind = "cpu" if device == "cpu" else "cuda"
    print(f"bench.unaligned on {platform.describe()}: {len(pairs)} pairs x {len(buckets)} M -> {out}", file=sys.stderr)
    points: list[dict[str, Any]] = []
    layer_rows: list[dict[str, Any]] = []
    for pair in pairs:
        workloads = {nk: GemmWorkload(GemmProblem(n=nk[0], k=nk[1], device=kind), device) for nk in pair}
        try:
            for m in buckets:
                points.append(measure_pair(pair, m, workloads, platform, timer, providers))
                for w in workloads.values():
                    w.release()
        finally:
            for w in workloads.values():
                w.close()
        if args.layer_modes:
            layers = {nk: LayerWorkload(nk[0], nk[1], device, args.layer_modes) for nk in pair}
            for m in buckets:
                layer_rows += measure_layers(pair, m, layers, args.layer_modes, timer)
            del layers
    rows = [r for p in points for r in rows_of(p)]
    result = {"points": points, "rows": rows, "layer_rows": layer_rows, "targets": targets(points, layer_rows)}
    method = ("both shapes of a pair in one interleaved timing per M: CUDA graph per candidate over input copies "
              f"rotated past L2, {timer.config.rounds} rounds x {timer.config.replays} replays, median per call; every "
              "candidate checked against the fp32 reference first" if device != "cpu" else "CPU wall clock (smoke run)")
    common.write_json(out / "unaligned.json", {"schema": "fp8_backends.bench.unaligned/1", "meta": header,
                                               "method": method, "m_values": buckets, **result})
    (out / "unaligned.md").write_text(markdown(header, result, method), encoding="utf-8")
    print(common.console_table(
        ["unaligned", "M", "layer mode", "auto runs", "unaligned µs", "aligned µs", "time ratio"],
        [[_shape(r["pair"][0]), r["m"], r["mode"], r["provider"]["unaligned"], common.fmt(r["unaligned_us"]),
          common.fmt(r["aligned_us"]), common.fmt(r["time_ratio"], ".3f")] for r in layer_rows]))
    print(common.console_table(
        ["unaligned", "M", "provider", "unaligned µs", "aligned µs", "time ratio", "bytes ratio"],
        [[_shape(r["pair"][0]), r["m"], r["provider"], common.fmt(r["unaligned_us"]), common.fmt(r["aligned_us"]),
          common.fmt(r["time_ratio"], ".3f"), common.fmt(r["bytes_ratio"], ".3f")] for r in rows]))
    for name, t in result["targets"].items():
        print(f"target {name}: {t['met']}/{t['points']}" + "".join(f"\n  {v}" for v in t["violations"]))
    print(f"results: {out}/unaligned.json, unaligned.md")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
