"""Atomic, safe-to-load checkpoints with exact resume (layout and key names: ``keys``).

The public names load on first use, so that ``keys`` and ``manifest`` (torch-free) can be imported
without torch: ``ampddp train`` reads a finished run's manifest before it imports torch.
"""

from __future__ import annotations

from ampddp import lazy_names

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

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
