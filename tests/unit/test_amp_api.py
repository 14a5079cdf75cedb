"""The apex-compatible facade: shapes, multiple losses/models/optimizers, accumulation, state, misuse."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch import nn

from ampddp import AmpUsageError, ConfigError
from ampddp.amp import Amp


def sgd(model, lr=0.1):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def train_step(amp, model, optimizer, x, y, loss_id=0):
    optimizer.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer, loss_id=loss_id) as scaled:
        scaled.backward()
    optimizer.step()


def test_initialize_returns_the_shapes_it_was_given():
    amp = Amp()
    model = make_mlp()
    assert amp.initialize(model, opt_level="O0", verbosity=0) is model
    model = make_mlp()
    model, optimizer = amp.initialize(model, sgd(model), opt_level="O1", verbosity=0)
    assert isinstance(model, nn.Module) and isinstance(optimizer, torch.optim.SGD)
    models = [make_mlp(), make_mlp(seed=1)]
    out_models, out_optimizers = amp.initialize(models, [sgd(models[0]), sgd(models[1])], opt_level="O2", verbosity=0)
    assert isinstance(out_models, list) and len(out_models) == 2 and isinstance(out_optimizers, list)


def test_disabled_amp_leaves_everything_untouched():
    amp = Amp()
    model = make_mlp()
    optimizer = sgd(model)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", enabled=False)
    assert model[0].weight.dtype == torch.float32
    loss = torch.tensor(2.0, requires_grad=True)
    with amp.scale_loss(loss, optimizer) as scaled:
        assert scaled is loss


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_disabled_engine_trains_like_plain_fp32(level):
    from ampddp import build_engine

    model, reference = make_mlp(), make_mlp()
    optimizer, ref_optimizer = sgd(model), sgd(reference)
    engine = build_engine(level, enabled=False)
    engine.setup([model], [optimizer])
    for x, y in make_batches(3):
        optimizer.zero_grad(), ref_optimizer.zero_grad()
        with engine.forward_context():
            engine.backward(F.cross_entropy(model(x), y))
        assert engine.step(optimizer)
        F.cross_entropy(reference(x), y).backward()
        ref_optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_o1_model_forward_runs_the_op_lists_without_an_explicit_context():
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(dim=-1))
    seen = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    amp = Amp()
    amp.initialize(model, opt_level="O1", verbosity=0)
    assert model(torch.randn(2, 4)).dtype == torch.float32
    assert seen == [torch.float16]
    # apex: casting stays on after the forward (the loss) until scale_loss / a step / end_casts
    assert F.softmax(torch.randn(2).half(), -1).dtype == torch.float32
    amp.end_casts()
    assert F.softmax(torch.randn(2).half(), -1).dtype == torch.float16


def test_o2_casts_inputs_to_model_dtype_and_outputs_to_fp32_or_as_asked():
    model = make_mlp()
    Amp().initialize(model, opt_level="O2", verbosity=0)
    assert model(torch.randn(4, 16)).dtype == torch.float32
    other = make_mlp()
    Amp().initialize(other, opt_level="O2", cast_model_outputs=torch.float16, verbosity=0)
    assert other(torch.randn(4, 16)).dtype == torch.float16


def test_num_losses_keep_separate_scalers():
    amp = Amp()
    model = make_mlp()
    model, optimizer = amp.initialize(model, sgd(model), opt_level="O1", num_losses=2, verbosity=0)
    (x, y), (x2, y2) = make_batches(2)
    x2 = x2.clone()
    x2[0, 0] = float("inf")
    train_step(amp, model, optimizer, x, y, loss_id=0)
    scales = {k: v["loss_scale"] for k, v in amp.state_dict().items()}
    train_step(amp, model, optimizer, x2, y2, loss_id=1)
    after = amp.state_dict()
    assert after["loss_scaler0"]["loss_scale"] == scales["loss_scaler0"]
    assert after["loss_scaler1"]["loss_scale"] == scales["loss_scaler1"] / 2
    with pytest.raises(ConfigError, match="loss_id=2"), amp.scale_loss(torch.ones(()), optimizer, loss_id=2):
        pass


def test_two_models_two_optimizers_only_the_overflowing_backward_skips():
    amp = Amp()
    models = [make_mlp(), make_mlp(seed=1)]
    models, optimizers = amp.initialize(models, [sgd(m) for m in models], opt_level="O2", num_losses=2, verbosity=0)
    (x, y), (bad, y2) = make_batches(2)
    bad = bad.clone()
    bad[0, 0] = float("inf")
    before = [copy.deepcopy([p.detach() for p in m.parameters()]) for m in models]
    for optimizer in optimizers:
        optimizer.zero_grad()
    with amp.scale_loss(F.cross_entropy(models[0](x), y), optimizers[0], loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(F.cross_entropy(models[1](bad), y2), optimizers[1], loss_id=1) as scaled:
        scaled.backward()
    for optimizer in optimizers:
        optimizer.step()
    moved = [not all(torch.equal(a, b) for a, b in zip(snapshot, m.parameters())) for snapshot, m in zip(before, models)]
    assert moved == [True, False]


def test_add_param_group_under_o2_gets_a_master_and_trains():
    amp = Amp()
    body, head = nn.Linear(16, 8), nn.Linear(8, 4)
    model = nn.Sequential(body, nn.ReLU(), head)
    optimizer = torch.optim.SGD(body.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    optimizer.add_param_group({"params": list(head.parameters()), "lr": 0.05})
    head_before = head.weight.detach().clone()
    x, y = make_batches(1)[0]
    for _ in range(2):
        train_step(amp, model, optimizer, x, y)
    masters = list(amp.master_params(optimizer))
    assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)
    assert not torch.equal(head.weight, head_before)
    assert torch.equal(head.weight, masters[2].half())


def reference_grads(model, batches):
    reference = copy.deepcopy(model)
    for x, y in batches:
        F.cross_entropy(reference(x), y).backward()
    return [p.grad for p in reference.parameters()]


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("delay_unscale", [False, True])
def test_accumulation_over_several_scale_loss_calls_sums_unscaled_grads(level, delay_unscale):
    model = make_mlp(batchnorm=False)
    expected = reference_grads(model, make_batches(3))
    amp = Amp()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), opt_level=level, loss_scale=256.0, verbosity=0)
    batches = make_batches(3)
    for index, (x, y) in enumerate(batches):
        last = index == len(batches) - 1
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer, delay_unscale=delay_unscale and not last) as scaled:
            scaled.backward()
    grads = [p.grad for p in amp.master_params(optimizer)]
    for grad, ref in zip(grads, expected):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, ref, rtol=0.05, atol=5e-3)


def test_state_dict_is_apex_format_and_round_trips_between_instances():
    amp = Amp()
    model = make_mlp()
    model, optimizer = amp.initialize(model, sgd(model), opt_level="O2", num_losses=2, verbosity=0)
    for x, y in make_batches(3):
        train_step(amp, model, optimizer, x, y)
    state = amp.state_dict()
    assert set(state) == {"loss_scaler0", "loss_scaler1"}
    assert set(state["loss_scaler0"]) == {"loss_scale", "unskipped"}
    assert isinstance(state["loss_scaler0"]["loss_scale"], float) and isinstance(state["loss_scaler0"]["unskipped"], int)
    other = Amp()
    fresh = make_mlp()
    other.initialize(fresh, sgd(fresh), opt_level="O2", num_losses=2, verbosity=0)
    other.load_state_dict(state)
    assert other.state_dict() == state


def test_grad_scaler_state_round_trips():
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scaler._growth_tracker.fill_(5)
    amp = Amp()
    model = make_mlp()
    amp.initialize(model, sgd(model), opt_level="O1", verbosity=0)
    amp.load_state_dict(scaler.state_dict())
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 5}}
    exported = amp.grad_scaler_state_dict()
    restored = torch.amp.GradScaler("cpu")
    restored.load_state_dict(exported)
    assert restored.get_scale() == 1024.0 and restored.state_dict()["_growth_tracker"] == 5


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}, "optimizer": {}}, "'optimizer' is not a loss scaler"),
        ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}}, "exactly loss_scaler0..loss_scaler1"),
        ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}, "loss_scaler2": {"loss_scale": 4.0, "unskipped": 0}}, "loss_scaler2"),
        ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}, "loss_scaler1": {"loss_scale": -1.0, "unskipped": 0}}, "loss scale=-1.0"),
        ({"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0}, "loss_scaler1": {"scale_value": 2.0}}, "expected apex form"),
        ({"scale": 8.0, "_growth_tracker": 0}, "holds one scaler"),
        ([("loss_scaler0", 1.0)], "must be a dict"),
    ],
)
def test_bad_amp_state_is_refused_and_changes_nothing(state, message):
    amp = Amp()
    model = make_mlp()
    amp.initialize(model, sgd(model), opt_level="O2", num_losses=2, verbosity=0)
    before = amp.state_dict()
    with pytest.raises(ConfigError, match=message):
        amp.load_state_dict(state)
    assert amp.state_dict() == before


def test_o2_model_state_dict_holds_fp32_master_values_and_restores_them_exactly():
    amp = Amp()
    model = make_mlp()
    model, optimizer = amp.initialize(model, sgd(model, lr=0.01), opt_level="O2", verbosity=0)
    for x, y in make_batches(5):
        train_step(amp, model, optimizer, x, y)
    state = model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    masters = list(amp.master_params(optimizer))
    assert torch.equal(state["0.weight"], masters[0])
    assert not torch.equal(state["0.weight"], model[0].weight.float()), "state must hold masters, not upcast half weights"
    saved = {"model": copy.deepcopy(state), "optimizer": copy.deepcopy(optimizer.state_dict()), "amp": amp.state_dict()}

    amp2 = Amp()
    restored = make_mlp(seed=5)
    restored, optimizer2 = amp2.initialize(restored, sgd(restored, lr=0.01), opt_level="O2", verbosity=0)
    restored.load_state_dict(saved["model"])
    optimizer2.load_state_dict(saved["optimizer"])
    amp2.load_state_dict(saved["amp"])
    for master, master2 in zip(masters, amp2.master_params(optimizer2)):
        assert torch.equal(master, master2)
    assert torch.equal(restored[0].weight, masters[0].half())


def test_misuse_gets_clear_errors():
    amp = Amp()
    with pytest.raises(AmpUsageError, match="initialize"), amp.scale_loss(torch.ones(()), sgd(make_mlp())):
        pass
    model = make_mlp()
    optimizer = sgd(model)
    with pytest.raises(AmpUsageError, match="passed twice"):
        amp.initialize(model, [optimizer, optimizer], opt_level="O1")
    with pytest.raises(AmpUsageError, match="already wrapped in DataParallel"):
        amp.initialize(nn.DataParallel(model), optimizer, opt_level="O1")
    with pytest.raises(AmpUsageError, match=r"'0\.weight' is torch\.float16"):
        amp.initialize(make_mlp().half(), opt_level="O2")
    with pytest.raises(AmpUsageError, match="models must be a Module"):
        amp.initialize("model", opt_level="O1")
    with pytest.raises(ConfigError, match="letter 'O'"):
        amp.initialize(model, optimizer, opt_level="02")
    with pytest.raises(ConfigError, match="did you mean 'loss_scale'"):
        amp.initialize(model, optimizer, opt_level="O1", loss_scaling=2)


def test_initialize_twice_on_the_same_model_is_refused_after_o2():
    amp = Amp()
    model = make_mlp()
    model, optimizer = amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    with pytest.raises(AmpUsageError, match="already initialized"):
        amp.initialize(model, sgd(model), opt_level="O2")
    x, y = make_batches(1)[0]
    train_step(amp, model, optimizer, x, y)
    assert model(x).dtype == torch.float32, "the refused call must leave the working set-up in place"


def test_backward_outside_scale_loss_under_o2_is_an_error_not_a_silent_no_op():
    amp = Amp()
    model = make_mlp()
    model, optimizer = amp.initialize(model, sgd(model), opt_level="O2", verbosity=0)
    x, y = make_batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(AmpUsageError, match="never unscaled"):
        optimizer.step()


def test_step_after_delay_unscale_is_an_error():
    amp = Amp()
    model = make_mlp()
    model, optimizer = amp.initialize(model, sgd(model), opt_level="O1", verbosity=0)
    x, y = make_batches(1)[0]
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(AmpUsageError, match="delay_unscale=True"):
        optimizer.step()


def test_initialize_again_keeps_the_earlier_setup_training():
    """apex's test_restoring: a reference and a restored model, each initialized, both train."""
    amp = Amp()
    first = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(first.parameters(), lr=0.1)
    amp.initialize(first, optimizer, opt_level="O2", loss_scale=8.0, verbosity=0)
    second = make_mlp()
    second_opt = sgd(second)
    amp.initialize(second, second_opt, opt_level="O1", verbosity=0)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16  # the newest set-up, as apex's globals
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    with amp.scale_loss(first(torch.randn(2, 4)).float().sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert first[0].weight.dtype == torch.float16
    assert all(not torch.equal(a, b) for a, b in zip(before, amp.master_params(optimizer)))
    assert torch.equal(first[0].weight, next(iter(amp.master_params(optimizer))).half())
    x, y = make_batches(1)[0]
    with amp.scale_loss(F.cross_entropy(second(x), y), second_opt) as scaled:
        scaled.backward()
    second_opt.step()


def test_initialize_with_a_model_again_replaces_its_setup():
    amp = Amp()
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", loss_scale=8.0, verbosity=0)
    amp.initialize(model, opt_level="O0", verbosity=0)
    assert len(amp.setups) == 1
    assert model(torch.randn(2, 4)).dtype == torch.float32
    with pytest.raises(AmpUsageError, match="not passed to initialize"), amp.scale_loss(torch.ones(()), optimizer):
        pass


def test_scale_loss_over_optimizers_of_two_setups_is_an_error():
    amp = Amp()
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt_a, opt_b = sgd(a), sgd(b)
    amp.initialize(a, opt_a, opt_level="O1", verbosity=0)
    amp.initialize(b, opt_b, opt_level="O1", verbosity=0)
    with pytest.raises(AmpUsageError, match=r"different amp.initialize"), amp.scale_loss(torch.ones(()), [opt_a, opt_b]):
        pass


def test_two_instances_are_independent():
    a, b = Amp(), Amp()
    a.register_float_function(torch, "sigmoid")
    model_a, model_b = nn.Sequential(nn.Linear(2, 2), nn.Sigmoid()), nn.Sequential(nn.Linear(2, 2), nn.Sigmoid())
    a.initialize(model_a, opt_level="O1", verbosity=0)
    b.initialize(model_b, opt_level="O1", loss_scale=4.0, verbosity=0)
    assert model_a(torch.randn(1, 2)).dtype == torch.float32
    assert model_b(torch.randn(1, 2)).dtype == torch.float16
    assert a.state_dict() != b.state_dict()


def test_apex_impl_without_apex_explains_the_removal_and_the_alternative():
    with pytest.raises(ConfigError) as error:
        Amp().initialize(make_mlp(), opt_level="O1", impl="apex")
    message = str(error.value)
    assert "25.04" in message and "removed" in message and "impl='builtin'" in message


def test_an_optimizers_state_dict_carries_its_loss_scales_back():
    """Code that checkpoints the optimizer but not amp (Hugging Face's Trainer) resumes with the scale it
    had, not apex's fresh 2**16; a refused or unfitting state changes no scale."""
    amp = Amp()
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", num_losses=2, verbosity=0)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 7}, "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    saved = copy.deepcopy(optimizer.state_dict())
    assert saved["ampddp_amp"] == amp.state_dict()

    fresh = Amp()
    again = make_mlp(batchnorm=False)
    again_optimizer = sgd(again)
    again, again_optimizer = fresh.initialize(again, again_optimizer, opt_level="O2", num_losses=2, verbosity=0)
    broken = {**saved, "param_groups": saved["param_groups"] * 2}
    with pytest.raises(ValueError, match="parameter groups"):
        again_optimizer.load_state_dict(broken)
    assert fresh.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16  # the refused state changed nothing
    again_optimizer.load_state_dict(saved)
    assert fresh.state_dict() == amp.state_dict()
    assert "ampddp_amp" in saved  # the caller's dict is left as it was

    other = Amp()
    one = make_mlp(batchnorm=False)
    one_optimizer = sgd(one)
    one, one_optimizer = other.initialize(one, one_optimizer, opt_level="O1", verbosity=0)
    with pytest.warns(UserWarning, match=r"holds 2 scalers but this amp has 1.*the loss scale stays as it is"):
        one_optimizer.load_state_dict(saved)
    assert other.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16
    plain = {key: value for key, value in saved.items() if key != "ampddp_amp"}
    one_optimizer.load_state_dict(plain)  # an optimizer state from before: the scale stays
    assert other.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16
