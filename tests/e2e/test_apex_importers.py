"""The apex call patterns of the libraries and NVIDIA examples that still import apex, unchanged
under ``python -m ampddp.apex`` (``tests/apex_importer_patterns.py`` holds one pattern per name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[1] / "apex_importer_patterns.py"
REPO = Path(__file__).resolve().parents[2]


def run_pattern(tmp_path, pattern, *extra, nproc=1, name="out"):
    out = tmp_path / name
    out.mkdir(exist_ok=True)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)] if nproc > 1 else []
    args = [sys.executable, *launcher, "-m", "ampddp.apex", str(JOB), pattern, "--out", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nproc)]


@pytest.mark.timeout(400)
def test_bert_pretraining_reduces_master_grads_itself_and_skips_through_update_scale(tmp_path):
    first, second = run_pattern(tmp_path, "bert-pretraining", nproc=2)
    assert first["params"] == second["params"]
    # BERT's initial 2**20 overflows fp16 twice; update_scale() halves it and the script skips those steps
    assert first["skipped"] == 2 and first["scales"] == [2.0**19, 2.0**18, 2.0**18, 2.0**18, 2.0**18, 2.0**18]
    assert first["dtypes"] == ["torch.float16"]


@pytest.mark.timeout(600)
def test_bert_pretraining_resumes_from_its_master_params_checkpoint_exactly(tmp_path):
    (straight, _) = run_pattern(tmp_path, "bert-pretraining", "--loss-scale", "1024", nproc=2, name="straight")
    run_pattern(tmp_path, "bert-pretraining", "--loss-scale", "1024", "--stop-at", "3", nproc=2, name="resumed")
    checkpoint = tmp_path / "resumed" / "ckpt.pt"
    (resumed, _) = run_pattern(tmp_path, "bert-pretraining", "--loss-scale", "1024", "--resume", str(checkpoint), nproc=2, name="resumed")
    assert resumed["losses"] == straight["losses"][3:]
    assert resumed["params"] == straight["params"]


@pytest.mark.timeout(400)
def test_bert_squad_with_apex_ddp_and_its_amp_c_clipper_keeps_ranks_identical(tmp_path):
    first, second = run_pattern(tmp_path, "bert-squad", nproc=2)
    assert first["params"] == second["params"]
    assert first["losses"][-1] < first["losses"][0]
    assert first["dtypes"] == ["torch.float16"]  # keep_batchnorm_fp32=False: BatchNorm is half too


@pytest.mark.timeout(300)
def test_gnmt_sets_its_own_scale_and_growth_interval_in_apex_scaler(tmp_path):
    (report,) = run_pattern(tmp_path, "gnmt")
    assert report["scales"] == [8192.0, 16384.0, 16384.0, 32768.0, 32768.0, 65536.0]  # doubles every 2 good steps
    assert report["lrs"] == [0.005]  # its scheduler, built before initialize, drives the amp optimizer


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pattern", ["ssd", "colossalai", "deepspeed", "opennmt"])
def test_single_process_patterns_train(tmp_path, pattern):
    (report,) = run_pattern(tmp_path, pattern)
    losses = report["losses"]
    assert len(losses) == 6 and all(loss == loss and loss < 10 for loss in losses)
    assert min(losses[3:]) < losses[0]
    expected = {"deepspeed": ["torch.float32"], "ssd": ["torch.float16", "torch.float32"]}.get(pattern, ["torch.float16"])
    assert report["dtypes"] == expected


@pytest.mark.timeout(300)
def test_fairseq_subclasses_apex_fused_adam_and_steps_through_its_kernel_handle(tmp_path):
    (report,) = run_pattern(tmp_path, "fairseq")
    assert report["max_diff_to_torch_adamw"] < 1e-5  # apex's kernel math: torch's AdamW
    for fused, plain in report["norms"]:
        assert fused == pytest.approx(plain, rel=1e-5)
    assert report["losses"][-1] < report["losses"][0] and report["dtypes"] == ["torch.float32"]
