"""Tests of services/env/episodes.py with real worker processes: an episode closed twice at once is closed once,
and what is closed or past max_steps is refused."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
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


def running_named(name: str) -> list[int]:
    """The host's running processes (not zombies) whose argv[0] is ``name``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            running = entry.name.isdigit() and (entry / "stat").read_text().rpartition(")")[2].split()[0] not in "ZX"
            if running and (entry / "cmdline").read_bytes().split(b"\0")[0] == name.encode():
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def ended(name: str, seconds: float = 10.0) -> bool:
    """Whether no process named ``name`` runs, within ``seconds`` (the kernel ending what was killed)."""
    deadline = time.monotonic() + seconds
    while running_named(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not running_named(name)


@pytest.fixture
def detaching():
    """One unsandboxed worker hosting hostile_tools.py's Detaches and Spins, 2 s per call."""
    tools = [{"class_name": f"{PLUGINS / 'hostile_tools.py'}:{cls}",
              "tool_schema": {"type": "function", "function": {"name": cls.lower()}}} for cls in ("Detaches", "Spins")]
    pool = Episodes(EnvServiceConfig.model_validate({"workers": 1, "call_timeout_s": 2.0,
                                                     "environments": {"e": {"tools": tools}}}), sandboxed=False)
    name = f"detached-{uuid.uuid4().hex[:12]}"
    yield pool, name
    pool.close_all()
    for pid in running_named(name):  # a failed test's leftovers
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def detach(name: str) -> Message:
    return Message("assistant", f'<tool_call>{{"name": "detaches", "arguments": {{"name": "{name}"}}}}</tool_call>')


def test_what_a_tool_started_and_detached_ends_with_its_episode_and_the_worker_serves_the_next(detaching):
    pool, name = detaching
    pool.reset("a", "e", {})
    assert [m.content for m in pool.step("a", detach(name)).messages] == ["detached"]
    assert len(running_named(name)) == 1  # a daemon: a session of its own, its parent gone
    pool.close("a")
    assert ended(name)
    pool.reset("b", "e", {})
    assert [m.content for m in pool.step("b", detach(name)).messages] == ["detached"]
    pool.close("b")
    assert ended(name)


def test_what_a_tool_started_and_detached_ends_when_its_unsandboxed_worker_is_replaced(detaching):
    pool, name = detaching
    pool.reset("a", "e", {})
    pool.step("a", detach(name))
    spun = pool.step("a", Message("assistant", '<tool_call>{"name": "spins", "arguments": {}}</tool_call>'))
    assert spun.info["restarted"] and spun.info["timed_out"]
    assert ended(name)
