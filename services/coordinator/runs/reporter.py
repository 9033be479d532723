"""Where a run's loop reports (``loop.Reporter``): the run's records, its experiment loggers, the log and the
coordinator's metrics.

The reporter asks the run's records (``records.RunRecords``) for every record it makes; they hold one the disk
refuses, and the run waits for the disk at the end of its step. Only a step's samples file
(trainer.rollout_data_dir, large) is written here, on a worker thread, and held by the records when the disk
refuses it.
The experiment loggers are not records: one that fails is logged.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import structlog

from services.coordinator import telemetry
from services.coordinator.disk import disk_fault
from services.coordinator.runs.loggers import Loggers, RunNames, open_loggers
from services.coordinator.runs.records import RunRecords
from services.coordinator.store import Checkpoint
from services.coordinator.step.validation import Validated, headline
from services.run.config import RunConfig

log = structlog.get_logger()


class RunReporter:
    """What one attempt at a run reports through, from its loop and its rollout and reward sets."""

    def __init__(self, *, records: RunRecords, run_id: str, run_dir: Path, samples_dir: Path | None):
        """``samples_dir``: where each step's samples go (trainer.rollout_data_dir; None: nowhere)."""
        self.records, self.run_id, self.run_dir = records, run_id, run_dir
        self.samples_dir = samples_dir
        self.loggers = Loggers({})  # trainer.logger's, from open_loggers to close

    async def open_loggers(self, config: RunConfig, first_step: int) -> None:
        names = RunNames(run_id=self.run_id, project=config.trainer.project_name,
                         experiment=config.trainer.experiment_name, config=config.model_dump(mode="json"))
        self.loggers = await asyncio.to_thread(open_loggers, config.trainer.logger, self.run_dir, names,
                                               first_step=first_step)

    async def close(self) -> None:
        await asyncio.to_thread(self.loggers.close)

    async def step(self, step: int, metrics: dict[str, float]) -> None:
        self.records.step(self.run_id, run_dir=self.run_dir, step=step, metrics=metrics)
        telemetry.step_done(self.run_id, step, metrics)
        self.loggers.log(step, metrics)
        log.info("step_done", run_id=self.run_id, step=step, reward=metrics.get("critic/score/mean"),
                 step_s=metrics.get("timing_s/step"))
        self.records.notify()
        await self.records.settle(self.run_id)

    def checkpoint(self, step: int, path: str, loop_state: dict, *, keep: int | None) -> None:
        self.records.checkpoint(self.run_id, step=step, path=path, loop_state=loop_state)
        self.log(f"checkpoint of step {step} saved in {path}", kind="checkpoint")
        if keep is not None:
            self.records.keep_newest_checkpoints(self.run_id, keep)

    def damaged(self, checkpoint: Checkpoint, reason: str) -> Checkpoint | None:
        earlier = self.records.store.last_checkpoint(self.run_id, before=checkpoint.step)
        instead = f"going on from the checkpoint of step {earlier.step} before it" if earlier else "none is older"
        self.log(f"the checkpoint of step {checkpoint.step} cannot be loaded ({reason}): {instead}")
        if earlier is not None:
            self.records.rewind(self.run_id, self.run_dir, earlier.step)
        return earlier

    def log(self, message: str, kind: str = "log") -> None:
        self.records.event(self.run_id, kind, step=self.records.store.get_run(self.run_id).step, message=message)
        log.info("run_log", run_id=self.run_id, kind=kind, message=message)
        self.records.notify()

    def waiting(self, reason: str | None) -> None:
        self.records.set_state(self.run_id, "waiting" if reason else "running", reason or "")

    async def samples(self, step: int, records: list[dict]) -> None:
        """Into <samples_dir>/<step>.jsonl (verl's file), replacing the one of an earlier attempt at the step; whole
        or not at all for a reader (written aside, then renamed). Written on a worker thread; one the disk refuses
        is held with the run's records, and written again with them once it takes them."""
        assert self.samples_dir is not None, "samples are asked for only with a samples_dir (keep_samples)"
        path = self.samples_dir / f"{step}.jsonl"
        text = await asyncio.to_thread(lambda: "".join(json.dumps(record) + "\n" for record in records))

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            written = path.with_name(path.name + ".tmp")
            written.write_text(text)
            written.replace(path)

        try:
            await asyncio.to_thread(write)
        except OSError as refused:
            if disk_fault(refused, path) is None:
                raise
            self.records.write(self.run_id, write, path)

    def disk_waiting(self, cause: str | None) -> None:
        self.records.wait_for_disk(self.run_id, cause)

    def validation(self, validated: Validated) -> None:
        """Its metrics into the step's record and metrics.jsonl, its responses into validation/step_N.jsonl."""
        self.records.validation(self.run_id, run_dir=self.run_dir, validated=validated, headline=headline(validated))
        self.loggers.log(validated.step, validated.metrics)
        log.info("validated", run_id=self.run_id, step=validated.step, weight_version=validated.version,
                 samples=len(validated.samples), seconds=validated.metrics.get("timing_s/testing"))
        self.records.notify()
