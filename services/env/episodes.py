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

A worker that died while idle is replaced before a Reset uses it, and a reset whose worker dies is tried once more
on the worker that replaced it. Closing an episode ends every process its code started (services/env/worker.py).
Workers end with the service, however it ends.

Each worker runs in a sandbox of its own (services/env/worker_sandbox.py: its own namespaces, no network, a
read-only view of only what it needs, a private /tmp, a uid of its own bounded in processes, memory bounded), so a
user's tool or environment cannot read the cluster's token, write outside its /tmp, open sockets or outgrow its
quotas, and replacing the worker ends every process its code started. With ``sandbox: false`` (or where the host
cannot give the sandbox and only built-in tools are hosted) workers run as the service's user, contained in memory
and credentials only. The worker's side of the socket, and the JSON it
answers in, are services/env/worker.py's.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

from services.common.errors import Busy, FailedPrecondition, NotFound
from services.env.config import EnvServiceConfig
from services.env.environment import Message, StepResult
from services.common.sandbox import SandboxLimits, SandboxUnavailable, run_in_sandbox
from services.env.worker import MAX_ANSWER_BYTES, decode
from services.env.worker_sandbox import WorkerProcess, readable_paths, start_worker, worker_config

WORKER_START_TIMEOUT_S = 60.0
"""Longest a new worker may take to start (import this package) before its first call."""
AGENT_GRACE_S = 5.0
"""How long past its agent_timeout_s an agent's step may take before its worker is replaced (the worker stops
the agent itself at agent_timeout_s and answers; this bounds one that does not)."""
BUSY_RETRY_AFTER_S = 0.5
"""When a Reset refused because every worker holds an episode may be sent again (the refusal's hint; its caller
backs off from it): episodes hold their workers for whole trajectories, so one is seldom free sooner."""


class CallFailed(Exception):
    """A call the worker could not answer: it timed out, or the worker died or reported an error."""

    def __init__(self, message: str, replies: list[Message], tool: str, *, timed_out: bool, worker_died: bool = False):
        super().__init__(message)
        self.replies, self.tool, self.timed_out, self.worker_died = replies, tool, timed_out, worker_died


@dataclass
class Worker:
    process: WorkerProcess
    connection: Connection  # the service's end of its socket
    started: bool = False  # its "ready" has been read


class Gateway(NamedTuple):
    """The run's gateway, as an agent environment's Reset gives it."""

    url: str  # http://host:port/v1
    key: str
    model: str

    def access(self) -> dict:
        """What the worker's agent is given (the URL stays with the service, which relays its calls)."""
        return {"key": self.key, "model": self.model}


@dataclass(kw_only=True)
class Episode:
    env_name: str
    row: dict
    worker: Worker
    max_parallel_calls: int  # the caller's bound on tool calls per step (0: the service's)
    gateway: Gateway | None = None  # an agent environment's: where its agent's calls go
    steps: int = 0
    closed: bool = False  # its worker went back (a call that waited for the lock meanwhile must not use it)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time on its worker


class Episodes:
    """The open episodes and the worker processes that hold them. Its methods block (call them from threads)."""

    def __init__(self, config: EnvServiceConfig, sandboxed: bool):
        """``sandboxed``: each worker in a sandbox of its own (the caller has checked that the host can give it)."""
        self.config = config
        self._worker_config = worker_config(config)
        self._readable = readable_paths(config) if sandboxed else None
        self._idle: queue.Queue[Worker] = queue.Queue()
        self._open: dict[str, Episode] = {}
        self._lock = threading.Lock()
        self._workers: list[Worker] = []
        for _ in range(config.workers):
            self._idle.put(self._start())

    def _start(self) -> Worker:
        ours, theirs = socket.socketpair()
        try:
            process = start_worker(self.config, theirs.fileno(), self._readable)
        finally:
            theirs.close()
        connection = Connection(ours.detach())
        connection.send(self._worker_config)
        worker = Worker(process, connection)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _replace(self, worker: Worker) -> Worker:
        worker.process.kill()
        worker.connection.close()
        with self._lock:
            self._workers.remove(worker)
        return self._start()

    @property
    def open_count(self) -> int:
        return len(self._open)

    def reset(self, episode_id: str, env_name: str, row: dict, *, max_parallel_calls: int = 0,
              gateway: Gateway | None = None) -> list[Message]:
        """Open the episode on an idle worker: the environment's first messages; ``max_parallel_calls`` (> 0)
        lowers the service's bound on the tool calls run per step for this episode; ``gateway``: where an agent
        environment's agent calls. An idle worker that has died is replaced first, and a worker that dies during
        the reset is replaced and the reset tried once more on the new one: a worker's death costs no episode.
        ValueError for an unknown environment, an agent environment without a gateway or an environment that fails
        to reset (its worker dying twice included); FailedPrecondition for an id already open; Busy (to be sent
        again later) when every worker holds an episode."""
        if env_name not in self.config.environments:
            raise ValueError(f"env_name {env_name!r} is not hosted here; hosted: {sorted(self.config.environments)}")
        if self.config.environments[env_name].runs_agent and gateway is None:
            raise ValueError(f"environment {env_name} runs a user's agent: its Reset must give gateway_url, "
                             f"episode_key and model (a run serves them with multi_turn)")
        try:
            worker = self._idle.get_nowait()
        except queue.Empty:
            raise Busy(f"all {self.config.workers} workers hold open episodes (the setting workers); ask again "
                       f"once one is closed", retry_after_s=BUSY_RETRY_AFTER_S) from None
        with self._lock:
            if episode_id in self._open:
                self._idle.put(worker)
                raise FailedPrecondition(f"episode {episode_id!r} is open already")
            episode = self._open[episode_id] = Episode(env_name=env_name, row=row, worker=worker,
                                                       max_parallel_calls=max_parallel_calls, gateway=gateway)
        with episode.lock:
            if worker.process.exit_code is not None:  # it died while idle
                episode.worker = self._replace(worker)
            command = self._reset_command(episode)
            try:
                try:
                    return self._call(episode, command)
                except CallFailed as failed:
                    if not failed.worker_died:
                        raise
                    return self._call(episode, command)  # on the worker that replaced it
            except CallFailed as failed:  # a worker that timed out or died has been replaced by a fresh one already
                self._forget(episode_id, episode, replace=not (failed.timed_out or failed.worker_died))
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
            environment = self.config.environments[episode.env_name]
            deadline = time.monotonic() + environment.agent_timeout_s + AGENT_GRACE_S if environment.runs_agent \
                else None
            try:
                result = self._call(episode, ("step", message._asdict()), deadline)
            except CallFailed as failed:
                result = self._recover(episode, failed)
            if episode.steps >= self.config.max_steps:
                result = replace(result, done=True, info={**result.info, "max_steps": True})
            return result

    def _recover(self, episode: Episode, failed: CallFailed) -> StepResult:
        """The step's result after its call failed: see the module's docstring."""
        info = {"error": str(failed), "timed_out": failed.timed_out, "tool": failed.tool}
        environment = self.config.environments[episode.env_name]
        if environment.environment is not None or environment.runs_agent:
            return StepResult(messages=[], done=True, info=info)
        reply = Message("tool", f"error: {failed}", failed.tool)
        try:
            self._call(episode, self._reset_command(episode))
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

    @staticmethod
    def _reset_command(episode: Episode) -> tuple:
        access = episode.gateway.access() if episode.gateway is not None else None
        return "reset", episode.env_name, episode.row, episode.max_parallel_calls, access

    def _call(self, episode: Episode, command: tuple, deadline: float | None = None) -> Any:
        """Send ``command`` to the episode's worker and wait for its answer, each message within call_timeout_s
        (an agent's step: all of it by ``deadline``, on the monotonic clock, its calls relayed to the gateway);
        CallFailed (the worker replaced in the episode) when one does not come, the worker dies or it reports an
        error."""
        worker, tool = episode.worker, ""
        replies: list[Message] = []
        calls = code_runs = 0
        try:
            if not worker.started:
                wait_ready(worker)
            worker.connection.send(command)
            while True:
                wait_s = self.config.call_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
                if not worker.connection.poll(wait_s):
                    what = f"tool {tool}" if tool else f"the environment's {command[0]}"
                    raise TimeoutError(f"{what} did not return within {wait_s:.1f} s (its worker was replaced)")
                kind, value = decode(worker.connection.recv_bytes(MAX_ANSWER_BYTES), command[0])
                calls, code_runs = calls + (kind == "calling"), code_runs + (kind == "run_code")
                check_reports(calls, len(replies) + (kind == "reply"), code_runs,
                              max_parallel_calls=self.config.max_parallel_calls)
                if kind == "calling":
                    tool = value
                elif kind == "reply":
                    replies.append(value)
                    tool = ""
                elif kind == "run_code":
                    worker.connection.send(self._run_code(*value))
                elif kind == "http" and episode.gateway is not None and deadline is not None:
                    worker.connection.send(("http_response", relay(episode.gateway, value, deadline)))
                elif kind == "done":
                    return value
                else:
                    raise CallFailed(value, replies, tool, timed_out=False)
        except TimeoutError as error:
            episode.worker = self._replace(worker)
            raise CallFailed(str(error), replies, tool, timed_out=True) from None
        except (EOFError, OSError, ValueError, TypeError) as error:  # it died, or sent what no worker sends
            episode.worker = self._replace(worker)
            died = isinstance(error, (EOFError, OSError))
            why = (f"its worker died (exit code {worker.process.exit_code})" if died
                   else f"its worker sent a malformed answer ({type(error).__name__})")
            raise CallFailed(f"{why}; it was replaced", replies, tool, timed_out=False, worker_died=died) from None

    def _run_code(self, code: str, limits: SandboxLimits) -> tuple[str, Any]:
        """A sandboxed worker's code-interpreter call, run in the code sandbox within call_timeout_s: ("ran",
        result) or ("ran_error", why)."""
        try:
            return "ran", run_in_sandbox(code, replace(limits, wall_s=min(limits.wall_s, self.config.call_timeout_s)))
        except (SandboxUnavailable, ValueError) as error:
            return "ran_error", f"{type(error).__name__}: {error}"

    def close_all(self) -> None:
        with self._lock:
            workers = list(self._workers)
        for worker in workers:
            worker.process.kill()
            worker.connection.close()

    def check_first_worker(self) -> None:
        """Wait for a worker to stand (at the service's start); SandboxUnavailable, with why, if it does not."""
        worker = self._idle.get()
        try:
            wait_ready(worker)
        except (TimeoutError, EOFError, OSError, ValueError) as error:
            raise SandboxUnavailable(f"an env worker did not start ({type(error).__name__}: {error}; exit code "
                                     f"{worker.process.exit_code}; its error is in this service's log)") from None
        finally:
            self._idle.put(worker)


def relay(gateway: Gateway, request: dict, deadline: float) -> dict:
    """An agent's call sent on to the gateway (its origin, the call's path: nowhere else), by ``deadline``: the
    gateway's answer, or a 502 with OpenAI's error object where it could not be reached."""
    origin = urllib.parse.urlsplit(gateway.url)
    http = urllib.request.Request(f"{origin.scheme}://{origin.netloc}{request['path']}", method=request["method"],
                                  data=request["body"].encode() if request["method"] == "POST" else None,
                                  headers=request["headers"])
    try:
        with urllib.request.urlopen(http, timeout=max(0.1, deadline - time.monotonic())) as answer:
            return {"status": answer.status, "content_type": answer.headers.get("Content-Type", "application/json"),
                    "body": answer.read(MAX_ANSWER_BYTES).decode(errors="replace")}
    except urllib.error.HTTPError as refused:
        return {"status": refused.code, "content_type": refused.headers.get("Content-Type", "application/json"),
                "body": refused.read(MAX_ANSWER_BYTES).decode(errors="replace")}
    except (urllib.error.URLError, OSError) as error:
        return {"status": 502, "content_type": "application/json", "body": json.dumps({"error": {
            "message": f"the env service could not reach the run's gateway: {error}", "type": "server_error",
            "param": None, "code": "gateway_unreachable"}})}


def check_reports(calls: int, replies: int, code_runs: int, *, max_parallel_calls: int) -> None:
    """ValueError (the worker is replaced) where a worker has reported more than one step can make: at most
    max_parallel_calls tool calls, a reply for each and one for the calls past them, a code run for each call.
    Without it, code in a worker could hold its service's thread for good, reporting calls that never end."""
    if calls > max_parallel_calls or replies > max_parallel_calls + 1 or code_runs > calls:
        raise ValueError(f"a worker reported {calls} calls, {replies} replies and {code_runs} code runs in one step")


def wait_ready(worker: Worker) -> None:
    """Read a new worker's "ready"; TimeoutError past WORKER_START_TIMEOUT_S, EOFError if it died first."""
    if not worker.connection.poll(WORKER_START_TIMEOUT_S):
        raise TimeoutError(f"a worker did not start within {WORKER_START_TIMEOUT_S} s")
    decode(worker.connection.recv_bytes(MAX_ANSWER_BYTES), "")
    worker.started = True
