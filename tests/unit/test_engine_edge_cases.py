"""Engine and facade edge cases: DDP bucket views, several optimizers or losses per backward, O2
submodule state, zero_grad and failed scale_loss, interrupted forwards, checkpointed recomputation,
NaN floors, out= buffers, sparse gradients, misuse refused before any state changes, native settings.
Each test is a way the engine once went wrong."""

from __future__ import annotations

import contextlib
import threading
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch import nn
from torch.utils.checkpoint import checkpoint

from ampddp import AmpUsageError, ConfigError, build_engine
from ampddp.amp import Amp
from ampddp.amp.loss_blocks import loss_blocks
from ampddp.distributed import free_port
from ampddp.errors import NonFiniteGradientsError


@pytest.fixture
def single_process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("bucket_view", [False, True])
def test_o1_accumulation_survives_ddp_gradient_bucket_views(single_process_group, bucket_view):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    reference.load_state_dict(model.state_dict())
    amp = Amp()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1.0), opt_level="O1", loss_scale=64.0, verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    inputs = [torch.randn(2, 4) * 0.1 for _ in range(2)]
    for x in inputs:
        with amp.scale_loss(ddp(x).float().sum(), optimizer) as scaled:
            scaled.backward()
        reference(x).sum().backward()
    for grad, ref in zip((p.grad for p in amp.master_params(optimizer)), reference.parameters()):
        torch.testing.assert_close(grad, ref.grad, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("mode", ["O1", "native-fp16"])
def test_a_second_step_before_the_next_backward_is_refused(mode):
    a, b = nn.Linear(4, 1), nn.Linear(4, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0)
    engine = build_engine(mode)
    engine.setup([a, b], [opt_a, opt_b])
    with engine.forward_context():
        loss = (a(torch.ones(1, 4)) + b(torch.ones(1, 4))).float().sum()
    engine.backward(loss)
    engine.step(opt_a)
    with pytest.raises(AmpUsageError, match=r"engine.step\(opt_a, opt_b\)"):
        engine.step(opt_b)


def test_only_the_overflowing_optimizer_skips_when_stepped_together():
    a, b = nn.Linear(4, 1, bias=False), nn.Linear(4, 1, bias=False)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0)
    engine = build_engine("O1", verbosity=0)
    engine.setup([a, b], [opt_a, opt_b])
    x = torch.full((1, 4), 0.01)
    with engine.forward_context():
        loss = 0.5 * (a(x).float().sum() * float("inf") + b(x).float().sum())
    before = b.weight.detach().clone()
    engine.backward(loss)
    assert engine.step(opt_a, opt_b) is False
    assert torch.equal(b.weight, before), "one scale update per backward: an overflow skips the whole step"


def test_o2_loading_or_saving_a_submodule_goes_through_the_masters():
    amp = Amp()
    model = make_mlp()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), opt_level="O2", verbosity=0)
    first = model[0]
    assert first.state_dict()["weight"].dtype == torch.float32
    first.load_state_dict({"weight": torch.full_like(first.weight, 0.5, dtype=torch.float32), "bias": torch.zeros(32)})
    x, y = make_batches(1)[0]
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert first.weight.float().unique().tolist() == [0.5]
    assert model.state_dict()["0.weight"].unique().tolist() == [0.5]


def test_engine_zero_grad_discards_a_backward_and_a_failed_scale_loss_leaves_nothing_behind():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    engine = build_engine("O2", loss_scale=1024.0, verbosity=0)
    engine.setup([model], [optimizer])
    x = torch.ones(1, 1)
    engine.backward(model(x).sum())
    engine.zero_grad(optimizer)
    engine.backward(model(x).sum())
    engine.step(optimizer)
    assert next(engine.master_params(optimizer)).item() == pytest.approx(0.99)

    amp = Amp()
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.01), opt_level="O2", loss_scale=1024.0, verbosity=0)
    with pytest.raises(ValueError), amp.scale_loss(model(x).sum(), optimizer) as scaled:
        scaled.backward()
        raise ValueError("after backward")
    optimizer.zero_grad()
    with amp.scale_loss(model(x).sum(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    assert next(amp.master_params(optimizer)).item() == pytest.approx(0.99)


class Interrupting(nn.Module):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.error = error

    def forward(self, x):
        y = self.linear(x)
        if self.error is not None:
            raise self.error
        return y


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_an_interrupted_forward_is_unwound_by_the_next_forward_or_teardown(error):
    amp = Amp()
    model = amp.initialize(Interrupting(error), opt_level="O1", verbosity=0)
    with pytest.raises(type(error)):
        model(torch.randn(2, 4))
    model.error = None
    assert model(torch.randn(2, 4)).dtype == torch.float16
    amp.end_casts()  # the facade keeps the op lists on after a forward (apex); end that, then nothing is left
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")
    model.error = error
    with pytest.raises(type(error)):
        model(torch.randn(2, 4))
    amp.initialize(nn.Linear(2, 2), opt_level="O0")
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32


def test_the_old_context_fn_advice_for_checkpointing_still_works():
    """No longer needed (tests/unit/test_checkpoint_recompute.py), but code that followed it keeps working."""
    amp = Amp()
    block = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.Softmax(-1))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = block, nn.Linear(16, 4)

        def forward(self, x):
            recompute = lambda: (contextlib.nullcontext(), amp.forward_context())  # noqa: E731
            return self.head(checkpoint(self.block, x, use_reentrant=False, context_fn=recompute))

    model = Model()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    with amp.scale_loss(model(torch.randn(8, 16)).float().pow(2).sum(), optimizer) as scaled:
        scaled.backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


def test_a_forward_that_always_makes_nan_stops_with_a_clear_error_naming_the_parameter():
    amp = Amp()
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    with pytest.raises(NonFiniteGradientsError, match=r"(?s)floor.*forward pass or the loss.*start at: models\[0\]\.1\.bias"):
        for _ in range(200):
            optimizer.zero_grad()
            with amp.scale_loss(model(torch.randn(3, 2)).float().sum() * float("nan"), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**-24


def test_overflows_are_logged_as_warnings(caplog):
    engine = build_engine("O1")
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.setup([model], [optimizer])
    engine.backward(model(torch.ones(1, 2)).sum() * float("inf"))
    with caplog.at_level("WARNING", logger="ampddp"):
        engine.step(optimizer)
    assert "gradient overflow" in caplog.text


def test_registered_plain_function_is_restored_when_contexts_exit_out_of_order():
    def triple(x):
        return x * 3

    namespace = types.SimpleNamespace(triple=triple)
    amp = Amp()
    amp.register_float_function(namespace, "triple")
    amp.initialize(nn.Linear(2, 2), opt_level="O1", verbosity=0)
    context = amp.forward_context()
    entered, release_first, release_second = threading.Event(), threading.Event(), threading.Event()

    def first():
        with context:
            entered.set()
            release_first.wait()

    def second():
        entered.wait()
        with context:
            release_first.set()
            release_second.wait()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    threads[0].join()
    release_second.set()
    threads[1].join()
    assert namespace.triple is triple
    other = Amp()
    other.initialize(nn.Linear(2, 2), opt_level="O1", verbosity=0)
    with other.forward_context():
        assert namespace.triple(torch.ones(2).half()).dtype == torch.float16


def test_out_buffers_are_written():
    engine = build_engine("O1", verbosity=0)
    engine.setup([nn.Linear(2, 2)], [])
    half_out, float_out = torch.zeros(1, dtype=torch.float16), torch.zeros(2, 2)
    with engine.forward_context():
        torch.exp(torch.ones(1, dtype=torch.float16), out=half_out)
        torch.mm(torch.ones(2, 2), torch.ones(2, 2), out=float_out)
    assert half_out.item() == pytest.approx(2.718, abs=1e-2)
    assert float_out.tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_sparse_gradients_get_a_clear_error():
    model = nn.Embedding(10, 4, sparse=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = build_engine("O1", verbosity=0)
    engine.setup([model], [optimizer])
    engine.backward(model(torch.tensor([1, 2])).float().sum())
    with pytest.raises(AmpUsageError, match="sparse gradients"):
        engine.step(optimizer)


def test_misuse_in_the_engine_path_is_refused_before_any_state_changes():
    engine = build_engine("O1", num_losses=2, loss_scale=1024.0, verbosity=0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine.setup([model], [optimizer])
    with pytest.raises(AmpUsageError, match="needs the optimizer"), loss_blocks(engine).scale_loss(model(torch.ones(1, 2)).sum(), []):
        pass
    engine.backward(model(torch.ones(1, 2)).sum())
    engine.clip_grad_norm_([optimizer], 1.0)
    scale = engine.loss_scale()
    with pytest.raises(AmpUsageError, match="backward after unscale_/clip_grad_norm_"):
        engine.backward(model(torch.ones(1, 2)).sum())
    assert engine.loss_scale() == scale
    assert engine.step(optimizer)
    engine.backward(model(torch.ones(1, 2)).sum(), loss_id=1)
    with pytest.raises(AmpUsageError, match="not yet stepped"):
        engine.backward(model(torch.ones(1, 2)).sum(), loss_id=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"init_loss_scale": -5.0}, "init_loss_scale=-5.0"),
        ({"growth_interval": 0}, "growth_interval=0"),
        ({"growth_factor": 0.5}, "growth_factor=0.5"),
        ({"backoff_factor": 2}, "backoff_factor=2"),
        ({"enabled": "yes"}, "enabled='yes'"),
    ],
)
def test_native_settings_are_validated(settings, message):
    with pytest.raises(ConfigError, match=message):
        build_engine("native-fp16", **settings)
