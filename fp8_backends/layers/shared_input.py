"""Linears that read the same input, run as one GEMM: :class:`Fp8LinearSlice` and :class:`SharedInputGroup`.

A ``transformers`` attention block calls ``q_proj(x)``, ``k_proj(x)`` and ``v_proj(x)`` on one tensor, its MLP
``gate_proj(x)`` and ``up_proj(x)``: three and two GEMMs (and, unfused, three and two activation quantizations) where
an engine runs one (vLLM's ``QKVParallelLinear``, ``MergedColumnParallelLinear``). Each call costs host time, and a
compiled prefill step of a few hundred tokens is host-bound. :func:`fp8_backends.quantize_model` therefore puts such
siblings' weights into one :class:`~fp8_backends.layers.Fp8Linear` (``[N_1 + ... + N_s, K]``) and replaces each
sibling by an :class:`Fp8LinearSlice`, so the model's own code keeps calling ``self.k_proj(x)``.

How a call is served (:meth:`SharedInputGroup.output`): the first slice called with an input runs the fused layer on
it and keeps the outputs (views of one ``[..., N]`` result, split along the last dim); a sibling called next with
*the same tensor object* (and, eager, the same version counter: not modified in place since; inference tensors
have none, so under ``torch.inference_mode`` identity alone decides) takes its view; once
every sibling has taken its own, the group forgets them (a sibling called again before then, as on a static buffer
refilled in place, runs the fused layer anew). A sibling called with another input runs the fused layer on
that input instead, so the result is always this input's: correctness never depends on the model calling siblings
together, only speed does. Eager calls that leave a group's outputs untaken (the siblings do not share their
input, e.g. a cross-attention's ``k``/``v`` on encoder states) are logged once as a warning: pass ``fuse=False`` to
``quantize_model`` there. The pending result is one object (input, version, outputs), so calls from several threads
never pair one input with another's outputs (they may run a group's GEMM more than once).

Under ``torch.compile`` the bookkeeping is traced: Dynamo resolves the identity tests at trace time, so a compiled
step runs one GEMM per group, and the outputs are views (no copy kernel).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.errors import InvalidInputError
from ..core.types import QuantizedActivation

if TYPE_CHECKING:
    from .modules import Fp8Linear

logger = logging.getLogger("fp8_backends")

_compiling = torch.compiler.is_compiling


def version_of(x: object) -> int:
    """The version counter of ``x``'s tensor (in-place writes bump it); -2 for an inference tensor
    (``torch.inference_mode``), which has none (identity alone then decides), -1 for anything that is not a tensor
    (the fused layer rejects it with the library's error)."""
    data = x.data if isinstance(x, QuantizedActivation) else x
    if not isinstance(data, torch.Tensor):
        return -1
    return -2 if data.is_inference() else data._version


class SharedInputGroup:
    """The bookkeeping of sibling :class:`Fp8LinearSlice` modules over one fused layer.

    - :attr:`sizes`: each sibling's ``N`` (output columns of the fused layer, in order); :attr:`names`: the siblings'
      module names (messages only).
    - The fused layer lives in the module tree as the first slice's ``fused`` submodule (so ``state_dict``, device
      moves and copies see it once); :attr:`owner` is that slice, :attr:`layer` the fused layer (kept in step with
      ``owner.fused`` when that is replaced). A compiled call reaches the layer through the group only: reaching it
      through ``owner`` too would cost one more identity guard per group and call.
    """

    __slots__ = ("_left", "_pending", "layer", "names", "owner", "sizes", "warned")

    def __init__(self, sizes: Sequence[int], names: Sequence[str]) -> None:
        if len(sizes) < 2 or len(sizes) != len(names):
            raise InvalidInputError(f"a shared-input group needs >= 2 siblings with one size each, got {sizes}")
        self.sizes = [int(s) for s in sizes]
        self.names = [str(n) for n in names]
        self.owner: Fp8LinearSlice | None = None
        self.layer: nn.Module | None = None
        #: ``(input, its version counter (eager; -1 compiled), the siblings' outputs)``, written and read as one
        #: object, so a call never pairs one input with another input's outputs, from any thread
        self._pending: tuple[Any, int, tuple[torch.Tensor, ...]] | None = None
        #: bit ``i``: sibling ``i`` has not taken its output of the pending result yet (a sibling called again with
        #: the same input object, e.g. a static buffer refilled in place, gets a fused call of its own)
        self._left = 0
        self.warned = False

    @property
    def has_pending(self) -> bool:
        """Whether outputs computed for siblings not yet called are held (with their input)."""
        return self._pending is not None

    def output(self, index: int, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        """Sibling ``index``'s output for ``x``: its view of the pending fused result when that was computed from
        this very input, else of a fused call made now."""
        compiling = _compiling()
        pending = self._pending
        bit = 1 << index
        if (pending is not None and pending[0] is x and self._left & bit
                and (compiling or pending[1] == version_of(x))):
            self._left &= ~bit
            if not self._left:
                self._pending = None
            return pending[2][index]
        if pending is not None and pending[0] is not x and not compiling and not self.warned:
            self.warned = True
            logger.warning("fused linears %s: %s was called with another input than the one its siblings' outputs "
                           "were computed from (they do not share their input here); each such call runs the whole "
                           "fused GEMM. quantize_model(..., fuse=False) keeps them separate", "+".join(self.names),
                           self.names[index])
        outs = self.layer(x).split(self.sizes, dim=-1)
        self._pending = (x, -1 if compiling else version_of(x), outs)
        self._left = ((1 << len(self.sizes)) - 1) & ~bit
        return outs[index]

    def reset(self) -> None:
        """Forget a pending result (and the input it holds)."""
        self._pending = None
        self._left = 0

    def __getstate__(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self.__slots__}
        state["_pending"] = None  # a copy never shares a pending result
        state["_left"] = 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


class Fp8LinearSlice(nn.Module):
    """One sibling of a fused :class:`~fp8_backends.layers.Fp8Linear`: ``y = x @ W_iᵀ (+ b_i)`` where ``W_i`` is rows
    ``[start, start + out_features)`` of the fused weight. ``x``: ``[..., K]`` in the model dtype or a
    :class:`~fp8_backends.core.types.QuantizedActivation`; returns ``[..., out_features]`` in the model dtype, a view
    of the fused ``[..., N]`` output (last dim contiguous, row stride ``N``).

    Attributes: ``in_features``, ``out_features``, ``index`` (its place in the group), ``start`` (its first row),
    ``group`` (:class:`SharedInputGroup`); the group's first slice also holds the fused layer as ``fused``.
    ``weight`` / ``weight_scale`` / ``bias`` are views of the fused layer's rows (``weight_scale`` the one value of a
    per-tensor scale; with block scales the rows of blocks that hold this sibling's rows: its own, since fused
    block-scaled siblings span whole blocks)."""

    def __init__(self, group: SharedInputGroup, index: int, fused: Fp8Linear | None = None) -> None:
        super().__init__()
        if not 0 <= index < len(group.sizes):
            raise InvalidInputError(f"slice index {index} out of range for {len(group.sizes)} siblings")
        self.group = group
        self.index = index
        self.start = sum(group.sizes[:index])
        self.out_features = group.sizes[index]
        if fused is not None:
            if fused.out_features != sum(group.sizes):
                raise InvalidInputError(f"fused layer has {fused.out_features} outputs, the group {sum(group.sizes)}")
            group.owner = self
            self.fused = fused  # also group.layer (__setattr__)
        elif group.owner is None:
            raise InvalidInputError("the group's first slice must be built with its fused layer")
        self.in_features = group.layer.in_features

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "fused" and self.group.owner is self:  # a replaced fused layer serves the whole group
            self.group.layer = value

    def _rows(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """This sibling's rows of a per-row tensor of the fused layer; a per-tensor value (or None) as it is."""
        if t is None or t.shape[0] != sum(self.group.sizes):
            return t
        return t[self.start:self.start + self.out_features]

    @property
    def weight(self) -> torch.Tensor:
        return self._rows(self.group.layer.weight)

    @property
    def weight_scale(self) -> torch.Tensor:
        layer = self.group.layer
        block = getattr(layer, "weight_block", None)
        if block is None:
            return self._rows(layer.weight_scale)
        first, end = self.start, self.start + self.out_features  # block scales: this sibling's rows of blocks
        return layer.weight_scale[first // block[0]:-(-end // block[0])]

    @property
    def bias(self) -> torch.Tensor | None:
        return self._rows(getattr(self.group.layer, "bias", None))

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.group.output(self.index, x)

    def extra_repr(self) -> str:
        group = self.group
        return (f"in_features={self.in_features}, out_features={self.out_features}, rows "
                f"{self.start}:{self.start + self.out_features} of the fused {'+'.join(group.names)}")


__all__ = ["Fp8LinearSlice", "SharedInputGroup", "version_of"]
