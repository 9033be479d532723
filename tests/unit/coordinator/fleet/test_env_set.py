"""CPU tests of services/coordinator/fleet/env_set.py: swaps (probed, refused or applied at the boundary, a batch begun
before it keeping its replicas, a checkpoint's target taken up), and env services that other runs fill (a
refused Reset asked again, one at a time, elsewhere meanwhile, until the run gives up)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import FROM_HANDLER, ORIGIN_KEY, RETRY_AFTER_KEY, ResourceExhausted
from services.coordinator.fleet import env_set as env_set_module
from services.coordinator.fleet.clients import EnvDescription
from services.coordinator.fleet.env_set import EnvProbe, EnvSet, busy_backoff_s
from services.coordinator.fleet.targets import ServiceTarget

PROBE = EnvProbe("countdown", {"prompt": [{"role": "user", "content": "abc"}]}, max_parallel_calls=8)


class Env:
    """An env service hosting ``environments``, with ``workers`` episodes at once, ``others`` of them held by other
    runs; a Reset past them is refused as busy (ask again after ``hint_s``). It records its calls."""

    def __init__(self, address: str, environments=("countdown",), workers: int = 2, others: int = 0,
                 hint_s: float = 0.0):
        self.address, self.environments, self.workers = address, environments, workers
        self.others, self.hint_s = others, hint_s
        self.calls: list[tuple] = []
        self.closed = False
        self.open: set[str] = set()
        self.in_flight = 0
        self.refusals = 0
        self.overlapping = 0  # Resets sent while another was in flight, after the first refusal
        self.refused = asyncio.Event()

    async def describe(self, timeout):
        return EnvDescription(service_id=f"env-{self.address}", meshrl_version="1.0",
                              environments={name: () for name in self.environments}, workers=self.workers)

    async def reset(self, episode_id, row, environment, max_parallel_calls, timeout, access=None):
        self.calls.append(("reset", environment, row, max_parallel_calls))
        self.overlapping += bool(self.refusals and self.in_flight)
        self.in_flight += 1
        try:
            await asyncio.sleep(0)  # Resets sent together are in flight together
            if len(self.open) + self.others >= self.workers:
                self.refusals += 1
                self.refused.set()
                raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(
                    (ORIGIN_KEY, FROM_HANDLER), (RETRY_AFTER_KEY, str(round(self.hint_s * 1000)))), "all workers busy")
            self.open.add(episode_id)
            return []
        finally:
            self.in_flight -= 1

    async def close_episode(self, episode_id, timeout=5.0):
        self.calls.append(("close",))
        self.open.discard(episode_id)

    async def close(self):
        self.closed = True


class Notices:
    def __init__(self):
        self.messages = []

    def log(self, message, kind="log"):
        self.messages.append(message)

    def waiting(self, reason):
        pass


def env_set(groups: dict[str, list[Env]], notices: Notices, timeout_s: float = 60.0) -> EnvSet:
    services = {env.address: env for group in groups.values() for env in group}
    find = lambda target: [env.address for env in groups.get(target.name, [])]  # noqa: E731 - the registry's view
    return EnvSet(ServiceTarget("group", "a"), find, notices, should_stop=lambda: False, timeout_s=timeout_s,
                  connect=services.__getitem__)


async def open_episode(envs: EnvSet, fleet) -> str:
    async with envs.episode({"prompt": []}, "countdown", 8, fleet=fleet) as episode:
        return episode.replica.address


async def test_a_swap_is_probed_and_runs_the_batches_begun_after_the_boundary():
    a, b = Env("a:1"), Env("b:1")
    notices = Notices()
    envs = env_set({"a": [a], "b": [b]}, notices)
    await envs.refresh()
    assert await envs.swap(ServiceTarget("group", "b"), PROBE) == ["b:1"]
    assert b.calls == [("reset", "countdown", PROBE.row, 8), ("close",)]  # the probe episode, opened and closed
    async with envs.batch("step 2") as fleet:  # before the boundary: still group a
        assert await open_episode(envs, fleet) == "a:1"
    await envs.refresh()
    assert a.closed and envs.target == ServiceTarget("group", "b") and envs.addresses() == ["b:1"]
    async with envs.batch("step 3") as fleet:
        assert await open_episode(envs, fleet) == "b:1"
    async with envs.batch("step 4") as fleet:
        pass
    assert [m for m in notices.messages if "switched" in m] == [
        "env services switched to group b from step 3: the first batch they run"]


async def test_a_batch_begun_before_the_swap_ends_on_its_replicas_which_are_closed_after_it():
    a, b = Env("a:1"), Env("b:1")
    envs = env_set({"a": [a], "b": [b]}, Notices())
    await envs.refresh()
    await envs.swap(ServiceTarget("group", "b"), PROBE)
    async with envs.batch("step 2") as ahead:  # generated ahead: the boundary of step 2 comes while it runs
        await envs.refresh()
        assert not a.closed and set(envs.addresses()) == {"a:1", "b:1"}
        assert await open_episode(envs, ahead) == "a:1"
        async with envs.batch("step 3") as fleet:
            assert await open_episode(envs, fleet) == "b:1"
    assert a.closed and not b.closed and envs.addresses() == ["b:1"]


@pytest.mark.parametrize("group, reason", [
    ("c", "env c:1 (env-c:1) does not host the run's environment 'countdown' (it hosts: guess)"),
    ("none", "no env service is up in group none"),
])
async def test_a_refused_swap_leaves_the_run_its_services_and_says_why(group, reason):
    a, c = Env("a:1"), Env("c:1", environments=("guess",))
    envs = env_set({"a": [a], "c": [c]}, Notices())
    await envs.refresh()
    with pytest.raises(Exception, match=reason.replace("(", r"\(").replace(")", r"\)")):
        await envs.swap(ServiceTarget("group", group), PROBE)
    assert c.calls == []  # no probe episode on a service that does not host the environment
    await envs.refresh()
    assert envs.target == ServiceTarget("group", "a") and envs.addresses() == ["a:1"] and not a.closed


async def test_a_checkpoints_target_is_taken_up_at_the_next_refresh():
    a, b = Env("a:1"), Env("b:1")
    envs = env_set({"a": [a], "b": [b]}, Notices())
    await envs.refresh()
    envs.restore(ServiceTarget("group", "b"))
    await envs.refresh()
    assert envs.addresses() == ["b:1"] and a.closed
    async with envs.batch("step 5") as fleet:
        assert await open_episode(envs, fleet) == "b:1"



async def opened(envs: EnvSet, fleet) -> tuple[str, int]:
    """Open an episode and close it: the replica it opened on, and the busy refusals it met first."""
    async with envs.episode({"prompt": []}, "countdown", 8, fleet=fleet) as episode:
        return episode.replica.address, episode.busy_waits


@pytest.fixture
def patient(monkeypatch):
    """A busy replica is left alone as long as its hint says (up to an hour): what a test sees it asked again for
    is not the time passing."""
    monkeypatch.setattr(env_set_module, "BUSY_BACKOFF_MAX_S", 3600.0)


def test_a_busy_replica_is_left_alone_for_its_hint_doubled_with_each_refusal_in_a_row_within_bounds():
    assert [busy_backoff_s(0.5, refusals) for refusals in (1, 2, 3, 4, 5, 10_000)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert busy_backoff_s(0.0, 1) == 0.1 and busy_backoff_s(0.0, 3) == 0.4  # a hint of nothing: not a busy loop
    assert busy_backoff_s(60.0, 1) == 5.0


async def test_an_episode_refused_while_other_runs_fill_the_service_opens_once_they_let_go_and_is_counted():
    env = Env("a:1", workers=1, others=1)
    envs = env_set({"a": [env]}, Notices())
    await envs.refresh()
    async with envs.batch("step 1") as fleet:
        opening = asyncio.ensure_future(opened(envs, fleet))
        await env.refused.wait()
        assert not opening.done()  # waiting, not failed
        env.others = 0  # the other run's episode closed
        address, busy_waits = await opening
    assert address == "a:1" and busy_waits == env.refusals >= 1


async def test_while_a_replica_is_full_of_other_runs_episodes_the_others_take_them(patient):
    full, free = Env("a:1", workers=8, others=8, hint_s=60.0), Env("a:2", workers=2)
    envs = env_set({"a": [full, free]}, Notices())
    await envs.refresh()
    async with envs.batch("step 1") as fleet:
        first = await opened(envs, fleet)  # asked of a:1 first (the most free workers by the run's count)
        later = [await opened(envs, fleet) for _ in range(3)]
    assert first == ("a:2", 1)
    assert later == [("a:2", 0)] * 3 and full.refusals == 1  # a:1 left alone for its hint


async def test_a_busy_replica_is_asked_again_at_once_where_an_episode_of_the_run_closes_there(patient):
    env = Env("a:1", workers=2, others=1, hint_s=3600.0)
    envs = env_set({"a": [env]}, Notices())
    await envs.refresh()
    async with envs.batch("step 1") as fleet:
        async with envs.episode({"prompt": []}, "countdown", 8, fleet=fleet):  # the run's own, on the last free worker
            opening = asyncio.ensure_future(opened(envs, fleet))
            await env.refused.wait()
        # its worker is free now: the refused episode takes it, without waiting out the hour
        assert await asyncio.wait_for(opening, 60) == ("a:1", 1)


async def test_a_replica_that_stays_full_is_asked_one_reset_at_a_time_until_the_run_gives_up_naming_why():
    env = Env("a:1", workers=4, others=4)
    envs = env_set({"a": [env]}, Notices(), timeout_s=0.2)  # gives up after 3 x 0.2 s refused
    await envs.refresh()
    async with envs.batch("step 1") as fleet:
        outcomes = await asyncio.gather(*(opened(envs, fleet) for _ in range(4)), return_exceptions=True)
    assert all(isinstance(outcome, ResourceExhausted) for outcome in outcomes), outcomes
    assert str(outcomes[0]).startswith("no env service of group a had a worker free for this run's episodes for 1 s "
                                       "(3 x trainer.rpc_timeout_s): every worker held an episode")
    assert env.overlapping == 0  # after the first round (4 at once), one trajectory asked at a time
    assert 4 < env.refusals <= 4 + 6  # asked again, at least 0.1 s apart: no busy loop
    assert not env.open and envs.fleet.replicas[0].open == 0
