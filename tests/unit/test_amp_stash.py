"""apex's attribute-level contract: ``optimizer._amp_stash`` and repeated ``initialize`` calls.

apex-era libraries ask "is amp already set up?" with ``hasattr(optimizer, "_amp_stash")`` (mmengine's
ApexOptimWrapper calls ``initialize`` on every iteration until it appears) and read the stash's
parameter lists to name or restore master weights. A repeat of the same ``initialize`` on the same
objects is a no-op, as mmengine relies on; the same optimizer with other settings is refused as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import make_batches, make_mlp

from ampddp import AmpUsageError
from ampddp.amp import Amp

LEVELS = ("O0", "O1", "O2", "O3", "O4", "O5")


def sgd(params, lr=0.05):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def train(level, initialize_each_step):
    """mmengine's loop: ``initialize`` inside the step, guarded by ``_amp_stash`` or (worse) not at all."""
    amp = Amp()
    model = make_mlp(seed=1, batchnorm=True)
    optimizer = sgd(model.parameters())
    for x, y in make_batches(3, batch=16, seed=2):
        if initialize_each_step or not hasattr(optimizer, "_amp_stash"):
            amp.initialize(model, optimizer, opt_level=level, verbosity=0, loss_scale=64.0)
        optimizer.zero_grad()
        with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], len(amp.setups)


@pytest.mark.parametrize("level", LEVELS)
def test_the_stash_guard_and_a_repeated_initialize_train_exactly_as_one_initialize(level):
    guarded, setups = train(level, initialize_each_step=False)
    repeated, repeated_setups = train(level, initialize_each_step=True)
    assert setups == repeated_setups == 1
    assert all(torch.equal(a, b) for a, b in zip(guarded, repeated))
    assert not all(torch.equal(a, b) for a, b in zip(guarded, [p.detach() for p in make_mlp(seed=1).parameters()]))


def test_the_same_objects_with_other_settings_are_refused_as_before():
    amp = Amp()
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model.parameters())
    amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    with pytest.raises(AmpUsageError, match=r"optimizers\[0\] was already passed to amp.initialize"):
        amp.initialize(model, optimizer, opt_level="O1", verbosity=0, loss_scale=128.0)
    assert len(amp.setups) == 1


def test_the_o2_stash_lists_model_params_masters_and_fp32_params_per_group():
    amp = Amp()
    model = make_mlp(batchnorm=True)
    linear = [p for n, p in model.named_parameters() if not n.startswith("1.")]
    norm = [p for n, p in model.named_parameters() if n.startswith("1.")]
    optimizer = sgd([{"params": linear}, {"params": norm, "lr": 0.01}])
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    stash = optimizer._amp_stash
    low = [p for p in model.parameters() if p.dtype == torch.float16]
    fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
    assert low and fp32  # BatchNorm stays fp32 at O2
    assert [id(p) for p in stash.all_fp16_params] == [id(p) for p in low]
    masters = [p for p in amp.master_params(optimizer) if p.dtype == torch.float32 and not any(p is q for q in fp32)]
    assert [id(p) for p in stash.all_fp32_from_fp16_params] == [id(p) for p in masters]
    assert [id(p) for p in stash.all_fp32_from_fp32_params] == [id(p) for p in fp32]
    assert [len(g) for g in stash.fp16_groups] == [len(low), 0]
    assert [len(g) for g in stash.fp32_from_fp32_groups] == [0, len(fp32)]
    for param, master in zip(stash.all_fp16_params, stash.all_fp32_from_fp16_params):
        assert torch.equal(param, master.half())
    assert stash.lazy_init_called
    optimizer._amp_lazy_init()
    optimizer._lazy_init_maybe_master_weights()  # Hugging Face's old resume path calls these before load_state_dict


def test_without_masters_the_stash_splits_params_by_dtype():
    amp = Amp()
    model = make_mlp(batchnorm=False)
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level="O3", verbosity=0)
    assert len(optimizer._amp_stash.all_fp16_params) == len(list(model.parameters()))
    assert optimizer._amp_stash.all_fp32_from_fp16_params == []
    amp_o1 = Amp()
    model = make_mlp(batchnorm=False)
    model, optimizer = amp_o1.initialize(model, sgd(model.parameters()), opt_level="O1", verbosity=0)
    assert [id(p) for p in optimizer._amp_stash.all_fp32_params] == [id(p) for p in model.parameters()]


def test_the_stash_says_when_the_next_step_will_be_skipped_and_when_grads_are_scaled():
    amp = Amp()
    model = make_mlp(batchnorm=False)
    model, optimizer = amp.initialize(model, sgd(model.parameters()), opt_level="O2", verbosity=0)
    x, y = make_batches(1)[0]
    with amp.scale_loss(F.cross_entropy(model(x), y) * float("inf"), optimizer) as scaled:
        scaled.backward()
    assert optimizer._amp_stash.already_patched
    optimizer.step()
    assert not optimizer._amp_stash.already_patched
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer, delay_unscale=True) as scaled:
        scaled.backward()
    assert optimizer._amp_stash.params_have_scaled_gradients


def test_disabled_amp_leaves_no_stash_as_apex_and_a_new_set_up_removes_the_old_one():
    amp = Amp()
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model.parameters())
    amp.initialize(model, optimizer, enabled=False)
    amp.initialize(model, optimizer, enabled=False)  # mmengine's repeat: a no-op, not an error
    assert not hasattr(optimizer, "_amp_stash")
    model = make_mlp(batchnorm=False)
    first = sgd(model.parameters())
    amp.initialize(model, first, opt_level="O1", verbosity=0)
    assert hasattr(first, "_amp_stash")
    second = sgd(model.parameters())
    amp.initialize(model, second, opt_level="O1", verbosity=0)  # the model again: the first set-up is torn down
    assert not hasattr(first, "_amp_stash") and not hasattr(first, "_amp_lazy_init")
    assert hasattr(second, "_amp_stash")


def test_a_repeated_initialize_returns_the_shapes_the_first_one_did():
    amp = Amp()
    model = make_mlp(batchnorm=False)
    optimizer = sgd(model.parameters())
    first = amp.initialize((model,), (optimizer,), opt_level="O1", verbosity=0)
    again = amp.initialize((model,), (optimizer,), opt_level="O1", verbosity=0)
    assert type(first[0]) is type(again[0]) is list and type(first[1]) is type(again[1]) is list
    assert again[0][0] is model and again[1][0] is optimizer
    assert amp.initialize(model, optimizer, opt_level="O1", verbosity=0) == (model, optimizer)
