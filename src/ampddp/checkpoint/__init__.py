"""Atomic, safe-to-load checkpoints with exact resume (layout and key names: ``keys``).

The public names load on first use, so that ``keys`` and ``manifest`` (torch-free) can be imported
without torch: ``ampddp train`` reads a finished run's manifest before it imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "CheckpointRef": "ampddp.checkpoint.store",
    "CheckpointStore": "ampddp.checkpoint.store",
    "SafetensorsWeights": "ampddp.checkpoint.safetensors_weights",
    "check_model_state": "ampddp.checkpoint.restore",
    "find_checkpoint": "ampddp.checkpoint.store",
    "initial_weights": "ampddp.checkpoint.restore",
    "load_safely": "ampddp.checkpoint.files",
    "restore_precision": "ampddp.checkpoint.restore",
    "save_atomic": "ampddp.checkpoint.files",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """Import a public name's module when the name is first used (PEP 562)."""
    if name not in _HOMES:
        raise AttributeError(f"module 'ampddp.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
