"""A user's agent, run in an env worker for one episode: it calls the run's gateway, and what it returns is the
reward.

The worker has no network (its sandbox's namespace holds only its own loopback), so the agent's calls go out the
way everything of a worker does, over its socket to the service: the worker serves a relay on its own loopback
(``OPENAI_BASE_URL`` points there), and each request the relay takes is sent to the service as ("http",
request), which sends it on to the gateway (only there, only its path, method and the headers it needs) and
answers ("http_response", response) (services/env/episodes.py). The relay forwards one request at a time (the
socket is one conversation); a streamed answer comes back whole, then to the client as it was streamed.

- A function (``agent: path/to/file.py:run``): ``await run(client, row)``, ``client`` an ``openai.AsyncOpenAI``
  pointed at the relay with the episode's key; OPENAI_BASE_URL, OPENAI_API_KEY and OPENAI_MODEL are set in the
  worker's environment too, for code that builds its own client.
- A command (``agent_command``): run with those variables and MESHRL_ROW (the row as JSON, also on its stdin), in
  a session of its own (killed whole when it runs over); the last line it prints, where it is a number, is its
  reward.

Whichever it is, it runs at most ``agent_timeout_s``. The step's result: done, the reward (0 where none was
returned), and in info ``agent_outcome`` (ok, raised, timed_out), ``reward_returned`` and, where it failed,
``agent_error``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
from typing import Any, Callable

from services.common.plugins import load_named
from services.env.config import EnvironmentConfig
from services.env.environment import StepResult

RELAY_HEADERS = ("Authorization", "Content-Type", "Accept")
MAX_OUTPUT_BYTES = 1 << 20  # of a command's stdout that is read for its reward
ERROR_CHARS = 2000

Relay = Callable[[dict], dict]  # an HTTP request as a dict -> the gateway's response as a dict (blocking)


class AgentEpisode:
    """An agent environment's episode in a worker: its reset keeps the row, its one step runs the agent."""

    def __init__(self, config: EnvironmentConfig, access: dict, relay: Relay):
        self.config, self.access, self.relay = config, access, relay
        self.row: dict = {}

    def reset(self, row: dict) -> list:
        self.row = row
        return []

    def step(self, message: dict) -> StepResult:
        return run_agent(self.config, self.row, self.access, relay=self.relay)


def run_agent(config: EnvironmentConfig, row: dict, access: dict, *, relay: Relay) -> StepResult:
    """Run the episode's agent to its end (see the module's docstring); ``access``: the gateway's episode key and
    model name."""
    return asyncio.run(_run(config, row, access, relay=relay))


async def _run(config: EnvironmentConfig, row: dict, access: dict, *, relay: Relay) -> StepResult:
    from aiohttp import web

    lock = asyncio.Lock()

    async def forward(request: web.Request) -> web.Response:
        message = {"method": request.method, "path": request.path_qs, "body": (await request.read()).decode(),
                   "headers": {name: request.headers[name] for name in RELAY_HEADERS if name in request.headers}}
        async with lock:
            answer = await asyncio.to_thread(relay, message)
        return web.Response(status=answer["status"], body=answer["body"].encode(),
                            headers={"Content-Type": answer["content_type"]})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        variables = {"OPENAI_BASE_URL": f"http://127.0.0.1:{runner.addresses[0][1]}/v1",
                     "OPENAI_API_KEY": access["key"], "OPENAI_MODEL": access["model"]}
        try:
            reward = await asyncio.wait_for(
                run_function(config.agent, row, variables) if config.agent is not None
                else run_command(config.agent_command or [], row, variables), config.agent_timeout_s)
        except TimeoutError:
            return failed("timed_out", f"the agent did not end within agent_timeout_s={config.agent_timeout_s}")
        except Exception as error:  # noqa: BLE001 - the user's agent failed: the episode is failed, the run goes on
            return failed("raised", f"{type(error).__name__}: {error}")
    finally:
        await runner.cleanup()
    return StepResult(messages=[], reward=0.0 if reward is None else reward, done=True,
                      info={"agent_outcome": "ok", "reward_returned": reward is not None})


def failed(outcome: str, error: str) -> StepResult:
    return StepResult(messages=[], done=True, info={"agent_outcome": outcome, "reward_returned": False,
                                                    "agent_error": error[:ERROR_CHARS]})


async def run_function(ref: str, row: dict, variables: dict[str, str]) -> float | None:
    import openai

    function = load_named(ref, "agent", "function", accept=callable)
    os.environ.update(variables)
    async with openai.AsyncOpenAI(base_url=variables["OPENAI_BASE_URL"], api_key=variables["OPENAI_API_KEY"]) as client:
        return as_reward(await function(client, row))


async def run_command(command: list[str], row: dict, variables: dict[str, str]) -> float | None:
    row_json = json.dumps(row)
    process = await asyncio.create_subprocess_exec(
        *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **variables, "MESHRL_ROW": row_json}, start_new_session=True)
    try:
        stdout, stderr = await process.communicate(row_json.encode())
    finally:
        if process.returncode is None:  # cancelled (past agent_timeout_s): its whole session goes
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
    if process.returncode != 0:
        raise RuntimeError(f"the agent command exited with {process.returncode}: "
                           f"{stderr.decode(errors='replace')[-ERROR_CHARS:]}")
    lines = stdout[-MAX_OUTPUT_BYTES:].decode(errors="replace").strip().splitlines()
    try:
        return as_reward(float(lines[-1])) if lines else None
    except ValueError:
        return None  # its last line is no number: the reward service scores


def as_reward(value: Any) -> float | None:
    """The agent's reward: a finite number, or None; TypeError or ValueError for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"the agent returned {type(value).__name__}, not a number or None")
    if not math.isfinite(value):
        raise ValueError(f"the agent returned {value}, not a finite number")
    return float(value)
