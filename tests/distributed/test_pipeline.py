"""Pipeline parallelism as the Trainer runs it (``Parallel("none", pp=PPOptions(...))``): ampddp's GPT cut into two
stages on two real gloo processes, torch's schedules running each micro-batch's forward and backward; every mode's
losses against the unsplit model's, an inf planted in stage 0's gradients skipped by both stages with both scales
halved (torch's GradScaler per stage let stage 0 step while stage 1 skipped), and checkpoints that read as the whole
model's: a pipeline's resumes on one process, a one-process run's under the pipeline, and exports whole."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import HAS_TORCHAO, O6_SMALL_MODEL
from resume_helpers import final_state
from safetensors.torch import load_file
from torch.utils.data import Subset

from ampddp import Parallel, Precision
from ampddp.checkpoint.export import export_weights
from ampddp.checkpoint.inspect import format_summary, summarize
from ampddp.distributed import launch_local
from ampddp.distributed.pipeline import PPOptions
from ampddp.trainer import Trainer
from ampddp.training import CheckpointSettings
from ampddp.training.batches import cross_entropy, logits_of
from ampddp.training.callbacks import Callback
from ampddp.zoo.models import GPT
from ampddp.zoo.text import python_docs

pytestmark = pytest.mark.timeout(420)
STEPS = 4
TOLERANCE = {"O0": 1e-5, "O1": 1e-3, "O2": 1e-3, "O3": 1e-3, "native-fp16": 1e-3}
"""Relative distance of each step's loss from the unsplit model's in the same mode (bf16 modes, O6: 1e-2, the default):
a pipeline computes the same products in the same order, micro-batch by micro-batch; fp16/bf16 activations cross the
stage boundary as they would cross a block, so what differs is the summation order of the micro-batches' gradients."""
LOSS_SCALED = ("O1", "O2", "native-fp16")


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(256, layers=4, width=32, heads=2, context=16)


def adamw(params) -> torch.optim.Optimizer:
    """AdamW with an epsilon fp16 holds (O3 steps fp16 weights)."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-4)


def logits_loss(outputs, batch) -> torch.Tensor:
    """Cross-entropy of the logits in fp32, split or not (the GPT's own loss, unsplit, is computed in the logits' dtype)."""
    return cross_entropy(logits_of(outputs), batch)


class Records(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, object]] = []

    def on_step(self, progress, record) -> None:
        if record is not None:
            self.steps.append({"loss": record["loss"], "scale": record["loss_scale"], "skipped": record["skipped"]})


def trainer(run_dir: Path, env, mode: str, pp: PPOptions | None, steps: int = STEPS, records: Records | None = None) -> Trainer:
    """Batches of 8 cut into 4 micro-batches by the pipeline; without one, the same 8 samples as 4 accumulated batches of
    2 (the same gradients in the same precision: fp16 overflows per micro-batch as the pipeline's do)."""
    train, _ = python_docs(sequence_length=16, eval_fraction=0.05)
    precision = Precision(mode, overrides=O6_SMALL_MODEL) if mode == "O6" else mode
    return Trainer(
        build, adamw, Subset(train, range(96)), precision=precision, batch_size=8 if pp else 2, grad_accum_steps=1 if pp else 4,
        seed=5, env=env, max_steps=steps,
        parallel=Parallel("none", pp=pp) if pp is not None else Parallel("none"), log_every=1, report=None,
        checkpoints=CheckpointSettings(run_dir, keep_last=None), checkpoint_every=2, callbacks=[records] if records else [],
        loss_fn=logits_loss,
    )  # fmt: skip


def plant_inf_at_last_step(trainer_: Trainer, micro_batches: int) -> None:
    """An inf in one weight's gradient of stage 0 on the last step's first micro-batch (this rank's stage only)."""
    weight = trainer_.run.module.blocks["0"].mlp[0].weight
    calls = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.full_like(grad, math.inf) if calls[0] == (STEPS - 1) * micro_batches + 1 else grad

    weight.register_hook(poison)


def train_worker(env, root: str, runs: list[tuple[str, str]]) -> dict[str, list[dict[str, object]]]:
    torch.set_num_threads(1)
    found = {}
    for mode, schedule in runs:
        records = Records()
        pp = PPOptions(2, schedule=schedule, microbatches=4)
        run = trainer(Path(root) / f"{mode}-{schedule}", env, mode, pp, records=records)
        if mode in LOSS_SCALED and env.rank == 0:
            plant_inf_at_last_step(run, pp.micro_batches)
        run.fit()
        found[f"{mode}/{schedule}"] = records.steps
    return found


def unsplit_losses(root: Path, mode: str) -> list[float]:
    records = Records()
    trainer(root / f"unsplit-{mode}", None, mode, None, records=records).fit()
    return [step["loss"] for step in records.steps]


def test_every_mode_trains_through_the_pipeline_like_the_unsplit_model(tmp_path):
    modes = ("O0", "O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16", *(("O6",) if HAS_TORCHAO else ()))
    runs = [(mode, "1F1B") for mode in modes] + [("O0", "GPipe"), ("O2", "GPipe")]
    results = launch_local(train_worker, 2, (str(tmp_path), runs), device="cpu", timeout_s=60, job_timeout_s=400)
    assert results[0] == results[1]  # both stages log the same records: the last stage's loss, one agreed verdict
    unsplit = {mode: unsplit_losses(tmp_path, mode) for mode in modes}
    for name, steps in results[0].items():
        mode = name.split("/")[0]
        losses = [step["loss"] for step in steps]
        assert losses == pytest.approx(unsplit[mode], rel=TOLERANCE.get(mode, 1e-2)), name
        if mode in LOSS_SCALED:  # the planted inf on stage 0 alone: the last step skipped by both, both scales halved
            assert [step["skipped"] for step in steps] == [False] * (STEPS - 1) + [True], name
            assert steps[-1]["scale"] == steps[-2]["scale"] / 2, name
        else:
            assert not any(step["skipped"] for step in steps), name
