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
"""

from __future__ import annotations

import torch

from ampddp.precision.hardware import cpu_description, cpu_has_bf16


def auto_mode(device: torch.device) -> tuple[str, str]:
    """The mode ``auto`` picks on ``device`` and the reason, one clause."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{name} (compute capability {major}.{minor})"
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return "native-bf16", f"{where} computes bf16 natively"
        return "native-fp16", f"{where} has no native bf16 (that needs 8.0+): fp16 with a dynamic loss scale"
    if device.type == "cpu":
        if cpu_has_bf16():
            return "native-bf16", f"this CPU ({cpu_description()}) computes bf16 natively"
        return "O0", f"this CPU ({cpu_description()}) would run bf16 about 3-4x slower than fp32"
    if device.type == "xpu":
        return "native-bf16", "Intel GPUs compute bf16 natively"
    return "O0", f"ampddp knows no low-precision mode that is faster than fp32 on {device.type}"


def auto_choice_line(device: torch.device) -> str:
    """What ``auto`` picked on ``device`` and why, as the run says it once."""
    mode, why = auto_mode(device)
    return f"precision auto -> {mode} on {device}: {why}"
