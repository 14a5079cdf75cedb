"""What a device computes at full speed, from torch's own capability queries (never timed at start-up).

Mixed precision exists to be faster; on some devices a low-precision dtype is slower than fp32: bf16
on a CPU without bf16 instructions runs emulated (a linear layer's step ~4x slower than fp32 on an
AVX2-only EPYC), and fp16 convolution backward on CPU is ~60x slower than fp32 in current PyTorch.
:func:`slower_than_fp32` names such a case so a run can say so once, with the faster choice.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def _arm_cpu_features() -> set[str]:
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return set()
    return {flag for line in lines if line.lower().startswith("features") for flag in line.split(":", 1)[1].split()}


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware: AVX512_BF16 or AMX on x86 (torch's queries) with ATen
    running its AVX-512 kernels (``ATEN_CPU_CAPABILITY=avx2`` turns them off, as an AVX2-only CPU has
    none), the BF16 extension on ARM (its /proc/cpuinfo feature: torch has no query for it)."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in _arm_cpu_features()
    wide_kernels = torch.backends.cpu.get_cpu_capability().startswith(("AVX512", "AMX"))
    return wide_kernels and bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def cpu_description() -> str:
    """The CPU as its precision sees it: ATen's capability and whether bf16 is native."""
    return f"{torch.backends.cpu.get_cpu_capability()}, bf16 {'native' if cpu_has_bf16() else 'emulated'}"


def slower_than_fp32(device: torch.device, compute_dtype: torch.dtype | None, has_convolutions: bool) -> str | None:
    """Why ``compute_dtype`` on ``device`` is slower than fp32 (one clause), or None when it is not."""
    if device.type != "cpu" or compute_dtype is None:
        return None
    if compute_dtype == torch.bfloat16 and not cpu_has_bf16():
        return f"this CPU ({cpu_description()}) runs bf16 about 3-4x slower than fp32"
    if compute_dtype == torch.float16 and has_convolutions:
        return "fp16 convolution backward is about 60x slower than fp32 on CPU in current PyTorch"
    return None
