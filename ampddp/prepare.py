"""The one fixed set-up order for a training run: SyncBN -> device -> optimizer -> precision -> DDP.

Precision conversion and the fp32 master copy are one step (``engine.setup``) so that masters are
taken from the exact fp32 weights; it runs after the optimizer exists and before DDP wraps the
model. SyncBN conversion comes first so the converted BatchNorm layers are the ones the optimizer
holds and O2/O5 keeps fp32. Rank 0's initial weights are broadcast before masters are made, so
masters and model agree on every rank even if ranks were seeded differently.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ampddp.choices import SYNC_BN_CHOICES
from ampddp.distributed.env import DistEnv
from ampddp.distributed.model_agreement import check_models_agree
from ampddp.distributed.sync_bn import convert_sync_batchnorm
from ampddp.distributed.wrap import DDPOptions, GradSync, wrap_model
from ampddp.errors import choice_error
from ampddp.precision.engine import PrecisionEngine
from ampddp.precision.factory import build_engine
from ampddp.precision.registry import OpRegistry


@dataclass
class Prepared:
    """What a training loop needs: the (wrapped) model, the bare module, optimizer, engine, sync."""

    model: nn.Module
    module: nn.Module
    optimizer: Optimizer
    engine: PrecisionEngine
    grad_sync: GradSync
    env: DistEnv


@torch.no_grad()
def broadcast_from_main(module: nn.Module, env: DistEnv) -> None:
    """Give every rank rank 0's parameters and buffers (once the ranks agree on what those are)."""
    if not env.distributed:
        return
    check_models_agree(module, env)
    for tensor in [*module.parameters(), *module.buffers()]:
        dist.broadcast(tensor.data, src=0)


def prepare(
    model: nn.Module,
    make_optimizer: Callable[[Iterable[nn.Parameter]], Optimizer],
    env: DistEnv,
    *,
    precision: str = "O1",
    impl: str = "builtin",
    precision_overrides: dict[str, Any] | None = None,
    registry: OpRegistry | None = None,
    sync_bn: str = "off",
    strategy: str = "ddp",
    ddp: DDPOptions | None = None,
    wrap_options: dict[str, Any] | None = None,
) -> Prepared:
    """Set up ``model`` for training on ``env``; ``make_optimizer(params)`` builds the optimizer.

    ``ddp``: torch DDP's settings (strategy ``ddp`` in a distributed run); ``wrap_options``: further
    keyword arguments of the wrapper (apex-ddp's own options, nn.DataParallel's, torch DDP's others).
    """
    if sync_bn not in SYNC_BN_CHOICES:
        raise choice_error("sync_bn", sync_bn, SYNC_BN_CHOICES)
    engine = build_engine(precision, impl=impl, registry=registry, **(precision_overrides or {}))
    if sync_bn != "off":
        model = convert_sync_batchnorm(model, sync_bn, device=env.device)
    model = model.to(env.device)
    broadcast_from_main(model, env)
    optimizer = make_optimizer(model.parameters())
    engine.setup([model], [optimizer])
    wrapped = wrap_model(model, strategy, env, ddp, **(wrap_options or {}))
    return Prepared(wrapped, model, optimizer, engine, GradSync(wrapped), env)
