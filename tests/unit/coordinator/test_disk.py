"""CPU tests of services/coordinator/disk.py: a run's writes when the disk refuses them."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sqlite3
from pathlib import Path

import pytest

from services.coordinator import disk
from services.coordinator.disk import RunWrites, append_line, disk_fault, metrics_lines


def test_disk_fault_names_the_file_and_the_systems_words():
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/state/runs/r/metrics.jsonl")
    assert disk_fault(full, Path("/elsewhere")) == (
        "the disk: cannot write /state/runs/r/metrics.jsonl: No space left on device")
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS))
    assert disk_fault(read_only, Path("/state/x")) == "the disk: cannot write /state/x: Read-only file system"
    assert disk_fault(sqlite3.OperationalError("database or disk is full"), Path("/state/meshrl.db")) == (
        "the disk: cannot write /state/meshrl.db: No space left on device (database or disk is full)")
    assert "Read-only file system" in disk_fault(sqlite3.OperationalError("attempt to write a readonly database"),
                                                 Path("/state/meshrl.db"))
    for other in (OSError(errno.ENOENT, "No such file or directory"), sqlite3.OperationalError("no such table: x"),
                  ValueError("disk I/O error")):
        assert disk_fault(other, Path("/state/x")) is None


def test_append_line_drops_a_torn_last_line_first(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_line(path, '{"step": 1}')
    with path.open("a") as out:
        out.write('{"step": 2, "lo')  # a crash in the middle of a write
    append_line(path, '{"step": 2}')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"ste')  # torn with no whole line before it
    append_line(path, '{"step": 1}')
    assert path.read_text() == '{"step": 1}\n'


def test_metrics_lines_are_one_json_line_a_step():
    text = metrics_lines([(0, 10.0, {"val-core/x": 0.5}), (1, 11.0, {"loss": 1.0, "val-core/x": 0.75})])
    assert [json.loads(line) for line in text.splitlines()] == [
        {"step": 0, "time": 10.0, "val-core/x": 0.5}, {"step": 1, "time": 11.0, "loss": 1.0, "val-core/x": 0.75}]


class Disk:
    """Writes into a list that refuse, as a full disk does, while ``full`` is set."""

    def __init__(self):
        self.full, self.written = False, []

    def write(self, what: str):
        def do():
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"/state/{what}")
            self.written.append(what)
        return do


def test_writes_the_disk_refuses_wait_in_order_and_the_run_waits_for_them(monkeypatch):
    monkeypatch.setattr(disk, "WAIT_POLL_S", 0.01)
    store, changes = Disk(), []
    writes = RunWrites(lambda state, error: store.write(f"state {state} {error}".strip())(), Path("/state/db"),
                       changes.append)

    cause = "the disk: cannot write /state/step 2: No space left on device"

    async def scenario():
        writes.write(store.write("step 1"), Path("/state/db"))
        await writes.settle()  # nothing held: returns at once, no state recorded
        store.full = True
        writes.write(store.write("step 2"), Path("/state/db"))  # held, not raised
        writes.write(store.write("line 2"), Path("/state/metrics.jsonl"))
        settling = asyncio.ensure_future(writes.settle())
        await asyncio.sleep(0.05)
        assert not settling.done() and writes.waiting_for == cause
        store.full = False
        await asyncio.wait_for(settling, 1)

    asyncio.run(scenario())
    assert store.written == ["step 1", f"state waiting {cause}", "step 2", "line 2", "state running"]
    assert changes == [cause, None] and writes.waiting_for is None


def test_a_write_that_fails_for_another_reason_raises_and_is_not_held():
    store = Disk()
    writes = RunWrites(lambda state, error: None, Path("/state/db"), lambda cause: None)

    def broken():
        raise sqlite3.OperationalError("no such table: steps")

    with pytest.raises(sqlite3.OperationalError):
        writes.write(broken, Path("/state/db"))
    writes.write(store.write("next"), Path("/state/db"))
    assert store.written == ["next"]
