"""CPU tests of services/coordinator/disk.py: a run's writes when the disk refuses them."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import sqlite3
from pathlib import Path

import grpc
import pytest

from services.common.errors import FailedPrecondition, ResourceExhausted, status_for
from services.coordinator import disk
from services.coordinator.disk import (RunWrites, append_line, disk_fault, metrics_lines, refused_by_state_dir,
                                       trainer_disk_fault)
from services.coordinator.runs.reporter import RunReporter


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


def test_a_trainers_save_refused_by_its_disk_is_told_by_the_error_number_its_status_carries():
    def status(code, details, number=None):
        trailing = grpc.aio.Metadata(("meshrl-origin", "handler"), *([("meshrl-errno", number)] if number else []))
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)

    words = ("CheckpointNotWritten: the checkpoint was not written to /c/step_2/actor: Read-only file system "
             "(/c/step_2.tmp); 3.0 MiB free on the disk of /c")
    assert trainer_disk_fault(status(grpc.StatusCode.FAILED_PRECONDITION, words, str(errno.EROFS)), "t:1") == (
        f"the disk: the trainer at t:1 cannot save the checkpoint: {words}")
    for other in (status(grpc.StatusCode.FAILED_PRECONDITION, words),  # the words alone are not read
                  status(grpc.StatusCode.FAILED_PRECONDITION, "not written: Permission denied", str(errno.EACCES)),
                  status(grpc.StatusCode.UNAVAILABLE, "Socket closed"), status(grpc.StatusCode.INTERNAL, None),
                  OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))):  # the coordinator's own disk: not the trainer's
        assert trainer_disk_fault(other, "t:1") is None


@pytest.mark.parametrize("error, refusal, words", [
    (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/state/runs/r/config.yaml"), ResourceExhausted,
     "/state/runs/r/config.yaml: No space left on device"),
    (sqlite3.OperationalError("database or disk is full"), ResourceExhausted,
     "/state/meshrl.db: No space left on device"),
    (OSError(errno.EROFS, os.strerror(errno.EROFS), "/state/runs/r"), FailedPrecondition,
     "/state/runs/r: Read-only file system"),
])
def test_a_call_whose_state_dir_write_the_disk_refuses_is_refused_naming_the_file(error, refusal, words):
    with pytest.raises(refusal) as refused:
        with refused_by_state_dir("start the run", Path("/state/meshrl.db")):
            raise error
    assert str(refused.value).startswith(f"cannot start the run: cannot write {words}")
    assert "then try again" in str(refused.value)
    assert status_for(refused.value) == (grpc.StatusCode.RESOURCE_EXHAUSTED if refusal is ResourceExhausted
                                         else grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(FileNotFoundError):  # not the disk's refusal: as it was
        with refused_by_state_dir("start the run", Path("/state/meshrl.db")):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", "/state/x")


def test_a_wait_for_a_checkpoints_disk_is_shown_at_once_and_recorded_when_the_run_db_takes_it():
    store, changes = Disk(), []
    writes = RunWrites(lambda state, error: store.write(f"state {state} {error}".strip())(), Path("/state/db"),
                       changes.append)
    store.full = True
    writes.wait("the disk: the trainer at t:1 cannot save the checkpoint: No space left on device")
    assert writes.waiting_for.endswith("No space left on device") and store.written == []
    store.full = False
    writes.wait(None)
    assert writes.waiting_for is None and store.written == [
        "state waiting the disk: the trainer at t:1 cannot save the checkpoint: No space left on device",
        "state running"]
    assert changes == [changes[0], None]


class HeldIn:
    """The run's records as the reporter's samples reach them: a write the disk refused, held in ``writes``."""

    def __init__(self, writes: RunWrites):
        self.writes = writes

    def write(self, run_id, do, path):
        self.writes.write(do, path)


def test_a_steps_samples_file_the_disk_refuses_is_held_with_the_runs_records_and_written_once_it_takes_them(
        tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "WAIT_POLL_S", 0.01)
    full, write_text, changes = [True], Path.write_text, []

    def refusing_write_text(path, text):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return write_text(path, text)

    monkeypatch.setattr(Path, "write_text", refusing_write_text)
    writes = RunWrites(lambda state, error: changes.append((state, error)), tmp_path / "db", lambda cause: None)
    reporter = RunReporter(records=HeldIn(writes), run_id="r", run_dir=tmp_path, samples_dir=tmp_path / "rollout_data")

    async def scenario():
        await reporter.samples(3, [{"step": 3, "output": "a"}, {"step": 3, "output": "b"}])  # held, not raised
        settling = asyncio.ensure_future(writes.settle())
        await asyncio.sleep(0.05)
        assert not settling.done() and "rollout_data/3.jsonl.tmp: No space left on device" in writes.waiting_for
        full[0] = False
        await asyncio.wait_for(settling, 1)

    asyncio.run(scenario())
    assert [json.loads(line)["output"] for line in (tmp_path / "rollout_data" / "3.jsonl").read_text().splitlines()] \
        == ["a", "b"]
    assert [state for state, _ in changes] == ["waiting", "running"]
