"""A model built on the meta device (FSDP2's build): the recorded initialisation replays to exactly the
weights, buffers and random state of an eager build of the same seed, and what cannot be replayed one
tensor at a time is refused in one line naming the tensor and the eager alternative."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ampddp.distributed.meta_init import build_on_meta, whole_model
from ampddp.errors import ConfigError
from ampddp.zoo.models import GPT


class OwnInit(nn.Module):
    """A user model with its own initialisation: a reset_parameters, an init_weights pass over the
    modules (truncated normal, scaled normal, zeros), a parameter drawn with torch.randn, a buffer made
    whole (torch.ones) and one filled in place after torch.empty, and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, 24)
        self.layers = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24), nn.LayerNorm(24))
        self.norm = nn.BatchNorm1d(24)
        self.scale = nn.Parameter(torch.empty(24))
        self.offset = nn.Parameter(torch.randn(24) * 0.1)
        self.register_buffer("mask", torch.ones(24))
        self.register_buffer("table", torch.empty(7))
        self.table.fill_(0.5)
        self.reset_parameters()
        self.apply(self.init_weights)

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale, 0.5, 1.5)

    @staticmethod
    def init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            module.weight.data.mul_(1 / math.sqrt(2))
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.layers(self.embed(ids)).mean(1)) * self.scale + self.offset + self.mask


def gpt() -> GPT:
    return GPT(50, layers=2, width=32, heads=2, context=16)


@pytest.mark.parametrize("factory", [gpt, OwnInit], ids=["gpt", "own-init"])
def test_a_meta_build_materialises_to_the_eager_build_bit_for_bit(factory):
    torch.manual_seed(7)
    eager = factory()
    eager_next = torch.rand(4)
    torch.manual_seed(7)
    built = build_on_meta(factory)
    assert any(p.is_meta for p in built.module.parameters())
    meta_next = torch.rand(4)  # the random stream after the build is the eager build's
    assert torch.equal(meta_next, eager_next)
    model = whole_model(built)
    expected = eager.state_dict()
    for name, value in model.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, expected[name]), name
    assert set(model.state_dict()) == set(expected)


def test_materialising_leaves_the_random_stream_where_the_build_left_it():
    torch.manual_seed(3)
    built = build_on_meta(gpt)
    state = torch.get_rng_state()
    whole_model(built)
    assert torch.equal(torch.get_rng_state(), state)


class DerivedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8)
        self.twice = nn.Parameter(self.base.weight.detach() * 2)


class ViewWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight[0].fill_(1.0)


class OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        nn.init.normal_(self.proj.weight, generator=torch.Generator().manual_seed(1))


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm_at_start = float(self.proj.weight.detach().norm())


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (DerivedWeight, r"model tensor 'twice' \(DerivedWeight\) cannot be initialised shard by shard: it is computed from other tensors"),
        (ViewWrite, r"model tensor 'proj.weight' \(Linear\) cannot be initialised shard by shard: fill_ writes a view of it"),
        (OwnGenerator, r"model tensor 'proj.weight' \(Linear\) cannot be initialised shard by shard: normal_ draws from a generator"),
        (ReadsValues, r"building the model on the meta device failed \(\w+: .*\)"),
    ],
    ids=["derived", "view", "generator", "reads-values"],
)
def test_what_cannot_be_replayed_per_shard_is_refused_naming_it_and_the_eager_build(factory, expected):
    with pytest.raises(ConfigError, match=expected) as caught:
        build_on_meta(factory)
    message = str(caught.value)
    assert "\n" not in message and "distributed.fsdp_build_on_meta: false" in message and "FSDPOptions(build_on_meta=False)" in message


def test_a_factory_that_returns_no_module_is_refused():
    with pytest.raises(ConfigError, match=r"the model factory returned a dict, not a torch\.nn\.Module"):
        build_on_meta(dict)
