"""``precision: auto``, the default everywhere: the fastest numerically safe mode of the device, said
in one line; decided by torch's capability queries; an explicit mode is always obeyed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from ampddp import ConfigError
from ampddp.distributed.env import DistEnv
from ampddp.precision import auto, hardware
from ampddp.precision.choice import Precision
from ampddp.precision.registry import FP32, OpRegistry
from ampddp.prepare import prepare
from ampddp.recipe.checks import validate
from ampddp.recipe.factories import precision_from
from ampddp.recipe.reading import load_config

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.mark.parametrize("has_bf16, mode", [(True, "native-bf16"), (False, "O0")])
def test_on_cpu_auto_is_bf16_exactly_where_the_cpu_has_bf16_instructions(monkeypatch, has_bf16, mode):
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: has_bf16)
    monkeypatch.setattr(auto, "cpu_has_bf16", lambda: has_bf16)
    picked, why = auto.auto_mode(CPU)
    assert picked == mode and torch.backends.cpu.get_cpu_capability() in why
    assert ("bf16 emulated) would run bf16 about 3-4x slower than fp32" in why) == (not has_bf16)
    assert Precision().resolved(CPU).mode == mode == Precision("auto").resolved(CPU).mode


@pytest.mark.parametrize(
    "capability, bf16, mode", [((9, 0), True, "native-bf16"), ((8, 0), True, "native-bf16"), ((7, 0), False, "native-fp16")]
)
def test_on_cuda_auto_is_bf16_from_compute_capability_8_and_fp16_below(monkeypatch, capability, bf16, mode):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    picked, why = auto.auto_mode(torch.device("cuda", 0))
    assert picked == mode and f"compute capability {capability[0]}.{capability[1]}" in why


def test_other_devices_get_fp32_and_explicit_modes_are_obeyed():
    assert auto.auto_mode(torch.device("mps"))[0] == "O0"
    for mode in ("O1", "O5", "native-fp16"):
        chosen = Precision(mode)
        assert chosen.resolved(CPU) is chosen


def test_auto_takes_no_settings_of_one_mode_and_builds_no_engine_unresolved():
    registry = OpRegistry()
    registry.register(torch, "sigmoid", FP32)
    for kwargs, named in [({"overrides": {"loss_scale": 128.0}}, "loss_scale=128.0"), ({"registry": registry}, "registered functions"),
                          ({"fp32_islands": False}, "fp32_islands=False"), ({"impl": "apex"}, "impl=apex")]:  # fmt: skip
        with pytest.raises(ConfigError, match=rf"precision mode auto picks a mode per device and takes no mode settings; got {named}"):
            Precision("auto", **kwargs)
    with pytest.raises(ConfigError, match=r"precision mode auto is decided per device: build the engine of precision.resolved"):
        Precision().build_engine()
    with pytest.raises(ConfigError, match=r"valid choices: auto, O0"):
        Precision("fastest")


def test_prepare_says_once_what_auto_picked_and_builds_that_mode(caplog):
    with caplog.at_level(logging.INFO, logger="ampddp.precision"):
        run = prepare(nn.Linear(4, 2), lambda params: torch.optim.SGD(params, lr=0.1), DistEnv())
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("precision auto ->")]
    mode = auto.auto_mode(CPU)[0]
    assert lines == [f"precision auto -> {mode} on cpu: {auto.auto_mode(CPU)[1]}"]
    assert run.engine.mode == mode and run.engine.precision_state().mode == mode  # checkpoints record the concrete mode


def test_a_recipe_defaults_to_auto_and_refuses_mode_settings_without_a_mode(tmp_path):
    config = load_config(None, [f"trainer.run_dir={tmp_path}"])
    assert config.precision.mode == "auto" and precision_from(config).mode == "auto"
    for key in ("precision.loss_scale=128", "precision.float_functions=[torch.sigmoid]", "precision.keep_batchnorm_fp32=true"):
        with pytest.raises(ConfigError, match=rf"precision.mode is auto \(the default\).*{key.split('=')[0]}.*set precision.mode"):
            precision_from(load_config(None, [key]))
    built = validate(load_config(ROOT / "recipes" / "quickstart.yaml", [f"trainer.run_dir={tmp_path / 'run'}", "distributed.device=cpu"]))
    assert built.model is not None
