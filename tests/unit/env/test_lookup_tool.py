"""CPU tests of the local multi-turn example's tool (examples/local_tools/lookup.py), loaded from its verl tool
config as the env service loads it: it answers each key with the lookup task's ground truth, and a bad key gets
an error reply."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.coordctl.synthetic import lookup_task_rows
from services.env.environment import ToolEnvironment, ToolLimits
from services.env.tools import read_tool_config

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def environment(monkeypatch) -> ToolEnvironment:
    """The example's tools, from the repository root as the README runs the example."""
    monkeypatch.chdir(ROOT)
    tools = read_tool_config("examples/local_tools/tools.yaml")
    assert [tool.name for tool in tools] == ["lookup"]
    return ToolEnvironment(tools, ToolLimits(max_parallel_calls=1, max_call_bytes=1000, max_reply_chars=100))


def call(arguments: dict) -> dict:
    return {"role": "assistant", "content": f"<tool_call>{json.dumps({'name': 'lookup', 'arguments': arguments})}"
                                            "</tool_call>"}


def test_the_tool_answers_each_key_with_the_tasks_ground_truth(environment):
    for row in lookup_task_rows(20, key_letters=2, seed=5):
        assert environment.reset(row) == []
        worked_call = row["extra_info"]["turns"][0]
        result = environment.step(worked_call)
        assert [m.content for m in result.messages] == [row["reward_model"]["ground_truth"]]
        assert result.info == {"calls": [{"tool": "lookup", "outcome": "ok"}]}


@pytest.mark.parametrize("arguments", [{"key": "qx"}, {"key": "Q1"}, {"key": 12}, {}])
def test_a_bad_key_gets_an_error_reply(environment, arguments):
    environment.reset({})
    result = environment.step(call(arguments))
    [reply] = result.messages
    assert reply.content.startswith('error: tool lookup failed: ValueError: "key" must be 1 to 8 capital letters')
    assert result.info == {"calls": [{"tool": "lookup", "outcome": "error"}]}
