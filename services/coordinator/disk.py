"""When the state directory's disk refuses a run's write (full, read-only, failing): what to tell a person, and
the run's writes, kept in order until the disk takes them again.

A run's records are its run DB rows, metrics.jsonl, its validation files, its samples files
(trainer.rollout_data_dir) and reward.png. A write the disk refuses is held in memory with every write after
it; the run goes on to the end of its step, then waits (state ``waiting``, the cause naming the file and the
error) and tries again every ``WAIT_POLL_S``, so that nothing it recorded is lost and no later record lands
before an earlier one. A checkpoint the trainer's disk refuses makes the run wait the same way (``wait``).

A call that must write into the state directory before a run exists (StartRun, ResumeRun) is refused instead
(``refused_by_state_dir``): RESOURCE_EXHAUSTED when the disk is full (free space, then call again),
FAILED_PRECONDITION when it is read-only or failing (fix the disk, then call again).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import sqlite3
from collections import deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import grpc

from services.common.errors import ERRNO_KEY, FailedPrecondition, ResourceExhausted
from services.coordinator.waiting import WAIT_POLL_S

DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EIO)
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
SQLITE_DISK_ERRORS = {  # SQLite's own words for a refused write -> the errno a person knows
    "database or disk is full": errno.ENOSPC,
    "attempt to write a readonly database": errno.EROFS,
    "disk I/O error": errno.EIO,
}


def refusing_errno(error: BaseException) -> int | None:
    """The errno of a write the disk refused (one of DISK_ERRNOS); None when ``error`` is not the disk's."""
    if isinstance(error, OSError) and error.errno in DISK_ERRNOS:
        return error.errno
    if isinstance(error, sqlite3.OperationalError):
        return SQLITE_DISK_ERRORS.get(str(error))
    return None


def disk_fault(error: BaseException, path: Path) -> str | None:
    """The cause of a write to ``path`` that the disk refused, for a person, after 'waiting for' (the file, and
    the error as the system says it: 'No space left on device', 'Read-only file system'); None when ``error`` is
    not the disk's."""
    number = refusing_errno(error)
    if number is None:
        return None
    if isinstance(error, OSError):
        return f"the disk: cannot write {error.filename or path}: {error.strerror}"
    return f"the disk: cannot write {path}: {os.strerror(number)} ({error})"


def trainer_disk_fault(error: BaseException, address: str) -> str | None:
    """The cause, for a person, of a checkpoint save that the trainer at ``address`` failed with ``error``, when
    its status carries the error number of a disk's refusal (ENOSPC, EROFS, ...); else None."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return None
    number = dict(error.trailing_metadata() or ()).get(ERRNO_KEY)
    if number is None or not number.isdigit() or int(number) not in DISK_ERRNOS:
        return None
    return f"the disk: the trainer at {address} cannot save the checkpoint: {(error.details() or '')[:500]}"


class DiskRefused(Exception):
    """A write outside the run's records that its disk refused (a trainer's checkpoint); the message is the
    cause, for a person."""


@contextlib.contextmanager
def refused_by_state_dir(doing: str, path: Path):
    """Around writes into the state directory (``path``: the file they write, if the error does not name it)
    that a call makes before its run exists: a write the disk refuses ends the call with ResourceExhausted (no
    space: free some, then call again) or FailedPrecondition (read-only or failing: fix the disk, then call
    again), naming ``doing``, the file and the system's error."""
    try:
        yield
    except Exception as error:
        number, cause = refusing_errno(error), disk_fault(error, path)
        if cause is None:
            raise
        if number in NO_SPACE_ERRNOS:
            raise ResourceExhausted(f"cannot {doing}: {cause.removeprefix('the disk: ')} (the state directory's "
                                    "disk is full: free space on it, then try again)") from None
        raise FailedPrecondition(f"cannot {doing}: {cause.removeprefix('the disk: ')} (the state directory's disk "
                                 "refuses writes: make it writable, then try again)") from None


def append_line(path: Path, line: str) -> None:
    """Append ``line`` and a newline to ``path``, keeping the file whole lines: a torn last line (a write cut
    short by a crash) is dropped first, and a write the disk cuts short is taken back."""
    with path.open("a+b") as out:
        size = out.seek(0, os.SEEK_END)
        if size and (out.seek(size - 1), out.read(1))[1] != b"\n":
            out.seek(0)
            size = out.read().rfind(b"\n") + 1
            out.truncate(size)
        try:
            out.write(line.encode() + b"\n")
            out.flush()
        except OSError:
            out.truncate(size)
            raise


def metrics_lines(steps: list[tuple[int, float, dict[str, float]]]) -> str:
    """metrics.jsonl for ``steps`` (step, time, metrics), one line a step."""
    return "".join(json.dumps({"step": step, "time": at, **metrics}) + "\n" for step, at, metrics in steps)


@dataclass(frozen=True)
class Write:
    do: Callable[[], object]
    path: Path  # the file it writes, named when the disk refuses it


class RunWrites:
    """A run's writes to the state directory, done in order; those the disk refuses are held, in order, until it
    takes them again."""

    def __init__(self, record_state: Callable[[str, str], object], db_path: Path,
                 changed: Callable[[str | None], None]):
        """``record_state(state, error)``: the run's state into the run DB; ``changed(cause)``: the run starts
        waiting for the disk (the cause) or stops (None)."""
        self._record_state, self._db_path, self._changed = record_state, db_path, changed
        self._held: deque[Write] = deque()
        self._refused: str | None = None  # why the first held write was refused; None while none is held
        self.waiting_for: str | None = None  # the refusal the run waits on now (in ``settle``), if it does

    def write(self, do: Callable[[], object], path: Path) -> None:
        """``do()`` now, or after the writes held before it; held with them if the disk refuses it. Any other
        failure raises."""
        self._held.append(Write(do, path))
        self._flush()

    def _flush(self) -> None:
        while self._held:
            write = self._held[0]
            try:
                write.do()
            except Exception as error:
                self._refused = disk_fault(error, write.path)
                if self._refused is None:
                    self._held.popleft()
                    raise
                return
            self._held.popleft()
        self._refused = None

    async def settle(self, then: str | None = "running") -> None:
        """Return once every write is done. While the disk refuses one, the run waits: state ``waiting`` with the
        cause (recorded before the held writes, as soon as the run DB takes it), then state ``then`` (None:
        none, the last held write being the run's final state)."""
        while self._refused is not None:
            self.waiting_for = cause = self._refused
            self._held.appendleft(Write(partial(self._record_state, "waiting", cause), self._db_path))
            self._changed(cause)
            self._flush()
            while self._refused is not None:
                await asyncio.sleep(WAIT_POLL_S)
                self._flush()
            if then is not None:
                self.write(lambda: self._record_state(then, ""), self._db_path)
        if self.waiting_for is not None:
            self.waiting_for = None
            self._changed(None)

    def wait(self, cause: str | None) -> None:
        """The run waits for a disk that refused a write outside its records (a checkpoint's): state ``waiting``
        with ``cause``, shown at once whatever the run DB takes; None: it goes on (state ``running``)."""
        self.waiting_for = cause
        self.write(lambda: self._record_state("waiting" if cause else "running", cause or ""), self._db_path)
        self._changed(cause)
