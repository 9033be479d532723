"""Users' reward functions: named ``path/to/file.py:function`` or ``module:function``, with verl's signature
``fn(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, "acc": bool, "pred": ...}``
(``acc`` and ``pred`` are optional: whether the answer is right, and the answer read, for validation metrics).

They run in worker processes, never in the service itself: a function that
raises costs its sample, a function that hangs past the per-sample timeout
costs its sample and its worker (killed and replaced), and nothing it does
can take the service down. A function that fails to import is refused when
the service starts, naming the file and the error.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import multiprocessing
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


def load_function(ref: str) -> Callable:
    """The function named by ``path/to/file.py:name`` or ``package.module:name``; ValueError if it cannot be had."""
    target, sep, name = ref.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"reward function {ref!r} must look like path/to/file.py:function or module:function")
    try:
        if target.endswith(".py"):
            path = Path(target).resolve()
            if not path.exists():
                raise FileNotFoundError(f"no such file {path}")
            spec = importlib.util.spec_from_file_location(f"meshrl_reward_plugin_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except Exception as error:  # noqa: BLE001 - any import failure refuses the plugin
        raise ValueError(f"reward function {ref}: {target} failed to import: {type(error).__name__}: {error}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"reward function {ref}: {target} has no function {name!r}")
    return function


@dataclass(frozen=True)
class FunctionScore:
    """What a user's function said of one sample."""

    score: float
    acc: bool | None  # its "acc", when it returned a dict with one
    pred: str  # its "pred" as text, "" when it gave none


def as_score(value: Any) -> FunctionScore:
    """A user function's result: a number, or a dict with a numeric ``score`` and optionally ``acc`` and ``pred``
    (verl's reward_extra_info); ValueError otherwise."""
    acc, pred = None, ""
    if isinstance(value, dict):
        acc, pred = value.get("acc"), value.get("pred")
        pred = "" if pred is None else str(pred)
        value = value.get("score")
        if acc is not None:
            if isinstance(acc, (int, float)) and not isinstance(acc, bool) and acc in (0, 1):
                acc = bool(acc)
            if not isinstance(acc, bool):
                raise ValueError(f"returned acc {acc!r}, not a bool")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"returned {value!r}, not a finite number or a dict with a numeric 'score'")
    return FunctionScore(float(value), acc, pred)


def _serve(ref: str, inbox, outbox) -> None:
    """A worker process: load the function once, then score what arrives until None."""
    function = load_function(ref)
    while (task := inbox.get()) is not None:
        try:
            outbox.put(("ok", as_score(function(*task))))
        except Exception as error:  # noqa: BLE001 - reported per sample
            outbox.put(("error", f"{type(error).__name__}: {error}"))


class FunctionWorkers:
    """A pool of worker processes running one user function, each sample with a timeout."""

    def __init__(self, ref: str, workers: int, timeout_s: float):
        load_function(ref)  # refuse at start, with the file and the error
        self.ref, self.timeout_s = ref, timeout_s
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.Queue = queue.Queue()
        self._all: list = []
        self._lock = threading.Lock()
        for _ in range(workers):
            self._idle.put(self._start())

    def _start(self):
        inbox, outbox = self._context.Queue(), self._context.Queue()
        process = self._context.Process(target=_serve, args=(self.ref, inbox, outbox), daemon=True)
        process.start()
        worker = (process, inbox, outbox)
        with self._lock:
            self._all.append(worker)
        return worker

    def _retire(self, worker) -> None:
        process, _, _ = worker
        process.kill()
        process.join(5)
        with self._lock:
            self._all.remove(worker)

    def score(self, data_source: str, solution: str, ground_truth: str, extra_info: dict) -> FunctionScore:
        """Blocking: the function's result for one sample; ValueError (raised, garbage) or TimeoutError (hung)."""
        worker = self._idle.get()
        process, inbox, outbox = worker
        inbox.put((data_source, solution, ground_truth, extra_info))
        try:
            status, value = outbox.get(timeout=self.timeout_s)
        except queue.Empty:
            self._retire(worker)
            self._idle.put(self._start())
            raise TimeoutError(f"{self.ref} did not return within {self.timeout_s} s (its worker was replaced)")
        if not process.is_alive():
            self._retire(worker)
            worker = self._start()
        self._idle.put(worker)
        if status == "error":
            raise ValueError(f"{self.ref} {value}")
        return value

    def close(self) -> None:
        with self._lock:
            workers = list(self._all)
        for process, inbox, _ in workers:
            if process.is_alive():
                process.kill()
            process.join(5)

