"""CPU tests of services/coordinator/agent/agent_loop.py's turns: one trajectory over a stand-in rollout (fixed model turns)
and a stand-in episode (fixed replies), with test_turns.py's one-token-per-character ChatML tokenizer (and its
template that strips earlier thinking, as Qwen3's does)."""

from __future__ import annotations

import asyncio
import dataclasses

from services.coordinator.agent.agent_loop import AgentLoop, Sampled, agent_metrics, trajectory_batch
from services.coordinator.fleet.clients import EnvStep
from services.coordinator.settings import AgentSettings
from services.coordinator.agent.turns import render_prompt, render_reply
from services.run.data import Prompt
from tests.unit.coordinator.agent.test_turns import (CALL, CONVERSATION, PROMPT_TEXT, STRIPS_THINKING, build_tokenizer,
                                              encode, sampled)

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

    (trajectory,), trace = asyncio.run(loop.turns(prompt, 0, (), episode=Episode(), dispatcher=rollout))

    assert rollout.rooms == [length]
    assert trajectory.response_ids == turn_ids + reply_ids and trajectory.room == 0
    assert [turn.role for turn in trace.turns] == ["model", "reply"] and trace.ended == "length"


THOUGHT = "<think>look it up</think>"
CALL_TURN = CALL + "<|im_end|>"


class ScriptedRollout:
    """Samples the turns given, in order, each at its weight version; keeps the ids and room each call gave."""

    address = "rollout:1"

    def __init__(self, tokenizer, turns: list[tuple[str, int]]):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), []

    async def sample(self, ids, room, seed_index, prefer) -> Sampled:
        self.calls.append((tuple(ids), room))
        text, version = self.turns.pop(0)
        return Sampled(sampled(self.tokenizer, text, version), version, truncated=False, replica=self)


class ToolThenDone:
    """Answers the first two model turns with a tool's reply ("42", then "ok"), and the third with done."""

    opening = ()
    service = "env-1 (test)"
    steps, seconds = 0, 0.0

    def __init__(self):
        self.replies = [[{"role": "tool", "content": "42"}], [{"role": "tool", "content": "ok"}]]

    async def step(self, content: str) -> EnvStep:
        if not self.replies:
            return EnvStep(messages=[], reward=0.0, done=True, info={})
        return EnvStep(messages=self.replies.pop(0), reward=0.0, done=False, info={})


def thinking_loop(max_response_length: int, max_assistant_turns: int | None = None):
    tokenizer = build_tokenizer(STRIPS_THINKING)
    agent = dataclasses.replace(settings(max_response_length), max_assistant_turns=max_assistant_turns)
    loop = AgentLoop(rollout_set=None, env_set=None, settings=agent, tokenizer=tokenizer, notices=None)
    prompt = Prompt(token_ids=list(render_prompt(tokenizer, CONVERSATION, {})), data_source="d", ground_truth="",
                    extra_info={}, messages=CONVERSATION)
    return tokenizer, loop, prompt


def test_a_template_that_strips_thinking_starts_a_new_sample_from_the_conversation_rendered_fresh():
    tokenizer, loop, prompt = thinking_loop(max_response_length=500)
    rollout = ScriptedRollout(tokenizer, [(THOUGHT + CALL_TURN, 1), (CALL_TURN, 2), ("It is 42.<|im_end|>", 2)])

    samples, trace = asyncio.run(loop.turns(prompt, 0, (), episode=ToolThenDone(), dispatcher=rollout))

    first, second = samples
    turn1, turn2, turn3 = (encode(tokenizer, text) for text in (THOUGHT + CALL_TURN, CALL_TURN, "It is 42.<|im_end|>"))
    # the first sample is the prompt and the turn sampled from it, all of it trained
    assert first.prompt_ids == encode(tokenizer, PROMPT_TEXT) and first.response_ids == turn1
    assert first.loss_mask == (1,) * len(turn1) and first.logprobs == (-0.25,) * len(turn1)
    # the second's prompt: the conversation with the tool's reply, the first turn's thinking stripped, as written
    # out by hand; it is exactly what the second turn was sampled from
    fresh = (PROMPT_TEXT + CALL + "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")
    assert second.prompt_ids == encode(tokenizer, fresh) == rollout.calls[1][0]
    # in it, the next reply appends token-exactly (nothing more is stripped) and carries no loss
    bridge = encode(tokenizer, "\n<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert second.response_ids == turn2 + bridge + turn3 == rollout.calls[2][0][len(second.prompt_ids):] + turn3
    assert second.loss_mask == (1,) * len(turn2) + (0,) * len(bridge) + (1,) * len(turn3)
    # the room: the first sample's less its turn and what the conversation grew by in the fresh rendering
    # (the reply's 55 tokens less the 25 of the thinking stripped)
    assert len(encode(tokenizer, THOUGHT)) == 25
    assert [room for _, room in rollout.calls] == [500, 500 - len(turn1) - 30, 500 - len(turn1) - 30 - len(turn2)
                                                   - len(bridge)]
    assert len(first.response_ids) + len(second.response_ids) <= 500
    assert [(t.role, t.sample, t.tokens) for t in trace.turns] == [
        ("model", 0, len(turn1)), ("reply", 1, 0), ("model", 1, len(turn2)), ("reply", 1, len(bridge)),
        ("model", 1, len(turn3))]
    assert trace.last_versions == (1, 2) and trace.ended == "done" and trace.final_text == "It is 42."
    assert agent_metrics([trace], [samples])["agent/new_samples"] == 1
    batch = trajectory_batch(list(samples))
    assert batch.response_lens.tolist() == [len(turn1), len(second.response_ids)]
    assert batch.loss_mask.tolist() == [True] * len(turn1) + [bool(m) for m in second.loss_mask]


def test_the_turn_limit_counts_the_model_turns_of_every_sample():
    tokenizer, loop, prompt = thinking_loop(max_response_length=500, max_assistant_turns=2)
    rollout = ScriptedRollout(tokenizer, [(THOUGHT + CALL_TURN, 1), (CALL_TURN, 1), ("never sampled", 1)])

    samples, trace = asyncio.run(loop.turns(prompt, 0, (), episode=ToolThenDone(), dispatcher=rollout))

    assert len(samples) == 2 and len(rollout.calls) == 2 and trace.ended == "max_assistant_turns"


def test_a_conversation_that_outgrows_what_is_left_of_the_response_ends_over_budget():
    turn = encode(build_tokenizer(), THOUGHT + CALL_TURN)
    tokenizer, loop, prompt = thinking_loop(max_response_length=len(turn) + 30)
    rollout = ScriptedRollout(tokenizer, [(THOUGHT + CALL_TURN, 1)])

    samples, trace = asyncio.run(loop.turns(prompt, 0, (), episode=ToolThenDone(), dispatcher=rollout))

    # the fresh rendering grows the conversation by 30 tokens: exactly the room left, none for a turn
    assert len(samples) == 1 and trace.ended == "over_budget"
