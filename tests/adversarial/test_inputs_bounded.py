"""Every input bounded before use (issue #47): what became a traceback at step 1, or silently changed,
is refused in one line naming it and what is valid, before anything is written. Override values keep
their text; numbers stop where torch or the OS overflow; names stop at the file system's NAME_MAX and
PATH_MAX, and a temporary name is never longer than its target's; ``prepare`` and the Trainer check
their arguments' types at the door; a loss scale past its scaler's max is refused and changes nothing."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from resume_helpers import make_trainer
from torch import nn

from ampddp import amp
from ampddp.checkpoint.restore import precision_conversion
from ampddp.cli import EXIT_USAGE, main
from ampddp.distributed.env import DistEnv
from ampddp.errors import ArgumentTypeError, CheckpointError, ConfigError
from ampddp.observe.plots import plot_comparison
from ampddp.precision import build_engine
from ampddp.precision.scaler import LossScaler
from ampddp.prepare import prepare
from ampddp.recipe.reading import load_config, parse_overrides
from ampddp.rundir.paths import name_limits
from ampddp.trainer import Trainer

QUICKSTART = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")
HUGE = "1" + "0" * 30


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *arguments: str) -> str:
    """The one line ``ampddp train`` refuses the quickstart with ``arguments`` in, nothing written."""
    before = sorted(tmp_path.iterdir())
    assert main(["train", QUICKSTART, f"trainer.run_dir={tmp_path / 'run'}", *arguments]) == EXIT_USAGE
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and "Traceback" not in said[0], said
    assert sorted(tmp_path.iterdir()) == before, "a refused run writes nothing"
    return said[0]


def test_an_override_keeps_its_text_where_yaml_would_read_a_comment_or_a_date(tmp_path, capsys):
    assert load_config(None, [f"trainer.run_dir={tmp_path}/exp #3"]).trainer.run_dir == f"{tmp_path}/exp #3"  # was .../exp
    assert parse_overrides(["a.b='exp #3'", "a.c=[x, 'y #']", "a.d=#3", "a.e=2024-05-01", "a.f=2024-13-45"]) == {
        "a": {"b": "exp #3", "c": ["x", "y #"], "d": "#3", "e": "2024-05-01", "f": "2024-13-45"}  # the last: a ValueError
    }
    said = refused(tmp_path, capsys, "data.batch_size=1" + "0" * 5000)  # past Python's 4300 digits: a ValueError
    assert said.startswith("ampddp train: error: override 'data.batch_size=1000") and "Exceeds the limit (4300 digits)" in said


OUT = "is out of range; it must be"
COUNT = "an integer in [1, 9223372036854775807]"
"""An integer key's range once its value passes int64's."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optimizer.lr=1e308"], f"optimizer.lr=1e+308 {OUT} a finite number in [0, 3.40282e+38]"),
        (["optimizer.weight_decay=1e308"], f"optimizer.weight_decay=1e+308 {OUT} a finite number in [0, 3.40282e+38]"),
        ([f"data.batch_size={HUGE}"], f"data.batch_size={HUGE} {OUT} {COUNT}"),
        ([f"model.num_classes={HUGE}"], f"model.num_classes={HUGE} {OUT} {COUNT}"),
        ([f"data.image_size={HUGE}"], f"data.image_size={HUGE} {OUT} {COUNT}"),
        ([f"data.num_workers={HUGE}"], f"data.num_workers={HUGE} {OUT} an integer in [0, 1024]"),
        (["data.num_workers=1", f"data.prefetch_factor={HUGE}"], f"data.prefetch_factor={HUGE} {OUT} an integer in [1, 1024]"),
        (["precision.mode=O2", "precision.loss_scale=1e300"], f"precision.loss_scale=1e+300 {OUT} a finite number in (0, 3.40282e+38]"),
        (["distributed.timeout_s=1e10"], f"distributed.timeout_s=10000000000.0 {OUT} a finite number in (0, 1000000000]"),
        (["optimizer.lr=1" + "0" * 400], f"optimizer.lr=10000000000000000000... (401 characters) {OUT}"),
        (["precision.mode=O3", "optimizer.lr=100000"], f"optimizer.lr=100000.0 {OUT} a finite number in [-65504, 65504] (O3 steps float16"),
        (["optimizer.name=adam", "optimizer.kwargs={eps: 1e300}"], f"optimizer.kwargs.eps=1e+300 {OUT} a finite number in [-3.40282e+38"),
        (["optimizer.scheduler=step", "optimizer.step_size=1", "trainer.max_epochs=3", "optimizer.gamma=1e30"],
         "optimizer.gamma=1e+30 multiplies optimizer.lr=0.05 2 times over trainer.max_epochs=3 (optimizer.step_size=1), past float32's"),
    ],
)  # fmt: skip
def test_a_number_past_what_torch_takes_is_refused_in_one_line_before_anything_is_written(tmp_path, capsys, overrides, message):
    assert message in refused(tmp_path, capsys, *overrides)


@pytest.mark.timeout(60)
def test_a_name_past_the_file_systems_limits_is_refused_before_anything_is_written(tmp_path, capsys):
    name_max, path_max = name_limits(tmp_path)
    long = tmp_path / ("n" * (name_max + 1))
    for overrides in ([f"checkpoint.resume_from={long}"], [f"checkpoint.init_from={long}"], ["data.name=cifar10", f"data.root={long}"]):
        said = refused(tmp_path, capsys, *overrides)
        assert f"is {name_max + 1} bytes; the file system takes names of at most {name_max} bytes" in said, said
    assert main(["train", QUICKSTART, f"trainer.run_dir={long}"]) == EXIT_USAGE  # was OSError: [Errno 36] File name too long
    assert "trainer.run_dir=" in capsys.readouterr().err and not any(tmp_path.iterdir())
    deep = tmp_path / ("d/" * (path_max // 2))
    assert main(["train", QUICKSTART, f"trainer.run_dir={deep}", "observe.loggers=[csv]"]) == EXIT_USAGE
    assert f"bytes as an absolute path; at most {path_max - 257} here" in capsys.readouterr().err and not any(tmp_path.iterdir())
    assert main(["inspect", str(long)]) == EXIT_USAGE and "checkpoint path=" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--to='.*': the name '.*' is \d+ bytes"):
        plot_comparison([tmp_path], tmp_path / ("p" * name_max + ".png"))


@pytest.mark.timeout(60)
def test_export_writes_a_name_of_name_max_bytes_and_refuses_a_longer_one(tmp_path, capsys):
    make_trainer(tmp_path / "run", "O0", max_steps=1).fit()
    name_max, _ = name_limits(tmp_path)
    out = tmp_path / "out" / ("m" * (name_max - len(".safetensors")) + ".safetensors")
    out.parent.mkdir()
    assert main(["export", str(tmp_path / "run"), "--to", str(out)]) == 0, capsys.readouterr().err  # was "File name too long", exit 5
    assert [path.name for path in out.parent.iterdir()] == [out.name], "no temporary is left beside it"
    longer = out.with_name("m" + out.name)
    assert main(["export", str(tmp_path / "run"), "--to", str(longer)]) == EXIT_USAGE
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and f"is {name_max + 1} bytes; the file system takes names of at most {name_max} bytes" in said[0]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


PREPARE_BAD = {"model": "m", "make_optimizer": "sgd", "env": "env", "precision": 3, "parallel": "ddp"}
TRAINER_BAD = {
    "model": "m", "make_optimizer": 3, "train_set": "data", "eval_set": 5, "env": "cpu", "precision": 3, "parallel": "ddp",
    "compile": 3, "make_scheduler": "cosine", "loss_fn": "ce", "metrics": "acc", "batches": "x", "loading": {"num_workers": 2},
    "device": "cpu", "checkpoints": "x", "run_dir": 3, "report": "x", "callbacks": 3, "stop_signals": "SIGTERM", "loop": {},
}  # fmt: skip
"""A value of a wrong type for every named argument of each door (most were AttributeErrors or TypeErrors deep inside)."""


def named_arguments(function) -> set[str]:
    return {name for name, p in inspect.signature(function).parameters.items() if name != "self" and p.kind is not p.VAR_KEYWORD}


def test_the_tables_name_every_argument_of_both_doors():
    assert named_arguments(prepare) == set(PREPARE_BAD)
    assert named_arguments(Trainer.__init__) == set(TRAINER_BAD)


def door_refusal(door, arguments: dict, name: str) -> str:
    with pytest.raises(ArgumentTypeError) as raised:
        door(**arguments)
    message = str(raised.value)
    assert isinstance(raised.value, ConfigError) and isinstance(raised.value, TypeError)
    assert "\n" not in message and f"{name}=" in message and f"({type(arguments[name]).__name__}) is not valid; valid: " in message
    return message


@pytest.mark.parametrize("name", sorted(PREPARE_BAD))
def test_prepare_checks_each_argument_at_the_door(name):
    arguments = {"model": nn.Linear(4, 2), "make_optimizer": sgd, "env": DistEnv(), "precision": "O0", "parallel": None}
    assert door_refusal(prepare, {**arguments, name: PREPARE_BAD[name]}, name).startswith(f"prepare: {name}=")


@pytest.mark.parametrize("name", sorted(TRAINER_BAD))
def test_the_trainer_checks_each_argument_at_the_door(name):
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    arguments = {"model": nn.Linear(4, 2), "make_optimizer": sgd, "train_set": data, "report": None, name: TRAINER_BAD[name]}
    assert door_refusal(Trainer, arguments, name).startswith(f"Trainer: {name}=")


def test_a_loss_scale_past_the_scalers_max_is_refused_and_changes_nothing():
    facade = amp.Amp()
    model = nn.Linear(4, 2)
    facade.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)
    before = facade.state_dict()
    for scale in (1e300, 2.0**24 * 2):  # 1e300 was taken, and O2 then skipped every step
        with pytest.raises(ConfigError, match=r"amp state: loss_scaler0: loss scale .* is out of range; .* \(0, 16777216\], "):
            facade.load_state_dict({"loss_scaler0": {"loss_scale": scale, "unskipped": 0}})
        assert facade.state_dict() == before
    facade.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**24, "unskipped": 3}})  # the max itself is valid
    assert facade.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**24, "unskipped": 3}}

    scaler = LossScaler(dynamic=True, init_scale=2.0**16)
    with pytest.raises(ConfigError, match=r"loss scale 1e\+300 is out of range; it must be a finite number in \(0, 16777216\]"):
        scaler.load_state_dict({"loss_scale": 1e300, "unskipped": 0})
    assert scaler.loss_scale == 2.0**16


@pytest.mark.parametrize(("mode", "scale", "ceiling"), [("O2", 1e300, "16777216"), ("native-fp16", 1e39, "3.402823466e+38")])
def test_a_checkpoints_loss_scale_past_the_max_is_refused_before_the_resume_changes_anything(mode, scale, ceiling):
    engine = build_engine(mode)
    saved = {"mode": mode, "scalers": [{"dynamic": True, "loss_scale": scale, "unskipped": 0}], "skipped_steps": 0}
    before = engine.state_dict()
    refusal = rf"^run/shared.pt: loss_scaler0: .* in \(0, {re.escape(ceiling)}\], the most this {mode} scaler holds"
    with pytest.raises(CheckpointError, match=refusal):
        precision_conversion(engine, saved, "run/shared.pt")
    assert engine.state_dict() == before


def test_a_checkpoints_scale_above_a_lowered_max_loss_scale_starts_at_the_new_max_with_a_warning():
    from ampddp import Precision

    engine = Precision("O2", overrides={"max_loss_scale": 1024.0}).build_engine()
    saved = {"mode": "O2", "scalers": [{"dynamic": True, "loss_scale": 2.0**20, "unskipped": 7}], "skipped_steps": 3}
    conversion = precision_conversion(engine, saved, "run/shared.pt")
    assert conversion.state.scalers[0].loss_scale == 1024.0 and conversion.state.scalers[0].unskipped == 7
    assert "saved loss scale above this O2 run's max_loss_scale, so it starts there: loss_scaler0 1.04858e+06 -> 1024" in conversion.warning
