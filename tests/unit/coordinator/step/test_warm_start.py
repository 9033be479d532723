"""CPU tests of services/coordinator/step/warm_start.py's multi-turn rows: a worked trajectory is taught token-exactly
as the agent loop builds it, the model's tokens trained and the tool's not, against the conversation written out
by hand in the tiny chat model's template."""

from __future__ import annotations

import pytest

from services.common.config import validate
from services.coordctl.synthetic import lookup_task_rows
from services.coordctl.tiny_model import build_chat_tokenizer
from services.coordinator.settings import loop_settings
from services.coordinator.step.warm_start import Taught, WarmStart, make_taught_batch
from services.run.config import RunConfig
from services.run.data import Prompt

TOOLS = ({"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"type": "string"}}}}},)


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def warm_start(tokenizer, max_response_length: int = 96) -> WarmStart:
    settings = loop_settings(validate(RunConfig, {"data": {"max_response_length": max_response_length}}))
    return WarmStart(settings=settings, actor=None, prompts=[], tokenizer=tokenizer, notices=None, timeout_s=1.0)


def prompt_of(row: dict, tokenizer) -> Prompt:
    return Prompt(token_ids=tokenizer.encode(row["prompt"][0]["content"]), data_source=row["data_source"],
                  ground_truth=row["reward_model"]["ground_truth"], extra_info=row["extra_info"],
                  messages=tuple(row["prompt"]))


def text(tokenizer, ids) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def test_a_worked_trajectory_is_taught_as_the_agent_loop_builds_it_and_only_the_models_turns_train(tokenizer):
    [row] = lookup_task_rows(1, key_letters=2, seed=0)
    key, code = row["prompt"][0]["content"][8:10], row["reward_model"]["ground_truth"]
    taught = warm_start(tokenizer).taught(prompt_of(row, tokenizer), TOOLS)
    assert text(tokenizer, taught.prompt_ids) == ("<|im_start|>system\nTools: lookup(key)<|im_end|>\n"
                                                  f"<|im_start|>user\ncode of {key}?<|im_end|>\n"
                                                  "<|im_start|>assistant\n")
    call = f'<tool_call>{{"name":"lookup","arguments":{{"key":"{key}"}}}}</tool_call><|im_end|>'
    reply = (f"\n<|im_start|>user\n<tool_response>\n{code}\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")
    answer = f"{code}<|im_end|>"
    assert text(tokenizer, taught.response_ids) == call + reply + answer
    lengths = [len(tokenizer.encode(part, add_special_tokens=False)) for part in (call, reply, answer)]
    assert taught.loss_mask == [True] * lengths[0] + [False] * lengths[1] + [True] * lengths[2]


def test_a_batch_has_a_loss_mask_only_where_a_token_is_not_trained():
    single = Taught(prompt_ids=[5, 6], response_ids=[7, 8], loss_mask=[True, True])
    assert make_taught_batch([single, single]).loss_mask is None
    multi = Taught(prompt_ids=[5], response_ids=[7, 8, 9], loss_mask=[True, False, True])
    assert make_taught_batch([single, multi]).loss_mask.tolist() == [True, True, True, False, True]


def test_malformed_turns_and_a_trajectory_over_the_response_length_are_refused_naming_the_row(tokenizer):
    [row] = lookup_task_rows(1, key_letters=2, seed=0)
    call, reply, answer = row["extra_info"]["turns"]
    for turns, message in (([reply, answer], "must start with an assistant message"),
                           ([call, answer], "two assistant messages in a row"),
                           ([{"role": "user", "content": "hi"}], "list of assistant and tool messages")):
        bad = prompt_of({**row, "extra_info": {**row["extra_info"], "turns": turns}}, tokenizer)
        with pytest.raises(ValueError, match=f"row 0: extra_info.turns.*{message}"):
            warm_start(tokenizer).taught(bad, TOOLS)
    with pytest.raises(ValueError, match=r"row 0: extra_info.turns.*data.max_response_length \(60 tokens\)"):
        warm_start(tokenizer, max_response_length=60).taught(prompt_of(row, tokenizer), TOOLS)
