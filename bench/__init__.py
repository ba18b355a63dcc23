"""Benchmarks (run from the repository root; not installed with the package).

- ``python -m bench.gemm``: every usable FP8 GEMM provider over Llama-3-8B/70B linear shapes x M.
- ``python -m bench.norm_quant``: every RMSNorm + FP8-quant provider over hidden sizes x tokens.
- ``python -m bench.resolve``: what resolving ``auto`` with a warm lockfile costs per layer (CPU is fine).

Results (JSON, markdown, PNG) go to ``bench/results/<date>-<gpu>/`` unless ``--out`` says otherwise.
"""
