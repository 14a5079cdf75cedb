"""Undo what a skipped step's forward passes wrote into the models' buffers.

A forward in training mode updates BatchNorm running statistics before anyone knows whether the
step will be applied. When the gradients overflow and the step is skipped, the weights stay as they
were, but buffers already hold the statistics of a forward that may have produced inf/NaN, and a
checkpoint would save them. The guard copies the buffers at the first training forward after a step
and writes the copy back if that step is skipped. Engines that can skip steps (dynamic loss
scaling) install one; it costs one foreach copy of the buffers per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampddp.precision.compile_support import run_eagerly_as_own_frame


class BufferGuard:
    """Snapshot of the models' buffers taken before the first training forward of each step."""

    def __init__(self, models: list[nn.Module]) -> None:
        self._buffers = [buffer for model in models for buffer in model.buffers()]
        # Made now, not at the first forward: a compiled forward that inlines the hook would guard
        # on "no snapshot yet" and compile again at the second step.
        self._snapshot = [buffer.detach().clone() for buffer in self._buffers]
        self._armed = True

    def install(self, models: list[nn.Module]) -> list[RemovableHandle]:
        if not self._buffers:
            return []
        run_eagerly_as_own_frame(self._before_forward)
        return [model.register_forward_pre_hook(self._before_forward) for model in models]

    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not self._armed or not module.training or not torch.is_grad_enabled():
            return
        self._armed = False
        if any(s.shape != b.shape or s.dtype != b.dtype for s, b in zip(self._snapshot, self._buffers)):
            self._snapshot = [buffer.detach().clone() for buffer in self._buffers]
        else:
            with torch.no_grad():
                torch._foreach_copy_(self._snapshot, [buffer.detach() for buffer in self._buffers])

    @torch.no_grad()
    def restore(self) -> None:
        """The step was skipped: buffers go back to what they were before its forwards."""
        if not self._armed:
            torch._foreach_copy_([buffer.data for buffer in self._buffers], self._snapshot)
        self._armed = True

    def commit(self) -> None:
        """The step was applied: keep the buffers; the next training forward takes a new snapshot."""
        self._armed = True
