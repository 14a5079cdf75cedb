"""apex's documented order on 2 gloo processes: ``amp.initialize`` first, then DDP, ranks seeded
differently (apex's tests/distributed/amp_master_params): every rank must end with the same model
and master params, and model == master in the model dtype."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch.nn.parallel import DistributedDataParallel

from ampddp.amp import Amp
from ampddp.distributed import launch_local


def wrap(model, kind, options):
    if kind == "torch":
        return DistributedDataParallel(model, **options)
    from ampddp.apex.parallel import DistributedDataParallel as ApexDDP

    return ApexDDP(model, **options)


def seeded_differently_worker(env, opt_level, kind, options):
    amp = Amp()
    model = make_mlp(seed=100 + env.rank, batchnorm=True)
    initial = next(model.parameters()).detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    ddp = wrap(model, kind, options)
    for x, y in make_batches(4, batch=16, seed=5):
        shard = slice(env.rank * 8, env.rank * 8 + 8)
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp(x[shard]), y[shard])
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    return initial, params, masters


CASES = [
    ("O2", "torch", {}),
    ("O5", "torch", {}),
    ("O2", "apex", {"delay_allreduce": True}),
    ("O2", "apex", {"gradient_predivide_factor": 2.0}),
    ("O5", "apex", {"allreduce_always_fp32": True, "message_size": 256}),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("opt_level, kind, options", CASES, ids=[f"{c[0]}-{c[1]}-{'-'.join(c[2]) or 'default'}" for c in CASES])
def test_initialize_then_ddp_with_differently_seeded_ranks_keeps_ranks_identical(opt_level, kind, options):
    (init0, params0, masters0), (init1, params1, masters1) = launch_local(
        seeded_differently_worker, 2, (opt_level, kind, options), timeout_s=60, job_timeout_s=240
    )
    assert not torch.equal(init0, init1)  # the ranks really started apart
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    for a, b in zip(masters0, masters1):
        assert torch.equal(a, b)
    low = torch.float16 if opt_level == "O2" else torch.bfloat16
    assert any(p.dtype == low for p in params0)
    for param, master in zip(params0, masters0):
        assert torch.equal(param, master.to(param.dtype))


def apex_ddp_strategy_worker(env):
    from ampddp.apex.parallel import DistributedDataParallel as ApexDDP
    from ampddp.distributed import Parallel
    from ampddp.prepare import prepare

    run = prepare(make_mlp(seed=env.rank, batchnorm=False), lambda p: torch.optim.SGD(p, lr=0.1), env, precision="O2",
                  parallel=Parallel("apex-ddp", wrap_options={"delay_allreduce": True}))  # fmt: skip
    x, y = make_batches(1, batch=8, seed=env.rank)[0]
    with run.engine.forward_context():
        loss = F.cross_entropy(run.model(x), y)
    run.engine.backward(loss)
    run.engine.step(run.optimizer)
    return isinstance(run.model, ApexDDP), [p.detach().clone() for p in run.module.parameters()]


@pytest.mark.timeout(200)
def test_apex_ddp_strategy_uses_ampddp_apex_parallel_without_nvidia_apex():
    (is_apex0, params0), (is_apex1, params1) = launch_local(apex_ddp_strategy_worker, 2, timeout_s=60, job_timeout_s=150)
    assert is_apex0 and is_apex1
    assert len(params0) == len(params1) > 0  # zip alone would pass on empty or truncated lists
    assert all(torch.equal(a, b) for a, b in zip(params0, params1))


def independent_models_worker(env):
    """No DDP: each rank trains its own model under O2; nothing may synchronise them."""
    amp = Amp()
    model = make_mlp(seed=7, batchnorm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    with torch.no_grad():
        next(model.parameters()).fill_(float(env.rank + 1))  # a write after initialize, on this rank only
    x, y = make_batches(1, batch=8)[0]
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    return next(model.parameters()).detach().clone(), next(iter(amp.master_params(optimizer))).detach().clone()


@pytest.mark.timeout(200)
def test_without_ddp_ranks_stay_independent_and_masters_follow_local_writes():
    (param0, master0), (param1, master1) = launch_local(independent_models_worker, 2, timeout_s=60, job_timeout_s=150)
    assert torch.all(param0 == 1) and torch.all(param1 == 2)
    assert torch.equal(master0, param0.float()) and torch.equal(master1, param1.float())


def accumulate(amp, model, optimizer, micro_batches, no_sync):
    """One step over several micro-batches the way Hugging Face's Trainer accumulates under DDP: every
    backward but the last inside ``no_sync``, each in its own ``scale_loss`` block."""
    optimizer.zero_grad()
    for index, (x, y) in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else no_sync():
            loss = F.cross_entropy(model(x), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
    optimizer.step()


def no_sync_accumulation_worker(env, levels):
    finals = {}
    for opt_level in levels:
        amp = Amp()
        model = make_mlp(seed=3, batchnorm=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
        ddp = DistributedDataParallel(model)
        for x, y in make_batches(3, batch=16, seed=9):
            shards = [(x[i : i + 4], y[i : i + 4]) for i in range(env.rank * 4, 16, 8)]  # 2 micro-batches per rank
            accumulate(amp, ddp, optimizer, shards, ddp.no_sync)
        finals[opt_level] = [p.detach().float().clone() for p in amp.master_params(optimizer)]
    return finals


@pytest.mark.timeout(300)
def test_gradient_accumulation_under_ddp_no_sync_reduces_every_micro_batch():
    """A backward under ``no_sync`` all-reduces nothing: its gradients wait, scaled, for the synchronising
    one. apex unscaled them into the masters (or stashed them) at once, so DDP reduced the last micro-batch
    only and the ranks trained apart; both ranks must equal one process that sees every micro-batch."""
    levels = ("O1", "O2")
    first, second = launch_local(no_sync_accumulation_worker, 2, (levels,), timeout_s=60, job_timeout_s=240)
    for opt_level in levels:
        amp = Amp()
        model = make_mlp(seed=3, batchnorm=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
        for x, y in make_batches(3, batch=16, seed=9):
            # DDP averages the two ranks' sums over their micro-batches: each of the 4 losses counts one half
            halves = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)]
            optimizer.zero_grad()
            for mx, my in halves:
                with amp.scale_loss(F.cross_entropy(model(mx), my) / 2, optimizer) as scaled:
                    scaled.backward()
            optimizer.step()
        whole = [p.detach().float() for p in amp.master_params(optimizer)]
        for a, b, ref in zip(first[opt_level], second[opt_level], whole):
            assert torch.equal(a, b), f"{opt_level}: ranks trained apart"
            torch.testing.assert_close(a, ref, atol=2e-3, rtol=2e-3, msg=f"{opt_level}: not the whole batch's step")
