"""A provider module that imports torch at import time (the kit's import-light check must fail it)."""

from typing import ClassVar

import torch  # noqa: F401  (the bug)
from mutant_providers import GoodGemm


class HeavyImport(GoodGemm):
    name: ClassVar[str] = "heavy_import"
