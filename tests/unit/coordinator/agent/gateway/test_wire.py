"""OpenAI's wire format at the gateway's edge: refusals name the field, tool calls come back in OpenAI's form,
stop strings cut the tokens that train as well as the text."""

from __future__ import annotations

import json

import pytest

from services.coordctl.tiny_model import build_chat_tokenizer
from services.coordinator.agent.gateway.server import decode_choice
from services.coordinator.agent.gateway.wire import (RequestError, ToolChoice, assistant_message, chat_request,
                                                     hermes_text, stream_chunks)

MESSAGES = [{"role": "user", "content": "hi"}]


def refused(body: bytes | dict, max_n: int = 8) -> RequestError:
    with pytest.raises(RequestError) as error:
        chat_request(body if isinstance(body, bytes) else json.dumps(body).encode(), max_n)
    return error.value


def test_a_request_is_read_with_openai_names_and_defaults():
    request = chat_request(json.dumps({"model": "m", "messages": MESSAGES, "n": 2, "temperature": 0.5,
                                       "max_completion_tokens": 7, "stop": "\n", "stream": True,
                                       "stream_options": {"include_usage": True}, "tool_choice": "none"}).encode(), 4)
    assert (request.n, request.temperature, request.top_p, request.max_tokens) == (2, 0.5, None, 7)
    assert (request.stop, request.stream, request.include_usage) == (("\n",), True, True)
    assert request.tool_choice == ToolChoice(offered=False, opening="")


def test_bad_requests_are_refused_naming_what_is_wrong():
    assert (refused(b"{not json").status, refused(b"{not json").code) == (400, "invalid_json")
    assert refused({"messages": MESSAGES}).param == "model"
    too_many = refused({"model": "m", "messages": MESSAGES, "n": 9})
    assert (too_many.code, too_many.param) == ("n_too_large", "n")
    assert refused({"model": "m", "messages": []}).param == "messages"
    assert refused({"model": "m", "messages": [{"role": "robot", "content": "x"}]}).param == "messages[0]"
    assert refused({"model": "m", "messages": MESSAGES, "temperature": "hot"}).param == "temperature"
    assert refused({"model": "m", "messages": MESSAGES, "max_tokens": 0}).param == "max_tokens"
    assert refused({"model": "m", "messages": MESSAGES, "tools": [{"type": "function"}]}).param == "tools[0]"
    assert refused({"model": "m", "messages": MESSAGES, "top_logprobs": 3}).param == "top_logprobs"
    body = refused({"model": "m", "messages": MESSAGES, "n": 0}).body()
    assert set(body["error"]) == {"message", "type", "param", "code"}


LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}


def tool_choice(value, tools=(LOOKUP,)) -> ToolChoice:
    return chat_request(json.dumps({"model": "m", "messages": MESSAGES, "tools": list(tools),
                                    "tool_choice": value}).encode(), 8).tool_choice


def test_tool_choice_offers_the_tools_or_not_and_forces_the_opening_of_a_call_where_one_is_required():
    assert tool_choice("auto") == tool_choice(None) == ToolChoice(offered=True, opening="")
    assert tool_choice("none") == ToolChoice(offered=False, opening="")
    assert tool_choice("required") == ToolChoice(offered=True, opening="<tool_call>")
    named = tool_choice({"type": "function", "function": {"name": "lookup"}})
    assert named == ToolChoice(offered=True, opening='<tool_call>{"name": "lookup", "arguments": ')
    # the opening is how hermes_text writes a call of the function, up to its arguments
    assert hermes_text("", [{"function": {"name": "lookup", "arguments": "{}"}}]).startswith(named.opening)


def test_tool_choice_that_cannot_be_met_is_refused_naming_it():
    for value, tools, says in (("required", (), "no tools"), ({"type": "function", "function": {"name": "x"}},
                                                              (LOOKUP,), "'x'"),
                               ("sometimes", (LOOKUP,), "must be"), ({"type": "function"}, (LOOKUP,), "must be")):
        with pytest.raises(RequestError) as refused:
            tool_choice(value, tools)
        assert (refused.value.status, refused.value.param) == (400, "tool_choice") and says in str(refused.value)


def test_hermes_tool_calls_come_back_as_openai_tool_calls_and_malformed_ones_as_text():
    text = 'let me see<tool_call>{"name": "lookup", "arguments": {"key": "QX"}}</tool_call>'
    message = assistant_message(text, tool_names=frozenset({"lookup"}), parse_tools=True, call_id="call_1")
    assert message["content"] == "let me see"
    assert message["tool_calls"] == [{"id": "call_1_0", "type": "function",
                                      "function": {"name": "lookup", "arguments": '{"key": "QX"}'}}]
    assert assistant_message(text, tool_names=frozenset({"other"}), parse_tools=True, call_id="c") == {
        "role": "assistant", "content": text}  # an unknown tool: the text as it is
    assert "tool_calls" not in assistant_message(text, tool_names=frozenset({"lookup"}), parse_tools=False,
                                                 call_id="c")


def test_a_stop_string_cuts_the_text_and_the_ids_after_the_token_that_completes_it():
    tokenizer = build_chat_tokenizer()
    ids = tuple(tokenizer.encode("ab\ncd", add_special_tokens=False))
    choice = decode_choice(tokenizer, ids, (-1.0, -2.0, -3.0, -4.0, -5.0), truncated=True, stop=("\nc",))
    assert (choice.text, choice.token_ids, choice.logprobs, choice.finish_reason) == (
        "ab", ids[:4], (-1.0, -2.0, -3.0, -4.0), "stop")
    whole = decode_choice(tokenizer, ids, (-1.0,) * 5, truncated=True, stop=("zz",))
    assert (whole.text, whole.finish_reason, whole.tokens) == ("ab\ncd", "length", ("a", "b", "\n", "c", "d"))


def test_a_streamed_completion_is_its_role_content_calls_and_finish_then_usage():
    tokenizer = build_chat_tokenizer()
    choice = decode_choice(tokenizer, tuple(tokenizer.encode("0423", add_special_tokens=False)), (-0.5,) * 4,
                           truncated=False, stop=())
    chunks = stream_chunks(completion_id="c", model="m", messages=[{"role": "assistant", "content": "0423"}],
                           choices=[choice], prompt_ids=(1, 2, 3), logprobs=False, include_usage=True)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "0423"}, {}]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
