"""apex.parallel's classes for ``strategy: apex-ddp`` and ``sync_bn: apex``: NVIDIA's own where an apex
build that still has them (25.04 or older) is installed, ampddp.apex.parallel's everywhere else."""

from __future__ import annotations

import importlib
from typing import Any


def apex_parallel_attr(name: str) -> Any:
    """``apex.parallel.<name>`` from NVIDIA apex if present, else from ``ampddp.apex.parallel``."""
    try:
        return getattr(importlib.import_module("apex.parallel"), name)
    except (ImportError, AttributeError):
        return getattr(importlib.import_module("ampddp.apex.parallel"), name)
