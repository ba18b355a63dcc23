"""The library's one exception hierarchy.

Every error this package raises on purpose derives from :class:`Fp8BackendError`, so an engine can
catch the whole family with one ``except``. The subclasses also derive from the matching builtin
(``LookupError``, ``RuntimeError``, ``ValueError``, ``TypeError``) so generic handlers keep working.
"""

from __future__ import annotations

from collections.abc import Iterable


class Fp8BackendError(Exception):
    """Base class of every error raised by fp8_backends."""


class UnknownBackendError(Fp8BackendError, LookupError):
    """A backend name (or alias) that no discovered provider carries."""

    def __init__(self, name: str, kind: str, valid: Iterable[str]) -> None:
        self.name = name
        self.kind = kind
        self.valid = sorted(set(valid))
        super().__init__(
            f"unknown {kind} backend {name!r}; valid names: {', '.join(['auto', *self.valid])}"
        )

    def __str__(self) -> str:  # LookupError/KeyError would quote the message; keep it plain
        return self.args[0]


class AmbiguousBackendError(Fp8BackendError, LookupError):
    """Two distributions register the same provider name and the choice was not qualified."""

    def __str__(self) -> str:
        return self.args[0]


class BackendUnavailableError(Fp8BackendError, RuntimeError):
    """The provider cannot run at all here (missing library, failed import, disabled, blocked)."""


class UnsupportedProblemError(Fp8BackendError, ValueError):
    """The provider is installed but cannot serve this problem on this platform.

    ``reasons`` lists every reason; ``alternatives`` names providers that could serve it.
    """

    def __init__(
        self, message: str, reasons: Iterable[str] = (), alternatives: Iterable[str] = ()
    ) -> None:
        self.reasons = list(reasons)
        self.alternatives = list(alternatives)
        super().__init__(message)


class InvalidInputError(Fp8BackendError, ValueError):
    """A tensor handed to a provider or layer has the wrong dtype, shape, layout, device or value."""


class CheckpointError(InvalidInputError):
    """A quantized checkpoint the library cannot serve as it is: no or an unknown quantization config, a scheme it does
    not serve, a missing, misshapen or non-positive scale, a tensor of the wrong dtype. Raised before any weight is
    loaded; the message names the tensor and the file (``tensor`` and ``file`` hold them; empty where the config is
    at fault)."""

    def __init__(self, message: str, *, tensor: str = "", file: str = "") -> None:
        self.tensor = tensor
        self.file = file
        where = ": ".join(part for part in (file, tensor) if part)
        super().__init__(f"{where}: {message}" if where else message)


class InvalidTypeError(InvalidInputError, TypeError):
    """An argument of the wrong type (a ``dict`` where a :class:`~fp8_backends.core.types.GemmProblem` belongs, a
    number as a backend name, a string as a platform). Also a ``TypeError`` (and, as an
    :class:`InvalidInputError`, a ``ValueError``)."""


class BackendOptionError(InvalidInputError, LookupError):
    """A backend request's options are malformed or refused: ``NAME@key`` without ``=``, a key given twice,
    options on ``auto``, an unknown key or value. Also a ``ValueError`` and (as malformed requests were
    reported before as unknown names) a ``LookupError``."""


class ConfigurationError(Fp8BackendError, ValueError):
    """An environment variable holds a value the library does not accept. ``variable``, ``value`` and
    ``accepted`` (a description of the valid values) say which and why."""

    def __init__(self, variable: str, value: str, accepted: str, detail: str = "") -> None:
        self.variable = variable
        self.value = value
        self.accepted = accepted
        extra = f" ({detail})" if detail else ""
        super().__init__(f"{variable}={value!r} is not valid{extra}; accepted: {accepted}")


class BuildError(Fp8BackendError, RuntimeError):
    """A just-in-time kernel build failed; ``log_path`` points at the compiler's output."""

    def __init__(self, message: str, log_path: str | None = None) -> None:
        self.log_path = log_path
        super().__init__(message if log_path is None else f"{message} (compiler log: {log_path})")


class DataFileError(Fp8BackendError, ValueError):
    """A data file the library reads is malformed: shipped selection data, a tuner shapes file. The message
    names the file and lists every problem found; ``problems`` holds them one by one."""

    def __init__(self, path: object, problems: Iterable[str]) -> None:
        self.path = str(path)
        self.problems = list(problems) or ["unknown problem"]
        shown = self.problems[:12]
        more = len(self.problems) - len(shown)
        text = "; ".join(shown) + (f"; ... and {more} more" if more > 0 else "")
        super().__init__(f"{self.path}: {text}")


__all__ = [
    "AmbiguousBackendError",
    "BackendOptionError",
    "BackendUnavailableError",
    "BuildError",
    "CheckpointError",
    "ConfigurationError",
    "DataFileError",
    "Fp8BackendError",
    "InvalidInputError",
    "InvalidTypeError",
    "UnknownBackendError",
    "UnsupportedProblemError",
]


class ProviderOutputError(Fp8BackendError, RuntimeError):
    """A provider broke its output contract: its result has the wrong type, shape, dtype or device (checked from
    metadata after every call, before the caller sees it). The message names the provider and its distribution;
    ``provider`` and ``distribution`` hold them."""

    def __init__(self, message: str, provider: str = "", distribution: str = "") -> None:
        self.provider = provider
        self.distribution = distribution
        super().__init__(message)


__all__.append("ProviderOutputError")
