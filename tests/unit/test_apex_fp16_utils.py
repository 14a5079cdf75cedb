"""apex.fp16_utils on ampddp: FP16_Optimizer against the O2 engine, the loss scalers against apex's
update rule, checkpoints in apex's format, and every fp16util helper against its definition."""

from __future__ import annotations

import copy
import io
import math
import pickle
import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch import nn

import ampddp.apex.fp16_utils.loss_scaler as loss_scaler_module
from ampddp import build_engine
from ampddp.apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from ampddp.errors import AmpUsageError, ConfigError, NonFiniteGradientsError

APEX_NAMES = {
    "BN_convert_float",
    "network_to_half",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "tofp16",
    "to_python_float",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "DynamicLossScaler",
}
BATCHES = make_batches(8, batch=16)


def fp16_exact_mlp(seed: int = 0) -> nn.Module:
    """An MLP (Linear + BatchNorm1d) whose fp32 weights are exactly representable in fp16."""
    model = make_mlp(seed, width=16)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.half().float())
    return model


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    return torch.optim.Adam(params, lr=1e-3)


def fp16_setup(kind: str = "adam", seed: int = 0, **kwargs) -> tuple[nn.Module, FP16_Optimizer]:
    model = network_to_half(fp16_exact_mlp(seed))
    return model, FP16_Optimizer(make_optimizer(kind, model.parameters()), verbose=False, **kwargs)


def fp16_step(model: nn.Module, optimizer: FP16_Optimizer, batch) -> torch.Tensor:
    x, y = batch
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x).float(), y)
    optimizer.backward(loss)
    optimizer.step()
    return loss


def tensors(model: nn.Module) -> list[torch.Tensor]:
    return [t.detach() for t in [*model.parameters(), *model.buffers()]]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


# ---- names ------------------------------------------------------------------------------------------
def test_star_import_gives_exactly_apex_names():
    namespace: dict = {}
    exec("from ampddp.apex.fp16_utils import *", namespace)
    assert set(namespace) - {"__builtins__"} == APEX_NAMES


def test_submodule_paths_and_unknown_names():
    from ampddp.apex.fp16_utils.fp16_optimizer import FP16_Optimizer as from_submodule
    from ampddp.apex.fp16_utils.fp16util import network_to_half as helper
    from ampddp.apex.fp16_utils.loss_scaler import DynamicLossScaler as dynamic
    from ampddp.apex.fp16_utils.loss_scaler import LossScaler as static

    assert (from_submodule, helper, dynamic, static) == (FP16_Optimizer, network_to_half, DynamicLossScaler, LossScaler)
    import ampddp.apex as apex

    assert apex.fp16_utils.FP16_Optimizer is FP16_Optimizer
    with pytest.raises(ImportError, match="FP16Model"):
        exec("from ampddp.apex.fp16_utils import FP16_Module", {})
    with pytest.raises(ImportError, match="weight_norm"):
        exec("from ampddp.apex.fp16_utils import Fused_Weight_Norm", {})
    assert not hasattr(apex.fp16_utils, "nonexistent")
    with pytest.raises(AttributeError, match=r"provides: .*FP16_Optimizer"):
        _ = apex.fp16_utils.fp16_optimizer.nonexistent


# ---- FP16_Optimizer against the O2 engine ------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_matches_o2_engine_bitwise(kind, dynamic):
    """Same fp16-exact start, same data: FP16_Optimizer on network_to_half == build_engine("O2"), bit for bit."""
    reference = fp16_exact_mlp()
    engine_model = copy.deepcopy(reference)
    engine_opt = make_optimizer(kind, engine_model.parameters())
    if dynamic:
        # window 2 from 2**16 grows the scale every other step, so fp16 overflow (and a skip) can happen
        engine = build_engine("O2", loss_scale="dynamic", init_loss_scale=2.0**16, growth_interval=2, min_loss_scale=1.0, verbosity=0)
        wrapped_kwargs = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2**16, "scale_window": 2}}
    else:
        engine = build_engine("O2", loss_scale=128.0, verbosity=0)
        wrapped_kwargs = {"static_loss_scale": 128.0}
    engine.setup([engine_model], [engine_opt])
    half_model = network_to_half(copy.deepcopy(reference))
    optimizer = FP16_Optimizer(make_optimizer(kind, half_model.parameters()), verbose=False, **wrapped_kwargs)
    skips = []
    for x, y in BATCHES:
        with engine.forward_context():
            engine_loss = F.cross_entropy(engine_model(x).float(), y)
        engine.backward(engine_loss)
        stepped = engine.step(engine_opt)
        engine_opt.zero_grad()
        loss = fp16_step(half_model, optimizer, (x, y))
        assert torch.equal(loss, engine_loss)
        assert optimizer.overflow == (not stepped)
        assert optimizer.loss_scale == engine.loss_scale()
        skips.append(optimizer.overflow)
        # Parameters always agree. Buffers agree until the first skipped step: the O2 engine then puts
        # back the BatchNorm statistics the skipped forward wrote (ampddp's never-poison rule), while
        # FP16_Optimizer, like apex's, only sees parameters. Training-mode forwards use batch
        # statistics, so the parameters stay bit-identical either way.
        compared = tensors if not any(skips) else (lambda model: [p.detach() for p in model.parameters()])
        assert_same(compared(half_model[1]), compared(engine_model))
        assert_same(list(optimizer._grads.master_params()), list(engine.master_params(engine_opt)))
    assert half_model[1][1].weight.dtype == torch.float32 and half_model[1][0].weight.dtype == torch.float16
    if dynamic:
        assert optimizer.loss_scale != 2.0**16  # the scale moved (here it grows into one fp16 overflow, skipped by both)


def test_injected_inf_skips_step_and_halves_scale():
    model, optimizer = fp16_setup("sgd", dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 1024.0})
    fp16_step(model, optimizer, BATCHES[0])
    before_model = [p.detach().clone() for p in model.parameters()]  # (the forward still moves BatchNorm's running stats)
    before_masters = [p.detach().clone() for p in optimizer._grads.master_params()]
    before_state = copy.deepcopy(optimizer.optimizer.state_dict()["state"])
    x, y = BATCHES[1]
    optimizer.zero_grad()
    optimizer.backward(F.cross_entropy(model(x).float(), y), update_master_grads=False)
    model[1][0].weight.grad[0, 0] = float("inf")
    optimizer.update_master_grads()
    assert optimizer.overflow
    assert optimizer.clip_master_grads(1.0) == -1
    assert optimizer.inspect_master_grad_data() is None
    assert optimizer.step() is None
    assert optimizer.loss_scale == 512.0
    assert_same([p.detach() for p in model.parameters()], before_model)
    assert_same([p.detach() for p in optimizer._grads.master_params()], before_masters)
    after_state = optimizer.optimizer.state_dict()["state"]
    for key, value in before_state.items():
        assert torch.equal(after_state[key]["momentum_buffer"], value["momentum_buffer"])
    # a NaN in an fp32 (BatchNorm) grad counts as well; then a clean step moves the weights again
    optimizer.zero_grad()
    optimizer.backward(F.cross_entropy(model(x).float(), y), update_master_grads=False)
    model[1][1].weight.grad[0] = float("nan")
    optimizer.update_master_grads()
    assert optimizer.overflow and optimizer.step() is None and optimizer.loss_scale == 256.0
    fp16_step(model, optimizer, BATCHES[2])
    assert not optimizer.overflow and not torch.equal(model[1][0].weight, before_model[0])


def test_static_scale_never_checks_overflow():
    """apex: a static scale does not look for inf/NaN, so nothing is skipped."""
    model, optimizer = fp16_setup("sgd", static_loss_scale=8.0)
    x, y = BATCHES[0]
    optimizer.backward(F.cross_entropy(model(x).float(), y), update_master_grads=False)
    model[1][0].weight.grad[0, 0] = float("inf")
    optimizer.update_master_grads()
    assert not optimizer.overflow
    optimizer.step()
    assert not torch.isfinite(model[1][0].weight).all() and optimizer.loss_scale == 8.0


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_master_grads_matches_torch_on_fp32_grads(norm_type):
    model, optimizer = fp16_setup("sgd", static_loss_scale=128.0)
    x, y = BATCHES[0]
    optimizer.backward(F.cross_entropy(model(x).float(), y))
    masters = list(optimizer._grads.master_params())
    copies = [p.detach().clone().requires_grad_(True) for p in masters]
    for c, p in zip(copies, masters):
        c.grad = p.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(copies, 0.05, norm_type)
    total = optimizer.clip_master_grads(0.05, norm_type)
    assert torch.equal(total, expected) and total > 0.05
    for c, p in zip(copies, masters):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, c.grad)


@pytest.mark.parametrize("via", ["torch.save", "torch.save weights_only"])
def test_state_dict_round_trip_resumes_identically(via):
    def run(model, optimizer, batches):
        for batch in batches:
            fp16_step(model, optimizer, batch)

    kwargs = {"dynamic_loss_scale": True, "dynamic_loss_args": {"init_scale": 2**16, "scale_window": 2}}
    model, optimizer = fp16_setup("adam", **kwargs)
    run(model, optimizer, BATCHES[:4])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    run(model, optimizer, BATCHES[4:])

    resumed_model, resumed = fp16_setup("adam", seed=5, **kwargs)
    buffer.seek(0)
    if via == "torch.save":
        checkpoint = torch.load(buffer, weights_only=False)
    else:
        with torch.serialization.safe_globals([LossScaler, DynamicLossScaler]):
            checkpoint = torch.load(buffer, weights_only=True)
    assert set(checkpoint["optimizer"]) == {
        "loss_scaler",
        "dynamic_loss_scale",
        "overflow",
        "first_closure_call_this_step",
        "optimizer_state_dict",
        "fp32_from_fp16",
    }
    assert isinstance(checkpoint["optimizer"]["loss_scaler"], DynamicLossScaler)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["optimizer"])
    run(resumed_model, resumed, BATCHES[4:])
    assert_same(tensors(resumed_model), tensors(model))
    assert_same([p.detach() for p in resumed._grads.master_params()], [p.detach() for p in optimizer._grads.master_params()])
    assert resumed.loss_scale == optimizer.loss_scale
    assert resumed.loss_scaler.cur_iter == optimizer.loss_scaler.cur_iter == 8


def test_state_dict_does_not_alias_the_live_scaler_and_bad_state_is_refused():
    model, optimizer = fp16_setup("sgd", dynamic_loss_scale=True)
    state = optimizer.state_dict()
    fp16_step(model, optimizer, BATCHES[0])
    assert state["loss_scaler"].cur_iter == 0 and optimizer.loss_scaler.cur_iter == 1
    _, other = fp16_setup("sgd", dynamic_loss_scale=True)
    bad = dict(state, fp32_from_fp16=[[torch.zeros(3)]])
    with pytest.raises(ConfigError, match="fp32_from_fp16"):
        other.load_state_dict(bad)
    with pytest.raises(ConfigError, match="missing"):
        other.load_state_dict({"loss_scaler": state["loss_scaler"]})
    with pytest.raises(ConfigError, match="dynamic_loss_scale"):
        other.load_state_dict(dict(state, dynamic_loss_scale=False))
    assert other.loss_scaler.cur_iter == 0  # nothing changed by the refused loads


def test_apex_pickled_scaler_loads_through_the_apex_alias(monkeypatch):
    """An apex-era checkpoint pickles apex's DynamicLossScaler by its __dict__; under the apex alias it loads here."""
    from ampddp.apex.aliasing import ApexAliasFinder

    fake = types.ModuleType("apex.fp16_utils.loss_scaler")

    class ApexDynamicLossScaler:  # apex's attributes, nothing else
        pass

    ApexDynamicLossScaler.__module__, ApexDynamicLossScaler.__qualname__ = fake.__name__, "DynamicLossScaler"
    fake.DynamicLossScaler = ApexDynamicLossScaler
    names = ("apex", "apex.fp16_utils", fake.__name__)
    for name in names:
        monkeypatch.setitem(sys.modules, name, fake if name == fake.__name__ else types.ModuleType(name))
    apex_scaler = ApexDynamicLossScaler()
    apex_scaler.__dict__.update(cur_scale=1024.0, cur_iter=7, last_overflow_iter=4, scale_factor=2.0, scale_window=5)
    buffer = io.BytesIO()
    torch.save({"loss_scaler": apex_scaler}, buffer)
    for name in names:  # what `python -m ampddp.apex` does: apex.* resolves to ampddp.apex.*
        del sys.modules[name]
    monkeypatch.setattr(sys, "meta_path", [ApexAliasFinder(), *sys.meta_path])
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)["loss_scaler"]
    assert sys.modules[fake.__name__] is loss_scaler_module
    assert isinstance(restored, DynamicLossScaler)
    reference = ApexRule(1024.0, 2.0, 5, cur_iter=7, last_overflow_iter=4)
    for overflow in [False, False, False, True, False]:
        restored.update_scale(overflow)
        reference.update(overflow)
        assert restored.cur_scale == reference.scale  # grows at iteration 9 ((9 - 4) % 5 == 0)
    assert (restored.cur_iter, restored.last_overflow_iter) == (reference.cur_iter, reference.last)


def test_amp_scaler_from_last_apex_releases_is_accepted():
    amp_scaler = types.SimpleNamespace(
        _loss_scale=4096.0, _unskipped=3, _scale_seq_len=4, _min_loss_scale=None, _max_loss_scale=2.0**24, dynamic=True
    )
    restored = loss_scaler_module.restore_scaler(amp_scaler)
    assert isinstance(restored, DynamicLossScaler) and restored.cur_scale == 4096.0
    restored.update_scale(False)
    assert restored.cur_scale == 8192.0  # the 4th clean step in amp's window of 4
    with pytest.raises(ConfigError, match="expected an fp16_utils LossScaler"):
        loss_scaler_module.restore_scaler("not a scaler")
    # the last apex releases took amp's keys in dynamic_loss_args
    args = {"init_scale": 2.0**16, "scale_window": 2000, "min_loss_scale": 1.0, "max_loss_scale": 2.0**17}
    _, optimizer = fp16_setup("sgd", dynamic_loss_scale=True, dynamic_loss_args=args)
    assert optimizer.loss_scale == 2.0**16 and optimizer.loss_scaler.scaler.max_scale == 2.0**17


# ---- backward / step semantics -----------------------------------------------------------------------
def test_several_losses_unscale_each_gradient_once():
    """backward twice (master update each time) == delayed update; fp32 BatchNorm grads are not re-divided (apex was)."""
    x, y = BATCHES[0]
    grads = []
    for delayed in (False, True):
        model, optimizer = fp16_setup("sgd", static_loss_scale=1024.0)
        out = model(x).float()
        optimizer.backward(F.cross_entropy(out, y), update_master_grads=not delayed, retain_graph=True)
        optimizer.backward(out.square().mean(), update_master_grads=not delayed)
        if delayed:
            optimizer.update_master_grads()
        grads.append([p.grad.clone() for p in optimizer._grads.master_params()])
    reference = fp16_exact_mlp()
    ref_out = reference(x)
    (F.cross_entropy(ref_out, y) + ref_out.square().mean()).backward()
    for eager, delayed, ref in zip(*grads, reference.parameters()):
        torch.testing.assert_close(eager, delayed, rtol=2e-3, atol=1e-5)
        torch.testing.assert_close(eager, ref.grad, rtol=2e-2, atol=1e-3)


def test_step_refuses_stale_or_raw_gradients():
    model, optimizer = fp16_setup("sgd")
    x, y = BATCHES[0]
    optimizer.backward(F.cross_entropy(model(x).float(), y), update_master_grads=False)
    with pytest.raises(AmpUsageError, match="update_master_grads"):
        optimizer.step()
    with pytest.raises(AmpUsageError, match="update_master_grads"):
        optimizer.clip_master_grads(1.0)
    optimizer.zero_grad()
    F.cross_entropy(model(x).float(), y).backward()
    with pytest.raises(AmpUsageError, match=r"optimizer\.backward\(loss\)"):
        optimizer.step()
    optimizer.zero_grad(set_grads_to_None=True)
    optimizer.update_master_grads()  # nothing pending: a no-op, as the scaled grads are gone
    optimizer.step()


def test_model_zero_grad_in_place_of_optimizer_zero_grad():
    """Scripts that zero through the model: the masters' grads are cleared by step, so nothing stale accumulates."""
    model_a, optimizer_a = fp16_setup("sgd", static_loss_scale=32.0)
    model_b, optimizer_b = fp16_setup("sgd", static_loss_scale=32.0)
    for x, y in BATCHES[:3]:
        fp16_step(model_a, optimizer_a, (x, y))
        model_b.zero_grad()
        optimizer_b.backward(F.cross_entropy(model_b(x).float(), y))
        optimizer_b.step()
    assert_same(tensors(model_b), tensors(model_a))


def test_closure_matches_plain_step_and_reruns_after_overflow():
    plain_model, plain = fp16_setup("sgd", static_loss_scale=64.0)
    closure_model, with_closure = fp16_setup("sgd", static_loss_scale=64.0)
    for x, y in BATCHES[:3]:
        fp16_step(plain_model, plain, (x, y))

        def closure(x=x, y=y):
            with_closure.zero_grad()
            loss = F.cross_entropy(closure_model(x).float(), y)
            with_closure.backward(loss)
            return loss

        with_closure.step(closure)
    assert_same(tensors(closure_model), tensors(plain_model))

    model, optimizer = fp16_setup("sgd", dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 256.0})
    calls = []
    x, y = BATCHES[0]

    def overflowing_once():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        optimizer.backward(loss, update_master_grads=False)
        if not calls:
            model[1][0].weight.grad.fill_(float("inf"))
        calls.append(optimizer.loss_scale)
        optimizer.update_master_grads()
        return loss

    before = model[1][0].weight.clone()
    loss = optimizer.step(overflowing_once)
    assert calls == [256.0, 128.0] and torch.is_tensor(loss)
    assert not torch.equal(model[1][0].weight, before) and torch.isfinite(model[1][0].weight).all()


def test_closure_called_repeatedly_refreshes_the_model():
    model, optimizer = fp16_setup("sgd")
    optimizer = FP16_Optimizer(torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4), verbose=False)
    x, y = BATCHES[0]
    losses = []

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        optimizer.backward(loss)
        losses.append(loss.item())
        return loss

    optimizer.step(closure)
    assert len(losses) > 1 and losses[-1] < losses[0]
    for half, master in zip(optimizer.all_fp16_params, optimizer.all_fp32_from_fp16_params):
        assert torch.equal(half, master.half())
    assert optimizer.first_closure_call_this_step


def test_attributes_groups_and_loss_scale_setter():
    model = network_to_half(fp16_exact_mlp())
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = FP16_Optimizer(torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.0}], lr=0.1), static_loss_scale=4.0)
    assert [len(g) for g in optimizer.fp16_groups] == [3, 3] and [len(g) for g in optimizer.fp32_from_fp32_groups] == [1, 1]
    assert all(p.dtype == torch.float32 for g in optimizer.fp32_from_fp16_groups for p in g)
    assert all(a is b for a, b in zip(optimizer.param_groups, optimizer.optimizer.param_groups))
    assert optimizer.state is optimizer.optimizer.state
    optimizer.loss_scale = 32.0
    assert optimizer.loss_scale == optimizer.loss_scaler.cur_scale == 32.0
    with pytest.raises(ConfigError, match="loss scale"):
        optimizer.loss_scale = -1
    biases_before, weights_before = [b.clone() for b in biases], [w.clone() for w in weights]
    x, y = BATCHES[0]
    optimizer.backward(F.cross_entropy(model(x).float(), y))
    grads = optimizer.inspect_master_grad_data()
    assert [len(g) for g in grads] == [4, 4] and all(g.dtype == torch.float32 for group in grads for g in group)
    optimizer.step()
    assert_same(biases, biases_before)  # lr 0 in the second group
    assert not any(torch.equal(w, before) for w, before in zip(weights, weights_before))
    with pytest.raises(RuntimeError, match="state_dict"):
        pickle.dumps(optimizer)


def test_constructor_refuses_bad_inputs(capsys):
    model = network_to_half(fp16_exact_mlp())
    FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert "FP16_Optimizer processing param group 0" in capsys.readouterr().out  # verbose=True as apex
    with pytest.raises(AmpUsageError, match=r"torch\.optim\.Optimizer"):
        FP16_Optimizer(model)
    with pytest.raises(ConfigError, match="float64"):
        FP16_Optimizer(torch.optim.SGD(nn.Linear(2, 2).double().parameters(), lr=0.1), verbose=False)
    with pytest.raises(ConfigError, match=r"scale_windw.*valid keys"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True, dynamic_loss_args={"scale_windw": 3})
    with pytest.raises(ConfigError, match="static loss scale"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=0, verbose=False)


# ---- loss scalers ------------------------------------------------------------------------------------
class ApexRule:
    """fp16_utils' DynamicLossScaler.update_scale, written out as the reference."""

    def __init__(self, scale, factor, window, cur_iter=0, last_overflow_iter=-1):
        self.scale, self.factor, self.window, self.cur_iter, self.last = scale, factor, window, cur_iter, last_overflow_iter

    def update(self, overflow):
        if overflow:
            self.scale = max(self.scale / self.factor, 1)
            self.last = self.cur_iter
        elif (self.cur_iter - self.last) % self.window == 0:
            self.scale *= self.factor
        self.cur_iter += 1


@pytest.mark.parametrize(("init", "factor", "window"), [(2.0**32, 2.0, 1000), (8.0, 2.0, 3), (0.5, 4.0, 2), (2.0, 3.0, 1)])
def test_dynamic_scaler_follows_apex_rule(init, factor, window):
    rng = random.Random(init * factor + window)
    scaler, reference = DynamicLossScaler(init, factor, window), ApexRule(init, factor, window)
    for _ in range(60):
        overflow = rng.random() < 0.3 and reference.scale > 1
        scaler.update_scale(overflow)
        reference.update(overflow)
        assert scaler.loss_scale == scaler.cur_scale == reference.scale
        assert (scaler.cur_iter, scaler.last_overflow_iter) == (reference.cur_iter, reference.last)
        clone = pickle.loads(pickle.dumps(scaler))  # apex attribute form keeps the schedule
        clone.update_scale(False)
        twin = copy.copy(reference)
        twin.update(False)
        assert clone.cur_scale == twin.scale


def test_dynamic_scaler_defaults_and_floor():
    scaler = DynamicLossScaler()
    assert (scaler.cur_scale, scaler.scale_factor, scaler.scale_window) == (2.0**32, 2.0, 1000)
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (0, -1)
    scaler = DynamicLossScaler(init_scale=2.0)
    for _ in range(9):
        scaler.update_scale(True)
    assert scaler.cur_scale == 1.0  # apex's floor
    with pytest.raises(NonFiniteGradientsError, match="floor"):
        scaler.update_scale(True)
    with pytest.raises(ConfigError, match="scale_window"):
        DynamicLossScaler(scale_window=0)
    with pytest.raises(ConfigError, match="scale_factor"):
        DynamicLossScaler(scale_factor=0.5)


def test_scaler_methods():
    param = nn.Parameter(torch.ones(3))
    for scaler in (LossScaler(4.0), DynamicLossScaler(init_scale=4.0)):
        param.grad = None
        scaler.backward((param * 2).sum().half())
        assert torch.equal(param.grad, torch.full((3,), 8.0))
        assert scaler.scale_gradient(None, (torch.ones(2), None), None)[0].tolist() == [4.0, 4.0]
    static = LossScaler(3)
    static.update_scale(True)
    assert static.loss_scale == 3.0 and not static.has_overflow([param]) and not LossScaler._has_inf_or_nan(torch.tensor(math.inf))
    dynamic = DynamicLossScaler()
    param = nn.Parameter(torch.ones(3).half())
    param.grad = torch.tensor([1.0, 2.0, 3.0]).half()
    assert not dynamic.has_overflow([param, nn.Parameter(torch.zeros(0))])
    for bad in (math.inf, -math.inf, math.nan):
        param.grad[1] = bad
        assert dynamic.has_overflow([param]) and DynamicLossScaler._has_inf_or_nan(param.grad)
    assert not DynamicLossScaler._has_inf_or_nan(torch.tensor([60000.0, 60000.0]).half())  # large but finite
    assert repr(static) == "LossScaler(scale=3)"


# ---- fp16util helpers --------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.bn = nn.BatchNorm1d(6)
        self.plain_bn = nn.BatchNorm1d(6, affine=False)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))

    def forward(self, x):
        return self.block(self.plain_bn(self.bn(self.fc(x))))


def dtypes(module: nn.Module) -> set[torch.dtype]:
    return {t.dtype for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)] if t.is_floating_point()}


def test_tofp16_bn_convert_float_and_network_to_half():
    x = torch.randn(5, 4)
    assert torch.equal(tofp16()(x), x.half())
    net = Net()
    assert BN_convert_float(net.half()) is net
    assert dtypes(net.bn) == dtypes(net.block[1]) == {torch.float32}
    assert dtypes(net.plain_bn) == dtypes(net.fc) == {torch.float16}  # non-affine BN stays half, as apex
    assert net.bn.num_batches_tracked.dtype == torch.int64
    inner = Net()
    half = network_to_half(inner)
    assert isinstance(half, nn.Sequential) and isinstance(half[0], tofp16) and half[1] is inner
    assert dtypes(inner.bn) == {torch.float32} and dtypes(inner.fc) == {torch.float16}
    assert half(x).dtype == torch.float16


def test_convert_module_network_and_fp16_model():
    net = Net()
    net.fc.weight.grad = torch.ones(6, 4)
    convert_module(net.fc, torch.half)
    assert dtypes(net.fc) == {torch.float16} and net.fc.weight.grad.dtype == torch.float16
    assert dtypes(net.bn) == {torch.float32}  # only the module's own tensors
    weight = net.block[0].weight
    assert convert_network(net, torch.half) is net
    assert net.block[0].weight is weight and weight.dtype == torch.float16
    assert dtypes(net.bn) == dtypes(net.block[1]) == {torch.float32} and dtypes(net.plain_bn) == {torch.float16}
    lstm = convert_network(nn.LSTM(3, 4), torch.half)
    assert dtypes(lstm) == {torch.float16}
    with pytest.raises(ConfigError, match="dtype"):
        convert_network(net, torch.int32)
    model = FP16Model(Net())
    assert model(torch.randn(5, 4)).dtype == torch.float16
    embed = FP16Model(nn.Embedding(10, 3))
    assert embed(torch.tensor([1, 2])).dtype == torch.float16  # integer ids are not cast (apex made them half)


@pytest.mark.parametrize("flat", [False, True])
def test_prep_param_lists_and_copies(flat):
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).half()
    model[1].bias.requires_grad_(False)
    model_params, masters = prep_param_lists(model, flat_master=flat)
    assert model_params == [model[0].weight, model[0].bias, model[1].weight]
    if flat:
        assert len(masters) == 1 and isinstance(masters[0], nn.Parameter) and masters[0].numel() == 12 + 4 + 8
        assert torch.equal(masters[0].grad, torch.zeros(24)) and masters[0].dtype == torch.float32
        assert torch.equal(masters[0].detach(), torch.cat([p.detach().float().flatten() for p in model_params]))
    else:
        assert all(m.dtype == torch.float32 and m.requires_grad and m.is_leaf for m in masters)
        assert all(torch.equal(m, p.float()) and m.data_ptr() != p.data_ptr() for m, p in zip(masters, model_params))
    for index, param in enumerate(model_params):
        param.grad = torch.full_like(param, index + 1)
    model_grads_to_master_grads(model_params, masters, flat_master=flat)
    expected = [torch.full(p.shape, float(i + 1)) for i, p in enumerate(model_params)]
    got = [masters[0].grad] if flat else [m.grad for m in masters]
    want = [torch.cat([e.flatten() for e in expected])] if flat else expected
    assert all(g.dtype == torch.float32 and torch.equal(g, w) for g, w in zip(got, want))
    with torch.no_grad():
        for master in masters:
            master.add_(1.0)
    master_params_to_model_params(model_params, masters, flat_master=flat)
    sources = masters[0].detach().split([p.numel() for p in model_params]) if flat else masters
    for param, source in zip(model_params, sources):
        assert param.dtype == torch.float16 and torch.equal(param.detach(), source.detach().view_as(param).half())


def test_grad_copy_edge_cases_and_small_helpers():
    model = nn.Linear(3, 2).half()
    model_params, masters = prep_param_lists(model)
    masters[0].grad = torch.ones(2, 3)
    model.bias.grad = torch.ones(2).half()
    model_grads_to_master_grads(model_params, masters)
    assert masters[0].grad is None and torch.equal(masters[1].grad, torch.ones(2))  # apex: no model grad clears the master's
    with pytest.raises(ConfigError, match="2 model params but 1"):
        model_grads_to_master_grads(model_params, masters[:1])
    _, flat = prep_param_lists(model, flat_master=True)
    with pytest.raises(AmpUsageError, match=r"no \.grad"):
        model_grads_to_master_grads(model_params, flat, flat_master=True)
    with pytest.raises(ConfigError, match="flat_master=True"):
        master_params_to_model_params(model_params, masters, flat_master=True)
    assert to_python_float(torch.tensor([2.5])) == 2.5 and to_python_float(3.0) == 3.0 and to_python_float([4.0, 1.0]) == 4.0
    assert clip_grad_norm is torch.nn.utils.clip_grad_norm_
