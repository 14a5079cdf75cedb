"""O2/O5 steps allocate nothing of their own: the masters' fp32 gradients live in buffers made once
(allocated afresh each step, glibc returned them to the OS and the next step faulted them back)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampddp import prepare
from ampddp.distributed import detect_env


@pytest.mark.parametrize("mode", ["O2", "O5"])
def test_the_masters_gradients_are_the_same_buffers_every_step(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    run = prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3), detect_env(device="cpu"), precision=mode)
    seen: list[list[int]] = []
    run.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: seen.append([p.grad.data_ptr() for group in optimizer.param_groups for p in group["params"]])
    )
    inputs, targets = torch.randn(8, 16), torch.randint(0, 4, (8,))
    for _ in range(3):
        run.optimizer.zero_grad(set_to_none=True)
        with run.engine.forward_context():
            loss = nn.functional.cross_entropy(run.model(inputs), targets)
        run.engine.backward(loss)
        assert run.engine.step(run.optimizer)
    assert len(seen) == 3 and seen[0] == seen[1] == seen[2]
