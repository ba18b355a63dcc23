"""``python -m fp8_backends.build PROVIDER``: build a provider's just-in-time kernels ahead of serving.

Providers with JIT kernels: ``cutlass`` (CUTLASS 3.x SM90 FP8 GEMM: per-tensor / row-wise and block-scaled) and
``flashinfer_block`` (flashinfer's ``fp8_blockscale_gemm_sm90``). ``cutlass`` works on a machine without a GPU as long
as nvcc and the headers are there; the libraries land in the provider's disk cache, where a serving process (same
cache folder) finds them.

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
  --json PATH             also write a JSON report (with --list: each library, cached or not)
  --native auto|yes|no    also build the provider's C++ op against this torch (auto: where torch has CUDA)

``flashinfer_block`` options (without any: build flashinfer's module, about 2 minutes the first time; no GPU
needed, but then set ``FLASHINFER_CUDA_ARCH_LIST=9.0a``):
  --shapes NxK,...        also compile the DeepGEMM kernels of these weights [N, K] (needs the SM 9.0 GPU)
  --m LIST                the batch sizes to cover, e.g. 1-31,32-4096 (default 1-31: the decode kernels)
  --sms N                 SM count for --list without a GPU (default: the GPU's, else 132 as on H100/H200 SXM)
  --list                  print the module's state and the kernels --shapes/--m need, cached or not; build nothing
  --json PATH             also write a JSON report

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


def _positive_int(text: str) -> int:
    """``--jobs``: an integer >= 1 (argparse's error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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
    parser.add_argument("--jobs", type=_positive_int, default=None)
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
        listed = {"arch": arch, "cache": str(build.cache_dir()), "libraries": []}
        for spec in specs:
            where = build.locate(spec)
            print(f"  {spec.name:60s} {'cached ' + str(where) if where else 'not built'}")
            listed["libraries"].append({"name": spec.name, "cached": where is not None,
                                        "path": None if where is None else str(where)})
        return _write_report(args.json, listed, 0)

    reason = build.missing_toolchain_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    try:
        tc = build.get_toolchain()
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        jobs = args.jobs or build.default_jobs(len(specs))
    except ValueError as exc:  # a bad FP8_BACKENDS_BUILD_JOBS (ConfigurationError)
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
    return _write_report(args.json, report, 1 if failed else 0)


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


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        n, sep, k = item.lower().partition("x")
        try:
            shape = (int(n), int(k))
        except ValueError:
            shape = (0, 0)
        if not sep or min(shape) < 1:
            raise ValueError(f"bad shape {item!r} (use NxK, e.g. 7168x2048)")
        shapes.append(shape)
    return shapes


def _flashinfer_block(argv: Sequence[str]) -> int:
    """flashinfer's fp8_blockscale_gemm_sm90 module, and optionally the DeepGEMM kernels of given weight shapes."""
    from fp8_backends.providers.flashinfer import block_jit, common

    parser = argparse.ArgumentParser(prog="python -m fp8_backends.build flashinfer_block",
                                     description="Prebuild flashinfer's block-scaled FP8 GEMM module and kernels.")
    parser.add_argument("--shapes", default="")
    parser.add_argument("--m", default="1-31")
    parser.add_argument("--sms", type=int, default=None)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(list(argv))
    try:
        shapes = _parse_shapes(args.shapes)
        ms = block_jit.parse_ms(args.m)
        bad = [f"{n}x{k}: {'; '.join(block_jit.shape_reasons(n, k))}" for n, k in shapes
               if block_jit.shape_reasons(n, k)]
        if bad:
            raise ValueError("shapes the kernels cannot serve: " + " | ".join(bad))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if common._find_spec("flashinfer") is None:
        print(f"error: flashinfer is not installed ({common.INSTALL_HINT})", file=sys.stderr)
        return 2
    missing = block_jit.missing_sources()
    if missing:
        print(f"error: this flashinfer install lacks the JIT sources {', '.join(missing)} (under flashinfer/data/csrc)",
              file=sys.stderr)
        return 2
    nvcc = block_jit.find_nvcc()
    if nvcc is None:
        print("error: no nvcc ($TRTLLM_DG_NVCC_COMPILER, $CUDA_HOME/bin/nvcc or nvcc on the PATH)", file=sys.stderr)
        return 2
    module, reason = common.import_flashinfer()
    reason = reason if module is None else block_jit.feature_reason(module)
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    import torch

    gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    sms = args.sms or (torch.cuda.get_device_properties(0).multi_processor_count if gpu else 132)
    try:
        built, folder = block_jit.module_state(block_jit.module_spec())
    except Exception as exc:  # no GPU and no FLASHINFER_CUDA_ARCH_LIST, a broken JIT environment
        print(f"error: flashinfer's JIT spec: {type(exc).__name__}: {exc} (without a GPU, set "
              "FLASHINFER_CUDA_ARCH_LIST=9.0a)", file=sys.stderr)
        return 2
    report: dict = {"flashinfer": common.flashinfer_version(), "nvcc": nvcc, "module": str(folder),
                    "kernel_cache": str(block_jit.kernel_cache_dir()), "sms": sms, "kernels": []}
    print(f"flashinfer {common.flashinfer_version()}, nvcc {nvcc}; module {'built' if built else 'not built'} "
          f"({folder}); DeepGEMM kernel cache {block_jit.kernel_cache_dir()}; {sms} SMs")
    if args.list:
        for n, k in shapes:
            for config, m in block_jit.configs_for(ms, n, k, sms).items():
                cached = block_jit.kernel_cached_on_disk(config, n, k)
                print(f"  N={n} K={k} from M={m}: {config.describe():42s} {'cached' if cached else 'not built'}")
                report["kernels"].append({"n": n, "k": k, "m": m, "config": config.describe(), "cached": cached})
        return _write_report(args.json, report, 0)
    if shapes and not gpu:
        print("error: --shapes compiles DeepGEMM kernels, which needs the SM 9.0 GPU here", file=sys.stderr)
        return 2
    lib_logger = logging.getLogger("fp8_backends")
    level = lib_logger.level
    lib_logger.setLevel(logging.INFO)  # the build's and each kernel's compile lines
    try:
        return _flashinfer_block_build(args, shapes, ms, report)
    finally:
        lib_logger.setLevel(level)


def _flashinfer_block_build(args: argparse.Namespace, shapes: list[tuple[int, int]], ms: list[int],
                            report: dict) -> int:
    import torch

    from fp8_backends.providers.flashinfer import block_jit

    start = time.monotonic()
    try:
        block_jit.build_module(load=bool(shapes))
    except Exception as exc:
        print(f"  FAILED module: {type(exc).__name__}: {str(exc)[:500]}")
        report["module_error"] = str(exc)
        return _write_report(args.json, report, 1)
    print(f"module ready in {time.monotonic() - start:.1f} s")
    failed = 0
    if shapes:
        from fp8_backends.providers.flashinfer import block_ops

        for n, k in shapes:
            w = torch.zeros((n, k), dtype=torch.float8_e4m3fn, device="cuda")
            w_scale = torch.ones((-(-n // 128), k // 128), dtype=torch.float32, device="cuda")
            try:
                ran = block_ops.warm_up(w, w_scale, ms)
            except Exception as exc:
                failed += 1
                print(f"  FAILED N={n} K={k}: {type(exc).__name__}: {str(exc)[:300]}")
                report["kernels"].append({"n": n, "k": k, "ok": False, "error": str(exc)})
                continue
            torch.cuda.synchronize()
            for m, config, seconds in ran:
                print(f"  N={n} K={k} from M={m}: {config} ready in {seconds:.1f} s")
                report["kernels"].append({"n": n, "k": k, "m": m, "config": config, "seconds": round(seconds, 1),
                                          "ok": True})
            if not ran:
                print(f"  N={n} K={k}: every kernel for M in {args.m} ran already")
    return _write_report(args.json, report, 1 if failed else 0)


def _write_report(path: str | None, report: dict, status: int) -> int:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return status


BUILDERS = {"cutlass": _cutlass, "flashinfer_block": _flashinfer_block}


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
