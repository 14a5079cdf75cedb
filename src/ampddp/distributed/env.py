"""One object with every process-group fact, built once from whichever launcher started us.

``detect_env`` is a pure function of the environment mapping (so every launcher is testable without
launching); ``init_distributed`` binds the device and creates the process group. No other ampddp
module reads RANK, WORLD_SIZE or SLURM variables.
"""

from __future__ import annotations

import datetime
import math
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy
import torch
import torch.distributed as dist

from ampddp.choices import MAX_TIMEOUT_S
from ampddp.distributed.hook_callbacks import let_worker_threads_finish
from ampddp.distributed.join import join_process_group
from ampddp.distributed.lifeline import end_with_parent
from ampddp.errors import ConfigError, choice_error

LAUNCHERS = ("torchrun", "slurm", "spawn", "tcp", "none")
HOST_AND_CUDA = "cpu:gloo,cuda:nccl"
"""A process group with both: NCCL for GPU tensors, gloo for host tensors (FSDP2's CPU-offloaded shards)."""
BACKENDS = ("auto", "nccl", "gloo", HOST_AND_CUDA)
DEFAULT_TIMEOUT_S = 600.0
SLURM_PORT_BASE = 15000


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job. Single-process jobs have world_size 1 and no backend."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    launcher: str = "none"
    init_method: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = DEFAULT_TIMEOUT_S
    agent_store: bool = False  # torchrun's agent hosts the store at master_addr:master_port for every restart
    under_agent: bool = False  # started by torchrun's elastic agent: this process ends with it (see ampddp.distributed.lifeline)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def rank_seed(self, seed: int) -> int:
        """Seed for per-rank randomness (augmentation, dropout): differs per rank, fixed per run."""
        return (seed * 1_000_003 + self.rank) % 2**63

    def describe(self) -> str:
        where = f"rank {self.rank}/{self.world_size} (local {self.local_rank}, node {self.node_rank}/{self.num_nodes})"
        return f"{where} via {self.launcher}, backend {self.backend or 'none'}, device {self.device}"


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is not set; the launcher must set it")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,09]-ib,cpu1' -> 'gpu03-ib'."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
    if match is None or not (match.group(1) or match.group(2)):
        raise ConfigError(f"SLURM node list {nodelist!r} cannot be parsed; expected e.g. 'node[01-04]' or 'host1,host2'")
    prefix, ranges, suffix = match.group(1), match.group(2), match.group(3)
    first = ranges.split(",")[0].split("-")[0] if ranges else ""
    return prefix + first + suffix


def _tasks_on_first_node(value: str | None, default: int) -> int:
    """SLURM_TASKS_PER_NODE looks like '4(x2),3'; the first count is ours when tasks are even."""
    if not value:
        return default
    match = re.match(r"(\d+)", value)
    return int(match.group(1)) if match else default


def _from_torchrun(environ: Mapping[str, str]) -> dict:
    world = _int(environ, "WORLD_SIZE")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", world)
    return {
        "launcher": "torchrun",
        "rank": _int(environ, "RANK"),
        "local_rank": _int(environ, "LOCAL_RANK", 0),
        "world_size": world,
        "local_world_size": local_world,
        "node_rank": _int(environ, "GROUP_RANK", _int(environ, "NODE_RANK", 0)),
        "num_nodes": max(1, world // max(local_world, 1)),
        "init_method": "env://",
        "master_addr": environ.get("MASTER_ADDR"),
        "master_port": _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else None,
        "agent_store": environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in environ,
        "under_agent": "TORCHELASTIC_RUN_ID" in environ,
    }


def _from_slurm(environ: Mapping[str, str]) -> dict:
    world = _int(environ, "SLURM_STEP_NUM_TASKS")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if "MASTER_ADDR" in environ:
        addr = environ["MASTER_ADDR"]
    elif nodelist:
        addr = first_slurm_host(nodelist)
    else:
        raise ConfigError("SLURM job without SLURM_JOB_NODELIST or MASTER_ADDR: cannot find the master node")
    port = _int(environ, "MASTER_PORT") if "MASTER_PORT" in environ else SLURM_PORT_BASE + _int(environ, "SLURM_JOB_ID", 0) % 20000
    return {
        "launcher": "slurm",
        "rank": _int(environ, "SLURM_PROCID"),
        "local_rank": _int(environ, "SLURM_LOCALID", 0),
        "world_size": world,
        "local_world_size": _tasks_on_first_node(environ.get("SLURM_TASKS_PER_NODE"), world),
        "node_rank": _int(environ, "SLURM_NODEID", 0),
        "num_nodes": _int(environ, "SLURM_NNODES", 1),
        "init_method": f"tcp://{addr}:{port}",
        "master_addr": addr,
        "master_port": port,
    }


def _explicit(rank: int, world_size: int, init_method: str | None, environ: Mapping[str, str], local_rank: int | None) -> dict:
    if init_method is None:
        if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
            raise ConfigError("rank/world_size were given without init_method, and MASTER_ADDR/MASTER_PORT are not set")
        init_method = "env://"
    launcher = "tcp" if init_method.startswith("tcp://") else "spawn"
    addr, port = None, _int(environ, "MASTER_PORT") if init_method == "env://" else None
    match = re.fullmatch(r"tcp://\[?([^\]]+?)\]?:(\d+)", init_method)
    if match:
        addr, port = match.group(1), int(match.group(2))
    elif not init_method.startswith(("env://", "file://")):
        raise ConfigError(f"init_method={init_method!r} is not valid; valid: 'env://', 'tcp://HOST:PORT' or 'file:///PATH'")
    return {
        "launcher": launcher,
        "rank": rank,
        "local_rank": rank if local_rank is None else local_rank,
        "world_size": world_size,
        "local_world_size": world_size,
        "init_method": init_method,
        "master_addr": addr or environ.get("MASTER_ADDR"),
        "master_port": port,
    }


def _pick_device(local_rank: int, device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigError(f"local rank {local_rank} needs cuda:{local_rank}, but this node has {count} CUDA device(s)")
        return torch.device("cuda", local_rank)
    raise choice_error("device", device, ["auto", "cuda", "cpu"])


def detect_env(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    local_rank: int | None = None,
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DistEnv:
    """Work out the DistEnv without side effects.

    Precedence: an explicit ``rank`` (mp.spawn / tcp://), then torchrun's variables, then SLURM's
    (an srun step with more than one task), else a single process.
    """
    environ = os.environ if environ is None else environ
    if backend not in BACKENDS:
        raise choice_error("backend", backend, BACKENDS)
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not math.isfinite(timeout_s)
        or not 0 < timeout_s <= MAX_TIMEOUT_S
    ):
        raise ConfigError(f"timeout_s={timeout_s!r} is not valid; it must be a number of seconds in (0, {MAX_TIMEOUT_S:g}]")
    if rank is not None:
        _check_explicit_place(rank, world_size, local_rank)
        facts = _explicit(rank, world_size, init_method, environ, local_rank)
    else:
        facts = _launched(environ)
    env = DistEnv(**facts, timeout_s=float(timeout_s))
    if not 0 <= env.rank < env.world_size:
        raise ConfigError(f"rank {env.rank} is outside world size {env.world_size} (launcher {env.launcher})")
    chosen = _pick_device(env.local_rank, device)
    return replace(env, device=chosen, backend=_resolve_backend(backend, chosen) if env.distributed else None)


def _check_explicit_place(rank: int, world_size: int | None, local_rank: int | None) -> None:
    if world_size is None:
        raise ConfigError("rank was given without world_size; pass both (e.g. from mp.spawn)")
    for name, value in (("rank", rank), ("world_size", world_size), ("local_rank", local_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{name}={value!r} is not valid; it must be an integer")


def _launched(environ: Mapping[str, str]) -> dict:
    """The place a launcher's variables give this process: torchrun's, then an srun step's, else none."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and _int(environ, "SLURM_STEP_NUM_TASKS", 1) > 1:
        # Only an srun job step has one process per task; a batch script itself is a single process.
        return _from_slurm(environ)
    return {}


def launched_rank_without_a_group(environ: Mapping[str, str] | None = None) -> DistEnv | None:
    """This process's place when a launcher started several (torchrun, SLURM) but no process group
    exists: the ranks then train independent copies. None otherwise, or when the variables do not parse."""
    try:
        env = detect_env(environ, device="cpu")
    except ConfigError:
        return None
    joined = dist.is_available() and dist.is_initialized()
    return env if env.distributed and not joined else None


def _resolve_backend(backend: str, device: torch.device) -> str:
    """The process group's backend for ``device``: ``auto`` picks NCCL on GPUs and gloo on the CPU."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == HOST_AND_CUDA and device.type != "cuda":
        return "gloo"  # its host half: every tensor of a CPU run is a host tensor
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("backend 'nccl' needs CUDA devices; on CPU use backend 'gloo' (or 'auto')")
    return backend


def init_distributed(env: DistEnv) -> DistEnv:
    """Bind the device and create the process group (no-op for a single process), within
    ``env.timeout_s`` and with one-line failures (``ampddp.distributed.join``).

    Under torchrun the group is built on a fresh namespace of the agent's store (see
    ``ampddp.distributed.rendezvous``), so ``--max-restarts`` restarts connect reliably, and this
    process ends with the agent (``ampddp.distributed.lifeline``).
    """
    if env.under_agent:
        end_with_parent(os.getppid())
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if env.distributed and not dist.is_initialized():
        join_process_group(env)
    return env


def init_one_rank_group(env: DistEnv, backend: str = "auto") -> None:
    """A process group of this one process (on an in-memory store, no port): what FSDP2's device mesh is
    built over when a run has one process. The caller ends it (``shutdown_distributed``)."""
    if env.distributed or dist.is_initialized():
        return
    dist.init_process_group(backend=_resolve_backend(backend, env.device), store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=env.timeout_s))  # fmt: skip


def setup_distributed(**kwargs) -> DistEnv:
    """``detect_env`` + ``init_distributed``: the one call a training script makes."""
    return init_distributed(detect_env(**kwargs))


def shutdown_distributed() -> None:
    """Wait for every rank, then destroy the process group (idempotent).

    The barrier keeps one rank from tearing down gloo connections while a peer is still finishing
    its last collective, which can abort the process at exit. A worker thread can still be releasing
    the last collectives' tensors after the barrier returned (that takes the GIL); a script that
    exits right after this call would then abort in finalization ("terminate called without an
    active exception", seen once in ~50 torchrun runs of the example), so the GIL is given up for a
    short grace first.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:
            pass  # a peer is already gone: nothing left to wait for, and the real error is propagating
        finally:
            dist.destroy_process_group()
            let_worker_threads_finish()


def seed_everything(seed: int) -> None:
    """Seed python, numpy (when installed) and torch on every device with the same value."""
    random.seed(seed)
    numpy.random.seed(seed % 2**32)
    torch.manual_seed(seed)
