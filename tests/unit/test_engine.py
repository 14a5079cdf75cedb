"""The engine interface the trainer uses: every mode behind one API, clipping, state, errors."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp, small_model_settings

from ampddp import PRECISION_MODES, AmpUsageError, ConfigError, OpRegistry, build_engine


def setup(mode, **overrides):
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = build_engine(mode, **{**small_model_settings(mode), **overrides})
    engine.setup([model], [optimizer])
    return engine, model, optimizer


def step(engine, model, optimizer, x, y, accumulate=1):
    optimizer.zero_grad()
    for chunk_x, chunk_y in zip(x.chunk(accumulate), y.chunk(accumulate)):
        with engine.forward_context():
            loss = F.cross_entropy(model(chunk_x), chunk_y) / accumulate
        engine.backward(loss)
    return engine.step(optimizer)


@pytest.mark.parametrize("mode", PRECISION_MODES)
def test_every_mode_trains_and_reports_scale_and_state(mode):
    engine, model, optimizer = setup(mode)
    losses = []
    for x, y in make_batches(8):
        step(engine, model, optimizer, x, y)
        with torch.no_grad(), engine.forward_context():
            losses.append(F.cross_entropy(model(x).float(), y).item())
    assert losses[-1] < losses[0]
    state = engine.state_dict()
    assert state["mode"] == mode and isinstance(state["scalers"], list)
    assert len(engine.precision_state().fp8_layers) == (2 if mode == "O6" else 0)  # O6 runs the two 16-multiple layers in fp8
    # Dynamic scaling starts at 2**16 (O1, O2, native-fp16); O3 and the fp32/bf16 levels use a static 1.0. Eight
    # small steps overflow nothing, so the scale has not moved and no step was skipped.
    expected = 2.0**16 if mode in ("O1", "O2", "native-fp16") else 1.0
    assert engine.loss_scale() == expected and engine.skipped_steps == 0
    assert [s["loss_scale"] for s in state["scalers"]] == ([] if mode == "native-bf16" else [expected])
    fresh, _, _ = setup(mode)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state


@pytest.mark.parametrize("mode", ["O1", "O2", "native-fp16", "O5"])
def test_accumulation_equals_the_whole_batch(mode):
    x, y = make_batches(1, batch=32)[0]
    whole, whole_model, whole_opt = setup(mode, loss_scale=128.0) if mode != "native-fp16" else setup(mode)
    split, split_model, split_opt = setup(mode, loss_scale=128.0) if mode != "native-fp16" else setup(mode)
    whole_model.eval(), split_model.eval()
    step(whole, whole_model, whole_opt, x, y)
    step(split, split_model, split_opt, x, y, accumulate=4)
    for a, b in zip(whole.master_params(whole_opt), split.master_params(split_opt)):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3)


def test_o2_clipping_acts_on_unscaled_fp32_masters_and_matches_fp32():
    x, y = make_batches(1)[0]
    reference = make_mlp()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    F.cross_entropy(reference(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_opt.step()

    engine, model, optimizer = setup("O2", verbosity=0)
    with engine.forward_context():
        loss = F.cross_entropy(model(x), y)
    engine.backward(loss)
    norm = engine.clip_grad_norm_([optimizer], 0.5)
    assert engine.step(optimizer)
    assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-2)
    for master, ref in zip(engine.master_params(optimizer), reference.parameters()):
        torch.testing.assert_close(master, ref, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("mode", ["O2", "native-bf16"])
def test_grad_norm_for_logging_measures_unscaled_grads_and_changes_none(mode):
    x, y = make_batches(1)[0]
    engine, model, optimizer = setup(mode, **({"verbosity": 0} if mode == "O2" else {}))
    with engine.forward_context():
        loss = F.cross_entropy(model(x), y)
    engine.backward(loss)
    norm = engine.grad_norm([optimizer])
    grads = [p.grad.clone() for p in engine.master_params(optimizer)]
    assert norm.item() == pytest.approx(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
    first = next(iter(engine.master_params(optimizer)))
    first.grad[0] = float("inf")  # an infinite norm must not turn the gradients into NaN (clipping at inf would)
    assert engine.grad_norm([optimizer]).item() == float("inf")
    assert torch.equal(first.grad[1:], grads[0][1:])
    assert not any(p.grad.isnan().any() for p in engine.master_params(optimizer))


def test_unknown_optimizer_and_mixed_loss_ids_are_errors():
    engine, model, _ = setup("O1", num_losses=2, verbosity=0)
    stranger = torch.optim.SGD(make_mlp().parameters(), lr=0.1)
    with pytest.raises(AmpUsageError, match="not passed"):
        engine.step(stranger)
    x, y = make_batches(1)[0]
    with engine.forward_context():
        loss = F.cross_entropy(model(x), y)
    engine.backward(loss, loss_id=0)
    with pytest.raises(AmpUsageError, match="loss_id=1"):
        engine.backward(loss, loss_id=1)


def test_factory_rejects_unknown_modes_impls_and_settings():
    with pytest.raises(ConfigError, match="did you mean 'native-bf16'"):
        build_engine("native-bf61")
    with pytest.raises(ConfigError, match="valid choices: builtin, apex"):
        build_engine("O1", impl="torch")
    with pytest.raises(ConfigError, match="valid choices: builtin"):
        build_engine("native-fp16", impl="apex")
    with pytest.raises(ConfigError, match="did you mean 'growth_interval'"):
        build_engine("native-fp16", growth_intervals=3)
    with pytest.raises(ConfigError, match="loss_scale"):
        build_engine("native-fp16", loss_scale=8.0)


def test_native_bf16_has_no_scaler_and_native_fp16_is_dynamic():
    bf16, _, _ = setup("native-bf16")
    fp16, _, _ = setup("native-fp16", init_loss_scale=1024.0)
    assert bf16.loss_scale() == 1.0 and bf16.state_dict()["scalers"] == []
    assert fp16.loss_scale() == 1024.0 and len(fp16.state_dict()["scalers"]) == 1


def test_teardown_removes_every_hook():
    engine, model, optimizer = setup("O2", verbosity=0)
    engine.teardown()
    assert not model._forward_hooks and not model._forward_pre_hooks and not model._state_dict_hooks
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


class FakeApexAmp(types.ModuleType):
    """Stands in for an old apex build: records what the apex backend delegates."""

    def __init__(self):
        super().__init__("apex.amp")
        self.calls = []
        self.scale = 8.0

    def register_float_function(self, module, name):
        self.calls.append(("register_float_function", name))

    def initialize(self, models, optimizers, opt_level, **overrides):
        self.calls.append(("initialize", opt_level, overrides))
        return models, optimizers

    def scale_loss(self, loss, optimizers, loss_id=0, delay_unscale=False):
        amp = self

        class Context:
            def __enter__(self):
                return loss * amp.scale

            def __exit__(self, *exc):
                amp.scale /= 2

        return Context()

    def state_dict(self):
        return {"loss_scaler0": {"loss_scale": self.scale, "unskipped": 0}}

    def load_state_dict(self, state):
        self.calls.append(("load_state_dict", state))

    def master_params(self, optimizer):
        return iter(optimizer.param_groups[0]["params"])


def test_apex_backend_delegates_to_apex_amp(monkeypatch):
    fake = FakeApexAmp()
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.amp", fake)
    registry = OpRegistry()
    registry.register(torch, "sigmoid", "float")
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = build_engine("O2", impl="apex", registry=registry, keep_batchnorm_fp32=True)
    engine.setup([model], [optimizer])
    assert fake.calls[:2] == [("register_float_function", "sigmoid"), ("initialize", "O2", {"keep_batchnorm_fp32": True})]
    x, y = make_batches(1)[0]
    before = copy.deepcopy(model.state_dict())
    engine.backward(F.cross_entropy(model(x), y))
    assert engine.step(optimizer) is False and engine.skipped_steps == 1
    assert not torch.equal(before["0.weight"], model.state_dict()["0.weight"])
    engine.load_state_dict({"scalers": [{"loss_scale": 2.0, "unskipped": 3}]})
    assert fake.calls[-1] == ("load_state_dict", {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 3}})
    assert engine.state_dict()["impl"] == "apex"
    # The two halves open and close one of apex's scale_loss blocks; a stage without a loss has none to close.
    fake.scale = 8.0
    engine.scale_for_backward(F.cross_entropy(model(x), y)).backward()
    engine.backward_done()
    assert engine.step(optimizer) is False and engine.skipped_steps == 1  # counted from the loaded state (0)
    with pytest.raises(AmpUsageError, match=r"backward_done without scale_for_backward: NVIDIA apex's amp unscales in the scale_loss"):
        engine.backward_done()
    with pytest.raises(ConfigError, match=r"impl=apex cannot agree its loss-scale verdict over a process group"):
        engine.agree_over(object())


@pytest.mark.parametrize("mode", ["O0", "O1", "O2", "O3", "O5", "native-fp16", "native-bf16"])
def test_the_backward_in_two_halves_is_the_backward(mode):
    x, y = make_batches(1, batch=32)[0]
    trained = []
    for halves in (False, True):
        engine, model, optimizer = setup(mode)
        optimizer.zero_grad()
        for chunk_x, chunk_y in zip(x.chunk(2), y.chunk(2)):
            with engine.forward_context():
                loss = F.cross_entropy(model(chunk_x), chunk_y) / 2
            if halves:
                engine.scale_for_backward(loss).backward()
                engine.backward_done()
            else:
                engine.backward(loss)
        assert engine.step(optimizer)
        trained.append((model.state_dict(), engine.state_dict()))
    (whole, whole_state), (split, split_state) = trained
    assert whole_state == split_state and all(torch.equal(whole[key], split[key]) for key in whole)


@pytest.mark.parametrize("mode", ["O1", "native-fp16"])
def test_a_pipeline_stage_without_a_loss_only_says_its_backward_is_done(mode):
    """Two stages, an engine each: the last scales its loss; the first's backward starts from the gradients the
    last sent back (scaled already), and it only says when that backward is done. Both step as the whole model."""
    x, y = make_batches(1)[0]
    engine, model, optimizer = setup(mode)
    assert step(engine, model, optimizer, x, y)
    layers = list(make_mlp())
    stages = [torch.nn.Sequential(*layers[:3]), torch.nn.Sequential(*layers[3:])]
    optimizers = [torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9) for stage in stages]
    engines = [build_engine(mode) for _ in stages]
    for stage_engine, stage, stage_optimizer in zip(engines, stages, optimizers):
        stage_engine.setup([stage], [stage_optimizer])
    with engines[0].forward_context():
        sent = stages[0](x)
    received = sent.detach().requires_grad_()
    with engines[1].forward_context():
        loss = F.cross_entropy(stages[1](received), y)
    engines[1].scale_for_backward(loss).backward()
    engines[1].backward_done()
    sent.backward(received.grad)
    engines[0].backward_done()
    assert all(stage_engine.step(stage_optimizer) for stage_engine, stage_optimizer in zip(engines, optimizers))
    pipelined = [param for stage in stages for param in stage.parameters()]
    assert all(torch.equal(whole, stage_param) for whole, stage_param in zip(model.parameters(), pipelined))


@pytest.mark.parametrize(("mode", "skips"), [("O1", True), ("O2", True), ("native-fp16", True), ("O5", False), ("native-bf16", False)])
def test_a_non_finite_gradient_norm_counts_as_an_overflow(mode, skips):
    """A gradient finite in itself whose square is not (1e30): only the norm says overflow, and a dynamic loss
    scale skips the step on it (a static one never skips, as in apex)."""
    engine, model, optimizer = setup(mode, **({"verbosity": 0} if mode.startswith("O") else {}))
    x, y = make_batches(1)[0]
    with engine.forward_context():
        loss = F.cross_entropy(model(x), y)
    engine.backward(loss)
    engine.unscale_(optimizer)
    next(iter(engine.master_params(optimizer))).grad.view(-1)[0] = 1e30
    scale = engine.loss_scale()
    assert engine.grad_norm([optimizer]).item() == float("inf")
    assert engine.step(optimizer) is not skips
    assert engine.loss_scale() == (scale / 2 if skips else scale) and engine.skipped_steps == int(skips)


def test_the_verdict_is_agreed_over_a_process_group_or_none():
    engine, _, _ = setup("O1", verbosity=0)
    assert engine.verdict_group is None
    engine.agree_over(None)
    with pytest.raises(ConfigError, match=r"agree_over\('world'\) is not valid: give the torch.distributed.ProcessGroup of every rank"):
        engine.agree_over("world")
