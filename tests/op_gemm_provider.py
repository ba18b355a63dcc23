"""Two GEMM providers built on :class:`fp8_backends.OpGemmBackend`, for ``test_op_backends.py`` (import-light: their
ops live in :mod:`op_gemm_ops`, imported by ``load_op``).

- :class:`CustomOpGemm`: the op is a ``torch.library.custom_op`` (how a third party writes one), the bias fused
  (passed to the op), an option as the op's trailing argument;
- :class:`LibraryOpGemm`: the op is defined with :class:`fp8_backends.core.oplib.LazyOps` (a ``Library`` fragment, the
  eager fast path), the bias added after the op, per-token scales read with unit stride (``contiguous_vectors``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fp8_backends import (
    ActScale,
    BiasMode,
    DeviceKind,
    GemmCapabilities,
    OpGemmBackend,
    OutDtype,
    WeightScale,
)

OP_DIST = "op-test-plugin"


class CustomOpGemm(OpGemmBackend):
    """The reference GEMM through a ``torch.library.custom_op``; option ``compute`` is the op's last argument."""

    name: ClassVar[str] = "op_custom_gemm"
    options: ClassVar[dict[str, tuple[str, ...]]] = {"compute": ("float32", "float64")}
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU}), act_scales=frozenset(ActScale), weight_scales=frozenset(WeightScale),
        out_dtypes=frozenset(OutDtype), bias=BiasMode.FUSED, priority=-5)
    loads: ClassVar[list[str]] = []  # load_op calls, for the tests

    def load_op(self) -> Any:
        from op_gemm_ops import custom_gemm

        self.loads.append(self.name)
        return custom_gemm

    def op_arguments(self) -> tuple[str]:
        return (self.config["compute"],)


class LibraryOpGemm(OpGemmBackend):
    """The reference GEMM through an op of :mod:`fp8_backends.core.oplib`; bias added after, contiguous vectors."""

    name: ClassVar[str] = "op_library_gemm"
    contiguous_vectors: ClassVar[bool] = True
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
        devices=frozenset({DeviceKind.CPU}), act_scales=frozenset(ActScale), weight_scales=frozenset(WeightScale),
        out_dtypes=frozenset(OutDtype), bias=BiasMode.ADDED_AFTER, priority=-5)

    def load_op(self) -> Any:
        from op_gemm_ops import library_op

        return library_op()
