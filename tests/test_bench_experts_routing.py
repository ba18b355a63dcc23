"""``bench/experts_routing.py`` and ``bench/moe_experts.py``'s torch-op routing baseline on the CPU (Triton's
interpreter): the routing kernel and the torch ops make plans the bench's check accepts, a wrong plan is caught, and
the run writes its tables."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or (not torch.cuda.is_available()
                                                   and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="the routing kernel is a Triton kernel: a GPU or Triton's interpreter")


def test_both_plans_pass_the_check_and_a_broken_one_does_not():
    from bench.experts_routing import check, kernel_plan
    from bench.moe_experts import TorchPlanKernels
    from fp8_backends.providers.triton import experts_ops

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.randint(-1, 9, (300,), device=dev)
    bm, *torch_plan = TorchPlanKernels(None).plan(ids, 8, 0)
    for plan in (experts_ops.tile_plan(ids, 8, bm), torch_plan, kernel_plan(ids, 8, bm, 64, 2)):
        assert check(plan, ids, 8, bm) is None
    order, *tiles = experts_ops.tile_plan(ids, 8, bm)
    assert check((order.flip(0), *tiles), ids, 8, bm) == "the order is not sorted by expert"
    swapped = tiles[0].clone()
    swapped[0] = (swapped[0] + 1) % 8
    assert check((order, swapped, *tiles[1:]), ids, 8, bm) is not None


def test_cpu_smoke_run(tmp_path):
    from bench import experts_routing

    assert experts_routing.main(["--pairs", "40", "300", "--experts", "8", "--top-k", "2", "--chunks", "64",
                                 "--warps", "2", "--forms", "--rounds", "1", "--iters", "1", "--device", "cpu",
                                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "experts_routing.json").read_text())
    assert [row["pairs"] for row in data["rows"]] == [40, 300]
    assert all(not row["errors"] and {"kernel/eager", "torch_ops/eager", "kernel_c64_w2/eager", "kernel_one/eager",
                                             "kernel_many/eager"} <= set(row["us"])
               for row in data["rows"])
    assert "Plans checked before timing: all right" in (tmp_path / "experts_routing.md").read_text()


def test_the_tiled_variants_compute_what_the_library_does():
    """``bench.moe_experts.TiledVariantKernels``: a fixed tile height or grid order, the same rows as the library's
    kernels (the variants the bench times are the library's GEMM, not another computation)."""
    from bench.moe_experts import TiledVariantKernels
    from fp8_backends.core.reference import quantize_block
    from fp8_backends.providers.triton.experts_ops import TritonExpertsKernels

    torch.manual_seed(3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    blocks = [quantize_block(torch.randn(256, 256)) for _ in range(4)]
    w = torch.stack([q for q, _ in blocks]).to(dev)
    s = torch.stack([sc for _, sc in blocks]).to(dev)
    x = torch.randn(48, 256, dtype=torch.bfloat16, device=dev)
    ids = torch.randint(0, 4, (96,), device=dev)
    own = TritonExpertsKernels()
    plan = own.plan(ids, 4, 0)
    want = own.matmul(x, w, s, ids, None, 2, torch.float32, plan)
    for variant in (TiledVariantKernels(own, block_m=16), TiledVariantKernels(own, n_first=True),
                    TiledVariantKernels(own, n_first=False)):
        got_plan = variant.plan(ids, 4, 0)
        assert got_plan[0] == (16 if variant.block_m else plan[0])
        got = variant.matmul(x, w, s, ids, None, 2, torch.float32, got_plan)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert TiledVariantKernels(own, block_m=16).plan(ids, 4, 1000) is None  # few pairs: the GEMV, as the library
