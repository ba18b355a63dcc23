"""Shared test setup.

- ``@pytest.mark.gpu`` tests are skipped (with a reason) where torch sees no CUDA device.
- ``@pytest.mark.build`` tests compile CUDA code; they run only with ``--run-build`` (CI runs them once).
- Every test starts with fresh registry caches and no fp8_backends environment variables.
- Helper modules beside the tests (``fake_provider``) are importable by name.
- ``fuzz_cases(label, n)`` counts fuzzed problems (tests/test_fuzz.py), ``view_cases(label, n)`` fuzzed strided
  inputs (tests/test_fuzz_views.py); the session ends with one line per label of each.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from fp8_backends.core import settings

# shared test helpers (fake_provider.py) import as top-level modules: --import-mode=importlib puts no test folder
# on sys.path
sys.path.insert(0, str(Path(__file__).parent))
# the benchmarks some tests run import each other as ``bench.*``: the repository root is appended (the installed
# fp8_backends keeps precedence over the source tree)
if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent.parent))

# tests/data holds test subjects (a plugin distribution with its own tests, the kit's deliberately broken
# providers): other tests run them in subprocesses with the right sys.path
collect_ignore_glob = ["data/*"]

#: what the library's environment variables select (settings.ENV_VARS); the setup ones (folders, headers, nvcc jobs)
#: keep the developer's values
ENV_VARS = tuple(var.name for var in settings.ENV_VARS if not var.setup)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-build", action="store_true", help="run tests marked build (nvcc compiles)")


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def _use_triton_interpreter() -> None:
    """Without a GPU, run the Triton providers' kernels on Triton's CPU interpreter. Set before any
    kernel is defined (``triton.jit`` reads it then); an explicit TRITON_INTERPRET wins."""
    if "TRITON_INTERPRET" not in os.environ and importlib.util.find_spec("triton") and not _has_cuda():
        os.environ["TRITON_INTERPRET"] = "1"


_use_triton_interpreter()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _has_cuda()
    run_build = config.getoption("--run-build")
    for item in items:
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible to torch)"))
        if "build" in item.keywords and not run_build:
            item.add_marker(pytest.mark.skip(reason="compiles CUDA code; pass --run-build"))


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch: pytest.MonkeyPatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    # a developer's own tuned lockfile must not steer `auto` in tests (tests that use one set their own)
    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", "off")
    from fp8_backends.registry import discovery, resolution

    discovery.refresh()
    resolution.reset_caches()
    yield
    discovery.refresh()
    resolution.reset_caches()


@pytest.fixture(autouse=True)
def _restore_grad_mode():
    """The benchmarks' ``main()`` s turn autograd off for their process: a test that runs one leaves it on."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and not torch.is_grad_enabled():
        torch.set_grad_enabled(True)


_FUZZ_CASES: dict[str, int] = {}
_VIEW_CASES: dict[str, int] = {}


@pytest.fixture
def fresh_selection_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """``auto`` with no lockfile, no shipped-data override, nothing disabled, no objective variable and its caches
    (shipped data, lockfile, resolution) empty before and after the test."""
    from fp8_backends.registry import lockfile, resolution, shipped

    monkeypatch.setenv("FP8_BACKENDS_LOCKFILE", str(tmp_path / "no-lockfile.json"))
    for var in ("FP8_BACKENDS_SHIPPED", "FP8_BACKENDS_DISABLED", settings.SELECTION_OBJECTIVE_ENV):
        monkeypatch.delenv(var, raising=False)
    shipped.reset_state()
    lockfile.reset_state()
    resolution.reset_caches()
    yield
    shipped.reset_state()
    lockfile.reset_state()


def _counter(totals: dict[str, int]):
    def count(label: str, n: int) -> None:
        totals[label] = totals.get(label, 0) + n

    return count


@pytest.fixture
def fuzz_cases():
    """``count(label, n)``: add ``n`` fuzzed problems to ``label``'s total (reported at the end of the session)."""
    return _counter(_FUZZ_CASES)


@pytest.fixture
def view_cases():
    """``count(label, n)``: add ``n`` fuzzed strided inputs to ``label``'s total (reported at the end of the
    session, apart from the problems)."""
    return _counter(_VIEW_CASES)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    seed = os.environ.get("FP8_FUZZ_SEED", "20261130")
    for title, totals in (("fuzz cases", _FUZZ_CASES), ("view cases", _VIEW_CASES)):
        if totals:
            terminalreporter.section(f"{title} (FP8_FUZZ_SEED={seed})")
            for label, n in sorted(totals.items()):
                terminalreporter.write_line(f"{label}: {n} cases")


PLUGIN_SRC = __import__("pathlib").Path(__file__).parent / "data" / "thirdparty_plugin"


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> str:
    """pip-install the test plugin distribution into a fresh folder; returns that folder."""
    import subprocess
    import sys

    target = tmp_path_factory.mktemp("plugin_site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(PLUGIN_SRC)],
        check=True,
    )
    return str(target)


@pytest.fixture
def thirdparty_plugin(plugin_site: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Put the installed test plugin on sys.path for one test (and rescan entry points)."""
    import sys

    from fp8_backends.registry import discovery

    monkeypatch.syspath_prepend(plugin_site)
    discovery.refresh()
    yield plugin_site
    sys.modules.pop("fp8_backends_testplugin.toy", None)
    discovery.refresh()


@pytest.fixture(scope="module")
def exact_interpreter_casts():
    """Make Triton's interpreter convert floats as the GPU does (round to nearest even, correct carries
    into the exponent) by routing its private ``_convert_float`` helper through torch's casts (the
    interpreter's own truncates fp32 -> bf16 and mis-rounds some fp32 -> fp8: ../shared/notes/cpu-ci.md).
    Kernel tests that compare codes exactly use it; it fails loudly if a triton upgrade renames the hook."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import inspect

    import numpy as np
    import torch
    from triton.runtime import interpreter

    torch_types = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                   "fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
    uints = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}
    original = getattr(interpreter, "_convert_float", None)
    params = list(inspect.signature(original).parameters) if original is not None else []
    if params != ["input", "input_dtype", "output_dtype", "rounding_mode"]:
        pytest.fail("triton's interpreter no longer has _convert_float(input, input_dtype, output_dtype, "
                    "rounding_mode): update the exact_interpreter_casts fixture for this triton version")

    def convert(input, input_dtype, output_dtype, rounding_mode):
        src, dst = torch_types.get(input_dtype.name), torch_types.get(output_dtype.name)
        if src is None or dst is None:
            return original(input, input_dtype, output_dtype, rounding_mode)
        bits = np.ascontiguousarray(input).reshape(-1).view(np.dtype(f"uint{input_dtype.primitive_bitwidth}"))
        out = torch.from_numpy(bits.copy()).view(src).to(dst).view(uints[dst.itemsize]).numpy()
        return out.reshape(input.shape)

    interpreter._convert_float = convert
    yield
    interpreter._convert_float = original


@pytest.fixture
def general_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one at every launch through ``KernelLauncher.__call__`` (the general Triton
    launch path; replays bypass it)."""
    from fp8_backends.providers.triton import launcher

    calls: list[int] = []
    real_call = launcher.KernelLauncher.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(launcher.KernelLauncher, "__call__", counted)
    return calls
