"""An apex-era training script, unchanged except for its import line.

Below the marker is the kind of code written against ``apex.amp`` in 2019-2024: initialize,
scale_loss, clip on master params, checkpoint ``{"model", "optimizer", "amp"}`` and restore in the
order apex documents (initialize, then model, optimizer, amp). The tests run it and require that a
run interrupted by save/restore ends exactly where an uninterrupted run does.
"""

from __future__ import annotations

import pytest
import torch

# ---- the apex-era script --------------------------------------------------------------------
import torch.nn as nn
import torch.nn.functional as F

from ampddp import amp  # was: from apex import amp

device = "cuda" if torch.cuda.is_available() else "cpu"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 5)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def get_data(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 20, generator=g)
    return x.to(device), (x[:, :5].argmax(1)).to(device)


def build(opt_level):
    torch.manual_seed(0)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    return model, optimizer


def train(model, optimizer, first_step, last_step):
    model.train()
    for step in range(first_step, last_step):
        x, y = get_data(step)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
    return loss.item()


def save(path, model, optimizer):
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
    torch.save(checkpoint, path)


def restore(path, opt_level):
    model, optimizer = build(opt_level)
    checkpoint = torch.load(path, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    return model, optimizer


# ---- the checks -------------------------------------------------------------------------------
def final_state(model, optimizer):
    return model.state_dict(), [p.detach().clone() for p in amp.master_params(optimizer)], amp.state_dict()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_apex_script_resumes_exactly(opt_level, tmp_path):
    model, optimizer = build(opt_level)
    loss = train(model, optimizer, 0, 12)
    straight = final_state(model, optimizer)

    model, optimizer = build(opt_level)
    train(model, optimizer, 0, 6)
    save(tmp_path / "amp_checkpoint.pt", model, optimizer)
    model, optimizer = restore(tmp_path / "amp_checkpoint.pt", opt_level)
    resumed_loss = train(model, optimizer, 6, 12)
    resumed = final_state(model, optimizer)

    assert resumed_loss == loss
    assert resumed[2] == straight[2]
    assert straight[0].keys() == resumed[0].keys()
    for key, value in straight[0].items():
        assert torch.equal(value, resumed[0][key]), key
    for a, b in zip(straight[1], resumed[1]):
        assert torch.equal(a, b)
    assert all(v.dtype != torch.float16 and v.dtype != torch.bfloat16 for v in resumed[0].values())
