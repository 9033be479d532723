"""An env worker process: the episode's environment and its tools, answering the service over one socket.

Started by the service (services/env/episodes.py) as ``python -m services.env.worker FD PARENT_PID [sandboxed]``,
inside its own sandbox (services/env/worker_sandbox.py) or, where the operator turned the sandbox off, as a plain
process of the service's user. FD is the worker's end of a socketpair. The service speaks first: the worker's
settings, then one command at a time (pickled: the worker trusts the service). The worker answers in JSON only,
never pickle, so that code in a worker, however hostile, can send the service nothing but data (``decode``):

- ("ready", null) once, when it stands;
- ("calling", tool name) and ("reply", message) as a tool environment's step goes (a call that hangs costs only
  itself);
- ("run_code", {"code", "limits"}) from the built-in code interpreter in a sandboxed worker, which cannot start a
  sandbox of its own: the service runs the code in the code sandbox and sends back ("ran", SandboxResult) or
  ("ran_error", text);
- ("done", value) or ("error", text) to end each command.

An agent environment's worker also sends ("http", request), its agent's call to the run's gateway, and the service
answers ("http_response", response) (services/env/agent_runner.py).

Commands: ("reset", env name, row, max parallel calls, gateway access or None) builds a new environment (its tool
calls per step bounded by the smaller of that, when positive, and the service's; an agent environment's agent
calling with the access's key) and resets it; ("step", message dict) steps it; ("close",) drops it and ends every
process its code started (the worker is the subreaper of its descendants, so a process that detached itself, by a
double fork or a new session, is found too); None (or the service's end closing) ends the worker.

Before any user code runs, the worker bounds itself (``contain``): its private memory (RLIMIT_DATA) and, in a
sandbox, where it runs as a uid of its own, the processes and threads of that uid (RLIMIT_NPROC); no core files.
Unsandboxed, it also leads a process group of its own (the service kills the group when it replaces the worker),
and the cluster's credentials were left out of its environment when it was started.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

import structlog

from services.common.lifetime import adopt_orphans, die_with_parent, end_descendants, reap_children
from services.env.agent_runner import AgentEpisode, Relay
from services.env.config import EnvironmentConfig, EnvServiceConfig
from services.env.environment import (Environment, Message, StepResult, ToolEnvironment, ToolLimits, as_messages,
                                      as_step_result)
from services.common.sandbox import SandboxLimits, SandboxResult, run_in_sandbox
from services.env.tools import CodeRunner, load_class

MAX_ANSWER_BYTES = 64 << 20
"""Largest message the service reads from a worker; a larger one counts as the worker failing."""
HELPER_PROCESSES = 2
"""Processes of a sandboxed worker's uid, inside its sandbox, besides those its code starts: the sandbox's pid 1
(bwrap's) and the worker."""


def build(name: str, environment: EnvironmentConfig, limits: ToolLimits, *, report, run: CodeRunner,
          access: dict | None, relay: Relay) -> Environment:
    """The environment ``name`` of an episode, in a worker (``access``: an agent environment's gateway key and
    model; ``relay``: how its agent's calls reach the gateway)."""
    if environment.runs_agent:
        if not access:
            raise ValueError(f"environment {name} runs an agent: its Reset must give the run's gateway")
        return AgentEpisode(environment, access, relay)
    if environment.environment is not None:
        return load_class(environment.environment, f"environment {name}")(**environment.options)
    return ToolEnvironment(environment.tools, limits, report, code_runner=run)


def contain(config: EnvServiceConfig, sandboxed: bool) -> None:
    """Bound this worker before user code runs (see the module's docstring). In a sandbox the worker is no
    longer root, so its code cannot raise the limits again."""
    memory = config.worker_memory_mb
    if memory is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (memory << 20, memory << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if sandboxed:
        processes = config.worker_processes + HELPER_PROCESSES
        resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


def encode(kind: str, value: Any) -> bytes:
    """A worker's message to the service, as JSON (a Message as its fields, a StepResult as a dict)."""
    if isinstance(value, Message):
        value = value._asdict()
    elif isinstance(value, StepResult):
        value = {**dataclasses.asdict(value), "messages": [m._asdict() for m in value.messages]}
    elif isinstance(value, list):
        value = [m._asdict() if isinstance(m, Message) else m for m in value]
    return json.dumps([kind, value]).encode()


def decode(data: bytes, command: str) -> tuple[str, Any]:
    """A worker's message, checked and rebuilt as ``encode`` wrote it for an answer to ``command``; ValueError
    (the worker is treated as failed) for anything else."""
    kind, value = json.loads(data)
    if kind in ("ready", "calling", "error"):
        return kind, None if kind == "ready" else str(value)[:2000]
    if kind == "reply":
        [message] = as_messages([value])
        return kind, message
    if kind == "run_code":
        if not isinstance(value, dict) or not isinstance(value.get("code"), str):
            raise ValueError("a run_code message needs code")
        return kind, (value["code"], SandboxLimits(**value.get("limits", {})))
    if kind == "http":
        return kind, http_request(value)
    if kind == "done":
        return kind, (as_messages(value) if command == "reset" else as_step_result(value) if command == "step"
                      else None)
    raise ValueError(f"a worker sent {str(kind)[:50]!r}")


def http_request(value: Any) -> dict:
    """An agent's call as the worker sent it, checked: method, path (from its root), headers and body strings."""
    if not isinstance(value, dict) or value.get("method") not in ("GET", "POST") \
            or not isinstance(value.get("path"), str) or not value["path"].startswith("/") \
            or not isinstance(value.get("body"), str) or not isinstance(value.get("headers"), dict) \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in value["headers"].items()):
        raise ValueError("an http message needs a method (GET or POST), a path from /, headers and a body")
    return value


def code_runner(connection: Connection, sandboxed: bool) -> CodeRunner:
    """How the code interpreter runs code here: in a sandboxed worker, by asking the service (which runs it in the
    code sandbox); unsandboxed, in the code sandbox itself."""
    if not sandboxed:
        return run_in_sandbox

    def ask_service(code: str, limits: SandboxLimits) -> SandboxResult:
        connection.send_bytes(encode("run_code", {"code": code, "limits": dataclasses.asdict(limits)}))
        kind, value = connection.recv()
        if kind != "ran":
            raise RuntimeError(value)
        return value

    return ask_service


def http_relay(connection: Connection) -> Relay:
    """How an agent's call reaches the gateway: sent to the service, which sends it on and answers."""

    def ask_service(request: dict) -> dict:
        connection.send_bytes(encode("http", request))
        kind, value = connection.recv()
        if kind != "http_response":
            raise RuntimeError(f"the service answered an agent's call with {kind!r}")
        return value

    return ask_service


def serve(connection: Connection, sandboxed: bool) -> None:
    """Answer the service's commands until None or its end closes (see the module's docstring)."""
    config: EnvServiceConfig = connection.recv()
    contain(config, sandboxed)
    limits = ToolLimits(config.max_parallel_calls, config.max_call_bytes, config.max_reply_chars)
    report: Callable[[str, Any], None] = lambda kind, value: connection.send_bytes(encode(kind, value))  # noqa: E731
    run = code_runner(connection, sandboxed)
    relay = http_relay(connection)
    environment: Any = None
    connection.send_bytes(encode("ready", None))
    while (command := connection.recv()) is not None:
        try:
            if command[0] == "reset":
                bound = min(limits.max_parallel_calls, command[3]) if command[3] > 0 else limits.max_parallel_calls
                environment = build(command[1], config.environments[command[1]],
                                    limits._replace(max_parallel_calls=bound), report=report, run=run,
                                    access=command[4], relay=relay)
                answer: Any = as_messages(environment.reset(command[2]))
            elif command[0] == "step":
                answer = as_step_result(environment.step(command[1]))
            else:
                environment = answer = None
                end_episode_processes()
            connection.send_bytes(encode("done", answer))
        except Exception as error:  # noqa: BLE001 - the service turns it into an error reply
            connection.send_bytes(encode("error", f"{type(error).__name__}: {str(error)[:2000]}"))


def end_episode_processes() -> None:
    """End every process the episode's code started (this worker adopts them all: ``main``), however it detached
    them, and reap them; log what would not end."""
    left = end_descendants(os.getpid())
    reap_children()
    if left:
        structlog.get_logger().warning("episode_processes_left", pids=left)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.env.worker",
                                     description="An env worker; the env service starts it, not a person.")
    parser.add_argument("fd", type=int, help="the worker's end of a socketpair")
    parser.add_argument("parent_pid", type=int, help="the env service's process id")
    parser.add_argument("sandboxed", nargs="?", choices=["sandboxed"], help="the worker runs in a sandbox")
    args = parser.parse_args(argv)
    fd, parent_pid, sandboxed = args.fd, args.parent_pid, args.sandboxed is not None
    if not sandboxed:  # a sandbox's bwrap kills it with the service (--die-with-parent)
        die_with_parent(parent_pid, signal.SIGKILL)
    adopt_orphans()  # what the episode's code starts stays this worker's to end, daemons and new sessions included
    try:
        serve(Connection(fd), sandboxed)
    except (EOFError, ConnectionError):
        return


if __name__ == "__main__":
    main(sys.argv[1:])
