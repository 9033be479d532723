"""A run's weight channels: how the actor trainer's weights reach its rollout replicas, apart from who the
replicas are (``RolloutSet``, which owns one ``WeightChannels`` and asks it to form and to send).

The rollouts take the weights on one channel per transport and sharing of the trainer's device
(``plan_channels``: e.g. CUDA IPC to a rollout on the trainer's GPU, NCCL to those on GPUs of their own).
- A formation (``WeightChannels.form``): the actor prepares the planned channels and it and the rollouts join
  them, all at once; a join that fails ends the others (they would only wait out the deadline). What it came
  to (``Formation``) names who did not join and why; the set of replicas decides what to do with them, and
  ``adopt`` makes a formation that every rollout joined the one sent over.
- A send (``WeightChannels.broadcast``) goes over each channel at once. A member whose side fails (it left the
  run: stopped, killed) ends the wait for the trainer's side, which could only wait for it until the
  channel's deadline: the trainer abandons that broadcast when it prepares the next channel.
- Formations that fail in a row end the attempt, naming the first cause (``not_formed``): if every cause was
  one a service decided (a refusal, which comes again) the run fails now (``ChannelNotFormed``); if any was
  transient (a rollout that died while joining) the run waits for its services and goes on from its
  checkpoint, one of its trainer.max_recoveries.
Each channel has a fresh id (run, attempt, generation); the trainer closes its old channel when it prepares the
next (ending at once a broadcast still on it, at the trainer and the members), a rollout when it joins the next.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import structlog

from services.common.errors import FailedPrecondition, Unavailable
from services.common.rpc import is_retryable
from services.coordinator.fleet.clients import Received, RolloutClient, RolloutInfo, TrainerClient, TrainerPlacement
from services.coordinator.settings import RolloutSetSettings
from services.coordinator.waiting import describe

log = structlog.get_logger()


def took(receiving: asyncio.Future, version: int | None) -> bool:
    """Whether a member's finished receive brought it ``version`` (None: any)."""
    return (not receiving.cancelled() and receiving.exception() is None
            and version in (None, receiving.result().version))


def weights_named(version: int | None) -> str:
    """``version`` for an event: None is whatever version the actor holds when it sends."""
    return "the actor's weights" if version is None else f"version {version}"


class ChannelNotFormed(RuntimeError):
    """The weight channel failed to form several times in a row, each time for a reason a service decided:
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


def devices_held(trainer: TrainerPlacement, infos: list[RolloutInfo]) -> int:
    """The devices a run computes on, the denominator of perf/throughput (verl's and NeMo-RL's tokens/s per GPU):
    one per trainer rank, and each GPU of a rollout that does not share the trainer's device, a GPU counted once
    however many rollouts work on it. On CPU, where every process shares the machine, each process is one:
    the trainer's ranks and every rollout."""
    if not trainer.gpu and not any(info.gpus for info in infos):
        return trainer.ranks + len(infos)
    own = set().union(*(info.gpus for info in infos if not shares_trainer_device(trainer.gpu, info)))
    return trainer.ranks + len(own - {trainer.gpu})


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
    return [ChannelPlan(backend=backend, colocated=colocated, addresses=tuple(addresses))
            for (backend, colocated), addresses in groups.items()]


@dataclass(frozen=True, kw_only=True)
class Formation:
    """What one formation came to: its channels (id -> plan), who did not join and why (address -> error, in
    the order found; empty when every rollout joined), the actor's own failure to join, and the rollouts that
    left the run while it was joining (already dropped and closed)."""

    base: str  # the formation's id; its channels' ids are it, or it and an index
    plans: dict[str, ChannelPlan]
    failed: dict[str, BaseException]
    actor_failed: BaseException | None
    left: list[RolloutClient]
    devices: int  # the devices the trainer and the rollouts that answered compute on (devices_held)

    def described(self) -> str:
        """The channels formed, for an event: each one's id, transport and rollouts."""
        many = len(self.plans) > 1
        channels = "; ".join(f"{channel_id} ({plan.backend}): the actor and rollouts {', '.join(plan.addresses)}"
                             + (" (sharing its device)" if plan.colocated and many else "")
                             for channel_id, plan in self.plans.items())
        return f"weight channel{'s' if many else ''} {channels}"


class WeightChannels:
    """The channels a run's actor sends its weights into, to its rollout members."""

    def __init__(self, run_id: str, settings: RolloutSetSettings, actor: TrainerClient | None,
                 *, members: Callable[[], list[RolloutClient]]):
        """``members``: the run's rollout members now (one may leave while a formation or a send is on)."""
        self.settings, self.actor, self.members = settings, actor, members
        self.formed: dict[str, tuple[str, ...]] = {}  # the channels last formed: id -> its members' addresses
        self.colocated: set[str] = set()  # members sharing the trainer's device, which sleep while it works
        self.devices = 1  # the devices the trainer and the members of the adopted formation compute on
        self._prefix, self._generation = f"{run_id}-weights-{secrets.token_hex(3)}", 0

    def sender(self) -> TrainerClient:
        """The actor's trainer, which sends the weights (a run that only validates has none, and forms no channel)."""
        if self.actor is None:
            raise FailedPrecondition("the run has no actor trainer to send weights from: it only validates")
        return self.actor

    async def form(self, clients: list[RolloutClient], ranks: dict[str, int]) -> Formation:
        """The actor and ``clients`` (taking ``ranks[address]`` channel ranks each) join fresh channels
        (``plan_channels``); none is joined where a rollout does not answer Info. The channels are sent over
        only once ``adopt``-ed."""
        infos = await asyncio.gather(*(c.info(self.settings.rpc_timeout_s) for c in clients), return_exceptions=True)
        failed = {c.address: i for c, i in zip(clients, infos) if not isinstance(i, RolloutInfo)}  # will not join
        answered = {c.address: i for c, i in zip(clients, infos) if isinstance(i, RolloutInfo)}
        trainer = await self.sender().placement()
        plans = plan_channels(self.settings.backend, trainer.gpu, answered)
        self._generation += 1
        base = f"{self._prefix}-{self._generation}"
        channel_ids = [base] if len(plans) == 1 else [f"{base}-{index}" for index in range(len(plans))]
        before = list(self.members())
        joined, joiners = await self._join(channel_ids, plans, clients=clients, ranks=ranks) if not failed else ([], [])
        failed |= {c.address: r for c, r in zip(joiners, joined) if c is not None and isinstance(r, Exception)}
        left = [m for m in before if m in clients and m not in self.members()]  # dropped (and closed) while joining
        failed |= {m.address: Unavailable("it left the run meanwhile") for m in left}
        actor_failed = [r for c, r in zip(joiners, joined) if c is None and isinstance(r, Exception)]
        return Formation(base=base, plans=dict(zip(channel_ids, plans)), failed=failed,
                         actor_failed=actor_failed[0] if actor_failed else None, left=left,
                         devices=devices_held(trainer, list(answered.values())))

    def adopt(self, formation: Formation) -> None:
        """Send over ``formation``'s channels from now on (every rollout joined them)."""
        self.formed = {channel_id: plan.addresses for channel_id, plan in formation.plans.items()}
        self.colocated = {address for plan in formation.plans.values() if plan.colocated for address in plan.addresses}
        self.devices = formation.devices
        log.info("weight_channels_formed", channels=self.formed, colocated=sorted(self.colocated))

    async def broadcast(self, version: int | None) -> tuple[str | None, list[Received]]:
        """One send of the actor's weights of ``version`` (None: whatever version it holds then) over each current
        channel, concurrently (the trainer sends into them in turn): (None, every member's answer) if every member
        took one version, else (what went wrong on the first channel that failed, []) (the sends on the others are
        abandoned: the trainer's model thread may be held by the failed one until the next channel is prepared)."""
        sends = [asyncio.ensure_future(self._send_over(channel_id,
                                                       [m for m in self.members() if m.address in addresses],
                                                  version))
                 for channel_id, addresses in self.formed.items()]
        answers: list[Received] = []
        try:
            for send in asyncio.as_completed(sends):
                failure, received = await send
                if failure is not None:
                    return failure, []
                answers += received
        finally:
            for send in sends:
                send.cancel()
            await asyncio.gather(*sends, return_exceptions=True)
        versions = sorted({answer.version for answer in answers})
        if len(versions) > 1:  # version None: the actor was updated between its sends into two channels
            return f"the weight channels took different versions ({versions}): the actor was updated meanwhile", []
        return None, answers

    async def _send_over(self, channel_id: str, members: list[RolloutClient],
                    version: int | None) -> tuple[str | None, list[Received]]:
        """One send over channel ``channel_id`` to its ``members``: (None, their answers) if every member took it,
        else (what went wrong, [])."""
        timeout = self.settings.channel_timeout_s
        log.info("weight_sync_started", version=version, channel_id=channel_id, rollouts=[m.address for m in members])
        receiving = {m.address: asyncio.ensure_future(m.receive_weights(channel_id, timeout,
                                                                        self.settings.partial_rollout))
                     for m in members}
        sending = asyncio.ensure_future(self.sender().broadcast_weights(channel_id, self.settings.bucket_bytes,
                                                                        timeout))
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
                except Exception as error:  # sorted here
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
        if sent is not None and version is not None and sent.weight_version != version:
            raise RuntimeError(f"the trainer sent weight version {sent.weight_version}, not {version}")
        if sent is not None:
            version = sent.weight_version
        not_serving = {address: answer for address, answer in zip(receiving, answers)
                       if not isinstance(answer, Received) or answer.version != version}
        if sent is not None and not not_serving:
            return None, [answer for answer in answers if isinstance(answer, Received)]
        members_now = {m.address for m in self.members()}
        left = [address for address in not_serving if address not in members_now]
        if left and not trouble:
            trouble = f"{', '.join(left)} left the run while it was on the wire"
        errors = [describe(a) for a in not_serving.values() if isinstance(a, Exception)]
        detail = trouble or (f"a rollout's side: {errors[0]}" if errors else "a rollout received another version")
        return (f"weight sync of {weights_named(version)} on channel {channel_id} failed ({detail[:300]}); "
                f"not serving it: {', '.join(not_serving) or 'none'}"), []

    async def _join(self, channel_ids: list[str], plans: list[ChannelPlan], clients: list[RolloutClient],
                    *, ranks: dict[str, int]) -> tuple[list[Any], list[RolloutClient | None]]:
        """The actor prepares the planned channels (the first replacing its old ones, the others beside it), then
        it and ``clients`` join them, all at once; what each join returned or raised, and who joined (None: the
        actor). Once one join fails the others are cancelled: they would only wait out the deadline for it."""
        rpc_timeout_s, timeout = self.settings.rpc_timeout_s, self.settings.channel_timeout_s
        client = {c.address: c for c in clients}
        taken_by = [[ranks[address] for address in plan.addresses] for plan in plans]
        rendezvous = [await self.sender().prepare_channel(channel_id, plan.backend, world_size=1 + sum(taken),
                                                       timeout=rpc_timeout_s, keep_joined=index > 0)
                      for index, (channel_id, plan, taken) in enumerate(zip(channel_ids, plans, taken_by))]
        joins: list[Awaitable[Any]] = []
        joiners: list[RolloutClient | None] = []
        for channel_id, plan, taken, meeting in zip(channel_ids, plans, taken_by, rendezvous):
            world_size = 1 + sum(taken)
            joins.append(self.sender().join_channel(channel_id, plan.backend, rendezvous=meeting, world_size=world_size,
                                                 timeout=timeout))
            joiners.append(None)
            for rank, address in zip(itertools.accumulate([1, *taken]), plan.addresses):
                joins.append(client[address].join_channel(channel_id, plan.backend, rendezvous=meeting, rank=rank,
                                                          world_size=world_size, timeout=timeout))
                joiners.append(client[address])
        tasks = [asyncio.ensure_future(join) for join in joins]
        _, waiting = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in waiting:
            task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True), joiners
