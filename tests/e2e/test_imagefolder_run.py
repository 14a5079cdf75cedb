"""``ampddp train`` on an imagefolder of generated JPEGs: decoded and augmented in loader workers, trained, evaluated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from image_folders import make_image_folder

from ampddp.observe import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(360)
@pytest.mark.parametrize("workers", [0, 2])
def test_quickstart_trains_on_an_image_folder(tmp_path, workers):
    images = make_image_folder(tmp_path / "images")
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "ampddp", "train", "recipes/quickstart.yaml", f"trainer.run_dir={run_dir}",
        "data.name=imagefolder", f"data.root={images}", "data.image_size=32", "data.channels=3", "data.batch_size=8",
        "data.normalize=computed", "data.auto_augment=trivial", f"data.num_workers={workers}",
        "model.name=small_cnn", "precision.mode=O4", "trainer.max_steps=2", "trainer.log_every_steps=1", "trainer.progress=lines",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    records = read_metrics(run_dir)
    assert summary["steps"] == 2 and [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    evals = [r for r in records if r["kind"] == "eval"]
    assert evals and evals[-1]["samples"] == 3 * 2, "every validation image evaluated once"
