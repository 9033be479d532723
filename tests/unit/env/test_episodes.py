"""Tests of services/env/episodes.py with real worker processes: an episode closed twice at once is closed once,
and what is closed or past max_steps is refused."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.env.config import EnvServiceConfig
from services.env.environment import Message
from services.env.episodes import Episodes

PLUGINS = Path(__file__).resolve().parents[2] / "integration" / "plugins"
CHECK = {"class_name": "verl.tools.gsm8k_tool.Gsm8kTool", "tool_schema": {"type": "function",
                                                                        "function": {"name": "check"}}}


@pytest.fixture
def episodes():
    pool = Episodes(EnvServiceConfig.model_validate({"workers": 1, "max_steps": 2,
                                                     "environments": {"e": {"tools": [CHECK]}}}), sandboxed=False)
    yield pool
    pool.close_all()


def test_an_episode_closed_twice_at_once_is_closed_once_and_its_worker_serves_the_next(episodes):
    episodes.reset("a", "e", {})
    with ThreadPoolExecutor(2) as threads:
        closed = list(threads.map(episodes.close, ["a", "a"]))
    assert sorted(closed) == [False, True]
    with pytest.raises(NotFound):
        episodes.step("a", Message("assistant", "x"))
    assert episodes.reset("b", "e", {}) == []  # the one worker went back once


def test_the_last_step_says_done_and_one_more_is_refused(episodes):
    episodes.reset("a", "e", {})
    call = '<tool_call>{"name": "check", "arguments": {"answer": "1"}}</tool_call>'
    assert not episodes.step("a", Message("assistant", call)).done
    last = episodes.step("a", Message("assistant", call))
    assert last.done and last.info["max_steps"]
    with pytest.raises(FailedPrecondition, match="max_steps"):
        episodes.step("a", Message("assistant", call))


def kills_its_worker(folder: Path, deaths: int) -> Episodes:
    return Episodes(EnvServiceConfig.model_validate({"workers": 1, "environments": {"e": {
        "environment": f"{PLUGINS / 'user_env.py'}:KillsItsWorker", "options": {"folder": str(folder),
                                                                               "deaths": deaths}}}}), sandboxed=False)


def test_a_worker_dying_under_a_reset_is_replaced_and_the_reset_answered_by_its_replacement(tmp_path: Path):
    pool = kills_its_worker(tmp_path, deaths=1)
    try:
        assert pool.reset("a", "e", {}) == []
        assert sorted(path.name for path in tmp_path.iterdir()) == ["died-0"]  # one worker died, one answered
        assert pool.step("a", Message("assistant", "x")).reward == 0.25
    finally:
        pool.close_all()


def test_an_environment_whose_reset_kills_every_worker_is_refused_and_the_service_keeps_a_worker(tmp_path: Path):
    pool = kills_its_worker(tmp_path, deaths=2)
    try:
        with pytest.raises(ValueError, match=r"environment e could not reset: its worker died \(exit code 3\)"):
            pool.reset("a", "e", {})
        assert pool.reset("b", "e", {}) == []  # deaths spent: the worker that took their place answers
    finally:
        pool.close_all()
