"""Modules that moved stay importable at their old paths (deprecation shims re-exporting the new ones)."""

from __future__ import annotations

import importlib
import sys

import pytest


def _fresh_import(name: str):
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_registry_settings_shim():
    from fp8_backends import settings

    with pytest.warns(DeprecationWarning, match="fp8_backends.settings"):
        old = _fresh_import("fp8_backends.registry.settings")
    assert old.cache_dir is settings.cache_dir and old.env_flag is settings.env_flag
    assert old.LOCKFILE_ENV == settings.LOCKFILE_ENV and old.EnvFlag is settings.EnvFlag
