"""Host cost of the provider output contract check (CPU microbenchmark, no GPU needed).

    python -m bench.output_check_cost [--number 20000] [--repeat 7]

A stub GEMM provider whose ``gemm_impl`` returns a preallocated ``[M, N]`` bf16 tensor isolates the library's own
per-call Python work from any kernel: ``backend.gemm(...)`` (the general path: on the CPU every call takes the full
validation), a processed ``Fp8Linear``'s bound eager plan with a stub quantizer (the plan's checks, the GEMM closure
and, where present, the output check), and the output check's condition alone. Best of ``--repeat`` timeit runs,
in ns per call. Run it on the commit before and after a change to the hot path.
"""

from __future__ import annotations

import argparse
import timeit
from typing import ClassVar


def main(argv: list[str] | None = None) -> None:
    import torch

    from fp8_backends.core import reference
    from fp8_backends.core.backend import Fp8GemmBackend
    from fp8_backends.core.capabilities import GemmCapabilities
    from fp8_backends.core.types import ActScale, DeviceKind
    from fp8_backends.layers.eager_plan import EagerPlan, bind_linear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)

    m, n, k = 4, 32, 64
    y = torch.empty(m, n, dtype=torch.bfloat16)

    class Stub(Fp8GemmBackend):
        name: ClassVar[str] = "stub"
        capabilities: ClassVar[GemmCapabilities] = GemmCapabilities(
            devices=frozenset({DeviceKind.CPU}), act_scales=frozenset(ActScale))

        def prepare_weight_impl(self, w_q, w_scale, weight_scale):
            return self.prepare_k_major(w_q, w_scale, weight_scale)

        def gemm_impl(self, x_q, prepared, x_scale, out_dtype, bias):
            return y

    backend = Stub()
    w_q, w_s = reference.quantize_dynamic_per_tensor(torch.randn(n, k))
    prepared = backend.prepare_weight(w_q, w_s)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    x_q, x_s = reference.quantize_dynamic_per_tensor(x.float())
    linear = bind_linear(backend, prepared, torch.bfloat16, None, lambda _x: (x_q, x_s), ActScale.PER_TENSOR_DYNAMIC,
                         None, x_q.dtype)
    plan = EagerPlan(k=k, n=n, dtype=torch.bfloat16, device=torch.device("cpu"), rows=[(1 << 62, linear)])
    assert plan(x) is y or plan(x).shape == (m, n)
    tensor, bf16 = torch.Tensor, torch.bfloat16
    cases = {
        "backend.gemm (general path)": lambda: backend.gemm(x_q, prepared, x_s, out_dtype=bf16),
        "EagerPlan call (stub quantizer)": lambda: plan(x),
        "output check condition alone": lambda: (type(y) is not tensor or y.dtype is not bf16 or y.shape != (m, n)
                                                 or y.get_device() != -1),
    }
    for label, fn in cases.items():
        best = min(timeit.repeat(fn, number=args.number, repeat=args.repeat)) / args.number
        print(f"{label:34s} {best * 1e9:8.0f} ns/call")


if __name__ == "__main__":
    main()
