"""``fp8_backends.testing``: the conformance kit every provider is tested with.

Subclass a contract in a test module of your provider package and say how to make the provider::

    # tests/test_conformance.py
    from fp8_backends.testing import GemmProviderContract, NormQuantProviderContract


    class TestMyGemm(GemmProviderContract):
        def make_provider(self):
            from my_fp8_kernels.provider import MyGemmBackend

            return MyGemmBackend()


    class TestMyNormQuant(NormQuantProviderContract):
        provider_spec = "my-fp8-kernels:my_norm"      # or build it from the registry by DIST:NAME

Or run the kit against any registered provider without writing a test file::

    python -m fp8_backends.testing my-fp8-kernels:my_gemm [pytest options]

The contracts check what the provider declares (see :mod:`.gemm` and :mod:`.norm_quant`; tolerances in
:mod:`.compare`). Tests that need a GPU carry the ``gpu`` marker and skip where no CUDA device is visible;
``-p fp8_backends.testing.plugin`` (or ``pytest_plugins = ["fp8_backends.testing.plugin"]`` in a
``conftest.py``) registers that marker. This package needs pytest; nothing in ``fp8_backends`` imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8_backends import _lazy_exports

_EXPORTS = {
    "GemmProviderContract": "fp8_backends.testing.gemm",
    "NormQuantProviderContract": "fp8_backends.testing.norm_quant",
    "assert_codes_close": "fp8_backends.testing.compare",
    "assert_gemm_close": "fp8_backends.testing.compare",
    "assert_residual_close": "fp8_backends.testing.compare",
    "assert_scales_close": "fp8_backends.testing.compare",
    "provider_from_spec": "fp8_backends.testing._base",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = _lazy_exports(globals(), _EXPORTS)


if TYPE_CHECKING:
    from ._base import provider_from_spec
    from .compare import assert_codes_close, assert_gemm_close, assert_residual_close, assert_scales_close
    from .gemm import GemmProviderContract
    from .norm_quant import NormQuantProviderContract
