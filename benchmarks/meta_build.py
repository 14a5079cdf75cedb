"""FSDP2 from a meta-device build vs an eager build, and from safetensors weights read slice by slice into
the shards vs loaded whole, on 2 and 4 CPU processes (gloo, one thread each).

Per rank: the host memory that building and sharding a GPT adds at its peak (the kernel's high-water
mark of the resident set, reset just before the build, over the resident set then), against the
model's fp32 size; and the time from calling ``prepare`` to the end of the first training step.
Each side runs in fresh processes, so neither inherits the other's heap.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch
from harness import Budget, Row
from safetensors.torch import save_file

from ampddp import Parallel
from ampddp.checkpoint.safetensors_weights import DIGESTS_KEY, SafetensorsWeights, tensor_digest, weights_into
from ampddp.distributed import FSDPOptions, launch_local
from ampddp.distributed.meta_init import ModelBuild
from ampddp.prepare import prepare
from ampddp.zoo.models import GPT

MIB = 2**20


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _reset_peak() -> bool:
    """Reset the kernel's high-water mark of this process's resident set (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


BUILDS = ("meta", "eager", "sliced", "whole")
"""How a side builds the model: on the meta device (replayed init) or eagerly; from safetensors weights
read slice by slice into a meta build's shards, or loaded whole into an eager build."""


def _prepared(env, build: str, width: int, layers: int, weights: str | None):
    factory = functools.partial(GPT, 256, layers=layers, width=width, heads=max(1, width // 64), context=64)
    if build == "sliced":
        model = weights_into(Parallel("fsdp2").build(factory), SafetensorsWeights(weights))
    elif build == "whole":
        model = weights_into(ModelBuild(factory()), SafetensorsWeights(weights))
    else:
        model = factory if build == "meta" else factory()
    return prepare(model, lambda params: torch.optim.SGD(params, lr=1e-3), env, precision="O0",
                   parallel=Parallel("fsdp2", fsdp=FSDPOptions(build_on_meta=build in ("meta", "sliced"))))  # fmt: skip


def _build_and_step(env, build: str, width: int, layers: int, weights: str | None) -> dict:
    torch.set_num_threads(1)
    warm_up = {"sliced": "meta", "whole": "eager"}.get(build, build)
    _prepared(env, warm_up, 64, 2, None).engine.teardown()  # the code paths loaded: imports are not the build's memory
    torch.manual_seed(0)
    gc.collect()
    resettable = _reset_peak()
    resident = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    run = _prepared(env, build, width, layers, weights)
    built_peak = _status_kib("VmHWM") * 1024 - resident
    ids = torch.randint(256, (2, 64), generator=torch.Generator().manual_seed(env.rank))
    loss = run.model(input_ids=ids, labels=ids)["loss"]
    run.engine.backward(loss)
    run.engine.step(run.optimizer)
    first_step_s = time.perf_counter() - start
    sizes = [p.numel() * 4 for p in run.module.parameters()]  # fp32: DTensors report their global size
    run.engine.teardown()
    return {"peak": built_peak, "first_step_s": first_step_s, "model_bytes": sum(sizes), "largest": max(sizes), "resettable": resettable}


ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 20)}
"""glibc's thresholds fixed for the ranks (read at their start): a freed block of 1 MiB or more goes back to
the system at once, as every tensor of a large model's does under glibc's own limits, so the peak is the
tensors alive, not what the heap kept of a freed 4 MiB scratch tensor."""


def _side(world: int, build: str, width: int, layers: int, weights: str | None = None) -> dict:
    before = {name: os.environ.get(name) for name in ALLOCATOR}
    os.environ.update(ALLOCATOR)
    try:
        ranks = launch_local(_build_and_step, world, (build, width, layers, weights), device="cpu", timeout_s=900)
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return {"peak": max(r["peak"] for r in ranks), "first_step_s": max(r["first_step_s"] for r in ranks), **{
        key: ranks[0][key] for key in ("model_bytes", "largest", "resettable")}}  # fmt: skip


def _exported(folder: Path, width: int, layers: int) -> str:
    """A GPT's weights written as ``ampddp export`` writes them (one file, each tensor's digest in its metadata)."""
    torch.manual_seed(1)
    state = GPT(256, layers=layers, width=width, heads=max(1, width // 64), context=64).state_dict()
    path = folder / "model.safetensors"
    save_file(state, path, metadata={DIGESTS_KEY: json.dumps({name: tensor_digest(value) for name, value in state.items()})})
    return str(path)


def _rows(world: int, ours: dict, theirs: dict, what: str, versus: str) -> list[Row]:
    model, largest = ours["model_bytes"] / MIB, ours["largest"] / MIB
    caveat = "" if ours["resettable"] else " (peak not resettable here: includes start-up)"
    return [
        Row(f"meta-build/{world}-processes/{what}-peak-host-memory-{versus}", ours["peak"] / MIB, theirs["peak"] / MIB, "MiB per rank",
            theirs["peak"] / ours["peak"], 1, 0.0,
            f"GPT of {model:.0f} MiB fp32 weights, largest tensor {largest:.1f} MiB: 1/{world} of the model is {model / world:.0f} "
            f"MiB; the most any rank's resident set grew from calling prepare to the sharded model{caveat}"),
        Row(f"meta-build/{world}-processes/{what}-time-to-first-step-{versus}", ours["first_step_s"], theirs["first_step_s"], "s",
            theirs["first_step_s"] / ours["first_step_s"], 1, 0.0, "prepare and one O0 training step; the slowest rank"),
    ]  # fmt: skip


def run(device: str, budget: Budget) -> list[Row]:
    if device != "cpu":
        return []
    width, layers = budget.pick((128, 2), (512, 8), (1024, 8))
    rows = []
    with tempfile.TemporaryDirectory(dir=Path.cwd(), prefix=".ampddp-bench-") as folder:
        weights = _exported(Path(folder), width, layers)
        for world in (2, 4):
            meta, eager = _side(world, "meta", width, layers), _side(world, "eager", width, layers)
            rows += _rows(world, meta, eager, "build", "meta-vs-eager")
            sliced, whole = _side(world, "sliced", width, layers, weights), _side(world, "whole", width, layers, weights)
            rows += _rows(world, sliced, whole, "init-from-safetensors", "slices-vs-whole")
    return rows
