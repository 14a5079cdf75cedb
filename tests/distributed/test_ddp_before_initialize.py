"""mmengine's order on 2 gloo processes: the model is wrapped in DDP first and ``amp.initialize`` is
given ``ddp.module`` later (mmengine's ApexOptimWrapper does it inside ``optim_context``). At O2/O3/O5
the cast changes every parameter's dtype, which leaves the wrapper's gradient hooks on the old fp32
accumulators: without a rebuild no gradient is ever all-reduced and the ranks train apart silently.
Every rank must end with the same weights as the others, and as one process training on the whole
batch (the fp32 reference for O0/O1 bit for bit; within low-precision tolerance otherwise)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampddp.amp import Amp
from ampddp.distributed import launch_local

STEPS = 4


def wrap(model, kind):
    if kind == "torch":
        return DistributedDataParallel(model)
    from ampddp.apex.parallel import DistributedDataParallel as ApexDDP

    return ApexDDP(model, delay_allreduce=True)


class Holder(nn.Module):
    """A task module around the network (DDP wraps the holder; initialize gets the network)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)


def ddp_then_initialize_worker(env, opt_level, kind, given="module"):
    amp = Amp()
    model = make_mlp(seed=3, batchnorm=False)
    ddp = wrap(Holder(model) if given == "inner" else model, kind)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    targets = {"module": ddp.module, "inner": model, "parts": list(model.children())}[given]
    for step, (x, y) in enumerate(make_batches(STEPS, batch=16, seed=5)):
        if step == 0:  # mmengine: initialize on the first iteration, inside the wrapped model's step
            _, optimizer = amp.initialize(targets, optimizer, opt_level=opt_level, verbosity=0, loss_scale=128.0)
        shard = slice(env.rank * 8, env.rank * 8 + 8)
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x[shard]), y[shard])
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return [p.detach().float().clone() for p in model.parameters()]


def whole_batch_reference():
    model = make_mlp(seed=3, batchnorm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for x, y in make_batches(STEPS, batch=16, seed=5):
        optimizer.zero_grad()
        loss = (F.cross_entropy(model(x[:8]), y[:8]) + F.cross_entropy(model(x[8:]), y[8:])) / 2
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


CASES = [("O0", "torch"), ("O1", "torch"), ("O2", "torch"), ("O3", "torch"), ("O5", "torch"), ("O2", "apex")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt_level, kind", CASES, ids=[f"{level}-{kind}" for level, kind in CASES])
def test_ddp_wrapped_before_initialize_keeps_ranks_identical_and_averaged(opt_level, kind):
    params0, params1 = launch_local(ddp_then_initialize_worker, 2, (opt_level, kind), timeout_s=60, job_timeout_s=240)
    assert len(params0) == len(params1) > 0
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    reference = whole_batch_reference()
    tolerance = {"O0": 1e-6, "O1": 5e-3}.get(opt_level, 2e-2)
    for got, want in zip(params0, reference):
        assert torch.allclose(got, want, atol=tolerance, rtol=tolerance), (opt_level, (got - want).abs().max())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("given", ["inner", "parts"])
def test_ddp_around_a_holder_or_initialize_of_the_parts_is_rehooked_too(given):
    params0, params1 = launch_local(ddp_then_initialize_worker, 2, ("O2", "torch", given), timeout_s=60, job_timeout_s=240)
    assert len(params0) == len(params1) > 0
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))
    for got, want in zip(params0, whole_batch_reference()):
        assert torch.allclose(got, want, atol=2e-2, rtol=2e-2)


def unrebuildable_worker(env):
    import torch.distributed as dist

    from ampddp import AmpUsageError

    amp = Amp()
    model = make_mlp(seed=3, batchnorm=False)
    ddp = DistributedDataParallel(model)
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        message = None
    except AmpUsageError as error:
        message = str(error)
    untouched = all(p.dtype == torch.float32 for p in model.parameters()) and not hasattr(optimizer, "_amp_stash")
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)  # nothing was half-done: another level still works
    return message, untouched


@pytest.mark.timeout(300)
def test_a_wrapper_that_cannot_be_rehooked_is_refused_before_anything_changes():
    (message, untouched), _ = launch_local(unrebuildable_worker, 2, timeout_s=60, job_timeout_s=240)
    assert message is not None and "cannot be re-hooked" in message and "built-in communication hook" in message
    assert "call amp.initialize before wrapping" in message
    assert untouched
