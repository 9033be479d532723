"""Runs, as the coordinator's API sees them: start, resume, stop, get, list, watch, and reward and env swaps.

A run is refused before anything starts when its config or data is bad
(ValueError naming the field, or the file and row), and a StartRun refused for
any reason (a full disk too) leaves no run folder and no run DB record. Its state moves
pending -> running -> finished | stopped | failed; each change, each step's
metrics and each log line is an event in the run DB, which WatchRun streams.

Each started or resumed run is driven by a task of its own (``supervisor.RunSupervisor``); what a run says
about itself is written by one object beneath both (``records.RunRecords``).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import grpc
import structlog

from services.common.config import apply_overrides, to_yaml, validate
from services.common.errors import FailedPrecondition, NotFound
from services.common.paths import inside
from services.common.request_text import request_yaml
from services.run.checks import RunData, check_loggers_installed, load_run_data
from services.run.config import RunConfig
from services.coordinator.disk import refused_by_state_dir
from services.coordinator.runs.records import RunRecords
from services.coordinator.registry import Registry
from services.coordinator.settings import check_algorithms_registered, check_within_rollout_limits
from services.coordinator.store import Checkpoint, Event, RunRow, RunStore
from services.coordinator.runs.supervisor import RunSupervisor, checkpoint_dir_within, samples_dir_within
from services.coordinator.fleet.targets import ServiceTarget, named_target

log = structlog.get_logger()
FINAL_STATES = ("finished", "stopped", "failed", "interrupted")


def parse_run_config(config_yaml: str) -> RunConfig:
    """StartRun's run config, read within the limits of a request's YAML (``request_text.request_yaml``), its
    ${...} interpolations resolved (by OmegaConf, which takes seconds for the longest YAML allowed: only where
    there are some); ValueError naming the field or the limit."""
    data = request_yaml(config_yaml, "run config")
    config = validate(RunConfig, apply_overrides(data, []) if "${" in config_yaml else data)
    config.require_paths()
    return config


@contextlib.contextmanager
def removed_unless_done(run_dir: Path):
    """Around the writes into a new run's folder (just made) and its run DB record: a refusal (a full or
    read-only disk) takes the folder away again, so that a refused StartRun leaves no runs/<id> behind (the
    record is one transaction: all or nothing)."""
    try:
        yield
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise


class RunManager:
    def __init__(self, store: RunStore, registry: Registry, state_dir: Path):
        """``store``: the run DB, which this reads and its ``RunRecords`` writes."""
        self.store, self.registry, self.state_dir = store, registry, state_dir
        self.records = RunRecords(store)
        self._supervisors: dict[str, RunSupervisor] = {}  # run -> what drives (or drove) its latest start or resume
        self._tasks: dict[str, asyncio.Task] = {}  # run -> its supervisor's task
        self._attempt_marks: dict[str, int] = {}  # run -> its last event before its latest resume
        self._resuming: set[str] = set()  # runs whose resume is reading their data
        interrupted = [row.run_id for row in store.list_runs() if row.state not in FINAL_STATES]
        self.records.interrupted(interrupted, "the coordinator restarted while the run was active")
        if interrupted:
            asyncio.get_running_loop().create_task(self._resume_all(interrupted))

    async def start_run(self, config_yaml: str) -> tuple[RunRow, int]:
        """Check the run (model folder, data, batch sizes: ValueError naming the key, file or row), then start it;
        its config is recorded with the steps total_epochs comes to, and what it does not use is said once.
        Returns the run and the id of its last event before this call (0 for a new run)."""
        config = await asyncio.to_thread(parse_run_config, config_yaml)  # not on the loop: heartbeats go on
        check_within_rollout_limits(config, {record.address: record.limits
                                             for record in self.registry.up("rollout", config.placement.rollout)})
        check_algorithms_registered(config, {record.address: record.policy_losses
                                             for record in self.registry.up("trainer", config.placement.actor)})
        check_loggers_installed(config.trainer.logger)
        earlier = self._checkpoint_to_resume(config)
        if earlier is not None:
            return await self.resume_run(earlier.run_id, earlier,
                                         f"by trainer.resume_mode={config.trainer.resume_mode}")
        data = await asyncio.to_thread(load_run_data, config)
        config = config.steps_for(len(data.prompts))
        run_id = f"{config.trainer.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        run_dir = self.state_dir / "runs" / run_id
        self._check_checkpoint_dir(config, run_dir)  # before anything is made
        samples_dir_within(self.state_dir, config, run_dir)
        resolved = to_yaml(config)
        with refused_by_state_dir("start the run", self.store.path):
            run_dir.mkdir(parents=True)  # a new id: never a folder there already
            with removed_unless_done(run_dir):
                (run_dir / "config.yaml").write_text(resolved)
                self.records.create(run_id, name=config.trainer.experiment_name, config_yaml=resolved,
                                    run_dir=run_dir, total_steps=config.trainer.steps,
                                    notices=[*config.notices(), *([f"{data.describe()}"] if data.dropped else [])])
        self._drive(run_id, config, resolved, data=data, run_dir=run_dir, resume=None)
        log.info("run_started", run_id=run_id, run_dir=str(run_dir))
        return self.store.get_run(run_id), 0

    async def _resume_all(self, run_ids: list[str]) -> None:
        """After a restart: continue the runs that were active from their last checkpoints."""
        for run_id in run_ids:
            try:
                await self.resume_run(run_id)
            except Exception as error:  # noqa: BLE001 - such a run stays interrupted, for a person to look at
                log.warning("run_not_resumed", run_id=run_id, error=str(error))

    def _checkpoint_to_resume(self, config: RunConfig) -> Checkpoint | None:
        """The checkpoint a new run's trainer.resume_mode asks to go on from instead (verl's meaning): resume_path
        its resume_from_path; auto the latest in default_local_dir, if its run did not finish; else none."""
        trainer = config.trainer
        if trainer.resume_mode == "resume_path":
            if not trainer.resume_from_path:
                raise ValueError("trainer.resume_from_path: trainer.resume_mode=resume_path needs a checkpoint folder")
            found = self.store.checkpoint_at(str(inside(self.state_dir, trainer.resume_from_path,
                                                        "trainer.resume_from_path")))
            if found is None:
                raise ValueError(f"trainer.resume_from_path: {trainer.resume_from_path} is not the checkpoint of a run "
                                 "of this coordinator")
            return found
        chosen = trainer.default_local_dir
        if trainer.resume_mode == "auto" and chosen is not None and Path(chosen).is_absolute():
            latest = self.store.latest_checkpoint_under(
                str(inside(self.state_dir, chosen, "trainer.default_local_dir")))
            if latest is not None and self.store.get_run(latest.run_id).state in ("stopped", "failed", "interrupted"):
                return latest
        return None

    def _check_checkpoint_dir(self, config: RunConfig, run_dir: Path) -> None:
        """Refuse (ValueError naming trainer.default_local_dir) a new run's checkpoint folder outside state_dir, or
        one that holds another run's checkpoints: its saves would replace them."""
        folder = checkpoint_dir_within(self.state_dir, config, run_dir)
        taken = self.store.latest_checkpoint_under(str(folder))
        if taken is not None:
            raise ValueError(f"trainer.default_local_dir: {folder} holds the checkpoints of run {taken.run_id} "
                             f"({self.store.get_run(taken.run_id).state}), which a new run's would replace: give it "
                             "a folder of its own")

    async def resume_run(self, run_id: str, checkpoint: Checkpoint | None = None, why: str = "") -> tuple[RunRow, int]:
        """Continue a stopped, failed or interrupted run from ``checkpoint`` (by default its last complete one); an
        interrupted run without one (the coordinator died before its first) runs again from the start. Returns
        the run and the id of its last event before this call (what follows it is this resume)."""
        row, mark = self.get_run(run_id), self.store.last_event_id(run_id)
        if self._active(run_id):  # resumed already: by a coordinator that restarted, or by a call just before
            return row, self._attempt_marks.get(run_id, mark)
        if row.state not in ("stopped", "failed", "interrupted"):
            raise FailedPrecondition(f"run {run_id} is {row.state}; only a stopped, failed or interrupted run resumes")
        checkpoint = checkpoint or self.store.last_checkpoint(run_id)
        if checkpoint is None and row.state != "interrupted":
            raise FailedPrecondition(f"run {run_id} has no checkpoint to resume from")
        config = parse_run_config(row.config_yaml)
        self._resuming.add(run_id)  # before the first await: a second resume meanwhile finds it active
        self._attempt_marks[run_id] = mark
        try:
            data = await asyncio.to_thread(load_run_data, config)
            run_dir, step = Path(row.run_dir), checkpoint.step if checkpoint else 0
            with refused_by_state_dir(f"resume run {run_id}", self.store.path):
                self.records.rewind(run_id, run_dir, step)
                if checkpoint is None:
                    self.records.event(run_id, "log", step=0, message="no checkpoint to resume from: running it "
                                       "again from the start")
                elif why:
                    self.records.event(run_id, "log", step=step, message=f"going on from the checkpoint of step "
                                       f"{step} {why} (with the run's own config)")
            self._drive(run_id, config, row.config_yaml, data=data, run_dir=run_dir, resume=checkpoint)
        finally:
            self._resuming.discard(run_id)
        log.info("run_resumed", run_id=run_id, step=step)
        return self.store.get_run(run_id), mark

    def _drive(self, run_id: str, config: RunConfig, config_yaml: str, *, data: RunData, run_dir: Path,
               resume: Checkpoint | None) -> None:
        """Start the task that drives the run, from ``resume`` (None: the start)."""
        supervisor = self._supervisors[run_id] = RunSupervisor(
            run_id=run_id, config=config, config_yaml=config_yaml, data=data, run_dir=run_dir, records=self.records,
            registry=self.registry, state_dir=self.state_dir)
        self._tasks[run_id] = asyncio.create_task(supervisor.execute(resume))

    def _active(self, run_id: str) -> bool:
        """Whether the run is being driven (or about to be) by this coordinator."""
        return run_id in self._resuming or (run_id in self._tasks and not self._tasks[run_id].done())

    def get_run(self, run_id: str) -> RunRow:
        """The run as a person should see it: waiting, for the disk's refusal, while its records wait for the
        disk (the run DB itself may not take that state)."""
        try:
            return self.records.as_seen(self.store.get_run(run_id))
        except LookupError:
            raise NotFound(f"no run {run_id!r}") from None

    def list_runs(self) -> list[RunRow]:
        return [self.records.as_seen(row) for row in self.store.list_runs()]

    def stop_run(self, run_id: str) -> RunRow:
        row = self.get_run(run_id)
        if row.state not in FINAL_STATES:
            self._supervisors[run_id].stop()
            self.records.event(run_id, "log", step=row.step, message="stop requested: stopping at the next step "
                               "boundary (in the warm start, the next warm-start step's)")
            self.records.notify()
        return self.get_run(run_id)

    async def set_reward(self, run_id: str, group: str, address: str) -> RunRow:
        """Probe the named reward services, then have the run switch to them at its next step boundary.

        Refused (FailedPrecondition, recorded as a reward event) when the run is not running, or when a
        service does not answer the probe with valid scores; the run then keeps the services it has.
        """
        target = named_target(group, address)
        supervisor = self._running_supervisor(run_id)
        return await self._swap(run_id, "reward", target, swap=supervisor.swap_reward)

    async def set_env(self, run_id: str, group: str, address: str) -> RunRow:
        """Probe the named env services, then have the multi-turn run switch to them at its next step boundary.

        Refused (FailedPrecondition) when the run is not multi-turn or not running; refused and recorded as an
        env event when a service does not host the run's environment or cannot open and close an episode of it
        on one of the run's rows: the run then keeps the services it has.
        """
        target = named_target(group, address)
        supervisor = self._supervisors.get(run_id)
        if supervisor is not None and not supervisor.multi_turn():
            raise FailedPrecondition(f"run {run_id} is not multi-turn (actor_rollout_ref.rollout.multi_turn.enable "
                                     f"is off): it has no env services to swap")
        supervisor = self._running_supervisor(run_id)
        return await self._swap(run_id, "env", target, swap=supervisor.swap_env)

    def _running_supervisor(self, run_id: str) -> RunSupervisor:
        """The supervisor of a run whose attempt is running now; FailedPrecondition naming its state otherwise."""
        row, supervisor = self.get_run(run_id), self._supervisors.get(run_id)
        if row.state != "running" or supervisor is None or not supervisor.attempting():
            raise FailedPrecondition(f"run {run_id} is {row.state}, not running")
        return supervisor

    async def _swap(self, run_id: str, kind: str, target: ServiceTarget,
                    *, swap: Callable[[ServiceTarget], Awaitable[list[str]]]) -> RunRow:
        """``swap(target)`` for the run's ``kind`` (reward, env) services, its outcome recorded as an event of that
        kind; FailedPrecondition saying why if it fails."""
        step = self.get_run(run_id).step
        try:
            addresses = await swap(target)
        except Exception as error:  # noqa: BLE001 - any failure refuses the swap
            reason = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else error
            message = f"{kind} swap to {target} refused: {reason}"
            self.records.event(run_id, kind, step=step, message=message)
            log.warning("swap_refused", kind=kind, run_id=run_id, target=str(target), error=str(error))
            self.records.notify()
            raise FailedPrecondition(message) from None
        accepted = f"{kind} swap to {target} accepted; applies at the next step boundary"
        self.records.event(run_id, kind, step=step, message=accepted)
        log.info("swap_accepted", kind=kind, run_id=run_id, target=str(target), addresses=addresses)
        self.records.notify()
        return self.get_run(run_id)

    async def watch(self, run_id: str, after_event_id: int = 0) -> AsyncIterator[Event]:
        """Every event of the run after ``after_event_id`` (0: from its start), then live ones, until the run
        ends."""
        self.get_run(run_id)
        last = after_event_id
        while True:
            events = self.store.events_after(run_id, last)
            for event in events:
                last = event.id
                yield event
            if events:  # look again at once: the run's last event ends the stream now, not a second later
                continue
            if self.store.get_run(run_id).state in FINAL_STATES:
                return
            await self.records.changed(timeout_s=1.0)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
