"""channels_last, cuDNN benchmark and TF32: applied to the run, scoped to its training, logged."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from ampddp.errors import ConfigError
from ampddp.trainer import Trainer
from ampddp.training import Callback
from ampddp.training.device import DeviceSettings


def conv_net() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4)]
    return nn.Sequential(*layers)


def images() -> TensorDataset:
    generator = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(32, 3, 8, 8, generator=generator), torch.randint(0, 4, (32,), generator=generator))


def flags() -> tuple:
    """cuDNN benchmark and the TF32 settings, read through torch's fp32_precision API (reading the legacy
    allow_tf32 flags after the new API was used raises)."""
    return torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision


class FlagsSeen(Callback):
    def __init__(self) -> None:
        self.flags: list[tuple] = []

    def on_step(self, progress, record):
        self.flags.append(flags())


def train(device: DeviceSettings, callbacks=()) -> Trainer:
    trainer = Trainer(conv_net(), lambda p: torch.optim.SGD(p, lr=0.1), images(), precision="O4", batch_size=8, max_steps=4,
                      shuffle=False, device=device, callbacks=callbacks, log_every=1)  # fmt: skip
    inputs = []
    trainer.run.module[0].register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    trainer.fit()
    trainer.seen_inputs = inputs
    return trainer


def test_channels_last_converts_the_model_and_the_image_batches_and_trains_like_contiguous():
    fast = train(DeviceSettings(channels_last=True))
    plain = train(DeviceSettings())
    weight = fast.run.module[0].weight
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    assert all(x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() for x in fast.seen_inputs)
    assert all(x.is_contiguous() for x in plain.seen_inputs)
    for a, b in zip(fast.run.module.parameters(), plain.run.module.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def test_backend_flags_hold_while_training_and_are_restored_after(caplog):
    before = flags()
    seen = FlagsSeen()
    with caplog.at_level(logging.INFO, logger="ampddp"):
        train(DeviceSettings(cudnn_benchmark=True, allow_tf32=True), callbacks=[seen])
    assert seen.flags and all(during == (True, "tf32", "tf32") for during in seen.flags)
    assert flags() == before
    seen_off = FlagsSeen()
    train(DeviceSettings(allow_tf32=False), callbacks=[seen_off])
    assert all(during == (False, "ieee", "ieee") for during in seen_off.flags) and flags() == before
    said = [record.getMessage() for record in caplog.records if record.getMessage().startswith("device ")]
    assert said and said[0].startswith("device cpu: ") and "cudnn" not in said[0], said  # CUDA's settings only on CUDA


def test_the_device_line_names_the_gpu_and_its_settings(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    line = DeviceSettings(cudnn_benchmark=True, channels_last=True).describe(torch.device("cuda:0"))
    assert line == "cuda:0 (NVIDIA H100 80GB HBM3), channels_last, cudnn_benchmark on, TF32 torch's default"
    assert DeviceSettings(allow_tf32=False).describe(torch.device("cuda:1")).endswith("cudnn_benchmark off, TF32 off")


def test_allow_tf32_null_keeps_torch_defaults():
    seen = FlagsSeen()
    before = flags()
    train(DeviceSettings(), callbacks=[seen])
    assert seen.flags and all(during == before for during in seen.flags)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"channels_last": "yes"}, "trainer.channels_last='yes' is not valid; it must be true or false"),
        ({"cudnn_benchmark": 1}, "trainer.cudnn_benchmark=1 is not valid"),
        ({"allow_tf32": "on"}, "trainer.allow_tf32='on' is not valid; it must be true, false or null"),
    ],
)
def test_bad_device_settings_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        DeviceSettings(**settings)
