"""``python -m fp8_backends.testing DIST:NAME [DIST:NAME ...] [-- pytest options]``: the conformance kit
against registered providers (exit status: pytest's; 2 when a spec names no registered provider)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    import pytest

    args = list(sys.argv[1:] if argv is None else argv)
    if "--" in args:
        cut = args.index("--")
        specs, extra = args[:cut], args[cut + 1:]
    else:
        specs = [a for a in args if not a.startswith("-")]
        extra = [a for a in args if a.startswith("-")]
    if not specs or any(s in ("-h", "--help") for s in args[:1]):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    from fp8_backends.core.errors import Fp8BackendError
    from fp8_backends.testing._base import check_specs  # not the test modules: pytest imports those

    try:
        check_specs(specs)
    except Fp8BackendError as exc:  # a typo runs nothing: say which spec, no traceback
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    options = [item for spec in specs for item in ("--fp8-provider", spec)]
    return int(pytest.main(["-p", "fp8_backends.testing.plugin", "--import-mode=importlib", *options,
                            "--pyargs", "fp8_backends.testing.conformance", *extra]))


if __name__ == "__main__":
    sys.exit(main())
