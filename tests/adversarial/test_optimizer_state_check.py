"""A checkpoint's optimizer state must fit the live parameters: another model's state with the same
group sizes is refused in one line naming the first mismatched entry, before anything is loaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampddp.apex.optimizers import FusedNovoGrad
from ampddp.checkpoint.restore import check_optimizer_state
from ampddp.errors import CheckpointError


def stepped_state(model: nn.Module, make) -> dict:
    optimizer = make(model.parameters())
    F.mse_loss(model(torch.ones(2, model.in_features)), torch.zeros(2, model.out_features)).backward()
    optimizer.step()
    return optimizer.state_dict()


MAKERS = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


@pytest.mark.parametrize("name", list(MAKERS))
def test_the_optimizer_state_of_another_model_is_refused_naming_the_entry(name):
    saved = stepped_state(nn.Linear(4, 8), MAKERS[name])  # two params, as the live model has
    live = MAKERS[name](nn.Linear(8, 4).parameters())
    expected = r"ckpt: optimizer state '\w+' of parameter 0 in group 0 has shape \(8, 4\), the live parameter \(4, 8\)"
    with pytest.raises(CheckpointError, match=expected):
        check_optimizer_state(saved, live, "ckpt")


@pytest.mark.parametrize("name", list(MAKERS))
def test_the_state_of_the_same_model_shape_is_accepted(name):
    saved = stepped_state(nn.Linear(4, 8), MAKERS[name])
    check_optimizer_state(saved, MAKERS[name](nn.Linear(4, 8).parameters()), "ckpt")


def test_per_tensor_norms_are_not_mistaken_for_a_shape_mismatch():
    make = lambda params: FusedNovoGrad(params, lr=0.1)  # noqa: E731 - keeps exp_avg_sq as one number per tensor
    saved = stepped_state(nn.Linear(4, 8), make)
    check_optimizer_state(saved, make(nn.Linear(4, 8).parameters()), "ckpt")
