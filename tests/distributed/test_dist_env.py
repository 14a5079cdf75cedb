"""DistEnv from every launcher's variables (pure parsing: nothing is launched here)."""

from __future__ import annotations

import pytest
import torch

from ampddp import ConfigError
from ampddp.distributed import detect_env
from ampddp.distributed.env import first_slurm_host


def test_single_process_without_launcher():
    env = detect_env({})
    assert (env.rank, env.world_size, env.launcher, env.backend, env.distributed) == (0, 1, "none", None, False)
    assert env.device == torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_torchrun_variables():
    environ = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
               "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    env = detect_env(environ, device="cpu")
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.launcher, env.init_method) == (1, 2, "torchrun", "env://")
    assert (env.master_addr, env.master_port, env.backend) == ("10.0.0.1", 29500, "gloo")
    assert env.rank_seed(7) != detect_env({**environ, "RANK": "2"}, device="cpu").rank_seed(7)
    assert not env.agent_store
    assert detect_env({**environ, "TORCHELASTIC_USE_AGENT_STORE": "True"}, device="cpu").agent_store


def test_slurm_variables_and_node_list():
    environ = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NODEID": "2", "SLURM_NNODES": "4",
               "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "gpu[07-10],login1", "SLURM_JOB_ID": "123456"}  # fmt: skip
    env = detect_env(environ, device="cpu")
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 2)
    assert (env.node_rank, env.num_nodes, env.launcher) == (2, 4, "slurm")
    assert env.master_addr == "gpu07" and env.init_method == f"tcp://gpu07:{env.master_port}"
    assert env.master_port == detect_env({**environ, "SLURM_PROCID": "0"}, device="cpu").master_port
    assert detect_env({**environ, "MASTER_PORT": "4000"}, device="cpu").master_port == 4000


@pytest.mark.parametrize(
    ("nodelist", "host"), [("node1", "node1"), ("a[3-5]", "a3"), ("gpu[012,015]", "gpu012"), ("x1,x2", "x1"), ("a[1-2]b,c", "a1b")]
)
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_single_task_slurm_and_a_batch_script_are_single_process():
    assert detect_env({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, device="cpu").launcher == "none"
    batch_script = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert detect_env(batch_script, device="cpu").launcher == "none"


def test_torchrun_inside_slurm_takes_torchrun_variables():
    environ = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert detect_env(environ, device="cpu").launcher == "torchrun"


def test_explicit_tcp_and_spawn():
    env = detect_env({}, rank=1, world_size=2, init_method="tcp://127.0.0.1:23456", device="cpu")
    assert (env.launcher, env.master_addr, env.master_port, env.local_rank) == ("tcp", "127.0.0.1", 23456, 1)
    spawned = detect_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "2"}, rank=0, world_size=3, device="cpu")
    assert (spawned.launcher, spawned.init_method, spawned.world_size) == ("spawn", "env://", 3)


@pytest.mark.parametrize(
    ("environ", "kwargs", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, {}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, {}, "rank 2 is outside world size 2"),
        ({}, {"rank": 0}, "without world_size"),
        ({}, {"rank": 0, "world_size": 2}, "MASTER_ADDR/MASTER_PORT"),
        ({}, {"rank": 0, "world_size": 2, "init_method": "http://x"}, "init_method='http://x'"),
        ({}, {"backend": "mpi"}, "valid choices: auto, nccl, gloo"),
        ({}, {"device": "tpu"}, "valid choices: auto, cuda, cpu"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}, {}, "SLURM_JOB_NODELIST"),
        ({}, {"timeout_s": 0}, "timeout_s=0"),
        ({}, {"timeout_s": float("nan")}, "timeout_s=nan"),
        ({}, {"rank": "1", "world_size": 2, "init_method": "tcp://h:1"}, "rank='1' is not valid"),
    ],
)
def test_bad_launch_settings_are_named(environ, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        detect_env(environ, **{"device": "cpu", **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_cuda_requested_without_devices():
    with pytest.raises(ConfigError, match="CUDA device"):
        detect_env({}, device="cuda")
    with pytest.raises(ConfigError, match="nccl"):
        detect_env({}, rank=0, world_size=2, init_method="tcp://h:1", backend="nccl", device="cpu")
