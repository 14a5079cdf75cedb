"""Pipeline parallelism as the Trainer runs it (``Parallel("none", pp=PPOptions(...))``): ampddp's GPT cut into two
stages on two real gloo processes, torch's schedules running each micro-batch's forward and backward; every mode's
losses against the unsplit model's, an inf planted in stage 0's gradients skipped by both stages with both scales
halved (torch's GradScaler per stage let stage 0 step while stage 1 skipped), and checkpoints that read as the whole
model's: a pipeline's resumes on one process, a one-process run's under the pipeline, and exports whole."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from helpers import HAS_TORCHAO, O6_SMALL_MODEL
from resume_helpers import final_state
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import Subset

from ampddp import Parallel, Precision, prepare
from ampddp.checkpoint.export import export_weights
from ampddp.checkpoint.inspect import format_summary, summarize
from ampddp.distributed import launch_local
from ampddp.distributed.pipeline import PPOptions
from ampddp.distributed.tensor_parallel import TPOptions
from ampddp.errors import ConfigError
from ampddp.torch_compat import zbv_schedule_problem
from ampddp.trainer import Trainer
from ampddp.training import CheckpointSettings
from ampddp.training.batches import cross_entropy, logits_of
from ampddp.training.callbacks import Callback
from ampddp.training.compile_model import ModelCompiler
from ampddp.zoo.models import GPT
from ampddp.zoo.text import python_docs

pytestmark = pytest.mark.timeout(420)
STEPS = 4
TOLERANCE = {"O0": 1e-5, "O1": 1e-3, "O2": 1e-3, "O3": 5e-3, "native-fp16": 1e-3}
"""Relative distance of each step's loss from the unsplit model's in the same mode (bf16 modes, O6: 1e-2, the default):
a pipeline computes the same products in the same order, micro-batch by micro-batch; fp16/bf16 activations cross the
stage boundary as they would cross a block, so what differs is the summation order of the micro-batches' gradients.
O3 keeps no fp32 masters: each update rounds the weights to fp16 (1e-3 apart), and its fourth loss moved 3.6e-3 with
ATen's AVX2 kernels (an AVX2-only CPU's)."""
LOSS_SCALED = ("O1", "O2", "native-fp16")
ZBV = "ZBVZeroBubble" if zbv_schedule_problem() is None else "Interleaved1F1B"
"""The V-shaped zero-bubble schedule where this torch runs it (and compiled blocks under it: 2.14+), else a looped one
without a split backward (both refused below 2.14: tests/unit)."""


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
            self.steps.append(
                {"loss": record["loss"], "scale": record["loss_scale"], "skipped": record["skipped"], "grad_norm": record["grad_norm"]}
            )


def trainer(
    run_dir: Path,
    env,
    mode: str,
    pp: PPOptions | None,
    steps: int = STEPS,
    records: Records | None = None,
    batch_size: int | None = None,
    samples: int = 96,
    evaluated: bool = False,
    compiled: bool = False,
    parallel: Parallel | None = None,
) -> Trainer:
    """Batches of 8 cut into 4 micro-batches by the pipeline; without one, the same 8 samples as 4 accumulated batches of
    2 (the same gradients in the same precision: fp16 overflows per micro-batch as the pipeline's do)."""
    train, held_out = python_docs(sequence_length=16, eval_fraction=0.05)
    precision = Precision(mode, overrides=O6_SMALL_MODEL) if mode == "O6" else mode
    return Trainer(
        build, adamw, Subset(train, range(samples)), eval_set=Subset(held_out, range(10)) if evaluated else None,
        precision=precision, batch_size=batch_size or (8 if pp else 2), grad_accum_steps=1 if pp or batch_size else 4,
        seed=5, env=env, max_steps=steps, parallel=parallel or Parallel("none", pp=pp or PPOptions()), log_every=1, report=None,
        checkpoints=CheckpointSettings(run_dir, keep_last=None), checkpoint_every=2, callbacks=[records] if records else [],
        loss_fn=logits_loss, clip_grad_norm=0.5, compile=ModelCompiler(backend="aot_eager") if compiled else None,
    )  # fmt: skip


def plant_inf_at_last_step(trainer_: Trainer, micro_batches: int) -> None:
    """An inf in the gradient of stage 0's first MLP output on the last step's first micro-batch, on this rank only: its
    backward makes stage 0's gradients inf (reaching its data-parallel peers through FSDP2's reduction), never stage 1's.
    Planted on the activation, where every layout's backward passes (FSDP2 reduces its parameters' gradients outside
    autograd's hooks on them)."""
    calls = [0]

    def poison(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.full_like(grad, math.inf) if calls[0] == (STEPS - 1) * micro_batches + 1 else grad

    def watch(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
        if output.requires_grad:
            output.register_hook(poison)

    trainer_.run.module.blocks["0"].mlp.register_forward_hook(watch)


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


def unsplit_run(root: Path, mode: str) -> list[dict[str, object]]:
    records = Records()
    trainer(root / f"unsplit-{mode}", None, mode, None, records=records).fit()
    return records.steps


def test_every_mode_trains_through_the_pipeline_like_the_unsplit_model(tmp_path):
    modes = ("O0", "O1", "O2", "O3", "O4", "O5", "native-fp16", "native-bf16", *(("O6",) if HAS_TORCHAO else ()))
    looped = tuple(dict.fromkeys(("Interleaved1F1B", "InterleavedZeroBubble", ZBV)))  # 2 stages on each rank: 4 of one block
    runs = [(mode, "1F1B") for mode in modes] + [(mode, schedule) for schedule in ("GPipe", *looped) for mode in ("O0", "O2")]
    results = launch_local(train_worker, 2, (str(tmp_path), runs), device="cpu", timeout_s=60, job_timeout_s=400)
    assert results[0] == results[1]  # both stages log the same records: the last stage's loss, one agreed verdict
    unsplit = {mode: unsplit_run(tmp_path, mode) for mode in modes}
    for name, steps in results[0].items():
        mode, tolerance = name.split("/")[0], TOLERANCE.get(name.split("/")[0], 1e-2)
        losses = [step["loss"] for step in steps]
        assert losses == pytest.approx([step["loss"] for step in unsplit[mode]], rel=tolerance), name
        # clipped at 0.5 by the norm over both stages (each stage's own norm would clip another way)
        norms = [step["grad_norm"] for step in steps[:-1]]
        assert norms == pytest.approx([step["grad_norm"] for step in unsplit[mode][:-1]], rel=10 * tolerance), name
        if mode in LOSS_SCALED:  # the planted inf on stage 0 alone: the last step skipped by both, both scales halved
            assert [step["skipped"] for step in steps] == [False] * (STEPS - 1) + [True], name
            assert steps[-1]["scale"] == steps[-2]["scale"] / 2, name
        else:
            assert not any(step["skipped"] for step in steps), name


def fit_worker(env, run_dir: str, pp_size: int, steps: int, compiled: bool = False, schedule: str = "1F1B") -> dict[str, object]:
    """Trains (O0, batches of 8 of 53 samples: the epoch's seventh holds 5, one micro-batch through the stages in turn)
    under the pipeline (``pp_size`` 2) or on one process, evaluated at the epoch's end (10 samples: batches of 8 and 2, through the
    pipeline), ``compiled``: each stage's blocks one by one (``schedule``'s: a looped one holds 2 stages on each rank);
    returns the resume's layout line, the evaluation and which blocks were compiled."""
    torch.set_num_threads(1)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ampddp").addHandler(handler)
    logging.getLogger("ampddp").setLevel(logging.INFO)
    pp = PPOptions(pp_size, schedule=schedule, microbatches=4) if pp_size > 1 else None
    run = trainer(Path(run_dir), env, "O0", pp, steps=steps, batch_size=8, samples=53, evaluated=True, compiled=compiled)
    evaluation = run.fit()["eval"]
    compiled_blocks = [block._compiled_call_impl is not None for block in run.run.module.blocks.values()] if pp else []
    return {"layouts": next((line for line in said if "were written by" in line), ""), "eval": evaluation, "compiled": compiled_blocks}


def test_a_pipeline_checkpoint_resumes_on_one_process_and_back_and_exports_whole(tmp_path):
    straight, across = tmp_path / "straight", tmp_path / "across"
    # 7 steps (an epoch) on one process; and 2 under the pipeline with 2 stages on each rank (Interleaved1F1B), 2 more on
    # one process (a pipeline's checkpoint read whole), 1 more in 2 stages (1F1B: a whole model's checkpoint cut into
    # stages), 2 more under ZBV (2 stages on each rank again, compiled block by block), each resuming the one before
    alone = launch_local(fit_worker, 1, (str(straight), 1, 7), device="cpu", timeout_s=60, job_timeout_s=300)[0]
    launch_local(fit_worker, 2, (str(across), 2, 2, False, "Interleaved1F1B"), device="cpu", timeout_s=60, job_timeout_s=300)
    resumed_alone = launch_local(fit_worker, 1, (str(across), 1, 4), device="cpu", timeout_s=60, job_timeout_s=300)[0]
    written = "strategy none, pp 2 (Interleaved1F1B, 4 stages)"
    assert resumed_alone["layouts"] == f"its tensors were written by {written} and read into strategy none"
    launch_local(fit_worker, 2, (str(across), 2, 5), device="cpu", timeout_s=60, job_timeout_s=300)
    piped = launch_local(fit_worker, 2, (str(across), 2, 7, True, ZBV), device="cpu", timeout_s=60, job_timeout_s=300)
    assert [rank["compiled"] for rank in piped] == [[True, True], [True, True]]  # blocks 0, 3 on rank 0; 1, 2 on rank 1
    assert piped[0]["eval"] == piped[1]["eval"] and piped[0]["eval"].keys() == alone["eval"].keys()
    for name, value in alone["eval"].items():  # evaluated through the pipeline as on one process
        assert piped[0]["eval"][name] == pytest.approx(value, rel=1e-4), name
    expected, resumed = final_state(straight), final_state(across)
    assert resumed["progress"]["global_step"] == expected["progress"]["global_step"] == 7
    assert resumed["model"].keys() == expected["model"].keys()
    for name, value in expected["model"].items():  # fp32: the micro-batches' gradients summed in another order
        assert torch.allclose(resumed["model"][name], value, rtol=1e-4, atol=1e-5), name
    for index, entries in expected["optimizer"].items():  # AdamW's state under the whole model's numbering
        assert torch.allclose(resumed["optimizer"][index]["exp_avg_sq"], entries["exp_avg_sq"], rtol=1e-3, atol=1e-9), index
    assert f"world size   2; strategy none, pp 2 ({ZBV}, 4 stages)" in format_summary(summarize(across))
    exported = export_weights(across, tmp_path / "whole.safetensors")
    weights = load_file(tmp_path / "whole.safetensors")
    assert exported["tensors"] == len(expected["model"]) and weights.keys() == expected["model"].keys()
    for name in expected["model"]:  # whole tensors under the unsplit model's names
        assert torch.equal(weights[name], resumed["model"][name]), name


def tied_gpt() -> GPT:
    model = build()
    model.head.weight = model.token_embedding.weight  # one parameter: the first stage's embedding, the last stage's head
    return model


def tied_worker(env) -> None:
    prepare(tied_gpt, adamw, env, precision="O0", parallel=Parallel("none", pp=PPOptions(2)))


def test_weights_tied_across_stages_are_refused_on_every_stage():
    with pytest.raises(ConfigError, match=r"weights tied across pipeline stages \[0, 1\]: head.weight, token_embedding.weight"):
        launch_local(tied_worker, 2, (), device="cpu", timeout_s=60, job_timeout_s=120)


def composed_worker(env, root: str, layouts: list[tuple[str, int, str, str]]) -> dict[str, list[dict[str, object]]]:
    """Trainer runs of the pipeline composed with another dimension on 4 processes: (strategy, tp_size, mode, schedule)."""
    torch.set_num_threads(1)
    found = {}
    for strategy, tp_size, mode, schedule in layouts:
        records, pp = Records(), PPOptions(2, schedule=schedule, microbatches=4 if strategy == "none" else 2)
        parallel = Parallel(strategy, pp=pp, tp=TPOptions(tp_size))
        data_ranks = env.world_size // (pp.size * tp_size)
        run = trainer(Path(root) / f"{strategy}-{tp_size}-{mode}", env, mode, pp, records=records, batch_size=8 // data_ranks,
                      parallel=parallel)  # fmt: skip
        if mode in LOSS_SCALED and env.rank == 0:
            plant_inf_at_last_step(run, pp.micro_batches)
        run.fit()
        found[f"{strategy}/tp{tp_size}/{schedule}/{mode}"] = records.steps
    return found


def test_the_pipeline_composes_with_fsdp2_hsdp_and_tensor_parallelism_on_four_processes(tmp_path):
    # 2 stages x FSDP2 over 2 data ranks (4 samples each, 2 micro-batches of 2), 4 stages (2 on each rank, looped) the
    # same replicated (strategy ddp: run as HSDP with shards of one rank); 2 and 4 stages x tensor parallelism of 2 (8
    # samples, 4 micro-batches of 2): the unsplit model's 8 samples in 4 accumulated batches of 2 is the reference
    layouts = [("fsdp2", 1, "O2", "1F1B"), ("ddp", 1, "O2", "Interleaved1F1B"), ("none", 2, "O0", "1F1B"),
               ("none", 2, "O2", "InterleavedZeroBubble")]  # fmt: skip
    results = launch_local(composed_worker, 4, (str(tmp_path), layouts), device="cpu", timeout_s=60, job_timeout_s=400)
    assert all(result == results[0] for result in results)  # every rank logs the same records: one loss, one verdict
    unsplit = {mode: unsplit_run(tmp_path, mode) for mode in ("O0", "O2")}
    for name, steps in results[0].items():
        mode = name.split("/")[-1]
        assert [step["loss"] for step in steps] == pytest.approx([step["loss"] for step in unsplit[mode]], rel=TOLERANCE[mode]), name
        if mode in LOSS_SCALED:  # the inf planted on rank 0 (stage 0, one data or tensor rank): every rank skips
            assert [step["skipped"] for step in steps] == [False] * (STEPS - 1) + [True], name
            assert steps[-1]["scale"] == steps[-2]["scale"] / 2, name
