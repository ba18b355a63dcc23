"""The platform record: what a problem runs on (one CUDA device, real or simulated, or the CPU), as the provider
contract's checks read it (:meth:`~fp8_backends.core.backend.ProviderBase.supports`,
:meth:`~fp8_backends.core.capabilities.Capabilities.check`). Detecting it is the registry's
(:mod:`fp8_backends.registry.platform`: ``detect_platform``, ``list_platforms``, ``simulate_platform``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import DeviceKind


@dataclass(frozen=True)
class Platform:
    """One device a problem can run on.

    ``sm`` is ``(major, minor)`` for CUDA devices and ``None`` for the CPU. Every SM >= 9.0 part
    also runs its arch-specific target (``sm_90a``, ``sm_100a``, ...), reported by ``arch``.
    """

    kind: DeviceKind
    name: str
    sm: tuple[int, int] | None = None
    device_index: int | None = None
    simulated: bool = False
    multiprocessors: int | None = None
    driver_version: str | None = None
    cuda_runtime_version: str | None = None
    library_versions: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_cuda(self) -> bool:
        return self.kind is DeviceKind.CUDA

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch needs SM >= 9.0."""
        return self.sm is not None and self.sm >= (9, 0)

    @property
    def arch(self) -> str:
        """``"9.0a"`` style: major.minor plus ``a`` where an arch-specific target exists; ``"cpu"`` for the CPU and
        ``"none"`` for a CUDA platform without a device (one asked for on a machine that has none)."""
        if self.sm is None:
            return "cpu" if self.kind is DeviceKind.CPU else "none"
        return f"{self.sm[0]}.{self.sm[1]}{'a' if self.sm >= (9, 0) else ''}"

    @property
    def torch_device(self) -> str:
        if self.kind is DeviceKind.CPU:
            return "cpu"
        return "cuda" if self.device_index is None else f"cuda:{self.device_index}"

    def describe(self) -> str:
        if self.kind is DeviceKind.CPU:
            return "CPU"
        extra = " (simulated)" if self.simulated else ""
        idx = "" if self.device_index is None else f"cuda:{self.device_index} "
        if self.sm is None:  # no device: its name says so, and there is no SM to give
            return f"{idx}{self.name}{extra}"
        return f"{idx}{self.name}, SM {self.arch}{extra}"


__all__ = ["Platform"]
