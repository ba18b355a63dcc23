"""Just-in-time builds of the CUTLASS SM90 kernels: nvcc discovery, cache keys, locked builds, ctypes loading.

One shared library per spec, compiled with ``-D`` macros from one source file:

- :class:`LibrarySpec` (a kernel config x epilogue x output dtype x accumulation mode): ``fp8_gemm_sm90.cu``, the
  per-tensor / row-wise scaled GEMM, exporting ``fp8b_gemm``;
- :class:`BlockLibrarySpec` (a block config x output dtype): ``fp8_blockwise_gemm_sm90.cu``, the block-scaled GEMM
  (1x128 activation groups, 128x128 weight blocks), exporting ``fp8b_block_gemm``.

A library links the CUDA runtime statically and not torch: its entry takes raw pointers, sizes and a
``cudaStream_t`` and is called through ctypes on torch's current stream.

Cache: ``$FP8_BACKENDS_CUTLASS_CACHE`` or ``cutlass`` in the cache folder
(:func:`fp8_backends.core.settings.cache_dir`), one folder per library named ``<library>-<key>`` where the key
hashes the library's own kernel source, the macros, the flags, the arch, the nvcc version and the CUTLASS version. A
file lock beside the folder makes parallel processes build once: the second waits and loads the first's result. nvcc
runs in its own process group and dies with its builder, and a build removes the temp files of builders that died
(:mod:`.compiler`). Each folder keeps the compiler's ``build.log`` and a ``manifest.json``. A build at first use says
so at WARNING level (what, how long to expect, how to build ahead) and logs its progress while nvcc runs. A machine
without nvcc or headers still loads a library prebuilt for the same source, macros and arch (``python -m
fp8_backends.build cutlass``).

Nothing here imports torch; nothing builds unless asked (:func:`build_library`, :func:`get_library`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fp8_backends.core import settings
from fp8_backends.core.errors import BuildError

from .block_configs import BLOCK_CONFIGS
from .compiler import run_compiler, sweep_stale_temps, temp_path
from .configs import CONFIGS

logger = logging.getLogger("fp8_backends")

ABI_VERSION = 1
HERE = Path(__file__).resolve().parent
#: a library's sources: the file nvcc compiles first, then the headers of this folder it includes (all in its cache key)
SOURCE_FILES: tuple[str, ...] = ("fp8_gemm_sm90.cu", "tma_encode.cuh")
#: the block-scaled kernel's source and C ABI version (its own: a change to one source rebuilds only its libraries)
BLOCK_SOURCE_FILES: tuple[str, ...] = ("fp8_blockwise_gemm_sm90.cu", "tma_encode.cuh")
BLOCK_ABI_VERSION = 1
SUPPORTED_ARCHS: tuple[str, ...] = ("90a",)
EPILOGUES: tuple[str, ...] = ("tensor", "rowwise")
OUT_DTYPES: dict[str, int] = {"bfloat16": 0, "float16": 1, "float32": 2}
_OUT_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}

DEFAULT_NVCC = Path("/usr/local/cuda/bin/nvcc")
CACHE_ENV = settings.CUTLASS_CACHE_ENV
CUTLASS_DIR_ENV = settings.CUTLASS_DIR_ENV
JOBS_ENV = settings.BUILD_JOBS_ENV

#: nvcc flags shared by every library (the gencode flag is added per arch)
NVCC_FLAGS: tuple[str, ...] = (
    "-std=c++17",
    "-O3",
    "-DNDEBUG",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-fvisibility=hidden",
    "-shared",
    "--cudart=static",
)
#: wall seconds per library per job, the estimate availability() quotes: measured 67 s for one library
#: alone and ~100 s each for two at once on a 2-core box, 52-69 s for 8-22 libraries on 16 cores (nvcc 13.0)
SECONDS_PER_LIBRARY = 100
BUILD_TIMEOUT_S = 1800
#: seconds between two progress lines while a build runs
PROGRESS_EVERY_S = 15.0
LOCK_TIMEOUT_S = 3600

# the C ABI of fp8b_gemm (see fp8_gemm_sm90.cu); tests compare this with the source
GEMM_ARGTYPES: tuple[Any, ...] = (
    ctypes.c_void_p,  # x
    ctypes.c_void_p,  # w
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # m
    ctypes.c_int64,  # n
    ctypes.c_int64,  # k
    ctypes.c_void_p,  # x_scale
    ctypes.c_int,  # x_scale_vec
    ctypes.c_void_p,  # w_scale
    ctypes.c_int,  # w_scale_vec
    ctypes.c_void_p,  # bias (nullable)
    ctypes.c_void_p,  # workspace (nullable)
    ctypes.c_size_t,  # workspace_bytes
    ctypes.c_void_p,  # stream
)
GEMM_RESTYPE = ctypes.c_int
WORKSPACE_ARGTYPES: tuple[Any, ...] = (ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
WORKSPACE_RESTYPE = ctypes.c_size_t

# the C ABI of fp8b_block_gemm (see fp8_blockwise_gemm_sm90.cu); tests compare this with the source
BLOCK_GEMM_ARGTYPES: tuple[Any, ...] = (
    ctypes.c_void_p,  # x
    ctypes.c_void_p,  # w
    ctypes.c_void_p,  # out
    ctypes.c_int64,  # m
    ctypes.c_int64,  # n
    ctypes.c_int64,  # k
    ctypes.c_void_p,  # x_scale (M-major)
    ctypes.c_int64,  # x_scale_ld
    ctypes.c_void_p,  # w_scale (K-major)
    ctypes.c_int64,  # w_scale_ld
    ctypes.c_void_p,  # bias (nullable)
    ctypes.c_void_p,  # workspace (nullable)
    ctypes.c_size_t,  # workspace_bytes
    ctypes.c_void_p,  # stream
)

#: fp8b_gemm return codes
RETURN_CODES = {
    1: "invalid arguments (null pointer, bad size, or vector scales for the per-tensor epilogue)",
    2: "could not query the CUDA device",
    3: "CUTLASS cannot implement this problem (alignment or shape)",
    4: "workspace too small",
    5: "workspace initialisation failed",
    6: "could not raise the kernel's shared-memory limit",
    7: "kernel launch failed",
}
#: fp8b_block_gemm return codes
BLOCK_RETURN_CODES = {
    **RETURN_CODES,
    1: "invalid arguments (null pointer or bad size)",
    8: "scale layout not served (a scale stride too small, or for this config an activation-scale stride that is "
       "not a multiple of 4 or a pointer that is not 16-byte aligned)",
}


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class LibrarySpec:
    """One shared library: a kernel config in one epilogue family.

    - ``config``: a name from :data:`configs.CONFIGS`.
    - ``epilogue``: ``tensor`` (per-tensor scales, ``(s_x*s_w)*acc``) or ``rowwise`` (each scale one
      value or a vector: per-token x, per-channel w).
    - ``out_dtype``: ``bfloat16``, ``float16`` or ``float32`` (the bias has the same type).
    - ``fast_accum``: FP8 fast accumulation (True) or periodic promotion to fp32 (False).
    - ``arch``: the nvcc target, ``90a`` only (SM100 needs separate tcgen05 instantiations).
    """

    config: str
    epilogue: str = "tensor"
    out_dtype: str = "bfloat16"
    fast_accum: bool = True
    arch: str = "90a"

    #: the kernel source this library compiles and the C ABI version it exports
    source_files: ClassVar[tuple[str, ...]] = SOURCE_FILES
    abi: ClassVar[int] = ABI_VERSION

    def __post_init__(self) -> None:
        if self.config not in CONFIGS:
            raise ValueError(f"unknown CUTLASS config {self.config!r} (known: {', '.join(CONFIGS)})")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {', '.join(EPILOGUES)}, got {self.epilogue!r}")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {', '.join(OUT_DTYPES)}, got {self.out_dtype!r}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(
                f"arch {self.arch!r} is not built by this provider (supported: {', '.join(SUPPORTED_ARCHS)}; "
                "SM100 kernels need separate instantiations)"
            )

    @property
    def name(self) -> str:
        accum = "fast" if self.fast_accum else "precise"
        return f"fp8b_sm{self.arch}_{self.config}_{self.epilogue}_{_OUT_SHORT[self.out_dtype]}_{accum}"

    def defines(self) -> dict[str, str]:
        out = dict(CONFIGS[self.config].defines())
        out["FP8B_EPILOGUE"] = str(EPILOGUES.index(self.epilogue))
        out["FP8B_OUT"] = str(OUT_DTYPES[self.out_dtype])
        out["FP8B_FAST_ACCUM"] = str(int(self.fast_accum))
        out["FP8B_CONFIG_NAME"] = f'"{self.config}"'
        return out

    def describe_expected(self) -> str:
        """What the built library's ``fp8b_describe()`` returns."""
        d = self.defines()
        return (
            f"{self.config};swap={d['FP8B_SWAP_AB']};epilogue={d['FP8B_EPILOGUE']};out={d['FP8B_OUT']};"
            f"fast_accum={d['FP8B_FAST_ACCUM']}"
        )


def _check_arch(arch: str) -> None:
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"arch {arch!r} is not built by this provider (supported: {', '.join(SUPPORTED_ARCHS)}; "
            "SM100 kernels need separate instantiations)"
        )


@dataclass(frozen=True)
class BlockLibrarySpec:
    """One shared library of the block-scaled GEMM: a block config and an output dtype.

    - ``config``: a name from :data:`block_configs.BLOCK_CONFIGS`.
    - ``out_dtype``: ``bfloat16``, ``float16`` or ``float32`` (the bias has the same type).
    - ``arch``: the nvcc target, ``90a`` only.

    There is no accumulation option: the blockwise mainloop promotes every 128-deep K block to fp32 with its scales.
    """

    config: str
    out_dtype: str = "bfloat16"
    arch: str = "90a"

    source_files: ClassVar[tuple[str, ...]] = BLOCK_SOURCE_FILES
    abi: ClassVar[int] = BLOCK_ABI_VERSION

    def __post_init__(self) -> None:
        if self.config not in BLOCK_CONFIGS:
            raise ValueError(f"unknown CUTLASS block config {self.config!r} (known: {', '.join(BLOCK_CONFIGS)})")
        if self.out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {', '.join(OUT_DTYPES)}, got {self.out_dtype!r}")
        _check_arch(self.arch)

    @property
    def name(self) -> str:
        return f"fp8b_sm{self.arch}_{self.config}_{_OUT_SHORT[self.out_dtype]}"

    def defines(self) -> dict[str, str]:
        out = dict(BLOCK_CONFIGS[self.config].defines())
        out["FP8B_OUT"] = str(OUT_DTYPES[self.out_dtype])
        out["FP8B_CONFIG_NAME"] = f'"{self.config}"'
        return out

    def describe_expected(self) -> str:
        """What the built library's ``fp8b_block_describe()`` returns."""
        d = self.defines()
        return f"{self.config};swap={d['FP8B_SWAP_AB']};out={d['FP8B_OUT']}"


#: any library spec this module builds
AnySpec = LibrarySpec | BlockLibrarySpec


def block_specs_for(configs: Iterable[str], out_dtypes: Iterable[str] = ("bfloat16",),
                    arch: str = "90a") -> list[BlockLibrarySpec]:
    """The cross product of block configs and output dtypes, in a stable order."""
    return [BlockLibrarySpec(c, o, arch) for c in configs for o in out_dtypes]


def specs_for(
    configs: Iterable[str],
    epilogues: Iterable[str] = ("tensor",),
    out_dtypes: Iterable[str] = ("bfloat16",),
    fast_accum: Iterable[bool] = (True,),
    arch: str = "90a",
) -> list[LibrarySpec]:
    """The cross product, in a stable order."""
    return [
        LibrarySpec(c, e, o, f, arch)
        for c in configs
        for e in epilogues
        for o in out_dtypes
        for f in fast_accum
    ]


# ---------------------------------------------------------------------------------------------- toolchain
def _is_exe(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _nvidia_wheel_roots() -> list[Path]:
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def find_nvcc() -> str | None:
    """nvcc from ``$CUDA_HOME``/``$CUDA_PATH``, then ``PATH``, then the ``nvidia-cuda-nvcc`` wheel,
    then ``/usr/local/cuda``; ``None`` if there is none."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var, "").strip()
        if root and _is_exe(Path(root) / "bin" / "nvcc"):
            return str(Path(root) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    for root in _nvidia_wheel_roots():
        for cand in sorted(root.glob("*/bin/nvcc")):
            if _is_exe(cand):
                return str(cand)
    return str(DEFAULT_NVCC) if _is_exe(DEFAULT_NVCC) else None


def _wheel_flags(nvcc: str) -> tuple[str, ...]:
    """Include and library folders of the nvidia-* wheels when nvcc itself comes from a wheel (the
    runtime headers and libcudart_static live in other wheels than nvcc's)."""
    roots = _nvidia_wheel_roots()
    if not any(Path(nvcc).resolve().is_relative_to(r.resolve()) for r in roots):
        return ()
    flags: list[str] = []
    for root in roots:
        for inc in sorted(root.glob("*/include")):
            if (inc / "cuda_runtime.h").is_file():
                flags.append(f"-I{inc}")
        for lib in sorted(root.glob("*/lib")):
            if (lib / "libcudart_static.a").is_file():
                flags.append(f"-L{lib}")
    return tuple(flags)


@functools.lru_cache(maxsize=8)
def _nvcc_version_cached(nvcc: str, mtime: float) -> str:
    try:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"cannot run {nvcc} --version: {exc}") from None
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise BuildError(f"{nvcc} --version failed (exit {proc.returncode}): {text.strip()[:300]}")
    match = re.search(r"\bV(\d+\.\d+\.\d+)", text) or re.search(r"release (\d+\.\d+)", text)
    if not match:
        raise BuildError(f"cannot parse the version printed by {nvcc} --version: {text.strip()[:300]}")
    return match.group(1)


def nvcc_version(nvcc: str) -> str:
    """``"13.0.88"`` (runs ``nvcc --version`` once per binary and process)."""
    try:
        mtime = os.stat(nvcc).st_mtime
    except OSError as exc:
        raise BuildError(f"nvcc at {nvcc} is not readable: {exc}") from None
    return _nvcc_version_cached(nvcc, mtime)


def _cutlass_library_roots() -> list[Path]:
    """Folders of the ``cutlass_library`` package (the nvidia-cutlass wheel), found without importing it."""
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


def find_cutlass() -> tuple[Path, Path] | None:
    """``(include, tools/util/include)`` of CUTLASS 3.x/4.x headers: ``$FP8_BACKENDS_CUTLASS_DIR`` (a CUTLASS
    source tree) or the ``nvidia-cutlass`` wheel (``cutlass_library/source``), found without importing it."""
    roots: list[Path] = []
    env = os.environ.get(CUTLASS_DIR_ENV, "").strip()
    if env:
        roots.append(Path(env))
    roots.extend(p / "source" for p in _cutlass_library_roots())
    for root in roots:
        inc, util = root / "include", root / "tools" / "util" / "include"
        if (inc / "cutlass" / "cutlass.h").is_file() and (util / "cutlass" / "util" / "packed_stride.hpp").is_file():
            if env and root != roots[0] and env not in _WARNED_DIRS:  # the user's tree was passed over: say so
                _WARNED_DIRS.add(env)
                logger.warning("%s=%s holds no CUTLASS source tree (include/cutlass/cutlass.h and "
                               "tools/util/include/cutlass/util/packed_stride.hpp): building with the headers in %s",
                               CUTLASS_DIR_ENV, env, root)
            return inc, util
    return None


#: the ``FP8_BACKENDS_CUTLASS_DIR`` values already warned about (once per value and process)
_WARNED_DIRS: set[str] = set()


def cutlass_version(include: Path) -> str:
    """``"4.2.0"`` from ``cutlass/version.h``."""
    try:
        text = (include / "cutlass" / "version.h").read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def source_hash(files: Sequence[str] = SOURCE_FILES) -> str:
    """sha256 over kernel sources shipped in this folder (default: the per-tensor / row-wise kernel's; a spec's own:
    ``source_hash(spec.source_files)``)."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode())
        h.update(b"\0")
        h.update((HERE / name).read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Toolchain:
    """What a build needs: nvcc (and its version) and the CUTLASS headers (and their version)."""

    nvcc: str
    nvcc_version: str
    include: str
    util_include: str
    cutlass_version: str
    extra_flags: tuple[str, ...] = ()


def missing_toolchain_reason() -> str | None:
    """Why nothing can be built here (no subprocess runs), or ``None`` if nvcc and headers are present."""
    if find_nvcc() is None:
        return (
            "nvcc not found (set CUDA_HOME, put nvcc on PATH, or pip install nvidia-cuda-nvcc) and no "
            "prebuilt library"
        )
    if find_cutlass() is None:
        return (
            "CUTLASS headers not found (pip install 'fp8-backends[cutlass]' or set "
            f"{CUTLASS_DIR_ENV} to a CUTLASS source tree) and no prebuilt library"
        )
    return None


def get_toolchain() -> Toolchain:
    """The toolchain for a build, or :class:`BuildError` saying what is missing."""
    nvcc = find_nvcc()
    headers = find_cutlass()
    if nvcc is None or headers is None:
        raise BuildError(missing_toolchain_reason() or "no toolchain")
    inc, util = headers
    return Toolchain(
        nvcc=nvcc,
        nvcc_version=nvcc_version(nvcc),
        include=str(inc),
        util_include=str(util),
        cutlass_version=cutlass_version(inc),
        extra_flags=_wheel_flags(nvcc),
    )


# ---------------------------------------------------------------------------------------------- cache
def cache_dir() -> Path:
    """Where built libraries live (created on first build)."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return settings.cache_dir() / "cutlass"


def key_material(spec: AnySpec, *, src_hash: str, nvcc_ver: str | None, cutlass_ver: str | None) -> dict:
    """Everything a built library depends on; :func:`library_key` hashes it."""
    return {
        "abi": spec.abi,
        "source": src_hash,
        "defines": spec.defines(),
        "flags": list(NVCC_FLAGS),
        "arch": spec.arch,
        "nvcc": nvcc_ver,
        "cutlass": cutlass_ver,
    }


def library_key(spec: AnySpec, *, src_hash: str, nvcc_ver: str, cutlass_ver: str) -> str:
    material = key_material(spec, src_hash=src_hash, nvcc_ver=nvcc_ver, cutlass_ver=cutlass_ver)
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def library_dir(spec: AnySpec, key: str) -> Path:
    return cache_dir() / f"{spec.name}-{key[:16]}"


def library_file(spec: AnySpec, key: str) -> Path:
    return library_dir(spec, key) / f"lib{spec.name}.so"


def find_prebuilt(spec: AnySpec, *, nvcc_ver: str | None = None, cutlass_ver: str | None = None) -> Path | None:
    """A cached library for this source, macros, flags and arch (and the given nvcc / CUTLASS
    versions, where known); reads manifests only, runs nothing."""
    want = key_material(spec, src_hash=source_hash(spec.source_files), nvcc_ver=nvcc_ver, cutlass_ver=cutlass_ver)
    root = cache_dir()
    if not root.is_dir():
        return None
    for manifest in sorted(root.glob(f"{spec.name}-*/manifest.json")):
        try:
            have = json.loads(manifest.read_text(encoding="utf-8"))["material"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if any(have.get(k) != v for k, v in want.items() if v is not None):
            continue
        lib = manifest.parent / f"lib{spec.name}.so"
        if lib.is_file():
            return lib
    return None


def compile_command(spec: AnySpec, tc: Toolchain, output: Path) -> list[str]:
    """The nvcc command line that builds ``spec`` into ``output``."""
    cmd = [tc.nvcc, *NVCC_FLAGS, f"-gencode=arch=compute_{spec.arch},code=sm_{spec.arch}"]
    cmd += [f"-I{tc.include}", f"-I{tc.util_include}", *tc.extra_flags]
    cmd += [f"-D{k}={v}" for k, v in sorted(spec.defines().items())]
    cmd += [str(HERE / spec.source_files[0]), "-o", str(output)]
    return cmd


def _write_atomic(path: Path, text: str) -> None:
    tmp = temp_path(path, thread=True)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def build_library(spec: AnySpec, toolchain: Toolchain | None = None, *, force: bool = False) -> Path:
    """Build ``spec`` unless the cache has it; return the library path.

    Holds a file lock while building so parallel processes build once (the others wait, then find the
    file). A failed compile raises :class:`BuildError` with the path of the compiler's log.
    """
    from filelock import FileLock, Timeout

    tc = toolchain or get_toolchain()
    src_hash = source_hash(spec.source_files)
    key = library_key(spec, src_hash=src_hash, nvcc_ver=tc.nvcc_version, cutlass_ver=tc.cutlass_version)
    folder = library_dir(spec, key)
    lib = library_file(spec, key)
    if lib.is_file() and not force:
        return lib
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(folder) + ".lock")
    try:
        lock.acquire(timeout=LOCK_TIMEOUT_S)
    except Timeout:
        raise BuildError(f"timed out after {LOCK_TIMEOUT_S} s waiting for the build lock {lock.lock_file}") from None
    try:
        if lib.is_file() and not force:
            logger.debug("cutlass: %s was built by another process meanwhile", spec.name)
            return lib
        folder.mkdir(parents=True, exist_ok=True)
        sweep_stale_temps(folder.parent)  # what killed builders left (theirs or other libraries')
        log = folder / "build.log"
        tmp = temp_path(lib)
        cmd = compile_command(spec, tc, tmp)
        logger.info("cutlass: building %s with nvcc %s (about %d s)", spec.name, tc.nvcc_version,
                    SECONDS_PER_LIBRARY)
        start = time.monotonic()
        try:
            rc, out, err = run_compiler(cmd, timeout=BUILD_TIMEOUT_S)  # nvcc dies with this process
        except OSError as exc:
            rc, out, err = -1, "", f"cannot run nvcc: {exc}"
        except BaseException:  # KeyboardInterrupt, SystemExit: the compiler is already killed
            tmp.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the library's folder, unless an earlier build left its log there
                folder.rmdir()
            raise
        seconds = time.monotonic() - start
        log.write_text(
            f"$ {' '.join(cmd)}\n# exit {rc} after {seconds:.1f} s\n# stdout\n{out}\n# stderr\n{err}\n",
            encoding="utf-8",
        )
        if rc != 0 or not tmp.is_file():
            tmp.unlink(missing_ok=True)
            first = next((line for line in err.splitlines() if "error" in line.lower()), err.strip()[:200])
            raise BuildError(f"nvcc failed building {spec.name} (exit {rc}): {first}", str(log))
        manifest = {
            "library": spec.name,
            "key": key,
            "material": key_material(spec, src_hash=src_hash, nvcc_ver=tc.nvcc_version,
                                     cutlass_ver=tc.cutlass_version),
            "nvcc_path": tc.nvcc,
            "build_seconds": round(seconds, 1),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        _write_atomic(folder / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
        os.replace(tmp, lib)
        _status_cache_clear()
        logger.info("cutlass: built %s in %.1f s", spec.name, seconds)
        return lib
    finally:
        lock.release()


def default_jobs(n: int) -> int:
    """Parallel nvcc jobs for ``n`` builds: ``FP8_BACKENDS_BUILD_JOBS`` (an integer >= 1; anything else raises
    :class:`~fp8_backends.core.errors.ConfigurationError`), else the CPU count, never more than ``n``."""

    return max(1, min(n, settings.env_int(JOBS_ENV, os.cpu_count() or 1)))


class _Progress:
    """Logs ``cutlass: building ...: i of n done, s elapsed`` every :data:`PROGRESS_EVERY_S` seconds while a
    parallel build runs (a daemon thread; :meth:`close` stops it)."""

    def __init__(self, total: int, what: str, every: float | None = None) -> None:
        self.total, self.what = total, what
        self.every = PROGRESS_EVERY_S if every is None else every
        self.done = 0
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fp8b-cutlass-build-progress", daemon=True)
        self._thread.start()

    def finished_one(self) -> None:
        with self._lock:
            self.done += 1

    def line(self) -> str:
        with self._lock:
            done = self.done
        return (f"cutlass: building {self.what}: {done} of {self.total} done, "
                f"{time.monotonic() - self.start:.0f} s elapsed")

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            logger.info("%s", self.line())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


def build_many(
    specs: Sequence[AnySpec], *, jobs: int | None = None, force: bool = False
) -> dict[AnySpec, Path | BuildError]:
    """Build several libraries in parallel (one nvcc per job); failures are returned, not raised. While nvcc runs,
    a progress line is logged (INFO) every :data:`PROGRESS_EVERY_S` seconds."""
    specs = list(dict.fromkeys(specs))
    if not specs:
        return {}
    tc = get_toolchain()
    jobs = jobs or default_jobs(len(specs))
    progress = _Progress(len(specs), specs[0].name if len(specs) == 1 else f"{len(specs)} libraries")

    def one(spec: AnySpec) -> Path | BuildError:
        try:
            return build_library(spec, tc, force=force)
        except BuildError as exc:
            return exc
        finally:
            progress.finished_one()

    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            results = list(pool.map(one, specs))
    finally:
        progress.close()
    _status_cache_clear()
    return dict(zip(specs, results))


# ---------------------------------------------------------------------------------------------- loading
class KernelLibrary:
    """A loaded library: ``gemm`` and ``workspace_size`` with their ctypes signatures set."""

    def __init__(self, spec: LibrarySpec, path: Path) -> None:
        self.spec = spec
        self.path = Path(path)
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise BuildError(f"cannot load {self.path}: {exc}") from None
        lib.fp8b_abi_version.restype = ctypes.c_int
        lib.fp8b_abi_version.argtypes = []
        lib.fp8b_describe.restype = ctypes.c_char_p
        lib.fp8b_describe.argtypes = []
        abi = lib.fp8b_abi_version()
        if abi != ABI_VERSION:
            raise BuildError(f"{self.path} has ABI {abi}, this package needs {ABI_VERSION}; rebuild it")
        desc = lib.fp8b_describe().decode()
        if desc != spec.describe_expected():
            raise BuildError(f"{self.path} describes itself as {desc!r}, expected {spec.describe_expected()!r}")
        lib.fp8b_gemm.argtypes = list(GEMM_ARGTYPES)
        lib.fp8b_gemm.restype = GEMM_RESTYPE
        lib.fp8b_workspace_size.argtypes = list(WORKSPACE_ARGTYPES)
        lib.fp8b_workspace_size.restype = WORKSPACE_RESTYPE
        self._lib = lib
        self.gemm = lib.fp8b_gemm
        self.workspace_size = lib.fp8b_workspace_size


class BlockKernelLibrary:
    """A loaded block-scaled library: ``gemm`` (``fp8b_block_gemm``) and ``workspace_size`` with their ctypes
    signatures set, and ``act_scale_tma`` (the kernel loads the activation scales with TMA: they need the padded
    M-major layout), checked against what the config predicts."""

    def __init__(self, spec: BlockLibrarySpec, path: Path) -> None:
        self.spec = spec
        self.path = Path(path)
        try:
            lib = ctypes.CDLL(str(self.path))
        except OSError as exc:
            raise BuildError(f"cannot load {self.path}: {exc}") from None
        try:
            version, describe = lib.fp8b_block_abi_version, lib.fp8b_block_describe
        except AttributeError:
            raise BuildError(f"{self.path} is not a block-scaled GEMM library (no fp8b_block_* entry points)") from None
        version.restype, version.argtypes = ctypes.c_int, []
        describe.restype, describe.argtypes = ctypes.c_char_p, []
        abi = version()
        if abi != BLOCK_ABI_VERSION:
            raise BuildError(f"{self.path} has block ABI {abi}, this package needs {BLOCK_ABI_VERSION}; rebuild it")
        desc = describe().decode()
        if desc != spec.describe_expected():
            raise BuildError(f"{self.path} describes itself as {desc!r}, expected {spec.describe_expected()!r}")
        lib.fp8b_block_act_scale_tma.restype, lib.fp8b_block_act_scale_tma.argtypes = ctypes.c_int, []
        self.act_scale_tma = bool(lib.fp8b_block_act_scale_tma())
        expected = BLOCK_CONFIGS[spec.config].act_scale_tma
        if self.act_scale_tma != expected:
            raise BuildError(f"{self.path} loads activation scales by {'TMA' if self.act_scale_tma else 'cp.async'}, "
                             f"block_configs.py predicts {'TMA' if expected else 'cp.async'}")
        lib.fp8b_block_gemm.argtypes = list(BLOCK_GEMM_ARGTYPES)
        lib.fp8b_block_gemm.restype = GEMM_RESTYPE
        lib.fp8b_block_workspace_size.argtypes = list(WORKSPACE_ARGTYPES)
        lib.fp8b_block_workspace_size.restype = WORKSPACE_RESTYPE
        self._lib = lib
        self.gemm = lib.fp8b_block_gemm
        self.workspace_size = lib.fp8b_block_workspace_size


AnyLibrary = KernelLibrary | BlockKernelLibrary


def open_library(spec: AnySpec, path: Path) -> AnyLibrary:
    """Load the library at ``path`` built for ``spec`` (checks its ABI and self-description)."""
    if isinstance(spec, BlockLibrarySpec):
        return BlockKernelLibrary(spec, path)
    return KernelLibrary(spec, path)


_loaded: dict[AnySpec, AnyLibrary] = {}
_failed: dict[AnySpec, BuildError] = {}
_load_lock = threading.RLock()


def locate(spec: AnySpec) -> Path | None:
    """The cached library for ``spec`` if there is one (with the local nvcc's version when nvcc is here)."""
    nvcc = find_nvcc()
    headers = find_cutlass()
    if nvcc is not None and headers is not None:
        try:
            tc = get_toolchain()
        except BuildError:
            return find_prebuilt(spec)
        key = library_key(spec, src_hash=source_hash(spec.source_files), nvcc_ver=tc.nvcc_version,
                          cutlass_ver=tc.cutlass_version)
        lib = library_file(spec, key)
        return lib if lib.is_file() else None
    return find_prebuilt(spec, cutlass_ver=cutlass_version(headers[0]) if headers else None)


def get_library(spec: AnySpec, also: Iterable[AnySpec] = ()) -> AnyLibrary:
    """The loaded library for ``spec``, building it first if needed (and, in the same parallel build,
    the missing ones among ``also``: the other configs ``auto`` may pick). A build here (first use) is announced at
    WARNING level with its estimate and how to build ahead, and logs progress while it runs.

    Raises :class:`BuildError` (also for a build that failed earlier in this process).
    """
    lib = _loaded.get(spec)
    if lib is not None:
        return lib
    with _load_lock:
        lib = _loaded.get(spec)
        if lib is not None:
            return lib
        if spec in _failed:
            raise _failed[spec]
        try:
            path = locate(spec)
            if path is None:
                if missing_toolchain_reason() is not None:
                    raise BuildError(missing_toolchain_reason() or "no toolchain")
                wanted = [spec] + [s for s in also if s != spec and s not in _loaded and locate(s) is None]
                _announce_first_use_build(wanted)
                start = time.monotonic()
                results = build_many(wanted)
                ok = sum(not isinstance(r, BuildError) for r in results.values())
                logger.warning("cutlass: first-use build finished: %d of %d libraries built in %.0f s", ok,
                               len(results), time.monotonic() - start)
                for s, result in results.items():
                    if isinstance(result, BuildError):
                        _failed[s] = result
                result = results[spec]
                if isinstance(result, BuildError):
                    raise result
                path = result
            lib = open_library(spec, path)
        except BuildError as exc:
            _failed[spec] = exc
            _status_cache_clear()
            raise
        _loaded[spec] = lib
        _status_cache_clear()
        return lib


def _announce_first_use_build(specs: Sequence[AnySpec]) -> None:
    jobs = default_jobs(len(specs))
    names = ", ".join(s.name for s in specs[:4]) + (f" and {len(specs) - 4} more" if len(specs) > 4 else "")
    logger.warning(
        "cutlass: building %d kernel librar%s at first use with nvcc (%s; about %d s with %d parallel job%s; "
        "cached in %s afterwards; build ahead with: python -m fp8_backends.build cutlass)",
        len(specs), "y" if len(specs) == 1 else "ies", names, estimate_seconds(len(specs), jobs), jobs,
        "" if jobs == 1 else "s", cache_dir(),
    )


def loaded(spec: AnySpec) -> AnyLibrary | None:
    """The library for ``spec`` if this process has loaded it (no build, no file system access)."""
    return _loaded.get(spec)


def loaded_libraries() -> dict[AnySpec, AnyLibrary]:
    return dict(_loaded)


def failures() -> dict[AnySpec, BuildError]:
    """Builds that failed in this process (they are not retried until :func:`forget_failures`)."""
    return dict(_failed)


def forget_failures() -> None:
    _failed.clear()
    _status_cache_clear()


# ---------------------------------------------------------------------------------------------- status
@dataclass(frozen=True)
class BuildStatus:
    """What :meth:`CutlassSm90Backend.availability` reports; computed without running anything."""

    ok: bool
    reason: str
    built: int = 0
    missing: list[str] = field(default_factory=list)
    estimate_s: int = 0


def estimate_seconds(n_libraries: int, jobs: int | None = None) -> int:
    if n_libraries <= 0:
        return 0
    jobs = jobs or default_jobs(n_libraries)
    return int(math.ceil(n_libraries / jobs) * SECONDS_PER_LIBRARY)


@functools.lru_cache(maxsize=4)
def _status(specs: tuple[AnySpec, ...]) -> BuildStatus:
    kinds = {type(s) for s in specs}
    failed = [(s, e) for s, e in _failed.items() if type(s) in kinds]  # a block build's failure spares the rest
    if failed:
        spec, err = failed[0]
        return BuildStatus(False, f"build of {spec.name} failed: {err}")
    built, missing = 0, []
    for spec in specs:
        if spec in _loaded or find_prebuilt(spec) is not None:
            built += 1
        else:
            missing.append(spec.name)
    if not missing:
        return BuildStatus(True, "", built=built)
    reason = missing_toolchain_reason()
    if reason is not None:
        return BuildStatus(False, reason, built=built, missing=missing)
    est = estimate_seconds(len(missing))
    return BuildStatus(
        True,
        f"not built yet ({len(missing)} of {len(specs)} default kernels missing); builds on first use "
        f"(~{est} s) or run python -m fp8_backends.build cutlass",
        built=built,
        missing=missing,
        estimate_s=est,
    )


def status(specs: Iterable[AnySpec]) -> BuildStatus:
    """Built / buildable / unavailable for ``specs``; reads the cache folder and PATH, runs nothing."""
    return _status(tuple(specs))


def _status_cache_clear() -> None:
    _status.cache_clear()


__all__ = [
    "ABI_VERSION",
    "BLOCK_ABI_VERSION",
    "BlockKernelLibrary",
    "BlockLibrarySpec",
    "BuildStatus",
    "KernelLibrary",
    "LibrarySpec",
    "Toolchain",
    "build_library",
    "block_specs_for",
    "build_many",
    "cache_dir",
    "compile_command",
    "find_cutlass",
    "find_nvcc",
    "find_prebuilt",
    "get_library",
    "get_toolchain",
    "library_key",
    "loaded",
    "locate",
    "nvcc_version",
    "open_library",
    "source_hash",
    "specs_for",
    "status",
]
