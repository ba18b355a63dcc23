"""``python -m fp8_backends.build PROVIDER``: build a provider's just-in-time kernels ahead of serving.

Providers with JIT kernels: ``cutlass`` (CUTLASS 3.x SM90 FP8 GEMM: per-tensor / row-wise and block-scaled).
Works on a machine without a GPU as long as nvcc and the headers are there; the libraries land in the provider's
disk cache, where a serving process (same cache folder) finds them.

``cutlass`` options:
  --arch 90a              nvcc target (only 90a; SM100 needs separate kernels)
  --config NAMES          comma-separated config names, ``table`` (the configs the dispatch table uses)
                          or ``all`` (default: all)
  --epilogue NAMES        tensor, rowwise, block (the block-scaled kernel: 1x128 activation groups, 128x128
                          weight blocks) or all (default: all)
  --block-config NAMES    block configs (epilogue block): comma-separated names, ``table`` (those the block
                          table uses) or ``all`` (default: all)
  --out-dtype NAMES       bfloat16, float16, float32 (also bf16, fp16, fp32) or all (default: bfloat16)
  --accum NAMES           fast, precise or all (default: fast; the block kernel has one accumulation)
  --jobs N                parallel nvcc processes (default: CPU count, or $FP8_BACKENDS_BUILD_JOBS)
  --force                 rebuild even when cached
  --list                  print what would be built and whether it is cached; build nothing
  --json PATH             also write a JSON report
  --native auto|yes|no    also build the provider's C++ op against this torch (auto: where torch has CUDA)

Exit status: 0 all built, 1 some build failed (the compiler log path is printed), 2 bad arguments or
no toolchain.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence

_OUT_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def _pick(raw: str, allowed: Sequence[str], what: str, aliases: dict[str, str] | None = None) -> list[str]:
    if raw == "all":
        return list(allowed)
    out = []
    for item in (p.strip() for p in raw.split(",") if p.strip()):
        item = (aliases or {}).get(item, item)
        if item not in allowed:
            raise ValueError(f"unknown {what} {item!r} (choose from {', '.join(allowed)} or all)")
        out.append(item)
    if not out:
        raise ValueError(f"no {what} given")
    return out


def _cutlass(argv: Sequence[str]) -> int:
    from fp8_backends.core.errors import BuildError
    from fp8_backends.providers.cutlass import build
    from fp8_backends.providers.cutlass.block_configs import BLOCK_CONFIG_NAMES, active_block_table
    from fp8_backends.providers.cutlass.configs import CONFIG_NAMES, active_table

    parser = argparse.ArgumentParser(prog="python -m fp8_backends.build cutlass",
                                     description="Prebuild the CUTLASS SM90 FP8 GEMM kernels.")
    parser.add_argument("--arch", default="90a")
    parser.add_argument("--config", default="all")
    parser.add_argument("--epilogue", default="all")
    parser.add_argument("--block-config", default="all")
    parser.add_argument("--out-dtype", default="bfloat16")
    parser.add_argument("--accum", default="fast")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--native", choices=("auto", "yes", "no"), default="auto")
    args = parser.parse_args(list(argv))

    arch = args.arch.strip().lower().removeprefix("sm_").removeprefix("sm").replace(".", "")
    if arch not in build.SUPPORTED_ARCHS:
        print(f"error: --arch {args.arch}: this provider builds {', '.join(build.SUPPORTED_ARCHS)} only "
              "(SM100 kernels need separate instantiations)", file=sys.stderr)
        return 2
    try:
        if args.config == "table":
            configs = sorted(active_table().config_names())
        else:
            configs = _pick(args.config, CONFIG_NAMES, "config")
        families = _pick(args.epilogue, (*build.EPILOGUES, "block"), "epilogue")
        if args.block_config == "table":
            block_configs = sorted(active_block_table().config_names())
        else:
            block_configs = _pick(args.block_config, BLOCK_CONFIG_NAMES, "block config")
        outs = _pick(args.out_dtype, tuple(build.OUT_DTYPES), "output dtype", _OUT_ALIASES)
        accums = _pick(args.accum, ("fast", "precise"), "accumulation")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    epilogues = [e for e in families if e != "block"]
    specs: list = build.specs_for(configs, epilogues, outs, [a == "fast" for a in accums], arch)
    if "block" in families:
        specs += build.block_specs_for(block_configs, outs, arch)
    print(f"cache: {build.cache_dir()}")

    if args.list:
        for spec in specs:
            where = build.locate(spec)
            print(f"  {spec.name:60s} {'cached ' + str(where) if where else 'not built'}")
        return 0

    reason = build.missing_toolchain_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    try:
        tc = build.get_toolchain()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    jobs = args.jobs or build.default_jobs(len(specs))
    todo = [s for s in specs if args.force or build.locate(s) is None]
    print(f"nvcc {tc.nvcc_version} ({tc.nvcc}), CUTLASS {tc.cutlass_version}, arch sm_{arch}; "
          f"{len(specs)} libraries, {len(specs) - len(todo)} cached, building {len(todo)} with {jobs} jobs "
          f"(~{build.estimate_seconds(len(todo), jobs)} s)", flush=True)
    start = time.monotonic()
    results = build.build_many(todo, jobs=jobs, force=args.force)
    wall = time.monotonic() - start
    failed = 0
    report = {"arch": arch, "nvcc": tc.nvcc_version, "cutlass": tc.cutlass_version, "wall_s": round(wall, 1),
              "cache": str(build.cache_dir()), "libraries": []}
    for spec in specs:
        result = results.get(spec) if spec in results else build.locate(spec)
        if isinstance(result, BuildError):
            failed += 1
            print(f"  FAILED {spec.name}: {result}")
            report["libraries"].append({"name": spec.name, "ok": False, "error": str(result),
                                        "log": result.log_path})
        else:
            state = "built " if spec in results else "cached"
            print(f"  {state} {spec.name} -> {result}")
            report["libraries"].append({"name": spec.name, "ok": True, "path": str(result),
                                        "built": spec in results})
    print(f"{len(specs) - failed} of {len(specs)} libraries ready in {wall:.1f} s")
    native = _native(args.native)
    report["native"] = native
    failed += not native.get("ok", True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 1 if failed else 0


def _native(mode: str) -> dict:
    """The provider's C++ op (:mod:`fp8_backends.providers.cutlass.native_op`) built against this torch: ``auto``
    where torch has CUDA, ``yes`` always (a failure fails the command), ``no`` never."""
    if mode == "no":
        return {"skipped": "--native no"}
    import torch

    from fp8_backends.providers.cutlass import native_op

    if mode == "auto" and torch.version.cuda is None:
        print("C++ op: skipped (this torch has no CUDA; build it where the serving torch is)")
        return {"skipped": "torch without CUDA"}
    start = time.monotonic()
    try:
        path = native_op.build_library("cuda")
    except native_op.NativeBuildError as exc:
        print(f"  FAILED C++ op: {exc}")
        return {"ok": False, "error": str(exc)}
    print(f"C++ op ready in {time.monotonic() - start:.1f} s -> {path}")
    return {"ok": True, "path": str(path)}


BUILDERS = {"cutlass": _cutlass}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(__doc__)
        return 0 if argv else 2
    provider, rest = argv[0], argv[1:]
    builder = BUILDERS.get(provider)
    if builder is None:
        print(f"error: no prebuildable provider {provider!r} (known: {', '.join(BUILDERS)})", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    return builder(rest)


if __name__ == "__main__":
    sys.exit(main())
