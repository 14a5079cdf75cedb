"""ampddp.apex.optimizers' step() against the torch optimizer each corresponds to.

FusedSGD / FusedAdam / FusedAdagrad step through torch's own foreach kernels (fused on CUDA), so
on the CPU they should tie with torch.optim.SGD / AdamW / Adagrad (foreach) and any gap is their
Python overhead. FusedLAMB and FusedNovoGrad have no torch counterpart: they are timed against
torch.optim.AdamW (foreach), the nearest torch step, so the ratio is the price of their extra
work (LAMB: global grad norm and per-tensor trust ratios; NovoGrad: per-tensor grad norms).
The model: ~2M fp32 params in 50 tensors, gradients fixed, only ``step()`` is timed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from harness import Budget, Row, side_by_side

from ampddp.apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD

LAYERS, WIDTH = 25, 280  # 25 x (280 x 280 weight + 280 bias) = 1.97M params in 50 tensors


def many_tensor_params(device: str) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(LAYERS) for shape in ((WIDTH, WIDTH), (WIDTH,))]
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.02) for shape in shapes]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator) * 1e-3
    return [_to(p, device) for p in params]


def _to(param: torch.nn.Parameter, device: str) -> torch.nn.Parameter:
    moved = torch.nn.Parameter(param.detach().to(device))
    moved.grad = param.grad.to(device)
    return moved


def _stepper(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], device: str, steps: int) -> Callable[[], None]:
    optimizer = make(many_tensor_params(device))
    optimizer.step()  # state is created outside the timed region

    def run() -> None:
        for _ in range(steps):
            optimizer.step()

    return run


PAIRS = [
    ("FusedSGD-vs-SGD-foreach", lambda p: FusedSGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4),
     lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-4, foreach=True),
     "same rule; FusedSGD steps through torch's foreach SGD (fused on CUDA)"),
    ("FusedAdam-vs-AdamW-foreach", lambda p: FusedAdam(p, lr=1e-3, weight_decay=0.01),
     lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
     "same rule; FusedAdam steps through torch's foreach AdamW (fused on CUDA)"),
    ("FusedAdagrad-vs-Adagrad-foreach", lambda p: FusedAdagrad(p, lr=1e-2, weight_decay=0.01),
     lambda p: torch.optim.Adagrad(p, lr=1e-2, weight_decay=0.01, foreach=True),
     "same rule; FusedAdagrad steps through torch's foreach Adagrad"),
    ("FusedLAMB-vs-AdamW-foreach", lambda p: FusedLAMB(p, lr=1e-3, weight_decay=0.01),
     lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
     "no torch LAMB: AdamW is the nearest torch step; LAMB adds a global grad norm and per-tensor trust ratios"),
    ("FusedNovoGrad-vs-AdamW-foreach", lambda p: FusedNovoGrad(p, lr=1e-3, weight_decay=0.01),
     lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, foreach=True),
     "no torch NovoGrad: AdamW is the nearest torch step; NovoGrad keeps one second-moment norm per tensor"),
]  # fmt: skip


def run(device: str, budget: Budget) -> list[Row]:
    steps, repeats = budget.pick((1, 1), (5, 7), (20, 15))
    rows = []
    for name, ours, theirs, note in PAIRS:
        rows.append(side_by_side(f"fused-optimizers/{name}", _stepper(ours, device, steps), _stepper(theirs, device, steps),
                                 repeats=repeats, per=steps, note=f"{note}; 1.97M params in 50 tensors"))  # fmt: skip
    return rows
