"""One call from a checkpoint folder to a served model: :func:`load_pretrained`.

1. Reads ``config.json`` / ``hf_quant_config.json`` and detects the format (:mod:`.detect`), reads every shard's
   safetensors header (:mod:`.shards`).
2. Builds the ``transformers`` model from its config with every parameter on the meta device (no weight memory,
   no random initialisation; buffers such as rotary frequencies are computed as usual).
3. Plans (:mod:`.plan`, :mod:`.params`; checkpoint names the model's family renames are read under the model's
   names, :mod:`.names`; MoE experts stored one by one first get one linear each, :mod:`.experts`):
   which linears become :class:`~fp8_backends.layers.Fp8Linear` with which
   scheme, which siblings are fused, which modules stay in the model dtype; every name, dtype and shape is checked.
4. Reads every scale and bias of the FP8 linears (small) and checks their values (finite, > 0).
5. Only then changes the model (:class:`~fp8_backends.checkpoints.loader.Fp8CheckpointLoader`) and streams the
   shards: each file memory-mapped by ``safetensors``, one tensor at a time copied to its place on the device, the
   file closed before the next, so host memory beyond the model itself stays near one shard.
6. Processes every layer (providers resolved, weights prepared) and returns the model with a
   :class:`~fp8_backends.checkpoints.summary.CheckpointSummary`.

Any problem of steps 1-4 raises :class:`~fp8_backends.core.errors.CheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..core.errors import CheckpointError
from .summary import CheckpointSummary

if TYPE_CHECKING:
    from torch import nn

logger = logging.getLogger("fp8_backends")


class LoadedModel(NamedTuple):
    """What :func:`load_pretrained` returns: ``model, summary = load_pretrained(path)``."""

    model: Any
    summary: CheckpointSummary


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within it, every parameter a module registers is moved to the meta device as it is registered (buffers are
    not: what a model computes at construction, such as rotary frequencies, stays real). Construction then allocates
    and initialises no weights."""
    from torch import nn

    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and p.device.type != "meta":
            moved = type(p)(p.to("meta"), requires_grad=p.requires_grad)
            moved.__dict__.update(p.__dict__)
            module._parameters[name] = moved

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_skeleton(folder: Path, dtype: Any, model_class: Any = None, trust_remote_code: bool = False) -> nn.Module:
    """The ``transformers`` model of ``folder``'s config with its parameters on the meta device. ``model_class``: a
    ``transformers`` class or its name (default: the config's first ``architectures`` entry, else
    ``AutoModelForCausalLM``)."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("load_pretrained builds transformers models: "
                          "pip install 'fp8-backends[checkpoints]'") from exc
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except Exception as exc:  # any failure to read it (huggingface_hub's field validation derives from Exception only)
        raise CheckpointError(f"transformers cannot read this config: {type(exc).__name__}: {exc}",
                              file=str(folder / "config.json")) from None
    cls = model_class
    if isinstance(cls, str):
        cls = getattr(transformers, cls, None)
        if cls is None:
            raise CheckpointError(f"transformers has no model class {model_class!r}", file=str(folder / "config.json"))
    if cls is None:
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        cls = cls or transformers.AutoModelForCausalLM
    try:
        with parameters_on_meta():
            if hasattr(cls, "from_config"):
                model = cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
            else:
                model = cls._from_config(config, dtype=dtype)
    except Exception as exc:  # the config's values build no model (sizes that do not divide, a missing field)
        raise CheckpointError(f"transformers cannot build {getattr(cls, '__name__', cls)} from this config: "
                              f"{type(exc).__name__}: {exc}", file=str(folder / "config.json")) from None
    upcast = keep_in_fp32(model, dtype)
    if upcast:
        logger.debug("load_pretrained: %d parameter(s) kept in float32 as transformers keeps them (%s, ...)",
                     len(upcast), upcast[0])
    return model.eval()


def keep_in_fp32(model: nn.Module, dtype: Any) -> list[str]:
    """Make float32 the parameters ``transformers`` loads in float32 at ``dtype`` (its dtype plan: the model's
    ``_keep_in_fp32_modules`` at float16, ``_keep_in_fp32_modules_strict`` at float16 and bfloat16; globs searched in
    the parameter names), on the meta device before anything is loaded; returns their names. The checkpoint's
    tensors are then converted to float32 for them (:func:`.params.assign_params` converts to each parameter's
    dtype). A linear the checkpoint quantizes is served in FP8 whatever its dtype here."""
    import torch

    get_plan = getattr(model, "_get_dtype_plan", None)
    try:
        plan = get_plan(dtype) if callable(get_plan) else {}
    except Exception:  # a remote-code model's own plan that cannot be built: the model dtype everywhere
        return []
    globs = [k for k, v in (plan or {}).items() if isinstance(k, str) and k and v == torch.float32]
    if not globs:
        return []
    try:
        pattern = re.compile("|".join(f"(?:{g.replace('*', '.*')})" for g in globs))
    except re.error:
        return []
    upcast = []
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype != torch.float32 and pattern.search(name):
            param.data = param.data.to(torch.float32)
            upcast.append(name)
    return upcast


def load_pretrained(
    path: str | Path,
    *,
    backend: Any = None,
    device: Any = None,
    dtype: Any = None,
    fuse: Any = True,
    shard_scales: str = "auto",
    objective: Any = None,
    model_class: Any = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load an FP8 checkpoint folder (ModelOpt, compressed-tensors or Hugging Face ``fp8``) as a ``transformers``
    model served by the library's FP8 layers (module docstring). Returns ``(model, summary)``.

    Args:
        path: the checkpoint folder (``config.json``, ``*.safetensors`` and their index, ``hf_quant_config.json``).
        backend: GEMM provider of every FP8 layer (a name, ``"auto"``, an instance, or None: ``FP8_GEMM_BACKEND``,
            else auto).
        device: where the model runs (default: ``cuda`` when available, else ``cpu``).
        dtype: the model dtype (default bfloat16): activations, the modules kept unquantized, biases.
        fuse: run siblings that read one input (q/k/v, gate/up) as one GEMM where their scales allow it: True
            (:data:`fp8_backends.convert.DEFAULT_FUSE_GROUPS`), False, or leaf-name groups.
        shard_scales: fused siblings' differing per-tensor weight scales: ``"auto"`` (per channel where the provider
            can, else requantized to the largest; the summary says where), ``"per_channel"``, ``"requantize"``.
        objective: what ``auto`` optimizes (``"kernel"``, ``"host"``, ``"auto"``), as for ``Fp8Linear``.
        model_class: the ``transformers`` class (or its name) to build; default from the config.
        trust_remote_code: passed to ``transformers``.
    """
    import torch

    from .detect import detect
    from .experts import expand_experts
    from .loader import Fp8CheckpointLoader, block_layer_served, fuse_patterns
    from .names import model_names
    from .params import assign_params, linear_infos, plan_params
    from .plan import plan_linears
    from .shards import read_index

    clock = _PhaseClock()
    folder = Path(path)
    fmt = detect(folder)
    index = read_index(folder)
    clock.lap("read headers")
    dtype = torch.bfloat16 if dtype is None else dtype
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_skeleton(folder, dtype, model_class, trust_remote_code)
    clock.lap("build model")
    index, name_notes = model_names(model, index)
    expert_notes, _ = expand_experts(model, index.tensors, where=str(folder))  # a model of its own: no undo
    plan = plan_linears(fmt, linear_infos(model), index.tensors, fuse_groups=fuse_patterns(fuse),
                        block_served=block_layer_served(), where=str(folder))
    targets = plan_params(model, plan, index.tensors, where=str(folder))
    unused = [name for name in index.tensors if name not in targets and name not in plan.routes
              and name not in plan.ignored]
    loader = Fp8CheckpointLoader(plan, dtype=dtype, device=device, backend=backend, objective=objective,
                                 shard_scales=shard_scales)
    small = plan.small_tensors()
    clock.lap("plan")
    with torch.no_grad():
        _stream(small, loader.weight_loader)  # scales and biases: values checked before the model changes
        loader.create_weights(model)
        clock.lap("scales")
        first = {meta.name for meta in small}
        rest = [index.tensors[name] for name in index.tensors if name not in first and name not in unused]

        def put(name: str, tensor: torch.Tensor) -> None:
            if name in targets:
                assign_params(targets[name], tensor, device)
            else:
                loader.weight_loader(name, tensor)

        _stream(rest, put)
        model.to(device)
        clock.lap("weights", device)
        summary = loader.process_weights_after_loading()
        clock.lap("process", device)
    if unused:
        logger.warning("load_pretrained: %d checkpoint tensor(s) not used by %s: %s", len(unused),
                       type(model).__name__, ", ".join(unused[:5]))
    summary.ignored += unused
    summary.notes += name_notes + expert_notes
    summary.checkpoint_bytes = index.nbytes
    summary.load_seconds = clock.total()
    summary.load_phases = clock.phases
    logger.info("%s", summary)
    return LoadedModel(model, summary)


class _PhaseClock:
    """Seconds per named phase of a load (a CUDA device is synchronized where a phase ends with its copies queued,
    once per load: no per-tensor syncs)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def lap(self, name: str, device: Any = None) -> None:
        if device is not None and getattr(device, "type", None) == "cuda":
            import torch

            torch.cuda.synchronize(device)
        now = time.perf_counter()
        self.phases[name] = now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start


def _stream(metas: list[Any], sink: Any) -> None:
    """Read ``metas`` file by file (each file memory-mapped once, its tensors in order) into ``sink(name, tensor)``."""
    from safetensors import safe_open

    by_file: dict[str, list[Any]] = {}
    for meta in metas:
        by_file.setdefault(meta.file, []).append(meta)
    for file, metas_in in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for meta in metas_in:
                sink(meta.name, f.get_tensor(meta.key))


__all__ = ["LoadedModel", "build_skeleton", "load_pretrained", "parameters_on_meta"]
