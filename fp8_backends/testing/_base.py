"""What the GEMM and norm-quant contracts share: getting the provider, the devices to run on, the checks of
its declaration, registration and import cost, and a spy that proves no kernel ran."""

from __future__ import annotations

import copy
import inspect
import json
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import pytest

from fp8_backends.core.types import Availability, DeviceKind

#: modules a provider module must not import when it is imported (discovery imports every provider module)
HEAVY_MODULES: tuple[str, ...] = ("torch", "triton", "flashinfer", "cupy", "jax", "tensorflow")


def registered_in(kind: str, spec: str) -> bool:
    """Whether ``spec`` (``[DIST:]NAME[@options]``) names a discovered provider of ``kind``."""
    from fp8_backends.registry import discovery
    from fp8_backends.registry.resolution import BackendRequest

    request = BackendRequest.parse(spec)
    return any(e.matches(request.name, request.dist) for e in discovery.discover(kind))


def check_specs(specs: list[str]) -> None:
    """Raise :class:`~fp8_backends.core.errors.UnknownBackendError` naming every spec of ``specs`` that matches no
    discovered GEMM or norm-quant provider (a typo would otherwise run no test, or only the others'), and
    :class:`~fp8_backends.core.errors.InvalidInputError` for a malformed one."""
    from fp8_backends.core.errors import UnknownBackendError
    from fp8_backends.registry import discovery

    unknown = [spec for spec in specs if not any(registered_in(kind, spec) for kind in discovery.GROUPS)]
    if not unknown:
        return
    held = sorted({e.qualified_name for kind in discovery.GROUPS for e in discovery.discover(kind)})
    error = UnknownBackendError(unknown[0], "provider", held)
    error.args = (f"no registered GEMM or norm-quant provider matches {', '.join(map(repr, unknown))} (registered: "
                  f"{', '.join(held) or 'none'})",)
    raise error


def provider_from_spec(kind: str, spec: str) -> Any:
    """The provider instance that ``[DIST:]NAME[@key=value,...]`` names among the discovered ``kind``
    providers, built directly from its class (no support check: the kit decides what to run where)."""
    from fp8_backends.core.errors import AmbiguousBackendError, BackendUnavailableError, UnknownBackendError
    from fp8_backends.registry import discovery
    from fp8_backends.registry.resolution import KIND_LABEL, BackendRequest

    request = BackendRequest.parse(spec)
    entries = discovery.discover(kind)
    found = [e for e in entries if e.matches(request.name, request.dist)]
    if not found:
        raise UnknownBackendError(spec, KIND_LABEL[kind], [e.qualified_name for e in entries])
    if len(found) > 1:
        raise AmbiguousBackendError(
            f"{spec!r} names several {KIND_LABEL[kind]} providers: "
            f"{', '.join(e.qualified_name for e in found)}; qualify it as DIST:NAME"
        )
    entry = found[0]
    if entry.cls is None:
        raise BackendUnavailableError(f"{entry.qualified_name} ({entry.target}) {entry.status}: {entry.error}")
    return entry.cls(**dict(request.options))


class ContractBase:
    """Machinery shared by :class:`~fp8_backends.testing.GemmProviderContract` and
    :class:`~fp8_backends.testing.NormQuantProviderContract` (not a test class itself)."""

    #: ``"gemm"`` or ``"norm_quant"`` (set by the two contracts)
    kind: ClassVar[str]
    #: ``"DIST:NAME"`` (options may follow ``@``) of a registered provider: the default :meth:`make_provider`
    #: builds it; leave ``None`` and override :meth:`make_provider` instead
    provider_spec: ClassVar[str | None] = None
    #: the provider class must be registered under an entry point named like it (set False only for a
    #: class you test before packaging it)
    registered: ClassVar[bool] = True
    #: extra module names the provider module must not import at import time (beyond :data:`HEAVY_MODULES`)
    extra_heavy_modules: ClassVar[tuple[str, ...]] = ()
    #: device types to run on (``"cpu"``, ``"cuda"``); ``None``: every declared one present here
    run_on: ClassVar[tuple[str, ...] | None] = None

    # ------------------------------------------------------------------ the one method authors write
    def make_provider(self) -> Any:
        """A fresh provider instance to test (with the options you want tested). Default: built from
        :attr:`provider_spec`."""
        if self.provider_spec is None:
            raise NotImplementedError(f"{type(self).__name__}: define make_provider() (or set provider_spec)")
        return provider_from_spec(self.kind, self.provider_spec)

    # ------------------------------------------------------------------ collection
    _collected: ClassVar[dict[type, tuple[Any, BaseException | None]]] = {}

    def _collected_provider(self) -> tuple[Any, BaseException | None]:
        """The provider made once per test class at collection (to know what to parametrize), or the error."""
        key = type(self)
        if key not in ContractBase._collected:
            try:
                ContractBase._collected[key] = (self.make_provider(), None)
            except Exception as exc:  # reported by every test that needs the provider
                ContractBase._collected[key] = (None, exc)
        return ContractBase._collected[key]

    def device_params(self, gpu_only: bool = False) -> list[Any]:
        """``pytest.param`` per device type to run on: the declared ones present here (CUDA: a visible GPU),
        filtered by :attr:`run_on`; a single skipped param saying why when there is none."""
        provider, error = self._collected_provider()
        if error is not None:
            return [pytest.param("error", id="provider-error")]  # the test calls make_provider() and fails
        avail = provider.cached_availability()
        if not avail.ok:
            return [pytest.param(None, id="unavailable", marks=pytest.mark.skip(
                reason=f"{provider.name} is unavailable here: {avail.reason}"))]
        declared = [d.value for d in provider.capabilities.devices]
        wanted = [d for d in (self.run_on or ("cpu", "cuda")) if d in declared and (d == "cuda" or not gpu_only)]
        present = [d for d in wanted if d != "cuda" or _cuda_visible()]
        if present:
            return [pytest.param(d, id=d) for d in present]
        why = (f"{provider.name} declares devices {sorted(declared)}" + (f", run_on={self.run_on}" if self.run_on
               else "") + ("; no CUDA device is visible" if "cuda" in wanted else "; none of them is tested here"))
        return [pytest.param(None, id="no-device", marks=pytest.mark.skip(reason=why))]

    def provider(self) -> Any:
        """A fresh provider from :meth:`make_provider` (a shallow copy, so spies never leak into a cached
        instance)."""
        made = self.make_provider()
        return copy.copy(made)

    # ------------------------------------------------------------------ tests both contracts run
    def test_module_is_import_light(self) -> None:
        """Importing the provider's module (and calling ``availability()``) imports no heavy library."""
        self.check_import_light()

    def test_registered_under_its_name(self) -> None:
        """An entry point of the kind's group (``fp8_backends.gemm`` / ``fp8_backends.norm_quant``) names the
        class and carries its ``name``."""
        self.check_registered()

    # ------------------------------------------------------------------ shared checks
    def check_import_light(self) -> None:
        provider, error = self._collected_provider()
        if error is not None:
            raise error
        cls = type(provider)
        heavy = (*HEAVY_MODULES, *self.extra_heavy_modules)
        code = (
            "import json, sys, importlib;"
            f"sys.path[:0] = {json.dumps([p for p in sys.path if p])};"
            f"m = importlib.import_module({cls.__module__!r});"
            f"c = getattr(m, {cls.__qualname__!r});"
            "after_import = sorted(x for x in HEAVY if x in sys.modules);"
            "c.cached_availability();"
            "print(json.dumps([after_import, sorted(x for x in HEAVY if x in sys.modules)]))"
        ).replace("HEAVY", json.dumps(list(heavy)))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
        assert done.returncode == 0, f"importing {cls.__module__} failed:\n{done.stderr[-3000:]}"
        on_import, on_probe = json.loads(done.stdout.strip().splitlines()[-1])
        assert not on_import, (
            f"importing {cls.__module__} imports {on_import}: discovery imports every provider module, so "
            "import torch and kernel libraries inside methods"
        )
        assert not on_probe, (
            f"{cls.__name__}.availability() imports {on_probe}: the listing calls it for every provider; "
            "probe with importlib.util.find_spec instead"
        )

    def check_registered(self) -> None:
        if not self.registered:
            pytest.skip("registered = False: the entry point is not checked")
        from fp8_backends.registry import discovery

        provider, error = self._collected_provider()
        if error is not None:
            raise error
        cls = type(provider)
        target = f"{cls.__module__}:{cls.__qualname__}"
        entries = [e for e in discovery.discover(self.kind) if e.target == target]
        group = discovery.GROUPS[self.kind]
        assert entries, (
            f"{target} is not registered in the {group!r} entry-point group; add to pyproject.toml\n"
            f'  [project.entry-points."{group}"]\n  {cls.name} = "{target}"\nand reinstall (pip install -e .), or '
            "register it in the test process (fp8_backends.register_provider)"
        )
        for entry in entries:
            assert entry.status == discovery.LOADED, f"{entry.qualified_name}: {entry.status}: {entry.error}"
            assert entry.name == cls.name and entry.cls is cls, (entry.name, cls.name, entry.cls)

    def check_identity(self, base: type, caps_type: type) -> Any:
        """Checks the class attributes every provider declares; returns the provider."""
        from fp8_backends.core.types import Availability as _Availability

        provider, error = self._collected_provider()
        if error is not None:
            raise error
        cls = type(provider)
        assert isinstance(provider, base), f"{cls.__name__} is not a {base.__name__}"
        from fp8_backends.registry import discovery

        assert isinstance(cls.aliases, tuple) and cls.name not in cls.aliases, "aliases: a tuple without the name"
        for label, name in (("name", cls.name), *(("alias", a) for a in cls.aliases)):
            problem = discovery.name_problem(name)  # the rule discovery and register_provider apply
            assert problem is None, f"{label}: {problem} (the backend flag parses [DIST:]NAME[@key=value])"
        assert isinstance(cls.description, str), "description must be a str (the listing shows it)"
        assert isinstance(cls.requires, tuple) and all(isinstance(r, str) for r in cls.requires), "requires"
        assert isinstance(cls.install_hint, str), "install_hint must be a str"
        caps = cls.capabilities
        assert isinstance(caps, caps_type), f"capabilities must be a {caps_type.__name__}, got {type(caps).__name__}"
        assert caps.devices and all(isinstance(d, DeviceKind) for d in caps.devices), "devices: DeviceKind values"
        assert isinstance(caps.priority, int), "priority must be an int"
        caps.arch_summary()
        assert isinstance(cls.options, Mapping), "options: a mapping of option name -> allowed values"
        for key, values in cls.options.items():
            assert isinstance(key, str) and isinstance(values, tuple) and values, f"option {key!r}: a non-empty tuple"
            assert all(isinstance(v, str) for v in values), f"option {key!r}: string values (the first is the default)"
        assert set(cls.tunable_options) <= set(cls.options), "tunable_options must name options"
        assert set(provider.config) == set(cls.options), "self.config holds one value per option"
        static = inspect.getattr_static(cls, "availability")
        assert isinstance(static, classmethod), (
            "availability() must stay a classmethod (decorate your override with @classmethod): discovery "
            "and the listing call it on the class"
        )
        avail = cls.availability()
        assert isinstance(avail, _Availability), f"availability() returned {type(avail).__name__}, not Availability"
        return provider


@contextmanager
def no_kernel_runs(provider: Any, hooks: tuple[str, ...]) -> Iterator[list[str]]:
    """Replace ``provider``'s ``*_impl`` hooks (on this instance) by wrappers that record a call; yields the
    list of hook names called."""
    calls: list[str] = []

    def spy(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return wrapped

    saved = {h: provider.__dict__.get(h) for h in hooks}
    for h in hooks:
        setattr(provider, h, spy(h, getattr(provider, h)))
    try:
        yield calls
    finally:
        for h, old in saved.items():
            if old is None:
                provider.__dict__.pop(h, None)
            else:
                setattr(provider, h, old)


def expect_refusal(fn: Callable[[], Any], calls: list[str], match: str | None, what: str) -> None:
    """``fn()`` raises the library's :class:`InvalidInputError` (a ``ValueError`` and an ``Fp8BackendError``)
    matching ``match``, and no ``*_impl`` hook ran."""
    from fp8_backends.core.errors import Fp8BackendError, InvalidInputError

    before = len(calls)
    with pytest.raises(InvalidInputError, match=match) as info:
        fn()
    assert isinstance(info.value, Fp8BackendError) and isinstance(info.value, ValueError)
    assert len(calls) == before, f"{what}: a kernel hook ran ({calls[before:]}) before the input was refused"


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def platform_for(device: str) -> Any:
    from fp8_backends.registry.platform import detect_platform

    return detect_platform(device)


def skip_unless_available(provider: Any) -> None:
    avail: Availability = provider.cached_availability()
    if not avail.ok:
        pytest.skip(f"{provider.name} is unavailable here: {avail.reason}")


__all__ = ["HEAVY_MODULES", "ContractBase", "expect_refusal", "no_kernel_runs", "platform_for", "provider_from_spec"]
