"""A run's reward replicas: who scores its batches, and a swap to other reward services mid-run.

Mirrors the rollout set:
- The run scores with the reward services up in its target (a group, or one address). At each step
  boundary (``refresh``) the set follows the target's services as they come and go.
- A batch is spread over the replicas (``score``, through ReplicaPool): a shard whose replica fails is
  redone on another; when every replica failed it, the run waits (state ``waiting``, naming the services
  that left) until a service of the target answers an empty Score, and the batch is scored again.
- A replica that stops heartbeating (stopped, cut off: its calls would hang until their deadline) is
  dropped at once (``drop``, called by the run's watchdog): its calls in flight are cancelled and their
  shards scored on the others; it is taken back at a step boundary once it is up again.
- A swap (``swap``, from ``coordctl reward set``) is probed first: each new service must score a probe
  batch (some prompts' ground truths as their responses) with valid scores, or the swap is refused and the
  run keeps its services. An accepted swap applies at the next step boundary; its event names the first
  batch the new services score (with generation ahead of training, a later step than the boundary's).
- A client left at a boundary is closed one boundary later: a batch generated ahead may still be scoring
  on it.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import Callable, NamedTuple

from services.common.errors import FailedPrecondition, Unavailable
from services.coordinator.fleet.clients import RewardClient, RewardSample, ScoredSample
from services.run.data import Prompt
from services.coordinator.fleet.dispatch import ReplicaPool, map_shards_recovering
from services.coordinator.fleet.targets import ServiceTarget
from services.coordinator.waiting import Notices, wait_for

SCORING_ATTEMPTS = 3  # a batch scored again after every reward replica failed it, before giving up
ANSWER_TIMEOUT_S = 2.0  # a reward service that does not answer an empty Score this fast is not waited for
SWAP_PROBE_SAMPLES = 4
SWAP_PROBE_TIMEOUT_S = 15.0


class ScoredBy(NamedTuple):
    """The reward replica that scored a sample."""

    service_id: str
    address: str


@dataclass(frozen=True)
class Scored:
    """A batch's scores, and the reward replica that scored each, in sample order."""

    scores: list[ScoredSample]
    scored_by: list[ScoredBy]

    @property
    def by_service(self) -> dict[str, int]:
        """Service id -> samples it scored."""
        counts: dict[str, int] = {}
        for service_id, _ in self.scored_by:
            counts[service_id] = counts.get(service_id, 0) + 1
        return counts


def probe_samples(prompts: list[Prompt]) -> list[RewardSample]:
    """Each prompt's ground truth as its response: a scorer that works gives each a valid score."""
    return [RewardSample(data_source=p.data_source, response=p.ground_truth, ground_truth=p.ground_truth,
                         extra_info=p.extra_info)
            for p in prompts[:SWAP_PROBE_SAMPLES]]


async def probe(client: RewardClient, samples: list[RewardSample]) -> None:
    """ValueError unless ``client`` scores every sample validly."""
    scores, _ = await client.score(samples, SWAP_PROBE_TIMEOUT_S)
    invalid = [s.error for s in scores if not s.valid]
    if invalid:
        raise ValueError(f"{client.address} could not score the probe: {invalid[0]}")


class RewardSet:
    def __init__(self, target: ServiceTarget, find: Callable[[ServiceTarget], list[str]], notices: Notices,
                 *, should_stop: Callable[[], bool], timeout_s: float,
                 connect: Callable[[str], RewardClient] = RewardClient):
        """``find(target)``: the addresses of the target's reward services up now; ``connect``: a client of the
        reward service at an address; ``timeout_s``: of each Score call."""
        self.target, self.find, self.connect = target, find, connect
        self.notices, self.should_stop, self.timeout_s = notices, should_stop, timeout_s
        self.clients: list[RewardClient] = [connect(address) for address in find(target)]
        self._next: tuple[list[RewardClient], ServiceTarget] | None = None  # a swap waiting for the boundary
        self._switched = False  # a swap was applied: the next score call says which batch it scores first
        self._retired: list[RewardClient] = []  # clients left at the last boundary, closed at the next
        self._pools: weakref.WeakSet[ReplicaPool] = weakref.WeakSet()  # of the batches scoring now: drop reaches them
        self.left: dict[str, str] = {}  # address -> why it was dropped, until it scores for the run again

    def addresses(self) -> list[str]:
        return [client.address for client in self.clients]

    async def drop(self, address: str, reason: str) -> None:
        """Take a replica out now: no further shard goes to it, its calls in flight are cancelled and their shards
        scored on the others (or, with none left, once one answers)."""
        client = next((c for c in self.clients if c.address == address), None)
        if client is None:
            return
        self.clients = [c for c in self.clients if c is not client]
        for pool in list(self._pools):
            pool.drop(client)
        self.left[address] = reason
        rest = (f"its batches go to {', '.join(self.addresses())}" if self.clients
                else "no reward service is left: the run waits for one")
        self.notices.log(f"reward {address} left the run ({reason}); {rest}", kind="reward")
        await client.close()

    async def score(self, samples: list[RewardSample], what: str) -> Scored:
        """One score per sample, the batch spread over the replicas (waiting for the target's services if every
        replica fails it); ``what`` names the batch ("step 5") in the event of a swap's first batch."""
        if self._switched:
            self._switched = False
            self.notices.log(f"reward services switched to {self.target} from {what}: the first batch they score",
                             kind="reward")
        async def call(replica: RewardClient, lo: int, hi: int) -> tuple[list[ScoredSample], str]:
            return await replica.score(samples[lo:hi], self.timeout_s)

        async def wait(failure: Unavailable) -> None:
            self.notices.log(f"scoring failed on every reward replica ({failure}); waiting for the reward "
                             f"services and scoring the batch again")
            await self._wait_for_answering()

        def pool() -> ReplicaPool[RewardClient]:
            self._pools.add(replicas := ReplicaPool("reward", self.clients))
            return replicas

        shards = await map_shards_recovering(pool, len(samples), call, attempts=SCORING_ATTEMPTS, recover=wait)
        return Scored([score for (scores, _), _ in shards for score in scores],
                      [ScoredBy(service_id, replica.address) for (scores, service_id), replica in shards
                       for _ in scores])

    async def swap(self, target: ServiceTarget, probe_batch: list[RewardSample]) -> list[str]:
        """Probe the target's services; if every one scores the probe, use them from the next step boundary on.
        Returns their addresses; FailedPrecondition if none is up, ValueError or a call's error if one fails
        the probe (the run then keeps its services)."""
        addresses = self.find(target)
        if not addresses:
            raise FailedPrecondition(f"no reward service is up in {target}")
        clients = [self.connect(address) for address in addresses]
        try:
            await asyncio.gather(*(probe(client, probe_batch) for client in clients))
        except BaseException:
            await asyncio.gather(*(client.close() for client in clients))
            raise
        self._next = (clients, target)
        return addresses

    async def refresh(self, step: int) -> None:
        """At a step boundary (before step ``step`` is trained): apply an accepted swap, then follow the target's
        replicas as they come and go. A batch generated ahead may already be scored: the swap's event names the
        first batch the new services score."""
        clients = self.clients
        if self._next is not None:
            (clients, self.target), self._next = self._next, None
            self._switched = True
        addresses = self.find(self.target) or [c.address for c in clients]  # none up: keep trying these
        await self._use(clients, addresses, f"from step {step}")

    def restore(self, target: ServiceTarget) -> None:
        """Go on with the target a checkpoint recorded (taken up at the next refresh)."""
        self.target = target

    async def close(self) -> None:
        pending = [self._next[0] if self._next else [], self._retired, self.clients]
        await asyncio.gather(*(client.close() for client in {c for group in pending for c in group}))

    async def _wait_for_answering(self) -> None:
        """Wait (state waiting) until a service of the target answers an empty Score (a dead one stays registered
        until it misses its heartbeats), then score with those that answer."""
        async def answering() -> list[str]:
            clients = [self.connect(address) for address in self.find(self.target)]
            answers = await asyncio.gather(*(c.score([], ANSWER_TIMEOUT_S) for c in clients), return_exceptions=True)
            await asyncio.gather(*(c.close() for c in clients))
            return [c.address for c, answer in zip(clients, answers) if not isinstance(answer, BaseException)]

        gone = "; ".join(f"{address} left the run: {reason}" for address, reason in self.left.items())
        addresses = await wait_for(answering, self.notices, self.should_stop, reason=f"no reward service of "
                                   f"{self.target} answers{f' ({gone})' if gone else ''}; waiting for one to answer")
        await self._use(self.clients, addresses, "to score the batch again")

    async def _use(self, clients: list[RewardClient], addresses: list[str], when: str) -> None:
        """Score with the services at ``addresses`` (reusing the clients of ``clients`` that are among them)."""
        by_address = {client.address: client for client in clients}
        if set(addresses) != set(by_address):
            self.notices.log(f"reward replicas of {self.target} {when}: {sorted(addresses)}", kind="reward")
        new = [by_address.get(address) or self.connect(address) for address in addresses]
        for address in addresses:
            self.left.pop(address, None)
        retired = [c for c in {*self.clients, *clients} if c not in new]
        self.clients = new
        # closed one boundary later: a batch generated ahead may still be scoring on them
        await asyncio.gather(*(client.close() for client in self._retired if client not in new))
        self._retired = retired
