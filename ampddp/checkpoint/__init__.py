"""Atomic, safe-to-load checkpoints with exact resume (layout and key names: ``keys``)."""

from ampddp.checkpoint.files import load_safely, save_atomic
from ampddp.checkpoint.restore import check_model_state, initial_weights, restore_precision
from ampddp.checkpoint.store import CheckpointRef, CheckpointStore, find_checkpoint

__all__ = [
    "CheckpointRef",
    "CheckpointStore",
    "check_model_state",
    "find_checkpoint",
    "initial_weights",
    "load_safely",
    "restore_precision",
    "save_atomic",
]
