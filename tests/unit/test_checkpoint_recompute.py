"""Activation checkpointing recomputes with the casting its forward had (issue #47).

``torch.utils.checkpoint`` replays device autocast for the recompute and nothing else, so under O1/O4
the recompute ran LayerNorm and GELU in fp16 where the forward had run them in fp32: the reentrant
variant trained differently, the non-reentrant one raised ``CheckpointError``. A run with
checkpointing must train bit for bit as the same run without it, for both variants and
``checkpoint_sequential``, through the facade (inside and outside ``scale_loss``) and through the
engine path the Trainer uses (``prepare``, ``engine.forward_context``, ``engine.backward``); O0 and O2
(no op casting) are the control. Also: a backward on another thread (CUDA's autograd runs it on one of
its own), a forward cast by the torch-function mode, apex's legacy ``amp.init`` handle; backward
formulas stay uncast, and another thread's checkpoint is torch's. The runner (``python -m ampddp.apex``)
is tested in tests/e2e/test_apex_runner.py.
"""

from __future__ import annotations

import threading
import types

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from ampddp.amp import Amp
from ampddp.distributed.env import DistEnv
from ampddp.precision.casting.cast_context import CHECKPOINT_STAND_INS
from ampddp.prepare import prepare

LOW = {"O1": torch.float16, "O4": torch.bfloat16}
CHECKPOINTING = ("reentrant", "non-reentrant", "sequential", "sequential-reentrant")
STEPS = 3


class Block(nn.Module):
    """Linear -> LayerNorm -> GELU -> Linear: O1/O4 run the norm and GELU in fp32 on the Linear's low-precision output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc_in, self.norm, self.fc_out = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.norm(self.fc_in(x))))


class Net(nn.Module):
    def __init__(self, checkpointing: str | None) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.stem, self.blocks, self.head = nn.Linear(16, 16), nn.Sequential(Block(), Block(), Block()), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # the blocks' input requires grad, as the reentrant variant needs
        how = self.checkpointing
        if how is None:
            x = self.blocks(x)
        elif how.startswith("sequential"):
            x = checkpoint_sequential(self.blocks, 3, x, use_reentrant=how.endswith("-reentrant"))
        else:
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=how == "reentrant")
        return self.head(x)


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=generator) for _ in range(STEPS)]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def train_with_the_facade(level: str, checkpointing: str | None, inside_scale_loss: bool = True, backward_thread: bool = False):
    torch.manual_seed(0)
    amp = Amp()
    model = Net(checkpointing)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level=level, verbosity=0)
    for x in batches():
        optimizer.zero_grad()
        loss = loss_of(model(x))
        if inside_scale_loss:
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        elif backward_thread:  # as on CUDA, where the autograd engine runs the backward on a thread of its own
            thread = threading.Thread(target=loss.backward)
            thread.start()
            thread.join()
        else:
            loss.backward()
        optimizer.step()
    amp.end_casts()
    return [p.detach().clone() for p in model.parameters()]


def train_with_the_engine(level: str, checkpointing: str | None):
    torch.manual_seed(0)
    run = prepare(Net(checkpointing), lambda params: torch.optim.SGD(params, lr=0.5), DistEnv(), precision=level)
    try:
        for x in batches():
            with run.engine.forward_context():
                loss = loss_of(run.model(x))
            run.engine.backward(loss)
            run.engine.step(run.optimizer)
            run.optimizer.zero_grad()
    finally:
        run.engine.teardown()
    return [p.detach().clone() for p in run.module.parameters()]


def assert_bit_identical(reference, checkpointed):
    different = [index for index, (a, b) in enumerate(zip(reference, checkpointed)) if not torch.equal(a, b)]
    worst = max((float((a.float() - b.float()).abs().max()) for a, b in zip(reference, checkpointed)), default=0.0)
    assert not different, f"params {different} differ from the run without checkpointing (up to {worst:.3g})"


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O4"])
def test_a_checkpointed_run_trains_as_without_checkpointing_through_scale_loss(level, checkpointing):
    assert_bit_identical(train_with_the_facade(level, None), train_with_the_facade(level, checkpointing))


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_a_checkpointed_run_trains_as_without_checkpointing_outside_scale_loss(level, checkpointing):
    reference = train_with_the_facade(level, None, inside_scale_loss=False)
    assert_bit_identical(reference, train_with_the_facade(level, checkpointing, inside_scale_loss=False))


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
def test_the_recompute_casts_as_its_forward_on_the_thread_the_backward_runs_on(checkpointing):
    reference = train_with_the_facade("O1", None, inside_scale_loss=False, backward_thread=True)
    assert_bit_identical(reference, train_with_the_facade("O1", checkpointing, inside_scale_loss=False, backward_thread=True))


def scaled_gelu(x: torch.Tensor) -> torch.Tensor:
    """A plain Python function: registered, it makes the forward cast through the torch-function mode."""
    return F.gelu(x) * 0.5


class ModeBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(FUNCTIONS.scaled_gelu(self.norm(self.fc_in(x))))


FUNCTIONS = types.SimpleNamespace(scaled_gelu=scaled_gelu)


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
def test_a_forward_cast_by_the_torch_function_mode_recomputes_under_it(checkpointing):
    def train(checkpointing):
        torch.manual_seed(0)
        amp = Amp()
        amp.register_float_function(FUNCTIONS, "scaled_gelu")
        model = Net(checkpointing)
        model.blocks = nn.Sequential(ModeBlock(), ModeBlock(), ModeBlock())
        model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O1", verbosity=0)
        assert not amp.engine.forward_context().uses_kernels
        for x in batches():
            optimizer.zero_grad()
            with amp.scale_loss(loss_of(model(x)), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        amp.end_casts()
        return [p.detach().clone() for p in model.parameters()]

    assert_bit_identical(train(None), train(checkpointing))


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O4"])
def test_a_checkpointed_run_trains_as_without_checkpointing_through_the_engine(level, checkpointing):
    assert_bit_identical(train_with_the_engine(level, None), train_with_the_engine(level, checkpointing))


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
@pytest.mark.parametrize("level", ["O1", "O4"])
def test_the_recompute_runs_each_op_in_the_dtype_the_forward_ran_it_in(level, checkpointing):
    seen = []
    amp = Amp()
    model = Net(checkpointing)
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level=level, verbosity=0)

    def record(module, args, output):
        seen.append((type(module).__name__, torch.is_grad_enabled(), output.dtype))

    model.blocks[0].fc_in.register_forward_hook(record)
    model.blocks[0].norm.register_forward_hook(record)
    with amp.scale_loss(loss_of(model(torch.randn(8, 16))), optimizer) as scaled:
        scaled.backward()
    forward = [(name, dtype) for name, _, dtype in seen[:2]]
    assert forward == [("Linear", LOW[level]), ("LayerNorm", torch.float32)]
    assert [(name, dtype) for name, _, dtype in seen[2:]] == forward  # the recompute (grad enabled) ran them alike
    assert [grad for _, grad, _ in seen[2:]] == [True, True]


BACKWARD_DTYPES: list[torch.dtype] = []


class RecordsItsBackward(torch.autograd.Function):
    """Identity whose backward (a Python formula, as custom Functions have) records the dtype of ``mm``, on the low-precision list."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        BACKWARD_DTYPES.append(torch.mm(grad.float(), x.float().t()).dtype)
        return grad


@pytest.mark.parametrize("checkpointing", [None, "reentrant", "non-reentrant"])
def test_backward_formulas_are_not_cast_with_checkpointing_or_without(checkpointing):
    BACKWARD_DTYPES.clear()
    amp = Amp()
    block = nn.Linear(16, 16)

    def forward(x):
        return RecordsItsBackward.apply(block(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.stem = block, nn.Linear(16, 16)

        def forward(self, x):
            x = self.stem(x)
            return forward(x) if checkpointing is None else checkpoint(forward, x, use_reentrant=checkpointing == "reentrant")

    model, optimizer = amp.initialize(Model(), torch.optim.SGD(block.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    with amp.scale_loss(loss_of(model(torch.randn(4, 16))), optimizer) as scaled:
        scaled.backward()
    assert [torch.float32] == BACKWARD_DTYPES  # fp16 had it been cast


def test_a_checkpoint_on_a_thread_that_does_not_cast_recomputes_as_torch_does():
    """While a forward casts on this thread, another thread's checkpoint under its own torch.autocast is torch's."""
    amp = Amp()
    model = nn.Linear(16, 16)
    amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
    block, seen = Block(), []
    block.norm.register_forward_hook(lambda module, args, output: seen.append(output.dtype))

    def elsewhere():
        with torch.autocast("cpu", dtype=torch.float16):
            out = checkpoint(block, torch.randn(4, 16, requires_grad=True), use_reentrant=False)
        out.float().sum().backward()

    with amp.forward_context():
        assert CHECKPOINT_STAND_INS.held
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    amp.end_casts()
    assert seen == [torch.float16, torch.float16]  # torch's CPU autocast keeps layer_norm in its input's dtype
    assert not CHECKPOINT_STAND_INS.held


def test_the_stand_ins_are_in_torch_only_while_a_forward_casts():
    originals = (torch_checkpoint.CheckpointFunction, torch_checkpoint._CheckpointFrame)
    amp = Amp()
    model = Net("reentrant")
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), opt_level="O1", verbosity=0)
    during = []
    model.stem.register_forward_hook(lambda *_: during.append((torch_checkpoint.CheckpointFunction, torch_checkpoint._CheckpointFrame)))
    assert (torch_checkpoint.CheckpointFunction, torch_checkpoint._CheckpointFrame) == originals
    loss = loss_of(model(torch.randn(8, 16)))
    (stand_ins,) = during
    assert all(issubclass(stand_in, original) and stand_in is not original for stand_in, original in zip(stand_ins, originals))
    assert not CHECKPOINT_STAND_INS.held  # the facade's window after the forward is no forward
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    amp.end_casts()
    assert (torch_checkpoint.CheckpointFunction, torch_checkpoint._CheckpointFrame) == originals


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
def test_under_the_legacy_handle_the_recompute_casts_as_its_held_lists(checkpointing):
    """apex's ``amp.init()`` handle casts by op lists held on its thread, forwards included."""
    from ampddp.apex import amp as apex_amp

    def train(checkpointing):
        torch.manual_seed(0)
        handle = apex_amp.init(enabled=True)
        model = Net(checkpointing)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        try:
            for x in batches():
                optimizer.zero_grad()
                with handle.scale_loss(loss_of(model(x)), optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
        finally:
            handle._deactivate()
        return [p.detach().clone() for p in model.parameters()]

    assert_bit_identical(train(None), train(checkpointing))


class KeepsAnFp32Matmul(nn.Module):
    """A forward with a region of its own under ``torch.autocast(enabled=False)``: ampddp's casts are off there too."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).float()
        with torch.autocast("cpu", enabled=False):
            return h @ h.t()


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant"])
def test_a_checkpoint_around_a_whole_model_under_process_wide_casts_recomputes_as_its_forward(checkpointing):
    """The runner's op lists between forwards (the window) are not what a checkpoint recomputes under: the
    wrapped model's hooks close them in the forward and again in the recompute."""

    def train(checkpointing):
        torch.manual_seed(0)
        amp = Amp()
        with amp.process_wide_casts():
            model = KeepsAnFp32Matmul()
            model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1", verbosity=0)
            for x in batches():
                x.requires_grad_()
                output = model(x) if checkpointing is None else checkpoint(model, x, use_reentrant=checkpointing == "reentrant")
                optimizer.zero_grad()
                with amp.scale_loss(loss_of(output), optimizer) as scaled:
                    scaled.backward()
                optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    assert_bit_identical(train(None), train(checkpointing))
