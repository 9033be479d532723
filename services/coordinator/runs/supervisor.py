"""One run's supervising task: it drives the run's loop to its end, attempt after attempt.

An attempt connects to the services of the run's placement (waiting for them), builds the run's rollout and
reward sets, its reporter and its ``PPOLoop``, and runs the loop while it watches the run's members: a trainer
that stops heartbeating ends the attempt, a rollout or reward service that does leaves its set. When a service
goes away mid-run (a retryable failure), the run waits for the services and goes on from its last checkpoint,
at most trainer.max_recoveries times. Everything the run says goes through its records (``records.RunRecords``).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import structlog

from services.common.errors import FailedPrecondition, Unavailable
from services.common.paths import inside
from services.common.rpc import is_retryable
from services.coordinator.fleet.clients import TrainerClient
from services.coordinator.disk import disk_fault
from services.coordinator.fleet.env_set import EnvSet
from services.coordinator.step.loop import PPOLoop, Trainers
from services.coordinator.runs.records import RunRecords
from services.coordinator.registry import Registry
from services.coordinator.runs.reporter import RunReporter
from services.coordinator.fleet.reward_set import RewardSet
from services.coordinator.fleet.rollout_set import RolloutSet
from services.coordinator.fleet.targets import ServiceTarget, target_addresses
from services.coordinator.settings import loop_settings, rollout_set_settings
from services.coordinator.store import Checkpoint
from services.coordinator.waiting import RunStopped, describe
from services.run.checks import RunData
from services.run.config import RunConfig
from services.run.plot import plot_run

log = structlog.get_logger()
STOPPED = object()  # wait_to_recover's answer when the run was stopped while it waited
WATCH_INTERVAL_S = 0.5
TRAINER_PROBE_S = 2.0  # after a failure: a trainer that does not answer Info this fast is named as the cause


def recoverable(failure: Exception) -> bool:
    """A failure a run can wait out: a service that went away or stopped answering."""
    if isinstance(failure, grpc.aio.AioRpcError) and failure.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return True  # a service that restarted and lost the run's state
    return is_retryable(failure) or isinstance(failure, (Unavailable, FailedPrecondition))


def samples_dir_within(state_dir: Path, config: RunConfig, run_dir: Path) -> Path | None:
    """Where the run's samples go, resolved, once known to lie inside state_dir (else ValueError naming
    trainer.rollout_data_dir); None: nowhere."""
    chosen = config.samples_dir(run_dir)
    return None if chosen is None else inside(state_dir, chosen, "trainer.rollout_data_dir")


def checkpoint_dir_within(state_dir: Path, config: RunConfig, run_dir: Path) -> Path:
    """Where the run's checkpoints go, resolved, once known to lie inside state_dir (else ValueError naming
    trainer.default_local_dir)."""
    return inside(state_dir, config.checkpoint_dir(run_dir), "trainer.default_local_dir")


def roles(config: RunConfig) -> list[str]:
    if config.trainer.val_only:
        return []
    return ["actor"] + (["critic"] if config.use_critic else []) + (["ref"] if config.use_reference else [])


class RunSupervisor:
    """The task that drives one run, from its start or resume to its final state."""

    def __init__(self, *, run_id: str, config: RunConfig, config_yaml: str, data: RunData, run_dir: Path,
                 records: RunRecords, registry: Registry, state_dir: Path):
        """``config_yaml``: the run config as the trainers load it."""
        self.run_id, self.config, self.config_yaml, self.data, self.run_dir = run_id, config, config_yaml, data, run_dir
        self.records, self.registry, self.state_dir = records, registry, state_dir
        self.stop_requested = False
        self.loop: PPOLoop | None = None  # the loop of the attempt in progress

    def stop(self) -> None:
        """Stop the run at its next step boundary (or while it waits)."""
        self.stop_requested = True

    def attempting(self) -> bool:
        """Whether an attempt's loop is running now (one that can swap its reward or env services)."""
        return self.loop is not None

    def multi_turn(self) -> bool:
        """Whether the run is multi-turn (it has env services to swap)."""
        return self.config.actor_rollout_ref.rollout.multi_turn.enable

    async def swap_reward(self, target: ServiceTarget) -> list[str]:
        """Have the attempt in progress (``attempting``) probe ``target``'s reward services and switch to them at
        its next step boundary (``PPOLoop.swap_reward``)."""
        return await self._attempt().swap_reward(target)

    async def swap_env(self, target: ServiceTarget) -> list[str]:
        """Have the attempt in progress (``attempting``) probe ``target``'s env services and switch to them at its
        next step boundary (``PPOLoop.swap_env``)."""
        return await self._attempt().swap_env(target)

    def _attempt(self) -> PPOLoop:
        """The loop of the attempt in progress; FailedPrecondition when none is (``attempting``)."""
        if self.loop is None:
            raise FailedPrecondition(f"run {self.run_id} has no attempt in progress")
        return self.loop

    async def execute(self, resume: Checkpoint | None = None) -> None:
        """Drive the run to its end. When a service goes away mid-run (a retryable failure), the run waits
        for the services of its placement and continues from its last checkpoint (or from the start), at most
        trainer.max_recoveries times; then, or at once for a failure that would come again (``recoverable``),
        it fails with the failure's cause as its error."""
        run_id, config = self.run_id, self.config
        state, error, recoveries, shut_down = "failed", "", 0, False
        self.records.open(run_id)
        with structlog.contextvars.bound_contextvars(run_id=run_id):
            try:
                self.records.set_state(run_id, "running")
                while True:
                    try:
                        completed = await self.attempt(resume)
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
                        resume = await self.wait_to_recover(failure, recoveries)
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
                try:  # before the final state, so that whoever sees the run end finds its plot
                    await self.plot()
                finally:  # also when the coordinator shuts down while it draws
                    self.records.set_state(run_id, state, error)
                    await self.records.close(run_id, settle=not shut_down)  # a shutdown does not wait for the disk

    async def plot(self) -> None:
        """reward.png (and a multi-turn run's agent.png) in the run's folder; drawn again, with the run's other
        records, once the disk takes it."""
        run_id, plot, store = self.run_id, self.run_dir / "reward.png", self.records.store
        try:
            await asyncio.to_thread(plot_run, store.step_metrics(run_id), self.run_dir, run_id)
        except ImportError as missing:  # a node without matplotlib still keeps the metrics
            log.warning("plot_skipped", run_id=run_id, error=str(missing))
        except OSError as refused:
            if disk_fault(refused, plot) is None:
                raise
            self.records.write(run_id, lambda: plot_run(store.step_metrics(run_id), self.run_dir, run_id), plot)

    async def attempt(self, resume: Checkpoint | None) -> bool:
        """One go at the run with the services up now, from ``resume`` (or the start); True if it completed.

        A trainer of the run that stops heartbeating (killed, stopped, cut off) ends the attempt at once with
        Unavailable naming it, whatever call was waiting on it; a rollout or reward service that does leaves the
        run's rollout or reward set, and the attempt goes on with the others. A run that only validates has no
        trainer."""
        run_id, config, run_dir = self.run_id, self.config, self.run_dir
        trainers = await self.connect()
        reporter = RunReporter(records=self.records, run_id=run_id, run_dir=run_dir,
                               samples_dir=samples_dir_within(self.state_dir, config, run_dir))
        should_stop = lambda: self.stop_requested  # noqa: E731
        rollout_set = RolloutSet(
            run_id=run_id, settings=rollout_set_settings(config), actor=trainers.actor if trainers else None,
            find=lambda: [record.address for record in self.registry.up("rollout", config.placement.rollout)],
            notices=reporter, should_stop=should_stop)
        reward_set = RewardSet(target=ServiceTarget("group", config.placement.reward),
                               find=lambda target: target_addresses(self.registry, "reward", target),
                               notices=reporter, should_stop=should_stop, timeout_s=config.trainer.rpc_timeout_s)
        env_set = None if not self.multi_turn() else EnvSet(
            target=ServiceTarget("group", config.placement.env),
            find=lambda target: target_addresses(self.registry, "env", target),
            notices=reporter, should_stop=should_stop, timeout_s=config.trainer.rpc_timeout_s)
        ppo = PPOLoop(run_id=run_id, settings=loop_settings(config), config_yaml=self.config_yaml, trainers=trainers,
                      rollout_set=rollout_set, reward_set=reward_set, env_set=env_set, prompts=self.data.prompts,
                      val_prompts=self.data.val_prompts, tokenizer=self.data.tokenizer, reporter=reporter,
                      should_stop=should_stop, checkpoint_dir=checkpoint_dir_within(self.state_dir, config, run_dir))
        self.loop = ppo
        try:
            await reporter.open_loggers(config, resume.step + 1 if resume else 0)
            addresses = {client.address for client in trainers.roles()} if trainers else set()
            loop = asyncio.ensure_future(ppo.run(resume))
            watchdog = asyncio.ensure_future(self.watch_members(addresses, rollout_set, reward_set, env_set=env_set))
            await asyncio.wait({loop, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if not loop.done():
                loop.cancel()
                await asyncio.gather(loop, return_exceptions=True)
                return watchdog.result()  # raises the Unavailable that ended the attempt
            watchdog.cancel()
            failure = loop.exception()
            if isinstance(failure, Exception) and recoverable(failure):
                raise await self.name_silent_trainers(list(trainers.roles()) if trainers else [], failure)
            return loop.result()
        finally:
            self.loop = None
            await asyncio.gather(*(client.close() for client in (trainers.roles() if trainers else ())),
                                 rollout_set.close(), reward_set.close(), reporter.close(),
                                 *([env_set.close()] if env_set is not None else []),
                                 *([ppo.agent.close()] if ppo.agent is not None else []))

    async def watch_members(self, trainers: set[str], rollout_set: RolloutSet, reward_set: RewardSet,
                            *, env_set: EnvSet | None = None) -> bool:
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
            if env_set is not None:
                for address in set(env_set.addresses()) & down:
                    await env_set.drop(address, silent)

    @staticmethod
    async def name_silent_trainers(trainers: list[TrainerClient], failure: Exception) -> Exception:
        """``failure``, or, if a trainer does not answer now (the likely cause), Unavailable naming it."""
        answers = await asyncio.gather(*(t.gpu(TRAINER_PROBE_S) for t in trainers),  # any Info answer will do
                                       return_exceptions=True)
        silent = [t.address for t, answer in zip(trainers, answers) if isinstance(answer, BaseException)]
        if not silent:
            return failure
        return Unavailable(f"the trainer at {', '.join(silent)} does not answer ({describe(failure)[:300]})")

    async def wait_to_recover(self, failure: Exception, attempt: int):
        """State ``waiting`` until the run's services are up again; the checkpoint to go on from (None: the
        start), or STOPPED if the run was stopped meanwhile."""
        run_id, config = self.run_id, self.config
        reason = failure.details() if isinstance(failure, grpc.aio.AioRpcError) else str(failure)
        checkpoint = self.records.store.last_checkpoint(run_id)
        # rewound before the state is set: the rewind clears the run's error
        self.records.rewind(run_id, self.run_dir, checkpoint.step if checkpoint else 0)
        self.records.set_state(run_id, "waiting", describe(failure))
        where = f"the checkpoint of step {checkpoint.step}" if checkpoint else "the start"
        message = (f"a service failed ({reason}); waiting for the services, then going on from {where} (recovery "
                   f"{attempt} of {config.trainer.max_recoveries})")
        self.records.event(run_id, "log", step=checkpoint.step if checkpoint else 0, message=message)
        self.records.notify()
        # A dead service stays listed until it misses its heartbeats: wait that long before looking again.
        await asyncio.sleep(self.registry.down_after_s)
        while self.missing():
            if self.stop_requested:
                return STOPPED
            await asyncio.sleep(0.5)
        self.records.set_state(run_id, "running")
        return checkpoint

    def missing(self) -> list[str]:
        """The services of the run's placement that are not up now, described for a person."""
        place = self.config.placement
        wanted = {f"trainer for {role} (group {getattr(place, role)})": ("trainer", getattr(place, role))
                  for role in roles(self.config)}
        wanted |= {f"rollout (group {place.rollout})": ("rollout", place.rollout),
                   f"reward (group {place.reward})": ("reward", place.reward)}
        return [name for name, (kind, group) in wanted.items() if not self.registry.up(kind, group)]

    async def connect(self) -> Trainers | None:
        """Clients of the trainers of the run's placement, one per role (roles placed in the same group share
        it), once every service of the placement is up (waiting for them: state waiting, saying for what); None
        for a run that only validates."""
        run_id, config = self.run_id, self.config
        deadline = time.monotonic() + config.trainer.services_wait_s
        waited = False
        while missing := self.missing():
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
        place, placed = config.placement, roles(config)
        if not placed:
            return None
        trainers = {group: TrainerClient(self.registry.up("trainer", group)[0].address)
                    for group in {getattr(place, role) for role in placed}}
        return Trainers(trainers[place.actor], trainers[place.critic] if config.use_critic else None,
                        trainers[place.ref] if config.use_reference else None)
