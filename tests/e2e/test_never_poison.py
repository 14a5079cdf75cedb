"""A skipped step leaves no trace in the model: BatchNorm statistics its forward wrote are restored."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampddp import build_engine
from ampddp.amp import Amp
from ampddp.checkpoint.finite import first_non_finite

MODES = ["O1", "O2", "native-fp16"]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def options(mode):
    return {} if mode.startswith("native") else {"verbosity": 0}


def engine_step(engine, model, optimizer, x, poison=False, micro_batches=1):
    optimizer.zero_grad()
    for _ in range(micro_batches):
        with engine.forward_context():
            out = model(x * 1e4 if poison else x)
            loss = F.cross_entropy(out.float(), torch.zeros(len(x), dtype=torch.long))
        engine.backward(loss * float("inf") if poison else loss)
    return engine.step(optimizer)


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_a_skipped_engine_step_restores_the_buffers_its_forwards_changed(mode, micro_batches):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = build_engine(mode, **options(mode))
    engine.setup([model], [optimizer])
    x = torch.randn(16, 4)
    assert engine_step(engine, model, optimizer, x)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not engine_step(engine, model, optimizer, x, poison=True, micro_batches=micro_batches)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine_step(engine, model, optimizer, x)  # the next good step updates them again
    assert not torch.equal(model.state_dict()["1.running_mean"], before["1.running_mean"])
    assert int(model.state_dict()["1.num_batches_tracked"]) == int(before["1.num_batches_tracked"]) + 1
    engine.teardown()


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_step_skipped_through_the_amp_facade_restores_buffers(opt_level):
    amp = Amp()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    model.eval()
    model(torch.randn(4, 4))  # evaluation forwards neither change buffers nor arm the guard
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(torch.randn(16, 4) * 1e4)
    with amp.scale_loss(out.float().sum() * float("inf"), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_static_scale_modes_install_no_guard():
    model = make_model()
    engine = build_engine("O4", verbosity=0)
    engine.setup([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    assert not model._forward_pre_hooks or all("BufferGuard" not in repr(h) for h in model._forward_pre_hooks.values())


def test_first_non_finite_names_the_entry():
    state = {"model": {"fc.weight": torch.ones(2), "bn.running_var": torch.tensor([1.0, float("nan")])}, "step": torch.tensor(3)}
    assert first_non_finite(state) == "model.bn.running_var"
    assert (
        first_non_finite({"optimizer": {"state": {0: {"momentum_buffer": torch.tensor([float("inf")])}}}})
        == "optimizer.state.0.momentum_buffer"
    )
    assert first_non_finite({"model": {"w": torch.zeros(3)}, "lists": [torch.ones(1), 2.0]}) is None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setting", ["optimizer.lr=1e6", "optimizer.lr=1e30"])
def test_a_diverging_run_never_saves_a_non_finite_checkpoint(tmp_path, setting):
    """fp32 (no loss scale, nothing skipped): the weights themselves blow up; no such state may be saved."""
    import subprocess
    import sys
    from pathlib import Path

    from ampddp.checkpoint.store import CheckpointStore

    root = Path(__file__).resolve().parents[2]
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "ampddp", "train", str(root / "recipes" / "quickstart.yaml"), f"trainer.run_dir={run_dir}",
               "precision.mode=O0", setting, "checkpoint.every_steps=1", "trainer.max_steps=40",
               "trainer.max_nonfinite_losses=3", "trainer.progress=off", "data.batch_size=16"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=root)
    assert done.returncode == 3, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    store = CheckpointStore(run_dir)
    assert store.complete(), "the run saved no checkpoint at all"
    for ref in store.complete():
        assert first_non_finite(store.load_shared(ref)) is None, ref.path
