"""The hand-written torch loops ampddp is compared with, and the same work done through ampddp."""

from __future__ import annotations

import copy
import dataclasses
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


def engine_loop(mode: str, model: nn.Module, data, steps: int, registry=None) -> Callable[[], None]:
    model = copy.deepcopy(model)
    optimizer = sgd(model.parameters())
    options = {"verbosity": 0, "registry": registry} if mode.startswith("O") else {}
    engine = build_engine(mode, **options)
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


def python_registration():
    """A registry naming a plain Python function (never called here): the dispatcher cannot express
    it, so O1/O4 forwards see every torch call through the torch-function mode instead of kernels."""
    import types

    from ampddp import OpRegistry

    registry = OpRegistry()
    registry.register(types.SimpleNamespace(helper=lambda x: x), "helper", "float")
    return registry


AUTOCAST = {"O1": torch.float16, "native-fp16": torch.float16, "native-bf16": torch.bfloat16, "O4": torch.bfloat16}
MASTER_COPY = {"O2": torch.float16, "O5": torch.bfloat16}


def plain_step(mode: str, model: nn.Module, device: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """One training step as a user writes it by hand for the same precision (``model`` is used, not copied)."""
    if mode in MASTER_COPY:
        return _manual_master_step(model, MASTER_COPY[mode])
    if mode == "O3":
        model.half()
    optimizer = sgd(model.parameters())
    dtype = AUTOCAST.get(mode)
    scaler = torch.amp.GradScaler(device, enabled=dtype is torch.float16)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        if mode == "O3":
            x = x.half()
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return step


def plain_loop(mode: str, model: nn.Module, data, steps: int) -> Callable[[], None]:
    """``steps`` hand-written steps on one fixed batch, on a copy of ``model``."""
    x, y = data
    step = plain_step(mode, copy.deepcopy(model), x.device.type)

    def run() -> None:
        for _ in range(steps):
            step(x, y)

    return run


def _manual_master_step(model: nn.Module, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], None]:
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
    device = half[0].device
    inverse = torch.full((1,), 1 / scale, device=device)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        (F.cross_entropy(model(x.to(dtype)).float(), y) * scale).backward()
        grads = [torch.empty_like(m) for m in masters]
        torch._foreach_copy_(grads, [p.grad for p in half])
        for master, grad in zip(masters, grads):
            master.grad = grad
        overflowed = False
        if scaled:
            found = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads + [p.grad for p in full], found, inverse)
            overflowed = bool(found.item())
        if not overflowed:
            optimizer.step()
            with torch.no_grad():
                torch._foreach_copy_(half, masters)
        for p in half:
            p.grad = None

    return step


def trainer_and_plain_epochs(
    mode: str, model: nn.Module, data, batch_size: int, steps: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """``steps`` steps of ampddp's Trainer, and of a hand-written loop, both fed by a shuffling DataLoader."""
    from torch.utils.data import DataLoader, TensorDataset

    from ampddp.distributed import detect_env
    from ampddp.trainer import Trainer

    dataset = TensorDataset(*data)
    env = detect_env({}, device=data[0].device.type)
    trainer = Trainer(copy.deepcopy(model), sgd, dataset, env=env, precision=mode, batch_size=batch_size, max_epochs=10**6,
                      max_steps=steps, log_every=10, report=None)  # fmt: skip

    def ours() -> None:
        trainer.settings = dataclasses.replace(trainer.settings, max_steps=trainer.progress.global_step + steps)
        trainer.fit()

    step = plain_step(mode, copy.deepcopy(model), data[0].device.type)
    batches = endless(DataLoader(dataset, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0)))

    def theirs() -> None:
        for _, (x, y) in zip(range(steps), batches):
            step(x, y)

    return ours, theirs


def endless(loader):
    while True:
        yield from loader
