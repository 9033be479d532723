"""Episodes, each in a worker process of its own, every call under a timeout.

The service keeps ``workers`` processes; an open episode holds one (Reset takes an idle one, Close gives it
back), so the environment's code and its tools' code never run in the service's process. Each call (a reset, a
tool call, a user environment's step) must answer within ``call_timeout_s``: a tool environment's worker says
when each tool call starts and what it replied, so a tool that hangs costs only its own call. Past the timeout,
or when the worker dies, the worker is killed and replaced, and

- in a tool environment the model gets the replies of the calls before it (their rewards are lost with the
  worker) and an error reply for the call that hung, and the episode goes on in the new worker from a fresh
  reset of its row (the tools are built again);
- a user environment's episode, whose state is lost, is done, its error in ``info``.

Workers end with the service, however it ends (``die_with_parent``).

Before any user code runs, a worker is contained as far as a process of the service's own user can be
(``contain``): it leads a process group of its own, so that replacing it (a timeout, the service's stop) kills
every process its code started; the cluster's credentials (``MESHRL_TOKEN``, ``MESHRL_TOKEN_FILE``,
``MESHRL_TLS_*``) are not in its environment; its private memory and that of each process it starts is bounded
(``worker_memory_mb``: past it an allocation fails, a MemoryError in Python, and the call gets an error reply).
What it is not: a sandbox. A user's tool or environment runs as the service's user, so it can read the files
that user can (the token file at a path it knows or guesses, included), write where that user can, open sockets,
and start processes without a count limit; only the built-in code interpreter runs sandboxed
(services/common/sandbox.py).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import queue
import resource
import signal
import threading
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any

from services.common.auth import TLS_VARIABLES
from services.common.errors import FailedPrecondition, NotFound, ResourceExhausted
from services.common.lifetime import die_with_parent
from services.env.config import EnvironmentConfig, EnvServiceConfig
from services.env.environment import (Environment, Message, StepResult, ToolEnvironment, ToolLimits, as_messages,
                                      as_step_result)
from services.env.tools import environment_tools, load_class

WORKER_START_TIMEOUT_S = 60.0
"""Longest a new worker may take to start (import this package) before its first call."""


class CallFailed(Exception):
    """A call the worker could not answer: it timed out, or the worker died or reported an error."""

    def __init__(self, message: str, replies: list[Message], tool: str, timed_out: bool):
        super().__init__(message)
        self.replies, self.tool, self.timed_out = replies, tool, timed_out


def build(name: str, environment: EnvironmentConfig, limits: ToolLimits, report) -> Environment:
    """The environment ``name`` of an episode, in a worker."""
    if environment.environment is not None:
        return load_class(environment.environment, f"environment {name}")(**environment.options)
    return ToolEnvironment(environment_tools(environment), limits, report)


CREDENTIAL_VARIABLES = ("MESHRL_TOKEN", "MESHRL_TOKEN_FILE", *TLS_VARIABLES)
"""Environment variables that name the cluster's credentials: a worker drops them before running user code."""


def contain(memory_mb: int | None) -> None:
    """In a new worker, before user code: its own process group (the service kills the group when it replaces
    the worker), no credentials in its environment, its private memory bounded (RLIMIT_DATA, inherited by the
    processes it starts; None: unbounded)."""
    os.setsid()
    for name in CREDENTIAL_VARIABLES:
        os.environ.pop(name, None)
    if memory_mb is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_mb << 20, memory_mb << 20))


def kill_group(process: multiprocessing.process.BaseProcess) -> None:
    """SIGKILL a worker and every process in its group (those its code started and left running), then reap it.
    Safe after the worker was reaped: Linux reuses no pid while a process group of that id has members."""
    if process.pid is None:  # never started
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)  # its pid is its group's id (contain)
    except ProcessLookupError:  # no such group: the worker is not contained yet (or gone); it alone
        process.kill()
    process.join(5)


def _serve(config: EnvServiceConfig, connection: Connection, parent_pid: int) -> None:
    """A worker: die with the service; answer each command until None or the service's end of the pipe closes.

    ("reset", env name, row, max parallel calls) builds a new environment (its tool calls per step bounded by the
    smaller of that, when positive, and the service's) and resets it; ("step", message dict) steps it; ("close",)
    drops it. Each answer is ("done", value) or ("error", text), after any ("calling", tool) and ("reply",
    Message) that a tool environment's step reports."""
    die_with_parent(parent_pid, signal.SIGKILL)
    contain(config.worker_memory_mb)
    limits = ToolLimits(config.max_parallel_calls, config.max_call_bytes, config.max_reply_chars)
    environment: Any = None
    try:
        connection.send(("ready", None))
        while (command := connection.recv()) is not None:
            try:
                if command[0] == "reset":
                    bound = min(limits.max_parallel_calls, command[3]) if command[3] > 0 else limits.max_parallel_calls
                    environment = build(command[1], config.environments[command[1]],
                                        limits._replace(max_parallel_calls=bound),
                                        lambda kind, value: connection.send((kind, value)))
                    answer: Any = as_messages(environment.reset(command[2]))
                elif command[0] == "step":
                    answer = as_step_result(environment.step(command[1]))
                else:
                    environment = answer = None
                connection.send(("done", answer))
            except Exception as error:  # noqa: BLE001 - the service turns it into an error reply
                connection.send(("error", f"{type(error).__name__}: {str(error)[:2000]}"))
    except (EOFError, ConnectionError):
        return


@dataclass
class Worker:
    process: multiprocessing.process.BaseProcess
    connection: Connection  # the service's end of the pipe
    started: bool = False  # its "ready" has been read


@dataclass
class Episode:
    env_name: str
    row: dict
    worker: Worker
    max_parallel_calls: int  # the caller's bound on tool calls per step (0: the service's)
    steps: int = 0
    closed: bool = False  # its worker went back (a call that waited for the lock meanwhile must not use it)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time on its worker


class Episodes:
    """The open episodes and the worker processes that hold them. Its methods block (call them from threads)."""

    def __init__(self, config: EnvServiceConfig):
        self.config = config
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._open: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._workers: list[Worker] = []
        for _ in range(config.workers):
            self._idle.put(self._start())

    def _start(self) -> Worker:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(self.config, theirs, os.getpid()), daemon=True)
        process.start()
        theirs.close()
        worker = Worker(process, ours)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _replace(self, worker: Worker) -> Worker:
        kill_group(worker.process)
        worker.connection.close()
        with self._lock:
            self._workers.remove(worker)
        return self._start()

    @property
    def open_count(self) -> int:
        return len(self._open)

    def reset(self, episode_id: str, env_name: str, row: dict, max_parallel_calls: int = 0) -> list[Message]:
        """Open the episode on an idle worker: the environment's first messages; ``max_parallel_calls`` (> 0)
        lowers the service's bound on the tool calls run per step for this episode. ValueError for an unknown
        environment or an environment that fails to reset; FailedPrecondition for an id already open;
        ResourceExhausted when every worker holds an episode."""
        if env_name not in self.config.environments:
            raise ValueError(f"env_name {env_name!r} is not hosted here; hosted: {sorted(self.config.environments)}")
        try:
            worker = self._idle.get_nowait()
        except queue.Empty:
            raise ResourceExhausted(f"all {self.config.workers} workers hold open episodes (the setting "
                                    f"workers); close one first") from None
        with self._lock:
            if episode_id in self._open:
                self._idle.put(worker)
                raise FailedPrecondition(f"episode {episode_id!r} is open already")
            episode = self._open[episode_id] = Episode(env_name, row, worker, max_parallel_calls)
        with episode.lock:
            try:
                return self._call(episode, ("reset", env_name, row, max_parallel_calls))
            except CallFailed as failed:
                self._forget(episode_id, episode, replace=True)
                raise ValueError(f"environment {env_name} could not reset: {failed}") from None

    def step(self, episode_id: str, message: Message) -> StepResult:
        """The episode's reply to ``message``; NotFound for an episode not open, FailedPrecondition past max_steps."""
        episode = self._episode(episode_id)
        with episode.lock:
            if episode.closed:
                raise NotFound(f"episode {episode_id!r} was closed")
            if episode.steps >= self.config.max_steps:
                raise FailedPrecondition(f"episode {episode_id!r} took its {self.config.max_steps} steps (max_steps)")
            episode.steps += 1
            try:
                result = self._call(episode, ("step", message._asdict()))
            except CallFailed as failed:
                result = self._recover(episode, failed)
            if episode.steps >= self.config.max_steps:
                result = replace(result, done=True, info={**result.info, "max_steps": True})
            return result

    def _recover(self, episode: Episode, failed: CallFailed) -> StepResult:
        """The step's result after its call failed: see the module's docstring."""
        info = {"error": str(failed), "timed_out": failed.timed_out, "tool": failed.tool}
        if self.config.environments[episode.env_name].environment is not None:
            return StepResult(messages=[], done=True, info=info)
        reply = Message("tool", f"error: {failed}", failed.tool)
        try:
            self._call(episode, ("reset", episode.env_name, episode.row, episode.max_parallel_calls))
        except CallFailed as again:
            return StepResult(messages=[*failed.replies, reply], done=True, info={**info, "reset_error": str(again)})
        return StepResult(messages=[*failed.replies, reply], info={**info, "restarted": True})

    def close(self, episode_id: str) -> bool:
        """End the episode, its worker back to the idle ones; False if it was not open."""
        with self._lock:
            episode = self._open.get(episode_id)
        if episode is None:
            return False
        with episode.lock:
            if episode.closed:
                return False
            try:
                self._call(episode, ("close",))
                self._forget(episode_id, episode, replace=False)
            except CallFailed:
                self._forget(episode_id, episode, replace=True)
        return True

    def _episode(self, episode_id: str) -> Episode:
        with self._lock:
            episode = self._open.get(episode_id)
        if episode is None:
            raise NotFound(f"episode {episode_id!r} is not open here (Reset opens one)")
        return episode

    def _forget(self, episode_id: str, episode: Episode, *, replace: bool) -> None:
        """Close the episode (its lock held) and give its worker back, or a fresh one in its place."""
        episode.closed = True
        with self._lock:
            self._open.pop(episode_id, None)
        self._idle.put(self._replace(episode.worker) if replace else episode.worker)

    def _call(self, episode: Episode, command: tuple) -> Any:
        """Send ``command`` to the episode's worker and wait for its answer, each message within call_timeout_s;
        CallFailed (the worker replaced in the episode) when one does not come, the worker dies or it reports an
        error."""
        worker, replies, tool = episode.worker, [], ""
        try:
            if not worker.started:
                if not worker.connection.poll(WORKER_START_TIMEOUT_S):
                    raise TimeoutError(f"a worker did not start within {WORKER_START_TIMEOUT_S} s")
                worker.connection.recv()
                worker.started = True
            worker.connection.send(command)
            while True:
                if not worker.connection.poll(self.config.call_timeout_s):
                    what = f"tool {tool}" if tool else f"the environment's {command[0]}"
                    raise TimeoutError(f"{what} did not return within {self.config.call_timeout_s} s (its worker "
                                       f"was replaced)")
                kind, value = worker.connection.recv()
                if kind == "calling":
                    tool = value
                elif kind == "reply":
                    replies.append(value)
                    tool = ""
                elif kind == "done":
                    return value
                else:
                    raise CallFailed(value, replies, tool, timed_out=False)
        except TimeoutError as error:
            episode.worker = self._replace(worker)
            raise CallFailed(str(error), replies, tool, timed_out=True) from None
        except (EOFError, ConnectionError):
            episode.worker = self._replace(worker)
            raise CallFailed(f"its worker died (exit code {worker.process.exitcode}; it was replaced)", replies, tool,
                             timed_out=False) from None

    def close_all(self) -> None:
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            kill_group(worker.process)
            worker.connection.close()
