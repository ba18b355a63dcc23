"""Griffe extensions for the API reference (``mkdocs.yml`` names them in the python handler's ``extensions``).

- :class:`PackageDirs`: subpackages that live outside their parent's folder. ``pyproject.toml`` installs the
  top-level folders ``registry/`` and ``providers/`` as ``fp8_backends.registry`` and ``fp8_backends.providers``
  (``[tool.setuptools.package-dir]``). Griffe reads a package from its folder, so it would not see them under
  ``fp8_backends``; this extension reads that table and attaches each such folder, with its modules and
  subpackages, to the loaded parent package.
- :class:`SphinxMarkup`: the docstrings are written for plain reading and Sphinx (``:class:`X```, ``Example::``,
  lists right under a line of text); this rewrites those few constructs into the Markdown the site renders,
  without touching the source.
"""

from __future__ import annotations

import re
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


_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj|const):`(~?)([^`]+)`")
_LIST_ITEM = re.compile(r"^\s*(?:[-*] |\d+\. )")


def _code_span(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"``{target.rpartition('.')[2] if tilde else target}``"


def markdown_of(text: str) -> str:
    """A docstring with Sphinx roles as code spans, ``text::`` as ``text:``, and a blank line before each list that
    follows a line of text (Markdown needs it; plain reading does not)."""
    lines: list[str] = []
    for line in _ROLE.sub(_code_span, text).splitlines():
        if line.rstrip().endswith("::"):
            line = line.rstrip()[:-1]
        prev = lines[-1] if lines else ""
        if _LIST_ITEM.match(line) and prev.strip() and not _LIST_ITEM.match(prev) and not prev.startswith((" ", "\t")):
            lines.append("")
        lines.append(line)
    return "\n".join(lines)


class SphinxMarkup(griffe.Extension):
    """Rewrite each docstring's Sphinx constructs into Markdown as objects are read."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_of(obj.docstring.value)
