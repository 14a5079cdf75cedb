"""The step's flags riding DDP's first gradient bucket over gloo (``ampddp.distributed.gradient_rider``), two processes.

The rider must leave DDP's gradients bit-equal to DDP's own all-reduce, sum what boarded exactly in any bucket dtype,
and step aside where it cannot ride. Through the Trainer: a signal on one rank and a non-finite loss on one rank are
still agreed by both before anyone steps, the records' losses are the global batch's, and no step makes a collective
of its own for them.
"""

from __future__ import annotations

import os
import signal
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import make_batches, make_mlp
from torch.nn.parallel import DistributedDataParallel

from ampddp import Trainer
from ampddp.distributed import launch_local
from ampddp.distributed.gradient_rider import ride_gradients
from ampddp.errors import NonFiniteGradientsError
from ampddp.training.callbacks import Callback
from ampddp.training.compile_model import ModelCompiler
from ampddp.training.step_agreement import StepAgreement
from ampddp.training.stopping import StopAgreement


def rider_worker(env) -> dict:
    """Two copies of one model in DDP, one carrying a rider: the same backward on each, in fp32 and in bf16; then the
    rider's backward with each rank's loss weighted by its share (``summing``); then where it sits on a larger model."""
    out: dict = {}
    x, y = make_batches(1, batch=16, seed=5)[0]
    mine = slice(env.rank * 8, env.rank * 8 + 8)
    for dtype in (torch.float32, torch.bfloat16):
        plain, carrying = (
            DistributedDataParallel(make_mlp(batchnorm=False).to(dtype)),
            DistributedDataParallel(make_mlp(batchnorm=False).to(dtype)),
        )
        rider = ride_gradients(carrying)
        assert rider is not None and ride_gradients(carrying) is rider, "the rider is made once per wrapper"
        rider.board(torch.tensor([float(env.rank), 1.0, 3.0]))
        for model in (plain, carrying):
            F.cross_entropy(model(x[mine].to(dtype)).float(), y[mine]).backward()
        landed = rider.landed()
        out[str(dtype)] = {
            "equal": all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), carrying.parameters())),
            "landed": landed.float().tolist(),
            "again": rider.landed(),
        }
        F.cross_entropy(carrying(x[mine].to(dtype)).float(), y[mine]).backward()  # nothing boarded: a plain average
        out[str(dtype)]["unboarded"] = rider.landed()
        for model in (plain, carrying):
            model.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x[mine].to(dtype)).float(), y[mine]).backward()
        rider.board(torch.tensor([1.0, 0.0]))
        with rider.summing():  # each rank's share of the global batch: half
            (F.cross_entropy(carrying(x[mine].to(dtype)).float(), y[mine]) * 0.5).backward()
        out[str(dtype)]["summed_equal"] = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), carrying.parameters()))
        out[str(dtype)]["summed_landed"] = rider.landed().float().tolist()
    compressed = DistributedDataParallel(make_mlp(batchnorm=False))
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    compressed.register_comm_hook(None, default_hooks.fp16_compress_hook)
    out["compressed"] = ride_gradients(compressed)
    # Gradients ready last layer first: its 2.1 MB fill DDP's first bucket, over what the flags ride; the first
    # layer's 17 kB its second, which they take once a backward has shown its size.
    torch.manual_seed(0)
    large = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8192)))
    rider = ride_gradients(large)
    out["large"], out["boarded"] = [], []
    for _ in range(3):  # the caller agrees what did not land
        out["boarded"].append(rider.board(torch.tensor([1.0])))
        large(torch.randn(4, 64)).square().mean().backward()
        landed = rider.landed()
        out["large"].append(None if landed is None else landed.tolist())
    # Through a step's agreement on a model whose only bucket is over 2 MiB: who called ``all_reduce``, in order.
    torch.manual_seed(0)
    only_large = DistributedDataParallel(torch.nn.Linear(64, 8192), bucket_cap_mb=64)
    rider, out["order"], out["verdicts"] = ride_gradients(only_large), [], []
    for _ in range(3):
        agreement, callers = StepAgreement(env, StopAgreement(), rider), []
        with traced(callers):
            loss = only_large(torch.randn(4, 64)).square().mean()
            agreement.start(loss, backward_pending=True)
            loss.backward()
            out["verdicts"].append(agreement.verdict()[:2])
        out["order"].append(callers)
    return out


def traced(callers: list[str]):
    """Every all-reduce a process group starts from Python (``dist.all_reduce``'s, and the rider's own, not DDP's from
    C++), the name of the function outside torch that asked for it noted in ``callers``."""
    all_reduce = dist.ProcessGroup.allreduce

    def noted(group, *args, **kwargs):
        frame = sys._getframe(1)
        while frame.f_code.co_filename.startswith(TORCH_DIR):
            frame = frame.f_back
        callers.append(frame.f_code.co_name)
        return all_reduce(group, *args, **kwargs)

    return mock.patch.object(dist.ProcessGroup, "allreduce", noted)


TORCH_DIR = os.path.dirname(torch.__file__)


def test_the_rider_leaves_ddp_gradients_bit_equal_and_sums_what_boarded():
    results = launch_local(rider_worker, 2, device="cpu", timeout_s=60)
    for result in results:
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert result[dtype]["equal"], f"{dtype}: gradients differ from DDP's own all-reduce"
            assert result[dtype]["landed"] == [1.0, 2.0, 6.0], "the boarded values, summed over the two ranks"
            assert result[dtype]["again"] is None and result[dtype]["unboarded"] is None
            assert result[dtype]["summed_equal"], f"{dtype}: each rank's share summed differs from DDP's average"
            assert result[dtype]["summed_landed"] == [2.0, 0.0]
        assert result["compressed"] is None, "a wrapper with a hook of its own keeps it"
        landed = result["large"]
        assert landed[:2] == [None, None], "the buckets known are over 2 MiB (DDP lays them out anew after its first backward)"
        assert landed[2] == [2.0], "then the smallest bucket (the first layer's, DDP's second) carries them"
        # Before the first backward the layout is unknown (they board, and land nowhere); after it, the only bucket
        # seen was over 2 MiB, so the caller is told at once to send them on their own, while the backward computes.
        assert result["boarded"] == [True, False, True]
        assert result["verdicts"] == [(True, False)] * 3
        # The flags' own all-reduce ("__init__": PendingSum's): after the backward while the layout is unknown, then
        # before it, so that it travels while the backward computes.
        after, before = ["_gradients_with_riders", "__init__"], ["__init__", "_gradients_with_riders"]
        assert result["order"] == [after, before, before]


class SignalAt(Callback):
    """Rank ``rank`` receives SIGTERM as step ``step`` ends."""

    def __init__(self, env, rank: int, step: int) -> None:
        self.env, self.rank, self.step = env, rank, step

    def on_step(self, progress, record) -> None:
        if self.env.rank == self.rank and progress.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class Records(Callback):
    """The records, and the functions that started an all-reduce during each step (``traced``)."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.callers: list[str] = []
        self.collectives: dict[int, list[str]] = {}

    def traced(self):
        return traced(self.callers)

    def on_step(self, progress, record) -> None:
        self.collectives[progress.global_step] = list(self.callers)
        self.callers.clear()
        if record is not None:
            self.records.append({key: record[key] for key in ("step", "loss", "loss_mean")})


def trainer_worker(env, log_every: int, poison: bool, run_dir: str) -> dict:
    """Global batches of 16 (8 a rank, every other sample); with ``poison``, sample 17 (rank 1's, step 2) is NaN."""
    (x, y), = make_batches(1, batch=64, seed=9)  # fmt: skip
    if poison:
        x[17] = float("nan")
    records = Records()
    trainer = Trainer(make_mlp(batchnorm=False), lambda p: torch.optim.SGD(p, lr=0.05), torch.utils.data.TensorDataset(x, y), env=env,
                      run_dir=run_dir, precision="O0", metrics=None, report=None, shuffle=False, batch_size=16 // env.world_size,
                      max_steps=4, log_every=log_every, stop_signals=("SIGTERM",), max_nonfinite_losses=1,
                      callbacks=[records, SignalAt(env, rank=1, step=2)] if not poison and env.distributed else [records])  # fmt: skip
    hooks = len(getattr(trainer.run.model, "_comm_hooks", []))
    try:
        with records.traced():
            result = trainer.fit()
    except NonFiniteGradientsError as error:
        return {"error": str(error), "step": trainer.progress.global_step}
    hooks_after = len(getattr(trainer.run.model, "_comm_hooks", []))
    return {"preempted": result["summary"]["preempted"], "step": result["progress"]["global_step"], "records": records.records,
            "collectives": records.collectives, "hooks_before_fit": hooks, "hooks": hooks_after}  # fmt: skip


@pytest.mark.timeout(240)
def test_through_the_trainer_a_signal_on_one_rank_stops_both_at_the_same_step_and_the_records_are_the_global_batchs(tmp_path):
    two = launch_local(trainer_worker, 2, (1, False, str(tmp_path / "two")), device="cpu", timeout_s=90, job_timeout_s=200)
    assert [r["preempted"] for r in two] == ["a stop signal on another rank", "SIGTERM"]
    assert [r["step"] for r in two] == [3, 3], "the vote of step 2's end counts at step 3, on both ranks"
    assert [(r["hooks_before_fit"], r["hooks"]) for r in two] == [(0, 1), (0, 1)], "the flags rode the gradients"
    assert two[0]["records"] == two[1]["records"]
    from ampddp.distributed import detect_env

    one = trainer_worker(detect_env({}, device="cpu"), 1, False, str(tmp_path / "one"))
    for ddp, alone in zip(two[0]["records"], one["records"][:3]):
        assert ddp["step"] == alone["step"] and ddp["loss_mean"] == ddp["loss"]
        assert ddp["loss"] == pytest.approx(alone["loss"], rel=1e-6)
    windows = launch_local(trainer_worker, 2, (2, False, str(tmp_path / "windows")), device="cpu", timeout_s=90, job_timeout_s=200)
    assert windows[0]["collectives"][3] == ["_gradients_with_riders"], "a step between records: the gradients' all-reduce alone"
    assert windows[0]["collectives"][2] == ["_gradients_with_riders", "__init__"], "a record's step: and the window's sums"
    windows = windows[0]["records"]
    assert [r["step"] for r in windows] == [1, 2]
    assert windows[1]["loss_mean"] == pytest.approx(two[0]["records"][1]["loss"], rel=1e-12), "one step since the first record"


@pytest.mark.timeout(240)
def test_through_the_trainer_a_non_finite_loss_on_one_rank_is_traced_by_both_before_anyone_steps(tmp_path):
    results = launch_local(trainer_worker, 2, (1, True, str(tmp_path / "run")), device="cpu", timeout_s=90, job_timeout_s=200)
    assert [r["step"] for r in results] == [1, 1], "step 2 was not taken by either rank"
    for result in results:
        assert "the input batch itself holds inf/NaN (rank 1: training sample(s) 17 (epoch 0))" in result["error"], result["error"]


def shares_worker(env, precision: str, ride: bool) -> list[torch.Tensor]:
    """Two epochs of 44 samples in windows of 2 micro-batches of 4 a rank (the last window short), SGD with momentum;
    without ``ride``, DDP's own averaging hook registered first keeps the rider off."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    (x, y), = make_batches(1, batch=44, seed=3)  # fmt: skip
    trainer = Trainer(make_mlp(batchnorm=False), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), torch.utils.data.TensorDataset(x, y),
                      env=env, precision=precision, metrics=None, report=None, shuffle=False, batch_size=4, grad_accum_steps=2,
                      max_epochs=2, stop_signals=())  # fmt: skip
    if not ride:
        trainer.run.model.register_comm_hook(None, default_hooks.allreduce_hook)
    trainer.fit()
    hooks = [hook for hook, _ in trainer.run.model._comm_hooks]
    assert (hooks[0].__name__ == "_gradients_with_riders") == ride, hooks
    return [p.detach().clone() for p in trainer.engine.master_params(trainer.optimizer)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("precision", ["O0", "O2"])
def test_each_ranks_share_summed_trains_bit_equal_to_ddps_average(precision):
    """Riding, the Trainer weights each rank's loss by its share of the global batch and the hook sums (no pass to
    divide): with accumulation, a short last window and fp16 gradients in the buckets (O2), the same weights."""
    riding, averaged = (launch_local(shares_worker, 2, (precision, ride), device="cpu", timeout_s=120, job_timeout_s=200)[0]
                        for ride in (True, False))  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(riding, averaged))


def compiled_worker(env, compiled: bool) -> dict:
    (x, y), = make_batches(1, batch=64, seed=9)  # fmt: skip
    trainer = Trainer(make_mlp(batchnorm=False), lambda p: torch.optim.SGD(p, lr=0.05), torch.utils.data.TensorDataset(x, y), env=env,
                      precision="O0", metrics=None, report=None, shuffle=False, batch_size=8, max_steps=3, stop_signals=(),
                      compile=ModelCompiler("default", "aot_eager") if compiled else None)  # fmt: skip
    trainer.fit()
    wrapper = getattr(trainer.run.model, "_orig_mod", trainer.run.model)
    return {"params": [p.detach().clone() for p in trainer.run.module.parameters()], "hooks": len(wrapper._comm_hooks)}


@pytest.mark.timeout(240)
def test_a_compiled_ddp_model_carries_the_rider_and_trains_as_the_eager_one():
    compiled, eager = (launch_local(compiled_worker, 2, (flag,), device="cpu", timeout_s=150, job_timeout_s=200)[0] for flag in (1, 0))
    assert compiled["hooks"] == eager["hooks"] == 1
    assert all(torch.equal(a, b) for a, b in zip(compiled["params"], eager["params"]))
