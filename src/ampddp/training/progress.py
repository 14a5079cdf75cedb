"""Where a run stands (epoch, step, samples): the part of every checkpoint that says how far it got."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    epoch: int = 0
    """Current epoch (0-based)."""
    global_step: int = 0
    """Optimizer steps taken, skipped ones included."""
    samples_seen: int = 0
    """Training samples consumed over all ranks."""
    epoch_position: int = 0
    """Samples of the current epoch's global order consumed over all ranks."""
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            if name in self.__dataclass_fields__:
                setattr(self, name, int(value))


def finished(progress: Progress, max_steps: int | None, max_epochs: int) -> bool:
    """Whether a run at ``progress`` has reached its end (``max_steps`` first, when set)."""
    if max_steps is not None and progress.global_step >= max_steps:
        return True
    return progress.epoch >= max_epochs
