"""Two gloo processes: DDP gradients equal the global batch's, accumulation equals DDP, uneven batches.

Workers are module-level functions so the spawned processes can import them; each returns plain
data (tensors) that the test compares in the parent.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import make_batches, make_mlp

from ampddp import Parallel, Precision, Trainer
from ampddp.distributed import detect_env, global_batch_loss_weight, launch_local, unwrap_model
from ampddp.prepare import prepare
from ampddp.training.batches import BatchAdapter

MODES = ["O0", "O1", "O2", "native-bf16"]
TOLERANCE = {"O0": 1e-6, "O1": 2e-2, "O2": 2e-2, "native-bf16": 5e-2}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def global_batch(size=16):
    return make_batches(3, batch=size, seed=7)


def ddp_worker(env, mode):
    """Three DDP steps on this rank's half of each global batch; report master grads and params."""
    prepared = prepare(
        make_mlp(batchnorm=False), sgd, env, precision=Precision(mode, overrides={"loss_scale": 64.0} if mode in ("O1", "O2") else {})
    )
    first_grads = None
    for x, y in global_batch():
        shard = slice(env.rank * 8, env.rank * 8 + 8)
        prepared.optimizer.zero_grad()
        with prepared.engine.forward_context():
            loss = F.cross_entropy(prepared.model(x[shard]), y[shard])
        prepared.engine.backward(loss)
        prepared.engine.unscale_(prepared.optimizer)
        if first_grads is None:
            first_grads = [p.grad.clone() for p in prepared.engine.master_params(prepared.optimizer)]
        prepared.engine.step(prepared.optimizer)
    masters = [p.detach().clone() for p in prepared.engine.master_params(prepared.optimizer)]
    model_params = [p.detach().clone() for p in unwrap_model(prepared.model).parameters()]
    return first_grads, masters, model_params


def single_process_first_grads(mode):
    from ampddp import build_engine

    model = make_mlp(batchnorm=False)
    optimizer = sgd(model.parameters())
    engine = build_engine(mode, **({"loss_scale": 64.0} if mode in ("O1", "O2") else {}))
    engine.setup([model], [optimizer])
    x, y = global_batch()[0]
    with engine.forward_context():
        loss = F.cross_entropy(model(x), y)
    engine.backward(loss)
    engine.unscale_(optimizer)
    return [p.grad for p in engine.master_params(optimizer)]


@pytest.mark.smoke
@pytest.mark.parametrize("mode", MODES)
def test_ddp_gradient_equals_the_global_batch_gradient_and_ranks_stay_identical(mode):
    results = launch_local(ddp_worker, 2, (mode,), device="cpu", timeout_s=60)
    reference = single_process_first_grads(mode)
    for rank_grads in (results[0][0], results[1][0]):
        for grad, ref in zip(rank_grads, reference):
            assert grad.dtype == torch.float32
            torch.testing.assert_close(grad, ref, rtol=TOLERANCE[mode], atol=TOLERANCE[mode] / 10)
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b), "master grads must be identical on every rank"
    for part in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(results[0][part], results[1][part])), "params diverged between ranks"


def accumulation_worker(env, use_no_sync):
    """DDP over 2 ranks, each accumulating 2 micro-batches of 4 (no_sync on the first)."""
    prepared = prepare(make_mlp(batchnorm=False), sgd, env, precision="O0")
    x, y = global_batch()[0]
    mine = slice(env.rank * 8, env.rank * 8 + 8)
    prepared.optimizer.zero_grad()
    for index, (mx, my) in enumerate(zip(x[mine].chunk(2), y[mine].chunk(2))):
        sync = prepared.grad_sync.micro_step(is_last=index == 1) if use_no_sync else torch.enable_grad()
        with sync:
            loss = F.cross_entropy(prepared.model(mx), my) / 2
            prepared.engine.backward(loss)
    prepared.engine.step(prepared.optimizer)
    return [p.detach().clone() for p in unwrap_model(prepared.model).parameters()]


def test_k_step_accumulation_in_one_process_equals_k_process_ddp_and_no_sync_changes_nothing():
    with_no_sync = launch_local(accumulation_worker, 2, (True,), device="cpu", timeout_s=60)
    without = launch_local(accumulation_worker, 2, (False,), device="cpu", timeout_s=60)
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model.parameters())
    x, y = global_batch()[0]
    for mx, my in zip(x.chunk(2), y.chunk(2)):
        (F.cross_entropy(model(mx), my) / 2).backward()
    optimizer.step()
    for ddp_param, no_sync_param, param in zip(without[0], with_no_sync[0], model.parameters()):
        torch.testing.assert_close(ddp_param, param, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(no_sync_param, ddp_param, rtol=1e-6, atol=1e-7)


def uneven_worker(env, weighted):
    """Rank 0 holds 3 samples, rank 1 holds 5: the global batch has 8."""
    prepared = prepare(make_mlp(batchnorm=False), sgd, env, precision="O0")
    x, y = global_batch(size=8)[0]
    mine = slice(0, 3) if env.rank == 0 else slice(3, 8)
    loss = F.cross_entropy(prepared.model(x[mine]), y[mine])
    if weighted:
        loss = loss * global_batch_loss_weight(len(x[mine]), env)
    loss.backward()
    return [p.grad.clone() for p in unwrap_model(prepared.model).parameters()]


def test_uneven_batches_need_global_batch_weighting():
    weighted = launch_local(uneven_worker, 2, (True,), device="cpu", timeout_s=60)
    plain = launch_local(uneven_worker, 2, (False,), device="cpu", timeout_s=60)
    model = make_mlp(batchnorm=False)
    x, y = global_batch(size=8)[0]
    F.cross_entropy(model(x), y).backward()
    reference = [p.grad for p in model.parameters()]
    for grad, ref in zip(weighted[0], reference):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7)
    assert not all(torch.allclose(grad, ref, rtol=1e-3, atol=1e-5) for grad, ref in zip(plain[0], reference))


def o2_dataparallel_worker():
    return None


def test_o2_with_dataparallel_trains():
    env = detect_env({}, device="cpu")
    prepared = prepare(make_mlp(), sgd, env, precision=Precision("O2", overrides={"verbosity": 0}), parallel=Parallel("dp"))
    before = copy.deepcopy([p.detach() for p in prepared.module.parameters()])
    x, y = global_batch()[0]
    with prepared.engine.forward_context():
        loss = F.cross_entropy(prepared.model(x), y)
    prepared.engine.backward(loss)
    assert prepared.engine.step(prepared.optimizer)
    assert isinstance(prepared.model, torch.nn.DataParallel)
    assert not all(torch.equal(a, b) for a, b in zip(before, prepared.module.parameters()))
    assert not dist.is_initialized()


class KeptSamples(torch.utils.data.Dataset):
    """16 samples (inputs, target, keep); the odd ones (rank 1's under 2-rank DDP) mostly not kept."""

    def __init__(self) -> None:
        (self.x, self.y), self.keep = make_batches(1, batch=16, seed=3)[0], torch.tensor([1, 1, 1, 0] * 4)

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index):
        return self.x[index], self.y[index], self.keep[index]


class KeptAdapter(BatchAdapter):
    """Counts only the kept samples: a count that differs between ranks, so the loop must sum it."""

    def count(self, batch) -> int:
        return int(batch[2].sum())


def kept_loss(outputs, batch):
    return F.cross_entropy(outputs, batch[1], reduction="none")[batch[2].bool()].mean()


def kept_worker(env, batch_size):
    trainer = Trainer(make_mlp(batchnorm=False), sgd, KeptSamples(), env=env, precision="O0", batches=KeptAdapter(), loss_fn=kept_loss,
                      metrics=None, batch_size=batch_size, shuffle=False, max_steps=2, report=None, stop_signals=())  # fmt: skip
    trainer.fit()
    return [p.detach().clone() for p in trainer.run.module.parameters()]


def test_a_count_of_its_own_is_summed_over_the_ranks():
    """An adapter's own count (kept samples: 4 + 1 and 3 + 1 over two ranks) weights each rank's mean by its
    share of the global count, as one process over the whole batch does (the default count, every rank as
    many samples, needs no sum: the other tests of this file)."""
    two = launch_local(kept_worker, 2, (4,), device="cpu", timeout_s=90)
    one = kept_worker(detect_env({}, device="cpu"), 8)
    for ddp_param, param in zip(two[0], one):
        torch.testing.assert_close(ddp_param, param, rtol=1e-6, atol=1e-7)
