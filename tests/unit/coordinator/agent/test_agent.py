"""The agent loop's turn dispatcher (turns gathered into Generate calls per replica, each seeded from its own
index, cut to its room, moved off a failing replica) and its counts of tool calls, on in-process replicas."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch

from services.common.errors import Unavailable
from services.coordinator.agent.agent_loop import TurnDispatcher, count_calls
from services.coordinator.fleet.clients import Generated
from services.coordinator.settings import Sampling

SAMPLING = Sampling(n=1, temperature=1.0, top_p=1.0, max_new_tokens=99, stop_token_ids=())


class Replica:
    """Answers prompt i with ``length`` tokens, each its seed index (so a turn's tokens say which seed it got);
    fails its first ``failures`` calls."""

    def __init__(self, address: str, length: int = 3, version: int = 5, failures: int = 0):
        self.address, self.length, self.version, self.failures = address, length, version, failures
        self.calls: list[tuple[int, list[int], int]] = []  # (prompts, seed indices, max_new_tokens)

    async def generate(self, prompts, sampling, seed, first_index, timeout, seed_indices=None):
        self.calls.append((len(prompts), list(seed_indices), sampling.max_new_tokens))
        await asyncio.sleep(0.01)
        if self.failures:
            self.failures -= 1
            raise Unavailable(f"{self.address} is down")
        ids = [[index] * self.length for index in seed_indices]
        lens = torch.tensor([len(r) for r in ids])
        return Generated(response_ids=torch.tensor([t for r in ids for t in r]), response_lens=lens,
                         logprobs=torch.full((int(lens.sum()),), -1.0),
                         truncated=torch.zeros(len(ids), dtype=torch.bool), weight_versions=torch.full((len(ids),),
                                                                                                       self.version))


class Pool:
    def __init__(self, replicas):
        self.replicas = list(replicas)


class Rollouts:
    def __init__(self, *replicas):
        self.pool = Pool(replicas)

    async def refresh(self):
        raise AssertionError("no refresh expected")


def sample_all(dispatcher: TurnDispatcher, turns: list[tuple[int, int, object]]):
    async def run():
        try:
            return await asyncio.gather(*(dispatcher.sample([1, 2], room, index, prefer=prefer) for room, index, prefer in turns))
        finally:
            await dispatcher.close()
    return asyncio.run(run())


def test_turns_waiting_together_go_as_one_call_each_seeded_from_its_own_index():
    replica = Replica("a")
    dispatcher = TurnDispatcher(Rollouts(replica), SAMPLING, seed=1, oldest=0, timeout_s=5, calls_in_flight=1,
                                trajectories=3)
    sampled = sample_all(dispatcher, [(4, 7, None), (4, 3, None), (4, 12, None)])
    assert replica.calls == [(3, [7, 3, 12], 4)]
    assert [s.tokens.ids for s in sampled] == [(7, 7, 7), (3, 3, 3), (12, 12, 12)]
    assert all(s.replica is replica and s.tokens.weight_version == 5 and not s.truncated for s in sampled)


def test_a_turn_is_cut_to_its_room_when_the_call_ran_to_a_longer_one():
    replica = Replica("a", length=4)
    dispatcher = TurnDispatcher(Rollouts(replica), SAMPLING, seed=1, oldest=0, timeout_s=5, calls_in_flight=1,
                                trajectories=2)
    short, long = sample_all(dispatcher, [(2, 1, None), (6, 2, None)])
    assert replica.calls == [(2, [1, 2], 6)]  # the call asks for the longest room
    assert short.tokens.ids == (1, 1) and short.tokens.logprobs == (-1.0, -1.0) and short.truncated
    assert long.tokens.ids == (2, 2, 2, 2) and not long.truncated


def test_a_later_turn_goes_to_the_replica_of_the_turn_before():
    a, b = Replica("a"), Replica("b")
    dispatcher = TurnDispatcher(Rollouts(a, b), SAMPLING, seed=1, oldest=0, timeout_s=5,
                                calls_in_flight=1, trajectories=3)
    sampled = sample_all(dispatcher, [(4, 1, b), (4, 2, b), (4, 3, a)])
    assert [s.replica.address for s in sampled] == ["b", "b", "a"]
    assert b.calls == [(2, [1, 2], 4)] and a.calls == [(1, [3], 4)]


def test_turns_of_a_failing_replica_are_sampled_again_on_another_with_the_same_seeds():
    down, up = Replica("down", failures=5), Replica("up")
    dispatcher = TurnDispatcher(Rollouts(down, up), SAMPLING, seed=1, oldest=0, timeout_s=5,
                                calls_in_flight=1, trajectories=2)
    sampled = sample_all(dispatcher, [(4, 8, down), (4, 9, down)])
    assert down.calls == [(2, [8, 9], 4)]
    assert up.calls == [(2, [8, 9], 4)]
    assert [(s.replica.address, s.tokens.ids) for s in sampled] == [("up", (8, 8, 8)), ("up", (9, 9, 9))]


def test_a_turn_sampled_from_weights_older_than_the_batch_allows_is_sampled_again_elsewhere():
    old, new = Replica("old", version=2), Replica("new", version=4)
    dispatcher = TurnDispatcher(Rollouts(old, new), SAMPLING, seed=1, oldest=3, timeout_s=5,
                                calls_in_flight=1, trajectories=1)
    [turn] = sample_all(dispatcher, [(4, 1, old)])
    assert turn.replica is new and turn.tokens.weight_version == 4


def test_a_turn_that_fails_everywhere_fails_its_trajectory_naming_the_replica():
    dispatcher = TurnDispatcher(Rollouts(Replica("a", failures=99)), SAMPLING, seed=1, oldest=0, timeout_s=5,
                                calls_in_flight=1, trajectories=1)
    with pytest.raises(Unavailable, match="a turn failed on 4 attempts, last on a"):
        sample_all(dispatcher, [(4, 1, None)])


@pytest.fixture
def long_window(monkeypatch):
    """A gathering window of a minute: a call that waited it out would run past the tests' timeouts."""
    monkeypatch.setattr("services.coordinator.agent.agent_loop.GATHER_S", 60.0)


def test_a_lone_trajectorys_turn_goes_at_once_without_waiting_for_the_window(long_window):
    replica = Replica("a")
    dispatcher = TurnDispatcher(Rollouts(replica), SAMPLING, seed=1, oldest=0, timeout_s=5, calls_in_flight=1,
                                trajectories=1)

    async def run():
        try:
            return await asyncio.wait_for(dispatcher.sample([1, 2], 4, 7, prefer=None), timeout=20)
        finally:
            await dispatcher.close()
    assert asyncio.run(run()).tokens.ids == (7, 7, 7)
    assert replica.calls == [(1, [7], 4)]


def test_turns_wait_for_the_trajectories_still_running_and_go_together_once_the_last_has_ended(long_window):
    replica = Replica("a")
    dispatcher = TurnDispatcher(Rollouts(replica), SAMPLING, seed=1, oldest=0, timeout_s=5, calls_in_flight=1,
                                trajectories=3)

    async def run():
        try:
            turns = [asyncio.ensure_future(dispatcher.sample([1, 2], 4, index, prefer=None)) for index in (5, 6)]
            await asyncio.sleep(0.05)
            assert replica.calls == []  # the third trajectory may still send a turn: they wait for it
            dispatcher.trajectory_ended()  # it will not
            return await asyncio.wait_for(asyncio.gather(*turns), timeout=20)
        finally:
            await dispatcher.close()
    assert [s.tokens.ids for s in asyncio.run(run())] == [(5, 5, 5), (6, 6, 6)]
    assert replica.calls == [(2, [5, 6], 4)]


def test_tool_calls_are_counted_by_tool_and_outcome():
    calls, errors, timeouts = Counter(), Counter(), Counter()
    count_calls({"calls": [{"tool": "lookup", "outcome": "ok"}, {"tool": "lookup", "outcome": "error"},
                           {"tool": "", "outcome": "error"}]}, calls, errors, timeouts=timeouts)
    count_calls({"error": "tool hangs timed out after 2 s", "timed_out": True, "tool": "hangs"}, calls, errors,
                timeouts=timeouts)
    count_calls({"error": "the environment raised", "timed_out": False, "tool": ""}, calls, errors, timeouts=timeouts)
    count_calls({"calls": []}, calls, errors, timeouts=timeouts)  # a final answer: no call
    assert calls == {"lookup": 2, "(unparsed)": 1, "hangs": 1, "(environment)": 1}
    assert errors == {"lookup": 1, "(unparsed)": 1, "(environment)": 1}
    assert timeouts == {"hangs": 1}


def test_trajectory_metrics_count_turns_tools_and_tokens_by_hand():
    from services.coordinator.agent.agent_loop import AgentTrace, Ended, TurnRecord, agent_metrics
    from services.coordinator.agent.turns import Trajectory

    def trace(turns: int, calls: dict, errors: dict, ended: str, env_reward: float, seconds: float) -> AgentTrace:
        records = tuple(TurnRecord(role="model" if i % 2 == 0 else "reply", text="", tokens=1, trained=i % 2 == 0,
                                   weight_version=0, tool="", seconds=0.0) for i in range(turns))
        return AgentTrace(turns=records, final_text="", env_reward=env_reward, episode_service="env-1",
                          rollouts=("r",), last_versions=(0,), ended=Ended(ended), tool_calls=Counter(calls),
                          tool_errors=Counter(errors), tool_timeouts=Counter(), env_seconds=seconds,
                          restarts=1 if ended == "length" else 0, env_busy_waits=turns // 2)

    traces = [trace(1, {}, {}, "answer", 0.0, 0.0), trace(3, {"lookup": 1}, {}, "answer", 1.0, 0.5),
              trace(5, {"lookup": 2}, {"lookup": 1}, "length", 0.5, 1.5)]
    trajectories = [(Trajectory(prompt_ids=(1,), max_response_length=10, response_ids=(5, 5), loss_mask=(1, 1)),),
                    (Trajectory(prompt_ids=(1,), max_response_length=10, response_ids=(5, 6, 6, 5), loss_mask=(1, 0,
                                                                                                               0, 1)),),
                    (Trajectory(prompt_ids=(1,), max_response_length=10, response_ids=(5, 6, 5), loss_mask=(1, 0, 1)),
                     Trajectory(prompt_ids=(1,), max_response_length=10, response_ids=(6, 5, 5), loss_mask=(0, 1, 1)))]
    metrics = agent_metrics(traces, trajectories)
    assert metrics["num_turns/min"] == 1 and metrics["num_turns/max"] == 5 and metrics["num_turns/mean"] == 3
    assert metrics["agent/tool_calls/mean"] == 1.0 and metrics["agent/tool_call_rate"] == pytest.approx(2 / 3)
    assert metrics["agent/model_tokens/mean"] == pytest.approx((2 + 2 + 4) / 3)
    assert metrics["agent/tool_tokens/mean"] == pytest.approx((0 + 2 + 2) / 3)
    assert metrics["agent/env_seconds/mean"] == pytest.approx(2.0 / 3)
    assert metrics["agent/env_reward/mean"] == pytest.approx(0.5)
    assert metrics["agent/tool_errors"] == 1 and metrics["agent/tool_errors/lookup"] == 1
    assert metrics["agent/tool_timeouts"] == 0 and metrics["agent/ended/length"] == 1
    assert metrics["agent/episodes_restarted"] == 1
    assert metrics["agent/env_busy_waits"] == 0 + 1 + 2  # Resets refused while their env service was full
    assert metrics["agent/new_samples"] == 1  # the third went on in a second sample; its tokens count together
