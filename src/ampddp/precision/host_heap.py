"""glibc's heap thresholds for a training process on the CPU, set once as its own heuristic sets them.

glibc serves a request above its mmap threshold from a fresh mapping (faulted in page by page, unmapped when
freed) and gives the top of its heap back to the OS when more than its trim threshold lies free there. Both
start low (128 and 256 KiB) and rise with the largest mapped block the process has freed, up to 32 and 64 MiB.
A training step on the CPU allocates and frees the same tensors every step, so where a process's thresholds
stand decides whether every step faults its memory back in from the OS, and that depended on what the process
happened to free before training: the same ampddp Trainer on the peers' GPT at O5 faulted 1,200-1,900 pages a
step (23-24 ms a step) in one process and none (21.3-21.7 ms) in another that had freed one large block first.
``settle_host_heap`` frees one mapped block of the largest size the heuristic follows, once, so that every run
trains with the thresholds a long-running process ends up with: a step's freed memory stays in the heap for the
next step (at most 64 MiB of it beyond what is in use). A threshold the user set (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, glibc's tunables, ``mallopt``) turns glibc's heuristic off, and this changes nothing
then; other C libraries keep their own ways.
"""

from __future__ import annotations

import ctypes
import platform
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LARGEST_FOLLOWED = 32 * 1024 * 1024
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on a 64-bit host: the largest freed mapped block its thresholds follow."""

_BOOKKEEPING = 64 * 1024
"""Room for the allocator's header and page rounding, so that the block's mapping stays within ``LARGEST_FOLLOWED``."""


def settle_host_heap(device: torch.device) -> None:
    """Raise glibc's mmap and trim thresholds to their ceiling by freeing one mapped block of that size, when the
    run's tensors live on the host (``device`` is the CPU; a GPU's step memory is torch's caching allocator's) and
    the C library is glibc. Through ``malloc`` itself, where torch's CPU tensors also come from."""
    if device.type != "cpu" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    libc.free(libc.malloc(LARGEST_FOLLOWED - _BOOKKEEPING))
