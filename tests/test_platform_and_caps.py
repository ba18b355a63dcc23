"""Platform detection/simulation and the capability records' reasons."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fp8_backends import (
    ActScale,
    BiasMode,
    DeviceKind,
    GemmCapabilities,
    GemmProblem,
    NormQuantCapabilities,
    NormQuantProblem,
    OutDtype,
    WeightScale,
)
from fp8_backends.registry import platform as P


@pytest.mark.parametrize(
    "text, sm", [("9.0", (9, 0)), ("9.0a", (9, 0)), ("sm_90a", (9, 0)), ("90", (9, 0)), ("10.0", (10, 0)),
                 ("100", (10, 0)), ("12.0", (12, 0)), ("sm_120", (12, 0)), ("8.9", (8, 9))]
)
def test_parse_sm(text, sm):
    assert P.parse_sm(text) == sm


@pytest.mark.parametrize("bad", ["", "nine", "9.", "sm_"])
def test_parse_sm_rejects_garbage(bad):
    with pytest.raises(ValueError, match="SM version"):
        P.parse_sm(bad)


def test_simulated_platform_properties():
    p = P.simulate_platform("9.0")
    assert p.is_cuda and p.simulated and p.sm == (9, 0) and p.pdl and p.arch == "9.0a"
    assert not P.simulate_platform("8.9").pdl
    assert P.simulate_platform("8.0").arch == "8.0"
    assert "simulated" in p.describe()


def test_cpu_detection_without_gpu(monkeypatch):
    monkeypatch.setattr(P, "_cuda_devices", lambda: ((), None))
    assert P.detect_platform().kind is DeviceKind.CPU
    assert P.detect_platform("cpu").kind is DeviceKind.CPU
    cuda = P.detect_platform("cuda")
    assert cuda.is_cuda and cuda.sm is None  # asked for CUDA explicitly: reported as absent, not as CPU
    assert P.list_platforms()[0].kind is DeviceKind.CPU


def test_env_simulation(monkeypatch):
    monkeypatch.setenv("FP8_BACKENDS_SIMULATE_SM", "10.0")
    p = P.detect_platform()
    assert p.simulated and p.sm == (10, 0)
    assert P.detect_platform("cpu").kind is DeviceKind.CPU  # CPU tensors stay on the CPU platform


def test_mixed_gpus_resolve_per_device(monkeypatch):
    devs = (P._CudaDevice(0, "NVIDIA H200", (9, 0), 132), P._CudaDevice(1, "NVIDIA L4", (8, 9), 58))
    monkeypatch.setattr(P, "_cuda_devices", lambda: (devs, "13.0"))
    assert P.detect_platform("cuda:0").sm == (9, 0)
    assert P.detect_platform("cuda:1").sm == (8, 9)
    assert P.detect_platform(1).name == "NVIDIA L4"
    assert [p.device_index for p in P.list_platforms()] == [0, 1]
    with pytest.raises(ValueError, match="no CUDA device with index 5"):
        P.detect_platform("cuda:5")
    with pytest.raises(ValueError, match="unsupported device"):
        P.detect_platform("tpu")


def test_supports_detects_the_platform_through_the_registry():
    """The contract (floor 0) never imports the registry: ``supports(problem)`` without a platform asks the detection
    the registry's platform module installs when imported; before that the CPU needs none, and a GPU problem is told
    to pass a platform."""
    from fp8_backends.core import backend

    assert backend._PLATFORM_DETECTOR[0] is P.detect_platform
    code = (
        "import sys\n"
        "from fp8_backends.core.types import GemmProblem\n"
        "from fp8_backends.providers.torch_scaled_mm import TorchScaledMMBackend as B\n"
        "assert not [m for m in sys.modules if m.startswith('fp8_backends.registry')]\n"
        "assert B().supports(GemmProblem(n=16, k=32, device='cpu')) == []\n"
        "try:\n"
        "    B().supports(GemmProblem(n=16, k=32, device='cuda'))\n"
        "except ValueError as exc:\n"
        "    assert 'pass platform=' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
        "import fp8_backends.registry.platform as P\n"
        "p = P.detect_platform('cuda')\n"
        "assert B().supports(GemmProblem(n=16, k=32, device='cuda')) == B().supports(GemmProblem(n=16, k=32), p)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_library_versions_without_import():
    versions = P.library_versions()
    assert "torch" in versions and "fp8-backends" in versions


CAPS = GemmCapabilities(min_sm=(9, 0), max_sm=(9, 0), k_align=16, n_align=32, priority=3)


def test_gemm_caps_accept_and_reason():
    h200 = P.simulate_platform("9.0")
    ok = GemmProblem(n=64, k=32, m=1)
    assert CAPS.check(ok, h200) == []
    bad = GemmProblem(n=48, k=24, m=1, act_scale=ActScale.PER_TOKEN, weight_scale=WeightScale.PER_CHANNEL,
                      input_dtype="e5m2", out_dtype="float32", has_bias=True)
    reasons = CAPS.check(bad, P.simulate_platform("8.9"))
    text = "\n".join(reasons)
    for needle in ["needs SM >= 9.0", "per_token", "per_channel", "e5m2", "float32", "bias not supported",
                   "K=24 is not a multiple of 16", "N=48 is not a multiple of 32"]:
        assert needle in text, needle
    assert "supports SM <= 9.0" in CAPS.check(ok, P.simulate_platform("10.0"))[0]


def test_caps_device_and_cpu():
    cpu_problem = GemmProblem(n=64, k=32, device="cpu")
    assert "runs on cuda tensors only, not cpu" in CAPS.check(cpu_problem, P.cpu_platform())[0]
    assert "no CUDA device here" in CAPS.check(GemmProblem(n=64, k=32), P.cpu_platform())[0]


@pytest.mark.parametrize("sm, ok", [("9.0", True), ("10.0", False), ("8.9", False)])
def test_arch_specific_targets(sm, ok):
    caps = GemmCapabilities(archs=("9.0a",))
    assert (caps.check(None, P.simulate_platform(sm)) == []) is ok


def test_family_targets():
    caps = GemmCapabilities(archs=("10.0f",))
    assert caps.check(None, P.simulate_platform("10.3")) == []
    assert caps.check(None, P.simulate_platform("12.0"))
    assert caps.arch_summary() == "10.0f"
    assert GemmCapabilities(min_sm=(8, 9)).arch_summary() == ">=8.9"


def test_norm_caps():
    caps = NormQuantCapabilities(in_dtypes=frozenset({OutDtype.BF16}), residual=False, hidden_align=8)
    p = P.simulate_platform("9.0")
    assert caps.check(NormQuantProblem(hidden=64), p) == []
    reasons = caps.check(NormQuantProblem(hidden=60, in_dtype="float16", residual=True), p)
    assert len(reasons) == 3


def test_problem_normalises_loose_inputs():
    import torch

    p = GemmProblem(n=8, k=16, out_dtype=torch.float16, input_dtype=torch.float8_e4m3fn, device="cuda:1",
                    act_scale="per_token")
    assert p.out_dtype is OutDtype.FP16 and p.device is DeviceKind.CUDA and p.act_scale is ActScale.PER_TOKEN
    with pytest.raises(ValueError, match="unsupported output dtype"):
        GemmProblem(n=8, k=16, out_dtype="int8")
    with pytest.raises(ValueError, match="positive"):
        GemmProblem(n=0, k=16)
    assert BiasMode("fused") is BiasMode.FUSED
