"""The ``cutlass`` GEMM provider: CUTLASS 3.x SM90 FP8 kernels, JIT-built with nvcc and cached on disk.

Modules: ``backend`` (the provider class), ``configs`` (kernel configs and the M-bucket table),
``build`` (nvcc discovery, cache, locked builds, ctypes loading), ``ops`` (the torch custom op), and
the kernel source ``fp8_gemm_sm90.cu``. Importing this package imports nothing heavy.
"""
