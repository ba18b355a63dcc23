"""The torch.library op around flashinfer's compiled ``bmm_fp8`` kernels, and the cached per-problem call plans.

Importing this module imports torch and registers one op in the ``fp8_backends`` namespace (the GEMM provider
imports it lazily, at ``prepare_weight``; the norm-quant ops are in :mod:`.norm_ops`):

- ``fp8_backends::flashinfer_bmm_fp8(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale,
  ScalarType out_dtype, str mode) -> Tensor``: ``x [M, K]`` row-major fp8, ``w`` the prepared
  ``[1, K, N]`` column-major view of an ``[N, K]`` weight, scalar fp32 scales; returns ``[M, N]``
  in ``out_dtype`` (bf16/fp16). ``mode`` is ``"<runner>/<autotune>"``, e.g. ``"cublas/off"``.

The op has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces through it.
It is defined with :func:`fp8_backends.core.oplib.define_ops` (``Library.define`` + ``impl(..., "CUDA")``,
not the ``custom_op`` decorator and its per-call Python wrapper); it is inference-only.

Host cost. flashinfer's public ``bmm_fp8`` spends 90-275 us of Python per call (requirement checks,
runner-list building, the autotuner lookup, cuDNN graph lookup). Here the work is split:

- load time (``prepare_weight`` -> :func:`gemm_device`): import flashinfer, load its compiled
  ``gemm`` module (``gen_gemm_module().build_and_load()``: the AOT/JIT-cached .so), take flashinfer's
  own shared 40 MiB workspace for the device.
- first call per ``(mode, device, M, N, K, dtypes)`` (:func:`_make_plan`): pick the runner (and the
  tuned tactic, with ``autotune``) and build a small callable: for cuBLASLt, the 64-byte algorithm
  the heuristic picks (``bmm_fp8_get_algos``, host-only, so allowed during CUDA graph capture); for
  cuDNN, the graph (eager only).
- every call: one dict lookup, then the compiled entry point (``bmm_fp8_run_with_algo`` with the
  cached algorithm: no per-call cuBLASLt heuristic query, unlike ``bmm_fp8``; or the cuDNN graph's
  ``execute``).

What is left per call: the op dispatch, one ``torch.empty`` for the output, two ``unsqueeze`` views
(bmm_fp8 takes 3-D tensors), a pointer-alignment check, the plan lookup and the tvm-ffi call (DLPack
hand-over of the tensors; inside it cuBLASLt descriptor setup and the launch).

A plan's first call is guarded: if flashinfer's internals differ from 0.7.2's (a missing attribute,
a changed signature), the plan is replaced by one that calls the public ``flashinfer.bmm_fp8`` and a
warning says so. Results are the same; only the host cost differs (``plan_kinds()`` shows which).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from fp8_backends.core.errors import BackendUnavailableError, InvalidInputError
from fp8_backends.core.oplib import define_ops

from . import _support as support
from . import common

logger = logging.getLogger("fp8_backends")

BMM_OP = "flashinfer_bmm_fp8"
FAST_MODE = "cublas/off"

_CUBLASLT_MAX_ALGOS = 100
_CUBLASLT_ALGO_BYTES = 64
_OWN_WORKSPACE_BYTES = 40 * 1024 * 1024


# --------------------------------------------------------------------------------------------- GEMM
class GemmDevice:
    """Per-device state loaded once: flashinfer's gemm_base, the compiled module's entry points, the
    shared workspace, the SM."""

    def __init__(self, device: torch.device) -> None:
        self.fi = support.require_flashinfer(("bmm_fp8",))
        try:
            from flashinfer.gemm import gemm_base
        except Exception as exc:
            raise BackendUnavailableError(f"flashinfer.gemm.gemm_base failed to import: {exc}") from exc
        self.gb = gemm_base
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.sm = tuple(torch.cuda.get_device_capability(self.index))
        self.workspace = self._workspace()
        self.bmm: Callable[..., Any] | None = None
        self.get_algos: Callable[..., Any] | None = None
        self.run_with_algo: Callable[..., Any] | None = None
        try:
            from flashinfer.jit.gemm import gen_gemm_module

            module = gen_gemm_module().build_and_load()
            resolve = getattr(module, "_resolve_for_current_device", None)
            if resolve is not None:  # several AOT copies: pick this device's once, not per call
                with torch.cuda.device(self.index):
                    module = resolve()
            self.bmm = module.bmm_fp8
            self.get_algos = getattr(module, "bmm_fp8_get_algos", None)
            self.run_with_algo = getattr(module, "bmm_fp8_run_with_algo", None)
        except Exception as exc:
            logger.warning(
                "flashinfer_bmm: cannot call flashinfer's compiled gemm module directly (%s: %s); "
                "using flashinfer.bmm_fp8's Python path (slower host path, same results)",
                type(exc).__name__, exc,
            )

    def _workspace(self) -> torch.Tensor:
        """flashinfer's own process-wide bmm_fp8 workspace for this device (shared with direct
        flashinfer calls, as flashinfer shares it between its runners)."""
        get_buf = getattr(self.gb, "_get_cache_buf", None)
        size = int(getattr(self.gb, "DEFAULT_WORKSPACE_SIZE", _OWN_WORKSPACE_BYTES))
        device = torch.device("cuda", self.index)
        if get_buf is not None:
            try:
                return get_buf("bmm_fp8_workspace", size, device)
            except Exception as exc:
                logger.debug("flashinfer _get_cache_buf failed (%s); allocating a workspace", exc)
        return torch.empty(size, dtype=torch.uint8, device=device)


_GEMM_DEVICES: dict[int, GemmDevice] = {}



def gemm_device(device: torch.device) -> GemmDevice:
    """Load (once) what the GEMM op needs on ``device``. Called at prepare_weight time."""
    return support.per_device(_GEMM_DEVICES, GemmDevice, device, "loading flashinfer's gemm module")


class _Plan:
    kind = "?"

    def __call__(self, a3, b3, out3, sa, sb) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class _CublasPlan(_Plan):
    """The compiled ``bmm_fp8`` (cuBLASLt heuristic algorithm, fast accumulation)."""

    kind = "cublas"

    def __init__(self, fn: Callable[..., Any], workspace: torch.Tensor) -> None:
        self.fn, self.ws = fn, workspace

    def __call__(self, a3, b3, out3, sa, sb) -> None:
        self.fn(a3, b3, out3, sa, sb, self.ws)


class _CublasAlgoPlan(_Plan):
    """``bmm_fp8_run_with_algo`` with one cuBLASLt algorithm fixed for this exact problem (chosen
    once: the heuristic's first choice, or the tuned one), so no per-call heuristic query.
    ``algo_buf`` holds the 64-byte algorithm(s); ``algo`` indexes it; ``rank`` is the algorithm's
    place in cuBLASLt's list (0 = the heuristic's choice), for logs."""

    def __init__(self, fn: Callable[..., Any], workspace: torch.Tensor, algo_buf: torch.Tensor, algo: int,
                 rank: int = 0) -> None:
        self.fn, self.ws, self.algo_buf, self.algo = fn, workspace, algo_buf, int(algo)
        self.kind = f"cublas-algo{rank}"

    def __call__(self, a3, b3, out3, sa, sb) -> None:
        self.fn(a3, b3, out3, sa, sb, self.ws, self.algo_buf, self.algo)


class _CudnnPlan(_Plan):
    """A cuDNN graph built once for this exact shape (flashinfer's ``build_cudnn_gemm_fp8_graph``),
    executed on the current stream through flashinfer's cuDNN handle. The plan keeps the graph
    alive, so CUDA graphs that captured it stay valid."""

    def __init__(self, state: GemmDevice, tactic: Any, a3, b3, out3) -> None:
        import cudnn

        gb = state.gb
        to_dt = gb._torch_data_type_to_cudnn_data_type
        graph_tactic = -1 if tactic == -1 else gb._tactic_for_graph_cache(tactic)
        self.graph = gb.build_cudnn_gemm_fp8_graph(
            a3.shape, a3.stride(), b3.shape, b3.stride(), to_dt(a3.dtype), to_dt(b3.dtype), to_dt(out3.dtype),
            a3.device, tactic=graph_tactic,
        )
        self.index = -1 if tactic == -1 else int(gb._get_cudnn_plan_index_for_tactic(self.graph, tactic))
        self.handle = gb._get_cudnn_handle(a3.device, torch.cuda.current_stream(a3.device))
        need = self.graph.get_workspace_size() if self.index < 0 else self.graph.get_workspace_size_plan_at_index(
            self.index
        )
        self.ws = state.workspace
        if self.ws.numel() < need:  # own, never shared: resizing a shared buffer breaks captured graphs
            self.ws = torch.empty(int(need), dtype=torch.uint8, device=a3.device)
        self.set_stream = cudnn.set_stream
        self.dev = state.index
        uid = gb.UIDs
        self.uids = (uid.A_UID.value, uid.B_UID.value, uid.A_SCALE_UID.value, uid.B_SCALE_UID.value, uid.O_UID.value)
        execute = self.graph.execute if self.index < 0 else self.graph.execute_plan_at_index
        try:
            self.ordered = "tensor_uids" in inspect.signature(execute).parameters
        except (TypeError, ValueError):
            self.ordered = False
        self.kind = "cudnn" if self.index < 0 else f"cudnn-plan{self.index}"

    def use_dict_pack(self) -> None:
        self.ordered = False

    def __call__(self, a3, b3, out3, sa, sb) -> None:
        self.set_stream(self.handle, torch._C._cuda_getCurrentRawStream(self.dev))
        if self.ordered:
            buffers = (a3, b3, sa, sb, out3)
            if self.index < 0:
                self.graph.execute(buffers, self.ws, handle=self.handle, tensor_uids=self.uids)
            else:
                self.graph.execute_plan_at_index(buffers, self.ws, self.index, handle=self.handle,
                                                 tensor_uids=self.uids)
            return
        pack = dict(zip(self.uids, (a3, b3, sa, sb, out3)))
        if self.index < 0:
            self.graph.execute(pack, self.ws, handle=self.handle)
        else:
            self.graph.execute_plan_at_index(pack, self.ws, self.index, handle=self.handle)


class _RunnerPlan(_Plan):
    """One of flashinfer's TunableRunner objects called with a fixed tactic (Python path of that
    runner; used for runners without a direct entry point here, e.g. the SM100 CUTLASS runner)."""

    def __init__(self, runner: Any, tactic: Any, workspace: torch.Tensor) -> None:
        self.runner, self.tactic, self.ws = runner, tactic, workspace
        self.kind = f"runner:{type(runner).__name__}"

    def __call__(self, a3, b3, out3, sa, sb) -> None:
        self.runner(inputs=[a3, b3, sa, sb, out3, self.ws], tactic=self.tactic)


class _ApiPlan(_Plan):
    """The public ``flashinfer.bmm_fp8`` (its full Python path; the safe fallback)."""

    def __init__(self, fi: Any, backend: str) -> None:
        self.fn, self.backend = fi.bmm_fp8, backend
        self.kind = f"api:{backend}"

    def __call__(self, a3, b3, out3, sa, sb) -> None:
        self.fn(a3, b3, sa, sb, out3.dtype, out=out3, backend=self.backend)


class _GuardedPlan(_Plan):
    """Runs a fresh plan's first call; if it raises, swaps in ``fallbacks`` one by one (warning)."""

    def __init__(self, key: tuple, primary: _Plan, fallbacks: list[Callable[[], _Plan]]) -> None:
        self.key, self.primary, self.fallbacks = key, primary, fallbacks
        self.kind = primary.kind

    def __call__(self, a3, b3, out3, sa, sb) -> None:
        plan = self.primary
        while True:
            try:
                plan(a3, b3, out3, sa, sb)
            except Exception as exc:
                if not self.fallbacks or support.capturing():
                    raise
                nxt = self.fallbacks.pop(0)()
                logger.warning(
                    "flashinfer_bmm: the %s path failed on its first call (%s: %s); using %s for %s",
                    plan.kind, type(exc).__name__, exc, nxt.kind, _describe_key(self.key),
                )
                plan = nxt
                continue
            _PLANS[self.key] = plan
            return


_PLANS: dict[tuple, _Plan] = {}
_TUNE_FILES_LOADED: set[str] = set()


def _describe_key(key: tuple) -> str:
    mode, dev, m, k, n, xd, wd, od = key
    return f"{mode} cuda:{dev} M={m} N={n} K={k} {xd}x{wd}->{od}"


def plan_kinds() -> dict[str, str]:
    """For logs and benchmarks: which path each cached problem uses (``cublas`` direct,
    ``cudnn`` direct, ``cublas-algoN`` tuned, ``api:*`` flashinfer's Python path, ...)."""
    return {_describe_key(k): p.kind for k, p in list(_PLANS.items())}


def reset_plans() -> None:
    """Forget cached plans (tests, benchmarks). CUDA graphs already captured keep their kernels:
    the cuDNN graphs they use are also held by flashinfer's own caches."""
    with support.lock:
        _PLANS.clear()


def _cudnn_usable(gb: Any) -> bool:
    return bool(getattr(gb, "CUDNN_AVAILABLE", False))


def _runner_names(state: GemmDevice, runner: str, a3, b3, sa, sb, out3) -> list[str]:
    """flashinfer's runner list for ``runner`` on this device, in its preference order."""
    if runner in ("cublas", "cudnn"):
        return [runner]
    cutlass = "cutlass_sm12x" if state.sm[0] == 12 else "cutlass_sm10x"
    if runner == "cutlass":
        return [cutlass]
    e5m2 = torch.float8_e5m2 in (a3.dtype, b3.dtype)
    suitable = []
    if state.sm in common.RUNNER_SMS["cutlass"] and not e5m2:
        suitable.append("cutlass")
    suitable.append("cublas")
    if _cudnn_usable(state.gb):
        suitable.append("cudnn")
    heuristic = getattr(state.gb, "_heuristic_func_bmm_fp8", None)
    if heuristic is not None:
        try:
            names = list(heuristic(suitable, a3, b3, sa, sb, out3.dtype, out3, "auto"))
            if names:
                return names
        except Exception as exc:
            logger.info("flashinfer _heuristic_func_bmm_fp8 failed (%s); using our own order", exc)
    return [cutlass if s == "cutlass" else s for s in suitable]


def _runner_object(state: GemmDevice, name: str) -> Any:
    gb = state.gb
    if name == "cublas":
        return gb.get_gemm_module().cublas_fp8_gemm_runner()
    if name == "cudnn":
        return gb._cudnn_gemm_fp8_runner()
    if name == "cutlass_sm10x":
        return gb.get_gemm_sm100_module_cutlass_fp8().cutlass_fp8_gemm_runner()
    if name == "cutlass_sm12x":
        return gb.get_gemm_sm120_module_cutlass_fp8().cutlass_fp8_gemm_runner()
    raise BackendUnavailableError(f"flashinfer_bmm: no runner factory for {name!r}")


def _tuned_choice(state: GemmDevice, names: list[str], autotune: str, inputs: list[Any]) -> tuple[str, Any]:
    """Ask flashinfer's AutoTuner for ``(runner name, tactic)``: ``cache`` looks the shape up in the
    persisted file (never profiles); ``tune`` profiles uncovered M buckets now and saves the file."""
    from flashinfer.autotuner import AutoTuner
    from flashinfer.autotuner import autotune as fi_autotune

    tuner = AutoTuner.get()
    config = state.gb._FP8_GEMM_SM100_TUNING_CONFIG
    runners = [_runner_object(state, n) for n in names]
    path = common.autotune_cache_path(state.sm)
    if autotune == "tune":
        path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("flashinfer_bmm: autotuning %s (M=%d) with flashinfer's AutoTuner; cache %s",
                    "/".join(names), inputs[0].shape[1], path)
        with fi_autotune(True, cache=str(path)):
            runner, tactic = tuner.choose_one("fp8_gemm", runners, config, inputs)
        if tactic == -1:
            logger.warning(
                "flashinfer_bmm: flashinfer's AutoTuner recorded no tactic for %s M=%d (every profile failed; "
                "its log says why); using the untuned default", "/".join(names), inputs[0].shape[1],
            )
    else:
        key = str(path)
        if key not in _TUNE_FILES_LOADED:
            _TUNE_FILES_LOADED.add(key)
            if path.is_file():
                try:
                    tuner.load_configs(key)
                except Exception as exc:
                    logger.warning("flashinfer_bmm: cannot load flashinfer autotune cache %s (%s)", path, exc)
            else:
                logger.warning(
                    "flashinfer_bmm: autotune=cache but %s does not exist; untuned defaults until a run "
                    "with autotune=tune writes it", path,
                )
        runner, tactic = tuner.choose_one("fp8_gemm", runners, config, inputs)
    index = next(i for i, r in enumerate(runners) if r is runner)
    return names[index], tactic


def _cublaslt_algo(state: GemmDevice, tactic: Any, a3, b3, sa, sb, out3) -> torch.Tensor | None:
    """The 64-byte cuBLASLt algorithm for this exact problem: the heuristic's first choice (what
    ``bmm_fp8`` would pick on every call) or, tuned, the ``tactic``-th one. Host-only query."""
    if state.get_algos is None or state.run_with_algo is None:
        return None
    index = tactic if isinstance(tactic, int) and tactic >= 0 else 0
    algos = torch.empty(_CUBLASLT_MAX_ALGOS * _CUBLASLT_ALGO_BYTES, dtype=torch.uint8)
    try:
        count = int(state.get_algos(a3, b3, out3, sa, sb, state.workspace, algos))
    except Exception as exc:
        logger.info("flashinfer_bmm: bmm_fp8_get_algos failed (%s); per-call heuristic instead", exc)
        return None
    if index >= count:
        return None
    return algos[index * _CUBLASLT_ALGO_BYTES:(index + 1) * _CUBLASLT_ALGO_BYTES].clone()


def _build_plan(state: GemmDevice, name: str, tactic: Any, a3, b3, sa, sb, out3) -> tuple[_Plan, list]:
    """The fastest plan for ``(name, tactic)`` and the fallbacks to try if its first call fails."""
    api_backend = "cutlass" if name.startswith("cutlass") else name
    fallbacks: list[Callable[[], _Plan]] = [lambda: _ApiPlan(state.fi, api_backend)]
    if name == "cublas":
        if state.bmm is not None:
            plain = _CublasPlan(state.bmm, state.workspace)
            fallbacks.insert(0, lambda: plain)
        algo = _cublaslt_algo(state, tactic, a3, b3, sa, sb, out3)
        if algo is not None:
            return _CublasAlgoPlan(state.run_with_algo, state.workspace, algo, 0, max(tactic, 0)), fallbacks
        if state.bmm is not None:
            return fallbacks.pop(0)(), fallbacks
        return _ApiPlan(state.fi, "cublas"), []
    if name == "cudnn":
        try:
            plan = _CudnnPlan(state, tactic, a3, b3, out3)
        except Exception as exc:
            logger.warning("flashinfer_bmm: cannot build a direct cuDNN plan (%s: %s); using flashinfer.bmm_fp8",
                           type(exc).__name__, exc)
            return _ApiPlan(state.fi, "cudnn"), []
        if plan.ordered:
            def dict_pack() -> _Plan:
                plan.use_dict_pack()
                plan.kind += "-dict"
                return plan
            fallbacks.insert(0, dict_pack)
        return plan, fallbacks
    try:
        return _RunnerPlan(_runner_object(state, name), tactic, state.workspace), fallbacks
    except Exception as exc:
        logger.warning("flashinfer runner %s not constructible (%s); using flashinfer.bmm_fp8 (slower host path)",
                       name, exc)
        return _ApiPlan(state.fi, api_backend), []


def _make_plan(key: tuple, mode: str, x: torch.Tensor, w: torch.Tensor, sa, sb, out: torch.Tensor) -> _Plan:
    runner, _, autotune = mode.partition("/")
    with support.lock:
        plan = _PLANS.get(key)
        if plan is not None:
            return plan
        if mode != FAST_MODE:  # cuBLASLt's algorithm query is host-only: fine under capture; the rest is not
            support.refuse_in_capture(
                f"flashinfer_bmm's first call for {_describe_key(key)} (runner choice / plan build)")
        state = _GEMM_DEVICES.get(key[1]) or gemm_device(x.device)
        a3, out3 = x.unsqueeze(0), out.unsqueeze(0)
        names = _runner_names(state, runner, a3, w, sa, sb, out3)
        if autotune in ("cache", "tune"):
            name, tactic = _tuned_choice(state, names, autotune, [a3, w, sa, sb, out3, state.workspace])
        else:
            name, tactic = names[0], -1
        primary, fallbacks = _build_plan(state, name, tactic, a3, w, sa, sb, out3)
        logger.debug("flashinfer_bmm %s: runner %s tactic %s -> %s path", _describe_key(key), name, tactic,
                     primary.kind)
        plan = _GuardedPlan(key, primary, fallbacks) if fallbacks else primary
        _PLANS[key] = plan
        return plan



def _bmm_impl(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype, mode: str) -> torch.Tensor:
    m = x.shape[0]
    out = torch.empty((m, w.shape[2]), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    if x.data_ptr() % 16:
        raise InvalidInputError("flashinfer_bmm needs x_q's data pointer 16-byte aligned (cuBLASLt/cuDNN FP8)")
    key = (mode, x.get_device(), m, w.shape[1], w.shape[2], x.dtype, w.dtype, out_dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _make_plan(key, mode, x, w, x_scale, w_scale, out)
    plan(x.unsqueeze(0), w, out.unsqueeze(0), x_scale, w_scale)
    return out


def _bmm_fake(x, w, x_scale, w_scale, out_dtype, mode):
    return x.new_empty((x.shape[0], w.shape[2]), dtype=out_dtype)


def bmm_plan_for(x: torch.Tensor, w: torch.Tensor, x_scale, w_scale, out_dtype: torch.dtype, mode: str) -> str:
    """Which path ``mode`` takes for this problem (builds the plan if needed). For tests/benchmarks."""
    key = (mode, x.get_device(), x.shape[0], w.shape[1], w.shape[2], x.dtype, w.dtype, out_dtype)
    plan = _PLANS.get(key)
    if plan is None:
        out = torch.empty((x.shape[0], w.shape[2]), dtype=out_dtype, device=x.device)
        plan = _make_plan(key, mode, x, w, x_scale, w_scale, out)
    return _PLANS.get(key, plan).kind


# ------------------------------------------------------------------------------------- registration
_SCHEMA = ("flashinfer_bmm_fp8(Tensor x, Tensor w, Tensor x_scale, Tensor w_scale, ScalarType out_dtype, "
           "str mode) -> Tensor")

gemm_op = define_ops({BMM_OP: (_SCHEMA, _bmm_impl, _bmm_fake)}, ("CUDA",))[BMM_OP]
