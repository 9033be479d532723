"""Runs: start, stop, watch, and the task that drives each one's loop.

A run is refused before anything starts when its config or data is bad
(ValueError naming the field, or the file and row). Its state moves
pending -> running -> finished | stopped | failed; each change, each step's
metrics and each log line is an event in the run DB, which WatchRun streams.
What a run says about itself is written by one object (``records.RunRecords``); its loop reports through a
``reporter.RunReporter``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import AsyncIterator

import grpc
import structlog

from services.common.config import apply_overrides, parse_yaml, to_yaml, validate
from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.common.paths import inside
from services.common.rpc import is_retryable
from services.run.checks import RunData, check_loggers_installed, load_run_data
from services.run.config import RunConfig
from services.coordinator.clients import TrainerClient
from services.coordinator.disk import disk_fault, refused_by_state_dir
from services.coordinator.loop import PPOLoop, Trainers
from services.run.plot import plot_reward
from services.coordinator.records import RunRecords
from services.coordinator.registry import Registry
from services.coordinator.reporter import RunReporter
from services.coordinator.reward_set import RewardSet, RewardTarget, probe_samples
from services.coordinator.rollout_set import RolloutSet
from services.coordinator.settings import check_within_rollout_limits, loop_settings, rollout_set_settings
from services.coordinator.store import Checkpoint, Event, RunRow, RunStore
from services.coordinator.waiting import RunStopped, describe

log = structlog.get_logger()
FINAL_STATES = ("finished", "stopped", "failed", "interrupted")
STOPPED = object()  # _wait_to_recover's answer when the run was stopped while it waited
WATCH_INTERVAL_S = 0.5
TRAINER_PROBE_S = 2.0  # after a failure: a trainer that does not answer Info this fast is named as the cause


def recoverable(failure: Exception) -> bool:
    """A failure a run can wait out: a service that went away or stopped answering."""
    if isinstance(failure, grpc.aio.AioRpcError) and failure.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return True  # a service that restarted and lost the run's state
    return is_retryable(failure) or isinstance(failure, (Unavailable, FailedPrecondition))


def parse_run_config(config_yaml: str) -> RunConfig:
    data = parse_yaml(config_yaml, "run config") or {}
    if not isinstance(data, dict):
        raise ValueError("run config must be a mapping")
    config = validate(RunConfig, apply_overrides(data, []))  # its ${...} interpolations resolved
    config.require_paths()
    return config


class RunManager:
    def __init__(self, store: RunStore, registry: Registry, state_dir: Path):
        """``store``: the run DB, which this reads and its ``RunRecords`` writes."""
        self.store, self.registry, self.state_dir = store, registry, state_dir
        self.records = RunRecords(store)
        self._tasks: dict[str, asyncio.Task] = {}
        self._loops: dict[str, PPOLoop] = {}
        self._stop_requested: set[str] = set()
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
        self._samples_dir(config, run_dir)
        resolved = to_yaml(config)
        with refused_by_state_dir("start the run", self.store.path):
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(resolved)
            self.records.create(run_id, config.trainer.experiment_name, resolved, run_dir, config.trainer.steps,
                                [*config.notices(), *([f"{data.describe()}"] if data.dropped else [])])
        self._tasks[run_id] = asyncio.create_task(self._execute(run_id, config, resolved, data, run_dir))
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
        folder = self._checkpoint_dir(config, run_dir)
        taken = self.store.latest_checkpoint_under(str(folder))
        if taken is not None:
            raise ValueError(f"trainer.default_local_dir: {folder} holds the checkpoints of run {taken.run_id} "
                             f"({self.store.get_run(taken.run_id).state}), which a new run's would replace: give it "
                             "a folder of its own")

    def _samples_dir(self, config: RunConfig, run_dir: Path) -> Path | None:
        """Where the run's samples go, resolved, once known to lie inside state_dir (else ValueError naming
        trainer.rollout_data_dir); None: nowhere."""
        chosen = config.samples_dir(run_dir)
        return None if chosen is None else inside(self.state_dir, chosen, "trainer.rollout_data_dir")

    def _checkpoint_dir(self, config: RunConfig, run_dir: Path) -> Path:
        """Where the run's checkpoints go, resolved, once known to lie inside state_dir (else ValueError naming
        trainer.default_local_dir)."""
        return inside(self.state_dir, config.checkpoint_dir(run_dir), "trainer.default_local_dir")

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
                    self.records.event(run_id, "log", 0, "no checkpoint to resume from: running it again from the "
                                       "start")
                elif why:
                    self.records.event(run_id, "log", step, f"going on from the checkpoint of step {step} {why} "
                                       "(with the run's own config)")
            self._stop_requested.discard(run_id)
            self._tasks[run_id] = asyncio.create_task(
                self._execute(run_id, config, row.config_yaml, data, run_dir, checkpoint))
        finally:
            self._resuming.discard(run_id)
        log.info("run_resumed", run_id=run_id, step=step)
        return self.store.get_run(run_id), mark

    def _active(self, run_id: str) -> bool:
        """Whether the run is being driven (or about to be) by this coordinator."""
        return run_id in self._resuming or (run_id in self._tasks and not self._tasks[run_id].done())

    async def _execute(self, run_id: str, config: RunConfig, config_yaml: str, data: RunData, run_dir: Path,
                       resume: Checkpoint | None = None) -> None:
        """Drive the run to its end. When a service goes away mid-run (a retryable failure), the run waits
        for the services of its placement and continues from its last checkpoint (or from the start), at most
        trainer.max_recoveries times; then, or at once for a failure that would come again (``recoverable``),
        it fails with the failure's cause as its error."""
        state, error, recoveries, shut_down = "failed", "", 0, False
        self.records.open(run_id)
        with structlog.contextvars.bound_contextvars(run_id=run_id):
            try:
                self.records.set_state(run_id, "running")
                while True:
                    try:
                        completed = await self._attempt(run_id, config, config_yaml, data, run_dir, resume)
                        state = "finished" if completed else "stopped"
                        break
                    except Exception as failure:  # sorted below
                        if not recoverable(failure):
                            raise
                        if recoveries >= config.trainer.max_recoveries:  # state stays failed
                            error = (f"{describe(failure)} (in the last of 1 + trainer.max_recoveries="
                                     f"{config.trainer.max_recoveries} attempts)")
                            log.warning("run_failed", run_id=run_id, error=error)
                            break
                        recoveries += 1
                        resume = await self._wait_to_recover(run_id, config, run_dir, failure, recoveries)
                        if resume is STOPPED:
                            state = "stopped"
                            break
            except RunStopped as stopped:
                state, error = "stopped", str(stopped)
            except asyncio.CancelledError:
                state, error, shut_down = "stopped", "the coordinator shut down", True
                raise
            except Exception as failure:  # a run's failure is recorded, not raised
                log.exception("run_failed", run_id=run_id)
                error = describe(failure)
            finally:
                plot = run_dir / "reward.png"
                try:  # before the final state, so that whoever sees the run end finds its plot
                    await asyncio.to_thread(plot_reward, self.store.step_metrics(run_id), plot, run_id)
                except ImportError as missing:  # a node without matplotlib still keeps the metrics
                    log.warning("plot_skipped", run_id=run_id, error=str(missing))
                except OSError as refused:  # drawn again, with the run's other records, once the disk takes it
                    if disk_fault(refused, plot) is None:
                        raise
                    self.records.write(run_id, lambda: plot_reward(self.store.step_metrics(run_id), plot, run_id),
                                       plot)
                finally:  # also when the coordinator shuts down while it draws
                    self.records.set_state(run_id, state, error)
                    await self.records.close(run_id, settle=not shut_down)  # a shutdown does not wait for the disk

    async def _attempt(self, run_id: str, config: RunConfig, config_yaml: str, data: RunData, run_dir: Path,
                       resume: Checkpoint | None) -> bool:
        """One go at the run with the services up now, from ``resume`` (or the start); True if it completed.

        A trainer of the run that stops heartbeating (killed, stopped, cut off) ends the attempt at once with
        Unavailable naming it, whatever call was waiting on it; a rollout or reward service that does leaves the
        run's rollout or reward set, and the attempt goes on with the others. A run that only validates has no
        trainer."""
        trainers = await self._connect(run_id, config)
        reporter = RunReporter(self.records, run_id, run_dir, self._samples_dir(config, run_dir))
        should_stop = lambda: run_id in self._stop_requested  # noqa: E731
        rollout_set = RolloutSet(run_id, rollout_set_settings(config), trainers.actor if trainers else None,
                                 lambda: [record.address
                                          for record in self.registry.up("rollout", config.placement.rollout)],
                                 reporter, should_stop)
        reward_set = RewardSet(RewardTarget("group", config.placement.reward), self.reward_addresses, reporter,
                               should_stop, config.trainer.rpc_timeout_s)
        ppo = PPOLoop(run_id=run_id, settings=loop_settings(config), config_yaml=config_yaml, trainers=trainers,
                      rollout_set=rollout_set, reward_set=reward_set, prompts=data.prompts,
                      val_prompts=data.val_prompts, tokenizer=data.tokenizer, reporter=reporter,
                      should_stop=should_stop, checkpoint_dir=self._checkpoint_dir(config, run_dir))
        self._loops[run_id] = ppo
        try:
            await reporter.open_loggers(config, resume.step + 1 if resume else 0)
            addresses = {client.address for client in trainers.roles()} if trainers else set()
            loop = asyncio.ensure_future(ppo.run(resume))
            watchdog = asyncio.ensure_future(self._watch_members(addresses, rollout_set, reward_set))
            await asyncio.wait({loop, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if not loop.done():
                loop.cancel()
                await asyncio.gather(loop, return_exceptions=True)
                return watchdog.result()  # raises the Unavailable that ended the attempt
            watchdog.cancel()
            if loop.exception() is not None and recoverable(loop.exception()):
                raise await self._name_silent_trainers(list(trainers.roles()) if trainers else [], loop.exception())
            return loop.result()
        finally:
            self._loops.pop(run_id, None)
            await asyncio.gather(*(client.close() for client in (trainers.roles() if trainers else ())),
                                 rollout_set.close(), reward_set.close(), reporter.close())

    async def _watch_members(self, trainers: set[str], rollout_set: RolloutSet, reward_set: RewardSet) -> bool:
        """Raise Unavailable once a trainer is no longer up in the registry; drop a rollout that is no longer
        up from the run's rollout set, and a reward service that is registered but silent from its reward set
        (one a swap named by address may be one that does not register). Silence while the coordinator itself
        did not run (stopped, starved) is not the services': they get a fresh window."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if time.monotonic() - last > WATCH_INTERVAL_S + self.registry.heartbeat_interval_s:
                self.registry.woke()
            last = time.monotonic()
            up = {record.address for record in self.registry.all() if self.registry.is_up(record)}
            down = {record.address for record in self.registry.all()} - up
            silent = f"no heartbeat for {self.registry.down_after_s:.0f} s"
            for address in trainers - up:
                raise Unavailable(f"the trainer at {address} stopped answering ({silent})")
            for address in set(rollout_set.addresses()) - up:
                await rollout_set.drop(address, silent)
            for address in set(reward_set.addresses()) & down:
                await reward_set.drop(address, silent)

    @staticmethod
    async def _name_silent_trainers(trainers: list[TrainerClient], failure: Exception) -> Exception:
        """``failure``, or, if a trainer does not answer now (the likely cause), Unavailable naming it."""
        answers = await asyncio.gather(*(t.gpu(TRAINER_PROBE_S) for t in trainers),
                                       return_exceptions=True)  # any Info answer
        silent = [t.address for t, answer in zip(trainers, answers) if isinstance(answer, BaseException)]
        if not silent:
            return failure
        return Unavailable(f"the trainer at {', '.join(silent)} does not answer ({describe(failure)[:300]})")

    async def _wait_to_recover(self, run_id: str, config: RunConfig, run_dir: Path, failure: Exception,
                               attempt: int):
        """State ``waiting`` until the run's services are up again; the checkpoint to go on from (None: the
        start), or STOPPED if the run was stopped meanwhile."""
        reason = failure.details() if isinstance(failure, grpc.aio.AioRpcError) else str(failure)
        checkpoint = self.store.last_checkpoint(run_id)
        # rewound before the state is set: the rewind clears the run's error
        self.records.rewind(run_id, run_dir, checkpoint.step if checkpoint else 0)
        self.records.set_state(run_id, "waiting", describe(failure))
        where = f"the checkpoint of step {checkpoint.step}" if checkpoint else "the start"
        message = (f"a service failed ({reason}); waiting for the services, then going on from {where} (recovery "
                   f"{attempt} of {config.trainer.max_recoveries})")
        self.records.event(run_id, "log", checkpoint.step if checkpoint else 0, message)
        self.records.notify()
        # A dead service stays listed until it misses its heartbeats: wait that long before looking again.
        await asyncio.sleep(self.registry.down_after_s)
        while not self._services_up(config):
            if run_id in self._stop_requested:
                return STOPPED
            await asyncio.sleep(0.5)
        self.records.set_state(run_id, "running")
        return checkpoint

    @staticmethod
    def _roles(config: RunConfig) -> list[str]:
        if config.trainer.val_only:
            return []
        return ["actor"] + (["critic"] if config.use_critic else []) + (["ref"] if config.use_reference else [])

    def _missing(self, config: RunConfig) -> list[str]:
        """The services of the run's placement that are not up now, described for a person."""
        place = config.placement
        wanted = {f"trainer for {role} (group {getattr(place, role)})": ("trainer", getattr(place, role))
                  for role in self._roles(config)}
        wanted |= {f"rollout (group {place.rollout})": ("rollout", place.rollout),
                   f"reward (group {place.reward})": ("reward", place.reward)}
        return [name for name, (kind, group) in wanted.items() if not self.registry.up(kind, group)]

    def _services_up(self, config: RunConfig) -> bool:
        return not self._missing(config)

    async def _connect(self, run_id: str, config: RunConfig) -> Trainers | None:
        """Clients of the trainers of the run's placement, one per role (roles placed in the same group share
        it), once every service of the placement is up (waiting for them: state waiting, saying for what); None
        for a run that only validates."""
        deadline = time.monotonic() + config.trainer.services_wait_s
        waited = False
        while missing := self._missing(config):
            if time.monotonic() > deadline:
                raise FailedPrecondition(f"no {', '.join(missing)} registered within "
                                         f"trainer.services_wait_s={config.trainer.services_wait_s}")
            if not waited:
                self.records.set_state(run_id, "waiting", f"no {', '.join(missing)} is up: waiting up to "
                                                          f"{config.trainer.services_wait_s:.0f} s for one to register")
                waited = True
            await asyncio.sleep(0.2)
        if waited:
            self.records.set_state(run_id, "running")
        place, roles = config.placement, self._roles(config)
        if not roles:
            return None
        trainers = {group: TrainerClient(self.registry.up("trainer", group)[0].address)
                    for group in {getattr(place, role) for role in roles}}
        return Trainers(trainers[place.actor], trainers[place.critic] if config.use_critic else None,
                        trainers[place.ref] if config.use_reference else None)

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
            self._stop_requested.add(run_id)
            self.records.event(run_id, "log", row.step, "stop requested: stopping at the next step boundary")
            self.records.notify()
        return self.get_run(run_id)

    def reward_addresses(self, target: RewardTarget) -> list[str]:
        if target.kind == "address":
            return [target.name]
        return [record.address for record in self.registry.up("reward", target.name)]

    async def set_reward(self, run_id: str, group: str, address: str) -> RunRow:
        """Probe the named reward services, then have the run switch to them at its next step boundary.

        Refused (FailedPrecondition, recorded as a reward event) when the run is not running, or when a
        service does not answer the probe with valid scores; the run then keeps the services it has.
        """
        row, loop = self.get_run(run_id), self._loops.get(run_id)
        if (group == "") == (address == ""):
            raise ValueError("name exactly one of group or address")
        target = RewardTarget("group", group) if group else RewardTarget("address", address)
        if row.state != "running" or loop is None:
            raise FailedPrecondition(f"run {run_id} is {row.state}, not running")
        try:
            addresses = await loop.reward_set.swap(target, probe_samples(loop.prompts))
        except Exception as error:  # noqa: BLE001 - any failure refuses the swap
            reason = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.aio.AioRpcError) else error
            message = f"reward swap to {target} refused: {reason}"
            self.records.event(run_id, "reward", row.step, message)
            log.warning("reward_swap_refused", run_id=run_id, target=str(target), error=str(error))
            self.records.notify()
            raise FailedPrecondition(message) from None
        accepted = f"reward swap to {target} accepted; applies at the next step boundary"
        self.records.event(run_id, "reward", row.step, accepted)
        log.info("reward_swap_accepted", run_id=run_id, target=str(target), addresses=addresses)
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
            if not events and self.store.get_run(run_id).state in FINAL_STATES:
                return
            await self.records.changed(timeout_s=1.0)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
