"""One WARNING per token: the registry's files (the lockfile, the shipped data) warn once per problem they find, not
once per layer that reads them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable
from typing import Any


class WarnOnce:
    """``warning(token, msg, *args)`` logs at WARNING the first time ``token`` is seen (thread-safe);
    :meth:`clear` forgets every token (the modules' ``reset_state``)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def warning(self, token: Hashable, msg: str, *args: Any) -> None:
        with self._lock:
            if token in self._seen:
                return
            self._seen.add(token)
        self._logger.warning(msg, *args)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


__all__ = ["WarnOnce"]
