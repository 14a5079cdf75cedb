"""``inspect``, ``export`` and ``init_from`` of a run dir whose run is saving a checkpoint every step
and pruning all but the newest at that moment answer from the newest checkpoint that verifies: a
checkpoint removed while it is read is passed over for the one that replaced it, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ampddp.checkpoint.restore import initial_weights
from ampddp.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_readers_of_a_run_that_prunes_every_step_always_answer(tmp_path, capsys):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "ampddp", "train", str(REPO / "recipes" / "quickstart.yaml"), f"trainer.run_dir={run_dir}",
               "model.name=mlp", "data.image_size=8", "trainer.max_steps=100000", "trainer.max_epochs=10000",
               "checkpoint.every_steps=1", "checkpoint.keep_last=1", "trainer.progress=off", "optimizer.scheduler=none"]  # fmt: skip
    training = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((run_dir / "checkpoints").glob("*/COMPLETE")):
            assert training.poll() is None and time.monotonic() < deadline, "the run never saved a checkpoint"
            time.sleep(0.05)
        steps = []
        for _ in range(12):
            assert main(["inspect", str(run_dir), "--json"]) == 0, capsys.readouterr().err
            steps.append(json.loads(capsys.readouterr().out)["step"])
            assert main(["export", str(run_dir), "--to", str(tmp_path / "model.safetensors"), "--force"]) == 0, capsys.readouterr().err
            assert initial_weights(run_dir)  # a run dir as init_from: its newest checkpoint's weights
            assert "Traceback" not in capsys.readouterr().err
        assert training.poll() is None, "the run stopped while being read"
        assert steps == sorted(steps) and steps[-1] > steps[0], f"readers did not follow the live run: {steps}"
    finally:
        training.terminate()
        training.wait(timeout=120)
