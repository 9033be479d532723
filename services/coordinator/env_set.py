"""A run's env replicas: the env services of its placement group, and the episodes they hold for it.

Mirrors the reward set, for services that keep state per episode:
- The run uses the env services up in ``placement.env``; ``refresh`` (at each step boundary) follows them as
  they come and go, asking each new one what it hosts (``Info``) and how many episodes it can hold open.
- An episode (``episode``) is opened on the replica with the most free workers, waiting while every one is
  full, and closed when the trajectory ends, whatever its outcome. A replica whose call fails as unreachable
  is dropped (the trajectory starts its episode again on another: ``EnvLost``); one that left is taken back
  at a boundary once it is up again.
- ``tools(environment)``: the OpenAI schemas of an environment's tools, as its replicas host them (what the
  chat template renders into the prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Callable

import grpc

from services.common.rpc import is_retryable
from services.coordinator.clients import EnvClient, EnvDescription, EnvStep, Message
from services.coordinator.waiting import Notices, wait_for

DESCRIBE_TIMEOUT_S = 5.0  # an env service that does not say what it hosts this fast is not used yet


class EnvLost(Exception):
    """The env replica holding an episode failed (gone, unreachable, its deadline passed): the episode's state is
    lost with it, and the trajectory starts again on another."""


@dataclass(eq=False)
class EnvReplica:
    client: EnvClient
    description: EnvDescription
    open: int = 0  # episodes it holds for this run now
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # set when it is dropped: its steps in flight end

    @property
    def address(self) -> str:
        return self.client.address

    @property
    def free(self) -> int:
        return self.description.workers - self.open


@dataclass
class Episode:
    """One open episode on one replica."""

    replica: EnvReplica
    episode_id: str
    opening: list[Message]  # what the environment said before the model's first turn
    timeout_s: float
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


def lost(replica: EnvReplica, error: grpc.aio.AioRpcError) -> Exception:
    """EnvLost for a failure that says the replica is gone; the error itself for one that is the request's."""
    if is_retryable(error):
        return EnvLost(f"env {replica.address}: {error.code().name}: {error.details()}")
    return error


class EnvSet:
    def __init__(self, group: str, find: Callable[[str], list[str]], notices: Notices,
                 should_stop: Callable[[], bool], timeout_s: float, connect: Callable[[str], EnvClient] = EnvClient):
        """``find(group)``: the addresses of the group's env services up now; ``timeout_s``: of each Reset and
        Step call (a tool call is bounded by the env service's own call_timeout_s, well within it)."""
        self.group, self.find, self.connect = group, find, connect
        self.notices, self.should_stop, self.timeout_s = notices, should_stop, timeout_s
        self.replicas: list[EnvReplica] = []
        self.left: dict[str, str] = {}  # address -> why it was dropped
        self._changed = asyncio.Condition()

    def addresses(self) -> list[str]:
        return [replica.address for replica in self.replicas]

    def tools(self, environment: str) -> tuple[dict, ...]:
        """The tool schemas of ``environment``; ValueError if no replica hosts it, naming what they host."""
        for replica in self.replicas:
            if environment in replica.description.environments:
                return replica.description.environments[environment]
        hosted = sorted({name for r in self.replicas for name in r.description.environments})
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.environment = {environment!r}: no env service of "
                         f"group {self.group!r} hosts it (they host: {', '.join(hosted) or 'nothing'})")

    async def refresh(self) -> None:
        """Follow the group's env services: new ones are asked what they host, gone ones dropped; waits (state
        waiting) while none is up."""
        async def answering() -> list[EnvReplica]:
            known = {replica.address: replica for replica in self.replicas}
            fresh = [address for address in self.find(self.group) if address not in known]
            described = await asyncio.gather(*(self._describe(address) for address in fresh))
            up = set(self.find(self.group))
            return [r for r in self.replicas if r.address in up] + [r for r in described if r is not None]

        replicas = await wait_for(answering, self.notices, self.should_stop,
                                  f"no env service of group {self.group!r} answers; waiting for one")
        if {r.address for r in replicas} != set(self.addresses()):
            self.notices.log(f"env replicas of group {self.group!r}: {sorted(r.address for r in replicas)}",
                             kind="env")
        gone = [r for r in self.replicas if r not in replicas and r.open == 0]
        self.replicas = replicas
        for replica in replicas:
            self.left.pop(replica.address, None)
        await asyncio.gather(*(r.client.close() for r in gone))
        async with self._changed:
            self._changed.notify_all()

    async def drop(self, address: str, reason: str) -> None:
        """No further episode goes to the replica at ``address`` (its open ones fail as EnvLost)."""
        replica = next((r for r in self.replicas if r.address == address), None)
        if replica is None:
            return
        self.replicas.remove(replica)
        replica.gone.set()
        self.left[address] = reason
        rest = f"its episodes go to {', '.join(self.addresses())}" if self.replicas else "no env service is left"
        self.notices.log(f"env {address} left the run ({reason}); {rest}", kind="env")
        async with self._changed:
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def episode(self, row: dict, environment: str, max_parallel_calls: int) -> AsyncIterator[Episode]:
        """An episode of ``environment`` on ``row`` (at most ``max_parallel_calls`` tool calls run per turn), open
        for the ``with`` body and closed after it."""
        replica = await self._take()
        episode_id = uuid.uuid4().hex
        try:
            try:
                opening = await replica.client.reset(episode_id, row, environment, max_parallel_calls, self.timeout_s)
            except grpc.aio.AioRpcError as error:
                raise lost(replica, error) from error
            yield Episode(replica, episode_id, opening, self.timeout_s)
        except EnvLost as error:
            await self.drop(replica.address, str(error))
            raise
        finally:
            await self._give_back(replica, episode_id)

    async def close(self) -> None:
        await asyncio.gather(*(r.client.close() for r in self.replicas))

    async def _take(self) -> EnvReplica:
        """The replica with the most free workers, one taken for this episode (waiting while all are full)."""
        async with self._changed:
            while True:
                free = [r for r in self.replicas if r.free > 0]
                if free:
                    replica = max(free, key=lambda r: r.free)
                    replica.open += 1
                    return replica
                if not self.replicas:
                    break
                await self._changed.wait()
        await self.refresh()  # every replica left: wait for one to come
        return await self._take()

    async def _give_back(self, replica: EnvReplica, episode_id: str) -> None:
        if replica in self.replicas:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await replica.client.close_episode(episode_id, timeout=self.timeout_s)
        async with self._changed:
            replica.open -= 1
            self._changed.notify_all()

    async def _describe(self, address: str) -> EnvReplica | None:
        client = self.connect(address)
        try:
            return EnvReplica(client, await client.describe(DESCRIBE_TIMEOUT_S))
        except grpc.aio.AioRpcError:
            await client.close()
            return None
