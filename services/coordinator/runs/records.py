"""A run's records and their one writer: its state, its events, its steps' metrics, its checkpoints and its
validations, in the run DB and the run's folder (metrics.jsonl, validation/step_N.jsonl).

``RunRecords`` is the only code that writes what a run says about itself. The process-wide API
(``runs.RunManager``), a run's supervising task (``supervisor.RunSupervisor``) and the reporter its loop
reports through (``reporter.RunReporter``) ask it; none writes the run DB itself. So why a run says
``waiting`` is answered here: it waits for a service (``set_state``, asked by the supervisor while it connects
or recovers, and by the reporter while the loop waits for a rollout or reward service), or for its disk (its
``RunWrites`` hold its records, ``as_seen``; a checkpoint's disk, ``wait_for_disk``).

While a run is active (``open`` to ``close``) its writes go through its ``RunWrites`` (disk.py): in order, held
while the disk refuses them; otherwise they are done at once. Each change wakes the watchers (``notify``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Callable

import structlog

from services.coordinator import telemetry
from services.coordinator.disk import RunWrites, append_line, metrics_lines
from services.coordinator.store import RunRow, RunStore
from services.coordinator.step.validation import Validated

log = structlog.get_logger()


def removed(folder: Path) -> str:
    """Remove ``folder`` and all in it; what happened, for an event ('removed from <folder>', or why not)."""
    try:
        shutil.rmtree(folder)
    except FileNotFoundError:
        return f"forgotten ({folder} was gone already)"
    except OSError as error:
        return f"forgotten, but {folder} could not be removed: {error.strerror} ({error.filename})"
    return f"removed from {folder}"


def metrics_file(run_dir: Path) -> Path:
    return run_dir / "metrics.jsonl"


class RunRecords:
    def __init__(self, store: RunStore):
        """``store``: the run DB, which the others only read."""
        self.store = store
        self._writes: dict[str, RunWrites] = {}  # active run -> its writes to the state directory
        self._changed = asyncio.Condition()

    # ------------------------------------------------------------------ a run's active lifetime

    def open(self, run_id: str) -> None:
        """The run is driven from now on: its writes go through a ``RunWrites`` of its own."""
        self._writes[run_id] = RunWrites(lambda state, error: self.store.set_state(run_id, state, error),
                                         self.store.path, lambda cause: self._disk_changed(run_id, cause))

    async def close(self, run_id: str, settle: bool = True) -> None:
        """The run is no longer driven (its final state asked for): once the disk has taken its held records
        (``settle``; a shutdown does not wait for the disk), its writes are done at once again."""
        if settle:
            await self._writes[run_id].settle(then=None)
        del self._writes[run_id]

    async def settle(self, run_id: str) -> None:
        """At the end of a step: return once the disk has taken the run's records, the run waiting meanwhile."""
        await self._writes[run_id].settle()

    def wait_for_disk(self, run_id: str, cause: str | None) -> None:
        """The run waits for a disk that refuses a write outside its records (a checkpoint's); None: it goes on."""
        self._writes[run_id].wait(cause)

    # ------------------------------------------------------------------ what a run says

    def create(self, run_id: str, *, name: str, config_yaml: str, run_dir: Path, total_steps: int,
               notices: list[str]) -> None:
        """A new run (state pending), and the notices about its config and data a person should read first: all
        of it in the run DB, or none of it."""
        self.store.create_run(run_id, name=name, config_yaml=config_yaml, run_dir=str(run_dir), total_steps=total_steps,
                              notices=tuple(notices))

    def set_state(self, run_id: str, state: str, error: str = "") -> None:
        self.write(run_id, lambda: self.store.set_state(run_id, state, error))
        telemetry.count_runs(self.store.list_runs())
        log.info("run_state", run_id=run_id, state=state, error=error or None)
        self.notify()

    def interrupted(self, run_ids: list[str], reason: str) -> None:
        """Runs that were active when the coordinator went away: state interrupted, for ``reason``."""
        for run_id in run_ids:
            self.store.set_state(run_id, "interrupted", reason)

    def as_seen(self, row: RunRow) -> RunRow:
        """The run as a person should see it: waiting, for the disk's refusal, while its records wait for the
        disk (the run DB itself may not take that state)."""
        writes = self._writes.get(row.run_id)
        if writes is None or writes.waiting_for is None:
            return row
        return dataclasses.replace(row, state="waiting", error=writes.waiting_for)

    def event(self, run_id: str, kind: str, *, step: int, message: str) -> None:
        """Something a person watching the run should see at step ``step`` (kind: log, checkpoint, reward)."""
        self.write(run_id, lambda: self.store.add_event(run_id, kind, step=step, state="", message=message, metrics={}))

    def step(self, run_id: str, *, run_dir: Path, step: int, metrics: dict[str, float]) -> None:
        """A step's metrics, into the run DB (the run's step moves) and metrics.jsonl."""
        line = json.dumps({"step": step, "time": time.time(), **metrics})
        self.write(run_id, lambda: self.store.record_step(run_id, step, metrics))
        self.write(run_id, lambda: append_line(metrics_file(run_dir), line), metrics_file(run_dir))

    def checkpoint(self, run_id: str, *, step: int, path: str, loop_state: dict) -> None:
        self.write(run_id, lambda: self.store.add_checkpoint(run_id, step=step, path=path, loop_state=loop_state))

    def keep_newest_checkpoints(self, run_id: str, keep: int) -> None:
        """Remove the run's checkpoints but the ``keep`` saved last (``keep`` >= 1: never the newest, the one a
        resume goes on from), once the records before this are written: each one's run DB record first, so
        that nothing points at a folder half removed, then its folder, then an event saying so."""
        def remove_oldest() -> None:
            for old in self.store.checkpoints_by_age(run_id)[:-keep]:
                self.store.forget_checkpoint(run_id, old.step)
                outcome = removed(Path(old.path))
                self.store.add_event(run_id, "checkpoint", step=old.step, state="", metrics={},
                                     message=f"checkpoint of step {old.step} {outcome} (the run keeps its {keep} "
                                             "newest)")
                log.info("checkpoint_removed", run_id=run_id, step=old.step, path=old.path, outcome=outcome)

        self.write(run_id, remove_oldest)

    def validation(self, run_id: str, *, run_dir: Path, validated: Validated, headline: str) -> None:
        """Its metrics into the step's record and metrics.jsonl, its responses into validation/step_N.jsonl,
        and ``headline`` as an event."""
        step, metrics = validated.step, validated.metrics
        line = json.dumps({"step": step, "time": time.time(), **metrics})
        samples_file = run_dir / "validation" / f"step_{step:06d}.jsonl"
        samples = "".join(json.dumps(sample) + "\n" for sample in validated.samples)
        self.write(run_id, lambda: self.store.record_validation(run_id, step, metrics))
        self.write(run_id, lambda: append_line(metrics_file(run_dir), line), metrics_file(run_dir))

        def write_samples() -> None:
            samples_file.parent.mkdir(exist_ok=True)
            samples_file.write_text(samples)

        self.write(run_id, write_samples, samples_file)
        self.write(run_id, lambda: self.store.add_event(run_id, "validation", step=step, state="", message=headline,
                                                        metrics=metrics))

    def rewind(self, run_id: str, run_dir: Path, step: int) -> None:
        """Forget the metrics of steps after ``step``: they will be run again, and counted once. metrics.jsonl
        is written again from the run DB, which is the truth (the file may end in a line a crash tore)."""
        self.write(run_id, lambda: self.store.forget_steps_after(run_id, step))
        self.write(run_id, lambda: metrics_file(run_dir).write_text(metrics_lines(self.store.step_records(run_id))),
                   metrics_file(run_dir))

    def write(self, run_id: str, do: Callable[[], object], path: Path | None = None) -> None:
        """A write of the run's (into the run DB, or ``path``): through its ``RunWrites`` while it is active,
        so that one the disk refuses waits; else now."""
        writes = self._writes.get(run_id)
        if writes is None:
            do()
        else:
            writes.write(do, path or self.store.path)

    # ------------------------------------------------------------------ the watchers

    def notify(self) -> None:
        """Wake the watchers: the run DB has changed."""
        async def wake():
            async with self._changed:
                self._changed.notify_all()

        asyncio.get_running_loop().create_task(wake())

    async def changed(self, timeout_s: float) -> None:
        """Return once the run DB has changed (``notify``), or after ``timeout_s``."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=timeout_s)
            except TimeoutError:
                pass

    def _disk_changed(self, run_id: str, cause: str | None) -> None:
        if cause is None:
            log.info("disk_takes_writes_again", run_id=run_id)
        else:
            log.warning("run_waits_for_disk", run_id=run_id, cause=cause)
        self.notify()
