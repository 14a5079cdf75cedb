"""HSDP vs FSDP2 on 4 CPU processes simulated as 2 nodes of 2 (gloo): the bytes each rank exchanges
with the other node per training step (every collective; the all-gathers' part in the note).

Counted from the collectives themselves (a dispatch mode sees every c10d op with its tensors and
process group): an all-gather's output from the other node's members, a reduce-scatter's input to
them, an all-reduce's data both ways (its reduce-scatter and all-gather halves), each in proportion
to the group's members on the other node. Logical bytes, not wire bytes: what a ring or tree puts
on the inter-node links is of this order for either strategy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from harness import Budget, Row
from torch.utils._python_dispatch import TorchDispatchMode

from ampddp import Parallel
from ampddp.distributed import FSDPOptions, launch_local
from ampddp.prepare import prepare
from ampddp.zoo.models import GPT

NODE_SIZE = 2


class CrossNodeBytes(TorchDispatchMode):
    """Per collective kind, the bytes this rank exchanges with ranks of the other (simulated) node."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.node = rank // NODE_SIZE
        self.bytes: dict[str, float] = {"all-gather": 0.0, "reduce-scatter": 0.0, "all-reduce": 0.0}

    def _share_elsewhere(self, group) -> float:
        ranks = dist.get_process_group_ranks(dist.ProcessGroup.unbox(group))
        return sum(1 for rank in ranks if rank // NODE_SIZE != self.node) / len(ranks)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d._allgather_base_"):
            self.bytes["all-gather"] += args[0].nbytes * self._share_elsewhere(args[2])
        elif name.startswith("c10d._reduce_scatter_base_"):
            self.bytes["reduce-scatter"] += args[1].nbytes * self._share_elsewhere(args[2])
        elif name.startswith("c10d.allreduce_"):
            self.bytes["all-reduce"] += 2 * sum(t.nbytes for t in args[0]) * self._share_elsewhere(args[1])
        return func(*args, **(kwargs or {}))


def _traffic(env, strategy: str, width: int, layers: int, steps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    fsdp = FSDPOptions(shard_size=NODE_SIZE) if strategy == "hsdp" else FSDPOptions()
    run = prepare(lambda: GPT(256, layers=layers, width=width, heads=max(1, width // 64), context=64),
                  lambda params: torch.optim.SGD(params, lr=1e-3), env, precision="O5", parallel=Parallel(strategy, fsdp=fsdp))  # fmt: skip
    ids = torch.randint(256, (2, 64), generator=torch.Generator().manual_seed(env.rank))
    counter = CrossNodeBytes(env.rank)
    with counter:
        for _ in range(steps):
            with run.engine.forward_context():
                loss = run.model(input_ids=ids, labels=ids)["loss"]
            run.engine.backward(loss)
            run.engine.step(run.optimizer)
            run.engine.zero_grad(run.optimizer)
    count = sum(p.numel() for p in run.module.parameters())
    run.engine.teardown()
    return {**{kind: value / steps for kind, value in counter.bytes.items()}, "params": count}


def run(device: str, budget: Budget) -> list[Row]:
    if device != "cpu":
        return []
    width, layers, steps = budget.pick((64, 2, 1), (256, 4, 2), (512, 8, 2))
    found = {strategy: launch_local(_traffic, 4, (strategy, width, layers, steps), device="cpu", timeout_s=900)[0]
             for strategy in ("hsdp", "fsdp2")}  # fmt: skip
    hsdp, fsdp2 = found["hsdp"], found["fsdp2"]
    mib = 2**20
    label = f"GPT of {hsdp['params'] / 1e6:.2f}M params, O5 (bf16 gathers, fp32 reductions), rank 0 of 4 as 2 nodes x 2"
    total = {name: sum(side[kind] for kind in ("all-gather", "reduce-scatter", "all-reduce")) for name, side in found.items()}
    return [
        Row("hsdp/4-processes-2x2/bytes-across-nodes-per-step-hsdp-vs-fsdp2", total["hsdp"] / mib, total["fsdp2"] / mib,
            "MiB/step", total["fsdp2"] / total["hsdp"], steps, 0.0,
            f"{label}; all-gathered across the nodes: HSDP {hsdp['all-gather'] / mib:.3f} MiB, FSDP2 {fsdp2['all-gather'] / mib:.3f} "
            f"MiB; HSDP's cross-node traffic is its gradient all-reduce across the replicas ({hsdp['all-reduce'] / mib:.3f} MiB), "
            f"FSDP2's its gathers and reduce-scatters over all 4 ranks"),
    ]  # fmt: skip
