"""CPU tests of services/coordinator/env_set.py swaps: a swap probed, refused or applied at the boundary, a batch
begun before it keeping its replicas, a checkpoint's target taken up."""

from __future__ import annotations

import pytest

from services.coordinator.clients import EnvDescription
from services.coordinator.env_set import EnvProbe, EnvSet
from services.coordinator.targets import ServiceTarget

PROBE = EnvProbe("countdown", {"prompt": [{"role": "user", "content": "abc"}]}, max_parallel_calls=8)


class Env:
    """An env service hosting ``environments``, with ``workers`` episodes at once; it records its calls."""

    def __init__(self, address: str, environments=("countdown",), workers: int = 2):
        self.address, self.environments, self.workers = address, environments, workers
        self.calls: list[tuple] = []
        self.closed = False

    async def describe(self, timeout):
        return EnvDescription(f"env-{self.address}", "1.0", {name: () for name in self.environments}, self.workers)

    async def reset(self, episode_id, row, environment, max_parallel_calls, timeout):
        self.calls.append(("reset", environment, row, max_parallel_calls))
        return []

    async def close_episode(self, episode_id, timeout=5.0):
        self.calls.append(("close",))

    async def close(self):
        self.closed = True


class Notices:
    def __init__(self):
        self.messages = []

    def log(self, message, kind="log"):
        self.messages.append(message)

    def waiting(self, reason):
        pass


def env_set(groups: dict[str, list[Env]], notices: Notices) -> EnvSet:
    services = {env.address: env for group in groups.values() for env in group}
    find = lambda target: [env.address for env in groups.get(target.name, [])]  # noqa: E731 - the registry's view
    return EnvSet(ServiceTarget("group", "a"), find, notices, lambda: False, 60.0, connect=services.__getitem__)


async def open_episode(envs: EnvSet, fleet) -> str:
    async with envs.episode({"prompt": []}, "countdown", 8, fleet) as episode:
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

