"""Run state in SQLite: runs, the metrics of each step, and events.

The coordinator is the only writer. Each write is its own transaction, so a
crash loses at most the write in flight.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.cli import CannotStart

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    config_yaml TEXT NOT NULL,
    run_dir TEXT NOT NULL,
    step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER NOT NULL,
    error TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS steps (
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    time REAL NOT NULL,
    metrics_json TEXT NOT NULL,
    PRIMARY KEY (run_id, step)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER NOT NULL,
    state TEXT NOT NULL,
    message TEXT NOT NULL,
    metrics_json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_run ON events (run_id, id);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    loop_state_json TEXT NOT NULL,
    time REAL NOT NULL,
    PRIMARY KEY (run_id, step)
);
"""


@dataclass(frozen=True, kw_only=True)
class RunRow:
    run_id: str
    name: str
    state: str
    config_yaml: str
    run_dir: str
    step: int
    total_steps: int
    error: str
    created_at: float


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    run_id: str
    step: int
    path: str  # folder holding one sub-folder per trainer service
    loop_state: dict  # the coordinator's side: data position, KL coefficient, reward target


@dataclass(frozen=True, kw_only=True)
class Event:
    id: int
    run_id: str
    time: float
    kind: str  # step, state or log
    step: int
    state: str
    message: str
    metrics: dict[str, float]


class DamagedRunDB(CannotStart):
    """The run DB file is not a SQLite database, or one whose pages are damaged: the coordinator cannot start on
    it. The message names the file and what to do."""


class RunStore:
    def __init__(self, path: Path):
        """Open (or create) the run DB at ``path``; DamagedRunDB if the file is damaged."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if path.exists() and path.stat().st_size == 0:  # SQLite would take it for a new, empty DB
            runs = list((path.parent / "runs").glob("*/config.yaml"))
            if runs:
                raise DamagedRunDB(damaged_message(path, f"the file is empty, but {len(runs)} runs have folders "
                                                         f"under {path.parent / 'runs'}"))
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
            problems = [row[0] for row in self._db.execute("PRAGMA quick_check")]
        except sqlite3.DatabaseError as error:
            problems = [str(error)]
        if problems != ["ok"]:
            self._db.close()
            raise DamagedRunDB(damaged_message(path, problems[0]))

    def create_run(self, run_id: str, name: str, config_yaml: str, *, run_dir: str, total_steps: int,
                   notices: tuple[str, ...] = ()) -> None:
        """A new run (state pending) with ``notices`` as its first events, in one transaction: all of it, or
        nothing when the disk refuses the write."""
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO runs (run_id, name, state, config_yaml, run_dir, total_steps, created_at, updated_at)"
                " VALUES (?, ?, 'pending', ?, ?, ?, ?, ?)",
                (run_id, name, config_yaml, run_dir, total_steps, now, now),
            )
            self._db.executemany("INSERT INTO events (run_id, time, kind, step, state, message, metrics_json)"
                                 " VALUES (?, ?, 'log', 0, '', ?, '{}')", [(run_id, now, n) for n in notices])

    def set_state(self, run_id: str, state: str, error: str = "") -> Event:
        self._db.execute("UPDATE runs SET state = ?, error = ?, updated_at = ? WHERE run_id = ?",
                         (state, error, time.time(), run_id))
        return self.add_event(run_id, "state", self.get_run(run_id).step, state=state, message=error, metrics={})

    def record_step(self, run_id: str, step: int, metrics: dict[str, float]) -> Event:
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("INSERT OR REPLACE INTO steps (run_id, step, time, metrics_json) VALUES (?, ?, ?, ?)",
                             (run_id, step, now, json.dumps(metrics)))
            self._db.execute("UPDATE runs SET step = ?, updated_at = ? WHERE run_id = ?", (step, now, run_id))
        return self.add_event(run_id, "step", step, state="", message="", metrics=metrics)

    def record_validation(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        """Add a validation's metrics to the record of step ``step`` (step 0: before training), which may not
        exist yet; the run's step does not move."""
        with self._db:
            self._db.execute("BEGIN")
            row = self._db.execute("SELECT metrics_json FROM steps WHERE run_id = ? AND step = ?", (run_id, step))
            found = row.fetchone()
            merged = {**(json.loads(found[0]) if found else {}), **metrics}
            self._db.execute("INSERT OR REPLACE INTO steps (run_id, step, time, metrics_json) VALUES (?, ?, ?, ?)",
                             (run_id, step, time.time(), json.dumps(merged)))

    def add_event(self, run_id: str, kind: str, step: int, *, state: str, message: str,
                  metrics: dict[str, float]) -> Event:
        now = time.time()
        cursor = self._db.execute(
            "INSERT INTO events (run_id, time, kind, step, state, message, metrics_json) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (run_id, now, kind, step, state, message, json.dumps(metrics)),
        )
        if cursor.lastrowid is None:
            raise RuntimeError(f"the run DB gave no id to run {run_id}'s event")
        return Event(id=cursor.lastrowid, run_id=run_id, time=now, kind=kind, step=step, state=state, message=message,
                     metrics=metrics)

    def get_run(self, run_id: str) -> RunRow:
        row = self._db.execute(
            "SELECT run_id, name, state, config_yaml, run_dir, step, total_steps, error, created_at FROM runs"
            " WHERE run_id = ?", (run_id,),
        ).fetchone()
        if row is None:
            raise LookupError(run_id)
        return run_row(row)

    def list_runs(self) -> list[RunRow]:
        rows = self._db.execute(
            "SELECT run_id, name, state, config_yaml, run_dir, step, total_steps, error, created_at FROM runs"
            " ORDER BY created_at"
        ).fetchall()
        return [run_row(row) for row in rows]

    def step_metrics(self, run_id: str) -> list[tuple[int, dict[str, float]]]:
        rows = self._db.execute("SELECT step, metrics_json FROM steps WHERE run_id = ? ORDER BY step", (run_id,))
        return [(step, json.loads(metrics)) for step, metrics in rows]

    def step_records(self, run_id: str) -> list[tuple[int, float, dict[str, float]]]:
        """(step, time of its last record, metrics) of every recorded step, in order."""
        rows = self._db.execute("SELECT step, time, metrics_json FROM steps WHERE run_id = ? ORDER BY step", (run_id,))
        return [(step, at, json.loads(metrics)) for step, at, metrics in rows]

    def last_step_metrics(self, run_id: str) -> dict[str, float]:
        row = self._db.execute("SELECT metrics_json FROM steps WHERE run_id = ? ORDER BY step DESC LIMIT 1", (run_id,))
        found = row.fetchone()
        return json.loads(found[0]) if found else {}

    def last_event_id(self, run_id: str) -> int:
        row = self._db.execute("SELECT MAX(id) FROM events WHERE run_id = ?", (run_id,)).fetchone()
        return row[0] or 0

    def events_after(self, run_id: str, after_id: int) -> list[Event]:
        rows = self._db.execute(
            "SELECT id, run_id, time, kind, step, state, message, metrics_json FROM events"
            " WHERE run_id = ? AND id > ? ORDER BY id", (run_id, after_id),
        )
        return [Event(id=event_id, run_id=run, time=at, kind=kind, step=step, state=state, message=message,
                      metrics=json.loads(metrics_json))
                for event_id, run, at, kind, step, state, message, metrics_json in rows]

    def add_checkpoint(self, run_id: str, step: int, path: str, *, loop_state: dict) -> None:
        """Record a checkpoint whose trainer folders are complete (the last write of a checkpoint)."""
        self._db.execute("INSERT OR REPLACE INTO checkpoints (run_id, step, path, loop_state_json, time)"
                         " VALUES (?, ?, ?, ?, ?)", (run_id, step, path, json.dumps(loop_state), time.time()))

    def last_checkpoint(self, run_id: str, before: int | None = None) -> Checkpoint | None:
        """The run's checkpoint of the highest step (below ``before`` if given)."""
        row = self._db.execute("SELECT run_id, step, path, loop_state_json FROM checkpoints WHERE run_id = ?"
                               " AND step < ? ORDER BY step DESC LIMIT 1",
                               (run_id, before if before is not None else 2**62)).fetchone()
        return Checkpoint(run_id=row[0], step=row[1], path=row[2], loop_state=json.loads(row[3])) if row else None

    def checkpoints_by_age(self, run_id: str) -> list[Checkpoint]:
        """The run's checkpoints, the one saved first first."""
        rows = self._db.execute("SELECT run_id, step, path, loop_state_json FROM checkpoints WHERE run_id = ?"
                                " ORDER BY time, step", (run_id,))
        return [Checkpoint(run_id=row[0], step=row[1], path=row[2], loop_state=json.loads(row[3])) for row in rows]

    def forget_checkpoint(self, run_id: str, step: int) -> None:
        self._db.execute("DELETE FROM checkpoints WHERE run_id = ? AND step = ?", (run_id, step))

    def checkpoint_at(self, path: str) -> Checkpoint | None:
        """The checkpoint recorded at ``path``, of whichever run."""
        row = self._db.execute("SELECT run_id, step, path, loop_state_json FROM checkpoints WHERE path = ?",
                               (path,)).fetchone()
        return Checkpoint(run_id=row[0], step=row[1], path=row[2], loop_state=json.loads(row[3])) if row else None

    def latest_checkpoint_under(self, folder: str) -> Checkpoint | None:
        """The checkpoint saved last in ``folder`` (as step_<N>), of whichever run."""
        row = self._db.execute("SELECT run_id, step, path, loop_state_json FROM checkpoints WHERE path LIKE ?"
                               " ORDER BY time DESC LIMIT 1", (f"{folder.rstrip('/')}/step_%",)).fetchone()
        return Checkpoint(run_id=row[0], step=row[1], path=row[2], loop_state=json.loads(row[3])) if row else None

    def forget_steps_after(self, run_id: str, step: int) -> None:
        """Drop the metrics of steps after ``step`` (they will be run again) and set the run back to it."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM steps WHERE run_id = ? AND step > ?", (run_id, step))
            self._db.execute("UPDATE runs SET step = ?, error = '', updated_at = ? WHERE run_id = ?",
                             (step, time.time(), run_id))

    def close(self) -> None:
        self._db.close()


def damaged_message(path: Path, problem: str) -> str:
    """What a person reads when the run DB at ``path`` is damaged (``problem``: SQLite's words)."""
    return (f"the run DB {path} is damaged ({problem}). Move it aside (mv {path} {path}.damaged, and its -wal and "
            f"-shm files likewise if they are there) and start the coordinator again: it starts with a new, empty "
            f"run DB. The runs recorded in the damaged file cannot be listed or resumed from it; their folders under "
            f"{path.parent / 'runs'} keep each run's config.yaml, metrics.jsonl and checkpoints, and `sqlite3 "
            f"{path}.damaged .recover` may salvage rows the damage spared")


RUN_COLUMNS = ("run_id", "name", "state", "config_yaml", "run_dir", "step", "total_steps", "error", "created_at")


def run_row(row: tuple) -> RunRow:
    """A runs table row, selected in RUN_COLUMNS' order, as its record."""
    return RunRow(**dict(zip(RUN_COLUMNS, row, strict=True)))
