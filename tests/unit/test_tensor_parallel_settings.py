"""Tensor parallelism's settings, checked where they are made (no process group needed): the mesh it forms with
each strategy, the strategies it composes with, a plan table checked against the model, the GPT's own plan and its
split attention (a state dict of the fused ``qkv`` layer still loads)."""

from __future__ import annotations

import pytest
import torch
from helpers import HAS_TORCHAO
from torch import nn

from ampddp import Parallel
from ampddp.distributed.env import DistEnv
from ampddp.distributed.tensor_parallel import TPOptions, check_table, fp8_styles, model_plan
from ampddp.errors import ConfigError
from ampddp.zoo.models import GPT


def world(size: int, local: int | None = None) -> DistEnv:
    return DistEnv(world_size=size, local_world_size=local or size)


@pytest.mark.parametrize(
    ("strategy", "size", "local", "sizes"),
    [
        ("none", 2, None, {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2}),
        ("fsdp2", 4, None, {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2}),
        ("fsdp2", 2, None, {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2}),
        ("hsdp", 8, 4, {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 2}),  # a node of 4 holds a replica: 2 x tp 2
    ],
)
def test_tensor_parallelism_is_the_innermost_dimension_of_the_strategys_mesh(strategy, size, local, sizes):
    dims = Parallel(strategy, tp=TPOptions(2)).dims(world(size, local))
    assert dims.sizes() == sizes
    # the ranks of one tensor-parallel group read the same batch: consecutive ranks share a data coordinate
    assert [dims.dp_rank(rank) for rank in range(size)] == [rank // 2 for rank in range(size)]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Parallel("ddp", tp=TPOptions(2)), "tensor parallelism composes with strategy fsdp2, hsdp, or none"),
        (lambda: Parallel("apex-ddp", tp=TPOptions(2)), "strategy=apex-ddp replicates whole models"),
        (lambda: Parallel("dp", tp=TPOptions(2)), "strategy=dp replicates whole models"),
        (lambda: Parallel("none", tp=TPOptions(2)).dims(world(4)), "leaves 2 model copies training apart"),
        (lambda: Parallel("fsdp2", tp=TPOptions(3)).dims(world(4)), "tp_size=3 does not divide the world of 4 rank(s)"),
        (lambda: TPOptions(0), "tp_size=0 is not valid"),
        (lambda: TPOptions(2, plan={"head": "diagonal"}), "tp_plan['head']='diagonal' is not valid"),
        (lambda: TPOptions(2, plan="mypkg:plan"), "tp_plan='mypkg:plan' is not valid"),
        (lambda: Parallel("fsdp2", tp="2"), "Parallel tp='2' is not valid; it must be a TPOptions"),
        (lambda: TPOptions(2, loss_parallel="yes"), "loss_parallel='yes' is not valid; it must be true or false"),
        (lambda: TPOptions(2, plan={"head": "vocab"}), "tp_plan marks 'head' vocab, which leaves its logits split"),
        (lambda: TPOptions(2, plan={"fc": "colwise"}, loss_parallel=True), "mark the output head vocab in tp_plan"),
    ],
)
def test_what_tensor_parallelism_cannot_do_is_refused_in_one_line(make, message):
    with pytest.raises(ConfigError, match=None) as error:
        make()
    assert message in str(error.value)


def test_a_plan_table_names_modules_of_the_model():
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
    resolved = check_table(model, {"0": "colwise", "2": "rowwise"})
    assert [type(style).__name__ for style in resolved.values()] == ["ColwiseParallel", "RowwiseParallel"]
    with pytest.raises(ConfigError, match=r"tp_plan names '3', which matches no module of Sequential; give dotted module names"):
        check_table(model, {"3": "rowwise"})
    gpt = GPT(16, layers=2, width=8, heads=2, context=4)
    assert len(check_table(gpt, {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"})) == 2
    with pytest.raises(ConfigError, match=r"matches no module of GPT \(did you mean 'final_norm'\?\)"):
        check_table(gpt, {"final_nrom": "sequence"})
    with pytest.raises(ConfigError, match="has no tensor-parallel plan"):
        model_plan(model, TPOptions(2))


def test_the_vocabulary_parallel_loss_asks_the_plan_for_split_logits():
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 16))
    head = check_table(model, TPOptions(2, plan={"0": "colwise", "2": "vocab"}, loss_parallel=True).plan)["2"]
    assert (type(head).__name__, head.output_layouts[0].dim, head.use_local_output) == ("ColwiseParallel", -1, False)

    class OwnPlan(nn.Sequential):
        def tensor_parallel_plan(self, tp_size: int, sequence_parallel: bool) -> dict[str, str]:
            return {"0": "colwise"}

    with pytest.raises(ConfigError, match=r"OwnPlan\.tensor_parallel_plan takes no loss_parallel argument"):
        model_plan(OwnPlan(nn.Linear(4, 4)), TPOptions(2, loss_parallel=True))
    assert model_plan(OwnPlan(nn.Linear(4, 4)), TPOptions(2)) == {"0": "colwise"}
    gpt = GPT(16, layers=1, width=8, heads=2, context=4)
    split = model_plan(gpt, TPOptions(2, loss_parallel=True))["head"]
    assert (split.output_layouts[0].dim, split.use_local_output) == (-1, False)
    assert model_plan(gpt, TPOptions(2))["head"].use_local_output


def test_the_gpt_carries_its_plan_and_refuses_heads_that_do_not_split():
    gpt = GPT(16, layers=2, width=8, heads=2, context=4)
    plan = gpt.tensor_parallel_plan(2, sequence_parallel=True)
    assert {"blocks.1.attention.q", "blocks.1.attention.proj", "blocks.1.mlp_norm", "head", "token_embedding"} <= set(plan)
    assert not any("norm" in name for name in gpt.tensor_parallel_plan(2, sequence_parallel=False))
    with pytest.raises(ConfigError, match="gpt heads=2 do not split over tp_size=4"):
        gpt.tensor_parallel_plan(4)


def test_a_gpt_state_dict_with_the_fused_qkv_layer_loads_into_the_split_projections():
    torch.manual_seed(0)
    gpt = GPT(16, layers=1, width=8, heads=2, context=4)
    fused = {}
    for name, value in gpt.state_dict().items():
        for kind in ("weight", "bias"):
            if name.endswith(f"attention.q.{kind}"):
                parts = [gpt.state_dict()[name.replace(".q.", f".{part}.")] for part in "qkv"]
                fused[name.replace(".q.", ".qkv.")] = torch.cat(parts)
        if not any(f"attention.{part}." in name for part in "qkv"):
            fused[name] = value
    ids = torch.randint(0, 16, (2, 4))
    expected = gpt(ids)["logits"]
    reloaded = GPT(16, layers=1, width=8, heads=2, context=4)
    reloaded.load_state_dict(fused)  # strict: every key placed
    assert torch.equal(reloaded(ids)["logits"], expected)


@pytest.mark.skipif(not HAS_TORCHAO, reason="O6 needs torchao (the integrations extra)")
def test_tensorwise_fp8_layers_take_torchaos_fp8_styles_and_rowwise_ones_keep_torchs():
    from ampddp.precision.fp8 import convert_to_fp8, float8_config, plan_fp8

    def styles(recipe: str) -> dict[str, str]:
        gpt = GPT(16, layers=1, width=16, heads=2, context=4)
        convert_to_fp8(gpt, plan_fp8(gpt, recipe, (), 16), float8_config(recipe, torch.device("cpu")))
        table = fp8_styles(gpt, model_plan(gpt, TPOptions(2)))
        return {name: type(style).__name__ for name, style in table.items() if name.startswith("blocks.0.")}

    tensorwise = styles("tensorwise")
    assert tensorwise["blocks.0.attention.q"] == "Float8ColwiseParallel"
    assert tensorwise["blocks.0.mlp.2"] == "Float8RowwiseParallel"
    assert tensorwise["blocks.0.attention"] == tensorwise["blocks.0.mlp"] == "PrepareFloat8ModuleInput"  # one fp8 gather
    rowwise = styles("rowwise")
    assert (rowwise["blocks.0.attention.q"], rowwise["blocks.0.mlp.2"], rowwise["blocks.0.mlp"]) == (
        "ColwiseParallel", "RowwiseParallel", "PrepareModuleInput")  # fmt: skip
