"""How one linear of a quantized checkpoint is stored: :class:`Scheme` (torch-free).

A scheme says how the weight ``w_q [N, K]`` (float8_e4m3fn) is scaled, how the activation is quantized, and under
which names the checkpoint stores the scales:

- ``weight``: ``"tensor"`` (one scale: shape ``()``, ``[1]`` or ``[1, 1]``), ``"channel"`` (one per output row:
  ``[N]`` or ``[N, 1]``) or ``"block"`` (one per ``BN x BK`` block: ``[ceil(N/BN), ceil(K/BK)]``);
- ``act``: ``"static"`` (one calibrated input scale stored in the checkpoint), ``"dynamic"`` (one scale per batch),
  ``"token"`` (one per row, per batch) or ``"group"`` (one per row and group of ``group_size`` columns, per batch);
- the dequantized weight is ``w_q * scale`` in every format (HF ``fp8``'s ``weight_scale_inv`` included: despite its
  name it is the multiplier).
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_KINDS = ("tensor", "channel", "block")
ACT_KINDS = ("static", "dynamic", "token", "group")

#: the library's activation mode (:class:`~fp8_backends.core.types.ActScale` value) of each ``act`` kind
ACT_SCALE = {"static": "per_tensor_static", "dynamic": "per_tensor_dynamic", "token": "per_token",
             "group": "per_token_group"}
#: the library's weight-scale mode (:class:`~fp8_backends.core.types.WeightScale` value) of each ``weight`` kind
WEIGHT_SCALE = {"tensor": "per_tensor", "channel": "per_channel", "block": "block"}

#: safetensors dtype codes of FP8 weights, and of the scale dtypes converted to fp32 at load
FP8_E4M3 = "F8_E4M3"
FP8_E5M2 = "F8_E5M2"
SCALE_DTYPES = ("F32", "BF16", "F16", "F64")


@dataclass(frozen=True)
class Scheme:
    """One linear's quantization as a checkpoint stores it (see the module docstring).

    ``weight_scale_names`` / ``input_scale_names``: the tensor names (after ``<module>.``) the scales may have, the
    first present one is used (HF ``fp8`` writes ``weight_scale_inv`` and ``activation_scale``, vLLM-style ones
    ``weight_scale`` and ``input_scale``). ``input_scale_names`` of a dynamic scheme name tensors that may be present
    and are not used."""

    weight: str
    act: str
    block: tuple[int, int] | None = None
    group_size: int | None = None
    weight_scale_names: tuple[str, ...] = ("weight_scale",)
    input_scale_names: tuple[str, ...] = ("input_scale",)

    def __post_init__(self) -> None:
        if self.weight not in WEIGHT_KINDS or self.act not in ACT_KINDS:
            raise ValueError(f"unknown scheme {self.weight}/{self.act}")
        if (self.weight == "block") != (self.block is not None):
            raise ValueError("a block scheme (and only one) has a block size")
        if (self.act == "group") != (self.group_size is not None):
            raise ValueError("a group scheme (and only one) has a group size")

    @property
    def act_scale(self) -> str:
        """The :class:`~fp8_backends.core.types.ActScale` value the served layer uses."""
        return ACT_SCALE[self.act]

    @property
    def weight_scale(self) -> str:
        """The :class:`~fp8_backends.core.types.WeightScale` value of the checkpoint's weight scales."""
        return WEIGHT_SCALE[self.weight]

    @property
    def static(self) -> bool:
        return self.act == "static"

    def same_math(self, other: Scheme) -> bool:
        """Whether two linears are quantized alike (tensor names aside): siblings may only be fused then."""
        return (self.weight, self.act, self.block, self.group_size) == (other.weight, other.act, other.block,
                                                                        other.group_size)

    def weight_scale_shape_text(self, n: int, k: int) -> str:
        """The shapes a weight scale of ``[n, k]`` may have, as text (messages)."""
        if self.weight == "tensor":
            return "one value ((), [1] or [1, 1])"
        if self.weight == "channel":
            return f"[{n}] or [{n}, 1]"
        bn, bk = self.block  # type: ignore[misc]
        return f"[{-(-n // bn)}, {-(-k // bk)}] ({bn}x{bk} blocks)"

    def weight_scale_fits(self, shape: tuple[int, ...], n: int, k: int) -> bool:
        """Whether a weight scale of ``shape`` fits a weight ``[n, k]`` in this scheme."""
        if self.weight == "tensor":
            return _numel(shape) == 1 and len(shape) <= 2
        if self.weight == "channel":
            return shape in ((n,), (n, 1)) or (n == 1 and _numel(shape) == 1 and len(shape) <= 2)
        bn, bk = self.block  # type: ignore[misc]
        return shape == (-(-n // bn), -(-k // bk))

    def describe(self) -> str:
        """``"weights per-channel, activations dynamic per-token"``."""
        weight = {"tensor": "per-tensor", "channel": "per-channel",
                  "block": f"{self.block[0]}x{self.block[1]} blocks" if self.block else "block"}[self.weight]
        act = {"static": "static per-tensor", "dynamic": "dynamic per-tensor", "token": "dynamic per-token",
               "group": f"dynamic per-token groups of {self.group_size}"}[self.act]
        return f"weights {weight}, activations {act}"


def input_scale_fits(shape: tuple[int, ...]) -> bool:
    """A static input scale holds one value (``()``, ``[1]`` or ``[1, 1]``)."""
    return _numel(shape) == 1 and len(shape) <= 2


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


__all__ = ["ACT_KINDS", "ACT_SCALE", "FP8_E4M3", "FP8_E5M2", "SCALE_DTYPES", "WEIGHT_KINDS", "WEIGHT_SCALE", "Scheme",
           "input_scale_fits"]
