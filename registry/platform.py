"""What a problem runs on: one CUDA device (real or simulated) or the CPU.

Detection never imports torch unless torch is already imported: it asks the CUDA driver through
cuda-python, so ``python -m fp8_backends.list`` stays fast. On a machine without a driver it
reports no CUDA devices. ``simulate_platform("10.0")`` (or ``FP8_BACKENDS_SIMULATE_SM``) lets a
user ask what would run on another GPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import re
import sys
from dataclasses import dataclass

from fp8_backends.core import backend, settings
from fp8_backends.core.errors import ConfigurationError, InvalidInputError, InvalidTypeError
from fp8_backends.core.platform import Platform
from fp8_backends.core.types import DeviceKind

logger = logging.getLogger("fp8_backends")

# distributions whose versions key tuning data and appear in the listing
TRACKED_DISTRIBUTIONS = (
    "fp8-backends",
    "torch",
    "triton",
    "flashinfer-python",
    "nvidia-cutlass",
    "cuda-python",
    "stevedore",
)


def parse_sm(text: str) -> tuple[int, int]:
    """Parse ``"9.0"``, ``"9.0a"``, ``"sm_90a"``, ``"90"``, ``"10.0"``, ``"100"`` into ``(major, minor)``;
    anything else raises :class:`~fp8_backends.core.errors.InvalidInputError`."""
    if not isinstance(text, str):
        raise InvalidTypeError(f"an SM version is a string such as '9.0', got {type(text).__name__} {text!r}")
    raw = text.strip().lower().removeprefix("sm_").removeprefix("sm").rstrip("af")
    match = re.fullmatch(r"(\d+)\.(\d)", raw)
    if match:
        return int(match.group(1)), int(match.group(2))
    match = re.fullmatch(r"(\d+)(\d)", raw)
    if match:
        return int(match.group(1)), int(match.group(2))
    raise InvalidInputError(f"cannot parse SM version {text!r} (expected e.g. 9.0, 10.0, sm_90a)")


def library_versions() -> dict[str, str]:
    """Installed versions of the distributions that matter, without importing them. Read once per process
    (package metadata scans cost milliseconds; resolution asks on every call); :func:`_reset_cache` forgets."""
    return dict(_library_versions())


@functools.lru_cache(maxsize=1)
def _library_versions() -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {}
    for dist in TRACKED_DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return tuple(out.items())


def _torch_cuda_version() -> str | None:
    """torch's CUDA runtime version, read from torch/version.py when torch is not imported yet."""
    if "torch" in sys.modules:
        return getattr(sys.modules["torch"].version, "cuda", None)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(f"{folder}/version.py", encoding="utf-8") as f:
                match = re.search(r"^cuda(?::\s*\S+)?\s*=\s*['\"]([^'\"]+)['\"]", f.read(), re.M)
        except OSError:
            continue
        return match.group(1) if match else None
    return None


def cpu_platform() -> Platform:
    return Platform(kind=DeviceKind.CPU, name="CPU", library_versions=library_versions())


def simulate_platform(sm: str | tuple[int, int], name: str | None = None) -> Platform:
    """A CUDA platform that does not exist here: ``simulate_platform("10.0")`` asks what would run on SM 10.0."""
    if isinstance(sm, str):
        major_minor = parse_sm(sm)
    elif (isinstance(sm, tuple) and len(sm) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in sm)
          and sm[0] >= 0 and sm[1] >= 0):
        major_minor = (int(sm[0]), int(sm[1]))
    else:
        raise InvalidTypeError(f"simulate_platform needs an SM as '9.0' or (9, 0), got {type(sm).__name__} {sm!r}")
    if name is not None and not isinstance(name, str):
        raise InvalidTypeError(f"simulate_platform's name must be a string, got {type(name).__name__}")
    return Platform(
        kind=DeviceKind.CUDA,
        name=name or f"simulated SM {major_minor[0]}.{major_minor[1]}",
        sm=major_minor,
        simulated=True,
        library_versions=library_versions(),
    )


@dataclass(frozen=True)
class _CudaDevice:
    index: int
    name: str
    sm: tuple[int, int]
    multiprocessors: int | None


def _query_driver() -> tuple[list[_CudaDevice], str | None]:
    """Devices and driver version through cuda-python's driver API; ([], None) without a driver."""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        return _query_torch()
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # cuda-python not installed: ask torch instead
        logger.debug("cuda-python unavailable (%s); asking torch", exc)
        return _query_torch()
    except Exception as exc:  # cuda-python present but no driver library: no CUDA devices
        logger.debug("no CUDA driver (%s)", exc)
        return [], None
    try:
        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            logger.debug("cuInit failed: %s", err)
            return [], None
        err, version = cu.cuDriverGetVersion()
        driver = f"{version // 1000}.{(version % 1000) // 10}" if err == cu.CUresult.CUDA_SUCCESS else None
        err, count = cu.cuDeviceGetCount()
        devices = []
        attr = cu.CUdevice_attribute
        for index in range(count if err == cu.CUresult.CUDA_SUCCESS else 0):
            _, dev = cu.cuDeviceGet(index)
            _, raw_name = cu.cuDeviceGetName(256, dev)
            _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
            _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
            _, sms = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
            name = bytes(raw_name).split(b"\0", 1)[0].decode(errors="replace")
            devices.append(_CudaDevice(index, name, (int(major), int(minor)), int(sms)))
        return devices, driver
    except Exception as exc:
        logger.debug("CUDA driver query failed (%s)", exc)
        return [], None


def _query_torch() -> tuple[list[_CudaDevice], str | None]:
    if importlib.util.find_spec("torch") is None:
        return [], None
    import torch

    if not torch.cuda.is_available():
        return [], None
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(_CudaDevice(index, props.name, (props.major, props.minor), props.multi_processor_count))
    return devices, _driver_version()


def _driver_version() -> str | None:
    """The CUDA driver API version (``"13.0"``) through cuda-python, or None; the same value whether or
    not torch was imported first (tuned lockfiles are keyed by it)."""
    try:
        from cuda.bindings import driver as cu

        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        err, version = cu.cuDriverGetVersion()
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
        return f"{version // 1000}.{(version % 1000) // 10}"
    except Exception:
        return None


@functools.lru_cache(maxsize=1)
def _cuda_devices() -> tuple[tuple[_CudaDevice, ...], str | None]:
    devices, driver = _query_driver()
    return tuple(devices), driver


def list_platforms() -> list[Platform]:
    """Every real CUDA device here (a host can mix GPUs), or ``[cpu_platform()]`` if there are none."""
    devices, driver = _cuda_devices()
    if not devices:
        return [cpu_platform()]
    versions = library_versions()
    runtime = _torch_cuda_version()
    return [
        Platform(
            kind=DeviceKind.CUDA,
            name=d.name,
            sm=d.sm,
            device_index=d.index,
            multiprocessors=d.multiprocessors,
            driver_version=driver,
            cuda_runtime_version=runtime,
            library_versions=versions,
        )
        for d in devices
    ]


def detect_platform(device: object = None, *, simulate: str | None = None) -> Platform:
    """The platform for ``device`` (``None`` = current CUDA device or the CPU; ``"cpu"``; ``"cuda:1"``;
    an int; a ``torch.device``). ``simulate`` (or ``FP8_BACKENDS_SIMULATE_SM``) overrides CUDA detection."""
    kind, index = _parse_device(device)
    if kind is DeviceKind.CPU:
        return cpu_platform()
    if simulate:
        return simulate_platform(simulate)
    sim = settings.simulated_sm()
    if sim:
        try:
            return simulate_platform(sim)
        except InvalidInputError:
            raise ConfigurationError(settings.SIMULATE_SM_ENV, sim, "an SM version such as 9.0, 10.0 or sm_90a "
                                     "(unset or empty: the real device)") from None
    platforms = [p for p in list_platforms() if p.is_cuda]
    if not platforms:
        if kind is DeviceKind.CUDA and device is not None:
            # a CUDA device was asked for explicitly: describe it as absent rather than as a CPU
            return Platform(kind=DeviceKind.CUDA, name="no CUDA device", library_versions=library_versions())
        return cpu_platform()
    if index is None:
        index = _current_cuda_index()
    for p in platforms:
        if p.device_index == index:
            return p
    raise InvalidInputError(f"no CUDA device with index {index} (found {len(platforms)})")


def _current_cuda_index() -> int:
    if "torch" in sys.modules:
        try:
            return int(sys.modules["torch"].cuda.current_device())
        except Exception:
            return 0
    return 0


def _parse_device(device: object) -> tuple[DeviceKind | None, int | None]:
    if device is None:
        return None, None
    if isinstance(device, bool) or (isinstance(device, int) and device < 0):
        raise InvalidInputError(f"unsupported device {device!r} (expected cpu, cuda, cuda:N or a device index >= 0)")
    if isinstance(device, int):
        return DeviceKind.CUDA, device
    if isinstance(device, DeviceKind):
        return device, None
    if not isinstance(device, str) and type(device).__name__ != "device":  # a str or a torch.device
        raise InvalidTypeError(f"a device is 'cpu', 'cuda', 'cuda:N', an index or a torch.device, got "
                               f"{type(device).__name__} {device!r}")
    text = str(device)
    kind, sep, idx = text.partition(":")
    dk = DeviceKind._value2member_map_.get(kind)
    if dk is None or (sep and not (dk is DeviceKind.CUDA and idx.isdigit())):
        raise InvalidInputError(f"unsupported device {device!r} (expected cpu, cuda or cuda:N)")
    return dk, int(idx) if idx else None


def _reset_cache() -> None:
    """For tests: forget the detected devices and library versions."""
    _cuda_devices.cache_clear()
    _library_versions.cache_clear()


backend.set_platform_detector(detect_platform)  # what a provider's supports() uses when given no platform
