"""What the ``flashinfer_block`` provider knows about flashinfer's block-scaled FP8 GEMM without importing torch.

flashinfer 0.7's ``fp8_blockscale_gemm_sm90`` is TensorRT-LLM's DeepGEMM integration, built in two stages:

1. **The module** ``fp8_blockscale_gemm_90`` (flashinfer's JIT spec ``gen_fp8_blockscale_gemm_sm90_module``): a
   tvm-ffi library compiled with nvcc through ninja from the sources in :data:`MODULE_SOURCES`, about 130 s the
   first time on an H200 box, then cached in flashinfer's JIT folder (``$FLASHINFER_WORKSPACE_BASE/.cache/
   flashinfer/<version>/<archs>/cached_ops``, ``~`` by default). :func:`build_module` builds and loads it, logged,
   with a progress line on a terminal.
2. **One DeepGEMM kernel per shape and tile config**, compiled by the module at the first call that needs it: nvcc
   (``$TRTLLM_DG_NVCC_COMPILER``, else ``$CUDA_HOME/bin/nvcc``, else ``nvcc`` on the ``PATH``) on a few lines that
   instantiate DeepGEMM's kernel template from the headers under ``data/csrc/nv_internal/tensorrt_llm/deep_gemm``;
   the cubin is cached on disk in ``$TRTLLM_DG_CACHE_DIR/cache`` (default ``~/.tensorrt_llm/cache``, see
   :func:`kernel_cache_dir`) and in memory per process. The kernel is specialised on ``N``, ``K`` and a tile config
   chosen from ``M``, ``N``, ``K`` and the GPU's SM count (:func:`kernel_config`), so a new ``M`` may need a new
   kernel: M < 32 runs the swap-AB family (weights as the MMA's M side), whose config is the same for every
   M <= 16 and usually for every M < 32; M >= 32 runs the normal family, whose ``BLOCK_N`` follows the wave count.

:func:`kernel_config` states the config rule of flashinfer 0.7's ``deep_gemm::jit::get_best_gemm_config``
(``jit_utils.cuh``) as the provider's own code: it tells which kernels a set of ``M`` values needs (warm-up,
``python -m fp8_backends.build flashinfer_block``), whether a CUDA-graph capture would compile one (refused), and
what the first-call logs say. :data:`CONFIG_RULE_VERSIONS` are the flashinfer versions it was read from; on
others the provider relies on the exact shapes it has run instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from . import common

logger = logging.getLogger("fp8_backends")

#: the sources of flashinfer's fp8_blockscale_gemm_90 module, relative to ``flashinfer/data/csrc``
MODULE_SOURCES: tuple[str, ...] = (
    "nv_internal/tensorrt_llm/kernels/cutlass_kernels/fp8_blockscale_gemm/fp8_blockscale_gemm.cu",
    "fp8_blockscale_gemm_sm90_binding.cu",
    "fused_moe/cutlass_backend/deepgemm_jit_setup.cu",
    "nv_internal/cpp/common/envUtils.cpp",
    "nv_internal/cpp/common/logger.cpp",
    "nv_internal/cpp/common/stringUtils.cpp",
    "nv_internal/cpp/common/tllmException.cpp",
    "nv_internal/cpp/common/memoryUtils.cu",
)
#: the folder DeepGEMM's per-shape kernels include their headers from (``deep_gemm/...``), relative to ``data/csrc``
DEEPGEMM_INCLUDE = "nv_internal/tensorrt_llm"
#: the headers each per-shape kernel includes (relative to :data:`DEEPGEMM_INCLUDE`)
DEEPGEMM_HEADERS: tuple[str, ...] = ("deep_gemm/fp8_gemm_impl.cuh", "deep_gemm/nvrtc_cutlass.cuh",
                                     "deep_gemm/nvrtc_std.cuh")
MODULE_NAME = "fp8_blockscale_gemm_90"
#: the first-build time quoted in the log (measured on the H200 box, 2026-12-02)
MODULE_BUILD_SECONDS = 130

#: the kernels' shape rules: K in whole 128-column blocks (the MMA's K tile and the scale groups), N in 64s
K_MULTIPLE = 128
N_MULTIPLE = 64
#: below this M the module runs the swap-AB kernel family
SWAP_AB_BELOW = 32
#: flashinfer versions whose DeepGEMM config rule :func:`kernel_config` states
CONFIG_RULE_VERSIONS: tuple[str, ...] = ("0.7.",)

_BLOCK_K = 128
_SM90_SMEM_BYTES = 232448  # what get_best_gemm_config allows per block (227 KiB)


# ----------------------------------------------------------------------------------------- files and tools
def csrc_dir() -> Path | None:
    """flashinfer's ``data/csrc`` folder, found without importing flashinfer (``None`` when not installed)."""
    spec = common._find_spec("flashinfer")
    locations = list(getattr(spec, "submodule_search_locations", None) or [])
    if not locations:
        return None
    return Path(locations[0]) / "data" / "csrc"


def missing_sources() -> list[str]:
    """The module sources and DeepGEMM headers this flashinfer install lacks (``[]`` when all are there)."""
    root = csrc_dir()
    if root is None:
        return ["flashinfer/data/csrc"]
    wanted = [*MODULE_SOURCES, *(f"{DEEPGEMM_INCLUDE}/{h}" for h in DEEPGEMM_HEADERS)]
    return [rel for rel in wanted if not (root / rel).is_file()]


def find_nvcc() -> str | None:
    """The nvcc DeepGEMM's kernel compiler runs: ``$TRTLLM_DG_NVCC_COMPILER``, else ``$CUDA_HOME/bin/nvcc``, else
    ``nvcc`` on the ``PATH`` (``None`` when none of them exists)."""
    explicit = os.environ.get("TRTLLM_DG_NVCC_COMPILER")
    if explicit:
        return explicit if (Path(explicit).is_file() or shutil.which(explicit)) else None
    home = os.environ.get("CUDA_HOME")
    if home:
        path = Path(home) / "bin" / "nvcc"
        return str(path) if path.is_file() else None
    return shutil.which("nvcc")


def kernel_cache_dir() -> Path:
    """Where DeepGEMM's compiler caches the per-shape cubins: ``$TRTLLM_DG_CACHE_DIR/cache``, else
    ``$HOME/.tensorrt_llm/cache``, else ``<temp>/tensorrt_llm/cache``."""
    base = os.environ.get("TRTLLM_DG_CACHE_DIR")
    if base:
        return Path(base) / "cache"
    home = os.environ.get("HOME")
    return (Path(home) / ".tensorrt_llm" if home else Path(tempfile.gettempdir()) / "tensorrt_llm") / "cache"


def feature_reason(module: Any) -> str | None:
    """Why the imported flashinfer ``module`` cannot serve the provider (``None``: it can): it must have
    ``flashinfer.gemm.fp8_blockscale_gemm_sm90`` and the JIT spec ``gen_fp8_blockscale_gemm_sm90_module``."""
    gemm = getattr(module, "gemm", None)
    if gemm is None or not hasattr(gemm, "fp8_blockscale_gemm_sm90"):
        return (f"this flashinfer ({common.flashinfer_version()}) has no flashinfer.gemm.fp8_blockscale_gemm_sm90 "
                "(it came with flashinfer 0.6)")
    try:
        from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module  # noqa: F401
    except Exception as exc:  # ImportError, or a JIT environment error
        return f"flashinfer.jit.gemm.gen_fp8_blockscale_gemm_sm90_module is not importable ({type(exc).__name__}: " \
               f"{exc})"
    return None


#: the flashinfer release that brought ``flashinfer.gemm.fp8_blockscale_gemm_sm90`` and its JIT spec
FEATURE_SINCE = (0, 6)


def version_reason(version: str | None) -> str | None:
    """Why the installed flashinfer distribution (``version``, read from its metadata) cannot have the block-scaled GEMM
    (``None``: its version can). The check of a process where flashinfer is not imported yet: the exact one
    (:func:`feature_reason`) imports flashinfer (1.3-1.5 s after torch, byte-compiled) and runs where the module is
    loaded."""
    if not version:
        return None  # installed without metadata (a source tree on the path): the exact check decides at load
    release = re.match(r"(\d+)(?:\.(\d+))?", version.strip())  # PEP 440's release segment: "0.8rc1" is 0.8
    if release is None:
        return None  # not a version this check can read: the exact check decides at load
    if (int(release.group(1)), int(release.group(2) or 0)) < FEATURE_SINCE:
        return (f"this flashinfer ({version}) has no flashinfer.gemm.fp8_blockscale_gemm_sm90 (it came with flashinfer "
                f"{FEATURE_SINCE[0]}.{FEATURE_SINCE[1]})")
    return None


def built_library_may_exist() -> bool:
    """Whether a built ``fp8_blockscale_gemm_90`` library may exist, looked up without importing flashinfer: False
    only when none is in flashinfer's JIT cache (``$FLASHINFER_WORKSPACE_BASE`` or the home folder, then
    ``.cache/flashinfer/<version>/<archs>/cached_ops/``) nor among the install's AOT modules (``data/aot``) and no
    AOT kernel package (``flashinfer_jit_cache``) is installed. True means: ask flashinfer's spec (imports it)."""
    if common._find_spec("flashinfer_jit_cache") is not None:
        return True
    base = Path(os.environ.get("FLASHINFER_WORKSPACE_BASE") or Path.home()) / ".cache" / "flashinfer"
    if next(base.glob(f"*/*/cached_ops/{MODULE_NAME}/{MODULE_NAME}.so"), None) is not None:
        return True
    root = csrc_dir()
    return root is not None and next((root.parent / "aot" / MODULE_NAME).glob("*.so"), None) is not None


def config_rule_known(version: str | None) -> bool:
    """Whether :func:`kernel_config` states this flashinfer version's config rule."""
    return bool(version) and any(version.startswith(v) for v in CONFIG_RULE_VERSIONS)


def shape_reasons(n: int, k: int) -> list[str]:
    """Why the kernels cannot serve a weight ``[N, K]`` (``[]``: they can)."""
    reasons = []
    if k % K_MULTIPLE:
        reasons.append(f"K={k} is not a multiple of {K_MULTIPLE} (flashinfer's fp8_blockscale_gemm_sm90 / DeepGEMM "
                       f"kernels take whole 128-wide K blocks)")
    if n % N_MULTIPLE:
        reasons.append(f"N={n} is not a multiple of {N_MULTIPLE} (flashinfer's fp8_blockscale_gemm_sm90 needs "
                       f"N % {N_MULTIPLE} == 0)")
    return reasons


# ----------------------------------------------------------------------------------------- kernel configs
class KernelConfig(NamedTuple):
    """One DeepGEMM kernel's tile config (what its JIT compile is specialised on, besides N and K).

    ``swap_ab``: the swap-AB family (M < 32: the weight's N is the MMA's M side, ``block_m`` tiles N and
    ``block_n`` tiles the tokens); else ``block_m`` tiles the tokens and ``block_n`` tiles N."""

    swap_ab: bool
    block_m: int
    block_n: int
    stages: int
    multicast: int
    smem_bytes: int

    def describe(self) -> str:
        family = "swap-AB" if self.swap_ab else "normal"
        return (f"{family} {self.block_m}x{self.block_n} tile, {self.stages} stages"
                f"{', 2-CTA multicast' if self.multicast > 1 else ''}")


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _smem_bytes(stages: int, k: int, block_m: int, block_n: int, swap_ab: bool) -> int:
    """Shared memory of one kernel: output tile, ``stages`` x (A, B and the per-stage scale slices), the K-long
    scale vector of the side read whole, barriers."""
    kb = _ceil(k, _BLOCK_K)
    out_tile = block_m * block_n * 2
    barriers = stages * 16
    a_stage, b_stage = block_m * _BLOCK_K, block_n * _BLOCK_K
    if swap_ab:  # per stage: the tokens' scales padded to 128 bytes; whole: the weight's K scales
        token_scales = _ceil(block_n * 4, 128) * 128
        return out_tile + stages * (a_stage + b_stage + token_scales) + _ceil(kb * 4, 8) * 8 + barriers
    whole = kb * 4 * (1 if _BLOCK_K % block_n == 0 else 2)
    return out_tile + stages * (a_stage + b_stage + block_m * 4) + _ceil(whole, 8) * 8 + barriers


def kernel_config(m: int, n: int, k: int, num_sms: int) -> KernelConfig:
    """The DeepGEMM kernel config flashinfer 0.7 picks for ``M x N x K`` on a GPU with ``num_sms`` SMs.

    The tile that needs the fewest waves of ``num_sms`` blocks wins, a fuller last wave breaking ties, the narrower
    ``BLOCK_N`` (16 to 128 in steps of 8) breaking the rest; ``BLOCK_M`` is 64 when the tiled extent is at most 64,
    else 128. Then the most pipeline stages (8 down to 4; 6 down to 4 when 128 is not a multiple of ``BLOCK_N``) that
    fit in shared memory, and 2-CTA TMA multicast for M >= 1024 when N splits evenly. M < 32 tiles the weight's N as
    the MMA's M side (swap-AB)."""
    swap = m < SWAP_AB_BELOW
    rows, cols = (n, m) if swap else (m, n)
    block_m = 64 if rows <= 64 else 128
    best_n = best_waves = best_util = 0
    for block_n in range(16, 129, 8):
        tiles = _ceil(rows, block_m) * _ceil(cols, block_n)
        waves = _ceil(tiles, num_sms)
        util = tiles % num_sms or num_sms
        if not best_n or waves < best_waves or (waves == best_waves and util > best_util):
            best_n, best_waves, best_util = block_n, waves, util
    stages = smem = 0
    for candidate in ((8, 7, 6, 5, 4) if _BLOCK_K % best_n == 0 else (6, 5, 4)):
        size = _smem_bytes(candidate, k, block_m, best_n, swap)
        if size <= _SM90_SMEM_BYTES:
            stages, smem = candidate, size
            break
    multicast = 1
    if not swap and m >= 1024 and n % (2 * best_n) == 0 and num_sms % 2 == 0:
        multicast = 2
    return KernelConfig(swap, block_m, best_n, stages, multicast, smem)


def kernel_name(config: KernelConfig, n: int, k: int) -> str:
    """The folder DeepGEMM's compiler caches this kernel's cubin under (in :func:`kernel_cache_dir`)."""
    prefix = "gemm_swapAB_" if config.swap_ab else "gemm_"
    s = config.stages
    # the compiler's own name: block_k, groups (1), stages, then groups and stages again, multicast, GEMM type
    return f"{prefix}{n}_{k}_{config.block_m}_{config.block_n}_{_BLOCK_K}_1_{s}1_{s}_{config.multicast}_Normal"


def kernel_cached_on_disk(config: KernelConfig, n: int, k: int) -> bool:
    """Whether a cubin for this kernel is in DeepGEMM's disk cache (a later process loads it without nvcc)."""
    return (kernel_cache_dir() / kernel_name(config, n, k) / "nvcc_kernel.cubin").is_file()


def configs_for(ms: Iterable[int], n: int, k: int, num_sms: int) -> dict[KernelConfig, int]:
    """The distinct kernels the ``M`` values ``ms`` need for a weight ``[N, K]``: ``{config: first M needing it}``."""
    out: dict[KernelConfig, int] = {}
    for m in ms:
        out.setdefault(kernel_config(m, n, k, num_sms), m)
    return out


def decode_ms() -> range:
    """The ``M`` values of the swap-AB family (1 to 31): the decode batch sizes, warmed at ``prepare_weight``."""
    return range(1, SWAP_AB_BELOW)


def parse_ms(text: str) -> list[int]:
    """``"1-31,64,128-256"`` -> the listed ``M`` values (ranges inclusive); raises ``ValueError``."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 1 or last < first:
            raise ValueError(f"bad M range {part!r} (use M or FIRST-LAST with 1 <= FIRST <= LAST)")
        out.extend(range(first, last + 1))
    if not out:
        raise ValueError("no M given")
    return out


# ----------------------------------------------------------------------------------------- the module build
@contextlib.contextmanager
def progress_line(desc: str) -> Iterator[None]:
    """A tqdm line on stderr showing the time spent in the block (a terminal only: tqdm switches itself off when
    stderr is not one), refreshed every second from a helper thread."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency; a trimmed install still builds, without the line
        yield
        return
    bar = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}", file=sys.stderr, disable=None, leave=False)
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(1.0):
            bar.refresh()

    thread = threading.Thread(target=tick, name="fp8_backends-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        bar.close()


def module_spec() -> Any:
    """flashinfer's JIT spec of the module (imports flashinfer)."""
    from flashinfer.jit.gemm import gen_fp8_blockscale_gemm_sm90_module

    return gen_fp8_blockscale_gemm_sm90_module()


def module_state(spec: Any) -> tuple[bool, Path]:
    """``(already built, the folder it is built in)`` for the module's JIT spec."""
    try:
        built = bool(getattr(spec, "is_aot", False) or spec.is_compiled)
    except Exception:  # an older spec without the properties: assume a build
        built = False
    folder = getattr(spec, "build_dir", None)
    return built, Path(folder) if folder is not None else Path(str(spec.get_library_path())).parent


def build_module(*, load: bool = True) -> Any:
    """Build flashinfer's ``fp8_blockscale_gemm_90`` module if it is not built yet, and load it (``load=False``:
    build only, e.g. on a machine without a GPU; returns ``None``). Logged at INFO before and after a build; a
    terminal also shows the elapsed time while it runs. Imports flashinfer."""
    import time

    spec = module_spec()
    built, folder = module_state(spec)
    if built:
        return spec.build_and_load() if load else None
    logger.info("building flashinfer's fp8_blockscale_gemm_sm90 module (about %d minutes on an H200; cached in %s)",
                round(MODULE_BUILD_SECONDS / 60), folder)
    start = time.monotonic()
    with progress_line("building flashinfer fp8_blockscale_gemm_sm90"):
        if load:
            module = spec.build_and_load()
        else:
            spec.build(need_lock=True)
            module = None
    logger.info("built flashinfer's fp8_blockscale_gemm_sm90 module in %.0f s (%s)", time.monotonic() - start,
                folder)
    return module


__all__ = [
    "CONFIG_RULE_VERSIONS", "DEEPGEMM_HEADERS", "DEEPGEMM_INCLUDE", "FEATURE_SINCE", "K_MULTIPLE", "MODULE_SOURCES",
    "N_MULTIPLE", "SWAP_AB_BELOW", "KernelConfig", "build_module", "built_library_may_exist", "config_rule_known",
    "configs_for", "csrc_dir", "decode_ms", "feature_reason", "find_nvcc", "kernel_cache_dir", "kernel_cached_on_disk",
    "kernel_config", "kernel_name", "missing_sources", "module_spec", "module_state", "parse_ms", "progress_line",
    "shape_reasons", "version_reason",
]
