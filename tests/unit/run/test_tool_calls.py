"""CPU tests of services/run/tool_calls.py: Hermes tool calls parsed, hostile ones answered, never raised."""

from __future__ import annotations

import json

import pytest

from services.run.tool_calls import ParseError, ToolCall, check_format, parse_tool_calls

TOOLS = frozenset({"calculator", "lookup"})


def parse(text: str, max_parallel_calls: int = 4, max_call_bytes: int = 1000):
    return parse_tool_calls(text, tool_names=TOOLS, max_parallel_calls=max_parallel_calls,
                            max_call_bytes=max_call_bytes)


def test_a_turn_without_calls_is_a_final_answer():
    turn = parse("The answer is 42.")
    assert turn.content == "The answer is 42."
    assert turn.calls == ()


def test_several_calls_in_order_and_the_text_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call> done')
    turn = parse(text)
    assert turn.calls == (ToolCall(name="calculator", arguments={"expression": "6*7"}),
                          ToolCall(name="lookup", arguments={"key": "x"}))
    assert turn.content == "Let me compute.\n\n done"


def test_arguments_as_a_json_string_or_left_out():
    turn = parse('<tool_call>{"name": "lookup", "arguments": "{\\"key\\": 1}"}</tool_call>'
                 '<tool_call>{"name": "lookup"}</tool_call>')
    assert turn.calls == (ToolCall(name="lookup", arguments={"key": 1}), ToolCall(name="lookup", arguments={}))


@pytest.mark.parametrize(("block", "says"), [
    ('{"name": "calculator", "arguments": {"x": 1}', "not valid JSON"),
    ("not json at all", "not valid JSON"),
    ('{"name": "calculator", "arguments": {"x": NaN}}', "not valid JSON"),
    ('["calculator", {}]', "must be a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": 7, "arguments": {}}', 'no "name"'),
    ('{"name": "rm_rf", "arguments": {}}', "unknown tool 'rm_rf'; tools: calculator, lookup"),
    ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" of calculator must be a JSON object'),
    ('{"name": "calculator", "arguments": "not an object"}', '"arguments" of calculator must be a JSON object'),
    ('{"name": "calculator", "arguments": "[1]"}', '"arguments" of calculator must be a JSON object'),
    ("[" * 900 + "]" * 900, ""),  # deep nesting: an error (JSON or recursion), never an exception
])
def test_malformed_calls_are_errors_the_model_is_shown(block, says):
    (call,) = parse(f"<tool_call>{block}</tool_call>").calls
    assert isinstance(call, ParseError)
    assert says in call.message


@pytest.mark.parametrize("arguments", ['{"expression": "6\\ud800*7"}', '{"\\udc80": 1}',
                                       '"{\\"expression\\": \\"\\\\udfff\\"}"', '{"x": ["a", {"y": "\\ud83d"}]}'])
def test_a_lone_surrogate_escape_in_the_arguments_is_an_error_in_valid_text(arguments):
    (call,) = parse(f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>').calls
    assert isinstance(call, ParseError) and "half a surrogate pair" in call.message, call
    call.message.encode("utf-8")  # the reply itself travels


def test_a_surrogate_pair_escape_is_the_character_it_writes():
    (call,) = parse('<tool_call>{"name": "lookup", "arguments": {"key": "\\ud83d\\ude00"}}</tool_call>').calls
    assert call == ToolCall(name="lookup", arguments={"key": "\U0001f600"})


def test_deeply_nested_json_is_an_error_not_a_recursion_error():
    block = '{"name": "lookup", "arguments": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001
    (call,) = parse(f"<tool_call>{block}</tool_call>", max_call_bytes=10**7).calls
    assert isinstance(call, ParseError)


def test_a_huge_call_is_refused_by_its_size_unread():
    block = json.dumps({"name": "lookup", "arguments": {"blob": "x" * 10_000_000}})
    (call,) = parse(f"<tool_call>{block}</tool_call>", max_call_bytes=1_000_000).calls
    assert call == ParseError(f"tool call of {len(block)} bytes, at most 1000000")


def test_the_byte_bound_counts_utf8_bytes():
    block = json.dumps({"name": "lookup", "arguments": {"k": "é" * 300}}, ensure_ascii=False)
    (call,) = parse(f"<tool_call>{block}</tool_call>", max_call_bytes=400).calls
    assert isinstance(call, ParseError) and "bytes, at most 400" in call.message


def test_thousands_of_calls_are_bounded_to_one_error():
    one = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    turn = parse(one * 5000, max_parallel_calls=2)
    assert turn.calls[:2] == (ToolCall(name="lookup", arguments={}),) * 2
    assert turn.calls[2:] == (ParseError("5000 tool calls in one turn, at most 2: the first 2 were taken, "
                                         "the other 4998 were not run"),)


def test_an_unclosed_call_is_an_error_and_the_text_before_it_is_kept():
    turn = parse('I will look it up. <tool_call>{"name": "lookup", "argu')
    assert turn.content == "I will look it up. "
    assert turn.calls == (ParseError("a <tool_call> was not closed with </tool_call>"),)


def test_a_stray_closing_tag_is_just_text():
    turn = parse("no call here </tool_call>")
    assert turn.calls == ()


def test_error_messages_quote_little_of_a_long_block():
    (call,) = parse("<tool_call>" + "z" * 900 + "</tool_call>").calls
    assert isinstance(call, ParseError) and len(call.message) < 300


def test_an_unknown_format_is_refused_by_name():
    check_format("hermes")
    with pytest.raises(ValueError, match="'qwen3_coder' is not supported; supported: hermes"):
        check_format("qwen3_coder")
