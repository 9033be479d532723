"""The env servicer: wire <-> episodes, nothing else.

Each RPC's work runs in a thread of the servicer's own pool (a call may wait on a worker process up to
``call_timeout_s`` per tool call), sized so that every worker can be busy at once: asyncio's default pool (a few
threads more than the CPUs) would hold the steps of a service with more workers than that in a queue, their
episodes waiting on each other's tools. The episodes and their workers are ``services/env/episodes.py``'s.
"""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ParamSpec, TypeVar

import structlog

from meshrl.v1 import common_pb2, env_pb2, env_pb2_grpc
from services.common.cli import CannotStart
from services.common.limits import check_at_most
from services.common.request_text import json_object
from services.env import telemetry
from services.env.config import EnvServiceConfig
from services.env.environment import Message
from services.env.episodes import Episodes, Gateway
from services.common.sandbox import SandboxUnavailable, check_sandbox
from services.env.tools import check_tools, environment_tools
from services.env.worker_sandbox import hosts_user_code

log = structlog.get_logger()
Args = ParamSpec("Args")
Result = TypeVar("Result")


def row_from_json(text: str, limit: int) -> dict:
    """The Reset's row: a JSON object of at most ``limit`` characters (ResourceExhausted past it), nested at most
    MAX_NESTING deep (ValueError otherwise)."""
    check_at_most("row_json characters", len(text), limit, setting="max_message_chars")
    return json_object(text or "{}", "row_json")


def message_to_pb(message: Message) -> env_pb2.ChatMessage:
    return env_pb2.ChatMessage(role=message.role, content=message.content, name=message.name)


def workers_sandboxed(config: EnvServiceConfig, unavailable: str | None) -> bool:
    """Whether this service's workers run sandboxed: where ``sandbox`` is on and the host can give it
    (``unavailable``: why it cannot, or None). ValueError (the service refuses to start) where it is on, the host
    cannot and users' classes would run unsandboxed."""
    if not config.sandbox:
        if hosts_user_code(config):
            log.warning("workers_unsandboxed", reason="sandbox: false", consequence=(
                "users' tools and environments run as this service's user: they can read its files (the cluster "
                "token included), write where it can, open sockets and start processes without bound"))
        return False
    if unavailable is None:
        return True
    if hosts_user_code(config):
        raise ValueError(f"users' tools and environments run in sandboxed workers, which this host cannot give: "
                         f"{unavailable} (sandbox: false runs them unsandboxed, for trusted code only)")
    log.info("workers_unsandboxed", reason=unavailable, hosted="built-in tools only")
    return False


class EnvServicer(env_pb2_grpc.EnvServicer):
    def __init__(self, config: EnvServiceConfig, identity: common_pb2.ServiceIdentity):
        self.tools = {name: environment_tools(environment) for name, environment in config.environments.items()}
        for name, tools in self.tools.items():
            if not config.environments[name].runs_agent:  # an agent's tools are its own: listed, never run here
                check_tools(tools)
        self.config = config
        self.identity = identity
        unavailable = check_sandbox() if config.sandbox else None
        self.episodes = Episodes(config, sandboxed=workers_sandboxed(config, unavailable))
        try:
            self.episodes.check_first_worker()
        except SandboxUnavailable as error:
            self.episodes.close_all()
            raise CannotStart(str(error)) from None
        # a thread for each worker's call and as many again for the calls that wait on a busy episode (a Close
        # while its step runs), besides a few for the quick ones
        self.threads = ThreadPoolExecutor(max_workers=2 * config.workers + 4, thread_name_prefix="episodes")

    async def _in_thread(self, function: Callable[Args, Result], *args: Args.args, **kwargs: Args.kwargs) -> Result:
        return await asyncio.get_running_loop().run_in_executor(self.threads,
                                                                functools.partial(function, *args, **kwargs))

    async def Reset(self, request, context):
        if not request.episode_id:
            raise ValueError("episode_id is empty")
        row = await asyncio.to_thread(row_from_json, request.row_json, self.config.max_message_chars)  # off the loop
        gateway = Gateway(request.gateway_url, request.episode_key, request.model) if request.gateway_url else None
        messages = await self._in_thread(self.episodes.reset, request.episode_id, request.env_name, row,
                                         max_parallel_calls=max(0, request.max_parallel_calls), gateway=gateway)
        telemetry.EPISODES.inc()
        telemetry.OPEN_EPISODES.set(self.episodes.open_count)
        return env_pb2.ResetResponse(messages=[message_to_pb(m) for m in messages],
                                     service_id=self.identity.service_id)

    async def Step(self, request, context):
        content = request.message.content
        check_at_most("message.content characters", len(content), self.config.max_message_chars,
                      setting="max_message_chars")
        message = Message(request.message.role or "assistant", content)
        result = await self._in_thread(self.episodes.step, request.episode_id, message)
        telemetry.count_step(result)
        if "error" in result.info:
            log.warning("step_failed", episode=request.episode_id, error=result.info["error"][:300])
        return env_pb2.StepResponse(messages=[message_to_pb(m) for m in result.messages], reward=result.reward,
                                    done=result.done, info_json=json.dumps(result.info))

    async def Close(self, request, context):
        closed = await self._in_thread(self.episodes.close, request.episode_id)
        telemetry.OPEN_EPISODES.set(self.episodes.open_count)
        return env_pb2.CloseResponse(closed=closed)

    async def Info(self, request, context):
        return env_pb2.EnvInfo(identity=self.identity, open_episodes=self.episodes.open_count,
                               workers=self.config.workers, environments=[
            env_pb2.EnvironmentInfo(
                name=name, source=environment.environment or environment.agent or " ".join(
                    environment.agent_command or []) or "tools", runs_agent=environment.runs_agent,
                tools=[env_pb2.ToolInfo(name=tool.name, schema_json=json.dumps(tool.tool_schema))
                       for tool in self.tools[name]])
            for name, environment in self.config.environments.items()])

    def weight_version(self) -> None:
        return None  # hosts environments; holds no weights

    async def close(self) -> None:
        await asyncio.to_thread(self.episodes.close_all)
        self.threads.shutdown(wait=False, cancel_futures=True)


def attach(server, config: EnvServiceConfig, identity: common_pb2.ServiceIdentity) -> EnvServicer:
    servicer = EnvServicer(config, identity)
    env_pb2_grpc.add_EnvServicer_to_server(servicer, server)
    return servicer
