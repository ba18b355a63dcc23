"""Declarative capability records.

A provider states what it can do once, as data; :meth:`GemmCapabilities.check` turns a problem and a
platform into the list of reasons it cannot serve them (empty: it can). The listing prints the same
record, so what a user reads and what resolution decides never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .types import (
    ActScale,
    BiasMode,
    DeviceKind,
    Fp8Dtype,
    GemmProblem,
    NormQuantProblem,
    OutDtype,
    ScaleLayout,
    WeightScale,
)

if TYPE_CHECKING:
    from .platform import Platform


def _fs(*items):  # frozenset factory for dataclass defaults
    return field(default_factory=lambda: frozenset(items))


def _parse_arch(text: str) -> tuple[int, int, str]:
    """``"9.0a"`` -> (9, 0, "a"); ``"10.0f"`` -> (10, 0, "f"); ``"8.9"`` -> (8, 9, "")."""
    suffix = text[-1] if text and text[-1] in "af" else ""
    major, _, minor = text.rstrip("af").partition(".")
    return int(major), int(minor or 0), suffix


def _set_problem(value: object, kind: type, what: str, *, non_empty: bool = False) -> str | None:
    """Why ``value`` is not a (frozen)set of ``kind`` values (non-empty where asked), or None."""
    if not isinstance(value, (set, frozenset)) or not all(isinstance(v, kind) for v in value):
        return f"{what} must be a frozenset of {kind.__name__}, got {value!r}"
    if non_empty and not value:
        return f"{what} must name at least one {kind.__name__}"
    return None


def _group_sizes_problem(value: object) -> str | None:
    """Why ``value`` is not a (frozen)set of positive ints (activation group sizes), or None."""
    problem = _set_problem(value, int, "group_sizes")
    if problem is None and any(isinstance(g, bool) or g < 1 for g in value):  # type: ignore[union-attr]
        problem = f"group_sizes must be positive ints, got {sorted(value)!r}"  # type: ignore[call-overload]
    return problem


def _int_problem(value: object, what: str, low: int | None = None) -> str | None:
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        return f"{what} must be an int{'' if low is None else f' >= {low}'}, got {value!r}"
    return None


def _bool_problem(value: object, what: str) -> str | None:
    return None if isinstance(value, bool) else f"{what} must be a bool, got {value!r}"


def _sm_problem(value: object, what: str) -> str | None:
    if value is None:
        return None
    if (not isinstance(value, tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        return f"{what} must be None or a (major, minor) pair of ints, got {value!r}"
    return None


def _first(*problems: str | None) -> list[str]:
    return [p for p in problems if p is not None]


@dataclass(frozen=True)
class Capabilities:
    """What every provider declares: where it runs and how it ranks.

    - ``devices``: device kinds the kernels run on.
    - ``min_sm`` / ``max_sm``: inclusive SM range (``None`` = open). Ignored when ``archs`` is set.
    - ``archs``: explicit targets, e.g. ``("9.0a",)``: ``a`` targets run only on that exact SM;
      ``f`` targets on the same major with minor >= the stated one; plain ``"8.9"`` on exactly 8.9.
    - ``pdl``: launches with programmatic dependent launch where the GPU has it (SM >= 9.0).
    - ``priority``: higher wins in ``auto`` among providers that can serve.
    """

    devices: frozenset[DeviceKind] = _fs(DeviceKind.CUDA)
    min_sm: tuple[int, int] | None = None
    max_sm: tuple[int, int] | None = None
    archs: tuple[str, ...] = ()
    pdl: bool = False
    priority: int = 0

    def record_problems(self) -> list[str]:
        """What is malformed in this record (field types and values; empty: nothing): discovery and
        ``register_provider`` mark a provider with a malformed record unusable, naming these, before any listing or
        ranking reads it."""
        problems = _first(_set_problem(self.devices, DeviceKind, "devices", non_empty=True),
                          _sm_problem(self.min_sm, "min_sm"), _sm_problem(self.max_sm, "max_sm"),
                          _bool_problem(self.pdl, "pdl"), _int_problem(self.priority, "priority"))
        if not isinstance(self.archs, (tuple, list)) or not all(isinstance(a, str) for a in self.archs):
            problems.append(f"archs must be a tuple of strings such as '9.0a', got {self.archs!r}")
        else:
            for arch in self.archs:
                try:
                    _parse_arch(arch)
                except ValueError:
                    problems.append(f"archs entry {arch!r} is not an SM such as '9.0', '9.0a' or '10.0f'")
        return problems

    def arch_summary(self) -> str:
        if self.archs:
            return ",".join(self.archs)
        if self.min_sm is None and self.max_sm is None:
            return "any" if DeviceKind.CUDA in self.devices else "-"
        lo = "" if self.min_sm is None else f"{self.min_sm[0]}.{self.min_sm[1]}"
        hi = "" if self.max_sm is None else f"{self.max_sm[0]}.{self.max_sm[1]}"
        return f">={lo}" if not hi else (f"<={hi}" if not lo else f"{lo}-{hi}")

    def platform_reasons(self, platform: Platform, device: DeviceKind) -> list[str]:
        """Why the provider cannot run on ``platform`` for tensors on ``device``."""
        reasons: list[str] = []
        if device not in self.devices:
            have = ", ".join(sorted(d.value for d in self.devices))
            reasons.append(f"runs on {have} tensors only, not {device.value}")
            return reasons
        if device is DeviceKind.CPU:
            return reasons
        if not platform.is_cuda or platform.sm is None:
            reasons.append("no CUDA device here")
            return reasons
        if self.archs:
            if not any(self._arch_matches(a, platform.sm) for a in self.archs):
                reasons.append(
                    f"built for SM {', '.join(self.archs)}; this GPU is SM {platform.arch}"
                )
            return reasons
        if self.min_sm is not None and platform.sm < self.min_sm:
            reasons.append(
                f"needs SM >= {self.min_sm[0]}.{self.min_sm[1]}; this GPU is SM {platform.arch}"
            )
        if self.max_sm is not None and platform.sm > self.max_sm:
            reasons.append(
                f"supports SM <= {self.max_sm[0]}.{self.max_sm[1]}; this GPU is SM {platform.arch}"
            )
        return reasons

    @staticmethod
    def _arch_matches(arch: str, sm: tuple[int, int]) -> bool:
        major, minor, suffix = _parse_arch(arch)
        if suffix == "f":
            return sm[0] == major and sm[1] >= minor
        return sm == (major, minor)


@dataclass(frozen=True)
class GemmCapabilities(Capabilities):
    """What an FP8 GEMM provider can compute.

    - ``act_scales`` / ``weight_scales``: accepted scale granularities.
    - ``input_dtypes``: FP8 element types accepted for both operands; ``mixed_inputs`` allows
      ``x`` and ``w`` of different FP8 types.
    - ``out_dtypes``: output dtypes.
    - ``bias``: fused into the kernel, added after it, or unsupported.
    - ``k_align`` / ``n_align``: K and N must be multiples of these (elements) for tensors on the devices of
      ``align_devices`` (default: every device); ``align_reason`` says why (the kernels' rule: TMA's 16-byte rows, a
      library's FP8 layout), shown with every refusal. The default, 16, is what most FP8 kernels need; a provider
      whose kernels serve any N and K (masked loads) says 1.
    - ``group_sizes``: activation group sizes served in ``per_token_group`` mode, and ``weight_blocks``: the
      ``(BN, BK)`` weight blocks served in ``block`` mode. Block-wise FP8 is opt-in: with either empty (the
      default) the provider serves no block problem, whatever ``act_scales`` / ``weight_scales`` say (a provider
      written before the mode existed, declaring ``frozenset(ActScale)``, never claims it by accident).
    - ``group_scale_layout``: the layout its kernel reads per-token-group activation scales in
      (:class:`~fp8_backends.core.types.ScaleLayout`); the quantizer feeding it writes that layout.
    """

    act_scales: frozenset[ActScale] = _fs(ActScale.PER_TENSOR_STATIC, ActScale.PER_TENSOR_DYNAMIC)
    weight_scales: frozenset[WeightScale] = _fs(WeightScale.PER_TENSOR)
    input_dtypes: frozenset[Fp8Dtype] = _fs(Fp8Dtype.E4M3FN)
    mixed_inputs: bool = False
    out_dtypes: frozenset[OutDtype] = _fs(OutDtype.BF16, OutDtype.FP16)
    bias: BiasMode = BiasMode.NONE
    k_align: int = 16
    n_align: int = 16
    align_reason: str = ""
    align_devices: frozenset[DeviceKind] = _fs(DeviceKind.CUDA, DeviceKind.CPU)
    group_sizes: frozenset[int] = frozenset()
    weight_blocks: frozenset[tuple[int, int]] = frozenset()
    group_scale_layout: ScaleLayout = ScaleLayout.ROW_MAJOR

    def record_problems(self) -> list[str]:
        problems = super().record_problems() + _first(
            _set_problem(self.act_scales, ActScale, "act_scales"),
            _set_problem(self.weight_scales, WeightScale, "weight_scales"),
            _set_problem(self.input_dtypes, Fp8Dtype, "input_dtypes"),
            _set_problem(self.out_dtypes, OutDtype, "out_dtypes"),
            _bool_problem(self.mixed_inputs, "mixed_inputs"),
            None if isinstance(self.bias, BiasMode) else f"bias must be a BiasMode, got {self.bias!r}",
            _int_problem(self.k_align, "k_align", 1), _int_problem(self.n_align, "n_align", 1),
            None if isinstance(self.align_reason, str) else f"align_reason must be a str, got {self.align_reason!r}",
            _set_problem(self.align_devices, DeviceKind, "align_devices"),
            _group_sizes_problem(self.group_sizes),
            None if isinstance(self.group_scale_layout, ScaleLayout)
            else f"group_scale_layout must be a ScaleLayout, got {self.group_scale_layout!r}")
        if not isinstance(self.weight_blocks, (set, frozenset)) or not all(
                isinstance(b, tuple) and len(b) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                                              for v in b) for b in self.weight_blocks):
            problems.append(f"weight_blocks must be a frozenset of (BN, BK) pairs of positive ints, got "
                            f"{self.weight_blocks!r}")
        return problems

    @property
    def block_scaled(self) -> bool:
        """Whether the provider serves block-wise FP8 at all (a group size and a weight block declared, and both
        modes listed)."""
        return bool(self.group_sizes and self.weight_blocks and ActScale.PER_TOKEN_GROUP in self.act_scales
                    and WeightScale.BLOCK in self.weight_scales)

    def check(self, problem: GemmProblem | None, platform: Platform) -> list[str]:
        """Every reason this record rules the problem out on this platform (empty: it can serve)."""
        if problem is None:
            device = DeviceKind.CPU if platform.kind is DeviceKind.CPU else DeviceKind.CUDA
            return self.platform_reasons(platform, device)
        reasons = self.platform_reasons(platform, problem.device)
        if problem.block_scaled:
            reasons += self._block_reasons(problem)
        else:
            if problem.act_scale not in self.act_scales:
                reasons.append(
                    f"activation scale {problem.act_scale.value} not supported "
                    f"(supports {_names(self.act_scales)})"
                )
            if problem.weight_scale not in self.weight_scales:
                reasons.append(
                    f"weight scale {problem.weight_scale.value} not supported "
                    f"(supports {_names(self.weight_scales)})"
                )
        for role, dt in (("input", problem.input_dtype), ("weight", problem.weight_dtype)):
            if dt not in self.input_dtypes:
                reasons.append(f"{role} dtype {dt.value} not supported (supports {_names(self.input_dtypes)})")
        if problem.input_dtype is not problem.weight_dtype and not self.mixed_inputs:
            reasons.append(
                f"mixed FP8 inputs ({problem.input_dtype.value} x {problem.weight_dtype.value}) not supported"
            )
        if problem.out_dtype not in self.out_dtypes:
            reasons.append(
                f"output dtype {problem.out_dtype.value} not supported (supports {_names(self.out_dtypes)})"
            )
        if problem.has_bias and self.bias is BiasMode.NONE:
            reasons.append("bias not supported")
        reasons += self.alignment_reasons(problem.n, problem.k, problem.device)
        return reasons

    def alignment_reasons(self, n: int, k: int, device: DeviceKind) -> list[str]:
        """Why ``k_align`` / ``n_align`` rule out an ``[N, K]`` weight on ``device`` tensors (with ``align_reason``;
        empty: they do not)."""
        reasons: list[str] = []
        if device not in self.align_devices:
            return reasons
        why = f" ({self.align_reason})" if self.align_reason else ""
        if k % self.k_align:
            reasons.append(f"K={k} is not a multiple of {self.k_align}{why}")
        if n % self.n_align:
            reasons.append(f"N={n} is not a multiple of {self.n_align}{why}")
        return reasons

    def _block_reasons(self, problem: GemmProblem) -> list[str]:
        if not self.block_scaled:
            return ["block-wise FP8 (per_token_group activations x block weights) not supported"]
        reasons = []
        if problem.group_size not in self.group_sizes:
            reasons.append(f"activation group size {problem.group_size} not supported "
                           f"(supports {', '.join(map(str, sorted(self.group_sizes)))})")
        if problem.weight_block not in self.weight_blocks:
            have = ", ".join(f"{bn}x{bk}" for bn, bk in sorted(self.weight_blocks))
            reasons.append(f"weight block {problem.weight_block[0]}x{problem.weight_block[1]} not supported "
                           f"(supports {have})")
        return reasons

    def scale_summary(self) -> str:
        """The scale modes for the listing: ``act x weight`` granularities, and the block-wise mode's shape."""
        text = f"act {_names(self.act_scales - {ActScale.PER_TOKEN_GROUP})}; weight " \
               f"{_names(self.weight_scales - {WeightScale.BLOCK})}"
        if self.block_scaled:
            groups = "/".join(map(str, sorted(self.group_sizes)))
            blocks = "/".join(f"{bn}x{bk}" for bn, bk in sorted(self.weight_blocks))
            text += f"; block {blocks} x group {groups} ({self.group_scale_layout.value} scales)"
        return text


@dataclass(frozen=True)
class NormQuantCapabilities(Capabilities):
    """What a fused RMSNorm + FP8 quant provider can compute.

    - ``in_dtypes``: dtypes of ``x`` / ``residual`` / ``weight``.
    - ``out_fp8``: FP8 output types.
    - ``residual``: supports ``fused_add_rmsnorm_quant``.
    - ``hidden_align``: the hidden size must be a multiple of this.
    - ``act_scales``: how the output is scaled: ``per_tensor_static`` (a given scale; every provider), and the
      dynamic ``per_token`` / ``per_token_group`` modes (opt-in); ``group_sizes``: the groups served in
      ``per_token_group`` mode.
    - ``strided_rows``: the static hooks read ``x`` with its row stride (``x[:, :H]`` of a wider buffer, unit column
      stride): such an ``x`` reaches them as it is. Otherwise (the default) they get a row-major copy. Any other
      layout (a transposed view, broadcast rows) is copied row-major for every provider; the dynamic hooks always
      take row-strided inputs.
    """

    in_dtypes: frozenset[OutDtype] = _fs(OutDtype.BF16, OutDtype.FP16)
    out_fp8: frozenset[Fp8Dtype] = _fs(Fp8Dtype.E4M3FN)
    residual: bool = True
    hidden_align: int = 1
    act_scales: frozenset[ActScale] = _fs(ActScale.PER_TENSOR_STATIC)
    group_sizes: frozenset[int] = frozenset()
    strided_rows: bool = False

    def record_problems(self) -> list[str]:
        return super().record_problems() + _first(
            _set_problem(self.in_dtypes, OutDtype, "in_dtypes"), _set_problem(self.out_fp8, Fp8Dtype, "out_fp8"),
            _bool_problem(self.residual, "residual"), _int_problem(self.hidden_align, "hidden_align", 1),
            _set_problem(self.act_scales, ActScale, "act_scales"), _group_sizes_problem(self.group_sizes),
            _bool_problem(self.strided_rows, "strided_rows"))

    def check(self, problem: NormQuantProblem | None, platform: Platform) -> list[str]:
        if problem is None:
            device = DeviceKind.CPU if platform.kind is DeviceKind.CPU else DeviceKind.CUDA
            return self.platform_reasons(platform, device)
        reasons = self.platform_reasons(platform, problem.device)
        if problem.in_dtype not in self.in_dtypes:
            reasons.append(
                f"input dtype {problem.in_dtype.value} not supported (supports {_names(self.in_dtypes)})"
            )
        if problem.out_fp8 not in self.out_fp8:
            reasons.append(f"FP8 output {problem.out_fp8.value} not supported (serves {_names(self.out_fp8)})")
        if problem.residual and not self.residual:
            reasons.append("fused residual add not supported")
        if problem.act_scale not in self.act_scales:
            reasons.append(f"output scale {problem.act_scale.value} not supported (supports "
                           f"{_names(self.act_scales)})")
        elif problem.act_scale is ActScale.PER_TOKEN_GROUP and problem.group_size not in self.group_sizes:
            have = ", ".join(map(str, sorted(self.group_sizes))) or "none"
            reasons.append(f"group size {problem.group_size} not supported (supports {have})")
        if problem.hidden % self.hidden_align:
            reasons.append(f"hidden size {problem.hidden} is not a multiple of {self.hidden_align}")
        return reasons


def _names(items) -> str:
    return ", ".join(sorted(i.value for i in items)) or "none"


__all__ = ["Capabilities", "GemmCapabilities", "NormQuantCapabilities"]
