"""A run's rollout replicas and the weight channels they share with the actor.

The members take the weights on one channel per transport and sharing of the trainer's device
(``plan_channels``: e.g. CUDA IPC to a rollout on the trainer's GPU, NCCL to those on GPUs of their own);
only those sharing it sleep while the trainer works (``sleep``, with free_cache_engine).

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
- With no rollout left the run waits (state ``waiting``) until one answers, then
  goes on where it was: the trainer's state is intact, nothing is rewound.
- A channel that fails to form FORM_ATTEMPTS times in a row ends the attempt,
  naming the first cause (``not_formed``): if every cause was one a service
  decided (a refusal, which comes again) the run fails now; if any was
  transient (a rollout that died while joining) the run waits for its services
  and goes on from its checkpoint, one of its trainer.max_recoveries.
Each channel has a fresh id (run, attempt, generation); the trainer closes
its old channel when it prepares the next (ending at once a broadcast still on
it, at the trainer and the members), a rollout when it joins the next.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from dataclasses import dataclass
from typing import Callable

import structlog

from services.common.errors import Unavailable
from services.common.rpc import is_retryable
from services.coordinator.clients import Received, RolloutClient, RolloutInfo, TrainerClient
from services.coordinator.dispatch import ReplicaPool, ReplicaSpeeds
from services.coordinator.settings import RolloutSetSettings
from services.coordinator.waiting import Notices, describe, wait_for

log = structlog.get_logger()
PROBE_TIMEOUT_S = 2.0  # a rollout that does not answer Info this fast is out (stopped, cut off, dead)
FORM_ATTEMPTS = 3  # channel formations in a row that may fail (a member died while joining) before giving up
SYNC_ATTEMPTS = 3  # sends of one version in a row that may fail before the attempt gives up


def took(receiving: asyncio.Future, version: int) -> bool:
    """Whether a member's finished receive brought it ``version``."""
    return not receiving.cancelled() and receiving.exception() is None and receiving.result().version == version


class ChannelNotFormed(RuntimeError):
    """The weight channel failed to form FORM_ATTEMPTS times in a row, each time for a reason a service decided:
    it would fail the same way again, so the run fails (it does not wait to recover)."""


def transient(cause: BaseException) -> bool:
    """Whether a formation that failed with ``cause`` may succeed later: a service that went away or did not
    answer in time (``rpc.is_retryable``), or a rollout that left the run meanwhile (Unavailable)."""
    return is_retryable(cause) or isinstance(cause, Unavailable)


def not_formed(causes: list[tuple[str, BaseException]]) -> Exception:
    """What ends the attempt after formations in a row failed with ``causes`` (per formation: who failed it, and
    how; at least one): ChannelNotFormed when none of them was transient, else Unavailable (the run waits for
    its services, then goes on from its checkpoint). Either names the first cause."""
    who, cause = causes[0]
    message = (f"the weight channel could not be formed in {len(causes)} attempts; the first: {who} "
               f"({describe(cause)[:300]})")
    return Unavailable(message) if any(transient(c) for _, c in causes) else ChannelNotFormed(message)


def transport(configured: str, trainer_gpu: str, gpus: frozenset[str]) -> str:
    """A rollout's weight transport under weight_sync_backend ``configured``, the rollout's engine working on
    ``gpus``: as configured, unless auto: gloo for a trainer on CPU, cuda_ipc for an engine on the trainer's GPU
    (NCCL refuses two ranks on one GPU), nccl for one on other GPUs."""
    if configured != "auto":
        return configured
    if not trainer_gpu:
        return "gloo"
    return "cuda_ipc" if trainer_gpu in gpus else "nccl"


def shares_trainer_device(trainer_gpu: str, info: RolloutInfo) -> bool:
    """Whether a rollout shares the actor trainer's device (it sleeps while the trainer works, with
    free_cache_engine): as it says (its colocated setting), else whether its engine works on the trainer's GPU;
    beside a trainer on CPU every rollout does, as on one GPU."""
    if info.colocated is not None:
        return info.colocated
    return not trainer_gpu or trainer_gpu in info.gpus


@dataclass(frozen=True)
class ChannelPlan:
    """One weight channel of a formation: its transport, and its rollouts, which all share the trainer's device
    or none does."""

    backend: str
    colocated: bool
    addresses: tuple[str, ...]


def plan_channels(configured: str, trainer_gpu: str, infos: dict[str, RolloutInfo]) -> list[ChannelPlan]:
    """The weight channels that reach the rollouts (address -> Info): one per transport and sharing of the
    trainer's device, so a fleet with a rollout on the trainer's GPU (cuda_ipc) and others on GPUs of their own
    (nccl) gets two, which the trainer sends into in turn. Sharing splits a channel even where the transport is
    one (gloo, on CPU): the same two channels form as on GPUs. In order of their first rollout's address."""
    groups: dict[tuple[str, bool], list[str]] = {}
    for address in sorted(infos):
        info = infos[address]
        key = transport(configured, trainer_gpu, info.gpus), shares_trainer_device(trainer_gpu, info)
        groups.setdefault(key, []).append(address)
    return [ChannelPlan(backend, colocated, tuple(addresses)) for (backend, colocated), addresses in groups.items()]


class RolloutSet:
    def __init__(self, run_id: str, settings: RolloutSetSettings, actor: TrainerClient | None,
                 find: Callable[[], list[str]], notices: Notices, should_stop: Callable[[], bool],
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
        self.channels: dict[str, tuple[str, ...]] = {}  # the channels last formed: id -> its members' addresses
        self.colocated: set[str] = set()  # members sharing the trainer's device, which sleep while it works
        self._joined: set[str] = set()  # the rollouts of the last channel formed
        self._channel_prefix, self._generation = f"{run_id}-weights-{secrets.token_hex(3)}", 0

    def addresses(self) -> list[str]:
        return [member.address for member in self.members]

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
        await self._regroup(take_new=True)

    async def load(self) -> None:
        """For a run without a trainer: the group's rollouts that answer load the run's model and serve it as the
        model folder holds it (weight version 0); no channel is formed (waiting while none answers)."""
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
        if self.actor is None:
            await self.load()
            return
        found = await self._probe({*self.addresses(), *self.find()})
        members = set(self.addresses())
        serving = {address for address, (_, info) in found.items()
                   if info.run_id == self.run_id and info.weight_version == self.version}
        if self.stale or set(found) != members or not members <= serving:
            await self._regroup(take_new=True, found=found)
            await self.sync(self.version)

    async def sync(self, version: int) -> None:
        """Send the actor's weights, of ``version``, to every member. Members that do not take them are named
        in an event; the channel is re-formed with the members that answer and the version sent again."""
        self.version = version
        failures = []
        for _ in range(SYNC_ATTEMPTS):
            if self.stale:
                await self._regroup(take_new=False)
            failure = await self._broadcast(version)
            if failure is None:
                self.served = version
                return
            failures.append(failure)
            self.stale = True
            log.warning("weight_sync_failed", version=version, channels=list(self.channels), failure=failure)
            self.notices.log(f"{failure}; re-forming the weight channel with the rollouts that answer and "
                             f"sending version {version} again")
        raise Unavailable(f"weight sync of version {version} failed {SYNC_ATTEMPTS} times in a row; the first: "
                          f"{failures[0]}")

    async def sleep(self) -> None:
        """The members sharing the trainer's device free their GPU memory for it (a member that fails to is
        dropped); the others stay as they are."""
        await self._each("sleep")

    async def wake_up(self) -> None:
        """The members sharing the trainer's device take their GPU memory back (a member that fails to is
        dropped)."""
        await self._each("wake_up")

    async def _each(self, call: str) -> None:
        members = [m for m in self.members if m.address in self.colocated]
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

    async def _broadcast(self, version: int) -> str | None:
        """One send over each current channel, concurrently (the trainer sends into them in turn): None if every
        member took it, else what went wrong on the first channel that failed (the sends on the others are
        abandoned: the trainer's model thread may be held by the failed one until the next channel is prepared)."""
        sends = [asyncio.ensure_future(self._send(channel_id, [m for m in self.members if m.address in addresses],
                                                  version))
                 for channel_id, addresses in self.channels.items()]
        answers: list[Received] = []
        try:
            for send in asyncio.as_completed(sends):
                failure, received = await send
                if failure is not None:
                    return failure
                answers += received
        finally:
            for send in sends:
                send.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
        self.pause_s = max((answer.pause_s for answer in answers), default=0.0)
        self.memory = {key: max(answer.memory.get(key, 0.0) for answer in answers)
                       for key in {key for answer in answers for key in answer.memory}}
        return None

    async def _send(self, channel_id: str, members: list[RolloutClient],
                    version: int) -> tuple[str | None, list[Received]]:
        """One send over channel ``channel_id`` to its ``members``: (None, their answers) if every member took it,
        else (what went wrong, []).

        A member whose side fails (it left the run: stopped, killed) ends the wait for the trainer's side, which
        could only wait for it until the channel's deadline: the trainer abandons that broadcast when it
        prepares the next channel."""
        timeout = self.settings.channel_timeout_s
        log.info("weight_sync_started", version=version, channel_id=channel_id, rollouts=[m.address for m in members])
        receiving = {m.address: asyncio.ensure_future(m.receive_weights(channel_id, timeout,
                                                                        self.settings.partial_rollout))
                     for m in members}
        sending = asyncio.ensure_future(self.actor.broadcast_weights(channel_id, self.settings.bucket_bytes, timeout))
        sent, trouble = None, ""
        try:
            pending = {sending, *receiving.values()}
            while sending in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not took(task, version) for task in done - {sending}):
                    break
            if sending.done():
                try:
                    sent = sending.result()
                except Exception as error:  # noqa: BLE001 - sorted here
                    if not (is_retryable(error) or isinstance(error, Unavailable)):
                        raise
                    trouble = f"the trainer's side: {describe(error)}"
            if sent is not None:  # every member took the whole broadcast: their answers follow
                await asyncio.wait(receiving.values())
        finally:  # after a failed send the members' side ends with the channel, which the trainer closes
            for task in (sending, *receiving.values()):  # when it prepares the next: no use waiting for them
                task.cancel()
            answers = await asyncio.gather(*receiving.values(), return_exceptions=True)
            await asyncio.gather(sending, return_exceptions=True)
        if sent is not None and sent.weight_version != version:
            raise RuntimeError(f"the trainer sent weight version {sent.weight_version}, not {version}")
        not_serving = {address: answer for address, answer in zip(receiving, answers)
                       if not isinstance(answer, Received) or answer.version != version}
        if sent is not None and not not_serving:
            return None, answers
        left = [address for address in not_serving if address not in self.addresses()]
        if left and not trouble:
            trouble = f"{', '.join(left)} left the run while it was on the wire"
        errors = [describe(a) for a in not_serving.values() if isinstance(a, Exception)]
        detail = trouble or (f"a rollout's side: {errors[0]}" if errors else "a rollout received another version")
        return (f"weight sync of version {version} on channel {channel_id} failed ({detail[:300]}); "
                f"not serving it: {', '.join(not_serving) or 'none'}"), []

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

        return await wait_for(look, self.notices, self.should_stop,
                              f"no rollout of group {self.settings.group!r} answers: waiting for one to register")

    async def _probe(self, addresses: set[str]) -> dict[str, tuple[RolloutClient, RolloutInfo]]:
        """Client and Info of each address that answers within PROBE_TIMEOUT_S (members keep their client)."""
        members = {m.address: m for m in self.members}
        clients = [members.get(address) or self.connect(address) for address in sorted(addresses)]
        answers = await asyncio.gather(*(c.info(PROBE_TIMEOUT_S) for c in clients), return_exceptions=True)
        found = {c.address: (c, a) for c, a in zip(clients, answers) if isinstance(a, RolloutInfo)}
        await asyncio.gather(*(c.close() for c in clients if c.address not in found and c.address not in members))
        return found

    async def _admit(self, found: dict[str, tuple[RolloutClient, RolloutInfo]]) -> list[RolloutClient]:
        """The found rollouts with the run's model loaded: those without it load it now (one that fails to
        is left out, unless the failure is the run's: a bad model path fails the run)."""
        loading = [client for client, info in found.values() if info.run_id != self.run_id]
        settings = self.settings
        loaded = await asyncio.gather(*(c.init_run(self.run_id, settings.model_path, settings.dtype,
                                                   settings.rpc_timeout_s, allow_pickle=settings.allow_pickle)
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
            admitted.append(client)
        return admitted

    async def _form(self, clients: list[RolloutClient]) -> tuple[str, BaseException] | None:
        """The actor and ``clients`` join fresh channels (``plan_channels``); None, or (after an event) who did
        not join and why."""
        infos = await asyncio.gather(*(c.info(self.settings.rpc_timeout_s) for c in clients), return_exceptions=True)
        failed = {c.address: i for c, i in zip(clients, infos) if not isinstance(i, RolloutInfo)}  # will not join
        plans = plan_channels(self.settings.backend, await self.actor.gpu(),
                              {c.address: i for c, i in zip(clients, infos) if isinstance(i, RolloutInfo)})
        self._generation += 1
        base = f"{self._channel_prefix}-{self._generation}"
        channel_ids = [base] if len(plans) == 1 else [f"{base}-{index}" for index in range(len(plans))]
        before = list(self.members)
        joined, joiners = await self._join(channel_ids, plans, clients) if not failed else ([], [])
        failed |= {c.address: r for c, r in zip(joiners, joined) if c is not None and isinstance(r, Exception)}
        left = [m for m in before if m in clients and m not in self.members]  # dropped (and closed) while joining
        failed |= {m.address: Unavailable("it left the run meanwhile") for m in left}
        kept = [c for c in clients if c not in left]
        retired = [m for m in self.members if m not in kept]
        self.members, self.pool, self.stale = kept, self._pool(kept) if kept else None, True
        await asyncio.gather(*(m.close() for m in retired))
        trainer_failed = [r for c, r in zip(joiners, joined) if c is None and isinstance(r, Exception)]
        if trainer_failed and not failed:
            raise trainer_failed[0]  # the trainer's own trouble ends the attempt
        if failed:
            address, error = next(iter(failed.items()))
            self.notices.log(f"weight channel {base} not formed: {', '.join(failed)} did not join "
                             f"({address}: {describe(error)[:300]})")
            return f"rollout {address} did not join", error
        self.channels = {channel_id: plan.addresses for channel_id, plan in zip(channel_ids, plans)}
        self.colocated = {address for plan in plans if plan.colocated for address in plan.addresses}
        self.stale = False
        new = [address for address in self.addresses() if address not in self._joined]
        self._joined = set(self.addresses())
        described = "; ".join(f"{channel_id} ({plan.backend}): the actor and rollouts {', '.join(plan.addresses)}"
                              + (" (sharing its device)" if plan.colocated and len(plans) > 1 else "")
                              for channel_id, plan in zip(channel_ids, plans))
        self.notices.log(f"weight channel{'s' if len(plans) > 1 else ''} {described}"
                         + (f" (taken in: {', '.join(new)})" if new else ""))
        log.info("weight_channels_formed", channels=self.channels, colocated=sorted(self.colocated))
        return None

    async def _join(self, channel_ids: list[str], plans: list[ChannelPlan],
                    clients: list[RolloutClient]) -> tuple[list, list[RolloutClient | None]]:
        """The actor prepares the planned channels (the first replacing its old ones, the others beside it), then
        it and ``clients`` join them, all at once; what each join returned or raised, and who joined (None: the
        actor). Once one join fails the others are cancelled: they would only wait out the deadline for it."""
        rpc_timeout_s, timeout = self.settings.rpc_timeout_s, self.settings.channel_timeout_s
        client = {c.address: c for c in clients}
        ranks = [[self.ranks[address] for address in plan.addresses] for plan in plans]
        rendezvous = [await self.actor.prepare_channel(channel_id, plan.backend, 1 + sum(taken), rpc_timeout_s,
                                                       keep_joined=index > 0)
                      for index, (channel_id, plan, taken) in enumerate(zip(channel_ids, plans, ranks))]
        joins, joiners = [], []
        for channel_id, plan, taken, meeting in zip(channel_ids, plans, ranks, rendezvous):
            world_size = 1 + sum(taken)
            joins.append(self.actor.join_channel(channel_id, plan.backend, meeting, world_size, timeout))
            joiners.append(None)
            for rank, address in zip(itertools.accumulate([1, *taken]), plan.addresses):
                joins.append(client[address].join_channel(channel_id, plan.backend, meeting, rank, world_size,
                                                          timeout))
                joiners.append(client[address])
        joins = [asyncio.ensure_future(join) for join in joins]
        _, waiting = await asyncio.wait(joins, return_when=asyncio.FIRST_EXCEPTION)
        for join in waiting:
            join.cancel()
        return await asyncio.gather(*joins, return_exceptions=True), joiners
