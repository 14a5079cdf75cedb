"""Pipeline parallelism's settings and parts that need no process group: the options and their refusals, the GPT cut
into stages under the whole model's names (each stage's forward the whole model's, piece by piece), batches cut into
micro-batches, and a stage's part of a whole model's checkpoint both ways."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampddp import Parallel
from ampddp.checkpoint import keys
from ampddp.checkpoint.stage_view import StageView
from ampddp.distributed.env import DistEnv
from ampddp.distributed.pipeline import PPOptions, split_batch, split_stage, united
from ampddp.distributed.tensor_parallel import TPOptions
from ampddp.distributed.wrap import DDPOptions
from ampddp.errors import CheckpointError, ConfigError
from ampddp.torch_compat import compiled_split_backward_problem, zbv_schedule_problem
from ampddp.zoo.models import GPT


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PPOptions(0), "pp_size=0 is not valid"),
        (lambda: PPOptions(2, schedule="Zigzag"), "pp_schedule='Zigzag' is not valid"),
        (lambda: PPOptions(2, schedule="ZBVZeroBubble", stages_per_rank=3), "which runs exactly 2 stages per rank"),
        (lambda: PPOptions(2, schedule="1F1B", stages_per_rank=2), "pp_schedule=1F1B, which runs one stage per rank"),
        (lambda: PPOptions(2, schedule="Interleaved1F1B", microbatches=5), "take whole rounds of micro-batches"),
        (lambda: PPOptions(2, microbatches=0), "pp_microbatches=0 is not valid"),
        (lambda: PPOptions(2, split="mypkg:split"), "pp_split='mypkg:split' is not valid"),
        (
            lambda: Parallel("apex-ddp", pp=PPOptions(2)),
            "runs with strategy none, ddp, fsdp2 or hsdp (each with tp_size), not strategy=apex-ddp",
        ),
        (
            lambda: Parallel("ddp", pp=PPOptions(2), ddp=DDPOptions(static_graph=True)),
            "static_graph=True: torch DDP settings, but "
            "strategy=ddp with pp_size=2 runs each stage's data parallelism as hsdp with shards of one rank",
        ),
        (lambda: Parallel("none", pp=PPOptions(2)).dims(DistEnv(world_size=4, local_world_size=4)), "leaves 2 pipelines training apart"),
        (lambda: Parallel("fsdp2", pp=PPOptions(3)).dims(DistEnv(world_size=4, local_world_size=4)), "pp_size=3 does not divide"),
        (lambda: Parallel("none", sync_bn="portable", pp=PPOptions(2)), "sync_bn=portable with pp_size=2: a synchronised BatchNorm"),
        (lambda: Parallel("none", pp="2"), "Parallel pp='2' is not valid; it must be a PPOptions"),
    ],
)
def test_what_the_pipeline_cannot_do_is_refused_in_one_line(make, message):
    with pytest.raises(ConfigError) as error:
        make()
    assert message in str(error.value)


def test_ddp_over_pipeline_stages_replicates_each_stage_as_hsdp_with_shards_of_one_rank(caplog):
    caplog.set_level("INFO", logger="ampddp.distributed")
    parallel = Parallel("ddp", pp=PPOptions(2))
    assert "each stage replicated over its data ranks and its gradients all-reduced" in caplog.text
    dims = parallel.dims(DistEnv(world_size=4, local_world_size=4))
    assert dims.sizes() == {"pp": 2, "dp_replicate": 2, "dp_shard": 1, "tp": 1}


def test_fewer_micro_batches_than_stages_are_said_and_the_stages_are_the_outermost_dimension(caplog):
    assert PPOptions(4, schedule="GPipe", microbatches=2).micro_batches == 2
    assert "pp_microbatches=2 < pp_size=4: each micro-batch goes through the stages in turn" in caplog.text
    assert PPOptions(3).micro_batches == 3
    dims = Parallel("none", pp=PPOptions(2)).dims(DistEnv(world_size=2, local_world_size=2))
    assert dims.sizes() == {"pp": 2, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    assert [dims.dp_rank(rank) for rank in range(2)] == [0, 0]  # both stages read the same batch
    # the stages outermost: FSDP2 within each stage's ranks, tensor parallelism innermost
    dims = Parallel("fsdp2", pp=PPOptions(2), tp=TPOptions(2)).dims(DistEnv(world_size=8, local_world_size=8))
    assert dims.sizes() == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert [dims.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [dims.coordinates(rank)["pp"] for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_the_gpt_cut_into_stages_keeps_the_whole_models_names_and_computes_its_forward():
    torch.manual_seed(0)
    whole = GPT(32, layers=5, width=16, heads=2, context=8)
    names = set(whole.state_dict())
    ids = torch.randint(0, 32, (2, 8))
    expected = whole(ids)["logits"]
    stages = []
    for stage in range(3):
        part = GPT(32, layers=5, width=16, heads=2, context=8)
        part.load_state_dict(whole.state_dict())
        stages.append(split_stage(part, stage, PPOptions(3)))
    blocks = [sorted(int(name.split(".")[1]) for name, _ in part.named_parameters() if name.startswith("blocks.")) for part in stages]
    assert [sorted(set(found)) for found in blocks] == [[0, 1], [2, 3], [4]]  # as even as they go, earlier stages one more
    assert set().union(*(part.state_dict() for part in stages)) == names  # every name once, unchanged
    assert not set(stages[0].state_dict()) & set(stages[1].state_dict())
    hidden = ids
    for part in stages:
        hidden = part(hidden)
    assert torch.equal(hidden, expected)  # the stages in turn compute the whole model's logits (a tensor on the last)
    with pytest.raises(ConfigError, match="gpt layers=5 do not split into 6 pipeline stage"):
        GPT(32, layers=5, width=16, heads=2, context=8).pipeline_stage(0, 6)
    with pytest.raises(ConfigError, match="has no pipeline split"):
        split_stage(nn.Linear(2, 2), 0, PPOptions(2))
    with pytest.raises(ConfigError, match="pp_split returned a str for stage 1"):
        split_stage(nn.Linear(2, 2), 1, PPOptions(2, split=lambda model, stage, stages: "half"))


def test_a_batch_is_cut_into_equal_micro_batches_or_as_many_as_divide_it():
    batch = {"input_ids": torch.arange(16).view(8, 2), "labels": torch.arange(8), "note": "kept"}
    micro = split_batch(batch, 4)
    assert [part["labels"].tolist() for part in micro] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(part["note"] == "kept" and part["input_ids"].shape == (2, 2) for part in micro)
    assert [len(part[0]) for part in split_batch((torch.zeros(6, 3), torch.zeros(6)), 4)] == [2, 2, 2]  # 6: 3 of 2
    assert [len(part[0]) for part in split_batch((torch.zeros(5, 3), torch.zeros(5)), 4)] == [5]  # 5: one of 5
    with pytest.raises(ConfigError, match="holds no tensor with a sample dimension"):
        split_batch({"note": "text"}, 2)


def test_a_stages_checkpoint_part_reads_as_the_whole_models_both_ways():
    # stage 1 of 2: its optimizer's parameters 0, 1 are the whole model's 2, 3 (group 0) and its 2 the whole's 5 (group 1)
    view = StageView(whole_index=(2, 3, 5), names=frozenset({"blocks.1.w", "blocks.1.b", "head.w"}))
    tensors = {"model/head.w": torch.ones(2), "optimizer/0/exp_avg": torch.zeros(2), "optimizer/2/exp_avg": torch.ones(1)}
    optimizer = {"state": {0: {"step": 1.0}, 2: {"step": 1.0}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.0, "params": [2]}]}
    record = {name: {"shape": list(value.shape), "dtype": "float32"} for name, value in tensors.items()}
    renamed, whole_optimizer, whole_record = view.to_whole(tensors, optimizer, record, DistEnv())
    assert set(renamed) == set(whole_record) == {"model/head.w", "optimizer/2/exp_avg", "optimizer/5/exp_avg"}
    assert whole_optimizer["param_groups"] == [{"lr": 0.1, "params": [2, 3]}, {"lr": 0.0, "params": [5]}]
    assert set(whole_optimizer["state"]) == {2, 5}
    # a whole model's checkpoint (six parameters, two groups) cut to the stage's part, renumbered as its optimizer numbers them
    shared = {
        keys.MODEL: {"blocks.0.w": 0, "blocks.1.w": 1, "blocks.1.b": 2, "head.w": 3},
        keys.OPTIMIZER: {"state": {index: {"step": float(index)} for index in range(6)},
                         "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}, {"lr": 0.0, "params": [4, 5]}]},
        keys.SHARDS: {"model/head.w": {}, "model/blocks.0.w": {}, "optimizer/3/exp_avg": {}, "optimizer/4/exp_avg": {}},
    }  # fmt: skip
    mine = view.restrict(shared, "ckpt")
    assert mine[keys.MODEL] == {"blocks.1.w": 1, "blocks.1.b": 2, "head.w": 3}
    assert mine[keys.OPTIMIZER]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.0, "params": [2]}]
    assert mine[keys.OPTIMIZER]["state"] == {0: {"step": 2.0}, 1: {"step": 3.0}, 2: {"step": 5.0}}
    assert set(mine[keys.SHARDS]) == {"model/head.w", "optimizer/3/exp_avg"}  # only its own tensors are read
    with pytest.raises(CheckpointError, match=r"holds no head\.w of this pipeline stage's model"):
        view.restrict({**shared, keys.MODEL: {"blocks.1.w": 1, "blocks.1.b": 2}}, "ckpt")


class TitanStyle(nn.Module):
    """A model written for splitting by names, as torchtitan's are: layers in an nn.ModuleDict, a forward that skips None."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({str(index): nn.Linear(8, 8) for index in range(4)})
        self.head = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


def test_a_split_by_module_names_keeps_each_stages_modules_and_refuses_what_does_not_fit():
    torch.manual_seed(0)
    whole = TitanStyle()
    ids = torch.randint(0, 16, (2, 3))
    expected = whole(ids)
    table = [["embed", "layers.0", "layers.1"], ["layers.2", "layers.3", "head"]]
    stages = []
    for stage in range(2):
        part = TitanStyle()
        part.load_state_dict(whole.state_dict())
        stages.append(split_stage(part, stage, PPOptions(2, split=table)))
    assert sorted(stages[0].state_dict()) == ["embed.weight", "layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight"]
    assert torch.equal(stages[1](stages[0](ids)), expected)
    with pytest.raises(ConfigError, match=r"pp_split names 'layer.2', which is no module of TitanStyle \(did you mean 'layers.2'\?\)"):
        split_stage(TitanStyle(), 0, PPOptions(2, split=[["embed", "layers.0", "layers.1"], ["layer.2", "layers.3", "head"]]))
    with pytest.raises(ConfigError, match=r"puts parameter layers\.3\.weight under no stage's modules"):
        split_stage(TitanStyle(), 0, PPOptions(2, split=[["embed", "layers.0", "layers.1"], ["layers.2", "head"]]))
    with pytest.raises(ConfigError, match=r"removes blocks\.1 from an nn\.ModuleList"):
        split_stage(GPT(16, layers=2, width=8, heads=2, context=4), 0, PPOptions(2, split=[["token_embedding", "position_embedding",
                    "blocks.0"], ["blocks.1", "final_norm", "head"]]))  # fmt: skip
    with pytest.raises(ConfigError, match="give 2 lists of module names, one per stage"):
        PPOptions(2, split=[["embed"]])


def test_a_rank_holding_several_stages_trains_them_as_one_module_under_the_whole_models_names():
    """Looped schedules: rank r of p holds stages r, r + p (ZBV: r and 2p - 1 - r); its stages, cut from copies of the
    model, are held together by one module (the optimizer's, the checkpoint's) sharing their tensors."""
    options = PPOptions(2, schedule="Interleaved1F1B")
    assert (options.per_rank, options.stages, options.stages_of(0), options.stages_of(1)) == (2, 4, (0, 2), (1, 3))
    assert options.holders() == (0, 1, 0, 1) and PPOptions(2).holders() == (0, 1)
    if zbv_schedule_problem() is None:  # torch 2.14+
        assert PPOptions(2, schedule="ZBVZeroBubble").stages_of(0) == (0, 3)
        assert PPOptions(2, schedule="ZBVZeroBubble").holders() == (0, 1, 1, 0)
    assert [count for count in range(1, 9) if options.schedule_fits(count)] == [2, 3, 4, 6, 8]  # whole rounds of 2
    torch.manual_seed(0)
    whole = GPT(32, layers=4, width=16, heads=2, context=8)
    held = [split_stage(GPT(32, layers=4, width=16, heads=2, context=8), index, options) for index in (0, 2)]
    union = united(held)
    assert {name.split(".")[1] for name in union.state_dict() if name.startswith("blocks.")} == {"0", "2"}
    assert set(union.state_dict()) == set(held[0].state_dict()) | set(held[1].state_dict()) < set(whole.state_dict())
    assert {id(param) for param in union.parameters()} == {id(param) for part in held for param in part.parameters()}
    assert list(held[1].blocks) == ["2"] and held[1].token_embedding is None  # the stages themselves left as cut
    twice = [split_stage(GPT(32, layers=4, width=16, heads=2, context=8), 0, options) for _ in range(2)]
    with pytest.raises(ConfigError, match=r"two pipeline stages of one rank both hold token_embedding\.weight"):
        united(twice)


def test_zbv_and_compiled_zero_bubble_are_refused_on_a_torch_they_were_not_measured_to_run_on():
    assert zbv_schedule_problem("2.14.1") is None
    assert "pp_schedule=ZBVZeroBubble needs torch >= 2.14 (on torch 2.10.0 a rank sends to itself" in zbv_schedule_problem("2.10.0")
    assert compiled_split_backward_problem("2.14.1") is None
    assert "trainer.compile under a zero-bubble pipeline schedule needs torch >= 2.14" in compiled_split_backward_problem("2.10.0")
