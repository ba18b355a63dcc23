"""The ``cutlass`` GEMM provider: CUTLASS 3.x SM90 FP8 kernels, JIT-built with nvcc and cached on disk.

Modules: ``backend`` (the provider class), ``configs`` (per-tensor / row-wise kernel configs and their M-bucket
table), ``block_configs`` (block-scaled kernel configs and their table), ``build`` (nvcc discovery, cache, locked
builds, ctypes loading, for both kernel families), ``ops`` and ``block_ops`` (the torch custom ops), ``native_op`` (the
C++ op), and the kernel sources ``fp8_gemm_sm90.cu`` and ``fp8_blockwise_gemm_sm90.cu``. Importing this package
imports nothing heavy.
"""
