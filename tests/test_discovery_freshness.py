"""Entry-point freshness: discovery always reports what ``importlib.metadata`` reports for the installed
distributions, right after an (editable) reinstall, in a new process and in the running one.

stevedore's disk cache (``$XDG_CACHE_HOME/python-entrypoints``) keys its scans on file times rounded to
float32 (128 s steps today), so a plugin author's edit-reinstall loop used to see the old entry points for
minutes. The tests point ``XDG_CACHE_HOME`` at a fresh folder that a stale cache could fill.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_backends.registry import discovery

PLUGIN_SRC = Path(__file__).parent / "data" / "thirdparty_plugin"

LATE_MODULE = '''
from typing import ClassVar

from fp8_backends_testplugin.toy import ToyGemmBackend


class LateGemmBackend(ToyGemmBackend):
    name: ClassVar[str] = "late"
    aliases: ClassVar[tuple[str, ...]] = ()
'''

SCAN = (
    "import json, site, sys; site.addsitedir(sys.argv[1]);"
    "from fp8_backends.registry import discovery;"
    "print(json.dumps(sorted([e.name, e.status] for e in discovery.discover('gemm') if not e.builtin)))"
)


def _pip_editable(src: Path, target: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--upgrade", "-e", str(src), "--target", str(target)],
        check=True,
    )


def _add_late_entry_point(src: Path) -> None:
    (src / "fp8_backends_testplugin" / "late.py").write_text(LATE_MODULE)
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    marker = '[project.entry-points."fp8_backends.gemm"]\n'
    assert marker in text
    pyproject.write_text(text.replace(marker, marker + 'late = "fp8_backends_testplugin.late:LateGemmBackend"\n'))


def _scan_in_new_process(target: Path, env: dict[str, str]) -> list[list[str]]:
    out = subprocess.run([sys.executable, "-c", SCAN, str(target)], capture_output=True, text=True, env=env,
                         check=True, timeout=120, cwd="/")
    return json.loads(out.stdout)


@pytest.fixture
def editable_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A copy of the test plugin installed in editable mode into ``tmp_path/site``; returns (src, site)."""
    src = tmp_path / "src"
    shutil.copytree(PLUGIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path / "site"
    _pip_editable(src, target)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return src, target


def test_new_process_sees_an_entry_point_added_by_an_editable_reinstall(editable_plugin):
    src, target = editable_plugin
    env = dict(os.environ)
    before = _scan_in_new_process(target, env)
    assert ["toy", "loaded"] in before and not [n for n, _ in before if n == "late"]
    _add_late_entry_point(src)
    _pip_editable(src, target)
    after = _scan_in_new_process(target, env)  # at once: no cache of the first scan may answer
    assert ["late", "loaded"] in after, after


def test_running_process_sees_the_reinstall_without_refresh(editable_plugin, monkeypatch):
    src, target = editable_plugin
    monkeypatch.setattr(sys, "path", list(sys.path))  # addsitedir's additions are undone after the test
    site.addsitedir(str(target))  # as at start-up: processes the editable install's .pth file
    try:
        names = {e.name for e in discovery.discover("gemm")}
        assert "toy" in names and "late" not in names
        first = discovery.discover("gemm")
        assert discovery.discover("gemm") is first  # unchanged environment: the cached scan
        _add_late_entry_point(src)
        _pip_editable(src, target)
        late = [e for e in discovery.discover("gemm") if e.name == "late"]  # no refresh() call
        assert len(late) == 1 and late[0].status == "loaded" and late[0].cls.__name__ == "LateGemmBackend"
        reported = {ep.name for ep in importlib.metadata.entry_points(group="fp8_backends.gemm")}
        assert reported == {e.name for e in discovery.discover("gemm")}
    finally:
        for mod in [m for m in sys.modules if m.startswith("fp8_backends_testplugin")]:
            sys.modules.pop(mod)
        discovery.refresh()


def test_refresh_rescans(monkeypatch):
    first = discovery.discover("norm_quant")
    discovery.refresh()
    again = discovery.discover("norm_quant")
    assert again is not first and [e.name for e in again] == [e.name for e in first]


def test_watch_tracks_sys_path_and_metadata_folders(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "old.dist-info").mkdir()
    monkeypatch.setattr(sys, "path", [str(site)])
    watch = discovery.PathWatch()
    watch.record()
    assert not watch.changed()
    (site / "new.dist-info").mkdir()  # an install
    assert watch.changed()
    watch.record()
    monkeypatch.setattr(sys, "path", [str(site), str(tmp_path / "missing")])  # a sys.path edit
    assert watch.changed()


def test_watch_ignores_files_written_into_a_folder_without_metadata(tmp_path, monkeypatch):
    """The working directory (or a script's folder) on sys.path: a log file written there is no install."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(sys, "path", ["", str(work)])
    monkeypatch.chdir(work)
    watch = discovery.PathWatch()
    watch.record()
    (work / "run.log").write_text("x")
    os.utime(work, ns=(1, 1))  # the folder's time moved for sure
    assert not watch.changed()
    assert not watch.changed()  # its new time was recorded: no re-read either
    (work / "plugin-1.0.dist-info").mkdir()  # an install into that folder does count
    assert watch.changed()


def test_a_recorded_fault_survives_a_rescan_and_cwd_writes_cost_no_rescan(tmp_path, monkeypatch):
    """A provider found unusable at run time stays so when discovery rescans; a file written into the working
    directory does not make discovery rescan (the listing's verdicts stay attached to their entries)."""
    from fp8_backends.core.backend import record_fault

    monkeypatch.chdir(tmp_path)
    discovery.refresh()
    first = discovery.discover("norm_quant")
    torch_entry = next(e for e in first if e.name == "torch")
    record_fault(torch_entry.cls, "support check raised RuntimeError: boom")
    try:
        (tmp_path / "plugin.log").write_text("written by a plugin")
        os.utime(tmp_path, ns=(2, 2))
        again = discovery.discover("norm_quant")
        assert again is first  # no rescan
        discovery._watches[("norm_quant", None)].path = ()  # force the next call to rescan
        rescanned = discovery.discover("norm_quant")
        assert rescanned is not first
        entry = next(e for e in rescanned if e.name == "torch")
        assert entry is torch_entry and not entry.availability().ok
        assert "boom" in entry.availability().reason
    finally:
        discovery.refresh()
    assert next(e for e in discovery.discover("norm_quant") if e.name == "torch").availability().ok


def test_a_refresh_forgets_the_decisions_made_from_the_providers(monkeypatch):
    """What the floors above the registry decided from the discovered providers (the activation-quant defaults, the
    MoE experts' grouped kernels) is asked again after ``refresh``: a plugin installed since can supply them."""
    pytest.importorskip("torch")
    from fp8_backends import quant
    from fp8_backends.layers import experts

    monkeypatch.setitem(experts._kernels, "toy-device", (None, "decided before the plugin came"))
    quant.default_quant_impl("per_token", "cpu")
    assert quant._defaults and experts.experts_kernels("toy-device")[1] == "decided before the plugin came"
    discovery.refresh()
    assert not quant._defaults and "toy-device" not in experts._kernels
    kernels, why = experts.experts_kernels("toy-device")
    assert kernels is None and "no provider supplies grouped-experts kernels for toy-device" in why
