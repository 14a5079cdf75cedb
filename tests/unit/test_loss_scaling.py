"""Loss scaler rules, injected overflow (skip + exact halving) and growth after the window."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp

from ampddp import LossScaler, build_engine
from ampddp.amp import Amp


def test_dynamic_scaler_halves_on_overflow_and_grows_after_the_window():
    scaler = LossScaler(dynamic=True, init_scale=2.0**16, growth_interval=3)
    assert scaler.update(found_inf=True) is True
    assert (scaler.loss_scale, scaler.unskipped, scaler.skipped_steps) == (2.0**15, 0, 1)
    for _ in range(2):
        assert scaler.update(found_inf=False) is False
    assert scaler.loss_scale == 2.0**15
    scaler.update(found_inf=False)
    assert (scaler.loss_scale, scaler.unskipped) == (2.0**16, 0)


def test_scale_stays_within_min_and_max():
    scaler = LossScaler(dynamic=True, init_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=1)
    for _ in range(3):
        scaler.update(found_inf=True)
    assert scaler.loss_scale == 2.0 and scaler.at_minimum
    for _ in range(5):
        scaler.update(found_inf=False)
    assert scaler.loss_scale == 8.0


def test_configurable_factors_and_hysteresis():
    scaler = LossScaler(dynamic=True, init_scale=100.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=2, hysteresis=2)
    scaler.update(found_inf=True)
    assert scaler.loss_scale == 100.0 and scaler.skipped_steps == 1
    scaler.update(found_inf=True)
    assert scaler.loss_scale == 25.0 and scaler.skipped_steps == 2
    scaler.update(found_inf=False)
    scaler.update(found_inf=False)
    assert scaler.loss_scale == 75.0


def test_static_scaler_never_skips():
    scaler = LossScaler(dynamic=False, init_scale=128.0)
    assert scaler.update(found_inf=True) is False
    assert scaler.loss_scale == 128.0 and scaler.skipped_steps == 0


def test_fused_unscale_reports_non_finite_values():
    scaler = LossScaler(dynamic=True, init_scale=4.0)
    grads = [torch.full((3,), 8.0), torch.full((2,), 4.0).half()]
    assert scaler.unscale_(grads).item() == 0.0
    assert grads[0].tolist() == [2.0] * 3 and grads[1].tolist() == [1.0] * 2
    assert scaler.unscale_([torch.tensor([1.0, float("inf")])]).item() > 0
    assert scaler.unscale_([]) is None


def snapshot(model, optimizer):
    return copy.deepcopy([p.detach() for p in model.parameters()]), copy.deepcopy(optimizer.state_dict())


def assert_unchanged(before, model, optimizer):
    params, state = before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    now = optimizer.state_dict()
    assert now["state"].keys() == state["state"].keys()
    for key, entry in state["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(now["state"][key][name]), torch.as_tensor(value))


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("poisoned_micro_batch", [0, 1])
def test_facade_injected_overflow_skips_the_step_and_halves_the_scale_once(level, poisoned_micro_batch):
    amp = Amp()
    model = make_mlp()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), opt_level=level, verbosity=0)
    batches = make_batches(4)
    for x, y in batches[:2]:
        optimizer.zero_grad()
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    before = snapshot(model, optimizer)
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    skipped = amp.engine.skipped_steps
    optimizer.zero_grad()
    for index, (x, y) in enumerate(batches[2:]):
        if index == poisoned_micro_batch:
            x = x.clone()
            x[0, 0] = float("inf")
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
            scaled.backward()
    optimizer.step()
    assert_unchanged(before, model, optimizer)
    state = amp.state_dict()["loss_scaler0"]
    assert state["loss_scale"] == scale / 2
    assert state["unskipped"] == (0 if poisoned_micro_batch == 1 else 1)
    assert amp.engine.skipped_steps == skipped + 1
    x, y = batches[0]
    optimizer.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(before[0], model.parameters())), "the step after a skip must apply"


@pytest.mark.parametrize("mode", ["O1", "O2", "native-fp16"])
def test_engine_injected_overflow_skips_and_growth_follows_the_window(mode):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = build_engine(mode, growth_interval=3)
    engine.setup([model], [optimizer])

    def step(x, y):
        optimizer.zero_grad()
        with engine.forward_context():
            loss = F.cross_entropy(model(x), y)
        engine.backward(loss)
        return engine.step(optimizer)

    batches = make_batches(6)
    assert step(*batches[0])
    before = snapshot(model, optimizer)
    scale = engine.loss_scale()
    poisoned = batches[1][0].clone()
    poisoned[3, 2] = float("nan")
    assert not step(poisoned, batches[1][1])
    assert_unchanged(before, model, optimizer)
    assert engine.loss_scale() == scale / 2 and engine.skipped_steps == 1
    for x, y in batches[2:5]:
        assert step(x, y)
    assert engine.loss_scale() == scale


def test_master_grads_are_fp32_and_unscaled():
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = copy.deepcopy(model)
    engine = build_engine("O2", verbosity=0)
    engine.setup([model], [optimizer])
    x, y = make_batches(1)[0]
    with engine.forward_context():
        loss = F.cross_entropy(model(x), y)
    engine.backward(loss)
    engine.unscale_(optimizer)
    F.cross_entropy(reference(x), y).backward()
    for master, ref in zip(engine.master_params(optimizer), reference.parameters()):
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, ref.grad, rtol=0.05, atol=2e-3)
