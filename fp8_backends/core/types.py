"""Plain value types shared by providers, the registry and the layers.

Nothing here imports torch at module level: the registry and the listing use these types on
machines where importing torch (or any kernel library) would be slow or impossible.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from .errors import InvalidInputError, InvalidTypeError

if TYPE_CHECKING:
    import torch


class ActScale(str, enum.Enum):
    """How the activation ``x`` is scaled.

    - ``PER_TENSOR_STATIC``: one fp32 scale known at load time (a calibrated input scale).
    - ``PER_TENSOR_DYNAMIC``: one fp32 scale computed from each batch (``amax / 448``).
    - ``PER_TOKEN``: one fp32 scale per row of ``x`` (``x_scale: [M, 1]``), computed per batch.
    - ``PER_TOKEN_GROUP``: one fp32 scale per row and group of ``G`` consecutive columns
      (``x_scale: [M, ceil(K/G)]``, G = :attr:`GemmProblem.group_size`, 128 by default), computed per batch: the
      activation side of block-wise FP8 (DeepSeek-V3, Qwen3-FP8). Pairs with :attr:`WeightScale.BLOCK`.
    """

    PER_TENSOR_STATIC = "per_tensor_static"
    PER_TENSOR_DYNAMIC = "per_tensor_dynamic"
    PER_TOKEN = "per_token"
    PER_TOKEN_GROUP = "per_token_group"

    @property
    def per_tensor(self) -> bool:
        """One scale for the whole activation (static or dynamic)."""
        return self is ActScale.PER_TENSOR_STATIC or self is ActScale.PER_TENSOR_DYNAMIC

    @property
    def dynamic(self) -> bool:
        """The scale is computed from each batch (every mode but the static one)."""
        return self is not ActScale.PER_TENSOR_STATIC

    @classmethod
    def of(cls, mode: Any) -> ActScale:
        """Accept an instance or its value (``"per_token"``); safe inside torch.compile (no enum call)."""
        if isinstance(mode, cls):
            return mode
        return _member(cls, mode, "activation scale mode")


def _weight_scale_of(mode: Any) -> WeightScale:
    return mode if isinstance(mode, WeightScale) else _member(WeightScale, mode, "weight scale mode")


def _member(cls: type[enum.Enum], value: Any, what: str) -> Any:
    """``cls(value)`` through the value map: torch.compile traces a dict lookup, not an Enum call. An unknown
    value raises :class:`~fp8_backends.core.errors.InvalidInputError` (a ``ValueError``); an unhashable one
    :class:`~fp8_backends.core.errors.InvalidTypeError`."""
    try:
        member = cls._value2member_map_.get(value)
    except TypeError:  # unhashable (a list, a dict)
        valid = ", ".join(str(m.value) for m in cls)
        raise InvalidTypeError(
            f"{type(value).__name__} {value!r} is not a valid {what} (expected one of {valid})"
        ) from None
    if member is None:
        valid = ", ".join(str(m.value) for m in cls)
        raise InvalidInputError(f"{value!r} is not a valid {what} (expected one of {valid})")
    return member


def _int_field(owner: str, name: str, value: Any, minimum: int) -> int:
    """``value`` as an ``int >= minimum`` (any integer type: Python, NumPy, torch's symbolic ints), or the
    library error: :class:`InvalidTypeError` for a non-integer (floats, strings, ``None``, ``bool``),
    :class:`InvalidInputError` for one out of range."""
    if isinstance(value, bool):
        raise InvalidTypeError(f"{owner}.{name} must be an integer, got the bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidTypeError(
            f"{owner}.{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if number < minimum:
        bound = "positive" if minimum == 1 else f">= {minimum}"
        raise InvalidInputError(f"{owner}.{name} must be {bound}, got {number}")
    return number


def _flag_field(owner: str, name: str, value: Any) -> bool:
    """``value`` as a bool: ``True``/``False`` (or ``1``/``0``, NumPy bools); anything else (``"yes"``,
    ``None``) is an :class:`InvalidTypeError`."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, str):
        try:
            if value in (0, 1):
                return bool(value)
        except Exception:  # noqa: BLE001 - e.g. an array with no single truth value
            pass
    raise InvalidTypeError(f"{owner}.{name} must be a bool, got {type(value).__name__} {value!r}")


class WeightScale(str, enum.Enum):
    """How the weight ``w [N, K]`` is scaled: one scale (``PER_TENSOR``), one per output row (``PER_CHANNEL``,
    ``w_scale: [N]`` or ``[N, 1]``), or one per block of ``BN x BK`` elements (``BLOCK``, ``w_scale:
    [ceil(N/BN), ceil(K/BK)]``, (BN, BK) = :attr:`GemmProblem.weight_block`, 128x128 by default: the weight side of
    block-wise FP8 checkpoints, where ``w[n, k] = w_q[n, k] * w_scale[n // BN, k // BK]``)."""

    PER_TENSOR = "per_tensor"
    PER_CHANNEL = "per_channel"
    BLOCK = "block"


class ScaleLayout(str, enum.Enum):
    """Memory layout of per-token-group activation scales ``[M, G]`` (``G = ceil(K / group_size)``).

    - ``ROW_MAJOR``: the groups of one token are adjacent (strides ``(G, 1)``), what a quantizer writes row by row.
    - ``M_MAJOR``: the tokens of one group are adjacent (strides ``(1, M)``: the transpose of a contiguous
      ``[G, M]``), what cuBLASLt's and CUTLASS's block-scaled kernels read.
    - ``M_MAJOR_TMA``: M-major with the column stride rounded up to a multiple of 4 (strides ``(1, ceil(M/4)*4)``):
      16-byte aligned columns for TMA loads (DeepGEMM-style kernels).

    A provider states the layout its kernel reads (:attr:`GemmCapabilities.group_scale_layout`); the quantizer that
    feeds it writes that layout, so no call transposes scales. A scale in another layout is still served right (the
    provider's :meth:`gemm` converts it, one small copy).
    """

    ROW_MAJOR = "row_major"
    M_MAJOR = "m_major"
    M_MAJOR_TMA = "m_major_tma"

    @classmethod
    def of(cls, layout: Any) -> ScaleLayout:
        """Accept an instance or its value (``"m_major"``)."""
        if isinstance(layout, cls):
            return layout
        return _member(cls, layout, "scale layout")


#: group sizes (along K) of per-token-group activation scales the contract knows
GROUP_SIZES = (64, 128)
#: the block-wise FP8 checkpoints' shape: 128x128 weight blocks, activation groups of 128
DEFAULT_GROUP_SIZE = 128
DEFAULT_WEIGHT_BLOCK = (128, 128)


def _block_field(owner: str, value: Any) -> tuple[int, int]:
    """``(BN, BK)`` as a tuple of two positive ints, or the library error."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        bn, bk = value
    except (TypeError, ValueError):
        raise InvalidTypeError(f"{owner}.weight_block must be two integers (BN, BK), got {value!r}") from None
    return _int_field(owner, "weight_block[0]", bn, 1), _int_field(owner, "weight_block[1]", bk, 1)


def _check_group_pairing(owner: str, act: ActScale, weight: WeightScale, group: int,
                         block: tuple[int, int]) -> None:
    """Block weights pair with per-token-group activations whose group divides the block's K extent (each K block
    of the weight then spans whole activation groups); other weights pair with the other modes."""
    if act is ActScale.PER_TOKEN_GROUP and group not in GROUP_SIZES:
        raise InvalidInputError(
            f"{owner}.group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group}")
    if (act is ActScale.PER_TOKEN_GROUP) != (weight is WeightScale.BLOCK):
        raise InvalidInputError(
            f"{owner}: block weight scales pair with per_token_group activation scales (block-wise FP8); got "
            f"act_scale={act.value} with weight_scale={weight.value}")
    if weight is WeightScale.BLOCK and block[1] % group:
        raise InvalidInputError(
            f"{owner}: the weight block's K extent {block[1]} must be a multiple of the activation group size "
            f"{group}")


class Fp8Dtype(str, enum.Enum):
    """FP8 element types, named as torch names them (``torch.float8_<value>``)."""

    E4M3FN = "e4m3fn"
    E5M2 = "e5m2"

    @property
    def max(self) -> float:
        return 448.0 if self is Fp8Dtype.E4M3FN else 57344.0

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, f"float8_{self.value}")

    @classmethod
    def of(cls, dtype: Any) -> Fp8Dtype:
        """Accept a torch dtype, ``"e4m3fn"``/``"float8_e4m3fn"`` or an instance."""
        if isinstance(dtype, cls):
            return dtype
        text = str(dtype).removeprefix("torch.").removeprefix("float8_")
        member = cls._value2member_map_.get(text)
        if member is None:
            raise InvalidInputError(f"not an FP8 dtype: {dtype!r} (expected e4m3fn or e5m2)")
        return member


class OutDtype(str, enum.Enum):
    """Output (and high-precision activation) dtypes."""

    BF16 = "bfloat16"
    FP16 = "float16"
    FP32 = "float32"

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.value)

    @classmethod
    def of(cls, dtype: Any) -> OutDtype:
        """Accept a torch dtype, a name (``"bf16"``, ``"bfloat16"``, ``"torch.float16"``) or an instance."""
        if isinstance(dtype, cls):
            return dtype
        text = str(dtype).removeprefix("torch.")
        text = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                "float": "float32"}.get(text, text)
        member = cls._value2member_map_.get(text)
        if member is None:
            raise InvalidInputError(f"unsupported output dtype {dtype!r} (expected bfloat16, float16 or float32)")
        return member


class BiasMode(str, enum.Enum):
    """How a provider handles ``bias``: inside its kernel (``FUSED``), with a separate add after its
    kernel (``ADDED_AFTER``), or not at all (``NONE``: problems with a bias are refused)."""

    FUSED = "fused"
    ADDED_AFTER = "added_after"
    NONE = "none"


class DeviceKind(str, enum.Enum):
    CUDA = "cuda"
    CPU = "cpu"

    @classmethod
    def of(cls, device: Any) -> DeviceKind:
        """Accept ``"cuda"``, ``"cuda:1"``, ``"cpu"``, a ``torch.device`` or an instance."""
        if isinstance(device, cls):
            return device
        kind = getattr(device, "type", None)
        if kind is None:
            kind, sep, index = str(device).partition(":")
            if sep and not (kind == "cuda" and index.isdigit()):
                raise InvalidInputError(f"unsupported device {device!r} (expected cpu, cuda or cuda:N)")
        member = cls._value2member_map_.get(kind)
        if member is None:
            raise InvalidInputError(f"unsupported device {device!r} (expected cpu or cuda)")
        return member


@dataclass(frozen=True)
class GemmProblem:
    """What a caller wants computed: ``y[M, N] = (x_q·s_x) @ (w_q·s_w)ᵀ (+ bias)``.

    ``m`` may be ``None`` at load time (unknown batch size); ``n`` and ``k`` are the weight's
    ``[N, K]`` shape. ``device`` is where the tensors live. Block-wise FP8 (``act_scale="per_token_group"`` with
    ``weight_scale="block"``) also has ``group_size`` (the activation group along K: 128, or 64) and
    ``weight_block`` (``(BN, BK)``, 128x128); the other modes ignore both.
    """

    n: int
    k: int
    m: int | None = None
    input_dtype: Fp8Dtype = Fp8Dtype.E4M3FN
    weight_dtype: Fp8Dtype = Fp8Dtype.E4M3FN
    out_dtype: OutDtype = OutDtype.BF16
    act_scale: ActScale = ActScale.PER_TENSOR_DYNAMIC
    weight_scale: WeightScale = WeightScale.PER_TENSOR
    has_bias: bool = False
    device: DeviceKind = DeviceKind.CUDA
    group_size: int = DEFAULT_GROUP_SIZE
    weight_block: tuple[int, int] = DEFAULT_WEIGHT_BLOCK

    def __post_init__(self) -> None:
        # normalise loose inputs ("bf16", torch dtypes, plain strings, NumPy ints) into ints, bools and the
        # enums; anything else raises InvalidTypeError / InvalidInputError (TypeError / ValueError)
        setattr_ = object.__setattr__
        setattr_(self, "n", _int_field("GemmProblem", "n", self.n, 1))
        setattr_(self, "k", _int_field("GemmProblem", "k", self.k, 1))
        if self.m is not None:
            setattr_(self, "m", _int_field("GemmProblem", "m", self.m, 0))
        setattr_(self, "input_dtype", Fp8Dtype.of(self.input_dtype))
        setattr_(self, "weight_dtype", Fp8Dtype.of(self.weight_dtype))
        setattr_(self, "out_dtype", OutDtype.of(self.out_dtype))
        setattr_(self, "act_scale", ActScale.of(self.act_scale))
        setattr_(self, "weight_scale", _weight_scale_of(self.weight_scale))
        setattr_(self, "has_bias", _flag_field("GemmProblem", "has_bias", self.has_bias))
        setattr_(self, "device", DeviceKind.of(self.device))
        setattr_(self, "group_size", _int_field("GemmProblem", "group_size", self.group_size, 1))
        setattr_(self, "weight_block", _block_field("GemmProblem", self.weight_block))
        _check_group_pairing("GemmProblem", self.act_scale, self.weight_scale, self.group_size, self.weight_block)

    @property
    def block_scaled(self) -> bool:
        """Block-wise FP8: per-token-group activations with block weights."""
        return self.weight_scale is WeightScale.BLOCK

    def with_m(self, m: int | None) -> GemmProblem:
        return replace(self, m=m)

    def describe(self) -> str:
        m = "?" if self.m is None else self.m
        return (
            f"M={m} N={self.n} K={self.k} {self.input_dtype.value}x{self.weight_dtype.value}"
            f"->{self.out_dtype.value} act={self.act_scale.value}{self._group_text()} w={self.weight_scale.value}"
            f"{self._block_text()}{' +bias' if self.has_bias else ''} on {self.device.value}"
        )

    def _group_text(self) -> str:
        return f"/{self.group_size}" if self.act_scale is ActScale.PER_TOKEN_GROUP else ""

    def _block_text(self) -> str:
        return f"/{self.weight_block[0]}x{self.weight_block[1]}" if self.weight_scale is WeightScale.BLOCK else ""


@dataclass(frozen=True)
class NormQuantProblem:
    """A fused RMSNorm + FP8 quant: ``x: [T, H]`` in ``in_dtype``.

    ``act_scale``: how the normalized activation is scaled: ``per_tensor_static`` (a given scale, the default),
    ``per_token`` (one dynamic scale per row) or ``per_token_group`` (one dynamic scale per row and ``group_size``
    columns). Dynamic per-tensor is not a norm-quant mode (its global amax needs a pass over all rows first).
    """

    hidden: int
    tokens: int | None = None
    in_dtype: OutDtype = OutDtype.BF16
    out_fp8: Fp8Dtype = Fp8Dtype.E4M3FN
    residual: bool = False
    device: DeviceKind = DeviceKind.CUDA
    act_scale: ActScale = ActScale.PER_TENSOR_STATIC
    group_size: int = DEFAULT_GROUP_SIZE

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        setattr_(self, "hidden", _int_field("NormQuantProblem", "hidden", self.hidden, 1))
        if self.tokens is not None:
            setattr_(self, "tokens", _int_field("NormQuantProblem", "tokens", self.tokens, 0))
        setattr_(self, "in_dtype", OutDtype.of(self.in_dtype))
        setattr_(self, "out_fp8", Fp8Dtype.of(self.out_fp8))
        setattr_(self, "residual", _flag_field("NormQuantProblem", "residual", self.residual))
        setattr_(self, "device", DeviceKind.of(self.device))
        setattr_(self, "act_scale", ActScale.of(self.act_scale))
        setattr_(self, "group_size", _int_field("NormQuantProblem", "group_size", self.group_size, 1))
        if self.act_scale is ActScale.PER_TENSOR_DYNAMIC:
            raise InvalidInputError(
                "NormQuantProblem.act_scale per_tensor_dynamic is not a norm-quant mode (its global amax needs every "
                "row first); use per_token, per_token_group or a static scale")
        if self.act_scale is ActScale.PER_TOKEN_GROUP and self.group_size not in GROUP_SIZES:
            raise InvalidInputError(
                f"NormQuantProblem.group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got "
                f"{self.group_size}")

    def describe(self) -> str:
        t = "?" if self.tokens is None else self.tokens
        mode = "" if self.act_scale is ActScale.PER_TENSOR_STATIC else f" {self.act_scale.value}"
        if self.act_scale is ActScale.PER_TOKEN_GROUP:
            mode += f"/{self.group_size}"
        return (
            f"T={t} H={self.hidden} {self.in_dtype.value}->{self.out_fp8.value}{mode}"
            f"{' +residual' if self.residual else ''} on {self.device.value}"
        )


@dataclass(frozen=True)
class Availability:
    """Whether a provider can run at all in this process (libraries importable, hardware present)."""

    ok: bool
    reason: str = ""
    install_hint: str = ""
    #: the library error behind a ``no`` that the user's configuration caused (a bad ``FP8_BACKENDS_TRITON_TABLE``):
    #: ``auto`` raises it rather than pass the provider over
    error: Exception | None = field(default=None, compare=False)

    @classmethod
    def yes(cls, reason: str = "") -> Availability:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str, install_hint: str = "", error: Exception | None = None) -> Availability:
        return cls(False, reason, install_hint, error)


class QuantizedActivation(NamedTuple):
    """The typed hand-off from a fused norm+quant kernel (or a quant op) to an FP8 linear.

    - ``data``: ``[M, K]`` float8 (e4m3fn unless stated), row-major.
    - ``scale``: fp32 tensor; ``[1]`` (or 0-d) for per-tensor modes, ``[M, 1]`` for ``PER_TOKEN``,
      ``[M, ceil(K/G)]`` for ``PER_TOKEN_GROUP`` (in the layout its consumer reads: :class:`ScaleLayout`).
    - ``orig_dtype``: the model's dtype before quantization; a consumer returns this dtype.
    - ``mode``: how ``scale`` was obtained; a consumer prepared for another mode refuses it.

    It is a NamedTuple so that torch.compile traces it without graph breaks. A consumer never
    re-quantizes it.
    """

    data: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype
    mode: ActScale = ActScale.PER_TENSOR_STATIC


@dataclass
class PreparedWeight:
    """A weight converted once, at load time, into the layout a provider's kernel wants.

    - ``data``: provider-specific view or copy of ``w_q [N, K]`` (e.g. a column-major ``[K, N]`` view).
    - ``scale``: fp32 ``[1]`` (per-tensor), ``[1, N]``/``[N]`` (per-channel) or ``[ceil(N/BN), ceil(K/BK)]``
      (block), in the provider's layout.
    - ``backend``: the provider name that prepared it; another provider refuses it.
    - ``extra``: provider-owned state (e.g. cached runner handles).
    - ``block``: ``(BN, BK)`` for block scales, else ``None``; ``group_size``: the activation group size a block
      weight is served with (``BK`` unless stated).
    - ``k_pad``: the K the kernel reads when the provider zero-padded the weight's rows to it (K not a multiple of
      16: :mod:`fp8_backends.core.padding`), else ``None``. Activations reach the kernel zero-padded to it: a layer's
      quantizer writes them so, the provider pads any other.
    """

    data: Any
    scale: Any
    n: int
    k: int
    dtype: Fp8Dtype
    weight_scale: WeightScale
    backend: str
    extra: dict[str, Any] = field(default_factory=dict)
    block: tuple[int, int] | None = None
    group_size: int | None = None
    k_pad: int | None = None


__all__ = [
    "ActScale",
    "Availability",
    "BiasMode",
    "DeviceKind",
    "Fp8Dtype",
    "GemmProblem",
    "NormQuantProblem",
    "OutDtype",
    "PreparedWeight",
    "QuantizedActivation",
    "ScaleLayout",
    "WeightScale",
]
