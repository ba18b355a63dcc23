"""The CUTLASS provider's C++ ops: ``fp8_backends::cutlass_sm90_gemm_native``, ``cutlass_sm90_linear_native`` and
``cutlass_sm90_block_gemm_native``.

The Python op (:mod:`.ops`) is opaque to ``torch.compile``, so its body runs at every call of a compiled graph:
config pick, output allocation, a ctypes call, ~10 µs of Python on a fast host and several times that on a slow one.
``native_op.cu`` does the same work in C++ behind the dispatcher. It serves the kernels Python registered here
(:func:`NativeOp.register_kernel`, :func:`NativeOp.register_buckets`; :func:`.ops._run` does it whenever it loads a
library) and hands any call it cannot serve to the Python op (a shape or bucket not registered yet, an unaligned
pointer, a non-zero return code), which builds or loads the library, registers it and raises the library's own
exceptions. Same arguments, same result, same errors; the first call of each (N, K) goes through Python.

The block-scaled op, ``cutlass_sm90_block_gemm_native(x, w, x_scale, w_scale, bias, out_dtype, config)``, is the C++
body of :mod:`.block_ops`' op (1x128 activation groups x 128x128 weight blocks) on the same terms: it serves the
block libraries and block-table buckets Python registered (:meth:`NativeOp.register_block_kernel`,
:meth:`NativeOp.register_block_buckets`; :func:`.block_ops._run` does it) when the operands are what the kernels read
as they are (row-major, 16-byte aligned, activation scales M-major in the layout the config loads), and hands the
rest to the Python op, which copies a scale layout the kernel cannot read and raises the library's errors.

The fused op, ``cutlass_sm90_linear_native(x, w, w_scale, input_scale, bias, out_dtype, mode, config, fast_accum)``,
takes the unquantized activation and quantizes it in its own kernels (static, dynamic per-tensor or per-token: the
formulas of :mod:`fp8_backends.core.reference`, correctly rounded division, NaN kept) before the same GEMM: a
processed layer's eager call is then one dispatcher call
(:meth:`~fp8_backends.providers.cutlass.backend.CutlassSm90Backend.fused_quant_gemm_impl`).
Its block-scaled twin, ``cutlass_sm90_block_linear_native(x, w, w_scale, bias, out_dtype, config)``, quantizes per
token in groups of 128 (:func:`fp8_backends.core.reference.quantize_groups`' formulas, one kernel launched from C++)
into the M-major scale layout the block kernels read, then runs the block GEMM: what an eager layer and a compiled one
(:meth:`~fp8_backends.providers.cutlass.backend.CutlassSm90Backend.traced_fused_quant_gemm_impl`) call for block
weights, one dispatcher call where quantize + GEMM launched the group quantization from Python first.

The shared library is compiled at first use (27-30 s with nvcc on the H200 host, ~5 s for the CPU build here; once
per torch version and source, cached beside the CUTLASS builds):

- ``cuda``: ``nvcc`` against torch's headers (SM 9.0 code for the quantization kernels), linked to ``c10_cuda``
  (the current stream, the device guard);
- ``cpu-test``: the host ``c++`` compiler, registered for CPU tensors with a null stream and the quantization through
  ATen ops, for the CPU tests only (a process loads one of the two: they define the same ops).

A missing compiler or headers, or a failed build, leaves the provider on its Python op with the reason logged once
(:func:`status`); ``FP8_BACKENDS_CUTLASS_NATIVE=0`` does so on purpose.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fp8_backends.core import settings

logger = logging.getLogger("fp8_backends")

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "native_op.cu"
OP_NAME = "fp8_backends::cutlass_sm90_gemm_native"
ABI_VERSION = 5
LINEAR_OP_NAME = "fp8_backends::cutlass_sm90_linear_native"
BLOCK_OP_NAME = "fp8_backends::cutlass_sm90_block_gemm_native"
BLOCK_LINEAR_OP_NAME = "fp8_backends::cutlass_sm90_block_linear_native"
VARIANTS = ("cuda", "cpu-test")
_BUILD_TIMEOUT_S = 600
#: CUDA's own half/bfloat16 operators off, as torch's extensions build: torch's c10::Half / c10::BFloat16 convert
_NO_CUDA_HALF_OPERATORS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                           "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__")


class NativeBuildError(RuntimeError):
    """The C++ op could not be compiled or loaded (the message carries the compiler's output)."""


def enabled() -> bool:
    """``FP8_BACKENDS_CUTLASS_NATIVE`` (default on)."""
    return settings.env_flag(settings.CUTLASS_NATIVE_ENV, True)


def _torch_paths() -> tuple[Path, Path]:
    import torch

    root = Path(torch.__file__).resolve().parent
    return root / "include", root / "lib"


def _compiler(variant: str) -> list[str]:
    if variant == "cuda":
        from . import build

        nvcc = build.find_nvcc()
        if nvcc is None:
            raise NativeBuildError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
        return [nvcc, "-Xcompiler", "-fPIC", "-gencode=arch=compute_90,code=sm_90", "--expt-relaxed-constexpr",
                *_NO_CUDA_HALF_OPERATORS, *build._wheel_flags(nvcc)]
    cxx = os.environ.get("CXX", "").strip() or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise NativeBuildError("no C++ compiler found (set CXX or put c++ on PATH)")
    return [cxx, "-fPIC", "-x", "c++"]


def _compiler_version(cmd: Sequence[str]) -> str:
    try:
        proc = subprocess.run([cmd[0], "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeBuildError(f"cannot run {cmd[0]} --version: {exc}") from None
    return (proc.stdout or proc.stderr).strip().splitlines()[-1 if "nvcc" in cmd[0] else 0][:200]


def compile_command(variant: str, output: Path) -> list[str]:
    """The command line that builds ``variant`` into ``output``."""
    import torch

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    include, lib = _torch_paths()
    cmd = _compiler(variant)
    cmd += ["-O2", "-std=c++20", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    cmd += [f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}"]
    if variant == "cpu-test":
        cmd += ["-DFP8B_CPU_TEST"]
    cmd += [str(SOURCE), "-o", str(output)]
    # libraries after the source (linkers that drop unused libraries read them in order)
    cmd += [f"-L{lib}", "-lc10", "-ltorch_cpu", *(["-lc10_cuda"] if variant == "cuda" else [])]
    return cmd


def library_path(variant: str) -> tuple[Path, list[str]]:
    """Where ``variant``'s library lives for this source, torch and compiler, and the command that builds it."""
    import torch

    from . import build

    probe = compile_command(variant, Path("OUT"))
    material = {
        "abi": ABI_VERSION,
        "source": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "torch": torch.__version__,
        "command": [c for c in probe[1:] if c != "OUT"],
        "compiler": _compiler_version(probe),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    out = build.cache_dir() / f"native-{variant}-{key}" / "libfp8b_cutlass_native.so"
    return out, compile_command(variant, out)


def build_library(variant: str) -> Path:
    """Compile ``variant`` unless the cache has it; return the library's path (:class:`NativeBuildError` on failure)."""
    out, cmd = library_path(variant)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    cmd[cmd.index("-o") + 1] = str(tmp)
    logger.info("fp8_backends: compiling the cutlass provider's C++ op (%s, once per torch version)", variant)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(f"{' '.join(cmd[:1])}: {exc}") from None
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        log = out.parent / "build.log"
        log.write_text(" ".join(cmd) + "\n\n" + proc.stdout + proc.stderr, encoding="utf-8")
        raise NativeBuildError(f"compiling {SOURCE.name} failed (exit {proc.returncode}); log: {log}")
    os.replace(tmp, out)
    return out


class NativeOp:
    """The loaded C++ op: :attr:`op` (its OpOverload) and the functions that tell it what it may serve."""

    def __init__(self, path: Path, variant: str) -> None:
        import torch

        self.path = path
        self.variant = variant
        torch.ops.load_library(str(path))
        lib = ctypes.CDLL(str(path))
        lib.fp8b_native_abi_version.restype = ctypes.c_int
        if lib.fp8b_native_abi_version() != ABI_VERSION:
            raise NativeBuildError(f"{path}: ABI {lib.fp8b_native_abi_version()}, expected {ABI_VERSION}")
        lib.fp8b_native_register_kernel.argtypes = (ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
        lib.fp8b_native_register_kernel.restype = ctypes.c_int
        lib.fp8b_native_register_buckets.argtypes = (
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(ctypes.c_char_p))
        lib.fp8b_native_register_buckets.restype = None
        lib.fp8b_native_set_fallback.argtypes = (ctypes.c_char_p,)
        lib.fp8b_native_set_fallback.restype = None
        lib.fp8b_native_register_block_kernel.argtypes = (
            ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
        lib.fp8b_native_register_block_kernel.restype = ctypes.c_int
        lib.fp8b_native_register_block_buckets.argtypes = lib.fp8b_native_register_buckets.argtypes
        lib.fp8b_native_register_block_buckets.restype = None
        lib.fp8b_native_set_block_fallback.argtypes = (ctypes.c_char_p,)
        lib.fp8b_native_set_block_fallback.restype = None
        lib.fp8b_native_reset.restype = None
        lib.fp8b_native_calls.restype = ctypes.c_int64
        lib.fp8b_native_fallback_calls.restype = ctypes.c_int64
        self._lib = lib
        self._registered: set[tuple[Any, ...]] = set()
        self._lock = threading.Lock()
        self.op = torch.ops.fp8_backends.cutlass_sm90_gemm_native.default
        #: ``(x [M, K] bf16/fp16/fp32, w, w_scale, input_scale, bias, out_dtype, mode, config, fast_accum) -> [M, N]``
        self.linear_op = torch.ops.fp8_backends.cutlass_sm90_linear_native.default
        #: ``(x [M, K] e4m3, w [N, K] e4m3, x_scale [M, ceil(K/128)], w_scale [ceil(N/128), ceil(K/128)], bias,
        #: out_dtype, config) -> [M, N]``: the block-scaled GEMM (:mod:`.block_ops`)
        self.block_op = torch.ops.fp8_backends.cutlass_sm90_block_gemm_native.default
        #: ``(x [M, K] bf16/fp16/fp32 (any strides), w [N, K] e4m3, w_scale [ceil(N/128), ceil(K/128)], bias, out_dtype,
        #: config) -> [M, N]``: per-token-group quantization (groups of 128) + the block-scaled GEMM, one call
        self.block_linear_op = torch.ops.fp8_backends.cutlass_sm90_block_linear_native.default

    def register_kernel(self, key: str, gemm_fn: int, workspace_fn: int | None, stream_k: bool) -> None:
        """Serve ``key`` (``config|epilogue|out_dtype|fast_accum``: epilogue ``tensor``/``rowwise``, out_dtype
        ``bfloat16``/``float16``/``float32``, fast_accum ``1``/``0``) with these function addresses (``fp8b_gemm``,
        ``fp8b_workspace_size``). A key of another form raises ``ValueError``."""
        if self._lib.fp8b_native_register_kernel(key.encode(), gemm_fn, workspace_fn, int(stream_k)) != 0:
            raise ValueError(f"not a kernel key (config|tensor or rowwise|bfloat16, float16 or float32|0 or 1): {key}")

    def register_block_kernel(self, key: str, gemm_fn: int, workspace_fn: int | None, stream_k: bool,
                              act_scale_tma: bool) -> None:
        """Serve the block-scaled ``key`` (``config|out_dtype``, out_dtype ``bfloat16``/``float16``/``float32``) with
        these function addresses (``fp8b_block_gemm``, ``fp8b_block_workspace_size``); ``act_scale_tma``: the kernel
        loads the activation scales with TMA (column stride a multiple of 4, 16-byte aligned, padded rows). A key of
        another form raises ``ValueError``."""
        if self._lib.fp8b_native_register_block_kernel(key.encode(), gemm_fn, workspace_fn, int(stream_k),
                                                       int(act_scale_tma)) != 0:
            raise ValueError(f"not a block kernel key (config|bfloat16, float16 or float32): {key}")

    @staticmethod
    def _bucket_arrays(buckets: Sequence[tuple[int | None, str]]) -> tuple[int, Any, Any]:
        names = [name for _, name in buckets]
        bounds = [int(b) for b, _ in buckets[:-1]]  # type: ignore[arg-type]
        if not names or any(later <= earlier for earlier, later in zip(bounds, bounds[1:])):
            raise ValueError(f"buckets must be non-empty with ascending bounds, got {buckets!r}")
        arr_b = (ctypes.c_int64 * max(1, len(bounds)))(*bounds)
        arr_n = (ctypes.c_char_p * len(names))(*(name.encode() for name in names))
        return len(names), arr_b, arr_n

    def register_buckets(self, n: int, k: int, buckets: Sequence[tuple[int | None, str]]) -> None:
        """The ``config=auto`` M buckets of ``N x K``: ``(inclusive M bound, config)``, the last bound ignored."""
        arrays = self._bucket_arrays(buckets)
        self._lib.fp8b_native_register_buckets(n, k, *arrays)

    def register_block_buckets(self, n: int, k: int, buckets: Sequence[tuple[int | None, str]]) -> None:
        """The block op's ``config=auto`` M buckets of ``N x K`` (as :meth:`register_buckets`, block configs)."""
        arrays = self._bucket_arrays(buckets)
        self._lib.fp8b_native_register_block_buckets(n, k, *arrays)

    def note(self, what: tuple[Any, ...], register: Any) -> None:
        """Run ``register()`` once per ``what`` (the Python op calls this on every miss: registering is idempotent,
        this only skips repeats)."""
        if what in self._registered:
            return
        with self._lock:
            if what not in self._registered:
                register()
                self._registered.add(what)

    def set_fallback(self, op_name: str) -> None:
        self._lib.fp8b_native_set_fallback(op_name.encode())

    def set_block_fallback(self, op_name: str) -> None:
        self._lib.fp8b_native_set_block_fallback(op_name.encode())

    def reset(self) -> None:
        """Forget every registration (the next call of each shape goes through the fallback op again)."""
        with self._lock:
            self._lib.fp8b_native_reset()
            self._registered.clear()

    def calls(self) -> tuple[int, int]:
        """``(calls served in C++, calls handed to the fallback op)`` since the library loaded."""
        return int(self._lib.fp8b_native_calls()), int(self._lib.fp8b_native_fallback_calls())


_loaded: NativeOp | None = None
_failure: str | None = None
_load_lock = threading.Lock()
_fake_lib: Any = None
_warned = False  # try_load's failure is logged once per process


def load(variant: str = "cuda") -> NativeOp:
    """Build (if needed) and load ``variant`` once per process; :class:`NativeBuildError` if it cannot."""
    global _loaded, _failure, _fake_lib
    with _load_lock:
        if _loaded is not None:
            if _loaded.variant != variant:
                raise NativeBuildError(f"this process loaded the {_loaded.variant} C++ op; {variant} cannot load too")
            return _loaded
        if _failure is not None:
            raise NativeBuildError(_failure)
        try:
            native = NativeOp(build_library(variant), variant)
        except (NativeBuildError, OSError, RuntimeError) as exc:
            _failure = str(exc)
            raise NativeBuildError(_failure) from None
        import torch

        from fp8_backends.core.oplib import gemm_fake

        _fake_lib = torch.library.Library("fp8_backends", "FRAGMENT")
        torch.library.register_fake(OP_NAME, gemm_fake, lib=_fake_lib)
        torch.library.register_fake(LINEAR_OP_NAME, _linear_fake, lib=_fake_lib)
        torch.library.register_fake(BLOCK_OP_NAME, gemm_fake, lib=_fake_lib)
        torch.library.register_fake(BLOCK_LINEAR_OP_NAME, _linear_fake, lib=_fake_lib)
        _loaded = native
        return native


def _linear_fake(x: Any, w: Any, *operands: Any) -> Any:
    """Both fused ops' output: ``[M, N]`` in the ``out_dtype`` argument (the first ScalarType operand)."""
    import torch

    out_dtype = next(a for a in operands if isinstance(a, torch.dtype))
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


def loaded() -> NativeOp | None:
    """The loaded C++ op, if any (never builds)."""
    return _loaded


def try_load() -> NativeOp | None:
    """:func:`load` of the ``cuda`` variant, or ``None`` (disabled, or it failed: the reason is logged once)."""
    global _warned
    if not enabled():
        return None
    try:
        return load("cuda")
    except NativeBuildError as exc:
        if not _warned:
            _warned = True
            logger.warning("fp8_backends: the cutlass provider runs on its Python op (slower to call): %s", exc)
        return None


def expected() -> bool:
    """Whether the C++ op serves (or will at load time): enabled, no failed build or load in this process, and loaded
    already or a compiler to build it (nvcc). Cheap, runs nothing: the resolution's host-cost model asks it."""
    if not enabled() or _failure is not None:
        return False
    if _loaded is not None:
        return True
    from . import build

    return build.find_nvcc() is not None


def status() -> str:
    """One line for listings and logs (runs nothing): how calls reach the kernels here."""
    if _loaded is not None:
        return f"calls through its C++ op ({_loaded.path})"
    if _failure is not None:
        return f"calls through its Python op (the C++ op failed: {_failure})"
    try:
        on = enabled()
    except ValueError as exc:  # a malformed variable: the provider says so where it loads
        return f"calls through its Python op ({exc})"
    if not on:
        return f"calls through its Python op ({settings.CUTLASS_NATIVE_ENV}=0)"
    return "calls through its C++ op (built at first use)"


def register_loaded(native: NativeOp, libraries: Iterable[tuple[Any, Any]], stream_k_of: Any) -> None:
    """Register every ``(LibrarySpec, KernelLibrary)`` pair with ``native`` (once each)."""
    for spec, lib in libraries:
        key = f"{spec.config}|{spec.epilogue}|{spec.out_dtype}|{int(spec.fast_accum)}"

        def register(key: str = key, lib: Any = lib, spec: Any = spec) -> None:
            gemm = ctypes.cast(lib.gemm, ctypes.c_void_p).value
            ws = ctypes.cast(lib.workspace_size, ctypes.c_void_p).value
            native.register_kernel(key, gemm, ws, bool(stream_k_of(spec.config)))

        native.note(("kernel", key, id(lib)), register)


def register_loaded_block(native: NativeOp, spec: Any, lib: Any, stream_k: bool) -> None:
    """Register one ``(BlockLibrarySpec, BlockKernelLibrary)`` with ``native`` (once)."""
    key = f"{spec.config}|{spec.out_dtype}"

    def register() -> None:
        gemm = ctypes.cast(lib.gemm, ctypes.c_void_p).value
        ws = ctypes.cast(lib.workspace_size, ctypes.c_void_p).value
        native.register_block_kernel(key, gemm, ws, stream_k, lib.act_scale_tma)

    native.note(("block kernel", key, id(lib)), register)


__all__ = [
    "BLOCK_LINEAR_OP_NAME", "BLOCK_OP_NAME", "LINEAR_OP_NAME", "OP_NAME", "NativeBuildError", "NativeOp",
    "build_library", "compile_command",
    "enabled", "expected", "load", "loaded", "register_loaded", "register_loaded_block", "status", "try_load",
]
