"""Processes that end with the process that started them, however it ends (kill -9 included), on Linux.

The kernel sends the chosen signal to a process when its parent ends (``prctl(PR_SET_PDEATHSIG)``):
precisely, when the parent *thread* that started it ends, so a parent starts such children from a thread
that lives as long as it does. A process started by a library (vLLM's engine core, spawned from one of its
threads) instead watches the service's process through a pidfd (``end_with``). Elsewhere than Linux this
does nothing.

A process that hosts others' code (an env worker) also ends, when it chooses, everything that code started:
``adopt_orphans`` makes it the subreaper of its descendants (one whose parent ends, a daemon's double fork or a
``setsid`` included, is handed to it rather than to init), so ``end_descendants`` finds them all by /proc's
parent links and kills them, unprivileged, in a sandbox's pid namespace or outside one; ``reap_children`` then
collects their exit statuses.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


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


def adopt_orphans() -> None:
    """Become the subreaper of this process's descendants (see the module's docstring); nothing elsewhere than
    Linux."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1)


def end_descendants(pid: int, seconds: float = 5.0) -> list[int]:
    """SIGKILL every running descendant of process ``pid``, pass after pass until none runs (one started while a
    pass ran is found by the next) or ``seconds`` have passed: the descendants still running then, normally none.
    Those killed are left as zombies for their parent to reap (``reap_children``, where it is this process)."""
    deadline = time.monotonic() + seconds
    while (running := descendants(pid)) and time.monotonic() < deadline:
        for descendant in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(descendant, signal.SIGKILL)
        time.sleep(0.001)
    return running


def descendants(pid: int) -> list[int]:
    """The running (not zombie) descendants of process ``pid``, as this process's /proc shows them."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                state, parent = stat.read().rpartition(")")[2].split()[:2]
        except (OSError, ValueError):  # gone meanwhile
            continue
        if state not in "ZX":
            children.setdefault(int(parent), []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


def reap_children() -> None:
    """Collect the exit status of every child of this process that has ended (without waiting for others)."""
    while True:
        try:
            ended, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left
            return
        if ended == 0:  # none of those left has ended
            return
