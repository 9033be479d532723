"""Processes that end with the process that started them, however it ends (kill -9 included), on Linux.

The kernel sends the chosen signal to a process when its parent ends (``prctl(PR_SET_PDEATHSIG)``):
precisely, when the parent *thread* that started it ends, so a parent starts such children from a thread
that lives as long as it does. A process started by a library (vLLM's engine core, spawned from one of its
threads) instead watches the service's process through a pidfd (``end_with``). Elsewhere than Linux this
does nothing.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading

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


def end_with(pid: int) -> None:
    """Kill this process (SIGKILL: its own children see it go) as soon as process ``pid`` ends, watched from a
    daemon thread; at once if it has already ended."""
    try:
        handle = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        return

    def watch() -> None:
        poller = select.poll()
        poller.register(handle, select.POLLIN)  # readable once the process has ended
        poller.poll()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=f"end-with-{pid}", daemon=True).start()
