"""Every code block of README.md and of the documentation site (``docs/**/*.md``) runs as written (CI runs this
file with the rest of the suite; ``.ci/run`` also builds the site with ``mkdocs build --strict``).

By language:

- ``python``: runs in a fresh namespace, in a temporary folder, with ``sys.argv`` holding only a program name. On
  the provider author's pages (``docs/providers/``) the example package below is installed first.
- Files of the example package: on ``docs/providers/index.md``, a block whose first line names a file
  (``# my_fp8_kernels/provider.py``, ``# pyproject.toml``) is a file of the package ``my-fp8-kernels``: the blocks
  are written to a folder and installed, and the package must pass its own conformance tests, the listing and
  ``python -m fp8_backends.testing``. README's entry-point block must match its ``pyproject.toml``.
- ``bash``: runs with ``bash -euo pipefail`` from the repository root (as the pages say), without the developer's
  ``FP8_*`` variables and with a temporary cache folder.
  Every ``python -m MODULE`` a shell block names must import, and every repository file it names must exist.
- ``toml`` (other than the package's files) must parse; ``text`` blocks are output and schemas, not run.

Markers, on the line before a block:

- ``<!-- docs-test: gpu: <reason> -->`` (python): skips where no CUDA device is visible. Keep such blocks few:
  prefer ``device = "cuda" if torch.cuda.is_available() else "cpu"``.
- ``<!-- docs-test: skip: <reason> -->`` (bash): not run here: a command that needs a GPU or nvcc, installs
  something, or that CI runs elsewhere; the reason says where it is checked. Its syntax and the modules and files
  it names are still checked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
#: the page whose file-named blocks are the example provider package, and the folder of pages that import it
PACKAGE_PAGE = DOCS / "providers" / "index.md"
PACKAGE_PAGES = DOCS / "providers"
#: blocks known not to run yet, by id, with why: a strict xfail, so the entry must go when they run
PENDING: dict[str, str] = {}
MARKER = "<!-- docs-test:"
_FILE_LINE = re.compile(r"^# ([\w./-]+\.(?:py|toml))\s*$")
_PYTHON_M = re.compile(r"\bpython3? (?:-\w+ )*-m ([\w.]+)")
_REPO_FILE = re.compile(r"(?<![\w./-])((?:bench|examples|tests|fp8_backends|registry|providers|\.ci)/[\w./-]+"
                        r"\.(?:py|sh|md|json|cu)|\.ci/run)\b")


@dataclass(frozen=True)
class Block:
    page: Path
    lang: str
    code: str
    line: int
    section: str
    marker: str

    @property
    def rel(self) -> str:
        return self.page.relative_to(ROOT).as_posix()

    @property
    def file(self) -> str | None:
        """The example package's file this block is, or None."""
        first = self.code.splitlines()[0] if self.code else ""
        m = _FILE_LINE.match(first)
        return m.group(1) if m and self.page == PACKAGE_PAGE else None

    @property
    def needs_package(self) -> bool:
        return PACKAGE_PAGES in self.page.parents

    def marked(self, kind: str) -> str | None:
        """The reason of a ``<!-- docs-test: KIND: reason -->`` marker, or None."""
        prefix = f"{MARKER} {kind}:"
        if not self.marker.startswith(prefix):
            return None
        return self.marker.removeprefix(prefix).removesuffix("-->").strip()

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:30]
        return f"{self.rel}:L{self.line}-{slug}"


def page_blocks(page: Path) -> list[Block]:
    blocks, section = [], ""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.lstrip("#").strip()
        m = re.match(r"^```(\w*)\s*$", line)
        if m:
            start, body = i, []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            prev = lines[start - 1].strip() if start else ""
            marker = prev if prev.startswith(MARKER) else ""
            blocks.append(Block(page, m.group(1), "\n".join(body) + "\n", start + 1, section, marker))
        i += 1
    return blocks


BLOCKS = [b for page in PAGES for b in page_blocks(page)]
FILES = [b for b in BLOCKS if b.file is not None]
SCRIPTS = [b for b in BLOCKS if b.lang == "python" and b.file is None]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh")]
TOML = [b for b in BLOCKS if b.lang == "toml" and b.file is None]


def test_every_block_has_a_known_language_and_marker():
    known = {"python", "bash", "sh", "toml", "text"}
    assert not [b.id for b in BLOCKS if b.lang not in known], f"blocks need a language among {sorted(known)}"
    for b in BLOCKS:
        if b.marker:
            assert b.marked("gpu") is not None and b.lang == "python" or b.marked("skip") is not None and \
                b.lang in ("bash", "sh"), f"{b.id}: {b.marker!r} (gpu: python blocks only; skip: shell blocks only)"
            assert (b.marked("gpu") or b.marked("skip")), f"{b.id}: a marker states its reason"


def test_the_example_package_is_complete():
    assert {b.file for b in FILES} == {"pyproject.toml", "my_fp8_kernels/__init__.py", "my_fp8_kernels/ops.py",
                                       "my_fp8_kernels/provider.py", "tests/test_conformance.py"}
    assert len([b for b in SCRIPTS if b.page.name == "README.md"]) >= 2
    assert len(SCRIPTS) >= 10, [b.id for b in SCRIPTS]


def test_readme_entry_points_are_the_example_package_s():
    """README's third-party example is the entry-point table of the example package's ``pyproject.toml``."""
    pyproject = next(b.code for b in FILES if b.file == "pyproject.toml")
    readme = [b for b in TOML if b.page.name == "README.md"]
    assert readme, "README shows a provider's entry points"
    for block in readme:
        missing = [line for line in block.code.splitlines() if line.strip() and line not in pyproject.splitlines()]
        assert not missing, f"{block.id}: not in the example package's pyproject.toml: {missing}"


@pytest.fixture(scope="session")
def docs_package(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The example package of the provider author's guide, written from its blocks and pip-installed into a folder;
    returns (package folder, install folder)."""
    root = tmp_path_factory.mktemp("docs_package")
    for block in FILES:
        path = root / block.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.code)
    site = tmp_path_factory.mktemp("docs_site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(root)], check=True, timeout=300)
    return root, site


@pytest.mark.parametrize("block", SCRIPTS, ids=[b.id for b in SCRIPTS])
def test_python_block_runs_as_written(block: Block, request: pytest.FixtureRequest, monkeypatch, tmp_path):
    if block.id in PENDING:
        request.applymarker(pytest.mark.xfail(reason=PENDING[block.id], strict=True))
    reason = block.marked("gpu")
    if reason is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip(reason)
    if block.needs_package:
        from fp8_backends.registry import discovery

        _, site = request.getfixturevalue("docs_package")
        monkeypatch.syspath_prepend(str(site))
        discovery.refresh()
    monkeypatch.setattr(sys, "argv", ["docs-block"])
    monkeypatch.chdir(tmp_path)
    code = compile(block.code, f"{block.rel}:{block.line}", "exec")
    exec(code, {"__name__": "__docs__"})


def _env(site: Path | None = None, cache: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8_")}
    if site is not None:
        env["PYTHONPATH"] = str(site)
    if cache is not None:
        env["FP8_BACKENDS_CACHE_DIR"] = str(cache)
    env["FP8_BACKENDS_LOCKFILE"] = "off"
    return env


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_shell_block(block: Block, tmp_path):
    """A shell block's syntax, the modules it runs and the files it names; then the block itself unless marked."""
    done = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for module in _PYTHON_M.findall(block.code):
        assert importlib.util.find_spec(module) is not None, f"{block.id}: python -m {module}: no such module"
    package_files = {b.file for b in FILES} if block.needs_package else set()
    for path in _REPO_FILE.findall(block.code):
        assert path in package_files or (ROOT / path).exists(), f"{block.id}: {path} does not exist"
    reason = block.marked("skip")
    if reason is not None:
        pytest.skip(reason)
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=_env(cache=tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


@pytest.mark.parametrize("block", TOML, ids=[b.id for b in TOML])
def test_toml_block_parses(block: Block):
    tomllib = pytest.importorskip("tomllib")
    tomllib.loads(block.code)


def test_the_example_package_passes_the_conformance_kit(docs_package):
    root, site = docs_package
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"], cwd=root,
                          env=_env(site), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert int(summary.split(" passed")[0].split()[-1]) >= 150, summary
    kit = subprocess.run([sys.executable, "-m", "fp8_backends.testing", "my-fp8-kernels:my_gemm", "--", "-q",
                          "-p", "no:cacheprovider"], cwd=root, env=_env(site), capture_output=True, text=True,
                         timeout=900)
    assert kit.returncode == 0, kit.stdout[-4000:] + kit.stderr[-2000:]


def test_the_example_providers_are_listed_and_usable(docs_package):
    root, site = docs_package
    done = subprocess.run([sys.executable, "-m", "fp8_backends.list", "--json", "--gemm-backend", "mine"],
                          cwd="/", env=_env(site), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    mine = {(p["kind"], p["name"]): p for p in data["providers"] if p["distribution"] == "my-fp8-kernels"}
    assert set(mine) == {("gemm", "my_gemm"), ("norm_quant", "my_norm")}
    for p in mine.values():
        assert p["status"] == "loaded" and p["usable"], p
    assert mine[("gemm", "my_gemm")]["aliases"] == ["mine"]
    assert data["resolution"]["gemm"]["chosen"] == "my_gemm"


def test_named_files_and_links_exist():
    """Every repository file a page names in code (``providers/triton/launcher.py``) exists, and every relative link
    of README.md (mkdocs checks the site's own) reaches a file; results folders cited (``bench/results/<benchmark>/
    <date>-<gpu>/``) exist too."""
    missing = []
    package_files = {b.file for b in FILES}
    for page in PAGES:
        text = page.read_text()
        for span in re.findall(r"`([^`\n]+)`", text):
            for path in _REPO_FILE.findall(span):
                if "<" not in path and path not in package_files and not (ROOT / path).exists():
                    missing.append(f"{page.relative_to(ROOT)}: {path}")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text()):
        if "://" not in target and not (ROOT / target).exists():
            missing.append(f"README.md: link to {target}")
    assert not missing, "\n".join(missing)


def test_no_working_vocabulary():
    """Results are cited by benchmark, date and path: no page names a working session's 'stop N' or 'call N'."""
    pattern = re.compile(r"\bstop ?[0-9]+|\bcall ?[0-9]+\b|-stop[0-9]+", re.I)
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in PAGES
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "\n".join(found)


def test_every_public_name_is_in_the_api_reference():
    """The reference's overview names every export of ``fp8_backends``."""
    import fp8_backends

    text = (DOCS / "reference" / "index.md").read_text()
    assert not [name for name in fp8_backends.__all__ if f"`{name}`" not in text]

