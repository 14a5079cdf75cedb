"""A mode slower than fp32 on this device says so once, decided by torch's capability queries: bf16 on
a CPU without bf16 instructions (emulated, 3-4x slower), fp16 convolutions on CPU (~60x slower), fp8
without fp8 matmul hardware (emulated)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ampddp.distributed.env import DistEnv
from ampddp.precision import hardware
from ampddp.precision.choice import Precision
from ampddp.training.assemble import RunSetup

CPU = torch.device("cpu")


@pytest.mark.parametrize("has_bf16", [True, False])
def test_bf16_is_slower_than_fp32_exactly_on_cpus_without_bf16_instructions(monkeypatch, has_bf16):
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: has_bf16)
    reason = hardware.slower_than_fp32(CPU, torch.bfloat16, has_convolutions=False)
    assert (reason is None) == has_bf16
    if reason is not None:
        assert "bf16 emulated) runs bf16 about 3-4x slower than fp32" in reason and torch.backends.cpu.get_cpu_capability() in reason
    assert hardware.slower_than_fp32(CPU, None, has_convolutions=True) is None  # fp32 is never slower than itself
    assert hardware.slower_than_fp32(torch.device("cuda"), torch.bfloat16, has_convolutions=True) is None


def test_fp16_is_slower_than_fp32_on_cpu_only_with_convolutions():
    assert "60x slower" in hardware.slower_than_fp32(CPU, torch.float16, has_convolutions=True)
    assert hardware.slower_than_fp32(CPU, torch.float16, has_convolutions=False) is None


def test_fp8_is_slower_without_fp8_matmul_hardware(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: True)
    reason = hardware.slower_than_fp32(CPU, torch.bfloat16, False, runs_fp8=True)
    assert "has no fp8 matmul hardware: its fp8 matmuls run emulated" in reason
    assert hardware.slower_than_fp32(CPU, torch.bfloat16, False, runs_fp8=False) is None


def test_this_machines_answer_comes_from_torchs_queries():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    expected = native and torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))
    if hardware.platform.machine().lower() not in ("aarch64", "arm64"):
        assert hardware.cpu_has_bf16() == expected


@pytest.mark.parametrize(
    "has_bf16, mode, warned", [(False, "O5", True), (False, "native-bf16", True), (True, "O5", False), (False, "O0", False)]
)
def test_a_run_set_up_in_a_slow_mode_warns_once_naming_the_faster_choice(monkeypatch, caplog, has_bf16, mode, warned):
    monkeypatch.setattr(hardware, "cpu_has_bf16", lambda: has_bf16)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with caplog.at_level(logging.WARNING, logger="ampddp.precision"):
        RunSetup(Precision(mode)).build(model, lambda params: torch.optim.SGD(params, lr=0.1), DistEnv())
    lines = [record.getMessage() for record in caplog.records if "slower than fp32" in record.getMessage()]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert lines[0].startswith(f"precision {mode} on cpu is slower than fp32 here") and "O0 (fp32)" in lines[0]


def test_a_cuda_build_on_a_machine_without_an_nvidia_gpu_is_noted_with_the_disk_it_takes():
    from ampddp.precision.hardware import CPU_WHEEL_INDEX, cuda_build_note

    note = cuda_build_note("13.0", gpu_present=False, cuda_bytes=int(4.5 * 2**30))
    assert "is a CUDA 13.0 build and this machine has no NVIDIA GPU: its CUDA parts take 4.5 GB here" in note
    assert f"pip install torch torchvision --index-url {CPU_WHEEL_INDEX}" in note
    assert cuda_build_note(None, gpu_present=False, cuda_bytes=0) is None  # a CPU build
    assert cuda_build_note("13.0", gpu_present=True, cuda_bytes=1) is None  # a GPU machine (whatever torch sees of it)


@pytest.mark.skipif(torch.version.cuda is None, reason="this torch is a CPU build: nothing to note")
def test_prepare_on_this_cpu_only_machine_says_the_note_once(caplog):
    from ampddp import prepare
    from ampddp.distributed.env import detect_env
    from ampddp.precision.hardware import nvidia_gpu_present

    if nvidia_gpu_present():
        pytest.skip("this machine has an NVIDIA GPU")
    with caplog.at_level(logging.INFO, logger="ampddp"):
        prepare(torch.nn.Linear(4, 2), lambda p: torch.optim.SGD(p, lr=0.1), detect_env({}, device="cpu"), precision="O0")
    notes = [r.getMessage() for r in caplog.records if "CUDA" in r.getMessage() and "CPU-only wheel" in r.getMessage()]
    assert len(notes) == 1 and f"torch {torch.__version__} is a CUDA {torch.version.cuda} build" in notes[0], notes
