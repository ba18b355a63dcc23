"""Deprecated: renamed :mod:`fp8_backends.core.bucket_tables` (per-provider M-bucket config tables); re-exported
here."""

from __future__ import annotations

import warnings

from fp8_backends.core.bucket_tables import *  # noqa: F403
from fp8_backends.core.bucket_tables import Buckets, BucketTable, TableSource  # noqa: F401

warnings.warn("fp8_backends.dispatch was renamed fp8_backends.core.bucket_tables", DeprecationWarning, stacklevel=2)
