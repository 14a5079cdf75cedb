"""metrics.jsonl and summary.json stay strict JSON when a number is not finite (issue #47): a NaN
evaluation loss is written as null and named in the record's ``nonfinite`` field, warned once, and
read back as NaN by every reader (``read_metrics``, ``ampddp plot``, the summary's readers), which
still read the bare ``NaN`` older runs wrote."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampddp import Reporting, Trainer
from ampddp.cli import main
from ampddp.observe import read_metrics
from ampddp.rundir import strict_json
from ampddp.rundir.files import METRICS_FILE, SUMMARY_FILE, read_summary


def strict(text: str) -> object:
    """``text`` read as JSON by a reader that refuses NaN and Infinity, as jq and JavaScript do."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


class NanWhenEvaluated(nn.Module):
    """Trains normally; its evaluation outputs are NaN (a model whose eval-mode path diverged)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        outputs = self.linear(inputs)
        return outputs if self.training else outputs * math.nan


@pytest.mark.timeout(60)
def test_a_nan_evaluation_loss_is_written_as_strict_json_warned_once_and_read_back(tmp_path, caplog, capsys):
    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    trainer = Trainer(NanWhenEvaluated(), lambda params: torch.optim.SGD(params, lr=0.1), data, eval_set=data, precision="O0",
                      batch_size=8, max_epochs=2, run_dir=tmp_path, report=Reporting(progress="off", plots=False))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ampddp.observe"):
        trainer.fit()
    warned = [record.getMessage() for record in caplog.records if "evaluation at step" in record.getMessage()]
    assert len(warned) == 1 and "loss nan" in warned[0], warned  # two evaluations, one warning

    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    records = [strict(line) for line in lines]  # every line: a strict reader raised on today's bare NaN
    evals = [record for record in records if record["kind"] == "eval"]
    assert len(evals) == 2 and all(record["loss"] is None and record["nonfinite"] == {"loss": "nan"} for record in evals)
    summary = strict((tmp_path / SUMMARY_FILE).read_text())
    assert summary["final_eval_loss"] is None and summary["nonfinite"] == {"final_eval_loss": "nan"}

    assert all(math.isnan(record["loss"]) for record in read_metrics(tmp_path) if record["kind"] == "eval")
    assert math.isnan(read_summary(tmp_path)["final_eval_loss"]) and "nonfinite" not in read_summary(tmp_path)
    assert main(["plot", str(tmp_path)]) == 0  # the plot command reads the new form
    assert "loss.png" in capsys.readouterr().out and (tmp_path / "loss.png").is_file()


def test_nested_and_infinite_numbers_round_trip_and_bare_nan_of_older_files_still_reads(tmp_path):
    record = {"kind": "fp8_layers", "step": 3, "layers": [{"amax": math.inf}, {"amax": -math.inf}], "loss": math.nan, "lr": 0.1}
    text = strict_json.dumps(record)
    assert strict(text)["nonfinite"] == {"layers.0.amax": "inf", "layers.1.amax": "-inf", "loss": "nan"}
    back = strict_json.loads(text)
    assert back["layers"] == [{"amax": math.inf}, {"amax": -math.inf}] and math.isnan(back["loss"]) and back["lr"] == 0.1
    assert strict_json.loads('{"a": 1, "nonfinite": {"a": "nan", "gone.9": "inf", "b": "huge"}}') == {"a": 1}, "a flag naming no null"

    (tmp_path / METRICS_FILE).write_text('{"kind": "eval", "step": 1, "epoch": 0, "loss": NaN}\n')
    (tmp_path / SUMMARY_FILE).write_text('{"steps": 1, "final_eval_loss": NaN}')
    assert math.isnan(read_metrics(tmp_path)[0]["loss"]) and math.isnan(read_summary(tmp_path)["final_eval_loss"])
