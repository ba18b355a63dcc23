"""fp8_backends.core.oplib: op definition and the eager fast path (CPU; no kernels involved)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8_backends.core import oplib

_calls: list[str] = []


def _impl(x: torch.Tensor, factor: float) -> torch.Tensor:
    _calls.append("impl")
    return x * factor


def _fake(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.fixture(scope="module")
def op():
    name = "test_oplib_scale"
    return oplib.define_ops({name: (f"{name}(Tensor x, float factor) -> Tensor", _impl, _fake)}, ("CPU",))[name]


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_define_ops_is_idempotent(op):
    again = oplib.define_ops({"test_oplib_scale": ("test_oplib_scale(Tensor x, float factor) -> Tensor", _impl, _fake)},
                             ("CPU",))
    assert again["test_oplib_scale"] is op or str(again["test_oplib_scale"]) == str(op)


def test_eager_fast_calls_the_implementation_directly_for_plain_tensors(op):
    call = oplib.eager_fast(op)
    assert call.op is op
    _calls.clear()
    x = torch.arange(4.0)
    with _Recorder() as rec:  # a dispatch mode: the op must be visible to it
        y = call(x, 2.0)
    assert "fp8_backends.test_oplib_scale.default" in rec.seen and torch.equal(y, 2 * x)
    y = call(x, 3.0)  # plain eager: no mode, plain tensor -> the implementation, not the dispatcher
    assert torch.equal(y, 3 * x) and _calls == ["impl", "impl"]


def test_eager_fast_goes_through_the_op_for_fake_tensors_and_compile(op):
    from torch._subclasses.fake_tensor import FakeTensorMode

    call = oplib.eager_fast(op)
    _calls.clear()
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(3))
        out = call(fake, 2.0)
    assert out.shape == (3,) and _calls == []  # the fake implementation ran, never the real one

    def f(x):
        return call(x, 2.0) + 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.arange(3.0)
    assert torch.equal(compiled(x), 2 * x + 1)


def test_eager_fast_of_an_unknown_op_is_the_op_itself():
    op = torch.ops.aten.add.Tensor
    assert oplib.eager_fast(op) is op


def test_lazy_ops_define_on_first_use_and_call_through_eager_fast():
    name = "test_oplib_lazy_twice"
    asked = []

    def keys():
        asked.append(1)
        return ("CPU",)

    lazy = oplib.LazyOps({name: (f"{name}(Tensor x, float factor) -> Tensor", _impl, _fake)}, keys)
    assert asked == [] and not hasattr(torch.ops.fp8_backends, name)
    op = lazy.op(name)
    assert asked == [1] and lazy.op(name) is op and lazy.ops() == {name: op}
    call = lazy.call(name)
    assert call.op is op and lazy.call(name) is call
    _calls.clear()
    assert torch.equal(call(torch.ones(2), 4.0), torch.full((2,), 4.0)) and _calls == ["impl"]
