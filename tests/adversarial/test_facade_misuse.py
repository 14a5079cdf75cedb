"""Misuse of the apex facade and the engine fails at the call, in one line that says what was wrong:
an optimizer over another model's parameters, a loss that is not a tensor, and a loss scale loaded
into an opt level that does not scale the loss (dropped with a warning, as a resumed checkpoint's is)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampddp import amp
from ampddp.errors import AmpUsageError
from ampddp.precision import build_engine


def fresh_amp():
    return amp.Amp()


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O5"])
def test_an_optimizer_over_none_of_the_models_parameters_is_refused(opt_level):
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(AmpUsageError, match=r"optimizers\[0\] steps none of the models' parameters \(2 parameter"):
        fresh_amp().initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    assert model.weight.dtype == torch.float32  # refused before anything changed


def test_an_optimizer_over_some_of_the_models_parameters_and_a_second_module_is_accepted():
    model, head = nn.Linear(4, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
    fresh_amp().initialize(model, optimizer, opt_level="O2", verbosity=0)


@pytest.mark.parametrize("loss", [1.5, None, [torch.tensor(1.0)]], ids=["float", "None", "list"])
@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])
def test_scale_loss_of_something_other_than_a_tensor_says_what_it_got(loss, opt_level):
    facade = fresh_amp()
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = facade.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    refused = pytest.raises(AmpUsageError, match=rf"amp.scale_loss needs the loss as a torch.Tensor .*got {type(loss).__name__}")
    with refused, facade.scale_loss(loss, optimizer):
        pass


@pytest.mark.parametrize("mode", ["O1", "native-bf16"])
def test_engine_backward_of_a_number_says_what_it_got(mode):
    engine = build_engine(mode)
    model = nn.Linear(4, 2)
    engine.setup([model], [torch.optim.SGD(model.parameters(), lr=0.1)])
    with pytest.raises(AmpUsageError, match=r"engine.backward needs the loss as a torch.Tensor .*got float 0.5"):
        engine.backward(0.5)


def test_a_scaled_state_loaded_into_an_unscaled_opt_level_is_dropped_with_a_warning():
    facade = fresh_amp()
    model = nn.Linear(4, 2)
    model, optimizer = facade.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O0", verbosity=0)
    with pytest.warns(UserWarning, match=r"dropping loss scale 65536 of the loaded state: O0 does not scale the loss"):
        facade.load_state_dict({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 7}})
    loss = F.mse_loss(model(torch.ones(3, 4)), torch.zeros(3, 2))
    with facade.scale_loss(loss, optimizer) as scaled:
        assert scaled.item() == pytest.approx(loss.item())  # still unscaled
        scaled.backward()
    assert facade.state_dict()["loss_scaler0"]["loss_scale"] == 1.0


def test_an_unscaled_state_loads_into_an_unscaled_opt_level_silently():
    facade = fresh_amp()
    model = nn.Linear(4, 2)
    facade.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O0", verbosity=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        facade.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 3}})
    assert facade.state_dict()["loss_scaler0"]["unskipped"] == 3
