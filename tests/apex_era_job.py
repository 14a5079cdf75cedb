"""An apex-era training script of the 2019-2024 kind, for the runner tests: it imports ``apex`` and is
never edited. Run as ``python -m ampddp.apex tests/apex_era_job.py --out DIR`` (one process) or under
torchrun / torch.distributed.launch with ``-m ampddp.apex``. Each rank writes what it saw to DIR."""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

try:
    from apex import amp
    from apex.parallel import DistributedDataParallel as ApexDDP
    from apex.parallel import convert_syncbn_model

    has_apex = True
except ImportError:
    has_apex = False

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=0)
parser.add_argument("--opt-level", default="O1")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", required=True)
args = parser.parse_args()

distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
if distributed:
    dist.init_process_group("gloo", init_method="env://")
rank = dist.get_rank() if distributed else 0
world = dist.get_world_size() if distributed else 1

torch.manual_seed(1234 + rank)  # ranks seeded differently: DDP must make them agree
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
if distributed:
    model = convert_syncbn_model(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
if distributed:
    model = ApexDDP(model, delay_allreduce=True)

data = torch.Generator().manual_seed(0)
loss_dtypes = []
for _step in range(args.steps):
    x = torch.randn(8 * world, 8, generator=data)
    y = x[:, :4].argmax(1)
    mine = slice(rank * 8, rank * 8 + 8)
    output = model(x[mine])
    loss = F.cross_entropy(output, y[mine])
    loss_dtypes.append(str(loss.dtype))
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

module = model.module if hasattr(model, "module") else model
report = {
    "has_apex": has_apex,
    "argv": sys.argv,
    "name": __name__,
    "path0": sys.path[0],
    "local_rank": args.local_rank,
    "env_local_rank": os.environ.get("LOCAL_RANK"),
    "apex_module": amp.__name__,
    "output_dtype": str(output.dtype),
    "loss_dtypes": loss_dtypes,
    "loss_scale": amp._amp_state.loss_scalers[0].loss_scale(),
    "params": [p.detach().double().sum().item() for p in module.parameters()],
    "masters": [p.detach().double().sum().item() for p in amp.master_params(optimizer)],
}
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as handle:
    json.dump(report, handle)
if distributed:
    dist.destroy_process_group()
