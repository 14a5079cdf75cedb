"""An epoch ending in a one-sample batch that BatchNorm cannot train on fails at the start, in one
line naming batch sizes that work, instead of an epoch into the run; where the model can train on
one sample, or the run never reaches that batch, nothing happens and nothing changes."""

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
from ampddp.training import CheckpointSettings
from ampddp.training.batches import BatchAdapter, cross_entropy
from ampddp.training.last_batch import batch_sizes_avoiding_one, check_single_sample_batch, last_batch_size


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def trainer_on(run_dir, train_set: torch.utils.data.Dataset, max_steps: int, model: nn.Module | None = None, **options) -> Trainer:
    model = make_model() if model is None else model
    return Trainer(model, sgd, train_set, precision="O0", batch_size=4, max_steps=max_steps, max_epochs=100,
                   checkpoints=CheckpointSettings(run_dir), **options)  # fmt: skip


def test_last_batch_sizes_and_the_nearest_sizes_that_avoid_one():
    assert [last_batch_size(n, 4) for n in (8, 9, 10, 3)] == [4, 1, 2, 3]
    assert batch_sizes_avoiding_one([33], 32) == [31, 33]
    assert batch_sizes_avoiding_one([3], 2) == [3]
    assert batch_sizes_avoiding_one([1, 9], 8) == []
    assert batch_sizes_avoiding_one([33, 34], 4) == [5], "2 leaves one of 33, 3 one of 34"
    for epochs, batch in (([33], 32), ([65], 32), ([97, 101], 48), ([1000], 37)):
        assert all(last_batch_size(n, b) != 1 for b in batch_sizes_avoiding_one(epochs, batch) for n in epochs)


def test_a_batchnorm1d_model_whose_epoch_ends_in_one_sample_is_refused_before_training(tmp_path):
    trainer = trainer_on(tmp_path, NoisyDigits(33), max_steps=20)
    with pytest.raises(ConfigError) as error:
        trainer.fit()
    message = str(error.value)
    assert message.startswith("the last training batch of an epoch would hold 1 sample (33 samples per process in batches of 4)")
    assert "(ValueError: Expected more than 1 value per channel when training" in message and "though it runs on two" in message
    assert message.endswith("use a batch size of 3 or 5 (data.batch_size), which leaves more") and "\n" not in message
    assert CheckpointStore(tmp_path).latest() is None, "nothing was trained or written"


def test_a_run_that_never_reaches_the_one_sample_batch_is_not_refused(tmp_path):
    progress = trainer_on(tmp_path, NoisyDigits(33), max_steps=8).fit()["progress"]
    assert progress["global_step"] == 8, "8 full batches of an epoch of 9: the ninth, of one sample, is never trained"


def test_sizes_that_leave_more_than_one_sample_train_without_a_probe(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(BatchAdapter, "forward", lambda self, model, batch: calls.append(len(batch[0])) or model(batch[0]))
    trainer_on(tmp_path, NoisyDigits(34), max_steps=3).fit()
    assert 1 not in calls, "no single-sample forward: the last batch holds 2"


def test_a_frozen_batchnorm_trains_on_one_sample_and_stays_frozen(tmp_path):
    model = make_model()
    model[1].eval()  # a frozen BatchNorm: running statistics, no batch statistics
    result = trainer_on(tmp_path, NoisyDigits(33), max_steps=10, model=model, eval_set=NoisyDigits(8)).fit()
    assert result["progress"]["global_step"] == 10 and result["eval"]["samples"] == 8
    assert model.training and not model[1].training, "neither the probe nor the evaluations (steps 9 and 10) unfroze it"


def test_an_error_at_every_batch_size_is_the_models_own(tmp_path):
    broken = nn.Sequential(nn.Linear(15, 4))  # 16 features come in
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        trainer_on(tmp_path, NoisyDigits(33), max_steps=20, model=broken).fit()


class Counting(nn.Module):
    """A forward that replaces one buffer and registers another, besides BatchNorm2d's updates."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Linear(64, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        if not hasattr(self, "seen"):
            self.register_buffer("seen", torch.ones(()))
        return self.head(self.body(x).flatten(1))


class Images(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int):
        return torch.rand(1, 4, 4), index % 3


@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_a_model_that_trains_on_one_sample_passes_and_the_probe_leaves_no_trace(mode):
    run = prepare(Counting(), sgd, DistEnv(), precision=mode)
    module, adapter = run.module, BatchAdapter()
    calls = module.calls
    buffers = {name: buffer.clone() for name, buffer in module.named_buffers()}
    params = {name: p.detach().clone() for name, p in module.named_parameters()}

    def step(batch):
        with run.engine.forward_context():
            return cross_entropy(adapter.forward(run.model, batch), batch)

    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    try:
        check_single_sample_batch(Images(), [9, 5], 4, step, module, DistEnv())
    finally:
        run.engine.teardown()
    assert module.calls is calls and dict(module.named_buffers()).keys() == buffers.keys(), "the buffers are the same tensors"
    for name, buffer in module.named_buffers():
        assert torch.equal(buffer, buffers[name]), f"{name}: the probe left it as it was"
    for name, p in module.named_parameters():
        assert torch.equal(p, params[name]) and p.grad is None
    assert torch.equal(torch.rand(1), expected_draw), "the random streams are where they were (the sample's and dropout's draws undone)"


@pytest.mark.parametrize("mode", ["O2", "O4", "native-fp16"])
def test_a_batchnorm1d_model_is_refused_in_the_set_ups_that_cast_it(mode, tmp_path):
    trainer = Trainer(make_model(), sgd, NoisyDigits(5), precision=mode, batch_size=4, max_steps=5,
                      checkpoints=CheckpointSettings(tmp_path))  # fmt: skip
    with pytest.raises(ConfigError, match=r"\(5 samples per process in batches of 4\).*ValueError: Expected more than 1 value"):
        trainer.fit()
