"""A run's env replicas: the env services of its target (``placement.env``, or where a swap sent it), and the
episodes they hold for it.

Mirrors the reward set, for services that keep state per episode:
- The run uses the env services up in its target (a group, or one address); ``refresh`` (at each step boundary)
  follows them as they come and go, asking each new one what it hosts (``Info``) and how many episodes it can
  hold open.
- An episode (``episode``) is opened on the replica with the most free workers, waiting while every one is
  full, and closed when the trajectory ends, whatever its outcome. A replica whose call fails as unreachable
  is dropped (the trajectory starts its episode again on another: ``EnvLost``); one that left is taken back
  at a boundary once it is up again.
- The run counts only its own episodes, but an env service may be shared with other runs (of this coordinator or
  of others): a Reset it refuses because every worker holds an episode (``rpc.retry_after_s``: busy, not an error
  of the request) is asked again, and counted (``Episode.busy_waits``). The run leaves that replica alone for the
  service's hint, doubled with each refusal in a row up to BUSY_BACKOFF_MAX_S (``busy_backoff_s``), sooner where
  one of its own episodes there closes; its other replicas take the episodes meanwhile, and once it may be asked
  again one trajectory asks (``prober``) while the others wait for the answer, so a full service gets one Reset
  a while, not one per waiting trajectory. Replicas that refuse the run for BUSY_BOUND_CALLS x the env call
  timeout with no episode of it opened meanwhile fail the batch (ResourceExhausted, saying so).
- ``tools(environment)``: the OpenAI schemas of an environment's tools, as its replicas host them (what the
  chat template renders into the prompt).
- A swap (``swap``, from ``coordctl env set``) is probed first: each new service must say (``Info``) that it
  hosts the run's environment, and open and close an episode of it on one of the run's rows, or the swap is
  refused and the run keeps its services. An accepted swap applies at the next step boundary. A batch opens
  every episode on the replicas that were the run's when it began (``batch``: generated ahead, it may still
  run on the services swapped out, which are closed once it ends), so the swap's event names the first batch
  the new services run.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Callable

import grpc

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.common.rpc import is_retryable, retry_after_s
from services.coordinator.fleet.clients import EnvClient, EnvDescription, EnvStep, GatewayAccess, Message
from services.coordinator.fleet.targets import ServiceTarget
from services.coordinator.waiting import Notices, wait_for

DESCRIBE_TIMEOUT_S = 5.0  # an env service that does not say what it hosts this fast is not used yet
SWAP_PROBE_TIMEOUT_S = 15.0  # of each call of a swap's probe
BUSY_BACKOFF_MIN_S = 0.1  # the least a busy replica is left alone, whatever its hint says
BUSY_BACKOFF_MAX_S = 5.0  # the most: a full replica is asked again at least this often
BUSY_BOUND_CALLS = 3  # refused this many env call timeouts (trainer.rpc_timeout_s) with no episode opened: give up


class EnvLost(Exception):
    """The env replica holding an episode failed (gone, unreachable, its deadline passed): the episode's state is
    lost with it, and the trajectory starts again on another."""


@dataclass(eq=False, kw_only=True)
class EnvReplica:
    client: EnvClient
    description: EnvDescription
    open: int = 0  # episodes it holds for this run now
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set when it is dropped: its steps in flight end
    refused: int = 0  # rounds of Resets it refused in a row because every worker was busy (with other runs')
    ask_at: float = 0.0  # (the event loop's clock) after a refusal, no episode is asked of it before this
    prober: str | None = None  # after a refusal, the episode whose Reset asks it again; the others wait for it

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def free(self) -> int:
        return self.description.workers - self.open


@dataclass(kw_only=True)
class Episode:
    """One open episode on one replica."""

    replica: EnvReplica
    episode_id: str
    opening: list[Message]  # what the environment said before the model's first turn
    timeout_s: float
    busy_waits: int = 0  # Resets refused before it opened because every worker of the replica asked was busy
    steps: int = 0
    seconds: float = field(default=0.0)  # spent waiting for the environment's steps

    @property
    def service(self) -> str:
        """Who runs it, for the sample's lineage: service id and meshrl version."""
        description = self.replica.description
        return f"{description.service_id} ({description.meshrl_version or 'version unknown'})"

    async def step(self, content: str) -> EnvStep:
        """The model's turn into the episode; EnvLost if its replica fails."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        call = asyncio.ensure_future(self.replica.client.step(self.episode_id, content, self.timeout_s))
        gone = asyncio.ensure_future(self.replica.gone.wait())
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                raise EnvLost(f"env {self.replica.address} left the run")
            return call.result()
        except grpc.aio.AioRpcError as error:
            raise lost(self.replica, error) from error
        finally:
            for task in (call, gone):
                task.cancel()
            self.steps += 1
            self.seconds += loop.time() - started


@dataclass(eq=False)
class EnvFleet:
    """The env replicas of one target; the episodes of a batch begun on it are opened there."""

    target: ServiceTarget
    replicas: list[EnvReplica]
    batches: int = 0  # batches running on it now

    def tools(self, environment: str) -> tuple[dict, ...]:
        """The tool schemas of ``environment``; ValueError if no replica hosts it, naming what they host."""
        for replica in self.replicas:
            if environment in replica.description.environments:
                return replica.description.environments[environment]
        hosted = sorted({name for r in self.replicas for name in r.description.environments})
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.environment = {environment!r}: no env service of "
                         f"{self.target} hosts it (they host: {', '.join(hosted) or 'nothing'})")

    def runs_agent(self, environment: str) -> bool:
        """Whether ``environment``'s episodes run a user's agent (which calls the run's gateway)."""
        return any(environment in replica.description.agents for replica in self.replicas)


@dataclass(frozen=True)
class EnvProbe:
    """What each service of a swap must do before the run takes it: host ``environment``, and open and close an
    episode of it on ``row`` (one of the run's rows, as an episode gets it, with the run's ``max_parallel_calls``)."""

    environment: str
    row: dict
    max_parallel_calls: int


async def probe(client: EnvClient, env_probe: EnvProbe) -> EnvDescription:
    """What the service at ``client`` hosts; ValueError (naming the service and what it hosts) unless it hosts the
    probe's environment, or a call's error if the probe episode fails to open or close."""
    description = await client.describe(SWAP_PROBE_TIMEOUT_S)
    if env_probe.environment not in description.environments:
        hosted = ", ".join(sorted(description.environments)) or "nothing"
        raise ValueError(f"env {client.address} ({description.service_id}) does not host the run's environment "
                         f"{env_probe.environment!r} (it hosts: {hosted})")
    episode_id = f"probe-{uuid.uuid4().hex}"
    await client.reset(episode_id, env_probe.row, env_probe.environment,
                       max_parallel_calls=env_probe.max_parallel_calls, timeout=SWAP_PROBE_TIMEOUT_S)
    await client.close_episode(episode_id, SWAP_PROBE_TIMEOUT_S)
    return description


def busy_backoff_s(hint_s: float, refusals: int) -> float:
    """How long a run leaves a replica alone after the ``refusals``-th round in a row of Resets it refused because
    every worker was busy: the service's hint (at least BUSY_BACKOFF_MIN_S), doubled with each round after the
    first, at most BUSY_BACKOFF_MAX_S."""
    return min(max(hint_s, BUSY_BACKOFF_MIN_S) * 2.0 ** min(refusals - 1, 32), BUSY_BACKOFF_MAX_S)


def askable(replica: EnvReplica, now: float) -> bool:
    """Whether an episode may be asked of ``replica`` at ``now``: a worker free by the run's own count, not left
    alone after a refusal, and no trajectory asking it again after one."""
    return replica.free > 0 and now >= replica.ask_at and replica.prober is None


def choose(replicas: list[EnvReplica], now: float) -> EnvReplica | None:
    """The replica to ask for an episode at ``now``: of those ``askable``, the one with the most free workers."""
    return max((r for r in replicas if askable(r, now)), key=lambda r: r.free, default=None)


def next_ask(replicas: list[EnvReplica], now: float) -> float | None:
    """The soonest time after ``now`` that a replica left alone after a refusal may be asked again (None: no
    replica becomes askable by time alone)."""
    return min((r.ask_at for r in replicas if r.free > 0 and r.prober is None and r.ask_at > now), default=None)


def lost(replica: EnvReplica, error: grpc.aio.AioRpcError) -> Exception:
    """EnvLost for a failure that says the replica is gone; the error itself for one that is the request's."""
    if is_retryable(error):
        return EnvLost(f"env {replica.address}: {error.code().name}: {error.details()}")
    return error


class EnvSet:
    def __init__(self, target: ServiceTarget, find: Callable[[ServiceTarget], list[str]], notices: Notices,
                 *, should_stop: Callable[[], bool], timeout_s: float, connect: Callable[[str], EnvClient] = EnvClient):
        """``find(target)``: the addresses of the target's env services up now; ``timeout_s``: of each Reset and
        Step call (a tool call is bounded by the env service's own call_timeout_s, well within it); replicas that
        refuse the run for BUSY_BOUND_CALLS times as long (every worker busy) fail its batch."""
        self.find, self.connect = find, connect
        self.notices, self.should_stop, self.timeout_s = notices, should_stop, timeout_s
        self.busy_bound_s = BUSY_BOUND_CALLS * timeout_s
        self._refused_since: float | None = None  # (loop clock) the first refusal since an episode last opened
        self.fleet = EnvFleet(target, [])  # the run's: batches begun now open their episodes there
        self._next: EnvFleet | None = None  # a swap waiting for the boundary
        self._switched = False  # a swap was applied: the next batch says that it is the first the new services run
        self._swapped_out: list[EnvFleet] = []  # fleets swapped out while batches still ran on them
        self._changed = asyncio.Condition()

    @property
    def target(self) -> ServiceTarget:
        return self.fleet.target

    def addresses(self) -> list[str]:
        """Every replica the run's episodes may be on: its fleet's, and those of fleets swapped out while batches
        still run on them."""
        return [replica.address for fleet in (self.fleet, *self._swapped_out) for replica in fleet.replicas]

    def tools(self, environment: str) -> tuple[dict, ...]:
        """The tool schemas of ``environment`` on the run's replicas (``EnvFleet.tools``)."""
        return self.fleet.tools(environment)

    async def swap(self, target: ServiceTarget, env_probe: EnvProbe) -> list[str]:
        """Probe the target's services; if every one passes, batches begun from the next step boundary on open
        their episodes there. Returns their addresses; FailedPrecondition if none is up, ValueError or a call's
        error if one fails the probe (the run then keeps its services)."""
        addresses = self.find(target)
        if not addresses:
            raise FailedPrecondition(f"no env service is up in {target}")
        clients = [self.connect(address) for address in addresses]
        try:
            descriptions = await asyncio.gather(*(probe(client, env_probe) for client in clients))
        except BaseException:
            await asyncio.gather(*(client.close() for client in clients))
            raise
        replaced, self._next = self._next, EnvFleet(target, [EnvReplica(client=client,
                                                                        description=description) for client, description
                                                             in zip(clients, descriptions)])
        if replaced is not None:  # a second swap before the boundary: the last one named wins
            await close_clients(replaced)
        return addresses

    async def refresh(self) -> None:
        """At a step boundary: apply an accepted swap, then follow the target's env services (``follow``)."""
        if self._next is not None:
            swapped_out, (self.fleet, self._next) = self.fleet, (self._next, None)
            self._switched = True
            if swapped_out.batches:
                self._swapped_out.append(swapped_out)  # closed once its batches end
            else:
                await close_clients(swapped_out)
        await self.follow()

    def restore(self, target: ServiceTarget) -> None:
        """Go on with the target a checkpoint recorded (taken up at the next refresh)."""
        self.fleet.target = target

    async def follow(self) -> None:
        """Follow the target's env services: new ones are asked what they host, gone ones dropped; waits (state
        waiting) while none is up."""
        fleet = self.fleet

        async def answering() -> list[EnvReplica]:
            known = {replica.address: replica for replica in fleet.replicas}
            fresh = [address for address in self.find(fleet.target) if address not in known]
            described = await asyncio.gather(*(self._describe(address) for address in fresh))
            up = set(self.find(fleet.target))
            return [r for r in fleet.replicas if r.address in up] + [r for r in described if r is not None]

        replicas = await wait_for(answering, self.notices, self.should_stop,
                                  reason=f"no env service of {fleet.target} answers; waiting for one")
        if {r.address for r in replicas} != {r.address for r in fleet.replicas}:
            self.notices.log(f"env replicas of {fleet.target}: {sorted(r.address for r in replicas)}", kind="env")
        gone = [r for r in fleet.replicas if r not in replicas and r.open == 0]
        fleet.replicas = replicas
        await asyncio.gather(*(r.client.close() for r in gone))
        async with self._changed:
            self._changed.notify_all()

    async def drop(self, address: str, reason: str) -> None:
        """No further episode goes to the replica at ``address`` (its open ones fail as EnvLost)."""
        found = next(((fleet, r) for fleet in (self.fleet, *self._swapped_out) for r in fleet.replicas
                      if r.address == address), None)
        if found is None:
            return
        fleet, replica = found
        fleet.replicas.remove(replica)
        replica.gone.set()
        rest = f"its episodes go to {', '.join(self.addresses())}" if self.addresses() else "no env service is left"
        self.notices.log(f"env {address} left the run ({reason}); {rest}", kind="env")
        async with self._changed:
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def batch(self, what: str) -> AsyncIterator[EnvFleet]:
        """The fleet a batch (``what`` names it: "step 5") opens its episodes on: the run's when it begins, for the
        whole batch. The first batch after a swap says so."""
        fleet = self.fleet
        if self._switched:
            self._switched = False
            self.notices.log(f"env services switched to {fleet.target} from {what}: the first batch they run",
                             kind="env")
        fleet.batches += 1
        try:
            yield fleet
        finally:
            fleet.batches -= 1
            if fleet in self._swapped_out and fleet.batches == 0:
                self._swapped_out.remove(fleet)
                await close_clients(fleet)

    @contextlib.asynccontextmanager
    async def episode(self, row: dict, environment: str, max_parallel_calls: int, *, fleet: EnvFleet,
                      access: GatewayAccess | None = None) -> AsyncIterator[Episode]:
        """An episode of ``environment`` on ``row`` (at most ``max_parallel_calls`` tool calls run per turn; an agent
        environment's agent calls the gateway as ``access`` says), on a replica of the batch's ``fleet``, open for
        the ``with`` body and closed after it."""
        replica, episode_id, opening, busy_waits = await self._open(fleet, row, environment,
                                                                    max_parallel_calls=max_parallel_calls,
                                                                    access=access)
        try:
            yield Episode(replica=replica, episode_id=episode_id, opening=opening, timeout_s=self.timeout_s,
                          busy_waits=busy_waits)
        except EnvLost as error:
            await self.drop(replica.address, str(error))
            raise
        finally:
            await self._give_back(replica, episode_id)

    async def close(self) -> None:
        fleets = [self.fleet, *self._swapped_out, *([self._next] if self._next else [])]
        await asyncio.gather(*(close_clients(fleet) for fleet in fleets))

    async def _open(self, fleet: EnvFleet, row: dict, environment: str, *, max_parallel_calls: int,
                    access: GatewayAccess | None) -> tuple[EnvReplica, str, list[Message], int]:
        """Reset an episode on a replica of ``fleet`` (``_take``), asked again where one refuses it because every
        worker is busy: the replica, the episode's id, its opening messages and the refusals it met. A failed
        Reset raises as the trajectory sees it (EnvLost: the replica is dropped)."""
        busy_waits = 0
        while True:
            episode_id = uuid.uuid4().hex
            replica = await self._take(fleet, episode_id)
            try:
                opening = await replica.client.reset(episode_id, row, environment,
                                                     max_parallel_calls=max_parallel_calls, timeout=self.timeout_s,
                                                     access=access)
            except grpc.aio.AioRpcError as error:
                hint_s = retry_after_s(error)
                if hint_s is not None:
                    await self._refused(replica, episode_id, hint_s)
                    busy_waits += 1
                    continue
                failure = lost(replica, error)
                await self._not_opened(replica, episode_id, failure)
                raise failure from error
            except BaseException:
                await self._not_opened(replica, episode_id, None)
                raise
            await self._opened(replica, episode_id)
            return replica, episode_id, opening, busy_waits

    async def _take(self, fleet: EnvFleet, episode_id: str) -> EnvReplica:
        """The replica of ``fleet`` to ask for episode ``episode_id`` (``choose``), one of its workers taken for it
        (waiting while none may be asked); after a refusal this episode alone asks it again (``prober``). A
        swapped-out fleet with none left gives way to the run's. ResourceExhausted once replicas have refused the
        run for busy_bound_s with no episode opened meanwhile."""
        clock = asyncio.get_running_loop()
        async with self._changed:
            while True:
                if not fleet.replicas and fleet is not self.fleet:
                    fleet = self.fleet
                if not fleet.replicas:
                    break
                now = clock.time()
                replica = choose(fleet.replicas, now)
                if replica is not None:
                    replica.open += 1
                    if replica.refused:
                        replica.prober = episode_id
                    return replica
                wake = [t for t in (next_ask(fleet.replicas, now), self._give_up_at(fleet, now)) if t is not None]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(wake) - now if wake else None)
        await self.follow()  # every replica left: wait for one to come
        return await self._take(fleet, episode_id)

    def _give_up_at(self, fleet: EnvFleet, now: float) -> float | None:
        """When the run gives up waiting for a busy replica (None: none refused it since an episode last opened);
        ResourceExhausted, naming the cause, once that is past."""
        if self._refused_since is None:
            return None
        if now < self._refused_since + self.busy_bound_s:
            return self._refused_since + self.busy_bound_s
        raise ResourceExhausted(
            f"no env service of {fleet.target} had a worker free for this run's episodes for "
            f"{self.busy_bound_s:.0f} s ({BUSY_BOUND_CALLS} x trainer.rpc_timeout_s): every worker held an episode, "
            f"of this run or of others sharing the services; give them more workers (their setting workers) or "
            f"add env services to the group")

    async def _refused(self, replica: EnvReplica, episode_id: str, hint_s: float) -> None:
        """A Reset ``replica`` refused because every worker was busy: the worker taken goes back, and the replica is
        left alone for ``busy_backoff_s`` (a round of refusals counts once: the Resets sent together before the
        first came back, or one prober's)."""
        async with self._changed:
            now = asyncio.get_running_loop().time()
            probed = replica.prober == episode_id
            replica.refused = replica.refused + 1 if probed else max(replica.refused, 1)
            replica.ask_at = now + busy_backoff_s(hint_s, replica.refused)
            if probed:
                replica.prober = None
            replica.open -= 1
            if self._refused_since is None:
                self._refused_since = now
            self._changed.notify_all()

    async def _opened(self, replica: EnvReplica, episode_id: str) -> None:
        """An episode opened on ``replica``: it has workers free again, and the run is no longer refused."""
        self._refused_since = None
        if not replica.refused and replica.prober is None:
            return
        async with self._changed:
            if replica.prober == episode_id:
                replica.prober = None
            replica.refused, replica.ask_at = 0, 0.0
            self._changed.notify_all()

    async def _not_opened(self, replica: EnvReplica, episode_id: str, failure: Exception | None) -> None:
        """After a Reset that failed (``failure``, as the trajectory sees it) or was cancelled: a replica lost is
        dropped, and the worker taken goes back (the episode closed, where the service may have opened it)."""
        if replica.prober == episode_id:
            replica.prober = None
        if isinstance(failure, EnvLost):
            await self.drop(replica.address, str(failure))
        await self._give_back(replica, episode_id)

    async def _give_back(self, replica: EnvReplica, episode_id: str) -> None:
        if any(replica in fleet.replicas for fleet in (self.fleet, *self._swapped_out)):  # it still serves the run
            with contextlib.suppress(grpc.aio.AioRpcError):
                await replica.client.close_episode(episode_id, timeout=self.timeout_s)
        async with self._changed:
            replica.open -= 1
            replica.ask_at = 0.0  # a worker of its own is free there: no need to wait out a refusal
            self._changed.notify_all()

    async def _describe(self, address: str) -> EnvReplica | None:
        client = self.connect(address)
        try:
            return EnvReplica(client=client, description=await client.describe(DESCRIBE_TIMEOUT_S))
        except grpc.aio.AioRpcError:
            await client.close()
            return None


async def close_clients(fleet: EnvFleet) -> None:
    await asyncio.gather(*(replica.client.close() for replica in fleet.replicas))
