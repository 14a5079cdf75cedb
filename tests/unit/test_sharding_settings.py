"""FSDP2's settings, blocks and precision mapping, the GPT and its text corpus, checked in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from ampddp import Parallel, Precision
from ampddp.distributed.env import DistEnv
from ampddp.distributed.fsdp2 import FSDPOptions, block_classes, repeated_blocks, shard_model
from ampddp.distributed.strategies import wrap_model
from ampddp.errors import ConfigError
from ampddp.precision.modes import resolve_policy
from ampddp.recipe.build import build_run
from ampddp.recipe.checks import check_recipe
from ampddp.recipe.reading import load_config
from ampddp.training.batches import accuracy, cross_entropy
from ampddp.zoo.models import GPT, Block, gpt
from ampddp.zoo.text import VOCAB_SIZE, python_docs

RECIPE = Path(__file__).parents[2] / "recipes" / "gpt-fsdp2.yaml"


@pytest.mark.parametrize(("level", "low"), [("O2", torch.float16), ("O5", torch.bfloat16)])
def test_o2_and_o5_keep_fp32_sharded_masters_and_compute_in_the_low_dtype(level, low):
    policy = resolve_policy(level).for_sharded_params()
    assert policy.sharded_param_dtype == low and policy.cast_model_type is None and not policy.uses_master_weights
    assert policy.patch_torch_functions and policy.op_cast_dtype == low  # the fp32 islands: apex's op lists
    assert policy.loss_scale == resolve_policy(level).loss_scale
    pure = resolve_policy(level).for_sharded_params(fp32_islands=False)
    assert not pure.patch_torch_functions and pure.op_cast_dtype is None and pure.sharded_param_dtype == low
    assert "fp32 sharded masters" in policy.summary() and "apex's fp32 ops in fp32" in policy.summary()
    assert "no fp32 islands" in pure.summary()
    engine = Precision(level).build_sharded_engine()
    assert engine.sharded_param_dtype == low and engine.compute_dtype == low and not engine.casts_model_params


@pytest.mark.parametrize("level", ["O0", "O1", "O3", "O4"])
def test_other_levels_are_their_single_process_selves_under_fsdp2(level):
    assert resolve_policy(level).for_sharded_params() == resolve_policy(level)
    assert Precision(level).build_sharded_engine().sharded_param_dtype is None


def test_fp32_islands_is_refused_where_it_decides_nothing():
    with pytest.raises(
        ConfigError, match=r"fp32_islands=False applies only under a sharding strategy, fsdp2 or hsdp.*use O1 \(float16\) or O4"
    ):
        Precision("O5", fp32_islands=False).build_engine()
    with pytest.raises(ConfigError, match=r"fp32_islands=True applies to O2 and O5 under fsdp2, not to O4"):
        Precision("O4", fp32_islands=True).build_sharded_engine()
    with pytest.raises(ConfigError, match=r"fp32_islands='yes' is not valid; valid: true, false, or null"):
        Precision("O5", fp32_islands="yes")
    with pytest.raises(ConfigError, match=r"impl=apex cannot shard"):
        Precision("O2", impl="apex").build_sharded_engine()


def test_fsdp_settings_belong_to_fsdp2_and_ddp_settings_to_ddp():
    with pytest.raises(ConfigError, match=r"blocks=\('Block',\): FSDP2 settings, but strategy=ddp"):
        Parallel("ddp", fsdp=FSDPOptions(blocks=("Block",)))
    with pytest.raises(ConfigError, match=r"wrap_options \['broadcast_buffers'\] do not apply to strategy fsdp2"):
        Parallel("fsdp2", wrap_options={"broadcast_buffers": False})
    with pytest.raises(ConfigError, match=r"reshard_after_forward='no' is not valid; it must be true or false"):
        FSDPOptions(reshard_after_forward="no")
    with pytest.raises(ConfigError, match=r"blocks='Block' is not valid; give a list of module class names"):
        FSDPOptions(blocks="Block")
    with pytest.raises(ConfigError, match=r"wrap_model wraps whole models"):
        wrap_model(nn.Linear(2, 2), "fsdp2", DistEnv())


def test_blocks_are_found_or_named():
    model = GPT(VOCAB_SIZE, layers=2, width=16, heads=2, context=8)
    assert repeated_blocks(model) == [Block]
    assert block_classes(model, ("ampddp.zoo.models.Block",)) == [Block]
    resnet = torchvision.models.resnet18(num_classes=3)
    assert [kind.__name__ for kind in repeated_blocks(resnet)] == ["BasicBlock"]
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))) == []
    with pytest.raises(
        ConfigError, match=r"fsdp block class 'Blok' is not in the model \(did you mean 'Block'\?\).*holding parameters: .*Embedding"
    ):
        block_classes(model, ("Blok",))


def test_fsdp2_without_a_process_group_or_on_a_wrapped_model_is_refused_naming_what_to_do():
    with pytest.raises(ConfigError, match=r"fsdp2 builds its device mesh over a process group, and this process has none: on one "
                                          r"process, make a group of it first \(torch.distributed.init_process_group"):  # fmt: skip
        shard_model(nn.Linear(2, 2), DistEnv(), FSDPOptions(), None)
    with pytest.raises(ConfigError, match=r"fsdp2/hsdp got a model already wrapped in DataParallel: pass the bare model"):
        shard_model(nn.DataParallel(nn.Linear(2, 2)), DistEnv(world_size=2), FSDPOptions(), None)


def test_the_recipe_takes_fsdp2_on_one_process_and_refuses_fsdp_keys_without_it(tmp_path):
    overrides = [f"trainer.run_dir={tmp_path / 'run'}"]
    check_recipe(load_config(RECIPE, [*overrides, "distributed.nproc_per_node=1"]))  # a mesh of one rank (ampddp train makes its group)
    with pytest.raises(ConfigError, match=r"distributed.fsdp_blocks=\('Block',\): FSDP2 settings, but strategy=ddp"):
        check_recipe(load_config(RECIPE, [*overrides, "distributed.strategy=ddp", "distributed.fsdp_blocks=[Block]"]))
    with pytest.raises(ConfigError, match=r"fp32_islands=False applies only under a sharding strategy, fsdp2 or hsdp"):
        ddp_islands = ["distributed.strategy=ddp", "precision.mode=O5", "precision.fp32_islands=false"]
        build_run(load_config(RECIPE, [*overrides, *ddp_islands]), DistEnv())
    check_recipe(load_config(RECIPE, overrides))


def test_the_gpt_predicts_the_next_token_and_refuses_bad_shapes():
    torch.manual_seed(0)
    model = gpt(VOCAB_SIZE, layers=2, width=16, heads=4, context=8, norm="layer")
    ids = torch.randint(VOCAB_SIZE, (3, 8))
    out = model(ids, labels=ids)
    assert out["logits"].shape == (3, 8, VOCAB_SIZE) and out["loss"].shape == ()
    assert torch.allclose(out["loss"], nn.functional.cross_entropy(out["logits"].reshape(-1, VOCAB_SIZE), ids.reshape(-1)))
    assert torch.equal(cross_entropy(out, {"input_ids": ids, "labels": ids}), out["loss"])
    # Causal: a change at the last position leaves the earlier positions' logits as they were.
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB_SIZE
    assert torch.allclose(model(changed)["logits"][:, :-1], out["logits"][:, :-1], atol=1e-6)
    with pytest.raises(ValueError, match=r"a sequence of 9 tokens is longer than the GPT's context of 8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ConfigError, match=r"width=30 is not a multiple of heads=4"):
        GPT(VOCAB_SIZE, width=30, heads=4)
    with pytest.raises(ConfigError, match=r"norm='batch' is not valid; valid: rms, layer"):
        GPT(VOCAB_SIZE, norm="batch")
    with pytest.raises(ConfigError, match=r"layers=0 is not valid; it must be an integer >= 1"):
        GPT(VOCAB_SIZE, layers=0)


def test_the_corpus_windows_are_next_byte_pairs_split_without_overlap():
    train, held_out = python_docs(sequence_length=32, eval_fraction=0.1)
    sample = train[3]
    assert sample["input_ids"].shape == (32,) and sample["input_ids"].dtype == torch.int64
    assert torch.equal(sample["input_ids"][1:], sample["labels"][:-1])
    assert torch.equal(train[4]["input_ids"][0], sample["labels"][-1])
    assert int(max(train[i]["labels"].max() for i in range(20))) < VOCAB_SIZE
    assert 8 < len(train) / len(held_out) < 10
    assert not torch.equal(train.data[-32:], held_out.data[:32])
    with pytest.raises(ConfigError, match=r"sequence_length=0 is not valid"):
        python_docs(sequence_length=0)
    with pytest.raises(ConfigError, match=r"eval_fraction=1.5 is not valid; it must lie in \(0, 1\)"):
        python_docs(eval_fraction=1.5)


def test_accuracy_with_a_target_per_position_counts_each_samples_share():
    logits = torch.zeros(2, 4, 3)
    logits[..., 1] = 1.0  # predicts class 1 everywhere
    targets = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    assert accuracy({"logits": logits}, {"labels": targets})["accuracy"].item() == pytest.approx(1.5)
    assert accuracy(torch.eye(3), (None, torch.tensor([0, 2, 2])))["accuracy"].item() == 2


def test_a_block_name_two_classes_share_must_be_given_qualified():
    other = type("Block", (nn.Linear,), {"__module__": "elsewhere"})
    model = nn.Sequential(Block(8, 2, nn.LayerNorm), other(8, 8))
    with pytest.raises(
        ConfigError, match=r"'Block' names 2 classes of the model \(ampddp.zoo.models.Block, elsewhere.Block\); give the qualified name"
    ):
        block_classes(model, ("Block",))
    assert block_classes(model, ("elsewhere.Block",)) == [other]


def test_the_sharded_layout_refuses_tensors_nested_in_an_optimizer_entry():
    from ampddp.checkpoint.sharded import split_state
    from ampddp.errors import CheckpointError

    state = {"state": {0: {"step": torch.tensor(1.0), "factors": [torch.ones(2), torch.ones(3)], "note": "kept"}}, "param_groups": []}
    with pytest.raises(CheckpointError, match=r"optimizer state 0/factors holds tensors inside a list; .* use checkpoint layout whole"):
        split_state({}, state)
    del state["state"][0]["factors"]
    tensors, rest, _ = split_state({}, state)
    assert list(tensors) == ["optimizer/0/step"] and rest["state"] == {0: {"note": "kept"}}


def test_batchnorm_kept_fp32_is_the_only_choice_under_fsdp2():
    with pytest.raises(ConfigError, match=r"keep_batchnorm_fp32=False with O5 under fsdp2: BatchNorm layers are FSDP2 units"):
        Precision("O5", overrides={"keep_batchnorm_fp32": False}).build_sharded_engine()


def test_cpu_offload_asks_for_a_host_backend_beside_nccl(tmp_path):
    from ampddp.distributed.env import HOST_AND_CUDA, detect_env
    from ampddp.recipe.factories import process_group_backend

    config = load_config(Path(__file__).parents[2] / "recipes" / "gpt-fsdp2.yaml", ["distributed.fsdp_cpu_offload=true"])
    assert process_group_backend(config) == HOST_AND_CUDA
    config = load_config(Path(__file__).parents[2] / "recipes" / "gpt-fsdp2.yaml", ["distributed.backend=gloo"])
    assert process_group_backend(config) == "gloo"
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    assert detect_env(torchrun, backend=HOST_AND_CUDA, device="cpu").backend == "gloo"  # a CPU run's host half


def test_hsdp_settings_name_what_is_wrong():
    assert FSDPOptions(shard_size=2).replicas(DistEnv(world_size=4, local_world_size=4)) == 2
    assert FSDPOptions().replicas(DistEnv(world_size=8, local_world_size=4)) == 2  # a node's ranks by default
    with pytest.raises(ConfigError, match=r"hsdp shards over groups of 3 rank\(s\) \(shard_size\) and the world has 4: choose"):
        FSDPOptions(shard_size=3).replicas(DistEnv(world_size=4, local_world_size=4))
    with pytest.raises(ConfigError, match=r"fsdp shard_size=0 is not valid; it must be an integer >= 1 or null"):
        FSDPOptions(shard_size=0)
    with pytest.raises(ConfigError, match=r"shard_size=2: the replicas' shard size of strategy hsdp, but strategy=fsdp2"):
        Parallel("fsdp2", fsdp=FSDPOptions(shard_size=2))
    with pytest.raises(ConfigError, match=r"FSDP2 settings, but strategy=ddp; unset them or use strategy fsdp2 or hsdp"):
        Parallel("ddp", fsdp=FSDPOptions(shard_size=2))
