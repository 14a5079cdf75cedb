"""Tensor parallelism on CPU processes (gloo, one thread each), ampddp's GPT split by its own plan (issue #50 item 6).

- Training state one rank holds per parameter (params, gradients, AdamW state) at TP=1 (one process), TP=2 and
  FSDP2 x TP on 2 x 2, in O2 (fp32 shards as masters, fp16 compute).
- Bytes one rank exchanges per training step (every collective it takes part in, counted from the c10d ops
  themselves: an all-gather's output, a reduce-scatter's input, an all-reduce's data both ways).
- Step time of ampddp's set-up (``prepare(..., Parallel("none", tp=TPOptions(2)))``, O0) against a hand-written
  DTensor loop (``parallelize_module`` with the same plan, AdamW, fp32), interleaved repeat by repeat.
- The O2 (fp16, loss-scaled) loss curve under TP=2 against the unsplit fp32 model's, step by step.
- What the vocabulary-parallel loss (``loss_parallel``) saves: bytes exchanged per step at TP=2 with the logits left
  split against gathered whole (and their losses, step by step).

CPU times are overhead on shared cores, not tensor parallelism's speed (its collectives want NVLink).
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch
import torch.distributed as dist
from harness import Budget, Row, adamw_losses, held_bytes, paired_ratio, spread
from torch.utils._python_dispatch import TorchDispatchMode

from ampddp import Parallel
from ampddp.distributed import launch_local
from ampddp.distributed.tensor_parallel import TPOptions
from ampddp.prepare import prepare
from ampddp.zoo.models import GPT

VOCABULARY = 256


class CollectiveBytes(TorchDispatchMode):
    """The bytes this rank sends and receives in collectives, by kind (logical bytes, not wire bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith(("c10d._allgather_base_", "c10d.allgather_")):  # FSDP2's own: the output given
            self.bytes["all-gather"] += sum(t.nbytes for t in _tensors(args[0]))
        elif name.startswith(("c10d._reduce_scatter_base_", "c10d.reduce_scatter_")):
            self.bytes["reduce-scatter"] += sum(t.nbytes for t in _tensors(args[1]))
        elif name.startswith("c10d.allreduce_"):
            self.bytes["all-reduce"] += 2 * sum(t.nbytes for t in _tensors(args[0]))
        elif ".all_gather_into_tensor" in name:  # DTensor's functional collectives: (input, group size, group)
            self.bytes["all-gather"] += args[0].nbytes * args[1]
        elif ".reduce_scatter_tensor" in name:
            self.bytes["reduce-scatter"] += args[0].nbytes
        elif ".all_reduce" in name:
            self.bytes["all-reduce"] += 2 * args[0].nbytes
        return func(*args, **(kwargs or {}))


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [tensor for item in value for tensor in _tensors(item)] if isinstance(value, (list, tuple)) else []


def _model(width: int, layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCABULARY, layers=layers, width=width, heads=4, context=64)


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(VOCABULARY, (4, 64), generator=torch.Generator().manual_seed(rank))


def _layout(env, strategy: str, tp: int, width: int, layers: int, steps: int, loss_parallel: bool = False) -> dict[str, float]:
    """O2 training of the GPT under one layout, stepped through the run's schedule as the Trainer does: bytes held and
    exchanged per step by rank 0, and its losses."""
    torch.set_num_threads(1)
    run = prepare(lambda: _model(width, layers), lambda params: torch.optim.AdamW(params, lr=1e-3), env, precision="O2",
                  parallel=Parallel(strategy, tp=TPOptions(tp, loss_parallel=loss_parallel)))  # fmt: skip
    shard = run.data_shard
    ids = _batch(shard.rank)
    counter, losses = CollectiveBytes(), []

    def loss_of(index: int, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        with run.engine.forward_context():
            return run.model(input_ids=batch, labels=batch)["loss"], len(batch)

    for step in range(steps + 1):
        with counter if step else contextlib.nullcontext():  # the first step warms up: not counted
            loss = run.schedule.forward_backward([ids], loss_of, lambda loss, count: run.engine.backward(loss)) / len(ids)
            if step == steps:
                held = held_bytes(run)  # gradients present
            run.engine.step(run.optimizer)
            run.engine.zero_grad(run.optimizer)
        losses.append(loss.item())
    count = sum(param.numel() for param in run.module.parameters())
    run.engine.teardown()
    return {"held": held / count, "exchanged": sum(counter.bytes.values()) / steps, "losses": losses, "params": count,
            **{kind: value / steps for kind, value in counter.bytes.items()}}  # fmt: skip


def _hand_step(model, optimizer, ids) -> None:
    loss = model(input_ids=ids, labels=ids)["loss"]
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _speed(env, width: int, layers: int, steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per step at TP=2, O0: ampddp's set-up and a hand-written DTensor loop, taking turns."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    ids = _batch(0)
    run = prepare(lambda: _model(width, layers), lambda params: torch.optim.AdamW(params, lr=1e-3), env, precision="O0",
                  parallel=Parallel("none", tp=TPOptions(2)))  # fmt: skip
    hand = _model(width, layers)
    parallelize_module(hand, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), hand.tensor_parallel_plan(2))
    hand_optimizer = torch.optim.AdamW(hand.parameters(), lr=1e-3)

    def ours() -> None:
        with run.engine.forward_context():
            loss = run.model(input_ids=ids, labels=ids)["loss"]
        run.engine.backward(loss)
        run.engine.step(run.optimizer)
        run.engine.zero_grad(run.optimizer)

    times: dict[str, list[float]] = {"ampddp": [], "hand": []}
    sides = {"ampddp": ours, "hand": lambda: _hand_step(hand, hand_optimizer, ids)}
    for side in sides.values():
        side()  # warm-up
    for repeat in range(repeats):
        for name in sorted(sides, reverse=bool(repeat % 2)):  # turns alternate who goes first
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                sides[name]()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def _unsplit_fp32_losses(width: int, layers: int, steps: int) -> list[float]:
    ids = _batch(0)
    return adamw_losses(_model(width, layers), [ids] * (steps + 1), lambda model, batch: model(input_ids=batch, labels=batch)["loss"])


def run(device: str, budget: Budget) -> list[Row]:
    if device != "cpu":
        return []
    width, layers, steps, repeats = budget.pick((64, 2, 1, 1), (256, 4, 4, 5), (512, 4, 8, 9))
    found = {
        "tp2": launch_local(_layout, 2, ("none", 2, width, layers, steps), device="cpu", timeout_s=900)[0],
        "fsdp2xtp2": launch_local(_layout, 4, ("fsdp2", 2, width, layers, steps), device="cpu", timeout_s=900)[0],
    }
    split_logits = launch_local(_layout, 2, ("none", 2, width, layers, steps, True), device="cpu", timeout_s=900)[0]
    whole = _unsplit_fp32_losses(width, layers, steps)
    times = launch_local(_speed, 2, (width, layers, steps, repeats), device="cpu", timeout_s=900)[0]
    label = f"GPT of {found['tp2']['params'] / 1e6:.2f}M params"
    unsplit_bytes = 16.0  # O2 on one process: fp16 params, fp32 masters (4), fp16 grads freed into fp32 master grads (4), AdamW (8)
    rows = []
    for name, side in found.items():
        rows.append(Row(f"tensor-parallel/{name}/O2/training-state-bytes-per-param", side["held"], unsplit_bytes,
                        "bytes/param/rank", unsplit_bytes / side["held"], 1, 0.0,
                        f"{label}; rank 0's params, masters, gradients, AdamW state vs one process holding it all "
                        f"(O2's fp32 shards are the masters)"))  # fmt: skip
        kinds = ", ".join(f"{kind} {side[kind] / 2**20:.2f}" for kind in ("all-gather", "reduce-scatter", "all-reduce"))
        ddp = 2 * 4 * side["params"]  # a DDP rank's all-reduce of the fp32 gradients, both ways
        rows.append(Row(f"tensor-parallel/{name}/O2/bytes-exchanged-per-step", side["exchanged"] / 2**20, ddp / 2**20, "MiB/step/rank",
                        ddp / side["exchanged"], steps, 0.0,
                        f"{label}, batch 4 x 64 tokens per data rank, vs a DDP rank's fp32 gradient all-reduce of the same "
                        f"model (activations grow with the batch, gradients do not); MiB by kind: {kinds}"))  # fmt: skip
    gap = max(abs(ours - theirs) / theirs for ours, theirs in zip(found["tp2"]["losses"], whole))
    rows.append(Row("tensor-parallel/tp2/O2/loss-vs-unsplit-fp32", found["tp2"]["losses"][-1], whole[-1], "loss",
                    whole[-1] / found["tp2"]["losses"][-1], steps + 1, gap,
                    f"{label}: the last step's loss; spread column = largest relative gap over the {steps + 1} steps"))  # fmt: skip
    logits = 4 * 64 * VOCABULARY * 2  # one data rank's fp16 logits
    rows.append(Row("tensor-parallel/tp2/O2/loss-parallel-bytes-exchanged-per-step", split_logits["exchanged"] / 2**20,
                    found["tp2"]["exchanged"] / 2**20, "MiB/step/rank", found["tp2"]["exchanged"] / split_logits["exchanged"],
                    steps, max(abs(a - b) / b for a, b in zip(split_logits["losses"], found["tp2"]["losses"])),
                    f"{label}: the logits left split by vocabulary (loss_parallel) vs gathered whole ({logits / 2**10:.0f} KiB "
                    "of fp16 logits per step here; they grow with batch x sequence x vocabulary); spread column = largest "
                    "relative gap between the two runs' losses"))  # fmt: skip
    ours, hand = times["ampddp"], times["hand"]
    rows.append(Row("tensor-parallel/tp2/O0/step-vs-hand-dtensor-loop", 1 / statistics.median(ours), 1 / statistics.median(hand),
                    "steps/s", paired_ratio(ours, hand), repeats, spread(ours),
                    f"{label}: ampddp's set-up vs parallelize_module + AdamW by hand, fp32, interleaved"))  # fmt: skip
    return rows
