"""The gateway's recording of an episode's calls: token-exact extension by the prefix rule, new segments where
the agent rewrites its history, branches for n > 1, and the budget."""

from __future__ import annotations

import json

import pytest

from services.coordctl.tiny_model import build_chat_tokenizer
from services.coordinator.agent.turns import SampledTokens, render_prompt
from services.coordinator.agent.gateway.episodes import turn_records
from services.coordinator.agent.gateway.recorder import Budget, EpisodeRecording
from services.coordinator.agent.gateway.wire import RequestError, assistant_message

LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "The code of a key.",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}}}}}
CALL_TEXT = '<tool_call>{"name": "lookup", "arguments": {"key": "QX"}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def sampled(tokenizer, text: str, version: int = 3) -> SampledTokens:
    """``text`` as the model would sample it: its ids and the stop token, each with a logprob of its own."""
    ids = tuple(tokenizer.encode(text, add_special_tokens=False)) + (tokenizer.eos_token_id,)
    return SampledTokens(ids=ids, logprobs=tuple(-0.01 * (k + 1) for k in range(len(ids))), weight_version=version)


def answer(recording: EpisodeRecording, tokenizer, plan, texts: list[str], call_id: str) -> list[dict]:
    """Record ``texts`` as the call's completions; the assistant messages the gateway returns for them."""
    messages = [assistant_message(text, tool_names=frozenset({"lookup"}), parse_tools=True, call_id=f"{call_id}_{j}")
                for j, text in enumerate(texts)]
    recording.record(plan, [(sampled(tokenizer, text), 3) for text in texts], tokenizer, returned=messages)
    return messages


def test_a_call_that_goes_on_from_a_completion_extends_it_token_exactly(tokenizer):
    recording = EpisodeRecording(budget=Budget(max_prompt_length=64, max_response_length=96))
    user = {"role": "user", "content": "code of QX?"}
    first = recording.plan(tokenizer, [user], (LOOKUP,))
    assert first.extends is None
    assert first.base.prompt_ids == render_prompt(tokenizer, [user], {"tools": [LOOKUP]})
    [returned] = answer(recording, tokenizer, first, [CALL_TEXT], "call_a")
    assert returned["content"] is None
    assert json.loads(returned["tool_calls"][0]["function"]["arguments"]) == {"key": "QX"}

    tool = {"role": "tool", "tool_call_id": returned["tool_calls"][0]["id"], "content": "0423"}
    second = recording.plan(tokenizer, [user, returned, tool], (LOOKUP,))
    [leaf] = recording.leaves
    assert second.extends is leaf
    first_sample = sampled(tokenizer, CALL_TEXT)
    assert second.base.ids[:len(leaf.trajectory.ids)] == first.base.prompt_ids + first_sample.ids  # never re-rendered
    # the same ids as the whole conversation rendered fresh: the character tokenizer splits text one way only
    rendered = render_prompt(tokenizer, [user, {"role": "assistant", "content": CALL_TEXT},
                                         {"role": "tool", "content": "0423"}], {"tools": [LOOKUP]})
    assert second.base.ids == rendered
    answer(recording, tokenizer, second, ["0423"], "call_b")

    [sample] = [leaf.trajectory for leaf in recording.leaves]
    reply_length = len(second.base.ids) - len(leaf.trajectory.ids)
    final = sampled(tokenizer, "0423")
    assert sample.prompt_ids == first.base.prompt_ids
    assert sample.response_ids == first_sample.ids + second.base.ids[len(leaf.trajectory.ids):] + final.ids
    assert sample.loss_mask == (1,) * len(first_sample.ids) + (0,) * reply_length + (1,) * len(final.ids)
    assert sample.logprobs == first_sample.logprobs + (0.0,) * reply_length + final.logprobs
    assert sample.weight_versions == (3, 3)
    assert (recording.calls, recording.segments, recording.final_text) == (2, 1, "0423")


def test_a_call_that_rewrites_the_history_starts_a_new_segment(tokenizer):
    recording = EpisodeRecording(budget=Budget(max_prompt_length=64, max_response_length=96))
    user = {"role": "user", "content": "code of QX?"}
    [returned] = answer(recording, tokenizer, recording.plan(tokenizer, [user], (LOOKUP,)), [CALL_TEXT], "call_a")
    summary = {"role": "user", "content": "code of QX? lookup says 0423"}  # the agent dropped the call and reply
    again = recording.plan(tokenizer, [summary], (LOOKUP,))
    assert again.extends is None
    answer(recording, tokenizer, again, ["0423"], "call_b")
    assert recording.segments == 2
    assert [leaf.trajectory.prompt_ids for leaf in recording.leaves] == [
        render_prompt(tokenizer, [user], {"tools": [LOOKUP]}), render_prompt(tokenizer, [summary], {"tools": [LOOKUP]})]
    # an edited assistant message extends nothing either
    edited = {**returned, "tool_calls": [{**returned["tool_calls"][0], "id": "call_unknown"}]}
    edited["tool_calls"][0]["function"] = {"name": "lookup", "arguments": '{"key": "QY"}'}
    tool = {"role": "tool", "tool_call_id": "call_unknown", "content": "0001"}
    assert recording.plan(tokenizer, [user, edited, tool], (LOOKUP,)).extends is None


def test_each_choice_of_a_call_is_a_sample_and_the_one_the_agent_goes_on_with_is_extended(tokenizer):
    recording = EpisodeRecording(budget=Budget(max_prompt_length=64, max_response_length=96))
    user = {"role": "user", "content": "code of QX?"}
    choices = answer(recording, tokenizer, recording.plan(tokenizer, [user], (LOOKUP,)), ["1111", "2222"], "call_a")
    assert [c["content"] for c in choices] == ["1111", "2222"]
    follow = recording.plan(tokenizer, [user, choices[1], {"role": "user", "content": "sure?"}], (LOOKUP,))
    assert follow.extends is recording.leaves[1]
    answer(recording, tokenizer, follow, ["yes"], "call_b")
    assert len(recording.leaves) == 2 and recording.segments == 1
    assert tokenizer.decode(list(recording.leaves[0].trajectory.response_ids), skip_special_tokens=True) == "1111"


def test_calls_over_the_budget_are_refused_as_over_the_context(tokenizer):
    recording = EpisodeRecording(budget=Budget(max_prompt_length=16, max_response_length=32))
    with pytest.raises(RequestError) as refused:
        recording.plan(tokenizer, [{"role": "user", "content": "code of QX?"}], (LOOKUP,))
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    assert "data.max_prompt_length=16" in str(refused.value)

    recording = EpisodeRecording(budget=Budget(max_prompt_length=40, max_response_length=30))
    user = {"role": "user", "content": "code of QX?"}
    [returned] = answer(recording, tokenizer, recording.plan(tokenizer, [user], ()), ["QX"], "call_a")
    long_reply = {"role": "user", "content": "x" * 40}  # more than the response has left: never cut, refused
    with pytest.raises(RequestError) as refused:
        recording.plan(tokenizer, [user, returned, long_reply], ())
    assert refused.value.code == "context_length_exceeded"


def test_a_forced_opening_is_fed_untrained_before_the_sampled_ids_and_a_later_call_extends_the_whole_turn(
        tokenizer):
    recording = EpisodeRecording(budget=Budget(max_prompt_length=64, max_response_length=96))
    user = {"role": "user", "content": "code of QX?"}
    opening = '<tool_call>{"name": "lookup", "arguments": '  # tool_choice naming lookup
    plan = recording.plan(tokenizer, [user], (LOOKUP,), opening=opening)
    opening_ids = tuple(tokenizer.encode(opening, add_special_tokens=False))
    assert plan.opening == opening_ids
    assert plan.prompt_ids == render_prompt(tokenizer, [user], {"tools": [LOOKUP]}) + opening_ids
    assert plan.room == 96 - len(opening_ids)
    rest = sampled(tokenizer, '{"key": "QX"}}</tool_call>')
    [returned] = [assistant_message(opening + '{"key": "QX"}}</tool_call>', tool_names=frozenset({"lookup"}),
                                    parse_tools=True, call_id="call_a")]
    recording.record(plan, [(rest, 3)], tokenizer, returned=[returned])
    [leaf] = recording.leaves
    assert leaf.trajectory.response_ids == opening_ids + rest.ids
    assert leaf.trajectory.loss_mask == (0,) * len(opening_ids) + (1,) * len(rest.ids)  # only the sampled train
    assert leaf.trajectory.logprobs == (0.0,) * len(opening_ids) + rest.logprobs

    tool = {"role": "tool", "tool_call_id": returned["tool_calls"][0]["id"], "content": "0423"}
    follow = recording.plan(tokenizer, [user, returned, tool], (LOOKUP,))
    assert follow.extends is leaf  # the turn, opening and all, extended token-exactly
    assert follow.base.ids[:len(leaf.trajectory.ids)] == plan.prompt_ids + rest.ids


def test_the_tool_calls_of_turns_a_forced_opening_began_are_counted(tokenizer):
    """Three calls of one episode: a free call of lookup, a call forced to name lookup (its opening, untrained, is
    the call's start), and a forced call the model sampled into a malformed one; each model turn's call counted
    once, by tool, from where it began."""
    recording = EpisodeRecording(budget=Budget(max_prompt_length=64, max_response_length=400))
    user = {"role": "user", "content": "code of QX?"}
    conversation: list[dict] = [user]
    named = '<tool_call>{"name": "lookup", "arguments": '
    for k, (opening, rest) in enumerate([("", CALL_TEXT), (named, '{"key": "QY"}}</tool_call>'),
                                         (named, '{"key": }</tool_call>')]):
        plan = recording.plan(tokenizer, conversation, (LOOKUP,), opening=opening)
        [returned] = [assistant_message(opening + rest, tool_names=frozenset({"lookup"}), parse_tools=True,
                                        call_id=f"call_{k}")]
        recording.record(plan, [(sampled(tokenizer, rest), 3)], tokenizer, returned=[returned])
        reply_to = returned["tool_calls"][0]["id"] if returned.get("tool_calls") else None
        conversation += [returned, {"role": "tool", "tool_call_id": reply_to, "content": "0423"}]
    [leaf] = recording.leaves  # every call extended the one before
    assert len(leaf.openings) == 2
    records, calls = turn_records(recording, tokenizer)
    assert [r.role for r in records] == ["model", "reply", "reply", "model", "reply", "reply", "model"]
    assert calls == {"lookup": 2, "(unparsed)": 1}


def test_an_opening_that_leaves_no_room_is_refused_as_over_the_context(tokenizer):
    recording = EpisodeRecording(budget=Budget(max_prompt_length=64, max_response_length=8))
    with pytest.raises(RequestError) as refused:
        recording.plan(tokenizer, [{"role": "user", "content": "hi"}], (LOOKUP,),
                       opening='<tool_call>{"name": "lookup", "arguments": ')
    assert refused.value.code == "context_length_exceeded"
