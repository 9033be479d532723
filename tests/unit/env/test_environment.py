"""CPU tests of services/env/environment.py: a tool environment's step in-process, user results checked."""

from __future__ import annotations

import json

import pytest

from services.env.config import ToolConfig
from services.env.environment import Message, StepResult, ToolEnvironment, ToolLimits, as_messages, as_step_result

CHECK = ToolConfig(class_name="verl.tools.gsm8k_tool.Gsm8kTool",
                   tool_schema={"type": "function", "function": {"name": "check"}})


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def environment(**limits) -> ToolEnvironment:
    env = ToolEnvironment([CHECK], ToolLimits(**{"max_parallel_calls": 2, "max_call_bytes": 1000,
                                                 "max_reply_chars": 1000, **limits}))
    assert env.reset({"reward_model": {"ground_truth": "72"}}) == []
    return env


def test_each_call_gets_a_tool_reply_and_the_rewards_add_up():
    result = environment().step({"role": "assistant", "content": call("check", {"answer": "72"}) + " and "
                                 + call("check", {"answer": "71"})})
    assert [m.content for m in result.messages] == ["Current parsed answer=72 reward=1.0",
                                                    "Current parsed answer=71 reward=0.0"]
    assert (result.reward, result.done) == (1.0, False)
    assert result.info == {"calls": [{"tool": "check", "outcome": "ok"}] * 2}


def test_a_message_without_calls_ends_the_episode():
    assert environment().step({"role": "assistant", "content": "72"}) == StepResult(messages=[], done=True,
                                                                                     info={"calls": []})


def test_malformed_unknown_huge_and_too_many_calls_are_answered_with_errors():
    content = ("<tool_call>{nope</tool_call>" + call("ask", {}) + call("check", {"answer": "x" * 2000})
               + call("check", {"answer": "72"}) * 1000)
    result = environment(max_parallel_calls=3).step({"role": "assistant", "content": content})
    assert [c["outcome"] for c in result.info["calls"]] == ["error"] * 4
    assert "not valid JSON" in result.messages[0].content and "unknown tool 'ask'" in result.messages[1].content
    assert "at most 1000" in result.messages[2].content and "1003 tool calls in one turn" in result.messages[3].content


def test_long_replies_are_cut():
    result = environment(max_reply_chars=10).step({"role": "assistant", "content": call("check", {"answer": "72"})})
    assert result.messages[0].content.startswith("Current pa\n... (")


def test_what_a_user_environment_returns_is_checked():
    assert as_messages([{"role": "user", "content": "hi"}]) == [Message("user", "hi")]
    assert as_step_result({"messages": [], "reward": 1, "done": True}) == StepResult(messages=[], reward=1.0, done=True,
                                                                                     info={})
    for garbage in ("hi", [{"role": "robot", "content": "x"}], [{"role": "user"}]):
        with pytest.raises(ValueError, match="returned"):
            as_messages(garbage)
    with pytest.raises(ValueError, match="reward"):
        as_step_result({"messages": [], "reward": float("inf")})
    with pytest.raises(ValueError, match="not a StepResult"):
        as_step_result(1.0)
