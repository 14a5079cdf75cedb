"""NVIDIA apex's own ``apex.parallel`` where an apex build that still has it (25.04 or older) is
installed: ``strategy: apex-ddp`` and ``sync_bn: apex`` prefer it, as a user of that build expects,
and use ampddp's apex-style implementations everywhere else."""

from __future__ import annotations

import importlib
from typing import Any


def installed_apex_parallel(name: str) -> Any | None:
    """``apex.parallel.<name>`` from an installed apex, None when there is none (or it lacks ``name``).
    Under ``python -m ampddp.apex`` the name ``apex`` is ampddp's own facade, which gives the same
    classes as the fallback."""
    try:
        return getattr(importlib.import_module("apex.parallel"), name)
    except (ImportError, AttributeError):
        return None
