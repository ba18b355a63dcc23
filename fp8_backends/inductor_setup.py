"""Inductor settings for the library's Triton ops under ``torch.compile``.

The ``triton`` GEMM and norm-quant ops are ``torch.library.triton_op``\\ s: Inductor launches their kernels from its
own generated code, as it launches the kernels it generates. It launches its own kernels through its static CUDA
launcher (one C call), but user-defined Triton kernels, by default, through Triton's Python launcher, which costs
several µs more per launch (``torch._inductor.config.static_launch_user_defined_triton_kernels`` is off by default
in torch 2.11). In a compiled decode step without CUDA graphs, where every linear is one launch, that difference
is the host time that separated FP8 from bf16 (``bench/hf_model.py --step-profile`` on the H200, 2026-12-01).

:func:`static_launch_triton_ops` turns that setting on. It is global (it applies to every user-defined Triton
kernel Inductor compiles afterwards, not only this library's), read when Inductor compiles a kernel, and Inductor
falls back to Triton's launcher for any kernel its static launcher cannot launch.
:func:`fp8_backends.quantize_model` calls it when asked (``static_launch=True``). It is opt-in: the profile shows
where the launches go, but the effect on a whole model's step has not been measured yet.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_SETTING = "static_launch_user_defined_triton_kernels"


def static_launch_triton_ops(enable: bool = True) -> bool | None:
    """Set ``torch._inductor.config.static_launch_user_defined_triton_kernels`` to ``enable``; return the previous
    value, or ``None`` where this torch has no such setting (nothing is changed then). Cheap; no compile, no GPU."""
    try:
        from torch._inductor import config
    except ImportError:  # a torch without Inductor
        return None
    if not hasattr(config, _SETTING):
        return None
    previous = bool(getattr(config, _SETTING))
    if previous != enable:
        setattr(config, _SETTING, enable)
        logger.info("torch._inductor.config.%s = %s (Inductor launches the library's Triton kernels with %s)",
                    _SETTING, enable, "its static CUDA launcher" if enable else "Triton's launcher")
    return previous


__all__ = ["static_launch_triton_ops"]
