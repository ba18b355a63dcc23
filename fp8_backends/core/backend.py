"""The provider interfaces: :class:`Fp8GemmBackend` and :class:`NormQuantBackend`.

A provider is a class registered under an entry point (group ``fp8_backends.gemm`` or
``fp8_backends.norm_quant``). It declares:

- ``name`` (and optional ``aliases``), a :class:`~fp8_backends.core.capabilities.Capabilities` record,
- ``requires``: import names it needs (probed lazily with ``importlib.util.find_spec``) and an
  ``install_hint`` shown when one is missing,
- ``options``: named sub-choices (e.g. a runner) with their allowed values, the first the default,
- ``tunable_options``: which of ``options`` the tuner may time value by value (``auto`` values skipped),

and implements ``prepare_weight_impl`` + ``gemm_impl`` (GEMM) or ``rmsnorm_quant_impl`` +
``fused_add_rmsnorm_quant_impl`` (norm-quant). The public methods validate every input first
(metadata only: no host-device sync) and then call the ``*_impl`` hooks, so a provider's kernel
never sees a malformed tensor. Keep provider modules import-light: stevedore imports every module
it scans, so import torch and kernel libraries inside methods.

A provider whose calls are torch ops subclasses :class:`OpGemmBackend` (implement ``load_op``) or
:class:`OpNormQuantBackend` (implement ``load_ops``) and inherits the hooks. Any provider may also supply the default
activation-quant kernels of :mod:`fp8_backends.quant` (:meth:`ProviderBase.activation_quant_kernels`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from . import group_scales, output_contract
from . import validation as V
from .capabilities import Capabilities, GemmCapabilities, NormQuantCapabilities
from .errors import BackendOptionError, BackendUnavailableError, Fp8BackendError, InvalidInputError
from .types import (
    DEFAULT_GROUP_SIZE,
    ActScale,
    Availability,
    BiasMode,
    DeviceKind,
    Fp8Dtype,
    GemmProblem,
    NormQuantProblem,
    OutDtype,
    PreparedWeight,
    QuantizedActivation,
    ScaleLayout,
    WeightScale,
)

if TYPE_CHECKING:
    import torch

    from .platform import Platform


@runtime_checkable
class ExpertsKernels(Protocol):
    """A MoE layer's routed experts over stacked FP8 weights, every (token, slot) pair against its own expert
    (what :meth:`ProviderBase.experts_kernels` returns). Weights ``w [E, N, K]`` float8_e4m3fn with scales
    ``w_scale [E, ceil(N/128), ceil(K/128)]`` fp32 (128x128 blocks), or, where the object's ``row_scales`` attribute is
    True, ``[E, N]`` fp32, one per output row (per-channel checkpoints; per-tensor ones repeated over the rows);
    activations quantized dynamically per group of 128 by the kernels themselves. No host-device sync: CUDA-graph
    capturable, traceable by ``torch.compile``.

    - ``plan(ids, experts, gemv_pairs)``: once per layer call, from the expert ids ``ids [P]`` (contiguous int;
      ids outside ``[0, E)`` contribute nothing): whatever :meth:`matmul` needs for these ids (None allowed), shared
      by the layer's projections. ``gemv_pairs``: the layer's bound below which a weight-streaming kernel is wanted.
    - ``matmul(x, w, w_scale, ids, rw, token_div, out_dtype, plan)``: ``[P, N]`` in ``out_dtype`` (bf16 / fp16 /
      fp32): row ``p`` is ``x[p // token_div] @ w[ids[p]]ᵀ`` (dequantized), times ``rw[p]`` (fp32 ``[P]``) where
      given; zero for ids outside ``[0, E)``. ``x``: ``[R, K]`` bf16 / fp16 / fp32, unquantized."""

    def plan(self, ids: torch.Tensor, experts: int, gemv_pairs: int) -> Any: ...

    def matmul(self, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, ids: torch.Tensor,
               rw: torch.Tensor | None, token_div: int, out_dtype: torch.dtype, plan: Any) -> torch.Tensor: ...


class ProviderBase(ABC):
    """What GEMM and norm-quant providers share: identity, availability, options, support checks."""

    kind: ClassVar[str]
    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    description: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities]
    requires: ClassVar[tuple[str, ...]] = ()
    install_hint: ClassVar[str] = ""
    options: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    #: option names whose values ``python -m fp8_backends.tune`` times one by one (values "auto" skipped)
    tunable_options: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: str) -> None:
        config: dict[str, str] = {key: values[0] for key, values in self.options.items()}
        for key, value in options.items():
            if key not in self.options:
                valid = ", ".join(self.options) or "none"
                raise BackendOptionError(f"{self.name}: unknown option {key!r} (options: {valid})")
            if str(value) not in self.options[key]:
                raise BackendOptionError(
                    f"{self.name}: option {key}={value!r} not one of {', '.join(self.options[key])}"
                )
            config[key] = str(value)
        self.config: dict[str, str] = config

    @classmethod
    def availability(cls) -> Availability:
        """Can this provider run at all in this process? Probes ``requires`` without importing them.

        Override to add checks (a feature probe, a build); keep it cheap and never raise.
        """
        missing = [mod for mod in _names(cls.requires) if _find_spec(mod) is None]
        if missing:
            return Availability.no(f"missing Python module(s): {', '.join(missing)}", cls.install_hint)
        return Availability.yes()

    @classmethod
    def cached_availability(cls) -> Availability:
        """:meth:`availability`, computed once per process (never raises), unless a fault was recorded for the class
        (:func:`record_fault`: a failed preload or construction), which wins. The probe is cleared when discovery
        rescans (an install may have brought a missing module), the faults only by
        ``fp8_backends.registry.discovery.refresh()``."""
        fault = _FAULTS.get(cls)
        if fault is not None:
            return fault
        cached = _AVAILABILITY.get(cls)
        if cached is None:
            try:
                cached = checked_availability(cls.availability())
            except Exception as exc:  # a broken plugin must not break discovery or resolution
                cached = Availability.no(f"availability() raised {type(exc).__name__}: {exc}")
            _AVAILABILITY[cls] = cached
        return cached

    #: device types (``"cuda"``, ...) for which :meth:`activation_quant_kernels` supplies the default implementation
    #: of :mod:`fp8_backends.quant`'s ops (empty: none, the default)
    activation_quant_devices: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def activation_quant_kernels(cls, device_type: str) -> Mapping[ActScale, Callable[..., Any]]:
        """The activation-quantization kernels this provider supplies for tensors of ``device_type`` (one of
        :attr:`activation_quant_devices`), ``{ActScale: fn}`` with the signatures of
        :func:`fp8_backends.quant.register_quant_impl`: ``fn(x, scale, fp8_dtype) -> q`` (static),
        ``fn(x, fp8_dtype) -> (q, scale)`` (dynamic per-tensor, per-token); the modes left out keep the reference.

        :mod:`fp8_backends.quant` asks the providers that declare ``device_type`` once per process, at the first
        quantization on that device type when nothing is registered for it, in ``auto``'s order (priority, built-ins
        first), and takes the first answer; providers that are disabled, blocked or unavailable are not asked.
        Raise :class:`~fp8_backends.core.errors.BackendUnavailableError` with the reason when the kernels cannot run
        here (an old GPU): the reason is logged and the next provider is asked. The default supplies none."""
        return {}

    #: device types (``"cuda"``, ...) for which :meth:`experts_kernels` supplies MoE grouped-experts kernels (empty:
    #: none, the default)
    experts_devices: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def experts_kernels(cls, device_type: str) -> ExpertsKernels | None:
        """The grouped-experts kernels this provider supplies for MoE layers on ``device_type`` (one of
        :attr:`experts_devices`; :class:`ExpertsKernels`), or None. A stacking
        :class:`~fp8_backends.layers.experts.PerExpertLinears` asks the providers that declare ``device_type``, once
        per process, in ``auto``'s order, and takes the first answer; providers that are disabled, blocked or
        unavailable are not asked. Raise :class:`~fp8_backends.core.errors.BackendUnavailableError` with the reason
        where the kernels cannot run here: the next provider is asked. The default supplies none."""
        return None

    def preload(self) -> None:
        """Load-time work that must not first happen inside ``torch.compile`` tracing or CUDA-graph
        capture: defining the provider's torch ops, importing its kernel modules. The registry calls it
        when it resolves this provider, and ``Fp8GemmBackend.prepare_weight`` before converting a weight,
        so a model compiled before any eager call still finds its ops defined. Idempotent; the default
        does nothing. A provider whose ops are defined on first use overrides it."""
        return None

    def ensure_preloaded(self) -> None:
        """:meth:`preload` once per instance. An exception from it (a broken plugin) marks the provider
        unavailable for this process (the listing and every later resolution give the reason; ``auto`` moves on
        to the next provider) and is raised as a :class:`BackendUnavailableError` that names it."""
        if self.__dict__.get("_preloaded"):
            return
        try:
            self.preload()
        except Exception as exc:
            if isinstance(exc, Fp8BackendError) and not isinstance(exc, BackendUnavailableError):
                raise
            reason = f"preload() failed ({type(exc).__name__}: {exc})"
            record_fault(type(self), reason)
            raise BackendUnavailableError(f"{self.label}: {reason}; the provider cannot be used") from exc
        self._preloaded = True

    def describe_config(self) -> str:
        """``"runner=cublas"`` style summary of the chosen options ("" when there are none)."""
        return ",".join(f"{k}={v}" for k, v in self.config.items())

    @property
    def label(self) -> str:
        cfg = self.describe_config()
        return f"{self.name}[{cfg}]" if cfg else self.name

    def extra_reasons(self, problem: Any, platform: Platform) -> list[str]:
        """Provider-specific reasons beyond the capability record (default: none)."""
        return []

    def explicit_only_reason(self, problem: Any, platform: Platform) -> str | None:
        """Why ``auto`` should pass over this provider for a problem it *can* serve (it then serves only
        when named, e.g. a kernel emulated on the CPU for tests), or None (default)."""
        return None

    def first_use_build(self, problem: Any, platform: Platform) -> str | None:
        """What the first call for ``problem`` would build for minutes before it runs (a JIT module or kernel
        library not built yet), as a sentence with the estimate and the command that builds it ahead; None when
        nothing long is pending (default). Builds of seconds (a kernel per shape) do not count. ``auto``'s built-in
        defaults pass over such a provider and the tuner skips it unless told otherwise; naming it still works (it
        builds, logged). Must be cheap and never build or raise."""
        return None

    def supports(self, problem: Any = None, platform: Platform | None = None) -> list[str]:
        """Every reason this provider cannot serve ``problem`` on ``platform``; empty means it can.

        ``platform`` defaults to the detected one for the problem's device (the registry's detection,
        :func:`fp8_backends.registry.platform.detect_platform`, installed here by :func:`set_platform_detector`).
        """
        if platform is None:
            platform = _detect_platform(None if problem is None else problem.device)
        avail = self.cached_availability()
        if not avail.ok:
            return [avail.reason + (f" (install: {avail.install_hint})" if avail.install_hint else "")]
        reasons = list(self.capabilities.check(problem, platform))
        reasons += reason_list(self.extra_reasons(problem, platform), "extra_reasons()")
        return reasons

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.label}>"

    def _require_device(self, t: torch.Tensor, what: str) -> None:
        if t.device.type not in {d.value for d in self.capabilities.devices}:
            have = ", ".join(sorted(d.value for d in self.capabilities.devices))
            raise InvalidInputError(f"{self.name} runs on {have} tensors; {what} is on {t.device}")


_AVAILABILITY: dict[type, Availability] = {}


def checked_availability(avail: Any) -> Availability:
    """``avail`` (what a provider's :meth:`~ProviderBase.availability` returned) when it is a well-formed
    :class:`Availability` (a bool ``ok``, string ``reason`` and ``install_hint``), else an unavailable one that says
    what is wrong with it: every listing and resolution reads these fields."""
    if not isinstance(avail, Availability):
        return Availability.no(f"availability() returned {type(avail).__name__}, not Availability")
    for field_name, want in (("ok", bool), ("reason", str), ("install_hint", str)):
        value = getattr(avail, field_name)
        if not isinstance(value, want):
            return Availability.no(f"availability() returned a malformed Availability: {field_name} must be a "
                                   f"{want.__name__}, got {value!r}")
    return avail


def _names(value: Any) -> tuple[str, ...]:
    """A class's ``requires``: one module name given as a lone string is that name, not its characters."""
    return (value,) if isinstance(value, str) else tuple(value)


#: the refusal of ``out=`` in the norm's dynamic modes (their codes and scales are allocated by the kernel's launch)
_DYNAMIC_OUT = ("out is not taken in the dynamic modes (per_token, per_token_group): the returned "
                "QuantizedActivation holds the codes and scales; pass out=None")


def support_reasons(backend: Any, problem: Any, platform: Any) -> list[str]:
    """``backend.supports(problem, platform)`` as a list of strings: a lone string is one reason; anything but a
    list or tuple of strings (``None``: an override that forgot its ``return``) is a reason of its own that says
    what it returned, so a malformed answer never reads as "can serve". Exceptions propagate."""
    value = backend.supports(problem, platform)
    if isinstance(value, (list, tuple)) and all(isinstance(r, str) for r in value):
        return list(value)
    if isinstance(value, str):
        return [value]
    return [f"supports() returned {value!r}, not a list of reasons"]


def reason_list(value: Any, what: str) -> list[str]:
    """The reasons a provider hook (``what``: ``"extra_reasons()"``, ...) returned, as a list of strings: a lone
    string is one reason (not one per character), None none; anything else is a reason of its own that says what the
    hook returned (the provider then cannot serve, and the caller sees why)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(r, str) for r in value):
        return list(value)
    return [f"{what} returned {value!r}, not a list of reasons"]
_INF = float("inf")
#: ``[torch.Tensor]`` once torch is imported (the hot paths compare output types with it; this module stays torch-free)
_TENSOR: list[Any] = [None]


def _tensor_type() -> Any:
    import torch

    _TENSOR[0] = torch.Tensor
    return torch.Tensor


#: ``[detect(device) -> Platform]``: how :meth:`ProviderBase.supports` finds the platform it was not given. The registry
#: installs its detection when its platform module is imported (:func:`set_platform_detector`): this floor never
#: imports the registry
_PLATFORM_DETECTOR: list[Callable[[Any], Platform] | None] = [None]


def set_platform_detector(detect: Callable[[Any], Platform] | None) -> None:
    """Make ``detect(device)`` (a :class:`~fp8_backends.core.types.DeviceKind`, or None: the current device) the
    platform :meth:`ProviderBase.supports` uses when given none (the registry's platform module sets it on import)."""
    _PLATFORM_DETECTOR[0] = detect


def _detect_platform(device: Any) -> Platform:
    detect = _PLATFORM_DETECTOR[0]
    if detect is None:  # the registry is not loaded: the CPU needs no detection, a GPU does
        if device is DeviceKind.CPU:
            from .platform import Platform

            return Platform(kind=DeviceKind.CPU, name="CPU")
        raise InvalidInputError(
            "supports() was given no platform and none is detected before the registry's platform module is "
            "loaded: pass platform= (fp8_backends.detect_platform(device), or simulate_platform(...))"
        )
    return detect(device)


#: providers found unusable at run time (a preload or a construction that raised), by class: kept across rescans
_FAULTS: dict[type, Availability] = {}


def record_fault(cls: type, reason: str) -> None:
    """Mark provider class ``cls`` unusable in this process with ``reason`` (its preload or construction raised)."""
    _FAULTS[cls] = Availability.no(reason)


_REFRESH_HOOKS: list[Callable[[], None]] = []


def on_provider_refresh(hook: Callable[[], None]) -> Callable[[], None]:
    """Have ``hook()`` called whenever the registry forgets the discovered providers
    (:func:`fp8_backends.registry.discovery.refresh`): for caches of decisions made from them (the activation-quant
    defaults, the MoE experts kernels), kept on the floors above the registry. Returns ``hook`` (a decorator)."""
    if hook not in _REFRESH_HOOKS:
        _REFRESH_HOOKS.append(hook)
    return hook


def run_refresh_hooks() -> None:
    """Call every :func:`on_provider_refresh` hook (the registry's ``refresh`` does)."""
    for hook in list(_REFRESH_HOOKS):
        hook()


def clear_availability_cache(*, faults: bool = True) -> None:
    """Forget the availability probes (and, unless ``faults=False``, the recorded faults)."""
    _AVAILABILITY.clear()
    if faults:
        _FAULTS.clear()


def _find_spec(mod: str):
    try:
        return importlib.util.find_spec(mod)
    except (ImportError, ValueError):
        return None


class Fp8GemmBackend(ProviderBase):
    """An FP8 GEMM provider: ``y[M, N] = (x_q·s_x) @ (w_q·s_w)ᵀ (+ bias)`` in ``out_dtype``.

    Subclasses set ``name`` and ``capabilities`` (a :class:`GemmCapabilities`) and implement:

    - ``prepare_weight_impl(w_q, w_scale, weight_scale) -> PreparedWeight``: once, at load time.
    - ``gemm_impl(x_q, prepared, x_scale, out_dtype, bias) -> Tensor``: the hot path.
    """

    kind: ClassVar[str] = "gemm"
    capabilities: ClassVar[GemmCapabilities] = GemmCapabilities()
    #: µs of host time one call costs on the compiled path (``torch.compile``, no CUDA graph): what the host spends
    #: to enqueue the GEMM, the figure ``auto`` weighs under the ``host`` selection objective
    #: (:mod:`fp8_backends.core.objective`: a call costs ``max(kernel µs, host µs + context)`` there). One figure
    #: per class unless :meth:`host_us_for` says otherwise. ``None`` (undeclared): the provider counts as costing as
    #: much host time as the most expensive declared candidate of the same decision, so it never wins on host time
    #: alone.
    host_us: ClassVar[float | None] = None
    #: µs of host time one call of a block-scaled problem (1x128 activation groups x 128x128 weight blocks) costs on
    #: the compiled path, for a provider whose block-wise path is another call than its others (an opaque op where the
    #: others trace, or the reverse). ``None``: :meth:`host_us_for`'s answer for every problem.
    block_host_us: ClassVar[float | None] = None
    _fast: Any = None  # hot-path check tables (_FastPath), built at the first gemm call

    @classmethod
    def block_fused_host_us_for(cls, m: int, options: Mapping[str, str]) -> float | None:
        """For a block-scaled problem at ``M`` with ``options``: the host µs of a call that quantizes the activation
        inside the provider's own launch (:meth:`traced_fused_quant_max_m`), where the class's call does so at that
        M; ``None`` (the default) where it does not (then :attr:`block_host_us` counts). A fused call saves the
        launches of the group quantization that every other provider's call is preceded by, which
        :attr:`block_host_us` figures do not count: declare it so that it compares like for like. Pure Python."""
        return None

    @classmethod
    def host_us_for(cls, m: int, n: int, k: int, options: Mapping[str, str]) -> float | None:
        """The host µs of one call at ``M x N x K`` with ``options`` (a measured candidate's), for a provider whose
        call costs differ by problem (the ``triton`` provider's persistent TMA configs launch through Triton's JIT,
        its other kernels from Inductor's code). Default: :attr:`host_us`. Pure Python, no device work: it is asked
        at resolution time, per M bucket. An exception or a value that is not a finite number >= 0 counts as
        :attr:`host_us` (:func:`fp8_backends.registry.host_aware.host_us_of`)."""
        return cls.host_us

    # ------------------------------------------------------------------ load time
    def prepare_weight(
        self, w_q: torch.Tensor, w_scale: torch.Tensor, *, block: tuple[int, int] | None = None,
        group_size: int | None = None,
    ) -> PreparedWeight:
        """Convert a weight once for this provider's kernels.

        - ``w_q``: ``[N, K]`` float8 (e4m3fn or e5m2), row-major contiguous.
        - ``w_scale``: float32; one value (0-d, ``[1]``, ``[1, 1]``) for per-tensor, or ``[N]`` /
          ``[N, 1]`` for per-channel; or, for block-wise FP8, ``[ceil(N/BN), ceil(K/BK)]`` per ``block = (BN, BK)``
          (float32, bfloat16 or float16 as checkpoints store them: converted to float32 here, once). Values must be
          finite and > 0 (checked here; this may sync).
        - ``block``: ``(BN, BK)`` to read ``w_scale`` as block scales. ``None``: block scales are recognised by their
          shape ``[ceil(N/128), ceil(K/128)]`` (128x128 blocks) where no other mode has that shape.
        - ``group_size``: the activation group size the block weight is served with (``BK`` by default; block mode
          only).

        Returns a :class:`PreparedWeight` that only this provider's ``gemm`` accepts.
        """
        V.require_tensor(w_q, "w_q")
        dtype = V.fp8_dtype_of(w_q, "w_q")
        V.require_row_major_2d(w_q, "w_q", "[N, K]")
        self._require_device(w_q, "w_q")
        self.ensure_preloaded()
        n, k = w_q.shape
        if n == 0 or k == 0:
            raise InvalidInputError(f"w_q must have N >= 1 and K >= 1, got [N, K] = [{n}, {k}]")
        caps = self.capabilities
        if dtype not in caps.input_dtypes:
            raise InvalidInputError(f"{self.name} does not support weight dtype {dtype.value}")
        shape = caps.alignment_reasons(n, k, DeviceKind.of(w_q.device))
        if shape:
            raise InvalidInputError(f"{self.name} cannot serve a [N, K] = [{n}, {k}] weight: " + "; ".join(shape))
        block, group_size = V.weight_block_of(w_scale, n, k, block, group_size)
        if block is not None:
            return self._prepare_block_scales(w_q, w_scale, dtype, block, group_size)
        V.require_fp32_scale(w_scale, "w_scale")
        V.require_same_device(w_scale, "w_scale", w_q.device)
        if V.is_scalar_shape(w_scale):
            mode = WeightScale.PER_TENSOR
        elif w_scale.numel() == n and (w_scale.dim() == 1 or tuple(w_scale.shape) == (n, 1)):
            mode = WeightScale.PER_CHANNEL
        else:
            raise InvalidInputError(
                f"w_scale must have one value (per-tensor) or N={n} values as [N] or [N, 1] (per-channel), or "
                f"[ceil(N/128), ceil(K/128)] = [{-(-n // 128)}, {-(-k // 128)}] (128x128 blocks; other blocks: "
                f"prepare_weight(..., block=(BN, BK))); got shape {tuple(w_scale.shape)}"
            )
        if mode not in caps.weight_scales:
            raise InvalidInputError(f"{self.name} does not support {mode.value} weight scales")
        V.check_scale_values(w_scale, "w_scale", force=True)
        return self._finish_prepare(self.prepare_weight_impl(w_q, w_scale, mode))

    def _prepare_block_scales(self, w_q: torch.Tensor, w_scale: torch.Tensor, dtype: Fp8Dtype, block: tuple[int, int],
                       group_size: int) -> PreparedWeight:
        """``prepare_weight`` for block scales: checked against the capabilities, made fp32 contiguous once."""
        n, k = w_q.shape
        problem = GemmProblem(n=n, k=k, input_dtype=dtype, weight_dtype=dtype, act_scale=ActScale.PER_TOKEN_GROUP,
                              weight_scale=WeightScale.BLOCK, group_size=group_size, weight_block=block,
                              device=DeviceKind.of(w_q.device))
        reasons = self.capabilities._block_reasons(problem) + self.block_reasons(problem)
        if reasons:
            raise InvalidInputError(f"{self.name} cannot serve block-wise FP8 {problem.describe()}: "
                                    + "; ".join(reasons))
        V.require_same_device(w_scale, "w_scale", w_q.device)
        V.check_scale_values(w_scale, "w_scale", force=True)  # the caller's tensor (a bf16 scale converts exactly)
        w_scale = V.block_scale_fp32(w_scale)
        prepared = self.prepare_weight_impl(w_q, w_scale, WeightScale.BLOCK)
        prepared.block, prepared.group_size = block, group_size
        return self._finish_prepare(prepared)

    def _finish_prepare(self, prepared: PreparedWeight) -> PreparedWeight:
        prepared.backend = self.name
        if self._fast is None:
            self._fast = _FastPath(self)
            output_contract.preload()  # the op a wrong fake output reaches under torch.compile
        return prepared

    def block_reasons(self, problem: GemmProblem) -> list[str]:
        """Why this provider cannot serve the block-wise ``problem`` (its kernels' shape rules: N or K multiples,
        ...) beyond what :attr:`capabilities` states, independent of the platform; :meth:`supports` adds them for
        block problems the capabilities accept, and :meth:`prepare_weight` refuses a block weight with them.
        Default: none."""
        return []

    def supports(self, problem: Any = None, platform: Platform | None = None) -> list[str]:
        reasons = super().supports(problem, platform)
        if (isinstance(problem, GemmProblem) and problem.block_scaled and self.capabilities.block_scaled
                and self.cached_availability().ok):
            reasons += reason_list(self.block_reasons(problem), "block_reasons()")
        return reasons

    @abstractmethod
    def prepare_weight_impl(
        self, w_q: torch.Tensor, w_scale: torch.Tensor, weight_scale: WeightScale
    ) -> PreparedWeight:
        """Provider hook behind :meth:`prepare_weight`; inputs are already validated."""

    def prepare_k_major(self, w_q: torch.Tensor, w_scale: torch.Tensor, weight_scale: WeightScale) -> PreparedWeight:
        """A ready-made ``prepare_weight_impl`` for kernels that read the ``[N, K]`` row-major weight as it is
        (K-major, no copy), with its scale as contiguous fp32 ``[1]`` (per-tensor), ``[N]`` (per-channel) or
        ``[ceil(N/BN), ceil(K/BK)]`` row-major (block)."""
        n, k = w_q.shape
        if weight_scale is WeightScale.BLOCK:
            scale = w_scale.contiguous()
        else:
            scale = w_scale.reshape(n if weight_scale is WeightScale.PER_CHANNEL else 1).contiguous()
        return PreparedWeight(data=w_q, scale=scale, n=n, k=k, dtype=Fp8Dtype.of(w_q.dtype),
                              weight_scale=weight_scale, backend=self.name)

    def require_contiguous_vectors(self, x_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        """For kernels that index a per-token ``x_scale [M, 1]`` and a ``bias [N]`` with unit stride."""
        if x_scale.numel() > 1 and not x_scale.is_contiguous():
            raise InvalidInputError(f"{self.name} needs a contiguous per-token x_scale [M, 1]")
        if bias is not None and not bias.is_contiguous():
            raise InvalidInputError(f"{self.name} needs a contiguous bias [N]")

    # ------------------------------------------------------------------ hot path
    def gemm(
        self,
        x_q: torch.Tensor,
        prepared: PreparedWeight,
        x_scale: torch.Tensor,
        *,
        out_dtype: torch.dtype | str = "bfloat16",
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[M, N]`` output in ``out_dtype``.

        - ``x_q``: ``[M, K]`` float8, row-major contiguous, on the weight's device.
        - ``prepared``: from this provider's :meth:`prepare_weight`.
        - ``x_scale``: float32, one value (per-tensor) or ``[M, 1]`` (per-token); for a block weight
          ``[M, ceil(K/G)]`` per token group, in any layout (one not the provider's
          ``capabilities.group_scale_layout`` is copied into it first: quantize into that layout to avoid the copy).
        - ``bias``: optional ``[N]`` in ``out_dtype``.
        """
        out = self._accept_common_case(x_q, prepared, x_scale, out_dtype, bias)
        if out is None:
            out = self.validate_gemm_inputs(x_q, prepared, x_scale, out_dtype, bias).torch_dtype()
            if x_q.shape[0] == 0:  # M = 0 (any scale mode): the empty result, without asking the kernel
                return x_q.new_empty((0, prepared.n), dtype=out)
            if prepared.block is not None:
                x_scale = group_scales.to_layout(x_scale, self.capabilities.group_scale_layout)
        y = self.gemm_impl(x_q, prepared, x_scale, out, bias)
        # the output contract, from metadata (no sync): a plain tensor [M, N] in `out` on x_q's device
        if (
            type(y) is not (_TENSOR[0] or _tensor_type())
            or y.dtype is not out
            or y.shape != (x_q.shape[0], prepared.n)
            or y.get_device() != x_q.get_device()
        ):
            return output_contract.gemm_output_failed(self, y, x_q, prepared.n, out)
        return y

    def _accept_common_case(
        self, x_q: Any, prepared: Any, x_scale: Any, out_dtype: Any, bias: Any
    ) -> torch.dtype | None:
        """The hot path's check in one pass: the torch output dtype when the call is certainly valid
        (GPU tensors, x_q in the weight's FP8 type, row-major with the weight's K, one fp32 scale on the
        same device, an output dtype and bias this provider takes), else ``None`` so that
        :meth:`validate_gemm_inputs` decides (and explains). Same conditions, a few µs cheaper."""
        fast = self._fast
        if fast is None:  # built by prepare_weight (eagerly, at load time)
            return None
        tensor = fast.tensor
        if (
            type(x_q) is not tensor
            or type(x_scale) is not tensor
            or type(prepared) is not PreparedWeight
            or prepared.backend != self.name
            or x_q.dtype is not fast.weight_torch_dtype(prepared)
            or x_q.dim() != 2
            or x_q.shape[1] != prepared.k
            or not x_q.is_contiguous()
            or x_scale.dtype is not fast.f32
            or x_scale.numel() != 1
            or x_scale.dim() > 2
            or not fast.per_tensor_ok
            or V.device_scale_checks()
        ):
            return None
        device = x_q.get_device()  # -1 for CPU tensors: they take the full path (scale values checked)
        if device < 0 or x_scale.get_device() != device or fast.data_device(prepared) != device:
            return None
        out = fast.out_dtypes.get(out_dtype)
        if out is None:
            return None
        if bias is not None and (
            not fast.bias_ok
            or type(bias) is not tensor
            or bias.dtype is not out
            or bias.dim() != 1
            or bias.shape[0] != prepared.n
            or bias.get_device() != device
        ):
            return None
        return out

    def check_input_dtype(self, x_dtype: Fp8Dtype, weight_dtype: Fp8Dtype) -> None:
        """Raise :class:`InvalidInputError` where this provider cannot take ``x_dtype`` activations against a
        ``weight_dtype`` weight (its ``input_dtypes``, ``mixed_inputs``): what :meth:`validate_gemm_inputs` checks of
        ``x_q``, askable before the activation is quantized."""
        caps = self.capabilities
        if x_dtype not in caps.input_dtypes:
            raise InvalidInputError(f"{self.name} does not support x_q dtype {x_dtype.value}")
        if x_dtype is not weight_dtype and not caps.mixed_inputs:
            raise InvalidInputError(
                f"{self.name} needs x_q and the weight in the same FP8 type ({x_dtype.value} vs {weight_dtype.value})"
            )

    def validate_gemm_inputs(
        self,
        x_q: torch.Tensor,
        prepared: PreparedWeight,
        x_scale: torch.Tensor,
        out_dtype: object,
        bias: torch.Tensor | None,
    ) -> OutDtype:
        """Metadata-only checks run before every kernel; returns the parsed output dtype."""
        if not isinstance(prepared, PreparedWeight) or prepared.backend != self.name:
            got = getattr(prepared, "backend", type(prepared).__name__)
            raise InvalidInputError(
                f"{self.name}.gemm needs a weight prepared by {self.name}.prepare_weight (got {got})"
            )
        V.require_tensor(x_q, "x_q")
        x_dtype = V.fp8_dtype_of(x_q, "x_q")
        V.require_row_major_2d(x_q, "x_q", "[M, K]")
        self._require_device(x_q, "x_q")
        device = x_q.device
        m, k = x_q.shape
        if k != prepared.k:
            raise InvalidInputError(f"x_q has K={k} but the weight has K={prepared.k}")
        self.check_input_dtype(x_dtype, prepared.dtype)
        caps = self.capabilities
        V.require_fp32_scale(x_scale, "x_scale")
        V.require_same_device(x_scale, "x_scale", device)
        if prepared.block is not None:
            V.require_group_scale(x_scale, m, k, prepared.group_size)
        elif not V.is_scalar_shape(x_scale):
            if tuple(x_scale.shape) != (m, 1):
                raise InvalidInputError(
                    f"x_scale must have one value (per-tensor) or shape [M, 1] = [{m}, 1] (per-token); "
                    f"got {tuple(x_scale.shape)}"
                )
            if ActScale.PER_TOKEN not in caps.act_scales:
                raise InvalidInputError(f"{self.name} does not support per-token activation scales")
        elif not (caps.act_scales & {ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC}):
            raise InvalidInputError(f"{self.name} does not support per-tensor activation scales")
        V.check_scale_values(x_scale, "x_scale")
        out = V.out_dtype_of(out_dtype)
        if out not in caps.out_dtypes:
            raise InvalidInputError(f"{self.name} does not support output dtype {out.value}")
        if bias is not None:
            V.require_tensor(bias, "bias")
            if caps.bias is BiasMode.NONE:
                raise InvalidInputError(f"{self.name} does not support bias")
            if tuple(bias.shape) != (prepared.n,):
                raise InvalidInputError(f"bias must have shape [N] = [{prepared.n}], got {tuple(bias.shape)}")
            if bias.dtype != out.torch_dtype():
                raise InvalidInputError(f"bias must be {out.value} (the output dtype), got {bias.dtype}")
            V.require_same_device(bias, "bias", device)
        V.require_same_device(prepared.data, "the prepared weight", device)
        return out

    @abstractmethod
    def gemm_impl(
        self,
        x_q: torch.Tensor,
        prepared: PreparedWeight,
        x_scale: torch.Tensor,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """Provider hook behind :meth:`gemm`; inputs are already validated."""

    def traced_extra_keys(self, prepared: PreparedWeight, act_scale: ActScale) -> frozenset[str] | None:
        """The keys of ``prepared.extra`` that :meth:`gemm_impl` may read for activations quantized in
        ``act_scale`` mode, or ``None`` (the default): any of them. A compiled layer
        (:mod:`fp8_backends.layers.traced_plan`) hands ``gemm_impl`` only these: each tensor it hands over is a graph
        input that Dynamo guards at every call of the compiled model, whether the kernel reads it or not."""
        return None

    #: how much faster than every other candidate the provider's measured kernel must be for the tuner to choose it
    #: (:func:`fp8_backends.tuning.engine.select_winner`): its median, raised by this fraction, must still be the
    #: fastest. 0: the measured fastest wins. A provider whose kernels others also reach and whose use costs more
    #: outside the kernel (host time per call, a heavy import at model load) declares the win that pays for it.
    win_margin: ClassVar[float] = 0.0

    #: activation modes :meth:`fused_quant_gemm_impl` may serve (empty: the provider never fuses)
    fused_act_quant: ClassVar[frozenset[ActScale]] = frozenset()

    #: the modes of :attr:`fused_act_quant` whose fused launch also pays inside a CUDA graph, where a launch costs no
    #: host time and only the kernels' GPU time counts (``None``: all of them). A fused kernel that computes a dynamic
    #: scale in every program can lose there to quantize + GEMM while it wins in eager mode by its saved launch
    fused_act_quant_in_graphs: ClassVar[frozenset[ActScale] | None] = None

    def fuses_act_quant(self, act_scale: ActScale, in_graph: bool) -> bool:
        """Whether a layer calls :meth:`fused_quant_gemm_impl` for ``act_scale`` (``in_graph``: a call captured into a
        CUDA graph)."""
        graph = self.fused_act_quant_in_graphs
        return act_scale in self.fused_act_quant and (not in_graph or graph is None or act_scale in graph)

    def fuses_act_quant_for(self, prepared: PreparedWeight, act_scale: ActScale, in_graph: bool) -> bool:
        """:meth:`fuses_act_quant` for one prepared weight: what a layer's eager plan asks. A provider whose fused
        launch pays inside CUDA graphs on some weights only (where it is the same launch as its GEMM's, so the
        quantization it saves is the whole difference) overrides this; the default answers per mode."""
        return self.fuses_act_quant(act_scale, in_graph)

    def fused_quant_gemm_impl(
        self,
        x: torch.Tensor,
        prepared: PreparedWeight,
        act_scale: ActScale,
        input_scale: torch.Tensor | None,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Optional eager hook: ``y [M, N]`` for the *unquantized* ``x [M, K]`` (the model dtype, unit column
        stride) quantized in ``act_scale`` to ``prepared``'s float8 type within the provider's own launch (one
        kernel instead of quantize + GEMM), equal to :func:`fp8_backends.quant.quantize` followed by
        :meth:`gemm_impl`; ``input_scale``: fp32 ``[1]`` for ``per_tensor_static``, else ``None``. Return ``None``
        to decline a call (the caller then quantizes and calls :meth:`gemm_impl`). Called by a processed
        :class:`~fp8_backends.layers.Fp8Linear`'s eager path for the modes in :attr:`fused_act_quant` (inputs
        validated as for :meth:`gemm_impl`), never under ``torch.compile``, where the quantization stays torch
        ops for Inductor to fuse into the producer."""
        return None

    def bind_fused_quant_gemm(
        self,
        prepared: PreparedWeight,
        act_scale: ActScale,
        input_scale: torch.Tensor | None,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
    ) -> Callable[[torch.Tensor], torch.Tensor | None]:
        """:meth:`fused_quant_gemm_impl` with everything but ``x`` bound, once per processed layer and bucket:
        ``x [M, K] -> y [M, N]`` or ``None`` (declined). The default closes over the hook; a provider may override it
        to bind its launch's own arguments (the eager call then reads no attribute of the provider or ``prepared``).
        Same results and the same declines as the hook."""
        hook = self.fused_quant_gemm_impl

        def fused(x: torch.Tensor) -> torch.Tensor | None:
            return hook(x, prepared, act_scale, input_scale, out_dtype, bias)

        return fused

    def traced_fused_quant_max_m(self, prepared: PreparedWeight, act_scale: ActScale) -> int:
        """The largest M up to which a compiled layer (:mod:`fp8_backends.layers.traced_plan`) hands this provider
        the *unquantized* activation for ``prepared`` in ``act_scale`` mode (:meth:`traced_fused_quant_gemm_impl`)
        instead of quantizing it with torch ops first; ``0`` (the default): never. A layer fuses an M bucket whose
        bound is at most this (never the last bucket, which serves every larger M). Where Inductor splits a
        quantization into several kernels (per-token groups: the group amax, the codes, the scale's layout), a
        provider whose kernel quantizes as it reads saves those launches, the host's time in a decode step."""
        return 0

    def traced_fused_quant_gemm_impl(
        self,
        x: torch.Tensor,
        prepared: PreparedWeight,
        act_scale: ActScale,
        input_scale: torch.Tensor | None,
        out_dtype: torch.dtype,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``y [M, N]`` for the unquantized ``x [M, K]`` (the model dtype; M up to
        :meth:`traced_fused_quant_max_m`), traceable by ``torch.compile`` (an op, a ``triton_op``): equal to
        :func:`fp8_backends.quant.quantize` in ``act_scale`` followed by :meth:`gemm_impl`. Inputs checked by the
        caller. Called only where :meth:`traced_fused_quant_max_m` is positive."""
        raise NotImplementedError(f"{self.name} declares no traced fused quantization")

    def problem_for(self, prepared: PreparedWeight, m: int | None = None, **kw: Any) -> GemmProblem:
        """The :class:`GemmProblem` a prepared weight stands for (convenience for callers)."""
        if prepared.block is not None:
            kw = {"act_scale": ActScale.PER_TOKEN_GROUP, "group_size": prepared.group_size,
                  "weight_block": prepared.block, **kw}
        return GemmProblem(n=prepared.n, k=prepared.k, m=m, weight_dtype=prepared.dtype,
                           weight_scale=prepared.weight_scale, **kw)


class _FastPath:
    """Per-provider lookup tables for :meth:`Fp8GemmBackend._accept_common_case` (built once)."""

    def __init__(self, backend: Fp8GemmBackend) -> None:
        import torch

        caps = backend.capabilities
        self.tensor = torch.Tensor
        self.f32 = torch.float32
        self.per_tensor_ok = bool(caps.act_scales & {ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC})
        self.bias_ok = caps.bias is not BiasMode.NONE
        self.fp8 = {d: d.torch_dtype() for d in caps.input_dtypes}
        self.out_dtypes: dict[Any, torch.dtype] = {}
        for od in caps.out_dtypes:
            td = od.torch_dtype()
            for key in (td, od, od.value):
                self.out_dtypes[key] = td
                V.out_dtype_of(key)  # warm the full path's memo too (no Enum calls while compiling)

    def weight_torch_dtype(self, prepared: PreparedWeight) -> Any:
        return self.fp8.get(prepared.dtype)

    @staticmethod
    def data_device(prepared: PreparedWeight) -> int:
        data = prepared.data
        return data.get_device() if hasattr(data, "get_device") else -2


class OpGemmBackend(Fp8GemmBackend):
    """A GEMM provider whose ``gemm_impl`` is one call of a torch op (the twin of :class:`OpNormQuantBackend`).

    The op takes the prepared weight's data and scale and, after the output dtype, the provider's own arguments
    (:meth:`op_arguments`, from ``self.config``)::

        op(x_q, prepared.data, x_scale, prepared.scale, bias, out_dtype, *op_args)   # capabilities.bias FUSED
        op(x_q, prepared.data, x_scale, prepared.scale, out_dtype, *op_args)         # otherwise (no bias argument;
                                                                                   # ADDED_AFTER: the base adds it)

    and returns ``[M, N]`` in ``out_dtype``. Subclasses implement :meth:`load_op` (called once per instance, at
    :meth:`preload`, so heavy imports stay lazy) and inherit :meth:`preload`, ``gemm_impl`` and a
    ``prepare_weight_impl`` that keeps the ``[N, K]`` weight as it is (:meth:`Fp8GemmBackend.prepare_k_major`;
    override it for another layout). The op may be an ``OpOverload`` of :func:`fp8_backends.core.oplib.define_ops`
    / :class:`~fp8_backends.core.oplib.LazyOps` (plain eager calls then run its implementation directly,
    :func:`fp8_backends.core.oplib.eager_fast`, while ``torch.compile`` traces the op: a ``triton_op``'s kernels, a
    plain op's fake), a ``torch.library.custom_op`` or any callable with that signature
    (:func:`fp8_backends.core.oplib.gemm_schema` and :func:`~fp8_backends.core.oplib.gemm_fake` give the first's
    schema and fake).
    """

    #: the kernel indexes a per-token ``x_scale [M, 1]`` and the bias with unit stride: refuse strided ones
    contiguous_vectors: ClassVar[bool] = False
    _op: Any = None

    def __init__(self, **options: str) -> None:
        super().__init__(**options)
        #: the op's trailing arguments, fixed by the options (computed once)
        self.op_args: tuple[Any, ...] = tuple(self.op_arguments())
        self._bias_in_op = self.capabilities.bias is BiasMode.FUSED

    @abstractmethod
    def load_op(self) -> Any:
        """The GEMM op (define it here if needed: this runs at load time, never while ``torch.compile`` traces)."""

    def op_arguments(self) -> tuple[Any, ...]:
        """The op's arguments after ``out_dtype``, from ``self.config`` (default: none)."""
        return ()

    def preload(self) -> None:
        self._loaded_op()

    def _loaded_op(self) -> Callable[..., Any]:
        op = self._op
        if op is None:
            op = self._op = _hot_callable(self.load_op())
        return op

    def prepare_weight_impl(
        self, w_q: torch.Tensor, w_scale: torch.Tensor, weight_scale: WeightScale
    ) -> PreparedWeight:
        return self.prepare_k_major(w_q, w_scale, weight_scale)

    def gemm_impl(self, x_q: torch.Tensor, prepared: PreparedWeight, x_scale: torch.Tensor, out_dtype: torch.dtype,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """``op(x_q, prepared.data, x_scale, prepared.scale, [bias,] out_dtype, *op_args)`` (see the class)."""
        op = self._op
        if op is None:
            op = self._loaded_op()
        if self.contiguous_vectors:
            self.require_contiguous_vectors(x_scale, bias)
        if self._bias_in_op:
            return op(x_q, prepared.data, x_scale, prepared.scale, bias, out_dtype, *self.op_args)
        y = op(x_q, prepared.data, x_scale, prepared.scale, out_dtype, *self.op_args)
        if bias is not None:
            y.add_(bias)  # BiasMode.ADDED_AFTER: one more kernel
        return y


def _hot_callable(op: Any) -> Callable[..., Any]:
    """``op`` as the hot path calls it: an ``OpOverload`` through :func:`fp8_backends.core.oplib.eager_fast` (its
    implementation directly in plain eager calls, where the library defined it), anything else as it is."""
    from torch._ops import OpOverload

    from .oplib import eager_fast

    return eager_fast(op) if isinstance(op, OpOverload) else op


class NormQuantBackend(ProviderBase):
    """A fused RMSNorm + static per-tensor FP8 quant provider.

    ``rmsnorm_quant``: ``q = clamp(rmsnorm(x) · weight / scale, ±448) -> float8_e4m3fn``, RMSNorm in
    fp32. ``fused_add_rmsnorm_quant`` first forms ``r = x + residual`` in fp32, writes it to
    ``residual`` **in place** (in the residual's dtype), and normalizes the fp32 sum.

    Subclasses implement ``rmsnorm_quant_impl(out, x, weight, scale, eps)`` and
    ``fused_add_rmsnorm_quant_impl(out, x, residual, weight, scale, eps)``, writing into ``out``.
    """

    kind: ClassVar[str] = "norm_quant"
    capabilities: ClassVar[NormQuantCapabilities] = NormQuantCapabilities()

    def _validate(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float,
        residual: torch.Tensor | None = None,
    ) -> None:
        V.require_tensor(x, "x")
        if x.dim() != 2:
            raise InvalidInputError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
        self._require_device(x, "x")
        try:
            dt = OutDtype.of(x.dtype)
        except ValueError:
            raise InvalidInputError(f"x must be bfloat16, float16 or float32, got {x.dtype}") from None
        if dt not in self.capabilities.in_dtypes:
            raise InvalidInputError(f"{self.name} does not support input dtype {dt.value}")
        hidden = x.shape[1]
        if hidden == 0:
            raise InvalidInputError("x must have a hidden size H >= 1, got [T, 0] (RMSNorm of an empty row)")
        if hidden % self.capabilities.hidden_align:
            raise InvalidInputError(
                f"{self.name} needs the hidden size to be a multiple of {self.capabilities.hidden_align}, "
                f"got {hidden}"
            )
        V.require_tensor(weight, "weight")
        if tuple(weight.shape) != (hidden,):
            raise InvalidInputError(f"weight must have shape [H] = [{hidden}], got {tuple(weight.shape)}")
        if weight.dtype != x.dtype:
            raise InvalidInputError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
        V.require_same_device(weight, "weight", x.device)
        V.require_fp32_scale(scale, "scale")
        if not V.is_scalar_shape(scale):
            raise InvalidInputError(f"scale must hold one value (static per-tensor), got shape {tuple(scale.shape)}")
        V.require_same_device(scale, "scale", x.device)
        V.check_scale_values(scale, "scale")
        V.require_eps(eps)
        if residual is not None:
            V.require_matching_residual(residual, x)

    _fast: Any = None  # hot-path check tables, built at the first call

    def _accept_common_case(self, x: Any, weight: Any, scale: Any, eps: Any, residual: Any = None) -> bool:
        """One-pass check of the common call (contiguous GPU ``x`` in a supported dtype with H >= 1, matching
        ``weight`` and ``residual``, one fp32 ``scale`` on the same device, finite float ``eps > 0``); ``False``
        sends the call through :meth:`_validate`, which accepts it or raises the library error."""
        fast = self._fast
        if fast is None:
            import torch

            caps = self.capabilities
            fast = self._fast = (torch.Tensor, torch.float32, frozenset(d.torch_dtype() for d in caps.in_dtypes),
                                 caps.hidden_align)
        tensor, f32, dtypes, align = fast
        if type(x) is not tensor or type(weight) is not tensor or type(scale) is not tensor:
            return False
        dtype = x.dtype
        if (
            dtype not in dtypes
            or x.dim() != 2
            or not x.is_contiguous()
            or x.shape[1] % align
            or not x.shape[1]
            or weight.dtype is not dtype
            or weight.dim() != 1
            or weight.shape[0] != x.shape[1]
            or scale.dtype is not f32
            or scale.numel() != 1
            or scale.dim() > 2
            or type(eps) is not float
            or not V.FP32_TINY <= eps < _INF
            or V.device_scale_checks()
        ):
            return False
        device = x.get_device()  # -1 for CPU: the full path checks scale values there
        if device < 0 or weight.get_device() != device or scale.get_device() != device:
            return False
        return residual is None or (
            type(residual) is tensor and residual.dtype is dtype and residual.shape == x.shape
            and residual.is_contiguous() and residual.get_device() == device
        )

    def rmsnorm_quant(
        self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, eps: float = 1e-6,
        *, out: torch.Tensor | None = None, act_scale: ActScale | str = ActScale.PER_TENSOR_STATIC,
        group_size: int = DEFAULT_GROUP_SIZE, scale_layout: ScaleLayout | str = ScaleLayout.ROW_MAJOR,
    ) -> QuantizedActivation:
        """``x: [T, H]`` bf16/fp16 with any strides (a row-strided ``x[:, :H]`` of a wider buffer reaches a provider
        declaring ``capabilities.strided_rows`` as it is; other layouts are copied row-major first), ``weight: [H]``
        same dtype, ``scale``: fp32 one value on x's device. Returns a :class:`QuantizedActivation` (``data: [T, H]``
        float8_e4m3fn, row-major).

        Dynamic modes (``act_scale="per_token"`` or ``"per_token_group"``, where the provider declares them in
        ``capabilities.act_scales``): ``scale`` is ``None`` and the scale is computed from the normalized rows:
        ``[T, 1]`` per token, or ``[T, ceil(H/group_size)]`` per group, written in ``scale_layout`` (the layout the
        next linear's kernel reads: :class:`~fp8_backends.core.types.ScaleLayout`)."""
        if act_scale is not ActScale.PER_TENSOR_STATIC and act_scale != "per_tensor_static":
            if out is not None:
                raise InvalidInputError(_DYNAMIC_OUT)
            return self._dynamic(x, None, weight, scale, eps, act_scale, group_size, scale_layout)[0]
        if not self._accept_common_case(x, weight, scale, eps):
            self._validate(x, weight, scale, eps)
            x = self._kernel_input(x, self.capabilities.strided_rows)
        out = self._out_buffer(x, out)
        returned = self.rmsnorm_quant_impl(out, x, weight, scale, float(eps))
        if returned is not None and returned is not out:  # the output contract: results go into `out`
            output_contract.norm_quant_output_failed(self, returned, "rmsnorm_quant_impl")
        return QuantizedActivation(out, scale, x.dtype, ActScale.PER_TENSOR_STATIC)

    def fused_add_rmsnorm_quant(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
        eps: float = 1e-6, *, out: torch.Tensor | None = None,
        act_scale: ActScale | str = ActScale.PER_TENSOR_STATIC, group_size: int = DEFAULT_GROUP_SIZE,
        scale_layout: ScaleLayout | str = ScaleLayout.ROW_MAJOR,
    ) -> tuple[QuantizedActivation, torch.Tensor]:
        """``residual <- x + residual`` (in place), then RMSNorm + quant of the sum.

        Returns ``(QuantizedActivation, residual)``; the second item is the updated ``residual``. Dynamic modes as in
        :meth:`rmsnorm_quant`."""
        if not self.capabilities.residual:
            raise InvalidInputError(f"{self.name} does not support the fused residual add")
        if residual is None:
            raise InvalidInputError("fused_add_rmsnorm_quant needs a residual [T, H] to add x to (without one: "
                                    "rmsnorm_quant)")
        if act_scale is not ActScale.PER_TENSOR_STATIC and act_scale != "per_tensor_static":
            if out is not None:
                raise InvalidInputError(_DYNAMIC_OUT)
            return self._dynamic(x, residual, weight, scale, eps, act_scale, group_size, scale_layout)
        if not self._accept_common_case(x, weight, scale, eps, residual):
            self._validate(x, weight, scale, eps, residual)
            x = self._kernel_input(x, self.capabilities.strided_rows)
        out = self._out_buffer(x, out)
        returned = self.fused_add_rmsnorm_quant_impl(out, x, residual, weight, scale, float(eps))
        if returned is not None and returned is not out:
            output_contract.norm_quant_output_failed(self, returned, "fused_add_rmsnorm_quant_impl")
        return QuantizedActivation(out, scale, x.dtype, ActScale.PER_TENSOR_STATIC), residual

    def _dynamic(
        self, x: Any, residual: Any, weight: Any, scale: Any, eps: Any, act_scale: Any, group_size: Any,
        scale_layout: Any,
    ) -> tuple[QuantizedActivation, Any]:
        """The dynamic modes: validate, run :meth:`rmsnorm_quant_dynamic_impl`, check its output."""
        mode = ActScale.of(act_scale)
        layout = ScaleLayout.of(scale_layout)
        caps = self.capabilities
        if mode is ActScale.PER_TENSOR_DYNAMIC:
            raise InvalidInputError("per_tensor_dynamic is not a norm-quant mode (its global amax needs every row "
                                    "first): quantize the norm's output with fp8_backends.quant instead")
        if mode not in caps.act_scales:
            raise InvalidInputError(f"{self.name} does not quantize {mode.value} (it serves "
                                    f"{', '.join(sorted(a.value for a in caps.act_scales))})")
        if scale is not None:
            raise InvalidInputError(f"scale must be None in the dynamic {mode.value} mode (it is computed)")
        if mode is ActScale.PER_TOKEN_GROUP and group_size not in caps.group_sizes:
            have = ", ".join(map(str, sorted(caps.group_sizes))) or "none"
            raise InvalidInputError(f"{self.name} does not serve group size {group_size!r} (serves {have})")
        self._validate_dynamic(x, weight, eps, residual)
        x = self._kernel_input(x, True)
        q, x_scale = self.rmsnorm_quant_dynamic_impl(x, weight, float(eps), residual, mode, int(group_size), layout)
        output_contract.check_norm_quant_dynamic(self, q, x_scale, x, mode, int(group_size), layout)
        return QuantizedActivation(q, x_scale, x.dtype, mode), residual

    @staticmethod
    def _kernel_input(x: Any, strided_rows: bool) -> Any:
        """``x [T, H]`` in the layout the hooks read: itself when row-major, or when ``strided_rows`` and its rows
        are strided apart (unit column stride, row stride >= H: ``x[:, :H]`` of a wider buffer); otherwise a
        row-major copy (a transposed view, a column slice with a column stride, broadcast or overlapping rows)."""
        t, h = x.shape
        if x.is_contiguous() or (strided_rows and (h <= 1 or x.stride(1) == 1) and (t <= 1 or x.stride(0) >= h)):
            return x
        return x.contiguous()

    def _validate_dynamic(self, x: Any, weight: Any, eps: Any, residual: Any) -> None:
        V.require_tensor(x, "x")
        if x.dim() != 2:
            raise InvalidInputError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
        self._require_device(x, "x")
        try:
            dt = OutDtype.of(x.dtype)
        except ValueError:
            raise InvalidInputError(f"x must be bfloat16, float16 or float32, got {x.dtype}") from None
        if dt not in self.capabilities.in_dtypes:
            raise InvalidInputError(f"{self.name} does not support input dtype {dt.value}")
        hidden = x.shape[1]
        if hidden == 0 or hidden % self.capabilities.hidden_align:
            raise InvalidInputError(f"{self.name} needs a hidden size H >= 1 and a multiple of "
                                    f"{self.capabilities.hidden_align}, got {hidden}")
        V.require_tensor(weight, "weight")
        if tuple(weight.shape) != (hidden,) or weight.dtype != x.dtype:
            raise InvalidInputError(f"weight must be [H] = [{hidden}] in x's dtype {x.dtype}; got "
                                    f"{tuple(weight.shape)} {weight.dtype}")
        V.require_same_device(weight, "weight", x.device)
        V.require_eps(eps)
        if residual is not None:
            V.require_matching_residual(residual, x)

    def rmsnorm_quant_dynamic_impl(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, act_scale: ActScale,
        group_size: int, scale_layout: ScaleLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Provider hook of the dynamic modes (inputs validated; only modes the capabilities declare reach it):
        returns ``(q [T, H] float8_e4m3fn row-major, scale)``, ``scale`` fp32 ``[T, 1]`` (``per_token``) or
        ``[T, ceil(H/group_size)]`` in ``scale_layout`` (``per_token_group``), computed from the fp32 RMSNorm of
        ``x`` (of ``x + residual``, written into ``residual`` in place in its dtype, when ``residual`` is given):
        :func:`fp8_backends.core.reference.rmsnorm_quant_dynamic` states the numbers. ``x`` has unit column
        stride and may have a row stride > H."""
        from .errors import UnsupportedProblemError

        raise UnsupportedProblemError(f"{self.name} declares no dynamic norm-quant mode")

    @staticmethod
    def _out_buffer(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        import torch

        if out is None:  # empty_like parses fewer arguments (about 2 µs less); row-major strides whatever x's
            return torch.empty_like(x, dtype=torch.float8_e4m3fn, memory_format=torch.contiguous_format)
        V.require_tensor(out, "out")
        if out.shape != x.shape or out.dtype != torch.float8_e4m3fn or out.device != x.device:
            raise InvalidInputError(
                f"out must be float8_e4m3fn {tuple(x.shape)} on {x.device}; got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )
        if not out.is_contiguous():
            raise InvalidInputError("out must be row-major contiguous")
        return out

    @abstractmethod
    def rmsnorm_quant_impl(
        self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float
    ) -> None:
        """Write ``clamp(rmsnorm(x)·weight / scale, ±448)`` as float8_e4m3fn into ``out``."""

    @abstractmethod
    def fused_add_rmsnorm_quant_impl(
        self, out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        scale: torch.Tensor, eps: float,
    ) -> None:
        """``residual <- x + residual``; write the quantized RMSNorm of the fp32 sum into ``out``."""

    def problem_for(self, x: torch.Tensor, residual: bool = False, **kw: Any) -> NormQuantProblem:
        return NormQuantProblem(hidden=x.shape[-1], tokens=x.shape[0], in_dtype=x.dtype,
                                residual=residual, device=DeviceKind(x.device.type), **kw)


class OpNormQuantBackend(NormQuantBackend):
    """A norm-quant provider whose two calls are torch ops ``(out, x, weight, scale, eps)`` and
    ``(out, x, residual, weight, scale, eps)``: subclasses implement :meth:`load_ops` (called once, at the
    first call, so heavy imports stay lazy) and inherit both ``*_impl`` hooks, which call the ops through
    :func:`fp8_backends.core.oplib.eager_fast`."""

    _ops: Any = None

    def __init__(self, **options: str) -> None:
        super().__init__(**options)
        # A provider made directly (no resolution, no layer) may see its first call inside torch.compile
        # tracing, which cannot define ops: define them now. Only when torch is already imported (whoever
        # passes tensors has imported it), so listing providers stays free of torch. A failure marks the
        # provider unavailable (see ensure_preloaded); the first call or a resolution meets the error again.
        if "torch" in sys.modules:
            with contextlib.suppress(BackendUnavailableError):
                self.ensure_preloaded()

    @abstractmethod
    def load_ops(self) -> tuple[Any, Any]:
        """``(rmsnorm_quant_op, fused_add_rmsnorm_quant_op)``."""

    def preload(self) -> None:
        self._loaded_ops()

    def _loaded_ops(self) -> tuple[Any, Any]:
        ops = self._ops
        if ops is None:
            from .oplib import eager_fast

            ops = self._ops = tuple(eager_fast(op) for op in self.load_ops())
        return ops

    def rmsnorm_quant_impl(
        self, out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, eps: float
    ) -> None:
        self._loaded_ops()[0](out, x, weight, scale, eps)

    def fused_add_rmsnorm_quant_impl(
        self, out: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        scale: torch.Tensor, eps: float,
    ) -> None:
        self._loaded_ops()[1](out, x, residual, weight, scale, eps)


__all__ = ["ExpertsKernels", "Fp8Dtype", "Fp8GemmBackend", "NormQuantBackend", "OpGemmBackend", "OpNormQuantBackend",
           "ProviderBase"]
