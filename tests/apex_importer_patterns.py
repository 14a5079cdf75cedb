"""How libraries and NVIDIA's examples that still import apex drive it, one pattern per name, written
from reading their sources (no code of theirs): NVIDIA DeepLearningExamples' BERT pretraining and
SQuAD, GNMT and SSD; ColossalAI's ``convert_to_apex_amp``; DeepSpeed's ``"amp"`` config path; OpenNMT-py;
fairseq's fused layer norm, FusedAdam subclass and grad norm.

Run under the runner, one pattern per process: ``python -m ampddp.apex tests/apex_importer_patterns.py
PATTERN --out DIR`` (``bert-pretraining`` and ``bert-squad`` under ``torchrun --nproc-per-node 2``).
Each rank writes ``DIR/rank{N}.json``: losses, loss scales, final weights.
"""

import argparse
import json
import os
from pathlib import Path

import amp_C
import apex
import apex_C
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from apex import amp
from apex.amp import _amp_state
from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import FusedAdam, FusedLAMB
from apex.parallel import DistributedDataParallel as ApexDDP
from apex.parallel.distributed import flat_dist_call

parser = argparse.ArgumentParser()
parser.add_argument("pattern")
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--stop-at", type=int, default=None, help="save a checkpoint after this many steps and exit")
parser.add_argument("--resume", default=None, help="a checkpoint written with --stop-at")
parser.add_argument("--loss-scale", default="dynamic")
args = parser.parse_args()

distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0
world = dist.get_world_size() if distributed else 1


def batch(step, size=16, features=16, classes=4):
    """This rank's shard of step ``step``'s global batch."""
    x = torch.randn(size * world, features, generator=torch.Generator().manual_seed(100 + step))
    y = x[:, :classes].argmax(1)
    return x[rank * size : (rank + 1) * size], y[rank * size : (rank + 1) * size]


def encoder():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), apex.normalization.FusedLayerNorm(64), nn.GELU(), nn.Linear(64, 4))


report = {"losses": [], "scales": [], "skipped": 0}


def bert_pretraining():
    """O2, FusedLAMB, fp16 outputs, BERT's own initial scale; no DDP: after gradient accumulation the
    master grads are re-scaled into one flat fp16 buffer, all-reduced, unscaled with an overflow flag,
    and the step is taken or skipped by ``update_scale()`` (``scale_loss(..., delay_overflow_check=True)``)."""
    accumulation = 2
    model = encoder()
    optimizer = FusedLAMB(model.parameters(), lr=2e-3)
    loss_scale = "dynamic" if args.loss_scale == "dynamic" else float(args.loss_scale)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale=loss_scale, cast_model_outputs=torch.float16)
    if loss_scale == "dynamic":
        _amp_state.loss_scalers[0]._loss_scale = 2.0**20
    first = 0
    if args.resume:
        checkpoint = torch.load(args.resume, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        optimizer._lazy_init_maybe_master_weights()
        optimizer._amp_stash.lazy_init_called = True
        optimizer.load_state_dict(checkpoint["optimizer"])
        for param, saved in zip(amp.master_params(optimizer), checkpoint["master params"]):
            param.data.copy_(saved.data)
        first = checkpoint["step"]
    flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,))
    overflow_buf = torch.zeros(1, dtype=torch.int)
    for step in range(first, args.steps):
        for micro in range(accumulation):
            x, y = batch(step * accumulation + micro)
            loss = F.cross_entropy(model(x).float(), y) / accumulation
            with amp.scale_loss(loss, optimizer, delay_overflow_check=True) as scaled:
                scaled.backward()
        scale = _amp_state.loss_scalers[0].loss_scale()
        grads = [p.grad for p in amp.master_params(optimizer) if p.grad is not None]
        flat = torch.empty(sum(g.numel() for g in grads), dtype=torch.float16)
        views = apex_C.unflatten(flat, grads)
        overflow_buf.zero_()
        amp_C.multi_tensor_scale(65536, overflow_buf, [grads, views], scale / (world * accumulation))
        dist.all_reduce(flat)
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [views, grads], 1.0 / scale)
        scaler = _amp_state.loss_scalers[0]
        previous = scaler._overflow_buf
        scaler._overflow_buf = overflow_buf
        had_overflow = scaler.update_scale()
        scaler._overflow_buf = previous if previous is not None else overflow_buf
        if not had_overflow:
            optimizer.step()
        else:
            report["skipped"] += 1
            if _amp_state.opt_properties.master_weights:
                for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                    param.grad = None
        for param in model.parameters():
            param.grad = None
        report["losses"].append(loss.item() * accumulation)
        report["scales"].append(_amp_state.loss_scalers[0].loss_scale())
        if args.stop_at is not None and step + 1 == args.stop_at:
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "master params": list(amp.master_params(optimizer)), "step": step + 1}, Path(args.out, "ckpt.pt"))  # fmt: skip
            break
    return model


def bert_squad():
    """O2 with BatchNorm cast too, FusedAdam without bias correction, apex DDP (no arguments) after
    initialize, and a gradient clipper of its own on the master params through amp_C, every micro-step."""
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    torch.manual_seed(0)
    optimizer = FusedAdam(model.parameters(), lr=1e-2, bias_correction=False)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", keep_batchnorm_fp32=False, loss_scale="dynamic")
    model = ApexDDP(model)
    buf = torch.zeros(1, dtype=torch.int)

    def clip(params, max_norm=1.0):
        grads = [p.grad for p in params if p.grad is not None]
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [grads], False)
        if not torch.isfinite(norm).item():
            return
        coefficient = max_norm / (norm.item() + 1e-6)
        if coefficient < 1:
            multi_tensor_applier(amp_C.multi_tensor_scale, buf, [grads, grads], coefficient)

    for step in range(args.steps):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        clip(amp.master_params(optimizer))
        optimizer.step()
        optimizer.zero_grad()
        report["losses"].append(loss.item())
        report["scales"].append(_amp_state.loss_scalers[0].loss_scale())
    return model.module


def gnmt():
    """O2 with fp16 outputs, its scheduler built before initialize, its own initial scale and growth
    interval written into apex's scaler, clipping on the master params, ``model.zero_grad()``."""
    model = encoder()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[3], gamma=0.5)
    model, optimizer = amp.initialize(model, optimizer, cast_model_outputs=torch.float16, keep_batchnorm_fp32=False, opt_level="O2")
    scaler = apex.amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 8192.0
    scaler._scale_seq_len = 2
    for step in range(args.steps):
        x, y = batch(step)
        loss = F.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 5.0)
        scheduler.step()
        optimizer.step()
        model.zero_grad()
        report["losses"].append(loss.item())
        report["scales"].append(_amp_state.loss_scalers[0].loss_scale())
    report["lrs"] = [group["lr"] for group in optimizer.param_groups]
    return model


def ssd():
    """O2 on a conv net whose normalisation constants are made half by hand when amp is on."""
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 4)]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1).half()
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(step)
        labels = torch.randint(0, 3, (8,), generator=generator)
        images = (torch.rand(8, 3, 8, 8, generator=generator) * 0.2 + F.one_hot(labels, 3).view(8, 3, 1, 1)).half()
        loss = F.cross_entropy(model(images - mean), labels)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        report["losses"].append(loss.item())
    return model


def colossalai():
    """``convert_to_apex_amp``: initialize with a config dict, torch DDP afterwards, an optimizer
    wrapper whose backward is ``scale_loss`` and whose clipping takes the master params."""
    model = encoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    amp_config = {"opt_level": "O2", "keep_batchnorm_fp32": False, "loss_scale": 2.0**5}
    model, optimizer = apex.amp.initialize(model, optimizer, **amp_config)

    class ApexAmpOptimizer:
        def __init__(self, optim):
            self.optim = optim

        def backward(self, loss):
            with apex.amp.scale_loss(loss, self.optim) as scaled:
                scaled.backward()

        def clip_grad_norm(self, max_norm):
            torch.nn.utils.clip_grad_norm_(apex.amp.master_params(self.optim), max_norm)

    wrapped = ApexAmpOptimizer(optimizer)
    for step in range(args.steps):
        x, y = batch(step)
        wrapped.optim.zero_grad()
        loss = F.cross_entropy(model(x), y)
        wrapped.backward(loss)
        wrapped.clip_grad_norm(1.0)
        wrapped.optim.step()
        report["losses"].append(loss.item())
    return model


def deepspeed():
    """DeepSpeed's ``"amp"`` section: ``amp.initialize(module, optimizer, **params)``, gradient
    accumulation through ``delay_unscale`` off the boundary, clipping on the master params."""
    amp_params = {"opt_level": "O1"}
    module = encoder()
    basic_optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module, optimizer = amp.initialize(module, basic_optimizer, **amp_params)
    accumulation = 2
    for step in range(args.steps):
        for micro in range(accumulation):
            x, y = batch(step * accumulation + micro)
            loss = F.cross_entropy(module(x), y) / accumulation
            boundary = micro == accumulation - 1
            with amp.scale_loss(loss, optimizer, delay_unscale=not boundary) as scaled:
                scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        report["losses"].append(loss.item() * accumulation)
    return module


def opennmt():
    """``amp.initialize([model, model.generator], ...)`` with the generator a submodule of the model,
    the returned models thrown away (the cast is in place), ``optimizer.zero_grad()``."""

    class Translator(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
            self.generator = nn.Sequential(nn.Linear(32, 4), nn.LogSoftmax(dim=-1))

        def forward(self, x):
            return self.body(x)

    torch.manual_seed(0)
    model = Translator()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    amp.initialize([model, model.generator], optimizer, opt_level=args.loss_scale if args.loss_scale.startswith("O") else "O2",
                   loss_scale="dynamic", keep_batchnorm_fp32=None)  # fmt: skip
    for step in range(args.steps):
        x, y = batch(step)
        loss = F.nll_loss(model.generator(model(x)).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
        report["losses"].append(loss.item())
    return model


def fairseq():
    """fairseq's apex imports without amp: its LayerNorm subclasses apex's FusedLayerNorm; its FusedAdamV2
    subclasses apex's FusedAdam, checks for ``multi_tensor_adam`` and steps through
    ``multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, [g, p, m, v], ...)``; its
    grad norm is ``amp_C.multi_tensor_l2norm`` with a ``(1, 1)`` flag. Checked against torch's AdamW."""

    class FairseqLayerNorm(apex.normalization.FusedLayerNorm):
        def forward(self, x):
            return super().forward(x)

    class FusedAdamV2(FusedAdam):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            if not hasattr(self, "multi_tensor_adam"):
                raise RuntimeError("Apex installation is outdated. Please install an updated version of apex.")

        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                beta1, beta2 = group["betas"]
                g32, p32, m32, v32 = [], [], [], []
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    state = self.state[param]
                    if not state:
                        state["exp_avg"] = torch.zeros_like(param, dtype=torch.float)
                        state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float)
                    g32.append(param.grad.data)
                    p32.append(param.data)
                    m32.append(state["exp_avg"])
                    v32.append(state["exp_avg_sq"])
                multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, [g32, p32, m32, v32], group["lr"], beta1,
                                     beta2, group["eps"], group["step"], self.adam_w_mode, 1, group["weight_decay"])  # fmt: skip

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), FairseqLayerNorm(64), nn.GELU(), nn.Linear(64, 4))

    model, reference = build(), build()
    optimizer = FusedAdamV2(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch_adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(args.steps):
        x, y = batch(step)
        for net, opt in ((model, optimizer), (reference, torch_adamw)):
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
        grads = [p.grad for p in model.parameters()]
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, torch.zeros((1, 1), dtype=torch.int), [grads], False)
        report.setdefault("norms", []).append([norm.item(), torch.norm(torch.stack([g.norm() for g in grads])).item()])
        report["losses"].append(loss.item())
    report["max_diff_to_torch_adamw"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return model


PATTERNS = {"bert-pretraining": bert_pretraining, "bert-squad": bert_squad, "gnmt": gnmt, "ssd": ssd,
            "colossalai": colossalai, "deepspeed": deepspeed, "opennmt": opennmt, "fairseq": fairseq}  # fmt: skip
trained = PATTERNS[args.pattern]()
report["params"] = [p.detach().float().tolist() for p in trained.parameters()]
report["dtypes"] = sorted({str(p.dtype) for p in trained.parameters()})
Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
if distributed:
    dist.destroy_process_group()
