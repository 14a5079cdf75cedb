"""An epoch ending in a one-sample batch that BatchNorm cannot train on fails at the start, in one
line naming batch sizes that work, instead of an epoch into the run; where the model can train on
one sample, the probe changes nothing."""

from __future__ import annotations

import pytest
import torch
from resume_helpers import NoisyDigits, make_model
from torch import nn

from ampddp import PRECISION_MODES
from ampddp.checkpoint.store import CheckpointStore
from ampddp.distributed.env import DistEnv
from ampddp.errors import ConfigError
from ampddp.prepare import prepare
from ampddp.trainer import Trainer
from ampddp.training.batches import BatchAdapter
from ampddp.training.last_batch import batch_sizes_avoiding_one, check_single_sample_batch, last_batch_size


def trainer_on(run_dir, train_set: torch.utils.data.Dataset, max_steps: int) -> Trainer:
    sgd = lambda params: torch.optim.SGD(params, lr=0.05)  # noqa: E731
    return Trainer(make_model(), sgd, train_set, precision="O0", batch_size=4, max_steps=max_steps, max_epochs=100, run_dir=run_dir)


def test_last_batch_sizes_and_the_nearest_sizes_that_avoid_one():
    assert [last_batch_size(n, 4) for n in (8, 9, 10, 3)] == [4, 1, 2, 3]
    assert batch_sizes_avoiding_one(33, 32) == [31, 33]
    assert batch_sizes_avoiding_one(3, 2) == [3]
    assert batch_sizes_avoiding_one(1, 8) == []
    for samples, batch in ((33, 32), (65, 32), (97, 48), (1000, 37)):
        assert all(last_batch_size(samples, b) != 1 for b in batch_sizes_avoiding_one(samples, batch))


def test_a_batchnorm1d_model_whose_epoch_ends_in_one_sample_is_refused_before_training(tmp_path):
    trainer = trainer_on(tmp_path, NoisyDigits(33), max_steps=20)
    with pytest.raises(ConfigError) as error:
        trainer.fit()
    message = str(error.value)
    assert message.startswith("the last training batch of every epoch would hold 1 sample (33 samples per process in batches of 4)")
    assert "Expected more than 1 value per channel when training" in message
    assert message.endswith("use a batch size of 3 or 5 (data.batch_size), which leaves more") and "\n" not in message
    assert CheckpointStore(tmp_path).latest() is None, "nothing was trained or written"


def test_sizes_that_leave_more_than_one_sample_train_without_a_probe(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(BatchAdapter, "forward", lambda self, model, batch: calls.append(len(batch[0])) or model(batch[0]))
    trainer_on(tmp_path, NoisyDigits(34), max_steps=3).fit()
    assert 1 not in calls, "no single-sample forward: the last batch holds 2"


class ConvNet(nn.Module):
    """BatchNorm2d normalises over the batch and the pixels: one sample of 4x4 is enough."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).flatten(1))


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int):
        return torch.rand(1, 4, 4), index % 3


@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_a_model_that_trains_on_one_sample_passes_and_the_probe_leaves_no_trace(mode):
    run = prepare(ConvNet(), lambda params: torch.optim.SGD(params, lr=0.1), DistEnv(), precision=mode)
    module = run.module
    buffers = {name: buffer.clone() for name, buffer in module.named_buffers()}
    params = {name: p.detach().clone() for name, p in module.named_parameters()}
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    module.eval()
    try:
        check_single_sample_batch(module, Images(), [9, 5], 4, BatchAdapter(), torch.device("cpu"), run.engine.forward_context)
    finally:
        run.engine.teardown()
    assert not module.training, "the model's mode is restored"
    for name, buffer in module.named_buffers():
        assert torch.equal(buffer, buffers[name]), f"{name}: the probe left the running statistics as they were"
    for name, p in module.named_parameters():
        assert torch.equal(p, params[name]) and p.grad is None
    assert torch.equal(torch.rand(1), expected_draw), "the random streams are where they were (the sample's and dropout's draws undone)"


def test_the_probe_runs_in_every_mode_and_refuses_a_batchnorm1d_model(mode="O2"):
    for mode in ("O2", "O4", "native-fp16"):
        run = prepare(make_model(), lambda params: torch.optim.SGD(params, lr=0.1), DistEnv(), precision=mode)
        try:
            with pytest.raises(ConfigError, match=r"\(5 samples per process in batches of 4\).*ValueError: Expected more than 1 value"):
                check_single_sample_batch(
                    run.module, NoisyDigits(5), [5], 4, BatchAdapter(), torch.device("cpu"), run.engine.forward_context
                )
        finally:
            run.engine.teardown()
