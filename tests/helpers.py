"""Small models and data shared by the numerics tests (linear layers: fp16 on CPU is fast for those),
and the precision modes this environment can run."""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from ampddp import PRECISION_MODES

HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
NO_TORCHAO = "opt level O6 needs torchao (pip install 'ampddp[fp8]'), not installed here"
RUNNABLE_MODES = tuple(mode for mode in PRECISION_MODES if mode != "O6" or HAS_TORCHAO)
"""Every precision mode, less O6 where torchao is missing (tests looping over modes use this)."""
O6_SMALL_MODEL = {"fp8_filter": [], "fp8_min_size": 16}
"""O6's settings for the small models of the tests: every linear layer with dims of 16 or more in fp8
(O6's defaults keep layers this small, and the first and last, in bf16: the run would be O4's)."""


def small_model_settings(mode: str) -> dict[str, object]:
    """The settings a mode-wide test gives ``mode`` on its small models: O6's that convert their layers."""
    return dict(O6_SMALL_MODEL) if mode == "O6" else {}


def make_mlp(seed: int = 0, width: int = 32, batchnorm: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(width))
    layers += [nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4)]
    return nn.Sequential(*layers)


def make_batches(count: int, batch: int = 32, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(16, 4, generator=generator)
    batches = []
    for _ in range(count):
        x = torch.randn(batch, 16, generator=generator)
        batches.append((x, (x @ teacher).argmax(1)))
    return batches


def max_relative_difference(params_a, params_b) -> float:
    worst = 0.0
    for a, b in zip(params_a, params_b):
        a, b = a.detach().float(), b.detach().float()
        worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item())
    return worst
