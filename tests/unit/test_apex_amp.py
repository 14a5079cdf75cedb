"""``ampddp.apex.amp``: apex's amp namespace, the loss cast as apex cast it, ``_amp_state``, the legacy
``amp.init`` handle, several ``initialize`` calls, and apex's op-casting rules (our own tests of the
behaviour apex's L0 tests define)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch import nn

from ampddp import AmpUsageError, ConfigError
from ampddp.amp import Amp
from ampddp.apex import amp as apex_amp
from ampddp.apex.amp._amp_state import AmpStateView


def sgd(model, lr=0.1):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


@pytest.fixture
def amp():
    """A fresh facade instance with apex's ``_amp_state`` view over it."""
    instance = Amp()
    yield instance, AmpStateView(instance)
    instance.end_casts()


# ---- the namespace apex-era code looks into --------------------------------------------------------
def test_apex_amp_is_the_ampddp_facade_and_has_apex_names_in_its_namespace():
    import ampddp.amp

    assert apex_amp.initialize is ampddp.amp.initialize and apex_amp.scale_loss is ampddp.amp.scale_loss
    for name in ("initialize", "scale_loss", "state_dict", "load_state_dict", "master_params", "init", "_amp_state",
                 "half_function", "float_function", "promote_function", "register_float_function", "disable_casts"):  # fmt: skip
        assert name in apex_amp.__dict__, name
    from ampddp.apex.amp import _amp_state

    assert isinstance(_amp_state, AmpStateView)


def test_names_apex_amp_lacks_fail_with_their_replacement():
    with pytest.raises(AttributeError, match=r"apex.amp.LossScaler is not provided.*ampddp.LossScaler"):
        apex_amp.LossScaler  # noqa: B018
    assert not hasattr(apex_amp, "no_such_name")
    with pytest.raises(ImportError, match=r"apex.amp.rnn_compat is not provided"):
        from ampddp.apex.amp import rnn_compat  # noqa: F401
    import ampddp.apex

    with pytest.raises(AttributeError, match=r"apex.contrib is not provided"):
        ampddp.apex.contrib  # noqa: B018


# ---- O1/O4: the loss computed outside the model runs through apex's lists ----------------------------
@pytest.mark.parametrize("opt_level, low", [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_loss_outside_the_model_is_fp32_and_casting_ends_at_scale_loss(amp, opt_level, low):
    amp, _ = amp
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    x, y = make_batches(1)[0]
    output = model(x)
    assert output.dtype == low
    loss = F.cross_entropy(output, y)
    assert loss.dtype == torch.float32
    assert F.softmax(output, -1).dtype == torch.float32
    assert (output * 2).dtype == low  # unlisted ops keep their input's dtype, as with apex's patches
    with amp.scale_loss(loss, optimizer) as scaled:
        assert F.softmax(output, -1).dtype == low  # casting is off from scale_loss on
        scaled.backward()
    optimizer.step()
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_casting_window_closes_at_step_and_end_casts_and_reopens_on_forward(amp):
    amp, _ = amp
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    x, y = make_batches(1)[0]
    half = torch.randn(3).half()
    model(x)
    assert F.softmax(half, -1).dtype == torch.float32
    optimizer.step()  # no grads: a no-op step, with casts off
    assert F.softmax(half, -1).dtype == torch.float16
    model.eval()
    with torch.no_grad():
        assert F.cross_entropy(model(x), y).dtype == torch.float32  # evaluation losses too
    amp.end_casts()
    assert F.softmax(half, -1).dtype == torch.float16
    model(x)
    with amp.disable_casts():
        assert F.softmax(half, -1).dtype == torch.float16
    assert F.softmax(half, -1).dtype == torch.float32


def test_the_engine_api_keeps_casting_inside_the_forward():
    from ampddp import build_engine

    model = make_mlp(batchnorm=False)
    engine = build_engine("O1", verbosity=0)
    engine.setup([model], [sgd(model)])
    out = model(make_batches(1)[0][0])
    assert out.dtype == torch.float16 and F.softmax(out, -1).dtype == torch.float16
    engine.teardown()


def test_a_second_instance_forward_ends_the_first_instance_window():
    a, b = Amp(), Amp()
    a.register_float_function(torch, "sigmoid")
    model_a, model_b = nn.Sequential(nn.Linear(2, 2), nn.Sigmoid()), nn.Sequential(nn.Linear(2, 2), nn.Sigmoid())
    a.initialize(model_a, opt_level="O1", verbosity=0)
    b.initialize(model_b, opt_level="O1", verbosity=0)
    assert model_a(torch.randn(1, 2)).dtype == torch.float32
    assert model_b(torch.randn(1, 2)).dtype == torch.float16  # a's registration does not leak into b's forward
    b.end_casts()


# ---- apex's op rules ---------------------------------------------------------------------------------
def test_banned_function_and_in_place_fp32_ops_on_half_raise_not_implemented(amp):
    amp, _ = amp
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid())
    amp.initialize(model, opt_level="O1", verbosity=0)
    probabilities = model(torch.randn(3, 4))
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        F.binary_cross_entropy(probabilities.half(), torch.rand(3, 4))
    with pytest.raises(NotImplementedError, match=r"in-place exp_ on a torch.float16 tensor"):
        torch.randn(3).half().exp_()
    fp32 = torch.randn(3)
    assert fp32.exp_().dtype == torch.float32
    assert torch.randn(3).half().cpu().dtype == torch.float32  # Tensor.cpu is on apex's fp32 list


# ---- several initialize calls (apex's test_restoring) ------------------------------------------------
@pytest.mark.parametrize("opt_level, restore_level", [("O1", "O2"), ("O2", "O2"), ("O2", "O0"), ("O3", "O1")])
def test_reference_and_restored_setups_train_side_by_side(amp, opt_level, restore_level):
    amp, _ = amp
    torch.manual_seed(3)
    model = make_mlp(batchnorm=True)
    optimizer = sgd(model, lr=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    batches = make_batches(6)

    def train_step(m, opt, x, y):
        opt.zero_grad()
        out = m(x)
        with amp.scale_loss(F.cross_entropy(out, y), opt) as scaled:
            scaled.backward()
        opt.step()
        return out.detach().float()

    for x, y in batches[:3]:
        train_step(model, optimizer, x, y)
    # deepcopy: as on disk (optimizer.state_dict() hands out the live momentum buffers)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()})
    assert all(v.dtype not in (torch.float16, torch.bfloat16) for v in checkpoint["model"].values())
    restored = make_mlp(batchnorm=True)
    restored_opt = sgd(restored, lr=0.01)
    restored, restored_opt = amp.initialize(restored, restored_opt, opt_level=restore_level, verbosity=0)
    restored.load_state_dict(checkpoint["model"])
    restored_opt.load_state_dict(checkpoint["optimizer"])
    assert len(amp.setups) == 2
    for x, y in batches[3:]:
        reference = train_step(model, optimizer, x, y)
        again = train_step(restored, restored_opt, x, y)
        if opt_level == restore_level:
            assert torch.equal(reference, again)
        else:
            assert torch.allclose(reference, again, atol=0.1, rtol=0.1)


# ---- _amp_state --------------------------------------------------------------------------------------
def test_amp_state_reads_and_writes_through_to_the_live_scalers(amp):
    amp, state = amp
    with pytest.raises(AttributeError, match=r"after amp.initialize"):
        state.loss_scalers  # noqa: B018
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", num_losses=2, verbosity=0)
    assert state.opt_properties.loss_scale == "dynamic" and state.opt_properties.opt_level == "O2"
    assert [s.loss_scale() for s in state.loss_scalers] == [2.0**16, 2.0**16]
    state.loss_scalers[1]._loss_scale = 4.0
    assert amp.state_dict()["loss_scaler1"]["loss_scale"] == 4.0
    x, y = make_batches(1)[0]
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer, loss_id=1) as scaled:
        assert torch.equal(scaled, loss.float() * 4.0)
        scaled.backward()
    assert state.loss_scalers[1]._unskipped == 1
    with pytest.raises(ConfigError, match="finite number > 0"):
        state.loss_scalers[0]._loss_scale = -1.0
    with pytest.raises(AmpUsageError, match=r"cannot be changed after amp.initialize"):
        state.opt_properties.loss_scale = 8.0
    with pytest.raises(AttributeError, match="writable: allow_incoming_model_not_fp32"):
        state.loss_scalers = []


def test_allow_incoming_model_not_fp32_and_injected_overflow_as_apex_tests_do(amp):
    """apex's multiple-models test: fp16 params on entry, a forced scale, an inf in one backward."""
    amp, state = amp

    class Mixed(nn.Module):
        def __init__(self, unique):
            super().__init__()
            self.weight0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
            self.weight1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float16))

        def forward(self, x):
            return ((x * self.weight0.float()) * self.weight1.float()).sum()

    model0, model1 = Mixed(1), Mixed(2)
    optimizer = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}, {"params": model1.parameters(), "lr": 0.5}], momentum=0.125)
    with pytest.raises(AmpUsageError, match="must be fp32"):
        amp.initialize([model0, model1], optimizer, opt_level="O2", cast_model_type=False, verbosity=0)
    state.allow_incoming_model_not_fp32 = True
    [model0, model1], optimizer = amp.initialize(
        [model0, model1], optimizer, opt_level="O2", cast_model_type=False, num_losses=2, verbosity=0
    )
    state.allow_incoming_model_not_fp32 = False
    state.loss_scalers[0]._loss_scale = 4.0
    state.loss_scalers[1]._loss_scale = 16.0
    x = torch.ones(2)
    before = [p.detach().clone() for p in [*model0.parameters(), *model1.parameters()]]
    with amp.scale_loss(model0(x), optimizer, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(model1(x), optimizer, loss_id=1) as scaled:
        scaled.backward()
        model1.weight1.grad[0] = float("inf")
    optimizer.step()
    assert [s.loss_scale() for s in state.loss_scalers] == [4.0, 8.0]
    after = [p.detach() for p in [*model0.parameters(), *model1.parameters()]]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # the whole step was skipped
    masters = list(amp.master_params(optimizer))
    assert masters[1].dtype == torch.float32  # fp16 params on entry got fp32 masters (O2)
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(after, masters))


def test_amp_state_handle_deactivate_ends_o1_casting(amp):
    amp, state = amp
    model = nn.Sequential(nn.Linear(4, 4))
    amp.initialize(model, opt_level="O1", verbosity=0)
    assert model(torch.randn(2, 4)).dtype == torch.float16
    assert state.handle.is_active()
    state.handle._deactivate()
    assert not state.handle.is_active()
    assert model(torch.randn(2, 4)).dtype == torch.float32
    assert F.softmax(torch.randn(2).half(), -1).dtype == torch.float16


# ---- the legacy handle API -----------------------------------------------------------------------------
LEGACY_CASES = [
    ("linear", lambda x, m: m(x), torch.float16),
    ("softmax", lambda x, m: F.softmax(x, dim=1), torch.float32),
    ("mse_loss", lambda x, m: F.mse_loss(x, torch.randn(4, 8)), torch.float32),
    ("pow", lambda x, m: x**2.0, torch.float32),
    ("sum", lambda x, m: x.sum(), torch.float32),
    ("matmul", lambda x, m: x @ torch.randn(8, 8), torch.float16),
    ("cpu", lambda x, m: x.cpu(), torch.float32),
]


@pytest.mark.parametrize("name, fn, expected", LEGACY_CASES, ids=[c[0] for c in LEGACY_CASES])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16])
def test_legacy_init_handle_casts_until_deactivate(name, fn, expected, input_dtype):
    layer = nn.Linear(8, 8)
    handle = apex_amp.init(enabled=True)
    try:
        x = torch.randn(4, 8, dtype=input_dtype).requires_grad_()
        y = fn(x, layer)
        assert y.dtype == expected
        y.float().sum().backward()
        assert x.grad.dtype == input_dtype
        for match_input in (F.relu, torch.nn.BatchNorm1d(8).to(input_dtype)):
            assert match_input(x).dtype == input_dtype
    finally:
        handle._deactivate()
    assert not torch.overrides._is_torch_function_mode_enabled()
    assert layer(torch.randn(2, 8)).dtype == torch.float32


def test_legacy_handle_bfloat16_banned_and_promotion_rules():
    handle = apex_amp.init(enabled=True, patch_type=torch.bfloat16)
    try:
        assert F.linear(torch.randn(2, 3), torch.randn(3, 3)).dtype == torch.bfloat16
        low = torch.randn(4, dtype=torch.bfloat16)
        assert torch.cat([low, torch.randn(4)]).dtype == torch.float32
        assert torch.cat([low, low]).dtype == torch.bfloat16
        assert low.clone().add_(torch.randn(4)).dtype == torch.bfloat16  # in place keeps self's dtype
        with pytest.raises(NotImplementedError):
            low.exp_()
        with pytest.raises(NotImplementedError):
            F.binary_cross_entropy(torch.rand(3, dtype=torch.bfloat16), torch.rand(3))
    finally:
        handle._deactivate()
    allowed = apex_amp.init(enabled=True, allow_banned=True)
    try:
        assert F.binary_cross_entropy(torch.rand(3).half(), torch.rand(3)).dtype == torch.float32
    finally:
        allowed._deactivate()
    with pytest.raises(ConfigError, match="patch_type"):
        apex_amp.init(patch_type=torch.float64)


def test_legacy_handle_scale_loss_and_wrap_optimizer_skip_on_overflow():
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = apex_amp.init(enabled=True, loss_scale="dynamic")
    try:
        for _ in range(3):  # cached weight casts are dropped after each backward
            with handle.scale_loss(model(torch.randn(8, 4)).float().sum(), optimizer) as scaled:
                assert scaled.item() != 0
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
        wrapped = handle.wrap_optimizer(optimizer, num_loss=2)
        before = model.weight.detach().clone()
        with wrapped.scale_loss(model(torch.randn(8, 4)).float().sum()) as scaled:
            scaled.backward()
        with wrapped.scale_loss(model(torch.randn(8, 4)).float().sum() * float("inf")) as scaled:
            scaled.backward()
        with pytest.raises(AmpUsageError, match="num_loss=2"), wrapped.scale_loss(model(torch.randn(1, 4)).sum()):
            pass
        wrapped.step()
        assert torch.equal(model.weight, before)
        assert wrapped.param_groups is optimizer.param_groups
        with pytest.raises(NotImplementedError, match="closure"):
            wrapped.step(lambda: None)
    finally:
        handle._deactivate()
    noop = apex_amp.init(enabled=False)
    loss = torch.ones(())
    with noop.scale_loss(loss, optimizer) as same:
        assert same is loss
    assert not noop.is_active()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_larc_wrapped_optimizer_is_accepted_by_initialize_and_trains(amp, opt_level):
    """apex's test_larc: LARC(SGD) through initialize at every fp16 level."""
    from ampddp.apex.parallel import LARC

    amp, _ = amp
    model = make_mlp(batchnorm=False)
    optimizer = LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in make_batches(3):
        optimizer.zero_grad()
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(after, before))
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(after, amp.master_params(optimizer)))


@pytest.mark.parametrize("opt_level", ["O1", "O2", "O5"])
def test_a_deep_copy_of_an_initialized_model_works_as_an_ema_copy(amp, opt_level):
    """timm's ModelEma deep-copies the model after amp.initialize and averages weights into the copy."""
    amp, _ = amp
    model = make_mlp(batchnorm=True)
    optimizer = sgd(model)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    ema = copy.deepcopy(model)
    x, y = make_batches(1)[0]
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    with torch.no_grad():
        for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
            if e.is_floating_point():
                e.mul_(0.5).add_(m, alpha=0.5)
    ema.load_state_dict(ema.state_dict())
    assert ema(x).dtype == model(x).dtype
    assert all(e is not m for e, m in zip(ema.parameters(), model.parameters()))
    assert {p.dtype for p in ema.parameters()} == {p.dtype for p in model.parameters()}


# ---- the cast window against the rest of the process ---------------------------------------------------
def test_the_window_sits_under_the_users_torch_function_modes(amp):
    amp, _ = amp
    model = nn.Linear(4, 4)
    amp.initialize(model, opt_level="O1", verbosity=0)
    x = torch.randn(2, 4)
    with torch.device("meta"):
        model(x)
    assert torch.zeros(1).device.type == "cpu"  # leaving the block popped its own mode, not the window's
    assert F.softmax(torch.randn(2).half(), -1).dtype == torch.float32
    amp.end_casts()
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_disable_casts_covers_forwards_run_inside_it(amp):
    amp, _ = amp
    model = nn.Linear(4, 4)
    amp.initialize(model, opt_level="O1", verbosity=0)
    with amp.disable_casts():
        assert model(torch.randn(2, 4)).dtype == torch.float32
        assert F.linear(torch.randn(2, 4), torch.randn(4, 4)).dtype == torch.float32
    assert model(torch.randn(2, 4)).dtype == torch.float16


def test_a_deep_copy_stops_casting_when_its_setup_is_replaced(amp):
    amp, _ = amp
    model = nn.Linear(4, 4)
    amp.initialize(model, opt_level="O1", verbosity=0)
    ema = copy.deepcopy(model)
    amp.initialize(model, opt_level="O0", verbosity=0)
    assert ema(torch.randn(2, 4)).dtype == torch.float32
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_forwards_on_other_threads_leave_nothing_behind(amp):
    import threading
    import types

    amp, _ = amp
    helpers = types.SimpleNamespace(scale=lambda x: x * 2)
    amp.register_float_function(helpers, "scale")
    original = helpers.scale

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return helpers.scale(self.fc(x))

    model = Model()
    amp.initialize(model, opt_level="O1", verbosity=0)
    outputs = []
    worker = threading.Thread(target=lambda: outputs.append(model(torch.randn(2, 4)).dtype))
    worker.start()
    worker.join()
    assert outputs == [torch.float32]  # the registered function ran in fp32 inside the forward
    assert helpers.scale is original  # and nothing stays swapped once that thread's forward returned
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_setups_of_dropped_models_are_freed(amp):
    import gc
    import weakref

    amp, _ = amp
    refs = []
    for _ in range(3):  # k-fold: a fresh model and optimizer per fold
        model = make_mlp(batchnorm=False)
        optimizer = sgd(model)
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        refs.append(weakref.ref(model))
    del model, optimizer
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True, False]  # only the newest set-up is held
    assert len(amp.setups) == 1


def test_an_optimizer_goes_through_initialize_once(amp):
    amp, _ = amp
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with pytest.raises(AmpUsageError, match=r"optimizers\[0\] was already passed to amp.initialize"):
        amp.initialize(make_mlp(batchnorm=False), optimizer, opt_level="O1", verbosity=0)


def test_end_casts_unwinds_a_forward_interrupted_by_keyboard_interrupt(amp):
    amp, _ = amp

    class Interrupted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            self.fc(x)
            raise KeyboardInterrupt

    model = Interrupted()
    amp.initialize(model, opt_level="O1", verbosity=0)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(2, 4))
    assert torch.is_autocast_enabled("cpu")
    amp.end_casts()
    assert not torch.is_autocast_enabled("cpu")
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
