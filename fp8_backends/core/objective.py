"""What ``auto`` optimizes when it chooses a GEMM provider from measurements: :class:`SelectionObjective`.

The measurements behind ``auto`` (the tuned lockfile, the shipped selection data, the nearest-shapes model) are
kernel times taken in CUDA-graph replay. Inside a CUDA graph that is what a call costs. Outside one (eager mode,
``torch.compile`` without CUDA graphs) the host enqueues every call, and a small GEMM costs
``max(kernel time, host time)``: a provider whose kernel is a little faster but whose call costs ~20 µs of host
time (``torch._scaled_mm``: cuBLASLt heuristics per call) loses to one a few percent slower that costs a few µs.

- :attr:`SelectionObjective.KERNEL` (``"kernel"``): the fastest kernel, as measured in CUDA graphs (the
  measurements' own answer).
- :attr:`SelectionObjective.HOST` (``"host"``): the cost of a call the host enqueues: among the candidates whose
  kernel time is within :data:`HOST_MARGIN` of the fastest, or within :data:`HOST_HIDDEN_MARGIN` and hidden behind
  the host's work (at most :data:`HOST_HIDDEN` of ``host µs + context``), or, where the fastest kernel is itself
  hidden behind its own call, hidden behind that call too with a host saving of at least half the context and at
  least its kernel loss, the lowest
  ``max(kernel µs, host µs + context)`` (``host µs``: the provider class's ``host_us``; ``context``:
  :data:`HOST_CONTEXT_US`, the host time of the model's other work around each linear, which its kernel must outlast
  too). The rule, shared by every measuring policy, is
  :func:`fp8_backends.registry.host_aware.choose`.
- :attr:`SelectionObjective.AUTO` (``"auto"``): layers only (``Fp8Linear``, ``init_fp8_gemm``,
  ``quantize_model``): the HOST choice per M bucket for eager and compiled calls, and the KERNEL choice for calls
  made while a CUDA graph is being captured (both kept when they differ). A single resolution
  (``resolve_gemm_backend``) has one provider for both paths: there ``auto`` means KERNEL.

``FP8_SELECTION_OBJECTIVE`` (:func:`fp8_backends.core.settings.selection_objective`) sets the default where the
caller passes none: KERNEL for resolutions, AUTO for layers when it is unset.
"""

from __future__ import annotations

import enum
from typing import Any

from .errors import InvalidInputError, InvalidTypeError

#: HOST considers only candidates whose kernel µs is at most this fraction above the fastest candidate's (5%): the
#: host-aware choice never costs more than that inside a CUDA graph
HOST_MARGIN = 0.05

#: the host µs of the rest of a model's work around each linear call (its norms, attention, activations, the compiled
#: wrapper's launches and guards), which that linear's kernel must also outlast before the host, not the GPU, stops
#: deciding a step's time. Measured on the H200 (``bench/results/hf_model/2026-12-01-h200-traced-plan/``): a compiled
#: 8-layer Llama at Llama-3-8B sizes spends 4152 µs of host time on a 512-token bf16 step, 74 µs per linear, of which
#: ``torch.mm``'s own call is ~20 µs. ``FP8_SELECTION_HOST_CONTEXT_US`` overrides it
#: (:func:`fp8_backends.core.settings.host_context_us`; ``0``: only the provider's own host time counts, as before the
#: context existed; kernel-time ties still go to the cheaper call)
HOST_CONTEXT_US = 50.0

#: a kernel at most this fraction of ``host µs + context`` (its own call's host time plus the model's other work around
#: it) is hidden behind the host's work with room to spare: the host objective considers it even when it is more than
#: :data:`HOST_MARGIN` slower than the fastest kernel (up to :data:`HOST_HIDDEN_MARGIN`), because a host-bound call
#: never waits for it. Half, so that an estimate of the context twice too large still leaves the kernel hidden. Measured
#: case (H200, 2026-12-02, Llama-3-8B QKV 6144 x 4096 at M = 256): ``torch._scaled_mm``'s 12.3 µs kernel against 15.0
#: (cutlass, whose call costs ~7 µs less host time), in a compiled decoder block whose host spends ~250 µs per call on
#: ~130 µs of kernels (``bench/block_host.py``, ``bench/results/block_host/2026-12-02-h200-before-hidden-kernel-rule/``)
HOST_HIDDEN = 0.5

#: how much slower than the fastest a hidden kernel may be (25%): the bound on what the host objective can lose where
#: a workload the model calls host-bound turns out GPU-bound after all (other streams, a leaner host than the context
#: assumes). Beyond it only where the fastest kernel is hidden behind its own call and the candidate's host saving is
#: large (half the context or more) and covers its kernel loss (a GPU-bound step then loses at most what a host-bound
#: one gains). H200, 2026-12-04, Qwen3-8B layers in block-wise FP8
#: (``bench/results/hf_model/2026-12-04-h200-block-native-op/``): the fused q/k/v and gate/up at M <= 256 on
#: ``torch._scaled_mm`` (kernels 25-42% faster than cutlass's, behind ~75 µs of its opaque op's host time against
#: ~13) made a compiled 128-token step 1.20x the all-cutlass one
HOST_HIDDEN_MARGIN = 0.25

#: kernel times within this fraction of each other are one kernel time to the host objective: a kernel-bound answer
#: gives way to a candidate this close whose call costs less host time. Graph-replay timings of one shape differ by
#: about this much between runs, and a bucket's kernel time is measured at its largest M, so the calls at its smaller M
#: are host-bound sooner than that time says (H200, 2026-12-01,
#: ``bench/results/hf_model/2026-12-01-h200-fused-siblings-prefill-512/``: ``cutlass`` kept at 167.2 µs against
#: ``torch_scaled_mm``'s 168.0 for a 28672 x 4096 M <= 1024 bucket cost a 512-token compiled step 760 µs of host time)
HOST_TIE = 0.01


class SelectionObjective(str, enum.Enum):
    """What ``auto`` minimizes (module docstring)."""

    KERNEL = "kernel"
    HOST = "host"
    AUTO = "auto"

    @classmethod
    def of(cls, value: Any) -> SelectionObjective:
        """An instance or its value (``"host"``, any case); an unknown value raises
        :class:`~fp8_backends.core.errors.InvalidInputError` naming the valid ones."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, str):
            raise InvalidTypeError(f"a selection objective is one of {valid_values()}, got "
                                   f"{type(value).__name__} {value!r}")
        member = cls._value2member_map_.get(value.strip().lower())
        if member is None:
            raise InvalidInputError(f"{value!r} is not a selection objective (expected one of {valid_values()})")
        return member  # type: ignore[return-value]

    def for_resolution(self) -> SelectionObjective:
        """The objective one resolution (one provider for every path) decides by: AUTO is KERNEL there."""
        return SelectionObjective.KERNEL if self is SelectionObjective.AUTO else self


def valid_values() -> str:
    """``"kernel, host, auto"``."""
    return ", ".join(m.value for m in SelectionObjective)


__all__ = ["HOST_CONTEXT_US", "HOST_MARGIN", "HOST_TIE", "SelectionObjective", "valid_values"]
