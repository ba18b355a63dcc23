"""The import graph of the library: no cycle between modules, and no module imports one of a higher floor.

The graph is read statically (``ast``) from every module of the three folders the package is installed from
(``fp8_backends/``, ``registry/`` as ``fp8_backends.registry``, ``providers/`` as ``fp8_backends.providers``; see
``[tool.setuptools.package-dir]``), and of ``bench/``. An import statement is an edge to the modules it runs (the
parent packages an import of a submodule runs included; a name taken from a package's lazy export table, the module
that defines it), and so is an ``importlib.import_module("a.b")`` call with a literal name. Where it sits decides when
it runs (:data:`EVERY`): at import time (the *module-level* graph: module and class bodies, ``try`` blocks, the
``else`` of ``if TYPE_CHECKING``), inside a function (the library's lazy imports: torch, kernel modules, the registry
asked at call time), or never (``if TYPE_CHECKING``). Two graphs must have no cycle: the module-level one (and the
same between packages), and the *runtime* one, every import that can run, at import time or inside a function, over
the library and ``bench/``. An ``import_module`` call whose name is computed hides its edge from this walk: only the
lazy export tables of package ``__init__`` s make one (:data:`DYNAMIC_IMPORTS`).

The floors, bottom up (an edge may stay on its floor or go down, never up). A module's floor is its folder's
(``FOLDER_FLOORS``), so a module put in the wrong folder fails these tests:

0. ``fp8_backends/core/`` (``fp8_backends.core``): the provider contract and what everything shares: types, errors,
   settings, the selection objective, the platform record, capabilities, validation, the output contract, the
   reference, the provider bases, the op library, the bucket tables, the text table; with them the ``fp8_backends``
   package ``__init__``, whose exports are lazy;
1. ``registry/`` (``fp8_backends.registry``): platforms, discovery and in-process registration, resolution, the
   selection policies and their data;
2. ``providers/`` (``fp8_backends.providers``): the built-in providers, which register through entry points as a
   third party does;
3. the rest of ``fp8_backends/``: the engine layer and the tools: quantization ops, layers, functional API, model
   conversion, CLI flags, the listing, the tuner (``tuning/``) and its CLI, builds, shipped-data tools, the
   conformance kit (``testing/``).

Beyond the module-level rule, the core names no module above it at all, not even lazily or for type checkers: what it
needs of the registry (the platform detection of ``supports()``, the distribution of a provider class) the registry
installs as hooks when imported. The contract and the registry never name a provider module (the default
activation-quant kernels come to :mod:`fp8_backends.quant` through a provider hook); only the tools in
``TOOLS_NAMING_PROVIDERS`` import a provider module (lazily): they serve that provider's toolchain. The few lazy
imports up the floors that remain are named in :data:`LAZY_IMPORTS_UP`.

Floor 3 is layered too (the package graph keeps it so): ``quant/`` (the activation-quant ops) under ``layers/`` (the
modules and how they run), under the top-level modules (``functional``, ``convert``, ``cli`` and the command-line
tools ``list``, ``tune``, ``build``, ``selection_data``), beside ``tuning/`` and ``testing/``.
``docs/architecture.md`` names every module, one line each; the last test here keeps it complete.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"fp8_backends": "fp8_backends", "fp8_backends.registry": "registry",
                "fp8_backends.providers": "providers"}

#: the floor of each folder (paths from the repository root; the longest matching folder wins): a module's floor is
#: where it lies, so moving a module between floors means moving its file, and a new module starts on its folder's floor
FOLDER_FLOORS = {"fp8_backends/core": 0, "registry": 1, "providers": 2, "fp8_backends": 3}
#: the one module outside ``fp8_backends/core/`` on floor 0: the package ``__init__``, whose imports are lazy (every
#: name is imported on first use), so importing any module of the library runs it and it runs nothing
PACKAGE_INIT = "fp8_backends"
FLOOR_NAMES = ("core contract", "registry", "providers", "engine layer and tools")
#: tools of floor 3 that import a provider's modules (lazily) for its toolchain: ``python -m fp8_backends.build
#: cutlass`` builds the CUTLASS kernels; shipped-data provenance records the CUTLASS headers and nvcc
TOOLS_NAMING_PROVIDERS = frozenset({"fp8_backends.build", "fp8_backends.tuning.provenance"})
#: the imports up the floors that run (lazily: none at module level), each with why it cannot go down
LAZY_IMPORTS_UP = {
    # FP8_BACKENDS_TUNE=1: the lockfile policy of auto tunes a problem the lockfile lacks with the tuner
    ("fp8_backends.registry.lockfile_policy", "fp8_backends.tuning.first_use"),
    # a helper that installs the Triton quant kernels as the quant ops' implementation (tests, benchmarks)
    ("fp8_backends.providers.triton.quant_kernels", "fp8_backends.quant"),
}
#: the modules whose ``import_module`` calls compute their name: the lazy export tables (see :func:`lazy_exports`)
DYNAMIC_IMPORTS = frozenset({"fp8_backends"})


def folder_floor(path: Path) -> int:
    """The floor of the folder ``path`` lies in (``FOLDER_FLOORS``)."""
    rel = path.relative_to(ROOT).as_posix()
    folder = max((f for f in FOLDER_FLOORS if rel.startswith(f + "/")), key=len)
    return FOLDER_FLOORS[folder]


def floor(module: str) -> int:
    if module == PACKAGE_INIT:
        return 0
    return folder_floor(MODULES[module][0])


def library_modules() -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is a package __init__)}`` for every module of the three folders."""
    found: dict[str, tuple[Path, bool]] = {}
    for package, folder in PACKAGE_DIRS.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base)
            if rel.parts[0] == "data" or "__pycache__" in rel.parts:
                continue
            parts = [package, *rel.parts[:-1]]
            if path.name != "__init__.py":
                parts.append(path.stem)
            name = ".".join(parts)
            if name.startswith("fp8_backends.registry") and folder == "fp8_backends":
                continue  # a stray folder of that name inside fp8_backends/ is not what gets installed
            found[name] = (path, path.name == "__init__.py")
    return found


MODULES = library_modules()


def bench_modules() -> dict[str, tuple[Path, bool]]:
    """``{module name: (file, is a package __init__)}`` for the modules of ``bench/`` (not its results)."""
    base = ROOT / "bench"
    found = {"bench": (base / "__init__.py", True)}
    for path in sorted(base.glob("*.py")):
        if path.name != "__init__.py":
            found[f"bench.{path.stem}"] = (path, False)
    return found


BENCH_MODULES = bench_modules()
#: the library and ``bench/``: what the runtime graph walks
ALL_MODULES = {**MODULES, **BENCH_MODULES}


def _is_type_checking(test: ast.expr) -> bool:
    return any(isinstance(n, ast.Name | ast.Attribute) and getattr(n, "id", getattr(n, "attr", None)) ==
               "TYPE_CHECKING" for n in ast.walk(test))


#: where an import statement sits, which decides when it runs: ``"module"`` (at import time: the module body, class
#: bodies, ``try``/``if`` blocks, the ``else`` of ``if TYPE_CHECKING``), ``"function"`` (when a function or method
#: runs: the library's lazy imports) or ``"type_checking"`` (never: type checkers and IDEs only)
MODULE_LEVEL = frozenset({"module"})
RUNTIME = frozenset({"module", "function"})
EVERY = frozenset({"module", "function", "type_checking"})


def _is_import_module(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module")


def scan(tree: ast.Module) -> tuple[list[tuple[ast.Import | ast.ImportFrom, str]], list[str]]:
    """``(imports, dynamic)``: every import statement of a module with where it sits (see :data:`EVERY`), an
    ``importlib.import_module("a.b")`` call with a literal name counted as ``import a.b``; and the source of each
    ``import_module`` call whose name is computed (which no static walk can follow)."""
    found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
    dynamic: list[str] = []

    def visit(node: ast.AST, where: str) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, "type_checking")
            for child in node.orelse:
                visit(child, where)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, where))
            return
        if isinstance(node, ast.Call) and _is_import_module(node):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
                found.append((ast.Import(names=[ast.alias(name=arg.value)]), where))
            else:
                dynamic.append(ast.unparse(node))
        inner = "function" if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and \
            where == "module" else where
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    for stmt in tree.body:
        visit(stmt, "module")
    return found, dynamic


@functools.cache
def lazy_exports(module: str) -> dict[str, str]:
    """A package's lazy export table (``_EXPORTS``: name -> the module defining it, imported on first attribute access
    by its ``__getattr__``), or ``{}``. Read from the imported package: a package ``__init__`` imports nothing heavy."""
    path, is_package = MODULES[module]
    if not is_package or "_EXPORTS" not in path.read_text():
        return {}
    return dict(importlib.import_module(module)._EXPORTS)


def _targets(module: str, node: ast.Import | ast.ImportFrom,
             table: dict[str, tuple[Path, bool]] = MODULES) -> set[str]:
    """The modules of ``table`` an import statement of ``module`` runs (the named modules and their parent packages;
    a name taken from a package's lazy export table, the module that defines it)."""
    path, is_package = table[module]
    named: set[str] = set()
    if isinstance(node, ast.Import):
        named = {alias.name for alias in node.names}
    else:
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        exports = lazy_exports(source) if source in MODULES else {}
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            named.add(sub if sub in table else source)
            if sub not in table and alias.name in exports:
                named.add(exports[alias.name])
    out = set()
    for name in named:
        parts = name.split(".")
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}  # importing a.b.c runs a and a.b first
    return {t for t in out if t in table and t != module}


@functools.cache
def _scan(path: Path) -> tuple[tuple[tuple[ast.Import | ast.ImportFrom, str], ...], tuple[str, ...]]:
    imports, dynamic = scan(ast.parse(path.read_text(), filename=str(path)))
    return tuple(imports), tuple(dynamic)


def import_graph(*, lazy: bool = False, scope: frozenset[str] | None = None,
                 table: dict[str, tuple[Path, bool]] = MODULES) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over ``table`` (:data:`MODULES`, or :data:`ALL_MODULES` with ``bench/``):
    the imports that run at import time (the default), every import the source names (``lazy=True``: in functions
    and under ``TYPE_CHECKING`` too), or those of ``scope`` (:data:`RUNTIME`: every import that can run, at import
    time or inside a function)."""
    scope = scope or (EVERY if lazy else MODULE_LEVEL)
    graph = {}
    for module, (path, _) in table.items():
        imports, _ = _scan(path)
        graph[module] = {t for node, where in imports if where in scope for t in _targets(module, node, table)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def floor_summary(graph: dict[str, set[str]]) -> dict[tuple[int, int], int]:
    """``{(floor of the importer, floor of the imported): edges}``."""
    summary: dict[tuple[int, int], int] = {}
    for module, targets in graph.items():
        for target in targets:
            key = (floor(module), floor(target))
            summary[key] = summary.get(key, 0) + 1
    return summary


# ------------------------------------------------------------------------------------------------------ tests
def test_the_walk_sees_the_library():
    assert {"fp8_backends.core.backend", "fp8_backends.registry.discovery", "fp8_backends.providers.triton.gemm",
            "fp8_backends.tuning.engine", "fp8_backends.registry", "fp8_backends.providers"} <= set(MODULES)
    graph = import_graph()
    assert "fp8_backends.core.types" in graph["fp8_backends.core.backend"]
    assert "fp8_backends.registry.discovery" in graph["fp8_backends.registry.resolution"]  # relative import
    assert "fp8_backends.registry" in graph["fp8_backends.registry.resolution"]  # its package runs first
    # lazy imports are not module-level edges, but the lazy walk sees them
    assert "fp8_backends.tuning.first_use" not in graph["fp8_backends.registry.lockfile_policy"]
    assert "fp8_backends.tuning.first_use" in import_graph(scope=RUNTIME)["fp8_backends.registry.lockfile_policy"]
    # an importlib.import_module call with a literal name is an import too
    assert "fp8_backends.registry.defaults" in import_graph(scope=RUNTIME)["fp8_backends.registry.resolution"]
    # TYPE_CHECKING imports never run: only the walk of every name (lazy=True) sees them
    assert "fp8_backends.core.types" in import_graph(lazy=True)["fp8_backends"]
    assert "fp8_backends.core.types" not in import_graph(scope=RUNTIME)["fp8_backends"]
    # a name from a package's lazy export table is an edge to the module that defines it
    assert "fp8_backends.layers.modules" in import_graph(scope=RUNTIME)["fp8_backends.functional"]
    # bench/ is walked with the library
    runtime = import_graph(scope=RUNTIME, table=ALL_MODULES)
    assert {"bench.common", "bench.hf_bench"} <= runtime["bench.hf_workers"]
    assert "fp8_backends.tuning.timing" in runtime["bench.common"]


def test_the_walk_sees_every_kind_of_import():
    tree = ast.parse(
        "import a\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
        "class K:\n    import d\n    def m(self):\n        import e\n"
        "def f():\n    importlib.import_module('g')\n    importlib.import_module(name)\n    lambda: __import__('h')\n"
        "try:\n    import i\nexcept ImportError:\n    pass\n")
    imports, dynamic = scan(tree)
    where = {alias.name: w for node, w in imports if isinstance(node, ast.Import) for alias in node.names}
    assert where == {"a": "module", "b": "type_checking", "c": "module", "d": "module", "e": "function",
                     "g": "function", "i": "module"}
    assert dynamic == ["importlib.import_module(name)"]


def test_the_folder_tells_the_floor():
    """Floor 0 is exactly ``fp8_backends.core`` (and the package ``__init__``); every other module's installed name
    names its floor's folder: ``fp8_backends.registry.*`` lies in ``registry/``, ``fp8_backends.providers.*`` in
    ``providers/``, and the rest of ``fp8_backends.*`` in ``fp8_backends/`` outside ``core/``."""
    by_name = {m: 0 if m == PACKAGE_INIT or m == "fp8_backends.core" or m.startswith("fp8_backends.core.")
               else 1 if m == "fp8_backends.registry" or m.startswith("fp8_backends.registry.")
               else 2 if m == "fp8_backends.providers" or m.startswith("fp8_backends.providers.")
               else 3 for m in MODULES}
    wrong = sorted(f"{m} ({MODULES[m][0].relative_to(ROOT)}): floor {floor(m)} by folder, {by_name[m]} by name"
                   for m in MODULES if floor(m) != by_name[m])
    assert not wrong, "modules whose folder is not their floor's:\n" + "\n".join(wrong)
    core = {m for m in MODULES if floor(m) == 0}
    assert core == {PACKAGE_INIT, "fp8_backends.core"} | {
        f"fp8_backends.core.{p.stem}" for p in (ROOT / "fp8_backends" / "core").glob("*.py") if p.stem != "__init__"}
    assert {"fp8_backends.core.types", "fp8_backends.core.backend", "fp8_backends.core.settings",
            "fp8_backends.core.bucket_tables"} <= core
    # the package __init__ may sit on floor 0 only because it imports nothing of the library at import time
    assert not import_graph()[PACKAGE_INIT]


def test_a_module_in_the_wrong_folder_fails():
    """The floor test catches a contract module left in ``fp8_backends/`` (floor 3) that the contract imports."""
    graph = {m: set(t) for m, t in import_graph().items()}
    stray = "fp8_backends.some_contract_piece"
    MODULES[stray] = (ROOT / "fp8_backends" / "some_contract_piece.py", False)
    try:
        graph[stray] = set()
        graph["fp8_backends.core.types"].add(stray)
        assert floor(stray) == 3
        assert any(floor(t) > floor(m) for m, targets in graph.items() for t in targets)
    finally:
        del MODULES[stray]


def test_no_import_cycle_between_modules():
    found = cycles(import_graph())
    assert not found, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_cycle_counting_imports_inside_functions():
    """Every import that can run (at import time or inside a function, ``import_module`` with a literal name), over
    the library and ``bench/``: no two modules reach each other. Break a cycle by moving what both need down (a
    module of its own, or the lower floor), or by a hook the upper side installs; never by hiding the name."""
    found = cycles(import_graph(scope=RUNTIME, table=ALL_MODULES))
    assert not found, "import cycles (imports inside functions included):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_core_names_nothing_above_it():
    """Not at import time, not inside a function, not for type checkers (the package ``__init__``'s mirror of its
    lazy export table aside: it is floor 0 only for what it runs)."""
    up = sorted(f"{m} -> {t} (floor {floor(t)})" for m, targets in import_graph(lazy=True).items()
                if floor(m) == 0 and m != PACKAGE_INIT for t in targets if floor(t) > 0)
    up += sorted(f"{PACKAGE_INIT} -> {t} (floor {floor(t)})" for t in import_graph(scope=RUNTIME)[PACKAGE_INIT]
                 if floor(t) > 0)
    assert not up, "the core names modules above it:\n" + "\n".join(up)


def test_the_lazy_imports_up_the_floors_are_the_known_few():
    graph = import_graph(scope=RUNTIME)
    # a package run on the way to its module (fp8_backends.tuning for tuning.first_use) comes with that module
    up = {(m, t) for m, targets in graph.items() for t in targets if floor(t) > floor(m)
          and not any(other.startswith(t + ".") for other in targets)}
    assert up == LAZY_IMPORTS_UP, (f"new lazy imports up the floors: {sorted(up - LAZY_IMPORTS_UP)} (move the piece "
                                   f"down, or give the lower floor a hook)" if up - LAZY_IMPORTS_UP
                                   else f"LAZY_IMPORTS_UP is stale: {sorted(LAZY_IMPORTS_UP - up)}")


def test_only_the_lazy_export_tables_compute_a_module_name():
    """An ``import_module`` call with a computed name hides its edge from this walk (a string-built path is how a
    cycle would hide): only the lazy export helper of the package ``__init__`` computes one, and its tables are read
    as edges (:func:`lazy_exports`)."""
    computing = {m for m, (path, _) in ALL_MODULES.items() if _scan(path)[1]}
    assert computing == DYNAMIC_IMPORTS, {m: _scan(ALL_MODULES[m][0])[1] for m in computing ^ DYNAMIC_IMPORTS}


def package_of(module: str) -> str:
    """The node of ``module`` in the package graph: its package, labelled with its floor."""
    package = module if MODULES[module][1] else module.rpartition(".")[0]
    return f"{package}[{FLOOR_NAMES[floor(module)]}]"


def test_no_import_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        # running an ancestor package's __init__ first is how Python imports a module, not a dependency of the
        # package on its parent (the module graph covers what that __init__ itself imports)
        packages.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if not (MODULES[t][1] and module.startswith(t + ".")))
    for package, targets in packages.items():
        targets.discard(package)
        for target in targets:
            packages.setdefault(target, set())
    found = cycles(packages)
    assert not found, "package-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_module_imports_a_higher_floor():
    upward = sorted(f"{m} (floor {floor(m)}, {FLOOR_NAMES[floor(m)]}) imports {t} (floor {floor(t)})"
                    for m, targets in import_graph().items() for t in targets if floor(t) > floor(m))
    assert not upward, "imports up the floors at module level:\n" + "\n".join(upward)


@pytest.mark.parametrize("lower_floor", [0, 1])
def test_the_contract_and_the_registry_name_no_provider(lower_floor):
    """Not even lazily: what a provider supplies (kernels, the quant default) reaches them through hooks."""
    named = sorted(f"{m} -> {t}" for m, targets in import_graph(lazy=True).items() if floor(m) == lower_floor
                   for t in targets if floor(t) == 2)
    assert not named, f"{FLOOR_NAMES[lower_floor]} modules naming provider modules:\n" + "\n".join(named)


def test_only_the_toolchain_tools_name_a_provider():
    naming = {m for m, targets in import_graph(lazy=True).items() if floor(m) == 3 and any(floor(t) == 2
                                                                                          for t in targets)}
    assert naming == TOOLS_NAMING_PROVIDERS, (
        f"engine-layer modules importing provider modules: {sorted(naming - TOOLS_NAMING_PROVIDERS)} "
        "(ask the registry, or give the provider contract a hook)" if naming - TOOLS_NAMING_PROVIDERS
        else f"TOOLS_NAMING_PROVIDERS is stale: {sorted(TOOLS_NAMING_PROVIDERS - naming)}")


def test_quant_names_no_provider():
    source = (ROOT / "fp8_backends" / "quant" / "__init__.py").read_text()
    assert "fp8_backends.providers" not in source and "triton" not in source.split('"""', 2)[2]


MODULE_TABLE = ROOT / "docs" / "architecture.md"


def _has_code(path: Path) -> bool:
    """Whether a module holds more than its docstring (an ``__init__`` that only describes its package does not)."""
    body = ast.parse(path.read_text()).body
    return any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) for node in body)


def test_the_module_table_lists_every_module():
    """``docs/architecture.md`` names every module of the library's folders by its path (one line each; a
    package ``__init__`` only when it holds code), and no module that is gone."""
    text = MODULE_TABLE.read_text()
    files = sorted(path.relative_to(ROOT).as_posix() for path, _ in MODULES.values()
                   if path.name != "__init__.py" or _has_code(path))
    missing = [f for f in files if f"`{f}`" not in text]
    assert not missing, f"not in {MODULE_TABLE.relative_to(ROOT)}: {missing}"
    named = {m for m in re.findall(r"`((?:fp8_backends|registry|providers)/[\w/]+\.py)`", text)}
    stale = sorted(f for f in named if not (ROOT / f).exists())
    assert not stale, f"{MODULE_TABLE.relative_to(ROOT)} names modules that do not exist: {stale}"
