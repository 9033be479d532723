"""Processes that end with the process that started them, however it ends (kill -9 included), on Linux.

The kernel sends the chosen signal to a process when its parent ends (``prctl(PR_SET_PDEATHSIG)``):
precisely, when the parent *thread* that started it ends, so a parent starts such children from a thread
that lives as long as it does. Elsewhere than Linux this does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int) -> None:
    """Get ``signum`` when the parent ends; exit now if ``parent_pid`` is no longer the parent (it ended before
    this call, and this process was handed to another)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent_pid:
        sys.exit(f"parent {parent_pid} is gone")
