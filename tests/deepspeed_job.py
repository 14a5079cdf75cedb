"""A DeepSpeed job with the ``"amp"`` section, as DeepSpeed users wrote it (DeepSpeed calls
``amp.initialize`` itself). Run under ``torchrun ... -m ampddp.apex tests/deepspeed_job.py LEVEL --out DIR``
with ``DS_ACCELERATOR=cpu`` on CPU; ``LEVEL`` ``off`` drops the section (the fp32 reference).
Each rank writes ``DIR/rank{N}.json``."""

import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

level, out = sys.argv[1], Path(sys.argv[sys.argv.index("--out") + 1])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
config = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0}
if level != "off":
    config["amp"] = {"enabled": True, "opt_level": level}
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
rank, world = dist.get_rank(), dist.get_world_size()
losses = []
for micro_step in range(8):
    x = torch.randn(8 * world, 16, generator=torch.Generator().manual_seed(micro_step))
    y = x[:, :4].argmax(1)
    loss = F.cross_entropy(engine(x[rank * 8 : rank * 8 + 8]), y[rank * 8 : rank * 8 + 8])
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
report = {"losses": losses, "params": [p.detach().float().tolist() for p in engine.module.parameters()], "version": deepspeed.__version__}
out.joinpath(f"rank{rank}.json").write_text(json.dumps(report))
