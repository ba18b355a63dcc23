"""What the tests of the Triton block-wise kernels and providers share (``tests/test_triton_block_gemm.py``,
``tests/test_triton_block_provider.py``, ``tests/test_triton_group_quant.py``, ``tests/test_triton_norm_dynamic.py``).

- :data:`ON_GPU` / :data:`DEVICE`: where the tensors of a test live (``cuda`` when torch sees a GPU, else ``cpu`` for
  Triton's interpreter, which conftest.py turns on without a GPU);
- :data:`needs_kernels`: the skip mark of a test that launches a kernel;
- :func:`relerr`: the relative Frobenius error against a reference;
- :func:`fp8_ordinal`: fp8 codes as signed step counts, to measure how many representable steps apart two codes are.

Import it after ``pytest.importorskip("torch")`` and ``pytest.importorskip("triton")``: it imports both.
"""

from __future__ import annotations

import pytest
import torch

from fp8_backends.providers.triton import _support

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
needs_kernels = pytest.mark.skipif(
    not ON_GPU and not _support.interpreting(), reason="needs a GPU or TRITON_INTERPRET=1 (conftest sets it)"
)


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a - b‖ / ‖b‖`` in fp32 (``‖b‖`` clamped away from zero)."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fp8_ordinal(q: torch.Tensor) -> torch.Tensor:
    """The fp8 codes of ``q`` (e4m3fn or e5m2) as int16 ordinals: sign-magnitude to signed, so that neighbouring
    representable values differ by one."""
    b = q.view(torch.uint8).to(torch.int16)
    mag = b & 0x7F
    return torch.where(b >= 0x80, -mag, mag)
