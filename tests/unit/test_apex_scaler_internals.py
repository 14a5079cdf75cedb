"""apex's scaler internals that NVIDIA's examples drive by hand, and ``apex_C``.

BERT pretraining unscales with ``scale_loss(..., delay_overflow_check=True)``, reduces the master
grads itself, swaps its own flag into ``loss_scalers[0]._overflow_buf`` and calls ``update_scale()``;
GNMT writes ``_loss_scale`` and ``_scale_seq_len``. Each must move the scale exactly as apex's
``LossScaler.update_scale`` did.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp

from ampddp import ConfigError
from ampddp.amp import Amp
from ampddp.apex import apex_C
from ampddp.apex.amp._amp_state import AmpStateView


def o2_setup(**options):
    amp = Amp()
    model = make_mlp(batchnorm=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0, **options)
    return amp, AmpStateView(amp), model, optimizer


def backward(amp, model, optimizer, factor=1.0, **options):
    x, y = make_batches(1)[0]
    with amp.scale_loss(F.cross_entropy(model(x), y) * factor, optimizer, **options) as scaled:
        scaled.backward()


def test_delay_overflow_check_unscales_but_leaves_the_scale_and_the_step_to_update_scale():
    amp, state, model, optimizer = o2_setup()
    scaler = state.loss_scalers[0]
    backward(amp, model, optimizer, factor=float("inf"), delay_overflow_check=True)
    assert scaler.loss_scale() == 2.0**16 and not optimizer._amp_stash.already_patched
    assert scaler._has_overflow
    assert scaler.update_scale() is True  # apex: skip
    assert scaler.loss_scale() == 2.0**15 and scaler._unskipped == 0
    assert not scaler._has_overflow  # the pending flag was consumed
    for param in optimizer._amp_stash.all_fp32_from_fp16_params:  # the caller drops the skipped grads, as BERT does
        param.grad = None
    backward(amp, model, optimizer, delay_overflow_check=True)
    masters = [p.grad for p in amp.master_params(optimizer)]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in masters)
    assert scaler.update_scale() is False and scaler._unskipped == 1
    optimizer.step()


def test_a_callers_overflow_buf_decides_update_scale_and_persists_on_the_scaler_view():
    amp, state, model, optimizer = o2_setup()
    flag = torch.zeros(1, dtype=torch.int)
    state.loss_scalers[0]._overflow_buf = flag
    assert state.loss_scalers[0]._overflow_buf is flag  # the same view object each time, as apex's scalers
    backward(amp, model, optimizer, delay_overflow_check=True)
    flag.fill_(1)
    assert state.loss_scalers[0].update_scale() is True
    flag.zero_()
    assert state.loss_scalers[0].update_scale() is False
    state.loss_scalers[0].clear_overflow_state()
    with pytest.raises(ConfigError, match="one-element tensor"):
        state.loss_scalers[0]._overflow_buf = [0]


def test_scale_seq_len_and_loss_scale_written_by_gnmt_drive_growth():
    amp, state, model, optimizer = o2_setup()
    state.loss_scalers[0]._loss_scale = 8192.0
    state.loss_scalers[0]._scale_seq_len = 2
    scales = []
    for _ in range(4):
        backward(amp, model, optimizer)
        optimizer.step()
        scales.append(state.loss_scalers[0].loss_scale())
    assert scales == [8192.0, 16384.0, 16384.0, 32768.0]
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="_scale_seq_len"):
            state.loss_scalers[0]._scale_seq_len = bad


def test_a_static_scale_never_skips_through_update_scale():
    state = o2_setup(loss_scale=128.0)[1]
    flag = torch.ones(1, dtype=torch.int)
    state.loss_scalers[0]._overflow_buf = flag
    assert state.loss_scalers[0].update_scale() is False
    assert state.loss_scalers[0].loss_scale() == 128.0


def test_apex_c_flatten_and_unflatten_share_memory_and_refuse_mismatches():
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1)]
    flat = apex_C.flatten(tensors)
    assert flat.shape == (11,) and torch.equal(flat[:6], tensors[0].reshape(-1))
    views = apex_C.unflatten(flat, tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    assert all(torch.equal(v, t) for v, t in zip(views, tensors))
    views[1].fill_(7.0)
    assert torch.all(flat[6:10] == 7.0)
    with pytest.raises(ValueError, match="one dtype and device"):
        apex_C.flatten([torch.randn(2), torch.randn(2, dtype=torch.float16)])
    with pytest.raises(ValueError, match="1-D with 11 elements"):
        apex_C.unflatten(torch.zeros(10), tensors)
    with pytest.raises(AttributeError):
        apex_C.bogus  # noqa: B018


def test_overflow_buf_is_always_a_flag_and_a_script_can_swap_its_own_in_and_back():
    amp, state, model, optimizer = o2_setup()
    scaler = state.loss_scalers[0]
    own = scaler._overflow_buf
    assert isinstance(own, torch.Tensor) and own.numel() == 1 and int(own) == 0
    mine = torch.ones(1, dtype=torch.int)
    scaler._overflow_buf = mine
    assert scaler.update_scale() is True  # the script's flag decides
    scaler._overflow_buf = own  # put back, as a careful script does
    backward(amp, model, optimizer, factor=float("inf"), delay_overflow_check=True)
    assert scaler.update_scale() is True  # with apex's own flag back, the deferred check decides again


def test_a_normal_scale_loss_clears_flags_left_by_a_delayed_check():
    amp, state, model, optimizer = o2_setup()
    backward(amp, model, optimizer, factor=float("inf"), delay_overflow_check=True)
    for param in optimizer._amp_stash.all_fp32_from_fp16_params:
        param.grad = None
    backward(amp, model, optimizer)  # no update_scale in between: this check covers the new grads
    optimizer.step()
    assert state.loss_scalers[0].update_scale() is False


def test_scaler_views_are_freed_with_their_set_up():
    import gc
    import weakref

    amp, state, model, optimizer = o2_setup()
    scaler = amp.engine.scalers[0]
    assert state.loss_scalers[0] is state.loss_scalers[0]
    alive = weakref.ref(scaler)
    del amp, state, model, optimizer, scaler
    gc.collect()
    assert alive() is None
