"""data.decode_device=cuda: JPEGs decoded by nvjpeg on the GPU and transformed there, like the CPU pipeline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from image_folders import make_image_folder

from ampddp.zoo.data import imagefolder

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_decoding_gives_the_cpu_pipelines_images_on_the_gpu(tmp_path):
    folder = make_image_folder(tmp_path)
    cpu_train, cpu_val = imagefolder(str(folder), image_size=32, augment=True)
    gpu_train, gpu_val = imagefolder(str(folder), image_size=32, augment=True, decode_device="cuda")
    image, label = gpu_val[0]
    assert image.device.type == "cuda" and image.shape == (3, 32, 32) and label == cpu_val[0][1]
    # nvjpeg and libjpeg round differently by a few levels; the crop and flip are the same draws
    torch.testing.assert_close(image.cpu(), cpu_val[0][0], atol=0.15, rtol=0)
    torch.manual_seed(3)
    on_gpu = gpu_train[5][0]
    torch.manual_seed(3)
    torch.testing.assert_close(on_gpu.cpu(), cpu_train[5][0], atol=0.15, rtol=0)


@pytest.mark.timeout(360)
def test_a_run_decodes_on_the_gpu(tmp_path):
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "ampddp", "train", "recipes/quickstart.yaml", f"trainer.run_dir={run_dir}",
        "data.name=imagefolder", f"data.root={make_image_folder(tmp_path / 'images')}", "data.image_size=32", "data.channels=3",
        "data.batch_size=8", "data.decode_device=cuda", "model.name=small_cnn", "precision.mode=O1", "trainer.max_steps=2",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
