"""Every Python code block of README.md runs as written (CI runs this file with the rest of the suite).

- A block in "Writing a provider" whose first line names a file (``# my_fp8_kernels/provider.py``,
  ``# pyproject.toml``) is part of the example package: the blocks are written to a folder, installed, and the
  package must pass its own conformance tests, the listing and ``python -m fp8_backends.testing``.
- Every other ``python`` block runs in a fresh namespace (the "Writing a provider" ones with the example package
  installed), with ``sys.argv`` holding only a program name.
- A block preceded by ``<!-- readme-test: gpu: <reason> -->`` skips where no CUDA device is visible (keep such
  blocks few: prefer ``device = "cuda" if torch.cuda.is_available() else "cpu"``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
WRITING = "Writing a provider (third parties)"
#: sections whose blocks are known not to run yet, with why: a strict xfail, so the entry must go when they run
PENDING: dict[str, str] = {}
_FILE_LINE = re.compile(r"^# ([\w./-]+\.(?:py|toml))\s*$")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    section: str
    marker: str

    @property
    def file(self) -> str | None:
        first = self.code.splitlines()[0] if self.code else ""
        m = _FILE_LINE.match(first)
        return m.group(1) if m and self.section == WRITING else None

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-")[:30]
        return f"L{self.line}-{slug}"


def readme_blocks() -> list[Block]:
    blocks, section, marker = [], "", ""
    lines = README.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"^```(\w*)\s*$", line)
        if m:
            start = i
            body = []
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            prev = lines[start - 1].strip() if start else ""
            marker = prev if prev.startswith("<!-- readme-test:") else ""
            blocks.append(Block(m.group(1), "\n".join(body) + "\n", start + 1, section, marker))
        i += 1
    return blocks


BLOCKS = readme_blocks()
SCRIPTS = [b for b in BLOCKS if b.lang == "python" and b.file is None]
FILES = [b for b in BLOCKS if b.file is not None]


@pytest.fixture(scope="session")
def readme_package(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The example package of "Writing a provider", written from the README and pip-installed into a folder;
    returns (package folder, install folder)."""
    root = tmp_path_factory.mktemp("readme_package")
    for block in FILES:
        path = root / block.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.code)
    site = tmp_path_factory.mktemp("readme_site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(root)], check=True, timeout=300)
    return root, site


def test_the_example_package_is_complete():
    assert {b.file for b in FILES} == {"pyproject.toml", "my_fp8_kernels/__init__.py", "my_fp8_kernels/ops.py",
                                       "my_fp8_kernels/provider.py", "tests/test_conformance.py"}
    assert len(SCRIPTS) >= 4, [b.id for b in SCRIPTS]


@pytest.mark.parametrize("block", SCRIPTS, ids=[b.id for b in SCRIPTS])
def test_python_block_runs_as_written(block: Block, request: pytest.FixtureRequest, monkeypatch, tmp_path):
    if block.section in PENDING:
        request.applymarker(pytest.mark.xfail(reason=PENDING[block.section], strict=True))
    if block.marker.startswith("<!-- readme-test: gpu:"):
        import torch

        if not torch.cuda.is_available():
            pytest.skip(block.marker.removeprefix("<!-- readme-test: gpu:").removesuffix("-->").strip())
    if block.section == WRITING:
        from fp8_backends.registry import discovery

        _, site = request.getfixturevalue("readme_package")
        monkeypatch.syspath_prepend(str(site))
        discovery.refresh()
    monkeypatch.setattr(sys, "argv", ["readme-block"])
    monkeypatch.chdir(tmp_path)
    code = compile(block.code, f"README.md:{block.line}", "exec")
    exec(code, {"__name__": "__readme__"})


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8_")}
    env["PYTHONPATH"] = str(site)
    env["FP8_BACKENDS_LOCKFILE"] = "off"
    return env


def test_the_example_package_passes_the_conformance_kit(readme_package):
    root, site = readme_package
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


def test_the_example_providers_are_listed_and_usable(readme_package):
    root, site = readme_package
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
