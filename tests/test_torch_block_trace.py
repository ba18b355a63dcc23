"""``torch_scaled_mm``'s block-wise path under ``torch.compile``: the body (``aten._scaled_mm`` and its M padding) is
traced where this torch's meta function knows block scales, the opaque op otherwise. CPU: meta tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fp8_backends.providers import torch_block  # noqa: E402


def _operands(m: int, n: int = 256, k: int = 384):
    fp8 = torch.float8_e4m3fn
    x = torch.empty((m, k), dtype=fp8, device="meta")
    w_t = torch.empty((n, k), dtype=fp8, device="meta").t()
    x_scale = torch.empty((-(-k // 128), m), device="meta").t()
    w_scale_t = torch.empty((-(-k // 128), -(-n // 128)), device="meta")
    return x, w_t, x_scale, w_scale_t


def test_load_op_records_whether_the_meta_function_knows_block_scales(monkeypatch):
    monkeypatch.setattr(torch_block, "_TRACE_BODY", None)
    torch_block.load_op()
    assert torch_block._TRACE_BODY is torch_block.meta_knows_block_scales()
    monkeypatch.setattr(torch_block, "meta_knows_block_scales", lambda: False)
    torch_block.load_op()
    assert torch_block._TRACE_BODY is False


@pytest.mark.parametrize("m", [5, 8])  # 5: the body pads M to a multiple of 4 and slices the output back
def test_compiling_runs_the_body_where_it_traces(monkeypatch, m):
    if not torch_block.meta_knows_block_scales():
        pytest.skip("this torch's _scaled_mm meta function takes no block scales")
    calls = []
    monkeypatch.setattr(torch_block, "_TRACE_BODY", True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    real = torch_block._run
    monkeypatch.setattr(torch_block, "_run", lambda *a: calls.append(a[0].shape) or real(*a))
    y = torch_block.cuda_gemm(*_operands(m), None, torch.bfloat16)
    assert calls == [(m, 384)] and tuple(y.shape) == (m, 256) and y.dtype == torch.bfloat16


def test_compiling_calls_the_op_where_the_body_does_not_trace(monkeypatch):
    monkeypatch.setattr(torch_block, "_TRACE_BODY", False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(torch_block, "_run", lambda *a: pytest.fail("the body ran"))
    sent = []
    monkeypatch.setattr(torch_block._OPS, "call", lambda name: lambda *a: sent.append(name) or "op")
    assert torch_block.cuda_gemm(*_operands(8), None, torch.bfloat16) == "op" and sent == [torch_block.OP_NAME]
