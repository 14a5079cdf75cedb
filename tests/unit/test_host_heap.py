"""settle_host_heap: a step's freed memory stays in glibc's heap instead of being given back and faulted in every step."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import ampddp.precision.host_heap as host_heap

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's heap heuristic")

# A fresh interpreter without torch (whose import frees blocks of its own and so moves the thresholds): the module
# loaded from its file alone, the C library's malloc driven directly, as torch's CPU allocator drives it.
STEPS = textwrap.dedent(
    """
    import ctypes, importlib.util, resource, sys, types

    spec = importlib.util.spec_from_file_location("host_heap", sys.argv[1])
    host_heap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_heap)
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

    def faults_per_step():
        # a step's tensors: 200 blocks of 100 KiB (under the starting mmap threshold: from the heap), written, freed at its end
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            blocks = [libc.malloc(102_400) for _ in range(200)]
            for block in blocks:
                ctypes.memset(block, 1, 102_400)
            for block in blocks:
                libc.free(block)
        return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10

    faults_per_step()
    if sys.argv[2] != "fresh":
        host_heap.settle_host_heap(types.SimpleNamespace(type=sys.argv[2]))
    faults_per_step()
    print(faults_per_step())
    """
)


def _faults_per_step(how: str) -> float:
    done = subprocess.run([sys.executable, "-c", STEPS, str(Path(host_heap.__file__)), how], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout.split()[-1])


def test_a_settled_heap_keeps_a_steps_memory_where_a_fresh_one_faults_it_back_every_step():
    assert _faults_per_step("fresh") > 2000  # 20 MB freed at the top of the heap, over the 128 KiB trim threshold: given back
    assert _faults_per_step("cpu") < 50
    assert _faults_per_step("cuda") > 2000  # not a host run: the heap is left as it is
