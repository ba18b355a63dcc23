"""Selection policies are objects (``name``, ``rank``, ``pick()``, ``buckets()``); ``auto`` climbs one ladder; the
M buckets of a weight come from the policies, not from module names; a bare callable still registers."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from fake_provider import SplitAt8, install_split

from fp8_backends import GemmProblem, InvalidInputError, InvalidTypeError
from fp8_backends.registry import resolution
from fp8_backends.registry.platform import cpu_platform

ROOT = Path(__file__).resolve().parents[1]
CPU = GemmProblem(n=32, k=64, device="cpu")


@pytest.fixture
def split(monkeypatch):
    return install_split(monkeypatch)


def test_a_policy_object_picks_and_names_its_buckets(split):
    res = resolution.explain("gemm", "auto", problem=CPU.with_m(4))
    assert res.backend.name == "fake_mm" and res.source == "split-at-8" and res.note == "fake_mm for M=4"
    assert resolution.explain("gemm", "auto", problem=CPU.with_m(64)).backend.name == "torch_scaled_mm"
    table = resolution.resolve_gemm_buckets(problem=CPU, platform=cpu_platform())
    assert [(b, p.name) for b, p in table] == [(8, "fake_mm"), (9, "torch_scaled_mm")]
    assert resolution.resolve_gemm_buckets("torch", problem=CPU) == []  # an explicit choice: one provider


def test_the_first_policy_with_buckets_gives_them(split, caplog, monkeypatch):
    class Broken(resolution.SelectionPolicy):
        name, rank = "broken-buckets", 2000

        def pick(self, *_):
            return None

        def buckets(self, *_):
            raise RuntimeError("bucket bug")

    resolution.register_selection_policy(Broken())
    resolution.register_selection_policy("bare", lambda *_: None, rank=3000)  # no buckets: passed over
    try:
        with caplog.at_level(logging.WARNING, logger="fp8_backends"):
            table = resolution.resolve_gemm_buckets(problem=CPU)
    finally:
        resolution.unregister_selection_policy("broken-buckets")
        resolution.unregister_selection_policy("bare")
    assert [b for b, _ in table] == [8, 9]
    assert "broken-buckets could not give its M buckets" in caplog.text and "bucket bug" in caplog.text


def test_registration_forms():
    def bare(kind, problem, platform, serving):
        return None

    try:
        wrapped = resolution.register_selection_policy("bare-callable", bare, rank=5)
        assert isinstance(wrapped, resolution.CallablePolicy) and (wrapped.name, wrapped.rank) == ("bare-callable", 5)
        assert wrapped.buckets("gemm", CPU, cpu_platform()) == [] and wrapped("gemm", CPU, cpu_platform(), []) is None
        assert resolution.register_selection_policy("bare-callable", bare).rank == 0  # replaced, by name
        assert [p.name for p in resolution.selection_policies()].count("bare-callable") == 1
        obj = SplitAt8()
        assert resolution.register_selection_policy(obj.name, obj) is obj  # the name matches: accepted
        with pytest.raises(InvalidInputError, match="carries its own name and rank"):
            resolution.register_selection_policy("another-name", obj)
        with pytest.raises(InvalidInputError, match="own name and rank"):
            resolution.register_selection_policy(obj, rank=3)
        with pytest.raises(InvalidTypeError):
            resolution.register_selection_policy("not-callable", 42)
        with pytest.raises(InvalidInputError, match="non-empty name"):
            resolution.register_selection_policy("", bare)
    finally:
        resolution.unregister_selection_policy("bare-callable")
        resolution.unregister_selection_policy(SplitAt8.name)
    assert resolution.unregister_selection_policy("bare-callable") is None


def test_the_builtin_policies_are_objects_ranked_as_documented():
    resolution.load_builtin_policies()
    ranks = {p.name: p.rank for p in resolution.selection_policies()}
    assert ranks == {"lockfile": 100, "shipped-exact": -10, "shipped-nearest": -20, "measured-default": -100}
    assert all(isinstance(p, resolution.SelectionPolicy) for p in resolution.selection_policies())
    assert [p.name for p in resolution.selection_policies()] == sorted(ranks, key=lambda n: -ranks[n])


def test_provider_instance_is_public_and_shared():
    from fp8_backends.registry import discovery

    entry = next(e for e in discovery.discover("gemm") if e.name == "torch_scaled_mm")
    one = resolution.provider_instance(entry, (("fast_accum", "false"),))
    assert resolution.provider_instance(entry, [("fast_accum", "false")]) is one
    assert resolution.resolve_gemm_backend("torch_scaled_mm@fast_accum=false", problem=CPU) is one


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports at module level or in functions (relative ones resolved in ``registry``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                found |= {node.module} if node.module else {a.name for a in node.names}
            else:
                found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_the_policy_contract_never_imports_a_policy_module():
    """Policies import the contract and the candidates, not the reverse; resolution loads the built-ins at its first
    ``auto`` (by name, in a function), never when it is imported."""
    builtins = set(resolution.BUILTIN_POLICY_MODULES)
    for core in ("policy.py", "candidates.py", "discovery.py", "platform.py"):
        imported = _imports(ROOT / "registry" / core)
        assert not imported & builtins, (core, imported & builtins)
        assert not {m for m in imported if m.rsplit(".", 1)[-1] in builtins}, core
    for module in builtins:
        assert "resolution" not in {m.rsplit(".", 1)[-1] for m in _imports(ROOT / "registry" / f"{module}.py")}
    code = ("import sys; import fp8_backends.registry.resolution as r; "
            "assert not [m for m in sys.modules if m.endswith(('.defaults', '.shipped', '.lockfile_policy'))]; "
            "r.load_builtin_policies(); print(sorted(p.name for p in r.selection_policies()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert "measured-default" in out.stdout and "lockfile" in out.stdout


def test_auto_is_one_ladder_policies_then_priority(split):
    # no policy decides for an unknown M: the last rung, static priority
    res = resolution.explain("gemm", "auto", problem=CPU)
    assert res.source == "priority" and res.backend.name == "torch_scaled_mm"
    assert resolution.explain("gemm", "auto", problem=CPU.with_m(1)).source == "split-at-8"
