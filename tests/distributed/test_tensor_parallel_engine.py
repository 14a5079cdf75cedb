"""Every precision mode over a model the user split with torch's tensor parallelism (DTensor parameters), on 2 real
gloo processes: ``amp.initialize`` at O0-O5 and the native engines train a column/row-split MLP (a LayerNorm left
whole beside it: plain parameters next to DTensors; the head replicated by ampddp's ``replicate`` style) to the
losses of the same mode on the unsplit model; an inf in one rank's shard makes every rank skip and halve its scale,
the weights untouched. Before, O2, O3 and O5 failed (the cast changed a DTensor's outer dtype, not its shard:
``mat1 and mat2 must have the same dtype``) and the masters' foreach copy had no DTensor rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampddp import Precision
from ampddp.amp import Amp
from ampddp.distributed import launch_local
from ampddp.distributed.tensor_parallel import check_table
from ampddp.precision.verdict import group_for_sharded

pytestmark = pytest.mark.timeout(300)
OPT_LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")
NATIVE = ("native-fp16", "native-bf16")
LOSS_SCALED = ("O1", "O2", "native-fp16")
STEPS = 4
TOLERANCE = {"O0": 1e-6}
"""How far (relative) the split model's losses may be from the unsplit model's in the same mode: at fp32, sums in
another order; in fp16/bf16 (5e-3, measured up to 1.6e-3) a row-split's two half products are rounded, then added."""


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with an epsilon fp16 holds (O3 steps fp16 weights: torch's 1e-8 is 0 there, and 0/0 a NaN)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(STEPS)]


def split(model: nn.Module, mesh) -> nn.Module:
    """The MLP's pair split column- then row-wise, its head replicated (a DTensor whole on both ranks), the LayerNorm plain."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, check_table(model, {"0": "colwise", "2": "rowwise", "4": "replicate"}))


class Facade:
    """apex's API on ampddp: ``amp.initialize`` at an opt level, ``scale_loss`` around the backward."""

    def __init__(self, model: nn.Module, mode: str) -> None:
        self.amp = Amp()
        self.model, self.optimizer = self.amp.initialize(model, adamw(model), opt_level=mode, verbosity=0)

    def step(self, x: torch.Tensor, y: torch.Tensor, plant: float | None = None) -> float:
        loss = nn.functional.cross_entropy(self.model(x).float(), y)
        with self.amp.scale_loss(loss, self.optimizer) as scaled:
            scaled.backward()
            if plant is not None:
                self.model[0].weight.grad.to_local().view(-1)[0] = plant
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.item()

    def scale(self) -> float:
        return self.amp.state_dict()["loss_scaler0"]["loss_scale"]


class Engine:
    """The native engines (torch.autocast, GradScaler for fp16) through the engine interface."""

    def __init__(self, model: nn.Module, mode: str) -> None:
        self.model, self.optimizer = model, adamw(model)
        self.engine = Precision(mode).build_engine()
        self.engine.setup([model], [self.optimizer])
        self.engine.agree_over(group_for_sharded(model.parameters()))

    def step(self, x: torch.Tensor, y: torch.Tensor, plant: float | None = None) -> float:
        with self.engine.forward_context():
            loss = nn.functional.cross_entropy(self.model(x).float(), y)
        self.engine.backward(loss)
        if plant is not None:
            self.model[0].weight.grad.to_local().view(-1)[0] = plant
        self.engine.step(self.optimizer)
        self.optimizer.zero_grad()
        return loss.item()

    def scale(self) -> float:
        return self.engine.loss_scale()


def runner(mode: str):
    return Engine if mode in NATIVE else Facade


def whole(model: nn.Module) -> list[torch.Tensor]:
    return [(param.full_tensor() if hasattr(param, "full_tensor") else param).detach().float() for param in model.parameters()]


def worker(env) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    results: dict[str, object] = {}
    for mode in (*OPT_LEVELS, *NATIVE):
        run, reference = runner(mode)(split(build(), mesh), mode), runner(mode)(build(), mode)
        data = batches()
        results[mode] = [(run.step(x, y), reference.step(x, y)) for x, y in data]
        if mode in LOSS_SCALED:
            before, scale = whole(run.model), run.scale()
            # rank 1 alone finds an inf, in its half of the first layer's weight gradient (the scaled one)
            run.step(*data[0], plant=float("inf") if env.rank == 1 else None)
            results[f"{mode} planted"] = {"scale halved": run.scale() == scale / 2,
                                          "unchanged": all(torch.equal(a, b) for a, b in zip(before, whole(run.model)))}  # fmt: skip
    return results


def test_every_mode_trains_a_tensor_parallel_model_and_agrees_its_skips():
    for rank, result in enumerate(launch_local(worker, 2, device="cpu", timeout_s=60, job_timeout_s=240)):
        for mode in (*OPT_LEVELS, *NATIVE):
            for split_loss, whole_loss in result[mode]:
                assert split_loss == pytest.approx(whole_loss, rel=TOLERANCE.get(mode, 5e-3)), (rank, mode)
        for mode in LOSS_SCALED:
            assert result[f"{mode} planted"] == {"scale halved": True, "unchanged": True}, (rank, mode)
