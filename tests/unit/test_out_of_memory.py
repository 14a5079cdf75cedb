"""Running out of memory mid-training is one line naming the phase of the step and the batch."""

from __future__ import annotations

import pytest
import torch
from resume_helpers import NoisyDigits, make_model
from torch import nn

from ampddp.errors import OutOfMemoryError
from ampddp.trainer import Trainer


class GreedyAtStep(nn.Module):
    """``inner``, whose forward asks the allocator for a petabyte at its ``at``-th call (a real
    DefaultCPUAllocator failure, as a batch too large for the host would meet)."""

    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            torch.empty(2**50, dtype=torch.uint8)
        return self.inner(inputs)


def test_out_of_memory_in_a_forward_names_the_phase_the_step_and_the_batch():
    model = GreedyAtStep(make_model(), at=3)
    trainer = Trainer(model, lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(32), precision="O0", batch_size=8, max_steps=5,
                      report=None)  # fmt: skip
    with pytest.raises(OutOfMemoryError) as raised:
        trainer.fit()
    message = str(raised.value)
    assert message.startswith("out of host memory during the forward of step 3 (8 samples a batch on this rank): ")
    assert "can't allocate memory" in message and "\n" not in message
    assert message.endswith("lower the batch size (data.batch_size), keeping the effective batch with gradient accumulation "
                            "(trainer.grad_accum_steps) if it matters")  # fmt: skip
