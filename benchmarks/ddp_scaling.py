"""DDP on CPU (gloo, one thread per process): ampddp vs hand-written torch DDP, weak scaling, SyncBN cost,
and ampddp.apex.parallel.DistributedDataParallel (apex's DDP on torch DDP) vs torch DDP."""

from __future__ import annotations

import copy
import statistics
import time

import torch
import torch.nn.functional as F
from harness import Budget, Row, paired_ratio, spread
from loops import batch, many_layer_mlp, sgd
from torch.nn.parallel import DistributedDataParallel

from ampddp import Parallel
from ampddp.apex.parallel import DistributedDataParallel as ApexDDP
from ampddp.distributed import detect_env, launch_local
from ampddp.prepare import prepare


def _timings(env, steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per step of every repeat, per contender, with one thread (one core per process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(env, steps, repeats)
    finally:
        torch.set_num_threads(threads)


def _measure(env, steps: int, repeats: int) -> dict[str, list[float]]:
    x, y = batch(64, "cpu")
    base = many_layer_mlp()
    ours = prepare(copy.deepcopy(base), sgd, env, precision="O0")
    synced = prepare(copy.deepcopy(base), sgd, env, precision="O0", parallel=Parallel(sync_bn="portable"))
    plain_model = copy.deepcopy(base)
    plain = DistributedDataParallel(plain_model) if env.distributed else plain_model
    plain_opt = sgd(plain_model.parameters())

    def ampddp_step(run) -> None:
        run.optimizer.zero_grad(set_to_none=True)
        with run.engine.forward_context():
            loss = F.cross_entropy(run.model(x), y)
        run.engine.backward(loss)
        run.engine.step(run.optimizer)

    def torch_step() -> None:
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    def plain_step(model, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    contenders = {"ampddp": lambda: ampddp_step(ours), "torch": torch_step, "syncbn": lambda: ampddp_step(synced)}
    if env.distributed:  # apex's DDP needs a process group
        for name, options in (("apex", {}), ("apex_delay", {"delay_allreduce": True})):
            apex_model = ApexDDP(copy.deepcopy(base), **options)
            apex_opt = sgd(apex_model.parameters())
            contenders[name] = lambda m=apex_model, o=apex_opt: plain_step(m, o)
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(repeats + 1):
        for name, step in contenders.items():
            start = time.perf_counter()
            for _ in range(steps):
                step()
            if repeat:  # the first round warms up
                samples[name].append((time.perf_counter() - start) / steps)
    return samples


def run(device: str, budget: Budget) -> list[Row]:
    if device != "cpu":
        return []
    steps, repeats = budget.pick((1, 1), (10, 7), (20, 11))
    one = _timings(detect_env({}, device="cpu"), steps, repeats)
    two = launch_local(_spawned, 2, (steps, repeats), device="cpu", timeout_s=300)[0]
    rate = {key: 64 / statistics.median(value) for key, value in one.items()}
    rate2 = {key: 128 / statistics.median(value) for key, value in two.items()}
    efficiency = {key: rate2[key] / (2 * rate[key]) for key in rate}
    apex_note = "apex.parallel.DistributedDataParallel (torch DDP + apex's all-reduce hook; no per-forward buffer broadcast, as apex)"
    scaling = f"weak scaling 1->2 processes: ampddp {efficiency['ampddp']:.2f}, torch DDP {efficiency['torch']:.2f}"
    syncbn_note = "cost of synchronising 8 BatchNorm layers every step (below 1 by design)"
    return [
        Row("ddp/2-processes/ampddp-vs-torch-ddp", rate2["ampddp"], rate2["torch"], "samples/s", paired_ratio(two["ampddp"], two["torch"]),
            repeats, spread(two["ampddp"]), scaling),
        Row("ddp/2-processes/portable-syncbn-vs-plain-bn", rate2["syncbn"], rate2["ampddp"], "samples/s",
            paired_ratio(two["syncbn"], two["ampddp"]), repeats, spread(two["syncbn"]), syncbn_note),
        Row("ddp/2-processes/apex-ddp-vs-torch-ddp", rate2["apex"], rate2["torch"], "samples/s", paired_ratio(two["apex"], two["torch"]),
            repeats, spread(two["apex"]), apex_note),
        Row("ddp/2-processes/apex-ddp-delay-allreduce-vs-torch-ddp", rate2["apex_delay"], rate2["torch"], "samples/s",
            paired_ratio(two["apex_delay"], two["torch"]), repeats, spread(two["apex_delay"]),
            "delay_allreduce=True: one bucket reduced after backward (no overlap, by design)"),
    ]  # fmt: skip


def _spawned(env, steps: int, repeats: int) -> dict[str, list[float]]:
    return _timings(env, steps, repeats)
