"""Drop-in torch modules: :class:`Fp8Linear` and :class:`RMSNormFp8Quant` (:mod:`.modules`), and how they run.

- :mod:`.modules`: the two ``nn.Module`` s: loading, processing (``process_weights_after_loading``), the forward;
- :mod:`.general_path`: a linear call's general path (check the input, quantize it, run the GEMM of its M bucket),
  shared with :func:`fp8_backends.fp8_linear`;
- :mod:`.eager_plan`: a processed linear's eager call, bound once at processing;
- :mod:`.traced_plan`: what ``torch.compile`` traces of a processed linear (and of an ``auto`` norm), bound once;
- :mod:`.processing`: ``process_weights_after_loading(model)``: every layer of a loaded model (MoE experts stacked
  first);
- :mod:`.experts`: :class:`~.experts.PerExpertLinears`: MoE experts one linear triple per expert, stacked for the
  provider's grouped-experts kernels;
- :mod:`.shared_input`: :class:`~.shared_input.Fp8LinearSlice`: fused siblings (q/k/v, gate/up) served from one GEMM;
- :mod:`.inductor_setup`: Inductor's static launcher for the library's Triton kernels under ``torch.compile``.

The public names below are imported on first use (``from fp8_backends.layers import Fp8Linear`` imports torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8_backends import _lazy_exports

__all__ = ["SHARD_SCALE_POLICIES", "Fp8Linear", "RMSNormFp8Quant", "process_weights_after_loading"]
#: the public names' modules, imported on first use
_EXPORTS = dict.fromkeys(__all__, "fp8_backends.layers.modules") | {
    "process_weights_after_loading": "fp8_backends.layers.processing"}
__getattr__, __dir__ = _lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:
    from .modules import SHARD_SCALE_POLICIES, Fp8Linear, RMSNormFp8Quant
    from .processing import process_weights_after_loading
