"""``precision: auto``, the default everywhere: the fastest numerically safe mode of the device, said
in one line; decided by torch's capability queries; an explicit mode is always obeyed."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from ampddp import ConfigError
from ampddp.distributed.env import DistEnv
from ampddp.precision import auto, hardware
from ampddp.precision.casting.registry import FP32, OpRegistry
from ampddp.precision.choice import Precision
from ampddp.prepare import prepare
from ampddp.recipe.build import build_run
from ampddp.recipe.checks import check_recipe
from ampddp.recipe.factories import precision_from
from ampddp.recipe.reading import load_config

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.mark.parametrize("has_bf16, mode", [(True, "native-bf16"), (False, "O0")])
def test_on_cpu_auto_is_bf16_exactly_where_the_cpu_has_bf16_instructions(monkeypatch, has_bf16, mode):
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: has_bf16)
    picked, why = auto.auto_mode(CPU)
    assert picked == mode and torch.backends.cpu.get_cpu_capability() in why
    assert ("bf16 emulated) would run bf16 about 3-4x slower than fp32" in why) == (not has_bf16)
    assert Precision().resolved(CPU).mode == mode == Precision("auto").resolved(CPU).mode


@pytest.mark.parametrize(
    "capability, bf16, mode", [((9, 0), True, "native-bf16"), ((8, 0), True, "native-bf16"), ((7, 0), False, "native-fp16")]
)
def test_on_cuda_auto_is_bf16_from_compute_capability_8_and_fp16_below(monkeypatch, capability, bf16, mode):
    a_gpu(monkeypatch, capability, bf16)
    picked, why = auto.auto_mode(torch.device("cuda", 0))
    assert picked == mode and f"compute capability {capability[0]}.{capability[1]}" in why


def a_gpu(monkeypatch, capability: tuple[int, int], bf16: bool, name: str = "a GPU") -> None:
    """torch's CUDA queries answering as a GPU of ``capability`` would (no GPU needed)."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)


@pytest.mark.parametrize(
    "capability, bf16, mode, refused, works",
    [((7, 0), False, "O5", "computes in bf16, which Tesla V100 (compute capability 7.0) does not compute natively",
      "use native-fp16, O1 or O2"),
     ((7, 5), False, "native-bf16", "computes in bf16, which Tesla V100 (compute capability 7.5)", "use native-fp16"),
     ((8, 0), True, "O6", "runs fp8 matmuls, which Tesla V100 (compute capability 8.0) lacks (NVIDIA compute capability 8.9+",
      "use native-bf16, O4 or O5 (bf16), or auto"),
     ((7, 0), False, "O6", "runs fp8 matmuls", "use native-fp16, O1 or O2")],
)  # fmt: skip
def test_a_mode_the_gpu_cannot_run_is_refused_naming_the_device_and_what_works(monkeypatch, capability, bf16, mode, refused, works):
    a_gpu(monkeypatch, capability, bf16, name="Tesla V100")
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=re.escape(refused)) as error:
        Precision(mode).resolved(gpu)
    assert works in str(error.value)
    for runs in ("O0", "O1", "O2", "O3", "native-fp16"):
        assert Precision(runs).resolved(gpu).mode == runs
    assert Precision("O6").resolved(torch.device("cpu")).mode == "O6", "a CPU runs every mode (emulated ones say so)"


def test_resumed_auto_keeps_the_checkpoints_mode_where_the_device_runs_it(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: False)
    mode, line = auto.auto_choice(CPU, "native-bf16")
    assert mode == "native-bf16" == Precision().continuing("native-bf16").resolved(CPU).mode
    assert line.startswith("precision auto -> native-bf16 on cpu: kept from the checkpoint this run resumes (a new run here would get O0")
    assert auto.auto_choice(CPU, "O0") == auto.auto_choice(CPU) == ("O0", f"precision auto -> O0 on cpu: {auto.auto_mode(CPU)[1]}")
    a_gpu(monkeypatch, (7, 0), False)
    mode, line = auto.auto_choice(torch.device("cuda", 0), "native-bf16")
    assert mode == "native-fp16" and "the checkpoint this run resumes trained in native-bf16, which this device cannot run" in line
    assert Precision("O1").continuing("O5") == Precision("O1"), "a named mode is always obeyed"
    with pytest.raises(ConfigError, match=r"resumed_mode='O9' with mode auto is not valid.*O0, O1"):
        Precision(resumed_mode="O9")


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
    quickstart = load_config(ROOT / "recipes" / "quickstart.yaml", [f"trainer.run_dir={tmp_path / 'run'}", "distributed.device=cpu"])
    check_recipe(quickstart)
    assert build_run(quickstart, DistEnv()).engine.mode == auto.auto_mode(CPU)[0]


def test_an_auto_run_resumed_where_auto_picks_otherwise_keeps_its_checkpoints_mode(monkeypatch, tmp_path, caplog):
    from resume_helpers import NoisyDigits, make_model

    from ampddp.checkpoint.manifest import read_manifest
    from ampddp.checkpoint.store import CheckpointStore
    from ampddp.trainer import Trainer
    from ampddp.training import CheckpointSettings

    def train(max_steps: int) -> Trainer:
        trainer = Trainer(make_model(), lambda params: torch.optim.SGD(params, lr=0.05), NoisyDigits(), batch_size=4, max_steps=max_steps,
                          checkpoints=CheckpointSettings(tmp_path), report=None)  # fmt: skip
        trainer.fit()
        return trainer

    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: True)  # started on a CPU with bf16 instructions
    assert train(2).engine.mode == "native-bf16"
    assert read_manifest(CheckpointStore(tmp_path).latest().path).run["precision_mode"] == "native-bf16"
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: False)  # resumed on an AVX2-only one
    with caplog.at_level(logging.INFO, logger="ampddp"):
        resumed = train(4)
    assert resumed.engine.mode == "native-bf16" and resumed.progress.global_step == 4
    assert any(r.getMessage().startswith("precision auto -> native-bf16 on cpu: kept from the checkpoint") for r in caplog.records)
    assert any("slower than fp32 here" in r.getMessage() for r in caplog.records), "the kept mode is slow here, and says so"
    fresh = Trainer(make_model(), lambda params: torch.optim.SGD(params, lr=0.05), NoisyDigits(), batch_size=4, max_steps=1,
                    checkpoints=CheckpointSettings(tmp_path / "new"), report=None)  # fmt: skip
    assert fresh.engine.mode == "O0", "a new run on this CPU gets auto's own pick"
