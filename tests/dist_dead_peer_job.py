"""Run as two processes (rank as argv[1], port as argv[2]): rank 1 dies, rank 0 must name it."""

import os
import sys
import time

import torch
import torch.distributed as dist

from ampddp.distributed import setup_distributed
from ampddp.distributed.watch import PeerFailureError, PeerWatch

rank, port = int(sys.argv[1]), int(sys.argv[2])
env = setup_distributed(rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}", device="cpu", timeout_s=10)
with PeerWatch(env, interval_s=0.2) as watch:
    dist.barrier()
    time.sleep(0.5)
    if rank == 1:
        os._exit(9)
    start = time.monotonic()
    try:
        with watch.guard():
            for _ in range(100):
                dist.all_reduce(torch.ones(1))
                time.sleep(0.05)
    except PeerFailureError as error:
        print(f"after {time.monotonic() - start:.1f}s: {error}", flush=True)
        os._exit(3)
print("no failure seen", flush=True)
