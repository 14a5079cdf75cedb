"""What a run prints: one line per set-up (every setting only with --verbose), and a run that raises
releases what its reporting opened (the loggers are told it failed)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from resume_helpers import NoisyDigits, make_model

from ampddp.cli import main
from ampddp.observe import Reporting
from ampddp.observe.loggers import MetricLogger
from ampddp.trainer import Trainer
from ampddp.training import Callback, CheckpointSettings

QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml"
SHORT = ["trainer.max_steps=1", "data.batch_size=8", "data.eval_fraction=0.05", "trainer.progress=off", "model.name=mlp",
         "precision.mode=O1"]  # fmt: skip


@pytest.mark.parametrize("verbose", [False, True])
def test_a_set_up_prints_one_line_and_every_setting_only_when_verbose(tmp_path, caplog, monkeypatch, verbose):
    monkeypatch.setenv("AMPDDP_LOG_LEVEL", "")  # --verbose sets it for the ranks it starts: monkeypatch undoes it after the test
    caplog.set_level(logging.INFO)  # the root's level, as the command sets it
    caplog.handler.setLevel(logging.DEBUG)  # and a handler that would print debug records, were any made
    assert main(["train", str(QUICKSTART), f"trainer.run_dir={tmp_path}", *SHORT, *(["--verbose"] if verbose else [])]) == 0
    printed = "\n".join(record.getMessage() for record in caplog.records)
    assert "precision O1: float16 ops per apex's lists, fp32 weights, dynamic loss scale from 65536" in printed
    assert ("precision O1 settings: {'opt_level': 'O1'" in printed) is verbose
    assert logging.getLogger("ampddp").level == logging.NOTSET, "the run's log level ends with it"


class Recording(MetricLogger):
    name = "recording"

    def __init__(self) -> None:
        self.closed: list[bool] = []

    def log(self, kind, values, step) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        self.closed.append(failed)


class Fails(Callback):
    def on_step(self, progress, record) -> None:
        raise RuntimeError("a user's callback failed")


def test_a_run_that_raises_tells_its_loggers_and_leaves_no_progress_bar_or_log_redirect_behind(tmp_path):
    handlers = list(logging.getLogger().handlers)
    sink = Recording()
    trainer = Trainer(make_model(), lambda p: torch.optim.SGD(p, lr=0.05), NoisyDigits(16), precision="O0", batch_size=8,
                      max_steps=2, checkpoints=CheckpointSettings(tmp_path), callbacks=[Fails()],
                      report=Reporting(progress="bar", loggers=(sink,)))  # fmt: skip
    with pytest.raises(RuntimeError, match="a user's callback failed"):
        trainer.fit()
    assert sink.closed == [True]
    assert logging.getLogger().handlers == handlers
