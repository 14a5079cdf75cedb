"""Pipeline parallelism on CPU processes (gloo, one thread each), ampddp's GPT cut into 2 stages (issue #51 item 5).

- The bubble of each schedule: each rank's idle share of a step (1 - the time its stages spend in their forwards and
  backwards / the step's time, both measured), against the theory (p - 1) / (m + p - 1) for p ranks, m micro-batches
  (GPipe, 1F1B), (p - 1) / (v m + p - 1) with v = 2 stages per rank (the looped schedules; zero bubble: about 0).
- Training state one stage holds per parameter of the whole model (params, masters, gradients, AdamW state) in O2,
  against one process holding it all.
- Step time of ampddp's set-up (``prepare(..., Parallel("none", pp=PPOptions(2)))`` and its schedule part, O0)
  against a hand-written ``torch.distributed.pipelining`` loop of the same schedule (``PipelineStage``, AdamW, fp32),
  interleaved repeat by repeat.
- The O2 (fp16, loss-scaled) loss curve through the pipeline against the unsplit fp32 model's, step by step.

CPU times are overhead on shared cores, not pipeline parallelism's speed on GPUs.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Budget, Row, adamw_losses, held_bytes, paired_ratio, spread

from ampddp import Parallel
from ampddp.distributed import launch_local
from ampddp.distributed.pipeline import PPOptions
from ampddp.prepare import prepare
from ampddp.torch_compat import zbv_schedule_problem
from ampddp.zoo.models import GPT

VOCABULARY = 256
BATCH = 16
CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
"""A torch stage's work: forwards, backwards, and (zero-bubble schedules) the weight parts of backwards done apart."""
LOOPED = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")


def _model(width: int, layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCABULARY, layers=layers, width=width, heads=4, context=64)


def _batch(step: int) -> torch.Tensor:
    return torch.randint(VOCABULARY, (BATCH, 64), generator=torch.Generator().manual_seed(step))


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


class _Loss:
    """The loop's side of a step, as the Trainer gives it (``LossOf``): the first stage's forward, the last's loss."""

    def __init__(self, run) -> None:
        self.run = run

    def __call__(self, index: int, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        return _lm_loss(self.run.model(batch), batch), len(batch)

    def forward(self, module, batch: torch.Tensor) -> torch.Tensor:
        return module(batch)


class _Backward:
    """Each micro-batch's loss weighted by its share of the batch, scaled by the engine (``Backward``)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self, loss: torch.Tensor, count: int) -> None:
        self.engine.backward(loss * count / BATCH)

    def scaled(self, loss: torch.Tensor, count: int) -> torch.Tensor:
        return self.engine.scale_for_backward(loss * count / BATCH)

    def done(self) -> None:
        self.engine.backward_done()


def _ours(env, mode: str, schedule: str, micro: int, width: int, layers: int):
    run = prepare(lambda: _model(width, layers), lambda params: torch.optim.AdamW(params, lr=1e-3), env, precision=mode,
                  parallel=Parallel("none", pp=PPOptions(2, schedule=schedule, microbatches=micro)))  # fmt: skip
    loss_of, backward = _Loss(run), _Backward(run.engine)

    def step(ids: torch.Tensor) -> float:
        total = run.schedule.forward_backward([ids], loss_of, backward)
        run.engine.step(run.optimizer)
        run.engine.zero_grad(run.optimizer)
        reduced = total.clone()
        dist.all_reduce(reduced)  # the last stage's loss, shared as the loop shares it
        return float(reduced) / BATCH

    return run, step


def _busy_time(run) -> list[float]:
    """Seconds this rank's torch stages spend in forwards and backwards, accumulated by wrapping each stage object's own
    chunk methods (instance attributes: nothing global changes)."""
    spent = [0.0]
    for schedule in run.schedule._schedules._held.values():
        for stage, name in itertools.product(getattr(schedule, "_stages", None) or [schedule._stage], CHUNK_METHODS):
            original = getattr(stage, name)

            def timed(*args, original=original, **kwargs):
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    spent[0] += time.perf_counter() - start

            setattr(stage, name, timed)
    return spent


def _bubble(env, schedule: str, micro: int, width: int, layers: int, steps: int) -> dict[str, float]:
    """This stage's idle share of the schedule's run (its forwards and backwards of a batch; the optimizer step after it
    is not part of the pipeline)."""
    torch.set_num_threads(1)
    run, step = _ours(env, "O0", schedule, micro, width, layers)
    step(_batch(0))  # warm-up: the stage of this shape is made
    spent, wall = _busy_time(run), 0.0
    loss_of, backward = _Loss(run), _Backward(run.engine)
    for index in range(steps):
        dist.barrier()
        start = time.perf_counter()
        run.schedule.forward_backward([_batch(index + 1)], loss_of, backward)
        wall += time.perf_counter() - start
        run.engine.step(run.optimizer)
        run.engine.zero_grad(run.optimizer)
    return {"idle": 1 - spent[0] / wall}


def _o2(env, width: int, layers: int, steps: int) -> dict[str, object]:
    """O2 through the pipeline: the losses, and the training state each stage holds (measured after a step's backward)."""
    torch.set_num_threads(1)
    run, step = _ours(env, "O2", "1F1B", 4, width, layers)
    losses = [step(_batch(index)) for index in range(steps)]
    run.schedule.forward_backward([_batch(steps)], _Loss(run), _Backward(run.engine))
    run.engine.unscale_(run.optimizer)  # the masters' fp32 gradients made, as at every step
    held = held_bytes(run)
    whole = sum(param.numel() for param in _model(width, layers).parameters())
    return {"losses": losses, "held": held / whole}


def _speed(env, width: int, layers: int, steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of 1F1B over 4 micro-batches, fp32: ampddp's set-up and a hand-written pipelining loop, in turns."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    _, ours = _ours(env, "O0", "1F1B", 4, width, layers)
    stage = _model(width, layers).pipeline_stage(env.rank, 2)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    schedule = Schedule1F1B(PipelineStage(stage, env.rank, 2, torch.device("cpu")), 4, loss_fn=_lm_loss)

    def hand(ids: torch.Tensor) -> None:
        schedule.step(ids) if env.rank == 0 else schedule.step(target=ids)
        optimizer.step()
        optimizer.zero_grad()

    times: dict[str, list[float]] = {"ampddp": [], "hand": []}
    sides = {"ampddp": ours, "hand": hand}
    for side in sides.values():
        side(_batch(0))  # warm-up
    for repeat in range(repeats):
        for name in sorted(sides, reverse=bool(repeat % 2)):  # turns alternate who goes first
            dist.barrier()
            start = time.perf_counter()
            for index in range(steps):
                sides[name](_batch(index))
            times[name].append((time.perf_counter() - start) / steps)
    return times


def _unsplit_fp32_losses(width: int, layers: int, steps: int) -> list[float]:
    return adamw_losses(
        _model(width, layers), (_batch(index) for index in range(steps)), lambda model, ids: _lm_loss(model(ids)["logits"], ids)
    )


def run(device: str, budget: Budget) -> list[Row]:
    if device != "cpu":
        return []
    width, layers, steps, repeats = budget.pick((32, 2, 1, 1), (128, 4, 3, 5), (256, 4, 4, 9))
    label = f"GPT of {sum(p.numel() for p in _model(width, layers).parameters()) / 1e6:.2f}M params, 2 stages, batch {BATCH} x 64"
    rows = []
    every = [(schedule, micro) for schedule in ("GPipe", "1F1B") for micro in (2, 4, 8)]
    every += [(schedule, micro) for schedule in LOOPED if zbv_schedule_problem() is None or schedule != "ZBVZeroBubble" for micro in (4, 8)]
    for schedule, micro in budget.pick([("1F1B", 2)], every, every):
        found = launch_local(_bubble, 2, (schedule, micro, width, layers, steps * 2), device="cpu", timeout_s=900)
        idle = statistics.mean(rank["idle"] for rank in found)
        looped = schedule in LOOPED  # 2 stages on each rank: (p - 1) / (v m + p - 1), v = 2; else (p - 1) / (m + p - 1), p = 2
        theory = 1 / (2 * micro + 1) if looped else 1 / (micro + 1)
        rows.append(Row(f"pipeline/{schedule}/{micro}-microbatches/idle-share", idle, theory, "share of rank's step", theory / idle,
                        steps * 2, abs(found[0]["idle"] - found[1]["idle"]),
                        f"{label}{', 4 stages of one block, 2 on each rank' if looped else ''}: each rank's time in the "
                        "schedule's step outside its stages' forwards and backwards (mean of the 2; spread: their difference) "
                        f"vs {'interleaved 1F1B (p-1)/(vm+p-1)' if looped else '(p-1)/(m+p-1)'}"
                        f"{' (zero bubble: 0 where forward, input and weight backwards take equal time)' if 'Zero' in schedule else ''}; "
                        "the p2p sends and receives add to it"))  # fmt: skip
    o2 = launch_local(_o2, 2, (width, layers, steps * 3), device="cpu", timeout_s=900)
    for stage, found in enumerate(o2):
        rows.append(Row(f"pipeline/stage{stage}/O2/training-state-bytes-per-param", found["held"], 16.0, "bytes/param of the model",
                        16.0 / found["held"], 1, 0.0,
                        f"{label}: stage {stage}'s params, fp32 masters, gradients, AdamW state per parameter of the whole "
                        "model vs one process holding it all (16)"))  # fmt: skip
    whole = _unsplit_fp32_losses(width, layers, steps * 3)
    piped = o2[0]["losses"]
    gap = max(abs(ours - theirs) / theirs for ours, theirs in zip(piped, whole))
    rows.append(Row("pipeline/1F1B/O2/loss-vs-unsplit-fp32", piped[-1], whole[-1], "loss", whole[-1] / piped[-1], steps * 3, gap,
                    f"{label}: the last step's loss; spread column = largest relative gap over the {steps * 3} steps"))  # fmt: skip
    times = launch_local(_speed, 2, (width, layers, steps, repeats), device="cpu", timeout_s=900)[0]
    ours, hand = times["ampddp"], times["hand"]
    rows.append(Row("pipeline/1F1B/O0/step-vs-hand-pipelining-loop", 1 / statistics.median(ours), 1 / statistics.median(hand),
                    "steps/s", paired_ratio(ours, hand), repeats, spread(ours),
                    f"{label}: ampddp's set-up and schedule part vs PipelineStage + Schedule1F1B + AdamW by hand, fp32, "
                    "4 micro-batches, interleaved"))  # fmt: skip
    return rows
