"""A small training set-up with every source of randomness a real run has, for resume tests."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import O6_SMALL_MODEL
from torch import nn
from torch.utils.data import Dataset

from ampddp import Parallel, Precision
from ampddp.checkpoint import keys
from ampddp.checkpoint.files import load_safely
from ampddp.checkpoint.store import CheckpointStore, find_checkpoint
from ampddp.trainer import Trainer
from ampddp.training import CheckpointSettings


class NoisyDigits(Dataset):
    """Fixed points plus random augmentation noise drawn from torch's global generator."""

    def __init__(self, size: int = 44) -> None:
        generator = torch.Generator().manual_seed(11)
        self.x = torch.randn(size, 16, generator=generator)
        self.y = (self.x @ torch.randn(16, 4, generator=generator)).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index] + 0.1 * torch.randn(16), self.y[index]


def make_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


CHECKPOINT_FIELDS = ("keep_last", "resume", "init_from", "config", "layout")


def make_trainer(run_dir, mode: str, max_steps: int, env=None, **overrides) -> Trainer:
    options = dict(
        eval_set=NoisyDigits(10), precision=mode, batch_size=4, grad_accum_steps=2, clip_grad_norm=5.0,
        make_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
        max_epochs=100, max_steps=max_steps, seed=5, env=env, parallel=Parallel(sync_bn="auto"),
    )  # fmt: skip
    checkpoints = {"run_dir": run_dir, **{name: overrides.pop(name) for name in CHECKPOINT_FIELDS if name in overrides}}
    options["checkpoints"] = CheckpointSettings(**checkpoints)
    options["report"] = overrides.pop("report", None)  # these runs test checkpoints: the console and run-dir reports only where asked
    options.update(overrides)
    if "precision_overrides" in options:  # the mode's own settings
        options["precision"] = Precision(mode, overrides=options.pop("precision_overrides") or {})
    elif mode == "O6":  # this small model's first layer in fp8 (its last one's 4 outputs never qualify)
        options["precision"] = Precision(mode, overrides=O6_SMALL_MODEL)
    return Trainer(make_model(), lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), NoisyDigits(), **options)


def tree_snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (names in ``skip`` left out): what a refused or
    no-op operation must leave exactly as it was."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name not in skip}


def final_state(run_dir) -> dict:
    return state_of(CheckpointStore(run_dir).latest().path)


def state_of(step_folder: Path) -> dict:
    """The checkpoint's state with whole tensors (a sharded one's shards read and verified)."""
    folder = Path(step_folder)
    shared = load_safely(folder / keys.SHARED_FILE)
    if shared.get(keys.SHARDS) is not None:
        shared = CheckpointStore.load_whole(find_checkpoint(folder))
    return {
        "model": shared[keys.MODEL],
        "optimizer": shared[keys.OPTIMIZER]["state"],
        "precision": shared[keys.PRECISION]["scalers"],
        "progress": shared[keys.PROGRESS],
        "scheduler": shared[keys.SCHEDULER],
    }


def assert_identical(a: dict, b: dict) -> None:
    assert a["progress"] == b["progress"]
    assert a["precision"] == b["precision"]
    assert a["scheduler"] == b["scheduler"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for index, entry in a["optimizer"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer"][index][name])), (index, name)


def straight_and_resumed(root, mode: str, env=None, total: int = 14, stop: int = 7) -> tuple[dict, dict]:
    """Train ``total`` steps straight, and ``stop`` steps + resume + the rest; return both final states."""
    straight, resumed = root / f"{mode}-straight", root / f"{mode}-resumed"
    make_trainer(straight, mode, total, env).fit()
    make_trainer(resumed, mode, stop, env).fit()
    make_trainer(resumed, mode, total, env).fit()
    return final_state(straight), final_state(resumed)
