"""Inductor settings for the library's Triton ops under ``torch.compile``.

The ``triton`` GEMM and norm-quant ops are ``torch.library.triton_op``\\ s: Inductor launches their kernels from its
own generated code, as it launches the kernels it generates. It launches its own kernels through its static CUDA
launcher (one C call), but user-defined Triton kernels, by default, through Triton's Python launcher, which costs
several µs more per launch (``torch._inductor.config.static_launch_user_defined_triton_kernels`` is off by default
in torch 2.11). In a compiled decode step without CUDA graphs, where every linear is one launch, that difference
is the host time that separated FP8 from bf16 (``bench/hf_model.py --step-profile`` on the H200, 2026-12-01).

:func:`static_launch_triton_ops` turns that setting on. It is global (it applies to every user-defined Triton
kernel Inductor compiles afterwards, not only this library's), read when Inductor compiles a kernel, and Inductor
falls back to Triton's launcher for any kernel its static launcher cannot launch (a kernel launched with PDL, for
one: the traced ops build the library's kernels without it).

The decision is made where Inductor compiles a kernel: in its compile-worker processes, which receive
``use_static_cuda_launcher`` from the parent but read ``static_launch_user_defined_triton_kernels`` from their own
config, that is from the environment variable ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS`` (torch
2.11). Setting the config in the parent alone therefore changed nothing on the H200 (2026-12-01: the library's
kernels still went through Triton's launcher, ``bench/compiled_host.py``); with the variable set they launch
statically. So :func:`static_launch_triton_ops` sets both, and shuts down compile workers already started, so that
the next compile starts them with the variable.
:func:`fp8_backends.quantize_model` calls it when asked (``static_launch=True``). It stays opt-in: on the H200 the
static launcher, once it did launch the library's kernels, made a compiled Llama decode step without CUDA graphs
slower, not faster (1.68x and 1.73x bf16 in two runs against 1.03x with it off, the same provider choices;
``bench/results/hf_model/2026-12-01-h200-static-launcher-on/``, ``.../hf_model/2026-12-01-h200-objective/`` and
``.../hf_model/2026-12-01-h200-host-choices/``; where the time goes was not isolated).
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

_SETTING = "static_launch_user_defined_triton_kernels"
#: the environment variable Inductor's compile workers read the setting from
ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


def static_launch_triton_ops(enable: bool = True) -> bool | None:
    """Set ``torch._inductor.config.static_launch_user_defined_triton_kernels`` to ``enable``, and the variable
    :data:`ENV` its compile workers read; return the previous value, or ``None`` where this torch has no such
    setting (nothing is changed then). Compile workers already running are shut down when the value changes (the
    next compile starts new ones, a few seconds). No compile, no GPU."""
    try:
        from torch._inductor import config
    except ImportError:  # a torch without Inductor
        return None
    if not hasattr(config, _SETTING):
        return None
    previous = bool(getattr(config, _SETTING))
    changed = previous != enable or os.environ.get(ENV) != ("1" if enable else "0")
    os.environ[ENV] = "1" if enable else "0"
    if changed:
        _restart_compile_workers()
    if previous != enable:
        setattr(config, _SETTING, enable)
        logger.info("torch._inductor.config.%s = %s (Inductor launches the library's Triton kernels with %s)",
                    _SETTING, enable, "its static CUDA launcher" if enable else "Triton's launcher")
    return previous


def _restart_compile_workers() -> None:
    """Shut down Inductor's compile-worker pools, if any were started, so new ones read the environment."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    if async_compile is None or not getattr(async_compile, "_pool_set", None):
        return
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        logger.info("restarting Inductor's compile workers so that they read %s", ENV)
        shutdown()


__all__ = ["ENV", "static_launch_triton_ops"]
