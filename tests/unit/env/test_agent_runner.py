"""CPU tests of an agent environment's pieces: its config, the reward an agent returns or prints, the relay's
messages from a worker checked, and an agent command run with the gateway's variables (no gateway needed: the
command reads them and prints its reward)."""

from __future__ import annotations

import sys

import pytest

from services.env.agent_runner import as_reward, run_agent
from services.env.config import EnvironmentConfig
from services.env.worker import http_request

LOOKUP = {"class_name": "lookup.py:LookupTool", "tool_schema": {"type": "function", "function": {"name": "lookup"}}}


def test_an_agent_environment_names_one_agent_and_may_list_its_tools():
    assert EnvironmentConfig(agent="my_agent.py:run").runs_agent
    assert EnvironmentConfig(agent="my_agent.py:run", tools=[LOOKUP]).runs_agent  # schemas only, never run
    assert EnvironmentConfig(agent_command=["python", "agent.py"]).runs_agent
    for bad in ({"agent": "a.py:run", "agent_command": ["x"]}, {"agent": "a.py:run", "environment": "e.py:E"},
                {"agent_command": []}, {}):
        with pytest.raises(ValueError):
            EnvironmentConfig(**bad)


def test_an_agents_reward_is_a_finite_number_or_none():
    assert as_reward(1) == 1.0 and as_reward(0.25) == 0.25 and as_reward(None) is None
    for bad in (True, "1", float("nan"), float("inf"), [1.0]):
        with pytest.raises((TypeError, ValueError)):
            as_reward(bad)


def test_a_workers_http_message_is_checked_before_the_service_sends_it_on():
    good = {"method": "POST", "path": "/v1/chat/completions", "headers": {"Authorization": "Bearer k"}, "body": "{}"}
    assert http_request(good) == good
    for bad in ({**good, "method": "DELETE"}, {**good, "path": "http://elsewhere/v1"}, {**good, "headers": {"a": 1}},
                {**good, "body": None}, "GET /"):
        with pytest.raises(ValueError):
            http_request(bad)


def agent_command(tmp_path, body: str) -> EnvironmentConfig:
    script = tmp_path / "agent.py"
    script.write_text(body)
    return EnvironmentConfig(agent_command=[sys.executable, str(script)], agent_timeout_s=20)


def no_relay(request: dict) -> dict:
    raise AssertionError("the agent made no call")


def test_an_agent_command_gets_the_gateway_variables_and_its_printed_number_is_its_reward(tmp_path):
    config = agent_command(tmp_path, "import json, os, sys\n"
                                     "row = json.loads(sys.stdin.read())\n"
                                     "assert row == json.loads(os.environ['MESHRL_ROW'])\n"
                                     "assert os.environ['OPENAI_BASE_URL'].startswith('http://127.0.0.1:')\n"
                                     "print('thinking')\n"
                                     "print(len(os.environ['OPENAI_API_KEY']) + row['bonus'])\n")
    result = run_agent(config, {"bonus": 2}, {"key": "k" * 5, "model": "run-1"}, relay=no_relay)
    assert (result.reward, result.done, result.info) == (7.0, True, {"agent_outcome": "ok", "reward_returned": True})


def test_an_agent_command_that_fails_or_hangs_is_an_outcome_not_an_error(tmp_path):
    access = {"key": "k", "model": "m"}
    failed = run_agent(agent_command(tmp_path, "raise SystemExit(3)"), {}, access, relay=no_relay)
    assert failed.info["agent_outcome"] == "raised" and "exited with 3" in failed.info["agent_error"]
    unscored = run_agent(agent_command(tmp_path, "print('an answer, no number')"), {}, access, relay=no_relay)
    assert unscored.info == {"agent_outcome": "ok", "reward_returned": False}
    hangs = agent_command(tmp_path, "import time\ntime.sleep(60)").model_copy(update={"agent_timeout_s": 0.5})
    assert run_agent(hangs, {}, access, relay=no_relay).info["agent_outcome"] == "timed_out"
