"""Users' tools and environments for tests/integration/test_env_service.py, test_agent_run.py and
test_agent_faults.py, loaded by path."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path


class Lookup:
    """A tool that knows one value per key (its config's table) and earns 0.5 per known key."""

    def __init__(self, config: dict, create_kwargs: dict):
        self.table = dict(config.get("table", {}))

    def call(self, arguments: dict):
        key = arguments["key"]
        return (str(self.table[key]), 0.5) if key in self.table else f"no value for {key}"


class Undecodable:
    """Replies with a file name this host could not decode (os.fsdecode keeps its byte as a lone surrogate)."""

    def __init__(self, config: dict, create_kwargs: dict):
        pass

    def call(self, arguments: dict):
        return os.fsdecode(b"name-\xff")


class Hangs:
    def __init__(self, config: dict, create_kwargs: dict):
        pass

    def call(self, arguments: dict):
        while True:
            time.sleep(1)


class Raises:
    def __init__(self, config: dict, create_kwargs: dict):
        pass

    def call(self, arguments: dict):
        raise RuntimeError("the tool broke")


class Garbage:
    def __init__(self, config: dict, create_kwargs: dict):
        pass

    def call(self, arguments: dict):
        return {"not": "a reply"}


class GuessNumber:
    """A stateful environment: the model guesses the row's number; told higher or lower until right (reward 1)."""

    def __init__(self, tries: int = 3):
        self.tries = tries

    def reset(self, row: dict) -> list[dict]:
        self.secret, self.guesses = int(row["secret"]), 0
        return [{"role": "user", "content": f"Guess my number; {self.tries} tries."}]

    def step(self, message: dict) -> dict:
        self.guesses += 1
        guess = int(message["content"].strip())
        if guess == self.secret:
            return {"messages": [{"role": "user", "content": "right"}], "reward": 1.0, "done": True}
        hint = "higher" if guess < self.secret else "lower"
        return {"messages": [{"role": "user", "content": hint}], "done": self.guesses >= self.tries,
                "info": {"guesses": self.guesses}}


class Countdown:
    """Answers every model turn with "again" (reward 0.25 a step) until the third, which ends the episode: any
    model, trained or not, goes three turns with it."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def reset(self, row: dict) -> list[dict]:
        self.steps = 0
        return []

    def step(self, message: dict) -> dict:
        self.steps += 1
        done = self.steps >= self.turns
        return {"messages": [] if done else [{"role": "user", "content": "again"}], "reward": 0.25, "done": done}


class StallsOnce(Countdown):
    """Countdown, but the first step of all (of any episode, on any env service given the same ``folder``)
    writes its env service's process id to ``folder/stalled`` and never returns: the test kills that service
    mid-episode."""

    def __init__(self, folder: str, turns: int = 3):
        super().__init__(turns)
        self.folder = Path(folder)

    def step(self, message: dict) -> dict:
        claim = self.folder / f"claim-{uuid.uuid4().hex}"
        claim.write_text(str(os.getppid()))  # the worker's parent: the env service
        try:
            os.link(claim, self.folder / "stalled")  # atomic: one step of all wins, its pid already written
        except FileExistsError:
            return super().step(message)
        finally:
            claim.unlink()
        while True:  # until its env service is killed (its workers die with it)
            time.sleep(1)


class HeldAfterFirstTurn(Countdown):
    """Countdown, but each episode's first step leaves a file in ``folder/held`` and waits until
    ``folder/released`` exists: every trajectory holds between its first and second model turns until the test
    releases them."""

    def __init__(self, folder: str, turns: int = 3):
        super().__init__(turns)
        self.folder = Path(folder)

    def step(self, message: dict) -> dict:
        if self.steps == 0:
            (self.folder / "held" / uuid.uuid4().hex).touch()
            while not (self.folder / "released").exists():
                time.sleep(0.05)
        return super().step(message)


class KillsItsWorker(Countdown):
    """Countdown, but a reset ends its worker process (os._exit) the first ``deaths`` times of all (counted in
    files under ``folder``), as a worker dying under a reset would."""

    def __init__(self, folder: str, deaths: int = 1):
        super().__init__()
        self.folder, self.deaths = Path(folder), deaths

    def reset(self, row: dict) -> list[dict]:
        died = len(list(self.folder.glob("died-*")))
        if died < self.deaths:
            (self.folder / f"died-{died}").touch()
            os._exit(3)
        return super().reset(row)
