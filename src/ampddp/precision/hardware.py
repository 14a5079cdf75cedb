"""What a device computes at full speed, from torch's own capability queries (never timed at start-up).

Mixed precision exists to be faster; on some devices a low-precision dtype is slower than fp32: bf16
on a CPU without bf16 instructions runs emulated (a linear layer's step ~4x slower than fp32 on an
AVX2-only EPYC), fp16 convolution backward on CPU is ~60x slower than fp32 in current PyTorch, and
fp8 without fp8 matmul hardware is emulated. :func:`slower_than_fp32` names such a case so a run can
say so once, with the faster choice. On a GPU a mode it cannot compute at all (bf16 before compute
capability 8.0, fp8 before 8.9) is refused where a run's precision is chosen: :func:`unsupported`.
"""

from __future__ import annotations

import contextlib
import functools
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


def gpu_description(device: torch.device) -> str:
    """A GPU as its precision sees it: its name and compute capability (ROCm: its architecture)."""
    if torch.version.hip:
        return f"{torch.cuda.get_device_name(device)} ({torch.cuda.get_device_properties(device).gcnArchName})"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def device_description(device: torch.device) -> str:
    """A device as its precision sees it: "this CPU (AVX2, bf16 emulated)", "NVIDIA A100 (compute capability 8.0)"."""
    if device.type == "cpu":
        return f"this CPU ({cpu_description()})"
    return gpu_description(device) if device.type == "cuda" else device.type


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 in hardware: CUDA 8.0+ (or a ROCm GPU that says so), a CPU
    with bf16 instructions, an Intel GPU."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return cpu_has_bf16()
    return device.type == "xpu"


def native_fp8(device: torch.device) -> bool:
    """Whether ``device`` has fp8 matmul hardware: NVIDIA compute capability 8.9+ (Ada, Hopper,
    Blackwell), AMD MI300 and later (gfx94x, gfx95x)."""
    if device.type != "cuda":
        return False
    if torch.version.hip:
        return torch.cuda.get_device_properties(device).gcnArchName.startswith(("gfx94", "gfx95"))
    return torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def cpu_fp8_matmul() -> bool:
    """Whether torch's CPU fp8 matmul runs on this CPU. oneDNN's needs AVX512-FP16 (Intel Xeon from Sapphire Rapids);
    on such a CPU held to AVX-512 BF16 (``ONEDNN_MAX_CPU_ISA``, as AMD EPYC with AVX-512 BF16 is) it refuses to build
    one, and held to AVX2 with ATen's AVX2 kernels (the AVX2 kind's proxy) it serves a product until the first bf16
    autocast region has closed, and refuses from then on. A CPU without AVX512-FP16 (an Intel Xeon with AVX-512 and
    no BF16) gets torch's own reference kernel, cap or not. Asked of torch itself with a 16x16 product in and after
    such a region, once a process: its rules are its own."""
    operand = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32)
    try:
        for region in (torch.autocast("cpu", dtype=torch.bfloat16), contextlib.nullcontext()):
            with region:
                torch._scaled_mm(operand, operand.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def emulates_fp8(device: torch.device) -> bool:
    """Whether fp8 matmuls on ``device`` must be emulated (cast to fp8, multiplied in bf16/fp32): a GPU without fp8
    matmul hardware, a CPU without torch's fp8 matmul."""
    if device.type == "cuda":
        return not native_fp8(device)
    return device.type == "cpu" and not cpu_fp8_matmul()


def unsupported(mode: str, device: torch.device, bf16: bool, fp8: bool) -> str | None:
    """Why a GPU cannot run ``mode`` (computing in bf16, running fp8 matmuls) at its speed (bf16 before compute capability 8.0, where torch
    would emulate it slowly; fp8 before 8.9), with what works there, or None. CPUs run every mode
    (emulated ones say so: :func:`slower_than_fp32`)."""
    if device.type != "cuda":
        return None
    gpu = gpu_description(device)
    if fp8 and not native_fp8(device):
        works = "native-bf16, O4 or O5 (bf16)" if native_bf16(device) else "native-fp16, O1 or O2 (fp16 with loss scaling)"
        return (f"precision {mode} runs fp8 matmuls, which {gpu} lacks (NVIDIA compute capability 8.9+: L4, L40, H100, H200, "
                f"B200; AMD MI300+): use {works}, or auto")  # fmt: skip
    if bf16 and not native_bf16(device):
        return (f"precision {mode} computes in bf16, which {gpu} does not compute natively (that needs compute capability "
                "8.0+; torch would emulate it slowly): use native-fp16, O1 or O2 (fp16 with loss scaling), O0, or auto")  # fmt: skip
    return None


def slower_than_fp32(device: torch.device, compute_dtype: torch.dtype | None, has_convolutions: bool, runs_fp8: bool = False) -> str | None:
    """Why a set-up computing in ``compute_dtype`` (``runs_fp8``: with fp8 matmuls) on ``device`` is
    slower than fp32 (one clause), or None when it is not."""
    if runs_fp8 and not native_fp8(device):
        return f"{device_description(device)} has no fp8 matmul hardware: its fp8 matmuls run emulated (correct; for tests, not speed)"
    if device.type != "cpu" or compute_dtype is None:
        return None
    if compute_dtype == torch.bfloat16 and not cpu_has_bf16():
        return f"this CPU ({cpu_description()}) runs bf16 about 3-4x slower than fp32"
    if compute_dtype == torch.float16 and has_convolutions:
        return "fp16 convolution backward is about 60x slower than fp32 on CPU in current PyTorch"
    return None


CPU_WHEEL_INDEX = "https://download.pytorch.org/whl/cpu"
CUDA_ONLY_DISTRIBUTIONS = ("nvidia-", "triton", "cuda-")
"""Distributions a CUDA build of torch pulls in that a CPU-only one does not (names, or their prefixes)."""


def nvidia_gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU (its driver's device nodes), whether or not torch can use it."""
    return any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia"))


@functools.cache
def cuda_build_bytes() -> int:
    """Bytes on disk of the CUDA build's own parts: the CUDA-only distributions and torch's CUDA libraries."""
    import importlib.metadata

    total = 0
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(CUDA_ONLY_DISTRIBUTIONS):
            total += sum(entry.size or 0 for entry in dist.files or [])
    libraries = Path(torch.__file__).parent / "lib"
    if libraries.is_dir():
        total += sum(path.stat().st_size for path in libraries.iterdir() if "cuda" in path.name.lower())
    return total


def cuda_build_note(cuda_version: str | None, gpu_present: bool, cuda_bytes: int) -> str | None:
    """The line a run on a CPU-only machine with a CUDA build of torch says once: what the CUDA parts
    take on disk and how to install the CPU-only wheel instead (None otherwise)."""
    if cuda_version is None or gpu_present:
        return None
    return (
        f"torch {torch.__version__} is a CUDA {cuda_version} build and this machine has no NVIDIA GPU: its CUDA parts take "
        f"{cuda_bytes / 2**30:.1f} GB here, which the CPU-only wheel leaves out (pip install torch torchvision --index-url "
        f"{CPU_WHEEL_INDEX})"
    )
