"""An mmengine training job as its users write it: a BaseModel, a Runner, ``ApexOptimWrapper``.

Run under ``python -m ampddp.apex`` (1 process) or ``torchrun ... -m ampddp.apex`` (2 processes):
mmengine imports ``apex.amp`` itself, wraps the model in DDP first and calls ``amp.initialize`` on
``model.module`` inside its first iteration. On CPU the job starts the gloo group and wraps the model
itself, because mmengine's own ``init_dist`` calls ``torch.cuda.set_device`` and its default wrapper
passes ``device_ids`` (both CUDA-only). Writes ``rank{N}.json`` (losses, weights, amp state) to --out.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mmengine.dataset import DefaultSampler
from mmengine.model import BaseModel, MMDistributedDataParallel
from mmengine.runner import Runner
from torch import nn
from torch.utils.data import Dataset


class Net(BaseModel):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, inputs, labels, mode="tensor"):
        logits = self.fc2(F.relu(self.bn(self.fc1(inputs))))
        if mode == "loss":
            return {"loss": F.cross_entropy(logits, labels)}
        return logits


class Points(Dataset):
    def __init__(self, count=256):
        generator = torch.Generator().manual_seed(7)
        self.inputs = torch.randn(count, 16, generator=generator)
        self.labels = self.inputs[:, :4].argmax(1)

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return {"inputs": self.inputs[index], "labels": self.labels[index]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O1")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--work-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    torch.manual_seed(0)
    model = Net()
    if distributed:
        dist.init_process_group("gloo")
        model = MMDistributedDataParallel(module=model, broadcast_buffers=False)
    losses = []

    from mmengine.hooks import Hook

    class RecordLoss(Hook):
        def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
            losses.append(float(outputs["loss"]))

    optimizer = dict(type="SGD", lr=0.05, momentum=0.9)
    optim_wrapper = dict(type="ApexOptimWrapper", opt_level=args.opt_level, loss_scale="dynamic", optimizer=optimizer)
    runner = Runner(
        model=model,
        work_dir=args.work_dir,
        train_dataloader=dict(
            dataset=Points(),
            sampler=dict(type=DefaultSampler, shuffle=True),
            batch_size=16,
            num_workers=0,
            collate_fn=dict(type="default_collate"),
        ),
        optim_wrapper=optim_wrapper,
        train_cfg=dict(by_epoch=False, max_iters=args.iters),
        default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=4, by_epoch=False), logger=dict(type="LoggerHook", interval=4)),
        custom_hooks=[dict(type=RecordLoss)],
        launcher="pytorch" if distributed else "none",
        env_cfg=dict(dist_cfg=dict(backend="gloo")),
        randomness=dict(seed=0),
        resume=args.resume,
    )
    runner.train()
    import apex.amp

    optimizer = runner.optim_wrapper.optimizer
    inner = runner.model.module if distributed else runner.model
    report = {
        "losses": losses,
        "iter": runner.iter,
        "params": {name: p.detach().float().tolist() for name, p in inner.named_parameters()},
        "dtypes": sorted({str(p.dtype) for p in inner.parameters()}),
        "masters": [p.detach().tolist() for p in apex.amp.master_params(optimizer)],
        "amp_state": apex.amp.state_dict(),
        "has_stash": hasattr(optimizer, "_amp_stash"),
    }
    rank = dist.get_rank() if distributed else 0
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
