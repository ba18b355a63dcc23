"""Drop-in torch modules: :class:`Fp8Linear` and :class:`RMSNormFp8Quant` (:mod:`.modules`), and how they run.

- :mod:`.modules`: the two ``nn.Module`` s: loading, processing (``process_weights_after_loading``), the forward;
- :mod:`.eager_plan`: a processed linear's eager call, bound once at processing;
- :mod:`.traced_plan`: what ``torch.compile`` traces of a processed linear (and of an ``auto`` norm), bound once;
- :mod:`.shared_input`: :class:`~.shared_input.Fp8LinearSlice`: fused siblings (q/k/v, gate/up) served from one GEMM;
- :mod:`.inductor_setup`: Inductor's static launcher for the library's Triton kernels under ``torch.compile``.

Importing this package imports torch.
"""

from __future__ import annotations

from .modules import SHARD_SCALE_POLICIES, Fp8Linear, RMSNormFp8Quant, process_weights_after_loading

__all__ = ["SHARD_SCALE_POLICIES", "Fp8Linear", "RMSNormFp8Quant", "process_weights_after_loading"]
