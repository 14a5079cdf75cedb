"""Trainer behaviour a user relies on: scheduler vs skipped steps, overflow diagnostics, clipping."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from resume_helpers import NoisyDigits
from torch import nn

from ampddp import Precision
from ampddp.errors import NonFiniteGradientsError
from ampddp.trainer import Trainer
from ampddp.training import CheckpointSettings


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def trainer_for(model, tmp_path, **options):
    defaults = dict(batch_size=4, max_steps=3, seed=0, checkpoints=CheckpointSettings(tmp_path), max_epochs=10)
    defaults.update(options)
    return Trainer(model, lambda p: torch.optim.SGD(p, lr=0.1), NoisyDigits(), **defaults)


@pytest.mark.parametrize("mode", ["O1", "O2", "native-fp16"])
def test_the_scheduler_does_not_advance_on_a_skipped_step_and_torch_does_not_warn(tmp_path, mode):
    overrides = {"init_loss_scale": 2.0**24, "max_loss_scale": 2.0**24} if mode != "native-fp16" else {"init_loss_scale": 2.0**24}
    trainer = trainer_for(mlp(), tmp_path, precision=Precision(mode, overrides=overrides), max_steps=1,
                          make_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with torch.no_grad():
            trainer.run.module[4].weight.mul_(1e4)
        trainer.fit()
    assert trainer.progress.skipped_steps == 1
    assert trainer.optimizer.param_groups[0]["lr"] == 0.1
    assert trainer.scheduler.last_epoch == 0


class Exploding(nn.Module):
    def forward(self, x):
        return x * float("inf")


def test_overflow_diagnostics_name_the_module_whose_forward_made_inf(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), Exploding(), nn.Linear(32, 4))
    trainer = trainer_for(model, tmp_path, precision="O1", max_steps=2, max_nonfinite_losses=100)
    with caplog.at_level(logging.WARNING, logger="ampddp"):
        trainer.fit()
    assert "forward pass of module '3' produced inf/NaN" in caplog.text


def test_a_backward_overflow_names_the_parameter_nearest_the_output(tmp_path, caplog):
    model = mlp()
    trainer = trainer_for(
        model, tmp_path, precision=Precision("O2", overrides={"init_loss_scale": 2.0**24, "max_loss_scale": 2.0**24}), max_steps=1
    )
    with torch.no_grad():
        model[4].weight.mul_(1e3)
    with caplog.at_level(logging.WARNING, logger="ampddp"):
        trainer.fit()
    assert trainer.progress.skipped_steps == 1
    assert "gradients overflowed from models[0].4.bias" in caplog.text or "start at models[0].4" in caplog.text


def test_a_persistently_non_finite_loss_stops_training_with_the_module_named(tmp_path):
    model = nn.Sequential(nn.Linear(16, 8), Exploding(), nn.Linear(8, 4))
    trainer = trainer_for(model, tmp_path, precision="native-bf16", max_steps=50, max_nonfinite_losses=3)
    with pytest.raises(NonFiniteGradientsError, match=r"non-finite for 3 consecutive steps.*module '1'"):
        trainer.fit()


def test_trainer_clipping_under_o2_matches_fp32(tmp_path):
    results = {}
    for mode in ("O0", "O2"):
        precision = Precision(mode, overrides={"loss_scale": 128.0} if mode == "O2" else {})
        trainer = trainer_for(mlp(), tmp_path / mode, precision=precision, max_steps=3, clip_grad_norm=0.05)
        trainer.fit()
        results[mode] = list(trainer.engine.master_params(trainer.optimizer))
    for a, b in zip(results["O2"], results["O0"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
