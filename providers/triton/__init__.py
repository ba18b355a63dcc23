"""The ``triton`` providers: FP8 GEMM (``gemm``), fused RMSNorm + FP8 quant (``norm_quant``) and the
FP8 activation-quant kernels (``quant_kernels``), all written in Triton.

Modules:

- ``_support``: what every Triton module shares (interpreter detection, the PDL policy, devices);
- ``launcher``: low-host-cost launches through the compiled kernels Triton returns;
- ``gemm`` / ``gemm_ops`` / ``gemm_kernels`` / ``gemm_configs``: the GEMM provider, its torch op and
  launcher, its kernels (GEMV, swap-AB, tiled, persistent TMA) and its tile configs with the M-bucket table;
- ``gemm_args``: one GEMM launch (config pick, kernel, grid and arguments), shared by the eager launcher and
  ``traced_ops``;
- ``traced_ops``: what ``torch.compile`` sees of the Triton ops (their ``triton_op`` bodies);
- ``norm_quant`` / ``norm_kernels``: the norm-quant provider and its kernels;
- ``quant_kernels``: static, dynamic per-tensor and per-token quant, the CUDA default of
  :mod:`fp8_backends.quant`'s ops;
- block-wise FP8, each op as ``*_kernels`` (the kernels), its launch arithmetic (``block_gemm_args``; in the kernel
  module for the others), ``*_ops`` (eager launcher and op) and ``*_traced`` (the op's ``triton_op`` body):
  ``block_gemm_*`` (the GEMM of per-token-group activations and 128x128 block weights, with ``block_gemm_configs``),
  ``group_quant_*`` (per-token-group activation quant) and ``norm_dynamic_*`` (fused RMSNorm + dynamic per-token /
  per-token-group quant).

Importing this package imports nothing heavy: triton is imported when a kernel is first needed.
"""
