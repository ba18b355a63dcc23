"""argparse integration for engines: ``--fp8-gemm-backend`` and ``--fp8-norm-quant-backend``.

::

    parser = argparse.ArgumentParser()
    fp8_backends.add_cli_args(parser)
    args = parser.parse_args()
    gemm, norm = fp8_backends.backends_from_args(args, gemm_problem=..., norm_problem=...)

The flags' choices are ``auto`` plus every discovered provider name and alias (third-party ones
included); options may follow ``@`` (``flashinfer@runner=cudnn``) and a name may be qualified as
``DIST:NAME``. The help text says which providers are usable on this machine.
"""

from __future__ import annotations

import argparse
from typing import Any

from fp8_backends.core.errors import InvalidInputError, InvalidTypeError
from fp8_backends.registry import discovery, resolution
from fp8_backends.registry.platform import detect_platform


def backend_choices(kind: str) -> list[str]:
    """``auto`` plus every discovered name and alias for ``kind`` (an entry point under a name no request can give,
    which fails to load, left out)."""
    names: set[str] = set()
    for e in discovery.discover(kind):
        if discovery.name_problem(e.name) is None:
            names.add(e.name)
        names.update(e.aliases)
    return ["auto", *sorted(names)]


def _help_text(text: str) -> str:
    """``text`` for an argparse help string, which argparse formats with ``%``: a provider name or alias holding a
    ``%`` (``fast%gemm``) must not break every ``--help``."""
    return text.replace("%", "%%")


def _usable_summary(kind: str) -> str:
    """Each discovered provider once (as ``DIST:NAME`` where two distributions share the name), marked
    ``(unavailable)`` unless it can serve on this machine by what is known without loading any: a provider that is
    missing a library, disabled, blocked, failed to load, failed its preload in this process, cannot run on this
    device, or whose support check raises is not offered as usable. Showing help loads no provider (a preload may
    import or build a kernel library); ``python -m fp8_backends.list`` also loads ``auto``'s choice."""
    res = resolution.explain(kind, resolution.AUTO, platform=detect_platform(None))
    entries = [c.entry for c in res.candidates]
    parts = [resolution.display_name(c.entry, entries) + ("" if c.ok else " (unavailable)") for c in res.candidates]
    return ", ".join(parts) or "none registered"


_HELP_HEADS = {
    "gemm": ("FP8 GEMM provider: {{{choices}}}, optionally DIST:NAME and @key=value options (default: "
             "$FP8_GEMM_BACKEND or auto). Here: {usable}."),
    "norm_quant": ("fused RMSNorm+FP8-quant provider: {{{choices}}} (default: $FP8_NORM_QUANT_BACKEND or auto). "
                   "Here: {usable}."),
}


def backend_help(kind: str) -> str:
    """The help of ``kind``'s flag (argparse ``%`` escaped): the choices and which providers are usable here."""
    text = _HELP_HEADS[kind].format(choices=", ".join(backend_choices(kind)), usable=_usable_summary(kind))
    return _help_text(text)


class _BackendAction(argparse.Action):
    """``store`` for a backend flag, whose help is built when a help text is formatted (``--help``, an engine's
    ``format_help()``), not when the flag is added: telling which providers are usable means evaluating them, a cost
    an engine start must not pay."""

    def __init__(self, option_strings: list[str], dest: str, *, kind: str, **kwargs: Any) -> None:
        self.kind = kind
        super().__init__(option_strings, dest, **kwargs)

    @property  # type: ignore[override]
    def help(self) -> str:
        return backend_help(self.kind)

    @help.setter
    def help(self, value: str | None) -> None:  # argparse sets it; the text is always backend_help's
        pass

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)


class _BackendChoice:
    """argparse ``type=`` that validates the base name against the discovered choices."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __call__(self, text: str) -> str:
        try:
            request = resolution.BackendRequest.parse(text)
        except InvalidInputError as exc:  # malformed options: argparse shows the library's explanation
            raise argparse.ArgumentTypeError(str(exc)) from None
        if request.name not in backend_choices(self.kind):
            raise argparse.ArgumentTypeError(
                f"invalid choice {request.name!r} (choose from {', '.join(backend_choices(self.kind))})"
            )
        return text


def add_cli_args(parser: argparse.ArgumentParser, *, gemm: bool = True, norm_quant: bool = True) -> None:
    """Add ``--fp8-gemm-backend`` and ``--fp8-norm-quant-backend`` to ``parser``.

    Defaults come from ``FP8_GEMM_BACKEND`` / ``FP8_NORM_QUANT_BACKEND`` at resolution time
    (``None`` here means "not given on the command line")."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise InvalidTypeError(f"add_cli_args needs an argparse.ArgumentParser, got {type(parser).__name__}")
    group = parser.add_argument_group("FP8 backends (fp8_backends)")
    for wanted, kind in ((gemm, "gemm"), (norm_quant, "norm_quant")):
        if wanted:
            group.add_argument(f"--fp8-{kind.replace('_', '-')}-backend", action=_BackendAction, kind=kind,
                               type=_BackendChoice(kind), default=None, metavar="NAME")


def backends_from_args(
    args: argparse.Namespace,
    *,
    gemm_problem: Any = None,
    norm_problem: Any = None,
    platform: Any = None,
) -> tuple[Any, Any]:
    """Resolve both providers from parsed args; raises the library's errors when a choice can't serve."""
    gemm = resolution.resolve_gemm_backend(
        getattr(args, "fp8_gemm_backend", None), problem=gemm_problem, platform=platform
    )
    norm = resolution.resolve_norm_quant_backend(
        getattr(args, "fp8_norm_quant_backend", None), problem=norm_problem, platform=platform
    )
    return gemm, norm
