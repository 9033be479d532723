"""CPU tests of services/coordinator/agent.py's turns: one trajectory over a stand-in rollout (fixed model turns)
and a stand-in episode (fixed replies), with test_turns.py's one-token-per-character ChatML tokenizer."""

from __future__ import annotations

import asyncio

from services.coordinator.agent import AgentLoop, Sampled
from services.coordinator.clients import EnvStep
from services.coordinator.settings import AgentSettings
from services.coordinator.turns import render_prompt, render_reply
from services.run.data import Prompt
from tests.unit.coordinator.test_turns import CONVERSATION, build_tokenizer, sampled

TURN = "<tool_call>x</tool_call><|im_end|>"
REPLY = {"role": "user", "content": "again"}


class Rollout:
    """Samples TURN at every call, and keeps the room each call gave."""

    address = "rollout:1"

    def __init__(self, tokenizer):
        self.tokenizer, self.rooms = tokenizer, []

    async def sample(self, ids, room, seed_index, prefer) -> Sampled:
        self.rooms.append(room)
        assert room >= 1, "a turn was asked for with no room left"
        tokens = sampled(self.tokenizer, TURN, version=1)
        return Sampled(tokens._replace(ids=tokens.ids[:room], logprobs=tokens.logprobs[:room]), 1,
                       truncated=len(tokens.ids) > room, replica=self)


class Episode:
    """Answers every model turn with REPLY, never done."""

    opening = ()
    service = "env-1 (test)"
    steps, seconds = 0, 0.0

    async def step(self, content: str) -> EnvStep:
        return EnvStep(messages=[REPLY], reward=0.0, done=False, info={})


def settings(max_response_length: int) -> AgentSettings:
    return AgentSettings(environment="e", max_assistant_turns=None, max_user_turns=None, max_parallel_calls=8,
                         max_reply_tokens=1000, truncate_side="middle", env_reward_weight=1.0,
                         max_response_length=max_response_length, max_prompt_length=1000, calls_in_flight=1)


def test_a_reply_that_fills_the_response_ends_the_trajectory_without_asking_for_an_empty_turn():
    tokenizer = build_tokenizer()
    turn_ids = sampled(tokenizer, TURN, version=1).ids
    reply_ids = render_reply(tokenizer, messages=CONVERSATION, sampled_ids=turn_ids, replies=[REPLY], room=10_000,
                             max_reply_tokens=1000, truncate_side="middle", template_kwargs={}).ids
    length = len(turn_ids) + len(reply_ids)  # one model turn and its reply fill the response exactly
    loop = AgentLoop(rollout_set=None, env_set=None, settings=settings(length), tokenizer=tokenizer, notices=None)
    rollout = Rollout(tokenizer)
    prompt = Prompt(token_ids=list(render_prompt(tokenizer, CONVERSATION, {})), data_source="d", ground_truth="",
                    extra_info={}, messages=CONVERSATION)

    trajectory, trace = asyncio.run(loop.turns(prompt, 0, (), Episode(), rollout))

    assert rollout.rooms == [length]
    assert trajectory.response_ids == turn_ids + reply_ids and trajectory.room == 0
    assert [turn.role for turn in trace.turns] == ["model", "reply"] and trace.ended == "length"
