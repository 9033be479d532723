"""A run's rollout replicas: who generates for it, and when that changes.

The members take the weights over the run's weight channels (``WeightChannels``, which this set owns and asks
to form and send; weight_channels.py says how they are planned and formed); only those sharing the trainer's
device sleep while the trainer works (``sleep``, with free_cache_engine).

Who generates for a run changes only where no sample can come from stale
weights, and no trainer state is lost when a rollout goes:
- Members joined the current channel and serve ``version``. One that stops
  heartbeating (``drop``, called by the run's watchdog) leaves at once: its
  calls in flight are cancelled and its share of the step is redone on the
  others (ReplicaPool); the channel is re-formed without it before the next sync.
- At each step boundary (``refresh``) the members and the placement's rollout
  group are probed. A member that does not answer leaves; a rollout that
  (re)registered, or a member that answers with other weights (one stopped and
  resumed), is taken in: it loads the run's model if it has not, joins a fresh
  channel with the actor and the other members, and receives the current
  weights before it serves any Generate.
- A sync that fails (``sync``: a member died or stalled mid-broadcast, the
  collective errored or timed out) is an event naming the members not serving
  the new version; the channel is re-formed with those that still answer and
  the same version is sent again. A member that leaves mid-sync fails it at
  once: the trainer's side is not waited for, it would wait for that member
  until the channel's deadline.
- After each sync every member scores the run's weight probe (``WeightProbe``; from the first batch trained on,
  where actor_rollout_ref.rollout.weight_check is on). A member over its tolerance is sent the weights once
  more; over it again, it leaves the run with an event naming the version, its probe's mean and max
  |delta logprob| and top-k KL and the tolerance, and is not taken in again until its process is another
  (restarted). When
  that leaves no rollout, the run fails (``WeightCheckFailed``) rather than waiting: the trainer or the tolerance
  is then as likely at fault as every rollout.
- With no rollout left the run waits (state ``waiting``) until one answers, then
  goes on where it was: the trainer's state is intact, nothing is rewound.
- The loop's sync and a generation ahead of it (which refreshes when every
  member failed it) may both find that a member went or a rollout came: they
  change the set one at a time (``_changing``), and the second, once the first
  is done, finds every member serving and changes nothing. (Two at once asked a
  restarted rollout to load the run's model twice at once.) A refresh sends the
  actor's weights as they are then, which the loop's update may have moved past
  ``version`` meanwhile; the members serve that version from then on.
- A channel that fails to form FORM_ATTEMPTS times in a row ends the attempt,
  naming the first cause (``weight_channels.not_formed``): the run fails, or
  waits for its services and goes on from its checkpoint.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import structlog
import torch

from services.common.errors import Unavailable
from services.common.rpc import is_retryable
from services.common.sequences import SequenceBatch
from services.coordinator.fleet.clients import RolloutClient, RolloutInfo, TrainerClient
from services.coordinator.fleet.dispatch import ReplicaPool, ReplicaSpeeds
from services.coordinator.settings import RolloutSetSettings
from services.coordinator.waiting import Notices, describe, wait_for
from services.coordinator.fleet.weight_channels import WeightChannels, not_formed, weights_named
from services.coordinator.fleet.weight_probe import ProbeResult, WeightCheckFailed, WeightProbe

log = structlog.get_logger()
PROBE_TIMEOUT_S = 2.0  # a rollout that does not answer Info this fast is out (stopped, cut off, dead)
FORM_ATTEMPTS = 3  # channel formations in a row that may fail (a member died while joining) before giving up
SYNC_ATTEMPTS = 3  # sends of one version in a row that may fail before the attempt gives up


class RolloutSet:
    def __init__(self, run_id: str, settings: RolloutSetSettings, actor: TrainerClient | None,
                 *, find: Callable[[], list[str]], notices: Notices, should_stop: Callable[[], bool],
                 connect: Callable[[str], RolloutClient] = RolloutClient):
        """``actor``: None for a run without a trainer (it only validates: ``load``, never a channel); ``find``:
        the addresses of the placement's rollout group that are up now; ``connect``: a client of the rollout at
        an address."""
        self.run_id, self.settings, self.actor, self.find, self.connect = run_id, settings, actor, find, connect
        self.notices, self.should_stop = notices, should_stop
        self.members: list[RolloutClient] = []
        self.pool: ReplicaPool[RolloutClient] | None = None  # the members, for spreading a batch
        self.speeds = ReplicaSpeeds()  # each member's generated tokens per second: its share of a batch
        self.ranks: dict[str, int] = {}  # channel ranks each member's engine takes
        self.version = -1  # the weights every member must serve
        self.served = -1  # the weights every member is known to serve (version, once its sync is done)
        self.pause_s = 0.0  # of the last sync: the longest a member held generation back for the swap
        self.memory: dict[str, float] = {}  # of the last sync: the most memory any member reported, by metric
        self.stale = True  # the channel lacks a member or has one too many: form a new one before a sync
        self.channels = WeightChannels(run_id, settings, actor, members=lambda: self.members)
        self._joined: set[str] = set()  # the rollouts of the last channel formed
        self.probe = WeightProbe(settings.weight_check, settings.dtype, actor, timeout_s=settings.rpc_timeout_s) if (
            settings.weight_check is not None and actor is not None) else None
        self.probe_s = 0.0  # of the last sync: the weight check's seconds
        self.probe_metrics: dict[str, float] = {}  # of the last sync's weight check: the worst member's
        self.engines: dict[str, str] = {}  # each rollout's engine (hf, vllm), by address
        self.service_ids: dict[str, str] = {}  # each rollout's process, by address
        self.refused: set[str] = set()  # processes (service ids) that failed the weight check twice: never taken in
        self._changing = asyncio.Lock()  # held by form, load, refresh and sync: one change of the set at a time


    def spread(self) -> ReplicaPool[RolloutClient]:
        """The members as a pool to spread a batch over; Unavailable while the set has none (a refresh finds some,
        waiting for one)."""
        if self.pool is None:
            raise Unavailable(f"run {self.run_id} has no rollout replica")
        return self.pool
    def addresses(self) -> list[str]:
        return [member.address for member in self.members]

    @property
    def devices(self) -> int:
        """The devices the trainer and the members compute on, as last formed (``weight_channels.devices_held``)."""
        return self.channels.devices

    async def drop(self, address: str, reason: str) -> None:
        """Take a member out now: no further work goes to it, its calls in flight fail and are redone."""
        member = next((m for m in self.members if m.address == address), None)
        if member is None:
            return
        self.members.remove(member)
        self._joined.discard(address)  # if it comes back, it is taken in anew (and measured anew)
        self.speeds.forget(address)
        if self.pool is not None:
            self.pool.drop(member)
        self.stale = True
        rest = f"its work goes to {', '.join(self.addresses())}" if self.members else "no rollout is left"
        log.warning("rollout_left", address=address, reason=reason)
        self.notices.log(f"rollout {address} left the run ({reason}); {rest}")
        await member.close()

    async def form(self) -> None:
        """Before the first step: the group's rollouts that answer load the run's model and join a fresh
        channel (waiting while none answers; RunStopped if the run is stopped meanwhile)."""
        async with self._changing:
            await self._regroup(take_new=True)

    async def load(self) -> None:
        """For a run without a trainer: the group's rollouts that answer load the run's model and serve it as the
        model folder holds it (weight version 0); no channel is formed (waiting while none answers)."""
        async with self._changing:
            await self._load()

    async def _load(self) -> None:
        for _ in range(FORM_ATTEMPTS):
            admitted = await self._admit(await self._answering(take_new=True, found=None))
            if admitted:
                retired = [m for m in self.members if m not in admitted]
                self.members, self.pool, self.version, self.served = admitted, self._pool(admitted), 0, 0
                await asyncio.gather(*(m.close() for m in retired))
                return
        raise Unavailable(f"no rollout could load the run's model in {FORM_ATTEMPTS} attempts")

    async def refresh(self) -> None:
        """At a step boundary: if a member went, a rollout came or a member serves other weights, form a
        fresh channel with the rollouts that answer and send them the current weights (without a trainer:
        ``load`` again)."""
        async with self._changing:
            await self._refresh()

    async def _refresh(self) -> None:
        if self.actor is None:
            await self._load()
            return
        found = await self._probe({*self.addresses(), *self.find()})
        members = set(self.addresses())
        serving = {address for address, (_, info) in found.items()
                   if info.run_id == self.run_id and info.weight_version == self.version}
        if self.stale or set(found) != members or not members <= serving:
            await self._regroup(take_new=True, found=found)
            await self._sync(None)  # the actor's weights now: the loop may have updated them past self.version

    def draw_probe(self, batch: SequenceBatch, group_ids: torch.Tensor) -> None:
        """The weight check's probe, from the first batch trained (``group_ids``: each sample's prompt); later calls
        keep it."""
        if self.probe is not None:
            self.probe.draw(batch, group_ids)

    async def sync(self, version: int) -> None:
        """Send the actor's weights, of ``version``, to every member, then check that each computes with them
        (the weight probe, once drawn). A member that fails the check is sent them again; failing again, it leaves
        the run."""
        async with self._changing:
            await self._sync(version)

    async def _sync(self, version: int | None) -> None:
        """``version`` None: whatever version the actor holds when it sends, which the members then serve."""
        await self._deliver(version)
        version = self.version
        self.probe_s, self.probe_metrics = 0.0, {}
        failed = await self._check_weights(version)
        if failed:
            self.notices.log(f"rollout {', '.join(r.address for r in failed)} failed the weight check after the "
                             f"sync of version {version} ({failed[0].described()}); sending version {version} again")
            await self._deliver(version)
            again = await self._check_weights(version, only={r.address for r in failed})
            for result in again:
                if self.service_ids.get(result.address):
                    self.refused.add(self.service_ids[result.address])
                await self.drop(result.address, f"it failed the weight check twice; {result.described()}")
            if again and not self.members:  # the trainer's side or the tolerance, as likely as every rollout
                raise WeightCheckFailed(
                    f"no rollout passed the weight check after the sync of version {version}: rollout "
                    f"{again[0].address}: {again[0].described()}; if the rollouts are sound, widen "
                    "actor_rollout_ref.rollout.weight_check.tolerance_mean / tolerance_max / tolerance_topk_kl (or "
                    "set enable=false)")

    async def _check_weights(self, version: int, only: set[str] | None = None) -> list[ProbeResult]:
        """The members (or those of ``only``) score the probe; the sync's metrics take the figures of those that
        pass (the largest of each); returns those that fail."""
        if self.probe is None:
            return []
        members = [m for m in self.members if only is None or m.address in only]
        started = time.perf_counter()
        results = await self.probe.check(members, self.engines, version)
        self.probe_s += time.perf_counter() - started
        for result in results:
            log.info("weight_probe", address=result.address, version=version, diff_mean=result.diff.mean,
                     diff_max=result.diff.max, topk_kl_mean=result.kl.mean, topk_kl_max=result.kl.max,
                     tolerance_mean=result.tolerance.mean, tolerance_max=result.tolerance.max,
                     tolerance_topk_kl=result.tolerance.topk_kl, passed=result.passed, error=result.error,
                     seconds=round(result.seconds, 4), asked_ids=result.asked_ids)
        for result in results:
            if result.passed:
                for key, value in (("weights/probe_logprob_diff_mean", result.diff.mean),
                                   ("weights/probe_logprob_diff_max", result.diff.max),
                                   ("weights/probe_topk_kl_mean", result.kl.mean),
                                   ("weights/probe_topk_kl_max", result.kl.max)):
                    self.probe_metrics[key] = max(self.probe_metrics.get(key, 0.0), value)
        asked = sum(result.asked_ids for result in results)
        self.probe_metrics["weights/probe_asked_ids"] = self.probe_metrics.get("weights/probe_asked_ids", 0.0) + asked
        return [r for r in results if not r.passed]

    async def _deliver(self, version: int | None) -> None:
        """Send the actor's weights, of ``version`` (None: of whatever version it holds), to every member. Members
        that do not take them are named in an event; the channel is re-formed with the members that answer and
        the version sent again."""
        if version is not None:
            self.version = version
        failures = []
        for _ in range(SYNC_ATTEMPTS):
            if self.stale:
                await self._regroup(take_new=False)
            failure, answers = await self.channels.broadcast(version)
            if failure is None:
                self.version = self.served = answers[0].version if answers else self.version
                self.pause_s = max((answer.pause_s for answer in answers), default=0.0)
                self.memory = {key: max(answer.memory.get(key, 0.0) for answer in answers)
                               for key in {key for answer in answers for key in answer.memory}}
                return
            failures.append(failure)
            self.stale = True
            log.warning("weight_sync_failed", version=version, channels=list(self.channels.formed), failure=failure)
            self.notices.log(f"{failure}; re-forming the weight channel with the rollouts that answer and "
                             f"sending {weights_named(version)} again")
        raise Unavailable(f"weight sync of {weights_named(version)} failed {SYNC_ATTEMPTS} times in a row; the "
                          f"first: {failures[0]}")

    async def sleep(self) -> None:
        """The members sharing the trainer's device free their GPU memory for it (a member that fails to is
        dropped); the others stay as they are."""
        await self._each("sleep")

    async def wake_up(self) -> None:
        """The members sharing the trainer's device take their GPU memory back (a member that fails to is
        dropped)."""
        await self._each("wake_up")

    async def _each(self, call: str) -> None:
        members = [m for m in self.members if m.address in self.channels.colocated]
        results = await asyncio.gather(*(getattr(m, call)(self.settings.rpc_timeout_s) for m in members),
                                       return_exceptions=True)
        for member, result in zip(members, results):
            if isinstance(result, Exception):
                if not is_retryable(result):  # it would fail again (out of GPU memory, say): the attempt ends
                    self.notices.log(f"rollout {member.address}: {call} failed ({describe(result)[:300]})")
                    raise result
                await self.drop(member.address, f"{call} failed: {describe(result)}")

    async def close(self) -> None:
        await asyncio.gather(*(member.close() for member in self.members))

    def _pool(self, members: list[RolloutClient]) -> ReplicaPool[RolloutClient]:
        """The members, a batch split among them in proportion to their measured speeds."""
        return ReplicaPool("rollout", members, speed=lambda member: self.speeds.of(member.address))

    async def _regroup(self, take_new: bool, found: dict | None = None) -> None:
        """A fresh channel with the members that answer and, with ``take_new`` (or when none answers), the
        group's other rollouts that answer."""
        causes = []
        for _ in range(FORM_ATTEMPTS):
            found = await self._answering(take_new, found)
            admitted = await self._admit(found)
            cause = await self._form(admitted) if admitted else (
                "no rollout", Unavailable("none of those that answer could load the run's model"))
            if cause is None:
                return
            causes.append(cause)
            found = None
        raise not_formed(causes)

    async def _answering(self, take_new: bool, found: dict | None) -> dict[str, tuple[RolloutClient, RolloutInfo]]:
        """The rollouts that answer (``found``, if given, at first); members that do not leave. While none
        answers the run waits."""
        async def look() -> dict[str, tuple[RolloutClient, RolloutInfo]]:
            nonlocal found
            answering = found if found is not None else await self._probe(
                {*self.addresses(), *(self.find() if take_new or not self.members else ())})
            found = None
            for address in [a for a in self.addresses() if a not in answering]:
                await self.drop(address, f"it did not answer within {PROBE_TIMEOUT_S:.0f} s")
            return answering

        reason = f"no rollout of group {self.settings.group!r} answers: waiting for one to register"
        return await wait_for(look, self.notices, should_stop=self.should_stop, reason=reason)

    async def _probe(self, addresses: set[str]) -> dict[str, tuple[RolloutClient, RolloutInfo]]:
        """Client and Info of each address that answers within PROBE_TIMEOUT_S (members keep their client)."""
        members = {m.address: m for m in self.members}
        clients = [members.get(address) or self.connect(address) for address in sorted(addresses)]
        answers = await asyncio.gather(*(c.info(PROBE_TIMEOUT_S) for c in clients), return_exceptions=True)
        found = {c.address: (c, a) for c, a in zip(clients, answers)
                 if isinstance(a, RolloutInfo) and a.service_id not in self.refused}
        await asyncio.gather(*(c.close() for c in clients if c.address not in found and c.address not in members))
        return found

    async def _admit(self, found: dict[str, tuple[RolloutClient, RolloutInfo]]) -> list[RolloutClient]:
        """The found rollouts with the run's model loaded: those without it load it now (one that fails to
        is left out, unless the failure is the run's: a bad model path fails the run)."""
        loading = [client for client, info in found.values() if info.run_id != self.run_id]
        settings = self.settings
        loaded = await asyncio.gather(*(c.init_run(self.run_id, settings.model_path, dtype=settings.dtype,
                                                   timeout=settings.rpc_timeout_s, allow_pickle=settings.allow_pickle,
                                                   lora_rank=settings.lora_rank,
                                                   adapter_versions=settings.adapter_versions,
                                                   routed_experts=settings.routed_experts)
                                        for c in loading), return_exceptions=True)
        admitted = []
        for client, info in found.values():
            result = loaded[loading.index(client)] if client in loading else info.channel_ranks
            if isinstance(result, BaseException):
                if not is_retryable(result):
                    raise result
                self.notices.log(f"rollout {client.address} could not load the run's model ({describe(result)})")
                await client.close()
                continue
            self.ranks[client.address] = result
            self.engines[client.address], self.service_ids[client.address] = info.engine, info.service_id
            admitted.append(client)
        return admitted

    async def _form(self, clients: list[RolloutClient]) -> tuple[str, BaseException] | None:
        """The actor and ``clients`` join fresh weight channels (``WeightChannels.form``): ``clients`` are the
        members from now on, less those that left meanwhile; None, or (after an event) who did not join and why."""
        formation = await self.channels.form(clients, self.ranks)
        kept = [c for c in clients if c not in formation.left]
        retired = [m for m in self.members if m not in kept]
        self.members, self.pool, self.stale = kept, self._pool(kept) if kept else None, True
        await asyncio.gather(*(m.close() for m in retired))
        if formation.actor_failed is not None and not formation.failed:
            raise formation.actor_failed  # the trainer's own trouble ends the attempt
        if formation.failed:
            address, error = next(iter(formation.failed.items()))
            self.notices.log(f"weight channel {formation.base} not formed: {', '.join(formation.failed)} did not "
                             f"join ({address}: {describe(error)[:300]})")
            return f"rollout {address} did not join", error
        self.stale = False
        new = [address for address in self.addresses() if address not in self._joined]
        self._joined = set(self.addresses())
        self.notices.log(formation.described() + (f" (taken in: {', '.join(new)})" if new else ""))
        self.channels.adopt(formation)
        return None
