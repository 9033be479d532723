"""Users' reward functions: named ``path/to/file.py:function`` or ``module:function``, with verl's signature
``fn(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, "acc": bool, "pred": ...}``
(``acc`` and ``pred`` are optional: whether the answer is right, and the answer read, for validation metrics).

They run in worker processes, never in the service itself: a function that
raises costs its sample, a function that hangs past the per-sample timeout
costs its sample and its worker (killed and replaced), and nothing it does
can take the service down. A function that fails to import is refused when
the service starts, naming the file and the error. The built-in rules run in
such workers too (``services/reward/scoring.py``). Workers end with the
service, however it ends.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.process
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any, Callable

from services.common.lifetime import die_with_parent
from services.common.plugins import load_named


def load_function(ref: str) -> Callable:
    """The function named by ``path/to/file.py:name`` or ``package.module:name``; ValueError if it cannot be had."""
    return load_named(ref, "reward function", "function", accept=callable)


@dataclass(frozen=True, kw_only=True)
class FunctionScore:
    """What a user's function (or a rule) said of one sample."""

    score: float
    acc: bool | None  # its "acc", when it returned a dict with one
    pred: str  # its "pred" as text, "" when it gave none
    seconds: float = 0.0  # how long its worker took


def as_score(value: Any) -> FunctionScore:
    """A user function's result: a number, or a dict with a numeric ``score`` and optionally ``acc`` and ``pred``
    (verl's reward_extra_info); ValueError otherwise."""
    acc, pred = None, ""
    if isinstance(value, dict):
        acc, given = value.get("acc"), value.get("pred")
        pred = "" if given is None else str(given)
        value = value.get("score")
        if acc is not None:
            if isinstance(acc, (int, float)) and not isinstance(acc, bool) and acc in (0, 1):
                acc = bool(acc)
            if not isinstance(acc, bool):
                raise ValueError(f"returned acc {acc!r}, not a bool")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {value!r}, not a finite number or a dict with a numeric 'score'")
    return FunctionScore(score=float(value), acc=acc, pred=pred)


WORKER_START_TIMEOUT_S = 120.0
"""Longest a new worker may take to load its function and warm up, before it takes its first sample."""


def _serve(ref: str, connection, parent_pid: int) -> None:
    """A worker process: die with the service (kill -9 included), load the function once, say it is ready, then
    answer each task of each list that arrives on ``connection``, one by one, until None or the service's end of
    the pipe closes."""
    die_with_parent(parent_pid, signal.SIGKILL)
    function = load_function(ref)
    try:
        connection.send(("ready", None))
        while (tasks := connection.recv()) is not None:
            for task in tasks:
                started = time.perf_counter()
                answer: tuple[str, FunctionScore | str]
                try:
                    answer = ("ok", replace(as_score(function(*task)), seconds=time.perf_counter() - started))
                except Exception as error:  # noqa: BLE001 - reported per task
                    answer = ("error", f"{type(error).__name__}: {error}")
                connection.send(answer)
    except (EOFError, ConnectionError):
        return


@dataclass(kw_only=True)
class ScorerProcess:
    """One process running the users' scoring functions, and the service's pipe to it."""

    process: multiprocessing.process.BaseProcess
    connection: Connection  # the service's end of the pipe to the process: a task out, its answer back
    owed: int = 1  # answers it owes that are no task's: its "ready", then the warm-up call's
    warm: bool = False  # it has been sent the warm-up call


class FunctionWorkers:
    """A pool of worker processes running one function (a user's, or the built-in rules'), each call with a
    timeout.

    A worker gets SIGKILL when the thread that started it ends (see services/common/lifetime.py): the service
    itself, or the scoring thread that replaced a worker, which lives as long as the service. When every worker is
    gone, the multiprocessing resource tracker that starting them began sees its pipe close, and ends too."""

    def __init__(self, ref: str, workers: int, timeout_s: float):
        load_function(ref)  # refuse at start, with the file and the error
        self.ref, self.timeout_s = ref, timeout_s
        self._warm_up: tuple | None = None  # once a call asks for one: a replacement makes it as soon as it starts
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.LifoQueue[ScorerProcess] = queue.LifoQueue()  # the last back is warm; a new one may be
        # starting
        self._all: list[ScorerProcess] = []
        self._lock = threading.Lock()
        for _ in range(workers):
            self._idle.put(self._start())

    def _start(self) -> ScorerProcess:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_serve, args=(self.ref, theirs, os.getpid()), daemon=True)
        process.start()
        theirs.close()
        worker = ScorerProcess(process=process, connection=ours)
        if self._warm_up is not None:
            self._send_warm_up(worker)
        with self._lock:
            self._all.append(worker)
        return worker

    def _send_warm_up(self, worker: ScorerProcess) -> None:
        worker.connection.send([self._warm_up])
        worker.owed += 1
        worker.warm = True

    def _replace(self, worker: ScorerProcess) -> None:
        """Kill ``worker`` and put a fresh one in its place."""
        worker.process.kill()
        worker.process.join(5)
        worker.connection.close()
        with self._lock:
            self._all.remove(worker)
        self._idle.put(self._start())

    def score_all(self, tasks: list[tuple], warm_up: tuple | None = None) -> list[FunctionScore | Exception]:
        """Blocking: for each task (the function's arguments), its result or its error: ValueError (it raised,
        returned garbage, or its worker died) or TimeoutError (it took longer than the timeout). The tasks go to
        a worker together and each answer comes back as it is done; after a task that times out or kills its
        worker, the rest go on in another.

        ``warm_up``: arguments of a call that a worker which has not made it yet makes first (one that has the
        function import or build what it needs on first use; the same on every call), so that no task's timeout
        pays for it. Workers started later make it as soon as they start."""
        if warm_up is not None:
            self._warm_up = warm_up
        results: list[FunctionScore | Exception] = []
        while len(results) < len(tasks):
            results += self._run(self._idle.get(), tasks[len(results):], warm_up is not None)
        return results

    def _run(self, worker: ScorerProcess, tasks: list[tuple], warm: bool) -> list[FunctionScore | Exception]:
        """The tasks' results in order, up to and including the first that times out or loses the worker (which
        is then replaced); the worker goes back to the idle ones if it is still good."""
        results: list[FunctionScore | Exception] = []
        try:
            if not self._prepare(worker, warm):
                self._replace(worker)
                return [ValueError(f"{self.ref}: a worker did not start within {WORKER_START_TIMEOUT_S} s (it was "
                                   f"replaced)")]
            worker.connection.send(tasks)
            for _ in tasks:
                if not worker.connection.poll(self.timeout_s):
                    self._replace(worker)
                    return [*results, TimeoutError(f"{self.ref} did not return within {self.timeout_s} s (its "
                                                   f"worker was replaced)")]
                status, value = worker.connection.recv()
                results.append(value if status == "ok" else ValueError(f"{self.ref} {value}"))
        except (EOFError, ConnectionError):
            self._replace(worker)  # a process that has ended keeps its exit code through the kill
            return [*results, ValueError(f"{self.ref}: its worker died (exit code {worker.process.exitcode}; it "
                                         f"was replaced)")]
        self._idle.put(worker)
        return results

    def _prepare(self, worker: ScorerProcess, warm: bool) -> bool:
        """Have the worker make the warm-up call if asked and it has not, and take the answers it owes before any
        task's (its "ready", the warm-up's): no task's time, but each within WORKER_START_TIMEOUT_S (False if
        not)."""
        if warm and not worker.warm:
            self._send_warm_up(worker)
        while worker.owed:
            if not worker.connection.poll(WORKER_START_TIMEOUT_S):
                return False
            worker.connection.recv()  # "ready", or the warm-up's result or error: either way it is warm
            worker.owed -= 1
        return True

    def close(self) -> None:
        with self._lock:
            workers = list(self._all)
        for worker in workers:
            if worker.process.is_alive():
                worker.process.kill()
            worker.process.join(5)
            worker.connection.close()
