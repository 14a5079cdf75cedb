"""apex's O1/O4 scope under ``python -m ampddp.apex`` (``Amp.process_wide_casts``): from ``initialize``
on, ops on the initializing thread follow apex's lists — layers never given to ``initialize`` too
(mmengine's tests build a fresh ``nn.Conv2d`` and expect fp16) — except inside ``scale_loss`` and the
optimizer step; other threads and the library API's scoped casting are untouched, and nothing is
left once the scope ends."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from ampddp.amp import Amp


def mm():
    return torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype


def test_process_wide_scope_follows_apex_from_initialize_to_the_end_of_the_block():
    amp = Amp()
    with amp.process_wide_casts():
        assert mm() == torch.float32  # nothing before initialize
        model = nn.Linear(8, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        assert nn.Conv2d(3, 4, 3)(torch.randn(1, 3, 8, 8)).dtype == torch.float16
        assert mm() == torch.float16
        output = model(torch.randn(4, 8))
        loss = F.mse_loss(output, torch.zeros_like(output))
        assert output.dtype == torch.float16 and loss.dtype == torch.float32
        with amp.scale_loss(loss, optimizer) as scaled:
            assert mm() == torch.float32  # backward runs with casts off
            scaled.backward()
        assert mm() == torch.float16
        seen = []

        def record_step(opt, args, kwargs):
            seen.append(mm())

        handle = optimizer.register_step_pre_hook(record_step)
        optimizer.step()
        handle.remove()
        assert seen == [torch.float32]  # the step runs with casts off, as in apex
        assert mm() == torch.float16
        other = []
        thread = threading.Thread(target=lambda: other.append(mm()))
        thread.start()
        thread.join()
        assert other == [torch.float32]  # only the initializing thread
        with amp.disable_casts():
            assert mm() == torch.float32
        amp.end_casts()  # apex's handle._clear_cache: casting goes on
        assert mm() == torch.float16
    assert mm() == torch.float32
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_without_the_scope_casting_stays_with_the_models_forwards():
    amp = Amp()
    model = nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    assert nn.Conv2d(3, 4, 3)(torch.randn(1, 3, 8, 8)).dtype == torch.float32
    output = model(torch.randn(4, 8))
    assert mm() == torch.float16  # the window after a forward, until scale_loss
    with amp.scale_loss(output.float().sum(), optimizer) as scaled:
        scaled.backward()
    assert mm() == torch.float32
    optimizer.step()
    assert mm() == torch.float32


def test_an_o0_model_next_to_a_process_wide_o1_one_runs_in_fp32():
    amp = Amp()
    with amp.process_wide_casts():
        fast = nn.Linear(8, 8)
        amp.initialize(fast, torch.optim.SGD(fast.parameters(), lr=0.1), opt_level="O1", verbosity=0)
        exact = nn.Linear(8, 8)
        amp.initialize(exact, torch.optim.SGD(exact.parameters(), lr=0.1), opt_level="O0", verbosity=0)
        fast(torch.randn(2, 8))
        assert exact(torch.randn(2, 8)).dtype == torch.float32


def test_an_error_inside_scale_loss_does_not_end_the_process_wide_scope():
    amp = Amp()
    with amp.process_wide_casts():
        model = nn.Linear(8, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        try:
            with amp.scale_loss(model(torch.randn(2, 8)).float().sum(), optimizer):
                raise KeyError("user code failed")
        except KeyError:
            pass
        assert mm() == torch.float16
        amp.set_process_wide_casts(False)
        assert mm() == torch.float32
        amp.set_process_wide_casts(True)
        assert mm() == torch.float16
    assert mm() == torch.float32
