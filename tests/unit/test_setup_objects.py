"""``Precision`` and ``Parallel``: the set-up choices as two objects, checked when made, and the
Trainer's former loose arguments refused with where each went."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from ampddp import ConfigError, Parallel, Precision
from ampddp.distributed import DDPOptions
from ampddp.distributed.env import DistEnv
from ampddp.prepare import prepare
from ampddp.trainer import Trainer


def test_a_mode_name_stands_for_that_mode_with_its_defaults():
    assert Precision.of("O2") == Precision("O2")
    chosen = Precision("O1", overrides={"loss_scale": 128.0})
    assert Precision.of(chosen) is chosen
    assert chosen.build_engine().loss_scale() == 128.0
    with pytest.raises(ConfigError, match="precision=3 is not valid; give a mode's name"):
        Precision.of(3)
    with pytest.raises(ConfigError, match=r"overrides=.* it must be a mapping"):
        Precision("O1", overrides=[("loss_scale", 1.0)])


def test_the_overrides_are_copied_so_the_choice_cannot_change_under_a_run():
    settings = {"loss_scale": 8.0}
    chosen = Precision("O2", overrides=settings)
    settings["loss_scale"] = 16.0
    assert chosen.overrides == {"loss_scale": 8.0}


def test_parallel_is_checked_when_made():
    with pytest.raises(ConfigError, match=r"strategy=.fsdp. is not valid.*fsdp2.*; valid choices: ddp, apex-ddp, fsdp2, hsdp, dp, none"):
        Parallel("fsdp")
    with pytest.raises(ConfigError, match=r"sync_bn='on' is not valid"):
        Parallel(sync_bn="on")
    with pytest.raises(ConfigError, match=r"static_graph=True: torch DDP settings, but strategy=dp"):
        Parallel("dp", ddp=DDPOptions(static_graph=True))


def test_prepare_takes_the_objects():
    run = prepare(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), lambda p: torch.optim.SGD(p, lr=0.1), DistEnv(),
                  precision=Precision("O2", overrides={"loss_scale": 4.0}), parallel=Parallel("none", sync_bn="portable"))  # fmt: skip
    assert run.engine.loss_scale() == 4.0
    assert type(run.module[1]).__name__ == "PortableSyncBatchNorm"
    assert run.module[0].weight.dtype == torch.float16


def test_prepare_and_the_trainer_take_a_ready_engine_and_use_that_one(tmp_path):
    """An engine of the caller's own making is the one the run steps with, not a second build."""
    from ampddp import CheckpointSettings, build_engine

    engine = build_engine("O1", loss_scale=32.0)
    run = prepare(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), DistEnv(), precision=engine, parallel=Parallel("none"))
    assert run.engine is engine and engine.loss_scale() == 32.0
    assert run.strategy.name == "none" and run.strategy.checkpoint_layout == "whole"

    mine = build_engine("O2", loss_scale=16.0)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    trainer = Trainer(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), data, precision=mine, parallel=Parallel("none"),
                      batch_size=4, max_steps=2, checkpoints=CheckpointSettings(tmp_path), report=None)  # fmt: skip
    trainer.fit()
    assert trainer.engine is mine and trainer.progress.global_step == 2
    assert trainer.run.module.weight.dtype == torch.float16, "the given engine's O2 cast the model"


def test_the_library_is_one_import_away():
    """``from ampddp import ...`` gives the doors and their parts; ``prepare`` from the package trains
    exactly as ``ampddp.prepare.prepare`` does."""
    import ampddp
    from ampddp import CheckpointSettings, LoopSettings, Reporting
    from ampddp import Trainer as PackageTrainer
    from ampddp import prepare as package_prepare
    from ampddp.observe.observer import Reporting as reporting_home
    from ampddp.training.checkpoint_settings import CheckpointSettings as settings_home
    from ampddp.training.settings import LoopSettings as loop_home

    assert (PackageTrainer, CheckpointSettings, LoopSettings, Reporting) == (Trainer, settings_home, loop_home, reporting_home)
    assert ampddp.prepare is package_prepare
    results = []
    for door in (package_prepare, prepare):
        torch.manual_seed(0)
        run = door(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), DistEnv(), precision="O0", parallel=Parallel("none"))
        results.append(run.module.weight.detach().clone())
    assert torch.equal(*results)


@pytest.mark.parametrize(
    ("argument", "where"),
    [
        ("precision_overrides", "precision=Precision(mode, overrides={...})"),
        ("sync_bn", "parallel=Parallel(sync_bn=...)"),
        ("keep_last", "checkpoints=CheckpointSettings(keep_last=...)"),
        ("resume", "checkpoints=CheckpointSettings(resume=...)"),
        ("observer", "report=Reporting(progress=..., loggers=[...])"),
    ],
)
def test_the_trainers_former_arguments_say_where_they_went(argument, where):
    dataset = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    expected = f"Trainer no longer takes {argument}: each is now part of an object ({argument} -> {where})"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        Trainer(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), dataset, **{argument: {"loss_scale": 1.0}})


def test_the_run_dir_is_given_once_as_a_path_or_a_run_dir_value(tmp_path):
    from ampddp import CheckpointSettings
    from ampddp.rundir.run_dir import RunDir

    dataset = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))

    def trainer(**kwargs):
        return Trainer(nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), dataset, precision="O0", batch_size=4, max_steps=1,
                       report=None, **kwargs)  # fmt: skip

    place = RunDir(tmp_path / "a")
    assert trainer(run_dir=place).checkpointer.store.run_dir is place  # a RunDir made elsewhere is shared, not copied
    older = trainer(checkpoints=CheckpointSettings(tmp_path / "b")).checkpointer.store  # the older spelling
    assert older.root == tmp_path / "b" / "checkpoints"
    assert trainer(run_dir=tmp_path / "c", checkpoints=CheckpointSettings(tmp_path / "c", keep_last=1)).checkpointer.store.keep_last == 1
    with pytest.raises(ConfigError, match=r"name two run dirs; give it once, as Trainer\(run_dir=...\)"):
        trainer(run_dir=tmp_path / "c", checkpoints=CheckpointSettings(tmp_path / "d"))
    with pytest.raises(ConfigError, match=r"Trainer: run_dir=3 \(int\) is not valid; valid: a path, a RunDir or None"):
        trainer(run_dir=3)
    assert trainer().checkpointer.store is None and not any(tmp_path.iterdir())
