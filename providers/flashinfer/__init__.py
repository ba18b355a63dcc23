"""The flashinfer providers: FP8 GEMM through flashinfer's ``bmm_fp8`` kernels (``flashinfer_bmm``, alias
``flashinfer``), block-wise FP8 GEMM through its ``fp8_blockscale_gemm_sm90`` (``flashinfer_block``) and flashinfer's
fused RMSNorm + FP8 quant (``flashinfer`` norm-quant).

Modules:

- ``common``: what both providers decide without importing torch or flashinfer (availability, the runner
  support tables, the feature probe, the autotune cache file);
- ``gemm`` / ``gemm_ops``: the GEMM provider and its torch op with the cached per-problem call plans;
- ``block`` / ``block_ops`` / ``block_jit``: the block-wise GEMM provider, its torch op and per-device runners, and
  what it knows of flashinfer's module build and DeepGEMM's per-shape kernels (no torch there);
- ``norm_quant`` / ``norm_ops``: the norm-quant provider and its two torch ops;
- ``_support``: what the op modules share (graph-capture guards, per-device state, alignment).

Importing this package imports nothing heavy: the op modules (torch, flashinfer) load at first use.
"""
