"""pytest plugin of the conformance kit: ``pytest -p fp8_backends.testing.plugin``.

- registers the ``gpu`` marker the kit's GPU tests carry (they also skip themselves without a CUDA device);
- adds ``--fp8-provider DIST:NAME`` (repeatable): :mod:`fp8_backends.testing.conformance` runs both
  contracts against each named provider (a name may be registered as a GEMM and as a norm-quant provider).

Import-light: loading the plugin imports neither torch nor the registry.
"""

from __future__ import annotations

import pytest

OPTION = "--fp8-provider"
_requested: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fp8_backends", "fp8-backends conformance kit")
    group.addoption(OPTION, action="append", default=[], metavar="DIST:NAME",
                    help="a registered provider to run the conformance kit against (repeatable; options may "
                         "follow @, e.g. fp8-backends:triton@config=auto)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (the fp8_backends kit skips it where none is visible)")
    _requested[:] = list(config.getoption(OPTION, default=None) or [])


def requested_providers() -> list[str]:
    """The ``--fp8-provider`` values of this pytest run (empty without the plugin or the option)."""
    return list(_requested)
