"""The loss-scale verdict agreed by every rank whose gradients can differ (``PrecisionEngine.agree_over``): 4 real
gloo processes holding parameters on two device meshes, as FSDP2 x tensor parallelism leaves them (a parameter on
the 1-D data-parallel mesh beside ones on the 2-D mesh). DTensor's dispatch agreed a non-finite gradient only over
the mesh of the first gradient: with an inf in one rank's slice of a 2-D parameter, ranks 0 and 2 stepped and ranks
1 and 3 skipped (or hung, looking for the overflow's origin in a collective the stepping ranks never joined)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampddp import Precision
from ampddp.distributed import launch_local

pytestmark = pytest.mark.timeout(300)
MODES = ("O1", "O2", "native-fp16")
"""A dynamic loss scale: apex's op casting (O1), FSDP2's fp32 sharded masters (O2's engine there), GradScaler."""


class TwoMeshes(nn.Module):
    """One parameter sharded over the 1-D data-parallel mesh (first: its gradient is the one DTensor's dispatch
    agreed over), one over the whole 2-D (dp, tp) mesh."""

    def __init__(self, mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.on_dp = nn.Parameter(distribute_tensor(torch.randn(4, 4, generator=generator), mesh["dp"], [Shard(0)]))
        self.on_both = nn.Parameter(distribute_tensor(torch.randn(4, 4, generator=generator), mesh, [Shard(0), Shard(1)]))

    def forward(self) -> torch.Tensor:
        return (self.on_dp.to_local().float() ** 2).sum() + (self.on_both.to_local().float() ** 2).sum()


def planted_step(env, engine, model, optimizer, value: float, clip: bool) -> dict[str, object]:
    """One step with ``value`` planted in rank 1's slice of the 2-D parameter (its gradient, still scaled);
    ``clip``: clipped first, by the global norm over both meshes."""
    before = [param.detach().to_local().clone() for param in model.parameters()]
    with engine.forward_context():
        loss = model()
    engine.backward(loss)
    if env.rank == 1:
        model.on_both.grad.to_local().view(-1)[0] = value
    norm = float(engine.clip_grad_norm_([optimizer], 1.0)) if clip else None
    stepped = engine.step(optimizer)
    unchanged = all(torch.equal(old, param.detach().to_local()) for old, param in zip(before, model.parameters()))
    return {"stepped": stepped, "unchanged": unchanged, "scale": engine.loss_scale(), "skipped": engine.skipped_steps, "norm": norm}


def verdict_worker(env) -> dict[str, list[dict[str, object]]]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for mode in MODES:
        model = TwoMeshes(mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = Precision(mode).build_sharded_engine()
        engine.setup([model], [optimizer])
        engine.agree_over(dist.group.WORLD)  # what the sharding strategy sets: every rank's gradients can differ
        inf = planted_step(env, engine, model, optimizer, float("inf"), clip=False)
        # Finite once unscaled (1e30 / 2**15), but its square is not: the gradient norm alone says overflow.
        norm = planted_step(env, engine, model, optimizer, 1e30, clip=True)
        results[mode] = [inf, norm]
    return results


def test_every_rank_skips_when_one_rank_of_a_mixed_mesh_overflows():
    for rank, result in enumerate(launch_local(verdict_worker, 4, device="cpu", timeout_s=60, job_timeout_s=240)):
        for mode, (inf, norm) in result.items():
            assert inf == {"stepped": False, "unchanged": True, "scale": 2.0**15, "skipped": 1, "norm": None}, (rank, mode, inf)
            assert norm == {"stepped": False, "unchanged": True, "scale": 2.0**14, "skipped": 2, "norm": float("inf")}, (rank, mode, norm)
