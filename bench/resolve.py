"""``python -m bench.resolve``: what resolving ``auto`` with a warm lockfile costs at model load.

    python -m bench.resolve                      # CPU is fine: llama3-8b + llama3-70b shapes, 80 layers
    python -m bench.resolve --device cuda --layers 32 --out /tmp/resolve

Builds a synthetic lockfile for this platform (every model shape x M bucket; the recorded choice is the
candidate static priorities rank last, so a lockfile hit is visible) in a temporary folder, then times
``resolve_gemm_backend("auto", problem=...)`` as an engine loading a model would call it: per layer,
its four linear shapes, either at one M or at every M bucket (a dispatch table). Three settings:
lockfile off (static priorities or the measured defaults), lockfile cold (the first resolution parses the
file) and warm.
Reports microseconds per resolution and per layer, and what the lockfile adds over static priorities
(target: under 1 ms per layer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fp8_backends.core.types import GemmProblem
from fp8_backends.registry import lockfile, resolution
from fp8_backends.registry.platform import Platform, detect_platform
from fp8_backends.tuning.models import linear_shapes
from fp8_backends.tuning.workloads import expand_candidates

from . import common


def synthetic_lockfile(path: Path, platform: Platform, shapes: list[tuple[int, int]], device: str) -> int:
    """Entries for every shape x default bucket; the choice is the statically last-ranked candidate."""
    entries = {}
    for n, k in shapes:
        for m in lockfile.DEFAULT_M_BUCKETS:
            problem = GemmProblem(n=n, k=k, m=m, device=device)
            cands, _ = expand_candidates("gemm", problem, platform)
            if not cands:
                continue
            pick = max(cands, key=lambda c: c.rank)
            fields = lockfile.problem_fields("gemm", problem)
            choice = {"provider": pick.provider, "distribution": pick.entry.dist, "options": pick.options, "us": 1.0}
            entries[lockfile.entry_key("gemm", fields, m)] = {
                "kind": "gemm", "problem": fields, "m": m, "choice": choice, "ranking": [choice],
                "tie_break": False, "tie_margin": lockfile.DEFAULT_TIE_MARGIN, "method": "synthetic",
            }
    key, _ = lockfile.current_key(platform)
    return lockfile.write_entries(path, key, entries)


def _resolve_us(problem: GemmProblem, platform: Platform, expect: tuple[str, ...]) -> float:
    t0 = time.perf_counter()
    res = resolution.explain("gemm", None, problem=problem, platform=platform)
    if res.error is None:
        resolution._log_choice(res)
    us = (time.perf_counter() - t0) * 1e6
    if res.source not in expect:
        raise RuntimeError(f"expected a {' or '.join(expect)} resolution, got {res.source} ({res.note})")
    return us


def _load(shapes, layers: int, ms: list[int], platform: Platform, device: str, path: Path) -> tuple[list, list]:
    """Resolve every linear of every layer at every M, alternating lockfile off / on call by call (so load
    on a shared machine hits both alike); returns µs per resolution for each."""
    static, locked = [], []
    for _ in range(layers):
        for n, k in shapes:
            for m in ms:
                problem = GemmProblem(n=n, k=k, m=m, device=device)
                os.environ["FP8_BACKENDS_LOCKFILE"] = "off"
                static.append(_resolve_us(problem, platform, ("priority", "measured-default", "shipped-exact",
                                                                "shipped-nearest")))
                os.environ["FP8_BACKENDS_LOCKFILE"] = str(path)
                locked.append(_resolve_us(problem, platform, ("lockfile",)))
    return static, locked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.resolve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b"])
    ap.add_argument("--layers", type=int, default=80, help="layers resolved per setting (default 80)")
    ap.add_argument("--device", default="cpu", help="platform to resolve for: cpu (default) or cuda")
    ap.add_argument("--out", default=None, help="also write resolve.json / resolve.md here")
    args = ap.parse_args(argv)
    platform = detect_platform(args.device)
    device = "cpu" if platform.kind.value == "cpu" else "cuda"
    per_model = {m: [(s.n, s.k) for s in linear_shapes(m)] for m in args.models}
    all_shapes = list(dict.fromkeys(s for shapes in per_model.values() for s in shapes))
    results: dict[str, Any] = {"platform": platform.describe(), "layers": args.layers, "settings": {}}
    saved = os.environ.get("FP8_BACKENDS_LOCKFILE")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "selection.lock.json"
        os.environ["FP8_BACKENDS_LOCKFILE"] = str(path)
        lockfile.reset_state()
        count = synthetic_lockfile(path, platform, all_shapes, device)
        results["lockfile_entries"] = count
        one_m, every_m = [16], list(lockfile.DEFAULT_M_BUCKETS)
        try:
            for model, shapes in per_model.items():
                for ms_name, ms in (("one M", one_m), ("every M bucket", every_m)):
                    lockfile.reset_state()
                    os.environ["FP8_BACKENDS_LOCKFILE"] = str(path)
                    t0 = time.perf_counter()
                    _resolve_us(GemmProblem(n=shapes[0][0], k=shapes[0][1], m=ms[0], device=device), platform,
                                ("lockfile",))
                    cold_ms = (time.perf_counter() - t0) * 1e3
                    _load(shapes, 2, ms, platform, device, path)  # warm discovery and instance caches
                    static, warm = _load(shapes, args.layers, ms, platform, device, path)
                    per_layer = len(shapes) * len(ms)
                    s_med, w_med = statistics.median(static), statistics.median(warm)
                    results["settings"][f"{model}, {ms_name}"] = {
                        "resolutions_per_layer": per_layer,
                        "static_us_per_resolution": s_med,
                        "lockfile_us_per_resolution": w_med,
                        "static_us_per_layer": s_med * per_layer,
                        "lockfile_us_per_layer": w_med * per_layer,
                        "added_us_per_layer": (w_med - s_med) * per_layer,
                        "first_resolution_with_file_parse_ms": cold_ms,
                    }
        finally:
            if saved is None:
                os.environ.pop("FP8_BACKENDS_LOCKFILE", None)
            else:
                os.environ["FP8_BACKENDS_LOCKFILE"] = saved
            lockfile.reset_state()
    rows = [[name, r["resolutions_per_layer"], f"{r['static_us_per_resolution']:.1f}",
             f"{r['lockfile_us_per_resolution']:.1f}", f"{r['static_us_per_layer']:.0f}",
             f"{r['lockfile_us_per_layer']:.0f}", f"{r['added_us_per_layer']:.0f}",
             f"{r['first_resolution_with_file_parse_ms']:.1f}"]
            for name, r in results["settings"].items()]
    header = ["setting", "res./layer", "static µs/res", "lockfile µs/res", "static µs/layer", "lockfile µs/layer",
              "added µs/layer", "cold first (ms)"]
    print(f"platform: {results['platform']}; synthetic lockfile with {results['lockfile_entries']} entries; "
          f"{args.layers} layers per setting; medians")
    print(common.console_table(header, rows))
    worst = max(r["added_us_per_layer"] for r in results["settings"].values())
    print(f"target: the lockfile adds < 1000 µs per layer: {'met' if worst < 1000 else 'NOT met'} "
          f"(worst {worst:.0f} µs)")
    if args.out:
        out = Path(args.out)
        common.write_json(out / "resolve.json", results)
        (out / "resolve.md").write_text("\n".join(["# auto resolution cost at model load", "",
                                                   *common.md_table(header, rows), ""]), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
