"""Bad data is reported as the data's fault, in one line naming the sample by its dataset index: a
dataset whose ``__getitem__`` raises (with and without loader workers), a label outside the model's
classes (training and evaluation), and an inf/NaN input (in any micro-batch of an accumulated step)."""

from __future__ import annotations

import re

import pytest
import torch
from resume_helpers import NoisyDigits, make_trainer

from ampddp.distributed import launch_local
from ampddp.errors import DataError, NonFiniteGradientsError
from ampddp.training.loading import LoaderSettings


class BrokenAt(NoisyDigits):
    def __init__(self, broken: int) -> None:
        super().__init__()
        self.broken = broken

    def __getitem__(self, index: int):
        if index == self.broken:
            raise OSError("image file is truncated (12 bytes not processed)")
        return super().__getitem__(index)


class LabelledOutside(NoisyDigits):
    def __getitem__(self, index: int):  # sample 7's label is 12; the model has 4 classes
        x, y = super().__getitem__(index)
        return x, torch.tensor(12) if index == 7 else y


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_fails_to_load_is_named_in_one_line(tmp_path, workers):
    trainer = make_trainer(tmp_path, "O0", max_steps=20, loading=LoaderSettings(num_workers=workers))
    trainer.train_set = BrokenAt(37)
    with pytest.raises(DataError) as failed:
        trainer.fit()
    message = str(failed.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith("training sample 37 (epoch 0) cannot be loaded: OSError: image file is truncated")


def test_a_label_outside_the_models_classes_is_named_by_its_dataset_index(tmp_path):
    trainer = make_trainer(tmp_path, "O0", max_steps=20)
    trainer.train_set = LabelledOutside()
    named = r"^label\(s\) 12 of training sample\(s\) 7 \(epoch 0\) fall outside the model's 4 classes \(valid: 0\.\.3, or -100 to ignore\)"
    with pytest.raises(DataError, match=named):
        trainer.fit()


def test_a_label_outside_the_classes_in_the_eval_set_is_named_by_its_index(tmp_path):
    trainer = make_trainer(tmp_path, "O0", max_steps=20, eval_set=LabelledOutside(10))
    with pytest.raises(DataError, match=r"^label\(s\) 12 of evaluation sample\(s\) 7 fall outside the model's 4 classes"):
        trainer.fit()


class NaNAt(NoisyDigits):
    def __getitem__(self, index: int):
        x, y = super().__getitem__(index)
        return (torch.full_like(x, float("nan")) if index == 7 else x), y


@pytest.mark.parametrize("accumulated", [1, 2, 4])
def test_a_non_finite_input_is_blamed_on_the_data_by_its_index(tmp_path, accumulated):
    """With accumulation the bad sample may sit in any micro-batch of the step, not only the last."""
    trainer = make_trainer(tmp_path, "O0", max_steps=20, max_nonfinite_losses=1, grad_accum_steps=accumulated)
    trainer.train_set = NaNAt()
    blamed = r"first: the input batch itself holds inf/NaN \(training sample\(s\) 7 \(epoch 0\)\): the data's fault"
    with pytest.raises(NonFiniteGradientsError, match=blamed):
        trainer.fit()


def nan_on_one_rank_worker(env, run_dir) -> str:
    trainer = make_trainer(run_dir, "O0", max_steps=20, env=env, max_nonfinite_losses=1, grad_accum_steps=1)
    trainer.train_set = NaNAt()
    try:
        trainer.fit()
    except NonFiniteGradientsError as error:
        return str(error)
    return "trained"


@pytest.mark.timeout(240)
def test_a_non_finite_input_on_one_rank_is_blamed_on_it_by_every_rank(tmp_path):
    """With a synchronised BatchNorm (portable, on CPU) in the model: a rank that found the bad input
    and one that did not must not diverge (the diagnostic forward would wait for the other rank)."""
    reports = launch_local(nan_on_one_rank_worker, 2, (tmp_path,), device="cpu", timeout_s=120)
    assert reports[0] == reports[1]
    blamed = r"first: the input batch itself holds inf/NaN \(rank [01]: training sample\(s\) 7 \(epoch 0\)\): the data's fault"
    assert re.search(blamed, reports[0]), reports[0]


def test_rows_that_are_not_samples_of_the_batch_are_named_as_positions(tmp_path):
    """A loss over flattened tokens reports token rows, which no dataset index matches."""
    trainer = make_trainer(tmp_path, "O0", max_steps=1)
    assert trainer._samples(0, (0, 9)) == "batch position(s) 0, 9 of training batch 0 (epoch 0)"
