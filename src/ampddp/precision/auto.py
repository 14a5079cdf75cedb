"""``precision: auto``: the fastest numerically safe mode of the device a run lands on, and why.

Mixed precision is worth it only where the device computes the low dtype natively. bf16 needs no
loss scaling and keeps fp32's range, so it is the first choice wherever it is native: CUDA GPUs of
compute capability 8.0+ (A100, H100, ...), ROCm GPUs that report bf16, CPUs with AVX512_BF16 or AMX
(or ARM's BF16). There ``auto`` is ``native-bf16`` rather than O5: torch's autocast keeps the weights,
gradients and optimizer in fp32 (no master copy, no model whose dtype changed under the user's code)
and works with DDP, FSDP2 and torch.compile as they are. GPUs before 8.0 (V100, T4) compute fp16
natively and bf16 not: ``native-fp16`` with a dynamic loss scale. Elsewhere fp32 (``O0``): a CPU
without bf16 instructions emulates bf16 3-4x slower than fp32, and fp16 convolutions on CPU are ~60x
slower. Decided by torch's capability queries, never by timing.

A resumed ``auto`` run keeps the mode its checkpoint trained in (``ampddp.training.resume.kept_precision``),
unless this device cannot run it.
"""

from __future__ import annotations

import torch

from ampddp.precision.hardware import cpu_description, gpu_description, native_bf16
from ampddp.precision.modes import FP32_MODE, MODES, native_mode


def auto_mode(device: torch.device) -> tuple[str, str]:
    """The mode ``auto`` picks on ``device`` for a new run, and the reason, one clause."""
    bf16, fp16, fp32 = native_mode(torch.bfloat16).name, native_mode(torch.float16).name, FP32_MODE.name
    if device.type == "cuda":
        if native_bf16(device):
            return bf16, f"{gpu_description(device)} computes bf16 natively"
        return fp16, f"{gpu_description(device)} has no native bf16 (that needs 8.0+): fp16 with a dynamic loss scale"
    if device.type == "cpu":
        if native_bf16(device):
            return bf16, f"this CPU ({cpu_description()}) computes bf16 natively"
        return fp32, f"this CPU ({cpu_description()}) would run bf16 about 3-4x slower than fp32"
    if device.type == "xpu":
        return bf16, "Intel GPUs compute bf16 natively"
    return fp32, f"ampddp knows no low-precision mode that is faster than fp32 on {device.type}"


def auto_choice(device: torch.device, resumed_mode: str | None = None) -> tuple[str, str]:
    """The mode ``auto`` runs on ``device`` and the one line that says so and why: the mode of the
    checkpoint a run resumes (``resumed_mode``) where the device can run it, else :func:`auto_mode`'s pick."""
    picked, why = auto_mode(device)
    if resumed_mode is None or resumed_mode == picked:
        return picked, f"precision auto -> {picked} on {device}: {why}"
    if MODES[resumed_mode].unsupported(device) is None:
        return resumed_mode, (f"precision auto -> {resumed_mode} on {device}: kept from the checkpoint this run resumes "
                              f"(a new run here would get {picked}: {why})")  # fmt: skip
    return picked, (f"precision auto -> {picked} on {device}: {why}; the checkpoint this run resumes trained in {resumed_mode}, "
                    "which this device cannot run: its state converts as for any change of mode")  # fmt: skip
