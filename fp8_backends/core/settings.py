"""Every environment variable the library reads, in one place (:data:`ENV_VARS`), and the cache folder.

| variable | meaning |
|---|---|
| ``FP8_GEMM_BACKEND`` | default GEMM backend name when the caller passes none (``auto`` if unset) |
| ``FP8_NORM_QUANT_BACKEND`` | default norm-quant backend name |
| ``FP8_SELECTION_OBJECTIVE`` | what ``auto`` optimizes: ``kernel``, ``host`` or ``auto`` (:mod:`.objective`) |
| ``FP8_SELECTION_HOST_CONTEXT_US`` | the host objective's µs of other model work around each linear (default 50) |
| ``FP8_BACKENDS_DISABLED`` | ``[KIND:][DIST:]NAME`` items to exclude (``gemm:torch``: the GEMM one only) |
| ``FP8_BACKENDS_PLUGINS`` | comma-separated third-party distributions allowed to load (unset: all; empty: none) |
| ``FP8_BACKENDS_SIMULATE_SM`` | pretend the GPU is this SM (e.g. ``10.0``) for resolution and listing |
| ``FP8_BACKENDS_CHECK_SCALES`` | ``1``: also check device-resident scales for NaN/inf/zero at call time (syncs) |
| ``FP8_BACKENDS_LOCKFILE`` | tuned lockfile ``auto`` reads (default ``~/.cache/fp8_backends/selection.lock.json``) |
| ``FP8_BACKENDS_TUNE`` | ``1``: ``auto`` tunes a problem the lockfile lacks at first use and stores the result |
| ``FP8_BACKENDS_PDL`` | ``0``: never launch kernels with programmatic dependent launch (default: on where SM >= 9.0) |
| ``FP8_BACKENDS_DEFAULTS`` | ``0``: ``auto`` ignores the measured per-GPU, per-M defaults (``registry/defaults.py``) |
| ``FP8_BACKENDS_SHIPPED`` | ``off``: ``auto`` ignores the shipped per-GPU selection data; a file or folder: that data |
| ``FP8_BACKENDS_CACHE_DIR`` | :func:`cache_dir`: the default lockfile, CUTLASS builds, flashinfer autotune file |
| ``FP8_BACKENDS_FLASHINFER_AUTOTUNE`` | default of ``flashinfer_bmm``'s ``autotune`` option (off, cache, tune) |
| ``FP8_BACKENDS_CUTLASS_DIR`` | CUTLASS headers the ``cutlass`` provider builds against |
| ``FP8_BACKENDS_CUTLASS_CACHE`` | the CUTLASS build cache folder (default ``cache_dir()/cutlass``) |
| ``FP8_BACKENDS_CUTLASS_TABLE`` | a JSON file replacing the ``cutlass`` provider's M-bucket config table |
| ``FP8_BACKENDS_CUTLASS_NATIVE`` | ``0``: the ``cutlass`` provider calls its kernels through its Python op, not C++ |
| ``FP8_BACKENDS_TRITON_TABLE`` | a JSON file replacing the ``triton`` GEMM provider's M-bucket config table |
| ``FP8_BACKENDS_BUILD_JOBS`` | parallel nvcc processes for CUTLASS builds (default: CPU count) |

Boolean variables (``CHECK_SCALES``, ``TUNE``, ``PDL``, ``DEFAULTS``, ``CUTLASS_NATIVE``) take ``1/0``,
``true/false``, ``yes/no`` or ``on/off`` (any case; unset or empty: the default) and are read where they are used,
not once at import; any other value raises :class:`~fp8_backends.core.errors.ConfigurationError` naming the variable
and the accepted values, never a
silent default. :func:`env_int` parses integer variables as strictly.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import NamedTuple

from fp8_backends.core.errors import ConfigurationError
from fp8_backends.core.objective import HOST_CONTEXT_US, SelectionObjective, valid_values

GEMM_BACKEND_ENV = "FP8_GEMM_BACKEND"
NORM_QUANT_BACKEND_ENV = "FP8_NORM_QUANT_BACKEND"
SELECTION_OBJECTIVE_ENV = "FP8_SELECTION_OBJECTIVE"
HOST_CONTEXT_ENV = "FP8_SELECTION_HOST_CONTEXT_US"
DISABLED_ENV = "FP8_BACKENDS_DISABLED"
PLUGINS_ENV = "FP8_BACKENDS_PLUGINS"
SIMULATE_SM_ENV = "FP8_BACKENDS_SIMULATE_SM"
CHECK_SCALES_ENV = "FP8_BACKENDS_CHECK_SCALES"
LOCKFILE_ENV = "FP8_BACKENDS_LOCKFILE"
TUNE_ENV = "FP8_BACKENDS_TUNE"
PDL_ENV = "FP8_BACKENDS_PDL"
DEFAULTS_ENV = "FP8_BACKENDS_DEFAULTS"
SHIPPED_ENV = "FP8_BACKENDS_SHIPPED"
CACHE_DIR_ENV = "FP8_BACKENDS_CACHE_DIR"
FLASHINFER_AUTOTUNE_ENV = "FP8_BACKENDS_FLASHINFER_AUTOTUNE"
#: the values of :data:`FLASHINFER_AUTOTUNE_ENV` (``flashinfer_bmm``'s ``autotune`` option)
FLASHINFER_AUTOTUNE_MODES = ("off", "cache", "tune")
CUTLASS_DIR_ENV = "FP8_BACKENDS_CUTLASS_DIR"
CUTLASS_CACHE_ENV = "FP8_BACKENDS_CUTLASS_CACHE"
CUTLASS_TABLE_ENV = "FP8_BACKENDS_CUTLASS_TABLE"
CUTLASS_NATIVE_ENV = "FP8_BACKENDS_CUTLASS_NATIVE"
TRITON_TABLE_ENV = "FP8_BACKENDS_TRITON_TABLE"
BUILD_JOBS_ENV = "FP8_BACKENDS_BUILD_JOBS"


class EnvVar(NamedTuple):
    """One environment variable of the library. ``setup``: it says where things are on this machine or how to
    build (folders, headers, nvcc jobs) rather than what to select, so a test run keeps the developer's value."""

    name: str
    setup: bool = False


#: every environment variable the library reads, in the order of the table above (the listing's ``env`` and the
#: tests read this)
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(GEMM_BACKEND_ENV),
    EnvVar(NORM_QUANT_BACKEND_ENV),
    EnvVar(SELECTION_OBJECTIVE_ENV),
    EnvVar(HOST_CONTEXT_ENV),
    EnvVar(DISABLED_ENV),
    EnvVar(PLUGINS_ENV),
    EnvVar(SIMULATE_SM_ENV),
    EnvVar(CHECK_SCALES_ENV),
    EnvVar(LOCKFILE_ENV),
    EnvVar(TUNE_ENV),
    EnvVar(PDL_ENV),
    EnvVar(DEFAULTS_ENV),
    EnvVar(SHIPPED_ENV),
    EnvVar(CACHE_DIR_ENV, setup=True),
    EnvVar(FLASHINFER_AUTOTUNE_ENV),
    EnvVar(CUTLASS_DIR_ENV, setup=True),
    EnvVar(CUTLASS_CACHE_ENV, setup=True),
    EnvVar(CUTLASS_TABLE_ENV),
    EnvVar(CUTLASS_NATIVE_ENV),
    EnvVar(TRITON_TABLE_ENV),
    EnvVar(BUILD_JOBS_ENV, setup=True),
)


def cache_dir() -> Path:
    """The per-user cache folder of fp8_backends (not created here): ``$FP8_BACKENDS_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/fp8_backends`` (``~/.cache`` when ``XDG_CACHE_HOME`` is unset or not absolute). The default
    lockfile, the CUTLASS build cache and flashinfer's autotune file live under it."""
    explicit = os.environ.get(CACHE_DIR_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = Path(os.environ.get("XDG_CACHE_HOME", "").strip() or "~/.cache").expanduser()
    base = xdg if xdg.is_absolute() else Path.home() / ".cache"
    return base / "fp8_backends"


def _split(value: str | None) -> list[str]:
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def canonical_dist(name: str) -> str:
    """PEP 503 normalisation: ``Fp8_Backends`` and ``fp8-backends`` are the same distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


_encoded_names: dict[str, object] = {}


def env_token(name: str) -> object:
    """A cheap stand-in for ``os.environ.get(name)`` on hot paths that memoize on a variable's value:
    the value as the process environment stores it (``bytes`` on POSIX), or ``None`` when unset. Equal
    tokens mean equal values. About 0.1 µs against 1 µs for ``os.environ.get`` (which encodes the name and
    decodes the value at every call) on the 2-core CPU box."""
    environ = os.environ
    data = getattr(environ, "_data", None)
    if data is None:  # not CPython's os._Environ
        return environ.get(name)
    key = _encoded_names.get(name)
    if key is None:
        key = _encoded_names[name] = environ.encodekey(name)  # type: ignore[attr-defined]
    return data.get(key)


#: the provider kinds, as ``FP8_BACKENDS_DISABLED`` items may name them (``norm-quant`` also accepted)
KIND_PREFIXES = {"gemm": "gemm", "norm_quant": "norm_quant", "norm-quant": "norm_quant"}


class DisabledItem(NamedTuple):
    """One ``FP8_BACKENDS_DISABLED`` item: ``[KIND:][DIST:]NAME``. ``kind`` and ``dist`` are ``None`` when
    not given (any kind, any distribution); ``dist`` is PEP 503-normalised."""

    kind: str | None
    dist: str | None
    name: str

    def applies_to(self, kind: str, dist: str | None, names: set[str]) -> bool:
        """Whether this item disables a provider of ``kind`` from ``dist`` that answers to ``names``."""
        if self.name not in names or (self.kind is not None and self.kind != kind):
            return False
        return self.dist is None or (dist is not None and canonical_dist(dist) == self.dist)


def parse_disabled_item(text: str) -> DisabledItem:
    """``"torch"`` -> any kind, any distribution; ``"gemm:torch"`` -> the GEMM provider only;
    ``"acme-fp8:torch_scaled_mm"`` -> that distribution's; ``"gemm:acme-fp8:torch_scaled_mm"`` -> both.
    A first part that names a kind (``gemm``, ``norm_quant``, ``norm-quant``) is a kind; a distribution
    literally called ``gemm`` is written with its kind in front (``gemm:gemm:NAME``)."""
    parts = [p.strip() for p in text.split(":")]
    kind = None
    if len(parts) > 1 and parts[0].lower() in KIND_PREFIXES:
        kind = KIND_PREFIXES[parts.pop(0).lower()]
    name = parts.pop()
    dist = ":".join(parts) if parts else None
    return DisabledItem(kind, canonical_dist(dist) if dist else None, name)


_disabled_memo: dict[object, tuple[DisabledItem, ...]] = {}


def disabled_items() -> tuple[DisabledItem, ...]:
    """``FP8_BACKENDS_DISABLED`` parsed (empty when unset); memoized per value of the variable (resolution
    asks once per provider)."""
    token = env_token(DISABLED_ENV)
    items = _disabled_memo.get(token)
    if items is None:
        if len(_disabled_memo) > 64:
            _disabled_memo.clear()
        items = _disabled_memo[token] = tuple(
            parse_disabled_item(item) for item in _split(os.environ.get(DISABLED_ENV))
        )
    return items


def disabled_names() -> set[str]:
    """The raw ``FP8_BACKENDS_DISABLED`` items (see :func:`disabled_items` for their meaning)."""
    return set(_split(os.environ.get(DISABLED_ENV)))


def allowed_plugin_dists() -> set[str] | None:
    """``None`` when every distribution may load (unset); otherwise the canonical names allowed. Set but
    empty (``FP8_BACKENDS_PLUGINS=""``) allows none: only the built-in providers load."""
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None:
        return None
    return {canonical_dist(d) for d in _split(raw)}


def simulated_sm() -> str | None:
    """``FP8_BACKENDS_SIMULATE_SM`` as set (None when unset or empty); checked where it is used
    (:func:`fp8_backends.registry.platform.detect_platform` raises :class:`ConfigurationError` for a value that
    is not an SM version)."""
    value = os.environ.get(SIMULATE_SM_ENV, "").strip()
    return value or None


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
FLAG_VALUES = "1, true, yes, on / 0, false, no, off (any case; unset or empty: the default)"


def parse_flag(name: str, raw: str | None, default: bool) -> bool:
    """A boolean variable's value ``raw`` (``None``: unset): ``default`` when unset or empty, else one of
    :data:`FLAG_VALUES`; anything else raises :class:`ConfigurationError` naming ``name``."""
    if raw is None:
        return default
    text = raw.strip().lower()
    if not text:
        return default
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigurationError(name, raw, FLAG_VALUES)


class EnvFlag:
    """A boolean variable read at each call (strictly: see :func:`parse_flag`), for hot paths: the parsed value
    is kept with the raw value it came from, so a call whose variable did not change costs one environment
    lookup and one comparison (about 0.15 µs). A bad value raises at every call until it is fixed."""

    __slots__ = ("_key", "_token", "_value", "default", "name")

    def __init__(self, name: str, default: bool) -> None:
        self.name, self.default = name, default
        encode = getattr(os.environ, "encodekey", None)
        self._key = encode(name) if encode is not None else name
        self._token: object = _UNREAD
        self._value = default

    def __call__(self) -> bool:
        data = getattr(os.environ, "_data", None)  # env_token(), inlined: this runs on hot paths
        token = data.get(self._key) if data is not None else os.environ.get(self.name)
        if token is self._token or token == self._token:
            return self._value
        value = parse_flag(self.name, os.environ.get(self.name), self.default)
        self._token, self._value = token, value
        return value


_UNREAD = object()
_flags: dict[tuple[str, bool], EnvFlag] = {}


def env_flag(name: str, default: bool) -> bool:
    """Boolean variable ``name`` read now (strictly: see :func:`parse_flag`); cheap on repeated calls."""
    flag = _flags.get((name, default))
    if flag is None:
        flag = _flags[(name, default)] = EnvFlag(name, default)
    return flag()


def env_int(name: str, default: int, *, minimum: int = 1) -> int:
    """Integer variable ``name`` read now: ``default`` when unset or empty, else a decimal integer
    ``>= minimum``; anything else (``abc``, ``0`` where ``minimum`` is 1, ``-2``) raises
    :class:`ConfigurationError` naming the variable."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip()
    try:
        value = int(text, 10)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigurationError(name, raw, f"an integer >= {minimum} (unset or empty: {default})")
    return value


#: ``FP8_BACKENDS_CHECK_SCALES`` as a hot-path flag (:class:`EnvFlag`)
check_scales_flag = EnvFlag(CHECK_SCALES_ENV, False)


def check_scales_at_call() -> bool:
    """``FP8_BACKENDS_CHECK_SCALES`` (default off): also check device-resident per-call scales."""
    return check_scales_flag()


def tune_at_first_use() -> bool:
    """``FP8_BACKENDS_TUNE`` (default off): ``auto`` tunes problems the lockfile lacks at first use."""
    return env_flag(TUNE_ENV, False)


def measured_defaults_enabled() -> bool:
    """``FP8_BACKENDS_DEFAULTS`` (default on): ``auto`` consults the measured per-GPU, per-M defaults."""
    return env_flag(DEFAULTS_ENV, True)


def pdl_allowed() -> bool:
    """``FP8_BACKENDS_PDL`` (default on): launch kernels with programmatic dependent launch where SM >= 9.0."""
    return env_flag(PDL_ENV, True)


def selection_objective(default: SelectionObjective) -> SelectionObjective:
    """``FP8_SELECTION_OBJECTIVE`` read now: ``kernel``, ``host`` or ``auto`` (any case), ``default`` when unset or
    empty; any other value raises :class:`ConfigurationError` naming the variable and the valid values. Callers
    pass their own default: resolutions KERNEL, layers AUTO (:mod:`fp8_backends.core.objective`)."""
    raw = os.environ.get(SELECTION_OBJECTIVE_ENV)
    if raw is None or not raw.strip():
        return default
    member = SelectionObjective._value2member_map_.get(raw.strip().lower())
    if member is None:
        raise ConfigurationError(SELECTION_OBJECTIVE_ENV, raw, f"{valid_values()} (unset or empty: the default)")
    return member  # type: ignore[return-value]


def check_environment() -> None:
    """Read every variable of the table above that takes a fixed kind of value (the flags, the objective, the host
    context, the build jobs) now: :class:`ConfigurationError` for the first bad one. What reads them at use may never
    run in a process (the listing builds nothing, a CPU run launches no kernel), so a tool that reports the
    configuration calls this."""
    env_flag(CHECK_SCALES_ENV, False)  # read fresh (check_scales_at_call's flag caches its value)
    tune_at_first_use()
    pdl_allowed()
    measured_defaults_enabled()
    env_flag(CUTLASS_NATIVE_ENV, True)  # the cutlass provider's reader (providers/cutlass/native_op.py)
    selection_objective(SelectionObjective.KERNEL)
    host_context_us()
    env_int(BUILD_JOBS_ENV, os.cpu_count() or 1)
    autotune = os.environ.get(FLASHINFER_AUTOTUNE_ENV, "")
    if autotune.strip() and autotune.strip().lower() not in FLASHINFER_AUTOTUNE_MODES:
        raise ConfigurationError(FLASHINFER_AUTOTUNE_ENV, autotune,
                                 f"{', '.join(FLASHINFER_AUTOTUNE_MODES)} (unset or empty: off)")


def host_context_us() -> float:
    """``FP8_SELECTION_HOST_CONTEXT_US`` read now: a finite number of µs >= 0, :data:`~.objective.HOST_CONTEXT_US`
    when unset or empty; anything else raises :class:`ConfigurationError` naming the variable."""
    raw = os.environ.get(HOST_CONTEXT_ENV)
    if raw is None or not raw.strip():
        return HOST_CONTEXT_US
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigurationError(HOST_CONTEXT_ENV, raw, f"a number of µs >= 0 (unset or empty: {HOST_CONTEXT_US:g})")
    return value
