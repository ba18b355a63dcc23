"""Input checks shared by every provider and layer.

All checks read only metadata (dtype, shape, strides, device) so they cost a few microseconds and
never synchronise with the GPU. Scale *values* (NaN, inf, zero, negative) are checked where that is
free: for CPU tensors, and at load time (``prepare_weight``, layer construction). Set
``FP8_BACKENDS_CHECK_SCALES=1`` to also check device-resident per-call scales (this syncs).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from fp8_backends.core.settings import check_scales_flag

from .errors import InvalidInputError, InvalidTypeError
from .types import DEFAULT_WEIGHT_BLOCK, GROUP_SIZES, Fp8Dtype, OutDtype

if TYPE_CHECKING:
    import torch


def fp8_dtype_of(t: torch.Tensor, what: str) -> Fp8Dtype:
    """The FP8 type of ``t`` or an :class:`InvalidInputError` naming ``what``."""
    import torch

    if t.dtype == torch.float8_e4m3fn:
        return Fp8Dtype.E4M3FN
    if t.dtype == torch.float8_e5m2:
        return Fp8Dtype.E5M2
    raise InvalidInputError(f"{what} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")


def require_tensor(t: object, what: str) -> None:
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")


def require_row_major_2d(t: torch.Tensor, what: str, shape_doc: str) -> None:
    if t.dim() != 2:
        raise InvalidInputError(f"{what} must be 2-D {shape_doc}, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise InvalidInputError(
            f"{what} must be row-major contiguous {shape_doc}, got strides {tuple(t.stride())}; "
            "call .contiguous() once where it is produced"
        )


def require_same_device(t: torch.Tensor, what: str, device: torch.device) -> None:
    if t.device != device:
        raise InvalidInputError(f"{what} is on {t.device} but the operands are on {device}")


def require_fp32_scale(s: object, what: str) -> None:
    import torch

    require_tensor(s, what)
    if s.dtype != torch.float32:
        raise InvalidInputError(f"{what} must be a float32 tensor, got {s.dtype}")


def weight_block_of(
    w_scale: object, n: int, k: int, block: object, group_size: object
) -> tuple[tuple[int, int] | None, int | None]:
    """``(block, group_size)`` for a weight ``[N, K]`` whose scale is ``w_scale``: ``block`` as given (two positive
    ints), or the default 128x128 when ``w_scale`` has that grid's shape ``[ceil(N/128), ceil(K/128)]`` and no other
    mode's (per-tensor ``[1, 1]``, per-channel ``[N, 1]``); ``(None, None)`` for the other modes. ``group_size``
    defaults to the block's K extent and must divide it."""
    require_tensor(w_scale, "w_scale")
    if block is None:
        grid = (-(-n // DEFAULT_WEIGHT_BLOCK[0]), -(-k // DEFAULT_WEIGHT_BLOCK[1]))
        if w_scale.dim() != 2 or tuple(w_scale.shape) != grid or is_scalar_shape(w_scale) or grid == (n, 1):
            if group_size is not None:
                raise InvalidInputError("group_size is a block-wise FP8 argument: give block=(BN, BK) too")
            return None, None
        block = DEFAULT_WEIGHT_BLOCK
    from .types import _block_field, _int_field

    block = _block_field("prepare_weight", block)
    group = block[1] if group_size is None else _int_field("prepare_weight", "group_size", group_size, 1)
    if group not in GROUP_SIZES or block[1] % group:
        raise InvalidInputError(
            f"group_size must be one of {', '.join(map(str, GROUP_SIZES))} and divide the block's K extent "
            f"{block[1]}; got {group}")
    grid = (-(-n // block[0]), -(-k // block[1]))
    if w_scale.dim() != 2 or tuple(w_scale.shape) != grid:
        raise InvalidInputError(
            f"block w_scale for a [N, K] = [{n}, {k}] weight in {block[0]}x{block[1]} blocks must be "
            f"[ceil(N/{block[0]}), ceil(K/{block[1]})] = {list(grid)}; got shape {tuple(w_scale.shape)}")
    return block, group


def block_scale_fp32(w_scale: torch.Tensor) -> torch.Tensor:
    """Block scales as a contiguous fp32 tensor (checkpoints store fp32, bf16 or fp16): load time only."""
    import torch

    if w_scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InvalidInputError(f"block w_scale must be float32, bfloat16 or float16, got {w_scale.dtype}")
    return w_scale.to(torch.float32).contiguous()


def blocks_straddle_shards(sizes: Sequence[int], block_rows: int) -> bool:
    """Whether row shards of ``sizes`` (fused siblings, in order) stacked into one block-scaled weight would put two
    shards in one ``block_rows``-row block: any shard but the last not a multiple of ``block_rows`` (the last one's
    ragged block is the fused weight's last)."""
    return any(size % block_rows for size in sizes[:-1])


def require_group_scale(x_scale: torch.Tensor, m: int, k: int, group_size: int) -> None:
    """A per-token-group activation scale for ``x [M, K]``: 2-D ``[M, ceil(K/G)]`` (any strides)."""
    groups = -(-k // group_size)
    if x_scale.dim() != 2 or tuple(x_scale.shape) != (m, groups):
        raise InvalidInputError(
            f"a block-scaled weight needs per-token-group activation scales x_scale [M, ceil(K/{group_size})] = "
            f"[{m}, {groups}]; got shape {tuple(x_scale.shape)}")


def is_scalar_shape(s: torch.Tensor) -> bool:
    """0-d, ``[1]`` or ``[1, 1]``: one per-tensor scale."""
    return s.numel() == 1 and s.dim() <= 2


#: set by :func:`set_check_device_scales` (None: follow ``FP8_BACKENDS_CHECK_SCALES``)
_FORCED_DEVICE_SCALES: bool | None = None


def device_scale_checks() -> bool:
    """Whether per-call device-resident scales are checked: :func:`set_check_device_scales` if called, else
    ``FP8_BACKENDS_CHECK_SCALES`` read now (strictly; about 0.15 µs: see
    :class:`~fp8_backends.core.settings.EnvFlag`)."""
    forced = _FORCED_DEVICE_SCALES
    return check_scales_flag() if forced is None else forced


# torch.compile takes its value when it traces (scale values are never checked in compiled code): what
# torch._dynamo.assume_constant_result(device_scale_checks) sets, without importing torch in this light module
device_scale_checks._dynamo_marked_constant = True  # type: ignore[attr-defined]


def set_check_device_scales(enabled: bool | None) -> None:
    """Also check device-resident per-call scales (syncs; for debugging). ``None``: follow the
    ``FP8_BACKENDS_CHECK_SCALES`` environment variable again (the default, read at each call)."""
    global _FORCED_DEVICE_SCALES
    _FORCED_DEVICE_SCALES = None if enabled is None else bool(enabled)


#: ids of scale tensors whose values a caller checked already (:func:`scales_checked`)
_checked: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("fp8_backends_checked_scales",
                                                                          default=frozenset())


@contextlib.contextmanager
def scales_checked(*tensors: torch.Tensor) -> Iterator[None]:
    """Within the block, :func:`check_scale_values` passes these tensors (by identity) without reading them: their
    values were checked already, e.g. a layer's scales all at once with one device sync before each provider it
    prepares the weight for would check them again (one sync each)."""
    token = _checked.set(_checked.get() | {id(t) for t in tensors})
    try:
        yield
    finally:
        _checked.reset(token)


def check_scale_values(s: torch.Tensor, what: str, *, force: bool = False) -> None:
    """Refuse NaN, inf, zero or negative scales. Reads values only for CPU tensors unless ``force``
    or :func:`set_check_device_scales` (both sync with the device: use at load time or to debug).
    Skipped while torch.compile traces, for fake tensors (shape propagation: there are no values) and for tensors
    under :func:`scales_checked`."""
    checks = device_scale_checks()  # read even for CPU scales: a bad FP8_BACKENDS_CHECK_SCALES never goes unseen
    if s.device.type != "cpu" and not (force or checks):
        return
    import torch

    if torch.compiler.is_compiling() or _is_fake(s) or id(s) in _checked.get():
        return

    bad = bad_scale_values(s)
    if bool(bad.any()):
        sample = s[bad].flatten()[:4].tolist()
        raise InvalidInputError(f"{what} must be finite and > 0; got {sample}")


def bad_scale_values(s: torch.Tensor) -> torch.Tensor:
    """The mask of ``s``'s values no scale may hold: NaN, inf, zero or negative (device work only, no sync)."""
    import torch

    return ~(torch.isfinite(s) & (s > 0))


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


_OUT_DTYPES: dict[object, OutDtype] = {}


def out_dtype_of(out_dtype: object) -> OutDtype:
    """Parse an output dtype (memoised: this runs on every GEMM call)."""
    try:
        parsed = _OUT_DTYPES.get(out_dtype)
    except TypeError:  # unhashable
        raise InvalidTypeError(f"unsupported output dtype {out_dtype!r}") from None
    if parsed is None:
        parsed = OutDtype.of(out_dtype)  # raises InvalidInputError
        _OUT_DTYPES[out_dtype] = parsed
    return parsed


def require_eps(eps: object, what: str = "eps") -> float:
    """``eps`` as a float: a finite number > 0 (an ``int`` or ``float``, not a ``bool``); otherwise
    :class:`InvalidTypeError` (a string, ``None``) or :class:`InvalidInputError` (zero, negative, inf, NaN)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise InvalidTypeError(f"{what} must be a positive float, got {type(eps).__name__} {eps!r}")
    if not 0.0 < eps < math.inf:
        raise InvalidInputError(f"{what} must be a positive float (finite, > 0), got {eps!r}")
    if eps < FP32_TINY:  # the kernels add it in float32: it would be 0 there, and an all-zero row NaN
        raise InvalidInputError(f"{what} must be at least {FP32_TINY:.4g} (the smallest normal float32: the norm "
                                f"adds it in float32), got {eps!r}")
    return float(eps)


#: the smallest normal float32 (2 ** -126): a smaller eps is flushed to zero in float32 arithmetic (the smallest eps
#: the norms take, here and in :meth:`.backend.NormQuantBackend._accept_common_case`)
FP32_TINY = 2.0 ** -126


def require_norm_input(x: object, residual: object, h: int, dtype: torch.dtype) -> None:
    """A norm's input: ``x`` a ``[..., H]`` tensor of ``dtype``, and ``residual`` (unless ``None``) matching it."""
    require_tensor(x, "x")
    if x.dim() < 1 or x.shape[-1] != h:
        raise InvalidInputError(f"x must be [..., H={h}], got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise InvalidInputError(f"x is {x.dtype} but this norm was built for {dtype}")
    if residual is not None:
        require_matching_residual(residual, x)


def require_matching_residual(residual: object, x: torch.Tensor) -> None:
    """``residual`` must be a tensor with ``x``'s shape, dtype and device, row-major (it is updated in place)."""
    require_tensor(residual, "residual")
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise InvalidInputError(
            f"residual must match x ({tuple(x.shape)}, {x.dtype}); got {tuple(residual.shape)}, {residual.dtype}"
        )
    if not residual.is_contiguous():
        raise InvalidInputError("residual must be row-major contiguous (it is updated in place)")
    require_same_device(residual, "residual", x.device)

