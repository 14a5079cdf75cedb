"""The hand-written torch loops ampddp is compared with, and the same work done through ampddp."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ampddp import build_engine
from ampddp.amp import Amp


def many_layer_mlp(width: int = 256, depth: int = 8) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width)]
    for _ in range(depth):
        layers += [nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, width)]
    layers += [nn.ReLU(), nn.Linear(width, 10)]
    return nn.Sequential(*layers)


def resnet(depth: int = 18, classes: int = 10) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, f"resnet{depth}")(num_classes=classes)


def batch(size: int, device: str, shape: tuple[int, ...] = (64,), classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic inputs and labels, made on the CPU with a fixed seed and moved to ``device``."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(size, *shape, generator=generator)
    return x.to(device), torch.randint(0, classes, (size,), generator=generator).to(device)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def engine_loop(mode: str, model: nn.Module, data, steps: int) -> Callable[[], None]:
    model = copy.deepcopy(model)
    optimizer = sgd(model.parameters())
    engine = build_engine(mode, **({"verbosity": 0} if mode.startswith("O") else {}))
    engine.setup([model], [optimizer])
    x, y = data

    def run() -> None:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with engine.forward_context():
                loss = F.cross_entropy(model(x), y)
            engine.backward(loss)
            engine.step(optimizer)

    return run


def facade_loop(level: str, model: nn.Module, data, steps: int) -> Callable[[], None]:
    amp = Amp()
    model = copy.deepcopy(model)
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level=level, verbosity=0)
    x, y = data

    def run() -> None:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()

    return run


AUTOCAST = {"O1": torch.float16, "native-fp16": torch.float16, "native-bf16": torch.bfloat16, "O4": torch.bfloat16}
MASTER_COPY = {"O2": torch.float16, "O5": torch.bfloat16}


def plain_loop(mode: str, model: nn.Module, data, steps: int) -> Callable[[], None]:
    """What a user writes by hand for the same precision."""
    model = copy.deepcopy(model)
    x, y = data
    device = x.device.type
    if mode == "O3":
        model.half()
        x = x.half()
    if mode in MASTER_COPY:
        return _manual_master_loop(model, x, y, steps, MASTER_COPY[mode])
    optimizer = sgd(model.parameters())
    dtype = AUTOCAST.get(mode)
    scaler = torch.amp.GradScaler(device, enabled=dtype is torch.float16)

    def run() -> None:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()

    return run


def _manual_master_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, dtype: torch.dtype) -> Callable[[], None]:
    """Low-precision model (BatchNorm fp32), fp32 master copy: the classic O2/O5 by hand.

    fp16 scales the loss and skips a step whose gradients overflowed; bf16 (the range of fp32) does
    neither, as ampddp's O5 does not.
    """
    for module in model.modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)
    half = [p for p in model.parameters() if p.dtype == dtype]
    masters = [p.detach().float().requires_grad_() for p in half]
    full = [p for p in model.parameters() if p.dtype == torch.float32]
    optimizer = sgd(masters + full)
    scaled = dtype == torch.float16
    scale = 2.0**16 if scaled else 1.0
    inverse = torch.full((1,), 1 / scale, device=x.device)
    x = x.to(dtype)

    def run() -> None:
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            (F.cross_entropy(model(x).float(), y) * scale).backward()
            grads = [torch.empty_like(m) for m in masters]
            torch._foreach_copy_(grads, [p.grad for p in half])
            for master, grad in zip(masters, grads):
                master.grad = grad
            found = torch.zeros(1, device=x.device)
            if scaled:
                torch._amp_foreach_non_finite_check_and_unscale_(grads + [p.grad for p in full], found, inverse)
            if not scaled or not found.item():
                optimizer.step()
                with torch.no_grad():
                    torch._foreach_copy_(half, masters)
            for p in half:
                p.grad = None

    return run
