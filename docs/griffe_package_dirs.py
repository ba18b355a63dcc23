"""A griffe extension for the API reference: subpackages that live outside their parent's folder.

``pyproject.toml`` installs the top-level folders ``registry/`` and ``providers/`` as ``fp8_backends.registry``
and ``fp8_backends.providers`` (``[tool.setuptools.package-dir]``). Griffe reads a package from its folder, so it
would not see them under ``fp8_backends``; this extension reads that table and attaches each such folder, with its
modules and subpackages, to the loaded parent package. ``mkdocs.yml`` names it in the python handler's
``extensions``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import griffe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """``{dotted package name: folder}`` of the setuptools package-dir table."""
    table = tomllib.loads(pyproject.read_text())["tool"]["setuptools"].get("package-dir", {})
    return {name: (pyproject.parent / folder).resolve() for name, folder in table.items()}


class PackageDirs(griffe.Extension):
    """Attach the package-dir subpackages (``fp8_backends.registry`` ...) to their loaded parent package."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Griffe 2's hook (and griffe 1's ``on_package_loaded``): called once a package is loaded."""
        for name, folder in sorted(package_dirs().items()):
            parent, _, child = name.rpartition(".")
            if parent == pkg.path and child not in pkg.members:
                pkg.set_member(child, self._load(child, folder, pkg, loader))

    on_package_loaded = on_package

    def _load(self, name: str, folder: Path, parent: griffe.Module, loader: griffe.GriffeLoader) -> griffe.Module:
        module = self._visit(name, folder / "__init__.py", parent, loader)
        for path in sorted(folder.iterdir()):
            if path.suffix == ".py" and path.name != "__init__.py":
                module.set_member(path.stem, self._visit(path.stem, path, module, loader))
            elif path.is_dir() and (path / "__init__.py").is_file():
                module.set_member(path.name, self._load(path.name, path, module, loader))
        return module

    @staticmethod
    def _visit(name: str, path: Path, parent: griffe.Module, loader: griffe.GriffeLoader) -> griffe.Module:
        code = path.read_text(encoding="utf-8")
        loader.lines_collection[path] = code.splitlines()
        return griffe.visit(name, path, code, extensions=loader.extensions, parent=parent,
                            docstring_parser=loader.docstring_parser, docstring_options=loader.docstring_options,
                            lines_collection=loader.lines_collection, modules_collection=loader.modules_collection)
