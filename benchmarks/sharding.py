"""FSDP2 (strategy fsdp2) vs DDP on 2 CPU processes (gloo, one thread each), both in O5 on a GPT:
training-state bytes per parameter held by each rank (params, gradients, optimizer state), step time,
and the cost of a checkpoint's whole-tensor gather. On 2+ GPUs (``--device cuda``, NCCL): a GPT's
tokens/s, model FLOPs utilisation and peak memory per GPU under FSDP2 and DDP in O5."""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import Budget, Row, paired_ratio, spread
from torch.distributed.tensor import DTensor

from ampddp import Parallel
from ampddp.checkpoint import keys
from ampddp.checkpoint.sharded import read_into_live, split_state, verify_shards
from ampddp.checkpoint.store import CheckpointStore
from ampddp.distributed import launch_local
from ampddp.distributed.full_state import gathered, sharded_model_state, sharded_optimizer_state
from ampddp.prepare import prepare
from ampddp.zoo.models import GPT


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _state_bytes(run) -> dict[str, int]:
    """Bytes this rank holds for the model's params (and O5's fp32 masters), their gradients and the
    optimizer state, each storage counted once."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for tensor in tensors:
            local = _local(tensor)
            if local is None or local.untyped_storage().data_ptr() in seen:
                continue
            seen.add(local.untyped_storage().data_ptr())
            total += local.untyped_storage().nbytes()
        return total

    stepped = [param for group in run.optimizer.param_groups for param in group["params"]]
    params = [*run.module.parameters(), *stepped]
    return {
        "params": size(params),
        "grads": size(param.grad for param in params if param.grad is not None),
        "optimizer": size(value for entry in run.optimizer.state.values() for value in entry.values() if isinstance(value, torch.Tensor)),
    }


def _cloned(state):
    if isinstance(state, dict):
        return {key: _cloned(value) for key, value in state.items()}
    return state.detach().cpu().clone() if isinstance(state, torch.Tensor) else state


def _measure(env, strategy: str, width: int, steps: int, repeats: int, folder: str) -> dict:
    torch.manual_seed(0)
    model = GPT(256, layers=4, width=width, heads=4, context=64)
    count = sum(param.numel() for param in model.parameters())
    run = prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-3), env, precision="O5", parallel=Parallel(strategy))
    generator = torch.Generator().manual_seed(env.rank)
    ids = torch.randint(256, (8, 64), generator=generator)

    def step() -> None:
        with run.engine.forward_context():
            loss = run.model(input_ids=ids, labels=ids)["loss"]
        run.engine.backward(loss)
        run.engine.step(run.optimizer)

    step()  # warm-up, and the optimizer's state exists
    run.engine.backward(run.model(input_ids=ids, labels=ids)["loss"])  # gradients present while measured
    held = _state_bytes(run)
    run.engine.zero_grad(run.optimizer)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
            run.engine.zero_grad(run.optimizer)
        times.append((time.perf_counter() - start) / steps)
    start = time.perf_counter()
    for state in (run.module.state_dict(), run.optimizer.state_dict()["state"]):
        _cloned(gathered(state))  # a checkpoint's whole-tensor copy: gathered under FSDP2, copied under DDP
    gather_s = time.perf_counter() - start
    saves = _checkpoint_times(env, run, folder, repeats) if strategy == "fsdp2" else {}
    run.engine.teardown()
    return {"count": count, "held": held, "times": times, "gather_s": gather_s, **saves}


def _checkpoint_times(env, run, folder: str, repeats: int) -> dict[str, list[float]]:
    """Seconds to write a checkpoint of the FSDP2 model and optimizer, and to read it back into the
    live (sharded) run, in each layout: every rank its shards, or rank 0 the gathered whole."""
    store = CheckpointStore(Path(folder) / f"run-{repeats}", keep_last=None)
    found: dict[str, list[float]] = {"save_sharded": [], "save_whole": [], "load_sharded": [], "load_whole": []}
    for step in range(repeats):
        model, optimizer = run.module.state_dict(), run.optimizer.state_dict()
        start = time.perf_counter()
        tensors, rest, record = split_state(model, optimizer)
        sharded = store.save(2 * step + 1, {keys.FORMAT: keys.SHARDED_FORMAT_VERSION, keys.OPTIMIZER: rest, keys.SHARDS: record}, {},
                             env, shards=tensors)  # fmt: skip
        found["save_sharded"].append(time.perf_counter() - start)
        start = time.perf_counter()
        whole = store.save(2 * step + 2, {keys.FORMAT: keys.FORMAT_VERSION, keys.MODEL: gathered(model, env.is_main),
                                          keys.OPTIMIZER: gathered(optimizer, env.is_main)}, {}, env)  # fmt: skip
        found["save_whole"].append(time.perf_counter() - start)
        start = time.perf_counter()
        shared = CheckpointStore.load_shared(sharded)
        verify_shards(sharded.path, sharded.manifest(), env)  # as a resume does: each rank hashes its share of the files
        read_into_live(sharded.path, shared, sharded.manifest(), run.module.state_dict(), run.optimizer, env)
        found["load_sharded"].append(time.perf_counter() - start)
        start = time.perf_counter()
        shared = CheckpointStore.load_shared(whole)
        sharded_model_state(shared[keys.MODEL], run.module.state_dict())
        sharded_optimizer_state(shared[keys.OPTIMIZER], run.optimizer)
        found["load_whole"].append(time.perf_counter() - start)
    return found


def _spawned(env, width: int, steps: int, repeats: int, folder: str) -> dict:
    torch.set_num_threads(1)
    return {strategy: _measure(env, strategy, width, steps, repeats, folder) for strategy in ("fsdp2", "ddp")}


def _gpu_throughput(env, strategy: str, size: tuple[int, int, int, int], steps: int, repeats: int) -> dict:
    """Tokens/s and peak memory of one GPU's rank, FSDP2 or DDP, in O5 (what MFU is computed from)."""
    width, layers, context, batch = size
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()  # the other strategy's run freed: this one's memory alone
    torch.manual_seed(0)
    model = GPT(32768, layers=layers, width=width, heads=width // 128, context=context)
    count = sum(param.numel() for param in model.parameters())
    # Model FLOPs count the matmuls: the embedding tables are looked up, not multiplied.
    matmul_params = count - sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    run = prepare(model, lambda params: torch.optim.AdamW(params, lr=1e-4), env, precision="O5", parallel=Parallel(strategy))
    ids = torch.randint(32768, (batch, context + 1), generator=torch.Generator().manual_seed(env.rank)).to(env.device)

    def step() -> None:
        with run.engine.forward_context():
            loss = run.model(input_ids=ids[:, :-1], labels=ids[:, 1:])["loss"]
        run.engine.backward(loss)
        run.engine.step(run.optimizer)
        run.engine.zero_grad(run.optimizer)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / steps)
    peak = torch.cuda.max_memory_allocated() - before
    run.engine.teardown()
    run = model = None  # freed before the other strategy measures
    # Training FLOPs per token: 6 per matmul parameter (forward, backward) plus attention's 12 * layers * width * context.
    flops = 6 * matmul_params + 12 * layers * width * context
    return {"count": count, "times": times, "tokens": batch * context, "flops_per_token": flops,
            "peak_bytes": peak, "gpu": torch.cuda.get_device_name()}  # fmt: skip


def _gpu_spawned(env, size: tuple[int, int, int, int], steps: int, repeats: int) -> dict:
    return {strategy: _gpu_throughput(env, strategy, size, steps, repeats) for strategy in ("fsdp2", "ddp")}


def _gpu_rows(budget: Budget) -> list[Row]:
    """FSDP2 vs DDP in O5 on 2 GPUs: a GPT both can hold (width, layers, context, batch per GPU)."""
    from cuda_suite import BF16_PEAK

    size = budget.pick((256, 2, 128, 2), (2048, 16, 1024, 4), (4096, 16, 2048, 4))
    steps, repeats = budget.pick((1, 1), (5, 5), (10, 7))
    result = launch_local(_gpu_spawned, 2, (size, steps, repeats), device="cuda", backend="nccl", timeout_s=900)[0]
    fsdp2, ddp = result["fsdp2"], result["ddp"]
    label = f"gpt-{fsdp2['count'] / 1e6:.0f}M"
    rate = {name: side["tokens"] / statistics.median(side["times"]) for name, side in result.items()}
    peak = next((value for key, value in BF16_PEAK.items() if key in fsdp2["gpu"]), None)
    mfu = {name: (rate[name] * result[name]["flops_per_token"] / peak if peak else float("nan")) for name in rate}
    return [
        Row(f"sharding/2-gpus/{label}/O5/tokens-per-s-fsdp2-vs-ddp", rate["fsdp2"], rate["ddp"], "tokens/s per GPU",
            rate["fsdp2"] / rate["ddp"], repeats, spread(fsdp2["times"]),
            f"MFU {mfu['fsdp2']:.1%} (FSDP2) vs {mfu['ddp']:.1%} (DDP) of {fsdp2['gpu']}'s dense bf16 peak"),
        Row(f"sharding/2-gpus/{label}/O5/peak-memory-fsdp2-vs-ddp", fsdp2["peak_bytes"] / 2**30, ddp["peak_bytes"] / 2**30,
            "GiB per GPU", ddp["peak_bytes"] / fsdp2["peak_bytes"], repeats, 0.0,
            "torch.cuda.max_memory_allocated over the measured steps: params, gradients, AdamW state and activations"),
    ]  # fmt: skip


def run(device: str, budget: Budget) -> list[Row]:
    if device == "cuda":
        return _gpu_rows(budget) if torch.cuda.device_count() >= 2 else []
    width, steps, repeats = budget.pick((64, 1, 1), (256, 5, 5), (384, 10, 7))
    # Beside the results, not in /tmp: /tmp is often a RAM file system, where fsync costs nothing.
    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".ampddp-bench-") as folder:
        result = launch_local(_spawned, 2, (width, steps, repeats, folder), device="cpu", timeout_s=600)[0]
    fsdp2, ddp = result["fsdp2"], result["ddp"]
    count = fsdp2["count"]
    rows = []
    for part in ("params", "grads", "optimizer"):
        ours, theirs = fsdp2["held"][part] / count, ddp["held"][part] / count
        rows.append(Row(f"sharding/2-processes/{part}-bytes-per-param-fsdp2-vs-ddp-O5", ours, theirs, "bytes/param/rank",
                        theirs / ours if ours else float("inf"), 1, 0.0,
                        f"{count / 1e6:.2f}M-param GPT; DDP O5 keeps bf16 params + fp32 masters, FSDP2 O5 fp32 shards only"))  # fmt: skip
    total_ours = sum(fsdp2["held"].values()) / count
    total_theirs = sum(ddp["held"].values()) / count
    rows.append(Row("sharding/2-processes/training-state-bytes-per-param-fsdp2-vs-ddp-O5", total_ours, total_theirs, "bytes/param/rank",
                    total_theirs / total_ours, 1, 0.0, "params + gradients + AdamW state one rank holds (1/world: FSDP2)"))  # fmt: skip
    rate = {name: 16 / statistics.median(side["times"]) for name, side in result.items()}
    rows.append(Row("sharding/2-processes/step-fsdp2-vs-ddp-O5", rate["fsdp2"], rate["ddp"], "samples/s",
                    paired_ratio(fsdp2["times"], ddp["times"]), repeats, spread(fsdp2["times"]),
                    "FSDP2 gathers each block's params in forward and backward: slower where DDP fits (below 1 expected)"))  # fmt: skip
    megabytes = count * 4 * 3 / 2**20  # fp32 params and AdamW's two moments
    rows.append(Row("sharding/2-processes/checkpoint-state-copy-fsdp2-vs-ddp", megabytes / fsdp2["gather_s"], megabytes / ddp["gather_s"],
                    "MiB/s", ddp["gather_s"] / fsdp2["gather_s"], 1, 0.0,
                    "whole-tensor copy of model + optimizer state for a checkpoint: FSDP2 gathers shards, DDP copies"))  # fmt: skip
    for kind in ("save", "load"):
        ours, theirs = fsdp2[f"{kind}_sharded"], fsdp2[f"{kind}_whole"]
        rows.append(Row(f"sharding/2-processes/checkpoint-{kind}-sharded-vs-whole", megabytes / statistics.median(ours),
                        megabytes / statistics.median(theirs), "MiB/s", paired_ratio(ours, theirs), repeats, spread(ours),
                        f"FSDP2 model + AdamW state; sharded: every rank {kind}s its own shards (DCP), whole: gathered, rank 0 "
                        "writes one file (every rank reads it and cuts its shard); fsync'd, hashed, verified"))  # fmt: skip
    return rows
