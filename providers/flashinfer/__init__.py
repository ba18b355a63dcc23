"""The flashinfer providers: FP8 GEMM through flashinfer's ``bmm_fp8`` kernels (``flashinfer_bmm``, alias
``flashinfer``) and flashinfer's fused RMSNorm + FP8 quant (``flashinfer`` norm-quant).

Modules:

- ``common``: what both providers decide without importing torch or flashinfer (availability, the runner
  support tables, the feature probe, the autotune cache file);
- ``gemm`` / ``gemm_ops``: the GEMM provider and its torch op with the cached per-problem call plans;
- ``norm_quant`` / ``norm_ops``: the norm-quant provider and its two torch ops;
- ``_support``: what the op modules share (graph-capture guards, per-device state, alignment).

Importing this package imports nothing heavy: the op modules (torch, flashinfer) load at first use.
"""
