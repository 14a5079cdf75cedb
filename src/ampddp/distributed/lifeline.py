"""A rank ends with the launcher that started it: no orphaned ranks training on after their launcher died.

Killing ``ampddp train ... distributed.nproc_per_node=2`` (or torchrun's agent) with SIGKILL, or losing
it with its terminal, leaves nothing to stop its ranks: they would train on, unseen, and write into a
run dir whose launcher is gone. On Linux the kernel kills this process the moment its parent ends
(``PR_SET_PDEATHSIG``); elsewhere a thread checks every half second whether the parent changed. Ending
with SIGKILL writes nothing half-way: every file a run writes is replaced atomically, and the newest
complete checkpoint stays for the same command to resume from.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
"""prctl(2): the signal this process receives when its parent ends."""
POLL_S = 0.5


def end_with_parent(parent_pid: int) -> None:
    """From now on this process is killed when ``parent_pid`` (the process that started it) ends; at
    once if it ended already (this process was handed to another parent before this call)."""
    if not _kernel_watches():
        threading.Thread(target=_watch, args=(parent_pid,), name="ampddp-lifeline", daemon=True).start()
    if os.getppid() != parent_pid:
        _end()


def _kernel_watches() -> bool:
    """Ask Linux to send SIGKILL when the parent ends; False where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(POLL_S)
    _end()


def _end() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
