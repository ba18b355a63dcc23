"""The ``triton`` providers: FP8 GEMM (``gemm``), fused RMSNorm + FP8 quant (``norm_quant``) and the
FP8 activation-quant kernels (``quant_kernels``), all written in Triton.

Modules: ``_support`` (what every Triton module shares: interpreter detection, PDL policy, launch
helpers), ``gemm`` / ``gemm_kernels`` / ``gemm_configs`` (the GEMM provider, its kernels and its
M-bucket tile table), ``norm_quant`` / ``norm_kernels`` (the norm-quant provider and kernels) and
``quant_kernels`` (static, dynamic per-tensor and per-token quant, registered as the CUDA
implementation of the library's quant ops). Importing this package imports nothing heavy: triton is
imported when a kernel is first needed.
"""
