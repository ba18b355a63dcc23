"""Tuning at first use (``FP8_BACKENDS_TUNE=1``): when the ``"lockfile"`` policy of ``auto``
(:mod:`fp8_backends.registry.lockfile_policy`) meets a problem the lockfile lacks, it tunes that problem's M bucket
with the engine (:mod:`.engine`, quick timer settings), stores it in the lockfile and answers from it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from fp8_backends.registry.lockfile import _store, current_key, find_section, locked, write_entries
from fp8_backends.registry.platform import Platform

logger = logging.getLogger("fp8_backends")

_tuning_now = threading.local()


def active() -> bool:
    """Whether this thread is tuning at first use now."""
    return getattr(_tuning_now, "active", False)


def tune_missing(
    kind: str, problem: Any, platform: Platform, path: Path, bucket: int
) -> tuple[int, dict[str, Any]] | None:
    """``FP8_BACKENDS_TUNE=1``: tune this problem at ``bucket``, store it, and return the lookup. Holds the
    file lock while tuning so that concurrent ranks tune it once and all use the same result."""
    if not platform.is_cuda and problem.device.value != "cpu":
        return None
    _tuning_now.active = True
    try:
        from fp8_backends.tuning import engine as tuner

        with locked(path):
            _store.forget(path)
            loaded = _store.load(path)
            section = find_section(loaded, platform, warn=False) if loaded.error is None else None
            hit = section.lookup(kind, problem) if section is not None else None
            if hit is not None and hit[0] == bucket:
                return hit
            from fp8_backends.tuning.timing import TimerConfig

            report = tuner.tune([problem], m_buckets=[bucket], platform=platform, progress=False,
                                timer_config=TimerConfig.quick())
            entries = report.lockfile_entries()
            if not entries:
                logger.warning("tuning %s at first use found no working provider", problem.describe())
                return None
            key, _ = current_key(platform)
            write_entries(path, key, entries, already_locked=True)
            logger.info("tuned %s at first use (bucket M=%d) into %s", problem.describe(), bucket, path)
        loaded = _store.load(path)
        section = find_section(loaded, platform, warn=False) if loaded.error is None else None
        return section.lookup(kind, problem) if section is not None else None
    except Exception as exc:  # tuning must never break resolution
        logger.warning("tuning at first use failed for %s (%s: %s)", problem.describe(), type(exc).__name__, exc)
        return None
    finally:
        _tuning_now.active = False
