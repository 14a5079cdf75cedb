"""Hugging Face transformers 4.x's ``Trainer(fp16=True, half_precision_backend="apex")``, unedited,
under ``python -m ampddp.apex`` (``tests/transformers_apex_job.py``): transformers asks whether apex is
*installed* before anything else, then drives ``amp.initialize``, ``scale_loss`` (under DDP's
``no_sync`` while it accumulates), ``clip_grad_norm_(amp.master_params(...))``, FusedAdam and T5's
FusedRMSNorm. transformers 5 removed the backend: these tests need a 4.x release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="transformers 4.x is an optional test dependency (pip install -e '.[test]')")
if int(transformers.__version__.split(".")[0]) >= 5:
    pytest.skip(f"transformers {transformers.__version__} removed the apex backend (4.x has it)", allow_module_level=True)

JOB = Path(__file__).resolve().parents[1] / "transformers_apex_job.py"
REPO = Path(__file__).resolve().parents[2]


def train(tmp_path, name, *args, nproc=1):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    command = [sys.executable, *launcher, "-m", "ampddp.apex", str(JOB), *args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.timeout(260)
def test_without_the_runner_the_trainer_refuses_the_apex_backend(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    code = "from transformers import TrainingArguments; TrainingArguments('o', fp16=True, half_precision_backend='apex', use_cpu=True)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=200, env=env)
    assert done.returncode != 0 and "APEX is not installed" in done.stderr


@pytest.mark.timeout(400)
def test_o1_trains_evaluates_predicts_and_saves_fp32_weights(tmp_path):
    (report,) = train(tmp_path, "o1", "gpt2", "--opt-level", "O1")
    assert report["apex"] == "ampddp.apex" and report["global_step"] == 8
    losses = report["losses"]
    assert len(losses) == 8 and all(loss == loss for loss in losses) and losses[-1] < losses[0] - 0.2
    assert report["eval_loss"] < losses[0] and report["predictions_shape"] == [8, 16, 64]
    assert report["model_dtypes"] == ["torch.float32"] and report["saved_dtypes"] == ["torch.float32"]


@pytest.mark.timeout(600)
def test_o2_saves_the_fp32_masters_and_resumes_from_its_checkpoint_folder_exactly(tmp_path):
    (straight,) = train(tmp_path, "straight", "gpt2", "--opt-level", "O2")
    assert straight["model_dtypes"] == ["torch.float16"] and straight["saved_dtypes"] == ["torch.float32"]
    assert straight["saved_equal_masters"] and straight["saved_finer_than_model"]  # not the fp16 weights upcast
    train(tmp_path, "resumed", "gpt2", "--opt-level", "O2", "--stop-at", "4")
    (resumed,) = train(tmp_path, "resumed", "gpt2", "--opt-level", "O2", "--stop-at", "4", "--resume")
    assert resumed["logged_steps"] == list(range(1, 9)) and resumed["global_step"] == 8
    assert resumed["losses"] == straight["losses"] and resumed["params"] == straight["params"]
    # the Trainer saves no amp state, but the optimizer's state_dict carries it: the scale came back
    assert resumed["loss_scale"] == straight["loss_scale"] == 1024.0


@pytest.mark.timeout(600)
def test_torchrun_two_processes_with_apex_fused_adam_accumulate_and_stay_identical(tmp_path):
    first, second = train(tmp_path, "ddp", "gpt2", "--opt-level", "O2", "--optim", "adamw_apex_fused", nproc=2)
    assert first["optimizer"] == "ampddp.apex.optimizers.fused_adam"
    assert first["params"] == second["params"]  # gradient accumulation under no_sync reduced every micro-batch
    assert first["losses"][-1] < first["losses"][0] - 0.2


@pytest.mark.timeout(400)
def test_t5_takes_apex_fused_rms_norm_for_its_layer_norms(tmp_path):
    (report,) = train(tmp_path, "t5", "t5", "--opt-level", "O1")
    assert report["norm_classes"] == ["ampddp.apex.normalization.fused_layer_norm.FusedRMSNorm"]
    assert report["losses"][-1] < report["losses"][0] and report["saved_dtypes"] == ["torch.float32"]
