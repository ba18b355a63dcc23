"""Drop-in torch modules: :class:`Fp8Linear` and :class:`RMSNormFp8Quant`.

Lifecycle (as in vLLM): build the modules, load weights (``load_weights`` / ``load_shard`` /
``from_linear`` / ``from_fused_shards``, or ``load_state_dict``), move them to their device, then call
``process_weights_after_loading()`` once (or :func:`process_weights_after_loading` on the whole
model). That step checks every scale (this syncs: load time only), resolves the provider once and
prepares the weight for it. The forward then runs no resolution, no weight conversion and no
host-device sync, so it can be compiled (``torch.compile(fullgraph=True)``) and captured in a CUDA graph.

Fused hand-off: an :class:`RMSNormFp8Quant` given the next linear (``quant_linear=``) emits a
:class:`~fp8_backends.core.types.QuantizedActivation` from the fused norm+quant provider when that
linear takes a static per-tensor input scale; the linear then skips its own quantization.

Dtype changes (``model.half()``, ``model.to(torch.bfloat16)``) do not touch these modules' FP8
weights, fp32 scales or their model dtype: build them in the model's dtype. Device moves do apply;
a processed module re-processes itself after one.
"""

from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import quant
from ..core import validation as V
from ..core.backend import Fp8GemmBackend, NormQuantBackend
from ..core.errors import InvalidInputError, InvalidTypeError, UnsupportedProblemError
from ..core.objective import SelectionObjective
from ..core.types import (
    DEFAULT_GROUP_SIZE,
    DEFAULT_WEIGHT_BLOCK,
    ActScale,
    DeviceKind,
    Fp8Dtype,
    GemmProblem,
    NormQuantProblem,
    OutDtype,
    PreparedWeight,
    QuantizedActivation,
    WeightScale,
    _block_field,
)
from ..registry.per_m import PerMGemm, init_fp8_gemm
from .eager_plan import EagerPlan, bind_per_m
from .general_path import apply_fp8_linear
from .traced_plan import TracedNorm, TracedPlan, bind_traced, bind_traced_norm

if TYPE_CHECKING:
    from collections.abc import Callable

logger = logging.getLogger("fp8_backends")

#: how a fused layer's differing shard scales are combined (see :meth:`Fp8Linear.from_fused_shards`)
SHARD_SCALE_POLICIES = ("auto", "per_channel", "requantize")
_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack


def _positive_int(value: object, what: str) -> int:
    """``value`` as an int >= 1 (any integer type, not a bool); else the library's error."""
    if isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be a positive integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidTypeError(f"{what} must be a positive integer, got {type(value).__name__} {value!r}") from None
    if number <= 0:
        raise InvalidInputError(f"{what} must be positive, got {number}")
    return number


def _device(device: object) -> torch.device | None:
    """``device`` as a torch.device (None stays None), or the library's error for one torch does not know."""
    if device is None or isinstance(device, torch.device):
        return device
    if not isinstance(device, (str, int)) or isinstance(device, bool):
        raise InvalidTypeError(f"device must be a torch.device, a string or an index, got {type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidInputError(f"unsupported device {device!r}: {exc}") from None


def _check_backend_request(backend: object, base: type) -> None:
    """At construction: a backend must be None, a request string (parsed now: malformed options fail here, not at
    processing) or a ``base`` instance."""
    if backend is None or isinstance(backend, base):
        return
    if not isinstance(backend, str):
        raise InvalidTypeError(f"backend must be a name, a {base.__name__} or None, got {type(backend).__name__}")
    from ..registry.resolution import BackendRequest

    BackendRequest.parse(backend)


def _model_dtype(dtype: object) -> torch.dtype:
    try:
        return OutDtype.of(dtype).torch_dtype()
    except ValueError:
        raise InvalidInputError(f"model dtype must be bfloat16, float16 or float32, got {dtype!r}") from None


def _fp8_dtype(dtype: object, what: str) -> Fp8Dtype:
    try:
        return Fp8Dtype.of(dtype)
    except ValueError:
        raise InvalidInputError(f"{what} must be e4m3fn or e5m2, got {dtype!r}") from None


def _scale_tensor(value: object, what: str, device: torch.device) -> torch.Tensor:
    """A float or tensor as an fp32 tensor on ``device`` (values are checked at load time)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor([float(value)], dtype=torch.float32, device=device)
    V.require_fp32_scale(value, what)
    return value


def _check_values(t: torch.Tensor, what: str) -> None:
    """Load-time value check (syncs): finite and > 0, NaN meaning "never loaded"."""
    bad = V.bad_scale_values(t)
    if bool(bad.any()):
        if bool(torch.isnan(t).all()):
            raise InvalidInputError(f"{what} is missing (never loaded) or NaN")
        sample = t[bad].flatten()[:4].tolist()
        raise InvalidInputError(f"{what} must be finite and > 0; got {sample}")


def _check_all(items: list[tuple[torch.Tensor, str]]) -> None:
    """:func:`_check_values` of every ``(tensor, what)`` with one device sync when all are fine (a model load checks
    a hundred scales); the first bad one raises its own error."""
    flat = torch.cat([t.reshape(-1) for t, _ in items]) if len(items) > 1 else items[0][0].reshape(-1)
    if bool(V.bad_scale_values(flat).any()):
        for t, what in items:
            _check_values(t, what)


def _resolve(kind: str, backend: Any, problem: Any) -> Any:
    """A provider for ``problem``: a given instance (checked: it must serve it), else a name or None
    resolved by the registry (``None``: env var or ``auto``). Raises the library's errors."""
    from ..registry.resolution import resolve_or_check

    return resolve_or_check(kind, backend, problem)


def _resolve_gemm(backend: str | Fp8GemmBackend | None, problem: GemmProblem) -> Fp8GemmBackend:
    return _resolve("gemm", backend, problem)


def _resolve_norm(backend: str | NormQuantBackend | None, problem: NormQuantProblem) -> NormQuantBackend:
    return _resolve("norm_quant", backend, problem)


def _requests_auto(kind: str, backend: str | object | None) -> bool:
    """Whether ``backend`` (``None``: the kind's environment variable, else ``auto``) asks for ``auto``."""
    from ..registry.resolution import requests_auto

    return requests_auto(kind, backend)


def _quant_compile_mode() -> str:
    from .. import quant

    return quant.compile_mode()


class NoBackward(torch.autograd.Function):
    """Identity forward; a backward through an FP8 layer raises :class:`InvalidInputError` (the quantization has no
    gradient the library defines: a wrong one must not flow silently)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        raise InvalidInputError("FP8 layers have no backward: run them under torch.no_grad() or "
                                "torch.inference_mode() (inference only)")


def no_backward(y: torch.Tensor, x: Any) -> torch.Tensor:
    """``y``, the output of an FP8 layer on ``x`` (a tensor or a :class:`QuantizedActivation`), tied to ``x`` through
    :class:`NoBackward` where autograd would differentiate it (grad mode on and ``x`` or ``y`` requiring grad): a
    backward then raises the library's error. A kernel writes ``y`` outside autograd (an op provider's output never
    requires grad), so ``y`` alone cannot tell: the input does."""
    if not torch.is_grad_enabled():
        return y
    data = x.data if isinstance(x, QuantizedActivation) else x
    if y.requires_grad or (isinstance(data, torch.Tensor) and data.requires_grad):
        return NoBackward.apply(y, data) if isinstance(data, torch.Tensor) else NoBackward.apply(y)
    return y


#: the tensors an :class:`Fp8Linear`'s prepared weight is made from (replacing one makes the layer unprocessed)
_WEIGHT_TENSORS = frozenset({"weight", "weight_scale", "input_scale", "bias"})


class Fp8Linear(nn.Module):
    """``y = x @ Wᵀ (+ bias)`` with ``W = w_q · s_w`` in FP8 and the activation quantized to FP8.

    Buffers (also the ``state_dict`` keys):

    - ``weight``: ``[N, K]`` fp8 (``weight_dtype``), row-major.
    - ``weight_scale``: fp32 ``[1]`` (per-tensor) or ``[N]`` (per-channel). A fused layer
      (``shard_sizes``) keeps one value per output row until processing reduces it.
    - ``input_scale``: fp32 ``[1]`` for ``act_scale="per_tensor_static"`` (one per shard before
      processing for fused layers; their max after), else ``None``.
    - ``bias``: ``[N]`` in the model ``dtype``, or ``None``.

    Scale buffers start as NaN, so a scale that was never loaded is reported at load time.

    Args:
        in_features: ``K``.
        out_features: ``N``.
        bias: whether the layer has a bias.
        act_scale: ``"per_tensor_static"`` (calibrated ``input_scale``), ``"per_tensor_dynamic"`` or
            ``"per_token"``: how high-precision inputs are quantized, and the only mode of
            :class:`QuantizedActivation` this layer accepts.
        weight_scale: ``"per_tensor"``, ``"per_channel"`` or ``"block"`` (of the checkpoint's weight). Block-wise
            FP8 (DeepSeek-V3, Qwen3-FP8): ``weight_scale [ceil(N/BN), ceil(K/BK)]`` per ``weight_block`` and the
            activation quantized per token in groups of ``group_size`` (``act_scale="per_token_group"``, the
            default for block weights).
        weight_block: ``(BN, BK)`` of block weight scales (default 128x128).
        group_size: the activation group along K of block-wise layers (default: ``BK``).
        weight_dtype: FP8 element type of the weight.
        input_dtype: FP8 element type of the quantized activation.
        dtype: the model dtype: what the forward takes and returns (and the bias dtype).
        backend: GEMM provider name (``"auto"``, ``"torch_scaled_mm"``, ``"DIST:NAME@opt=v"``), a
            provider instance, or ``None`` (``FP8_GEMM_BACKEND``, else ``auto``); resolved at
            :meth:`process_weights_after_loading`.
        shard_sizes: output sizes of the logical weights fused into this one (QKV: ``[q, k, v]``,
            gate-up: ``[i, i]``), loaded with :meth:`load_shard`; they must sum to ``out_features``.
        shard_scales: how shards with different scales are combined at processing: ``"per_channel"``
            keeps each shard's scale per output row (exact; needs a provider with per-channel weight
            scales), ``"requantize"`` rescales every shard to the largest scale (one per-tensor scale),
            ``"auto"`` (default) keeps them per channel when the resolved provider's
            ``capabilities.weight_scales`` allow it and requantizes otherwise.
        device: where the buffers are allocated.
        objective: what ``auto`` optimizes per M bucket (:mod:`fp8_backends.core.objective`): ``"kernel"``
            (the fastest kernel in CUDA graphs), ``"host"`` (the cost of a call the host enqueues: eager,
            ``torch.compile`` without CUDA graphs) or ``"auto"`` (the default unless ``FP8_SELECTION_OBJECTIVE``
            says otherwise: host choices for eager and compiled calls, kernel choices for eager calls made while a
            CUDA graph is captured, both prepared when they differ). An explicit backend ignores it.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        act_scale: ActScale | str | None = None,
        weight_scale: WeightScale | str = WeightScale.PER_TENSOR,
        weight_dtype: object = Fp8Dtype.E4M3FN,
        input_dtype: object = Fp8Dtype.E4M3FN,
        dtype: object = torch.bfloat16,
        backend: str | Fp8GemmBackend | None = None,
        shard_sizes: Sequence[int] | None = None,
        shard_scales: str = "auto",
        device: torch.device | str | None = None,
        objective: SelectionObjective | str | None = None,
        weight_block: Sequence[int] = DEFAULT_WEIGHT_BLOCK,
        group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.in_features = _positive_int(in_features, "in_features")
        self.out_features = _positive_int(out_features, "out_features")
        try:
            self.weight_scale_mode = WeightScale(weight_scale)
        except (ValueError, TypeError):
            raise InvalidInputError(
                f"weight_scale must be per_tensor, per_channel or block, got {weight_scale!r}") from None
        block_scaled = self.weight_scale_mode is WeightScale.BLOCK
        if act_scale is None:
            act_scale = ActScale.PER_TOKEN_GROUP if block_scaled else ActScale.PER_TENSOR_DYNAMIC
        self.act_scale = ActScale.of(act_scale)
        # the block-wise pairing and sizes, checked as the problem checks them (one error for a bad combination)
        block = _block_field("Fp8Linear", weight_block)
        if not block_scaled and (group_size is not None or block != DEFAULT_WEIGHT_BLOCK):
            raise InvalidInputError("group_size and weight_block are block-wise FP8 arguments: give "
                                    f"weight_scale='block' too (got weight_scale={self.weight_scale_mode.value})")
        check = GemmProblem(n=self.out_features, k=self.in_features, act_scale=self.act_scale,
                            weight_scale=self.weight_scale_mode, weight_block=block,
                            group_size=(block[1] if group_size is None else group_size) if block_scaled else 128)
        self.weight_block: tuple[int, int] | None = check.weight_block if block_scaled else None
        self.group_size: int | None = check.group_size if block_scaled else None
        _check_backend_request(backend, Fp8GemmBackend)
        self.weight_dtype = _fp8_dtype(weight_dtype, "weight_dtype")
        self.input_dtype = _fp8_dtype(input_dtype, "input_dtype")
        self.dtype = _model_dtype(dtype)
        self.out_dtype = OutDtype.of(self.dtype)
        self.backend_request = backend
        #: the selection objective asked for (None: ``FP8_SELECTION_OBJECTIVE``, else auto, read at processing)
        self.objective_request = None if objective is None else SelectionObjective.of(objective)
        if not isinstance(bias, bool) and bias not in (0, 1):
            raise InvalidTypeError(f"bias must be a bool, got {type(bias).__name__} {bias!r}")
        device = _device(device)
        if shard_scales not in SHARD_SCALE_POLICIES:
            raise InvalidInputError(
                f"shard_scales must be one of {', '.join(SHARD_SCALE_POLICIES)}, got {shard_scales!r}"
            )
        self.shard_scales = shard_scales
        if shard_sizes is not None:
            if isinstance(shard_sizes, (str, bytes)) or not hasattr(shard_sizes, "__iter__"):
                raise InvalidTypeError(f"shard_sizes must be a sequence of ints, got {type(shard_sizes).__name__}")
            sizes = [_positive_int(s, "shard_sizes item") for s in shard_sizes]
            if not sizes or sum(sizes) != self.out_features:
                raise InvalidInputError(
                    f"shard_sizes must be positive and sum to out_features={self.out_features}, got {sizes}"
                )
        else:
            sizes = None
        self.shard_sizes: list[int] | None = sizes
        n, k = self.out_features, self.in_features
        fused = sizes is not None
        if block_scaled and sizes is not None and V.blocks_straddle_shards(sizes, self.weight_block[0]):
            raise InvalidInputError(
                f"fused block-scaled shards {sizes}: every shard but the last must span whole {self.weight_block[0]}-"
                "row weight blocks (a block would straddle two shards); fuse only block-aligned siblings")
        self.register_buffer("weight", torch.empty((n, k), dtype=self.weight_dtype.torch_dtype(), device=device))
        if block_scaled:
            grid = (-(-n // self.weight_block[0]), -(-k // self.weight_block[1]))
            self.register_buffer("weight_scale", torch.full(grid, float("nan"), device=device))
        else:
            n_scales = n if (fused or self.weight_scale_mode is WeightScale.PER_CHANNEL) else 1
            self.register_buffer("weight_scale", torch.full((n_scales,), float("nan"), device=device))
        if self.act_scale is ActScale.PER_TENSOR_STATIC:
            self.register_buffer("input_scale", torch.full((len(sizes) if fused else 1,), float("nan"),
                                                           device=device))
        else:
            self.register_buffer("input_scale", None)
        self.register_buffer("bias", torch.zeros(n, dtype=self.dtype, device=device) if bias else None)
        # set by process_weights_after_loading
        self._raw = True  # scales still in their loaded form (per-row / per-shard)
        self.kernel: PerMGemm | None = None  # the weight's provider(s) per M bucket, with their prepared weights
        self._plan: EagerPlan | None = None  # the eager hot path, bound at processing
        self._traced: TracedPlan | None = None  # what torch.compile traces, bound at processing
        self.problem: GemmProblem | None = None

    # ------------------------------------------------------------------------------ construction
    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        act_scale: ActScale | str | None = None,
        weight_scale: WeightScale | str = WeightScale.PER_TENSOR,
        input_scale: torch.Tensor | float | None = None,
        weight_dtype: object = Fp8Dtype.E4M3FN,
        input_dtype: object = Fp8Dtype.E4M3FN,
        backend: str | Fp8GemmBackend | None = None,
        process: bool = True,
        objective: SelectionObjective | str | None = None,
        weight_block: Sequence[int] = DEFAULT_WEIGHT_BLOCK,
        group_size: int | None = None,
    ) -> Fp8Linear:
        """Quantize a bf16/fp16/fp32 ``nn.Linear`` (``weight [N, K]``): ``s_w = amax / fmax`` per tensor, per output
        row or per ``weight_block`` block (``weight_scale="block"``), ``w_q = clamp(w / s_w) -> fp8``. The model dtype
        is the linear's.
        A static ``act_scale`` needs ``input_scale`` (a calibrated float or fp32 one-value tensor).
        ``process=True`` also runs :meth:`process_weights_after_loading` (weights already in place).
        ``objective``: what ``auto`` optimizes (see the class; default ``FP8_SELECTION_OBJECTIVE``, else auto)."""
        from ..core import reference

        if not isinstance(linear, nn.Linear):
            raise InvalidInputError(f"from_linear needs an nn.Linear, got {type(linear).__name__}")
        w = linear.weight.detach()
        if w.device.type not in {d.value for d in DeviceKind}:  # quantizing reads the values: none on meta
            raise InvalidInputError(f"cannot quantize a weight on {w.device}: it holds no values")
        dtype = _model_dtype(w.dtype)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, act_scale=act_scale,
                    weight_scale=weight_scale, weight_dtype=weight_dtype, input_dtype=input_dtype, dtype=dtype,
                    backend=backend, device=w.device, objective=objective, weight_block=weight_block,
                    group_size=group_size)
        fp8 = layer.weight_dtype
        if layer.weight_scale_mode is WeightScale.PER_TENSOR:
            w_q, w_s = reference.quantize_dynamic_per_tensor(w, fp8)
        elif layer.weight_scale_mode is WeightScale.BLOCK:
            w_q, w_s = reference.quantize_block(w, layer.weight_block, fp8)
        else:
            w_q, w_s = reference.quantize_per_token(w, fp8)
        layer.load_weights(w_q, w_s if w_s.dim() == 2 and layer.weight_block else w_s.reshape(-1),
                           input_scale=input_scale,
                           bias=None if linear.bias is None else linear.bias.detach())
        if process:
            layer.process_weights_after_loading()
        return layer

    @classmethod
    def from_fused_shards(
        cls,
        shards: Sequence[tuple[torch.Tensor, torch.Tensor | float]],
        *,
        input_scales: Sequence[torch.Tensor | float] | None = None,
        bias: torch.Tensor | None = None,
        act_scale: ActScale | str | None = None,
        weight_dtype: object = None,
        input_dtype: object = Fp8Dtype.E4M3FN,
        dtype: object = torch.bfloat16,
        backend: str | Fp8GemmBackend | None = None,
        shard_scales: str = "auto",
        process: bool = True,
        objective: SelectionObjective | str | None = None,
    ) -> Fp8Linear:
        """One linear from several checkpoint weights that share the input (QKV, gate-up).

        ``shards``: ``(w_q [N_i, K] fp8, w_scale)`` pairs, each scale one value or ``[N_i]``.
        ``input_scales``: one static input scale per shard (their max is used: the shards read the
        same quantized input); selects ``act_scale="per_tensor_static"`` unless given otherwise.
        Each shard keeps its own scale until processing, which combines them by ``shard_scales``
        (never by keeping only the first shard's scale)."""
        if not shards:
            raise InvalidInputError("from_fused_shards needs at least one (w_q, w_scale) shard")
        for i, shard in enumerate(shards):
            if not (isinstance(shard, (tuple, list)) and len(shard) == 2):
                raise InvalidInputError(f"shard {i} must be a (w_q, w_scale) pair")
            V.require_tensor(shard[0], f"shard {i} w_q")
            if shard[0].dim() != 2:
                raise InvalidInputError(f"shard {i} w_q must be 2-D [N_i, K], got {tuple(shard[0].shape)}")
        w0 = shards[0][0]
        if act_scale is None:
            act_scale = ActScale.PER_TENSOR_STATIC if input_scales is not None else ActScale.PER_TENSOR_DYNAMIC
        layer = cls(w0.shape[1], sum(s[0].shape[0] for s in shards), bias=bias is not None, act_scale=act_scale,
                    weight_dtype=weight_dtype if weight_dtype is not None else _fp8_guess(w0),
                    input_dtype=input_dtype, dtype=dtype, backend=backend,
                    shard_sizes=[s[0].shape[0] for s in shards], shard_scales=shard_scales, device=w0.device,
                    objective=objective)
        if input_scales is not None and len(input_scales) != len(shards):
            raise InvalidInputError(f"got {len(input_scales)} input scales for {len(shards)} shards")
        for i, (w_q, w_s) in enumerate(shards):
            layer.load_shard(i, w_q, w_s, input_scale=None if input_scales is None else input_scales[i])
        if bias is not None:
            layer.load_bias(bias)
        if process:
            layer.process_weights_after_loading()
        return layer

    # ------------------------------------------------------------------------------ loading
    def _check_weight(self, w_q: torch.Tensor, rows: int, what: str) -> None:
        V.require_tensor(w_q, what)
        dtype = V.fp8_dtype_of(w_q, what)
        if dtype is not self.weight_dtype:
            raise InvalidInputError(f"{what} is {dtype.value} but the layer holds {self.weight_dtype.value} weights")
        if tuple(w_q.shape) != (rows, self.in_features):
            raise InvalidInputError(f"{what} must be [{rows}, {self.in_features}], got {tuple(w_q.shape)}")

    def _scale_rows(self, w_scale: object, rows: int, what: str) -> torch.Tensor:
        s = _scale_tensor(w_scale, what, self.weight.device)
        if s.numel() == 1 and s.dim() <= 2:
            return s.reshape(1).expand(rows)
        if s.numel() == rows and (s.dim() == 1 or tuple(s.shape) == (rows, 1)):
            return s.reshape(rows)
        raise InvalidInputError(f"{what} must have one value or {rows} values ([N] or [N, 1]); got {tuple(s.shape)}")

    def _block_scales(self, w_scale: object, rows: int, what: str) -> torch.Tensor:
        """A block-scaled weight's scales for ``rows`` output rows: ``[ceil(rows/BN), ceil(K/BK)]`` fp32 (bf16 and
        fp16, as checkpoints store them, converted)."""
        assert self.weight_block is not None
        V.require_tensor(w_scale, what)
        bn, bk = self.weight_block
        grid = (-(-rows // bn), -(-self.in_features // bk))
        if w_scale.dim() != 2 or tuple(w_scale.shape) != grid:
            raise InvalidInputError(f"{what} of a {bn}x{bk}-block layer must be [ceil(N/{bn}), ceil(K/{bk})] = "
                                    f"{list(grid)}, got {tuple(w_scale.shape)}")
        if w_scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidInputError(f"{what} must be float32, bfloat16 or float16, got {w_scale.dtype}")
        return w_scale.to(device=self.weight.device, dtype=torch.float32)

    def load_weights(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor | float,
        *,
        input_scale: torch.Tensor | float | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        """Load an unfused layer: ``weight [N, K]`` fp8, ``weight_scale`` one value (per-tensor), ``[N]`` (per-channel)
        or ``[ceil(N/BN), ceil(K/BK)]`` (block), ``input_scale`` (static layers only), ``bias [N]``."""
        if self.shard_sizes is not None:
            raise InvalidInputError("this layer is fused from shards: load it with load_shard(i, ...)")
        self._check_weight(weight, self.out_features, "weight")
        if self.weight_block is not None:
            scale = self._block_scales(weight_scale, self.out_features, "weight_scale")
        else:
            rows = self._scale_rows(weight_scale, self.out_features, "weight_scale")
            if self.weight_scale_mode is WeightScale.PER_TENSOR and _numel(weight_scale) != 1:
                raise InvalidInputError(f"a per-tensor layer takes one weight_scale value, got {_numel(weight_scale)}")
            scale = rows[:1] if self.weight_scale.numel() == 1 else rows
        s_in = self._checked_input_scale(input_scale, "input_scale")
        if bias is not None:
            self._check_bias(bias)
        with torch.no_grad():  # everything checked first: an error leaves the layer as it was
            self.weight.copy_(weight)
            self.weight_scale.copy_(scale)
            if s_in is not None:
                self.input_scale[0].copy_(s_in)
            if bias is not None:
                self.bias.copy_(bias)
        self._mark_loaded()

    def load_shard(
        self,
        index: int,
        weight: torch.Tensor,
        weight_scale: torch.Tensor | float,
        *,
        input_scale: torch.Tensor | float | None = None,
    ) -> None:
        """Load shard ``index`` of a fused layer: ``weight [N_i, K]`` fp8 with its own scale (one
        value or ``[N_i]``) and, for static layers, its own input scale."""
        if self.shard_sizes is None:
            raise InvalidInputError("load_shard is for fused layers (built with shard_sizes)")
        if not 0 <= index < len(self.shard_sizes):
            raise InvalidInputError(f"shard index {index} out of range (0..{len(self.shard_sizes) - 1})")
        start = sum(self.shard_sizes[:index])
        rows = self.shard_sizes[index]
        self._check_weight(weight, rows, f"shard {index} weight")
        if not self._raw:
            raise InvalidInputError("this fused layer was already processed; build a new one to load shards")
        if self.weight_block is not None:  # the shard's own blocks (shards start on block rows: checked at build)
            scale = self._block_scales(weight_scale, rows, f"shard {index} weight_scale")
            first = start // self.weight_block[0]
            scale_slice = slice(first, first + scale.shape[0])
        else:
            scale = self._scale_rows(weight_scale, rows, f"shard {index} weight_scale")
            scale_slice = slice(start, start + rows)
        s_in = self._checked_input_scale(input_scale, f"shard {index} input_scale")
        with torch.no_grad():  # everything checked first: an error leaves the layer as it was
            self.weight[start:start + rows].copy_(weight)
            self.weight_scale[scale_slice].copy_(scale)
            if s_in is not None:
                self.input_scale[index].copy_(s_in)
        self._mark_loaded()

    def load_bias(self, bias: torch.Tensor) -> None:
        self._check_bias(bias)
        with torch.no_grad():
            self.bias.copy_(bias)
        self._mark_loaded()

    def _check_bias(self, bias: torch.Tensor) -> None:
        if self.bias is None:
            raise InvalidInputError("this layer was built with bias=False")
        V.require_tensor(bias, "bias")
        if tuple(bias.shape) != (self.out_features,):
            raise InvalidInputError(f"bias must be [{self.out_features}], got {tuple(bias.shape)}")
        if not bias.is_floating_point() or bias.dtype.itemsize < 2:
            raise InvalidInputError(f"bias must be a bf16/fp16/fp32 tensor, got {bias.dtype}")

    def _checked_input_scale(self, value: object, what: str = "input_scale") -> torch.Tensor | None:
        """A static input scale as one fp32 value (``None``: not given, or a dynamic layer, which takes none)."""
        if self.act_scale is not ActScale.PER_TENSOR_STATIC:
            if value is not None:
                raise InvalidInputError(f"{what} given to a {self.act_scale.value} layer (static layers only)")
            return None
        if value is None:
            return None  # may come later (state dict); missing ones are reported at processing
        s = _scale_tensor(value, what, self.weight.device)
        if not V.is_scalar_shape(s):
            raise InvalidInputError(f"{what} must hold one value (per-tensor), got shape {tuple(s.shape)}")
        return s.reshape(())

    def _mark_loaded(self) -> None:
        if self.kernel is not None:  # new values: the prepared weight is stale
            self.kernel = self._plan = self._traced = None
            self._rebind_norms()

    def __setattr__(self, name: str, value: Any) -> None:
        # a tensor put in place of a processed layer's weight or scales (transformers' tie_weights() making lm_head
        # share the embedding, a user's assignment): the prepared weight is stale, and the next forward says so
        if name in _WEIGHT_TENSORS and self.__dict__.get("kernel") is not None:
            current = self._buffers.get(name, self._parameters.get(name))
            super().__setattr__(name, value)
            if value is not current:
                self._mark_loaded()
            return
        super().__setattr__(name, value)

    def _rebind_norms(self) -> None:
        """The fused norms feeding this layer bind their traced call to its traced plan's input-scale alias: bind them
        again whenever that plan changes (or drop theirs while this layer has none)."""
        for norm in list(self.__dict__.get("_traced_norms", ())):
            norm._bind_traced_norm()

    def _load_from_state_dict(self, state_dict, prefix, *args: Any, **kwargs: Any) -> None:
        # a weight that is no FP8 of this layer's type (a bf16 model's state dict loaded into the quantized one):
        # torch would cast its values into the FP8 buffer, unscaled, and the model would be silently wrong
        weight = state_dict.get(prefix + "weight")
        if isinstance(weight, torch.Tensor):
            self._check_weight(weight, self.out_features, f"state dict entry {prefix}weight")
        # a processed layer's state dict holds the final scale shapes ([1] after requantizing or
        # reducing the shards' input scales): take those shapes over as loaded
        for name in ("weight_scale", "input_scale"):
            value = state_dict.get(prefix + name)
            current = self._buffers.get(name)
            if isinstance(value, torch.Tensor) and current is not None and value.shape != current.shape:
                self._buffers[name] = torch.empty(value.shape, dtype=torch.float32, device=current.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.shard_sizes is not None:
            self._raw = self.weight_scale.numel() == self.out_features and (
                self.input_scale is None or self.input_scale.numel() == len(self.shard_sizes))
        self._mark_loaded()

    # ------------------------------------------------------------------------------ processing
    @property
    def is_processed(self) -> bool:
        return self.kernel is not None

    @property
    def objective(self) -> SelectionObjective | None:
        """The selection objective the layer's providers were chosen by (after processing; before, the one asked
        for, None meaning ``FP8_SELECTION_OBJECTIVE``, else auto)."""
        return self.objective_request if self.kernel is None else self.kernel.objective

    @property
    def gemm_backend(self) -> Fp8GemmBackend | None:
        """The provider resolved for this weight with M unknown (``kernel.backend``); None before processing."""
        return None if self.kernel is None else self.kernel.backend

    @property
    def prepared(self) -> PreparedWeight | None:
        """``gemm_backend``'s prepared weight; None before processing."""
        return None if self.kernel is None else self.kernel.prepared

    def _problem(self, weight_scale: WeightScale) -> GemmProblem:
        block = {} if self.weight_block is None else {"weight_block": self.weight_block, "group_size": self.group_size}
        return GemmProblem(
            n=self.out_features, k=self.in_features, input_dtype=self.input_dtype, weight_dtype=self.weight_dtype,
            out_dtype=self.out_dtype, act_scale=self.act_scale, weight_scale=weight_scale,
            has_bias=self.bias is not None, device=DeviceKind(self.weight.device.type), **block,
        )

    def process_weights_after_loading(self) -> None:
        """Check the loaded tensors, combine fused shards' scales, resolve the GEMM provider once and
        prepare the weight for it. Load time only: it reads scale values (a device sync)."""
        if self.weight.dtype != self.weight_dtype.torch_dtype():
            raise InvalidInputError(f"weight must be {self.weight_dtype.value}, got {self.weight.dtype}")
        if self.weight.device.type not in {d.value for d in DeviceKind}:
            raise InvalidInputError(f"cannot run on {self.weight.device} tensors")
        if not self.weight.is_contiguous():
            self.weight = self.weight.contiguous()
        block = self.weight_block is not None
        fused = self.shard_sizes is not None and self._raw and not block  # block shards keep their own blocks
        if self.input_scale is not None:  # a state dict may have brought another shape
            want = len(self.shard_sizes) if fused else 1
            if self.input_scale.numel() != want:
                raise InvalidInputError(f"input_scale must hold {want} value(s) ({'one per shard' if fused else 'one'}"
                                        f"), got shape {tuple(self.input_scale.shape)}")
        if fused:
            self._check_shards()
            if self.input_scale is not None:
                self.input_scale = self.input_scale.amax().reshape(1).contiguous()
        else:
            _check_all([(self.weight_scale, "weight_scale")]
                       + ([] if self.input_scale is None else [(self.input_scale, "input_scale")]))
        if self.bias is not None and self.bias.dtype != self.dtype:
            raise InvalidInputError(f"bias must be {self.dtype}, got {self.bias.dtype}")
        if fused:
            mode, backend = self._combine_shard_scales()
        elif block:
            mode = WeightScale.BLOCK
            backend = _resolve_gemm(self.backend_request, self._problem(mode))
        else:
            mode = WeightScale.PER_TENSOR if self.weight_scale.numel() == 1 else WeightScale.PER_CHANNEL
            backend = _resolve_gemm(self.backend_request, self._problem(mode))
        self._raw = False
        self.weight_scale_mode = mode
        self.problem = self._problem(mode)
        # the scale's values were checked above (one sync; derived from checked shards where fused): the providers
        # preparing the weight need not read them again, one sync each
        with V.scales_checked(self.weight_scale):
            self.kernel = init_fp8_gemm(self.weight, self.weight_scale, problem=self.problem,
                                        backend=self.backend_request, default=backend,
                                        objective=self.objective_request)
        self._plan = self._eager_plan()
        self._traced = self._traced_plan()
        self._rebind_norms()
        logger.debug("Fp8Linear %dx%d prepared by %s (%s)", self.out_features, self.in_features,
                     self.kernel.describe(), self.problem.describe())

    def __getstate__(self) -> dict[str, Any]:
        # the plans hold this layer's own tensors (closures, parameter aliases): a copy (deepcopy, pickle) binds its
        # own, the traced plan when it is restored (never while torch.compile traces), the eager one at its first call.
        # The norms feeding it register again when they are restored (their consumer is copied with them).
        state = dict(self.__dict__)
        state["_plan"] = state["_traced"] = None
        state.pop("_traced_norms", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_traced", None)
        if self.kernel is not None:
            self._traced = self._traced_plan()

    def _traced_plan(self) -> TracedPlan:
        """What ``torch.compile`` traces (:mod:`.traced_plan`): a function generated for this layer that
        checks the input, quantizes it and runs the kernel's host row for its M, the layer's numbers constants of its
        code and its tensors parameter aliases."""
        assert self.kernel is not None
        return bind_traced(self.kernel, **self._bindings())

    def _bindings(self) -> dict[str, Any]:
        """What both plans bind besides the kernel: sizes, dtypes, device, bias, activation mode and scale."""
        return {"k": self.in_features, "n": self.out_features, "dtype": self.dtype, "device": self.weight.device,
                "bias": self.bias, "mode": self.act_scale, "input_scale": self.input_scale,
                "fp8_dtype": self.input_dtype.torch_dtype()}

    def _eager_plan(self) -> EagerPlan:
        """The eager hot path (:mod:`.eager_plan`): quantizer and the kernel's rows bound to this layer."""
        assert self.kernel is not None
        return bind_per_m(self.kernel, **self._bindings())

    def _check_shards(self) -> None:
        assert self.shard_sizes is not None
        start = 0
        items = []
        for i, rows in enumerate(self.shard_sizes):
            items.append((self.weight_scale[start:start + rows], f"shard {i} weight_scale"))
            if self.input_scale is not None:
                items.append((self.input_scale[i:i + 1], f"shard {i} input_scale"))
            start += rows
        _check_all(items)

    def _combine_shard_scales(self) -> tuple[WeightScale, Fp8GemmBackend]:
        """Pick per-tensor (all shard scales equal), per-channel or requantize-to-max."""
        rows = self.weight_scale
        if bool((rows == rows[0]).all()):
            self.weight_scale = rows[:1].clone()
            return WeightScale.PER_TENSOR, _resolve_gemm(self.backend_request, self._problem(WeightScale.PER_TENSOR))
        policy = self.shard_scales
        if policy == "per_channel":
            backend = _resolve_gemm(self.backend_request, self._problem(WeightScale.PER_CHANNEL))
            return WeightScale.PER_CHANNEL, backend
        backend = _resolve_gemm(self.backend_request, self._problem(WeightScale.PER_TENSOR))
        if policy == "auto":
            reasons = (backend.supports(self._problem(WeightScale.PER_CHANNEL))
                       if WeightScale.PER_CHANNEL in backend.capabilities.weight_scales
                       else ["it takes per-tensor weight scales only"])
            if not reasons:
                logger.debug("fused layer keeps per-shard scales per channel (%s)", backend.label)
                return WeightScale.PER_CHANNEL, backend
            logger.info("fused layer requantizes its shards to one scale: %s cannot keep them per channel (%s)",
                        backend.label, "; ".join(reasons))
        self._requantize_to_max()
        return WeightScale.PER_TENSOR, backend

    def _requantize_to_max(self) -> None:
        """``w_q[r] <- clamp(w_q[r] · s[r] / max(s), ±fmax)`` shard by shard; one scale ``max(s)``."""
        assert self.shard_sizes is not None
        fmax = self.weight_dtype.max
        s_max = self.weight_scale.amax().reshape(1)
        start = 0
        with torch.no_grad():
            for rows in self.shard_sizes:
                sl = slice(start, start + rows)
                ratio = (self.weight_scale[sl] / s_max).reshape(-1, 1)
                self.weight[sl] = (self.weight[sl].float() * ratio).clamp(-fmax, fmax).to(self.weight.dtype)
                start += rows
        self.weight_scale = s_max.contiguous()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8Linear:
        """Device moves apply to every buffer; dtype casts do not (see the module docstring). A
        processed layer whose tensors moved is processed again (the prepared weight is stale)."""
        before = dict(self._buffers)
        super()._apply(_keeping_dtype(fn), recurse)
        if self.kernel is not None and any(self._buffers[n] is not b for n, b in before.items()):
            self.kernel = self._plan = self._traced = None
            self.process_weights_after_loading()  # binds the norms feeding it again
        return self

    # ------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """``x``: ``[..., K]`` in the model dtype (quantized here in ``act_scale`` mode) or a
        :class:`QuantizedActivation` in this layer's ``act_scale`` mode (used as is; its
        ``orig_dtype`` must be the model dtype). Returns ``[..., N]`` in the model dtype.

        A plain eager call of a processed layer takes its :class:`~.eager_plan.EagerPlan` (load-time
        bindings, per-call checks of the input only), a compiled one its traced plan (:mod:`.traced_plan`)
        (the same, with few guards); every other call the general path. The layer has no backward: where autograd
        would differentiate the output (``x`` requires grad, grad mode on), a backward reaching it raises the
        library's error instead of a gradient."""
        if _compiling():
            traced = self._traced
            if traced is not None:
                y = traced(x)
                return no_backward(y, x)
        elif not _dispatch_modes():
            plan = self._plan
            if plan is None and self.kernel is not None:  # a copy or an unpickled layer: bind again
                plan = self._plan = self._eager_plan()
            if plan is not None:
                y = plan(x)
                if y is not None:
                    return no_backward(y, x)
        kernel = self.kernel
        if kernel is None:
            raise InvalidInputError("Fp8Linear: call process_weights_after_loading() before the first forward (and "
                                    "after every load_state_dict: "
                                    "fp8_backends.layers.process_weights_after_loading(model))")
        data = x.data if isinstance(x, QuantizedActivation) else x
        if isinstance(data, torch.Tensor) and data.device != self.weight.device:
            raise InvalidInputError(f"input is on {data.device} but the layer's weight is on {self.weight.device}")
        y = apply_fp8_linear(x, kernel, act_scale=self.act_scale, input_scale=self.input_scale, bias=self.bias,
                             out_dtype=self.out_dtype, input_dtype=self.input_dtype)
        return no_backward(y, x)

    def extra_repr(self) -> str:
        parts = [f"in_features={self.in_features}", f"out_features={self.out_features}",
                 f"bias={self.bias is not None}", f"act={self.act_scale.value}", f"w={self.weight_scale_mode.value}",
                 f"dtype={OutDtype.of(self.dtype).value}"]
        if self.shard_sizes is not None:
            parts.append(f"shards={self.shard_sizes}")
        parts.append(("backends=" if self.kernel is not None and self.kernel.per_m else "backend=")
                     + self.backends_text)
        return ", ".join(parts)

    @property
    def backends_text(self) -> str:
        """The provider(s) this layer runs on: one label, or ``"M<=16:triton,M>16:torch_scaled_mm[...]"`` when
        batch sizes are split between providers (a lockfile, the shipped data or a measured default), followed by
        ``"; in CUDA graphs: ..."`` when captures run other providers (the ``auto`` objective)."""
        return self.kernel.describe() if self.kernel is not None else "(unprocessed)"


def _keeping_dtype(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Wrap an ``nn.Module._apply`` function so that it may move a tensor but never change its dtype."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out if out.dtype == t.dtype else t.to(device=out.device)

    return apply


def _numel(value: object) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 1


def _fp8_guess(w: torch.Tensor) -> Fp8Dtype:
    try:
        return Fp8Dtype.of(w.dtype)
    except ValueError:
        raise InvalidInputError(f"shard weights must be float8_e4m3fn or float8_e5m2, got {w.dtype}") from None


class RMSNormFp8Quant(nn.Module):
    """RMSNorm (optionally with the residual add) that hands the next FP8 linear a quantized input.

    ``y = rmsnorm(x)·weight`` in fp32 (``x + residual`` first when a residual is given: the sum is
    written back into ``residual`` in place, in its dtype, and the fp32 sum is normalized, as
    vLLM's ``fused_add_rms_norm``). Then:

    - if ``quant_linear`` (the :class:`Fp8Linear` that consumes ``y``) takes a static per-tensor
      input scale, ``y`` is quantized with that scale by the resolved norm-quant provider, one fused
      kernel where the provider has one, and returned as a :class:`QuantizedActivation`;
    - if it quantizes per token or per token group (block-wise FP8), the norm computes the scales from the
      normalized rows in the same kernel (vLLM's ``rms_norm_dynamic_per_token_quant``; group scales in the layout
      the consumer's GEMM provider declares) and returns a :class:`QuantizedActivation`;
    - otherwise (dynamic per-tensor: a reduction over the whole activation) ``y`` is returned in the model dtype
      (the linear quantizes it itself).

    Under ``torch.compile`` a norm whose provider was chosen by ``auto`` traces the reference torch code
    (:func:`fp8_backends.core.reference.rmsnorm_quant`: the semantics every provider is tested against) instead of
    the provider's op, as the activation quantizers do (:func:`fp8_backends.quant.set_compile_mode`, ``"inline"``
    by default), so Inductor fuses the residual add, the norm and the quantization into kernels of its own, launched
    by its static launcher; the library's Triton norm kernel, a user-defined kernel, goes through Triton's Python
    launcher. Measured (H200, ``bench/decoder_block.py``, one Llama-3-8B block compiled,
    ``bench/results/decoder_block/2026-12-01-h200/``): the block with the
    norm in Inductor's kernels called in 302 / 519 µs at T = 1 / 256 against 323 / 576 with the Triton norm-quant op,
    at equal graph time (79.7 / 125.7 against 78.5 / 126.4 µs). A norm given an explicit provider (argument or
    ``FP8_NORM_QUANT_BACKEND``) runs that provider's op compiled too, as does every norm under
    ``set_compile_mode("op")``. The traced code is a function generated for the norm when it is processed
    (:func:`.traced_plan.bind_traced_norm`; bound again whenever its consumer binds a new plan): it holds
    ``H``, ``eps`` and the consumer's input-scale alias, so a compiled model's guards read neither the consumer nor
    the provider through the norm (CPU, a compiled block: 181 guards, 1 Python lambda, against 238 and 13 before).

    ``forward(x)`` returns that output; ``forward(x, residual)`` returns ``(output, residual)``.
    ``x``: ``[..., H]`` in the model dtype; ``residual``: same shape and dtype, contiguous.

    Args:
        hidden_size: ``H``.
        eps: RMSNorm epsilon.
        quant_linear: the consuming linear (held by reference, not as a child module: it is not
            part of this module's ``state_dict``). Settable later via the attribute.
        backend: norm-quant provider name, a provider instance, or ``None`` (``FP8_NORM_QUANT_BACKEND``,
            else ``auto``); resolved at :meth:`process_weights_after_loading`.
        dtype: of the ``weight`` parameter: the model dtype.
        device: of the ``weight`` parameter.
    """

    _auto = False  # the provider was chosen by auto: compiled calls may trace the reference (class docstring)

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        *,
        quant_linear: Fp8Linear | None = None,
        backend: str | NormQuantBackend | None = None,
        dtype: object = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = _positive_int(hidden_size, "hidden_size")
        self.eps = V.require_eps(eps)
        device = _device(device)
        self.weight = nn.Parameter(torch.ones(self.hidden_size, dtype=_model_dtype(dtype), device=device),
                                   requires_grad=False)
        _check_backend_request(backend, NormQuantBackend)
        self.backend_request = backend
        self.norm_backend: NormQuantBackend | None = None
        self._residual_backend: NormQuantBackend | None = None
        self._residual_error: Exception | None = None
        self._traced_norm: TracedNorm | None = None  # what torch.compile traces (auto provider, inline mode)
        self.quant_linear = quant_linear

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "quant_linear":  # through the property, not nn.Module's child registration
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    # the consumer is kept out of the module tree (and out of state_dict)
    @property
    def quant_linear(self) -> Fp8Linear | None:
        return self.__dict__["_quant_linear"]

    @quant_linear.setter
    def quant_linear(self, linear: Fp8Linear | None) -> None:
        if linear is not None:
            if not isinstance(linear, Fp8Linear):
                raise InvalidInputError(f"quant_linear must be an Fp8Linear, got {type(linear).__name__}")
            if linear.in_features != self.hidden_size:
                raise InvalidInputError(
                    f"quant_linear takes K={linear.in_features} inputs but the norm's hidden size is {self.hidden_size}"
                )
        previous = self.__dict__.get("_quant_linear")
        if previous is not None and previous is not linear:
            previous.__dict__.get("_traced_norms", set()).discard(self)
        self.__dict__["_quant_linear"] = linear
        self.norm_backend = self._residual_backend = self._residual_error = None  # process again
        self.__dict__["_traced_norm"] = None

    @property
    def emits_quantized(self) -> bool:
        """True when the forward returns a :class:`QuantizedActivation`: a static per-tensor consumer (quantized with
        its input scale), a per-token or a per-token-group one (the norm computes the scales)."""
        lin = self.quant_linear
        return lin is not None and lin.act_scale in _NORM_QUANT_MODES

    @property
    def is_processed(self) -> bool:
        return self.norm_backend is not None

    def process_weights_after_loading(self) -> None:
        """Resolve the norm-quant provider once (when :attr:`emits_quantized`), for plain and
        residual calls. A provider without the fused residual add is reported at the first residual
        call, not silently replaced. Without a quantizing consumer there is nothing to resolve."""
        self.norm_backend = self._residual_backend = self._residual_error = None
        self.__dict__["_traced_norm"] = None
        if not self.emits_quantized:
            return
        lin = self.quant_linear
        assert lin is not None
        group = _dynamic_args(lin, layout=False)  # the consumer may be processed after this norm
        problem = NormQuantProblem(hidden=self.hidden_size, in_dtype=self.weight.dtype, out_fp8=lin.input_dtype,
                                   residual=False, device=DeviceKind(self.weight.device.type), **group)
        self.norm_backend = _resolve_norm(self.backend_request, problem)
        self._auto = _requests_auto("norm_quant", self.backend_request)
        try:
            self._residual_backend = _resolve_norm(self.backend_request, replace(problem, residual=True))
        except (UnsupportedProblemError, InvalidInputError) as exc:
            self._residual_error = exc
        self._bind_traced_norm()

    def _bind_traced_norm(self) -> None:
        """Bind (or drop) the compiled call of an ``auto`` norm (:func:`.traced_plan.bind_traced_norm`):
        it needs a processed norm and a consumer with a traced plan, whose input-scale alias it shares. A processed
        ``auto`` norm is registered with its consumer, which calls this again whenever its own plan changes."""
        lin = self.quant_linear
        if self._auto and self.norm_backend is not None and lin is not None:
            lin.__dict__.setdefault("_traced_norms", weakref.WeakSet()).add(self)
        traced = None if lin is None else lin.__dict__.get("_traced")
        if not self._auto or self.norm_backend is None or traced is None or lin.input_scale is None:
            self.__dict__["_traced_norm"] = None
            return
        self.__dict__["_traced_norm"] = bind_traced_norm(
            h=self.hidden_size, eps=self.eps, dtype=self.weight.dtype, device=self.weight.device, weight=self.weight,
            input_scale=traced.input_scale, fp8_dtype=lin.input_dtype.torch_dtype())

    def __getstate__(self) -> dict[str, Any]:
        # the traced call holds this norm's weight and its consumer's scale alias: a copy binds its own when restored
        state = dict(self.__dict__)
        state["_traced_norm"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._bind_traced_norm()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RMSNormFp8Quant:
        """Device moves apply; dtype casts do not. A processed norm is processed again after a move."""
        before = self.weight.device
        super()._apply(_keeping_dtype(fn), recurse)
        if self.norm_backend is not None and self.weight.device != before:
            self.process_weights_after_loading()
        return self

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | QuantizedActivation | tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
        if _compiling():
            traced = self._traced_norm
            if traced is not None:
                out = traced(x, residual)  # None in compile mode "op": the provider's op below
                if out is not None:
                    return out
        V.require_norm_input(x, residual, self.hidden_size, self.weight.dtype)
        if self.emits_quantized:
            return self._forward_quant(x, residual)
        from ..core import reference

        if residual is None:
            return reference.rmsnorm(x, self.weight, self.eps).to(x.dtype)
        total = x.float() + residual.float()
        residual.copy_(total.to(residual.dtype))
        return reference.rmsnorm(total, self.weight, self.eps).to(x.dtype), residual

    def _forward_quant(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        lin = self.quant_linear
        assert lin is not None
        if self.norm_backend is None:
            raise InvalidInputError(
                "RMSNormFp8Quant: call process_weights_after_loading() (after setting quant_linear) before the forward"
            )
        if not lin.is_processed:
            raise InvalidInputError("RMSNormFp8Quant: its quant_linear is not processed yet (its input scale is final "
                                    "only after process_weights_after_loading)")
        scale = lin.input_scale
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.hidden_size)
        group = _dynamic_args(lin)  # dynamic modes: scales computed here, in the consumer provider's layout
        if self._auto and _compiling() and _quant_compile_mode() == "inline":
            return self._traced_quant(x2, residual, scale, lin.input_dtype.torch_dtype(), lead, group)
        if residual is None:
            qa = self.norm_backend.rmsnorm_quant(x2, self.weight, scale, self.eps, **group)
            return QuantizedActivation(qa.data.reshape(*lead, self.hidden_size), qa.scale, qa.orig_dtype, qa.mode)
        if self._residual_backend is None:
            raise self._residual_error or InvalidInputError("no norm-quant provider for the residual add")
        r2 = residual.view(-1, self.hidden_size)
        qa, _ = self._residual_backend.fused_add_rmsnorm_quant(x2, r2, self.weight, scale, self.eps, **group)
        return QuantizedActivation(qa.data.reshape(*lead, self.hidden_size), qa.scale, qa.orig_dtype, qa.mode), residual

    def _traced_quant(
        self, x2: torch.Tensor, residual: torch.Tensor | None, scale: torch.Tensor, fp8: torch.dtype,
        lead: torch.Size, group: dict[str, Any] | None = None,
    ) -> QuantizedActivation | tuple[QuantizedActivation, torch.Tensor]:
        """The compiled call of an ``auto`` norm (class docstring): the reference torch code, which Inductor fuses.
        ``x2 [T, H]``; ``residual`` updated in place with ``x + residual`` in its dtype, as every provider does.
        ``group``: a dynamic mode's arguments (:func:`_dynamic_args`: the scales computed from the normalized
        rows)."""
        from ..core import reference

        h = self.hidden_size
        if group:
            mode = group["act_scale"]
            r2 = None if residual is None else residual.view(-1, h)
            if mode is ActScale.PER_TOKEN_GROUP:  # reference.rmsnorm_quant_dynamic's steps, the scale in its layout
                total = x2.float() if r2 is None else x2.float() + r2.float()
                q, s = quant.traced_quantize_groups(
                    reference.rmsnorm(total, self.weight, self.eps), group.get("group_size", DEFAULT_GROUP_SIZE),
                    fp8, Fp8Dtype.of(fp8).max, group["scale_layout"])
                total = None if r2 is None else total.to(x2.dtype)
            else:
                q, s, total = reference.rmsnorm_quant_dynamic(x2, self.weight, self.eps, act_scale=mode, residual=r2,
                                                              dtype=fp8)
            if r2 is not None:
                r2.copy_(total)
            qa = QuantizedActivation(q.reshape(*lead, h), s, x2.dtype, mode)
            return qa if residual is None else (qa, residual)
        if residual is None:
            q = reference.rmsnorm_quant(x2, self.weight, scale, self.eps, fp8)
        else:
            r2 = residual.view(-1, h)
            q, total = reference.fused_add_rmsnorm_quant(x2, r2, self.weight, scale, self.eps, fp8)
            r2.copy_(total)
        qa = QuantizedActivation(q.reshape(*lead, h), scale, x2.dtype, ActScale.PER_TENSOR_STATIC)
        return qa if residual is None else (qa, residual)

    def extra_repr(self) -> str:
        lin = self.quant_linear
        consumer = "none" if lin is None else f"Fp8Linear({lin.in_features}->{lin.out_features}, {lin.act_scale.value})"
        nb = self.norm_backend.label if self.norm_backend is not None else "-"
        return (f"{self.hidden_size}, eps={self.eps}, dtype={OutDtype.of(self.weight.dtype).value}, "
                f"quant_linear={consumer}, backend={nb}")


#: the consumer modes a norm hands a quantized activation to: static (the consumer's scale), per-token (vLLM's
#: ``rms_norm_dynamic_per_token_quant``) and per-token-group (block-wise FP8)
_NORM_QUANT_MODES = frozenset({ActScale.PER_TENSOR_STATIC, ActScale.PER_TOKEN, ActScale.PER_TOKEN_GROUP})


def _dynamic_args(lin: Fp8Linear, layout: bool = True) -> dict[str, Any]:
    """The norm-quant keyword arguments of ``lin``'s dynamic activation mode (``{}`` for a static consumer):
    per-token scales ``[T, 1]``, or per-token-group scales in the layout ``lin``'s GEMM provider declares
    (``layout``: with that layout, which needs ``lin`` processed)."""
    if lin.act_scale is ActScale.PER_TOKEN:
        return {"act_scale": ActScale.PER_TOKEN}
    if lin.act_scale is ActScale.PER_TOKEN_GROUP:
        group = {"act_scale": ActScale.PER_TOKEN_GROUP, "group_size": lin.group_size}
        if layout:
            group["scale_layout"] = lin.gemm_backend.capabilities.group_scale_layout
        return group
    return {}


__all__ = ["Fp8Linear", "RMSNormFp8Quant", "SHARD_SCALE_POLICIES"]
