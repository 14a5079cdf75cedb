"""Ranks that built different models stop at once, every one of them, with one line naming the first
differing tensor, before DDP (or apex's DDP) pairs up tensors that do not match."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampddp import Parallel
from ampddp.distributed import launch_local
from ampddp.distributed.model_agreement import first_difference, model_layout
from ampddp.errors import ConfigError
from ampddp.prepare import prepare


def build(rank: int, change: str) -> nn.Module:
    torch.manual_seed(0)
    width = 64 if change == "width" and rank == 1 else 32
    model = nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))
    if change == "buffer" and rank == 1:
        model.register_buffer("step_count", torch.zeros(()))
    return model


def prepare_worker(env, change: str, strategy: str) -> str:
    try:
        prepare(build(env.rank, change), lambda params: torch.optim.SGD(params, lr=0.1), env, precision="O0", parallel=Parallel(strategy))
    except ConfigError as error:
        return str(error)
    return "wrapped"


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("change", "strategy", "named"),
    [
        ("width", "ddp", "rank 1 has parameter '0.weight' of shape [64, 16] where rank 0 has [32, 16]"),
        ("buffer", "apex-ddp", "rank 1 has buffer 'step_count' that rank 0 lacks"),
    ],
)
def test_ranks_with_different_models_all_stop_naming_the_tensor(change, strategy, named):
    reports = launch_local(prepare_worker, 2, (change, strategy), device="cpu", timeout_s=120)
    assert reports[0] == reports[1]
    assert reports[0] == (
        f"the ranks built different models: {named}; every rank must build the same model (same code, settings and weights files)"
    )


@pytest.mark.timeout(180)
def test_ranks_with_the_same_model_wrap_it():
    assert launch_local(prepare_worker, 2, ("none", "ddp"), device="cpu", timeout_s=120) == ["wrapped", "wrapped"]


def test_the_first_difference_is_named_in_words():
    main = model_layout(nn.Linear(3, 2))
    assert first_difference(main, main) is None
    assert first_difference(main, model_layout(nn.Linear(3, 2, bias=False))) == "lacks parameter 'bias' that rank 0 has"
    assert first_difference(main, model_layout(nn.Linear(3, 2).half())) == "has parameter 'weight' in float16 where rank 0 has float32"
    swapped = [main[1], main[0]]
    assert first_difference(main, swapped) == "registers its tensors in another order than rank 0"
