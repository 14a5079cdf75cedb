"""The O2 optimizer step (unscale + overflow check + master step + copy back) vs an fp32 step.

Both sides get their gradients from the same trivial loss (a weighted sum of the parameters), so
the comparison is dominated by what happens after backward.
"""

from __future__ import annotations

import copy
import warnings

import torch
from harness import Budget, Row, side_by_side
from loops import many_layer_mlp, sgd
from torch.overrides import TorchFunctionMode

from ampddp import build_engine


def _params_loss(model: torch.nn.Module) -> torch.Tensor:
    return sum((p.float() * 1e-3).sum() for p in model.parameters())


HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__}


class _HostReadCounter(TorchFunctionMode):
    """Counts reads of tensor values into Python: each one is a host synchronisation on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.reads += func in HOST_READS
        return func(*args, **(kwargs or {}))


def host_syncs(fn, device: str) -> str:
    """Host synchronisations during one call of ``fn``: CUDA's sync debug mode on a GPU, else value reads."""
    if device != "cuda":
        with _HostReadCounter() as counter:
            fn()
        return f"tensor values read by the host per O2 step: {counter.reads} (each is a synchronisation on a GPU)"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return f"host synchronisations per O2 step: {sum('synchroniz' in str(w.message) for w in caught)} (CUDA sync debug mode)"


def run(device: str, budget: Budget) -> list[Row]:
    base = many_layer_mlp().to(device)
    o2_model, fp32_model = copy.deepcopy(base), copy.deepcopy(base)
    o2_opt, fp32_opt = sgd(o2_model.parameters()), sgd(fp32_model.parameters())
    engine = build_engine("O2", verbosity=0)  # dynamic loss scale: the overflow check is part of the step
    engine.setup([o2_model], [o2_opt])
    steps, repeats = budget.pick((1, 1), (5, 9), (20, 15))

    def o2_step() -> None:
        o2_opt.zero_grad(set_to_none=True)
        engine.backward(_params_loss(o2_model))
        engine.step(o2_opt)

    def fp32_step() -> None:
        fp32_opt.zero_grad(set_to_none=True)
        _params_loss(fp32_model).backward()
        fp32_opt.step()

    def repeat(fn):
        return lambda: [fn() for _ in range(steps)]

    row = side_by_side("optimizer-step/O2-vs-fp32", repeat(o2_step), repeat(fp32_step), repeats=repeats, per=steps)
    row.note = host_syncs(o2_step, device)
    return [row]
