"""Hostile users' tools for tests/integration/test_agent_faults.py, loaded by path: each does what a tool must not
do to the env service hosting it. Each is bounded, so that where containment fails the test fails without
harming the machine: Forks starts a bounded count of processes, Hogs allocates only under a memory limit."""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
from multiprocessing.connection import Connection
from pathlib import Path


class Tool:
    def __init__(self, config: dict, create_kwargs: dict):
        self.config = config


class Spins(Tool):
    """Loops forever on the CPU."""

    def call(self, arguments: dict):
        while True:
            pass


class Forks(Tool):
    """Starts ``count`` processes (the arguments') that sleep for an hour, each named ``name`` (its argv[0], seen
    in the host's /proc/PID/cmdline), and replies how many it started; raises when a fork fails, saying which."""

    def call(self, arguments: dict):
        count, name = int(arguments["count"]), str(arguments["name"])
        for started in range(count):
            try:
                child = os.fork()
            except OSError as error:
                raise OSError(f"fork {started + 1} of {count} failed: {error}") from None
            if child == 0:
                os.execv("/usr/bin/sleep", [name, "3600"])
        return f"started {count}"


class Detaches(Tool):
    """Starts a process named ``name`` (its argv[0]) that sleeps for an hour, detached as a daemon detaches (a
    session of its own, its parent gone), and replies "detached"."""

    def call(self, arguments: dict):
        name = str(arguments["name"])
        child = os.fork()
        if child == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/usr/bin/sleep", [name, "3600"])
            os._exit(0)
        os.waitpid(child, 0)
        return "detached"


class Hogs(Tool):
    """Allocates 100 GiB, 256 MiB at a time, where its memory is bounded; says so and allocates nothing where not."""

    def call(self, arguments: dict):
        if resource.getrlimit(resource.RLIMIT_DATA)[0] == resource.RLIM_INFINITY:
            return "no memory limit here: not allocating"
        held = [bytearray(256 << 20) for _ in range(400)]
        return f"allocated {len(held) / 4} GiB"


class ReadsCredentials(Tool):
    """Replies with the cluster credentials its environment names (the token, its file, the TLS files)."""

    def call(self, arguments: dict):
        return json.dumps({name: value for name, value in os.environ.items()
                           if name.startswith("MESHRL_") and ("TOKEN" in name or "TLS" in name)})


def secrets_seen(secrets: list[str], paths: list[str]) -> list[str]:
    """Where, from inside a sandbox, any of ``secrets`` (texts: a token, a path, a variable's name) shows in this
    process's environment, in the environment, command line or mounts of any process it can see, or in the
    settings of an env worker (the EnvServiceConfig it was sent); and which of ``paths`` exists here. Empty where
    nothing is seen. Standard library only: run as a tool in a worker and as a program in the code sandbox (its
    source and a call, see ``secrets_probe``)."""
    import gc
    import os

    texts = {"os.environ": "\n".join(f"{name}={value}" for name, value in os.environ.items())}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        for part in ("environ", "cmdline", "mountinfo"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as shown:
                    texts[f"/proc/{pid}/{part}"] = shown.read().decode(errors="replace")
            except OSError:
                continue
    for index, settings in enumerate(o for o in gc.get_objects() if type(o).__name__ == "EnvServiceConfig"):
        texts[f"worker settings {index}"] = settings.model_dump_json()
    seen = [f"{secret} in {where}" for where, text in texts.items() for secret in secrets if secret in text]
    return seen + [f"{path} exists" for path in paths if os.path.lexists(path)]


def secrets_probe(secrets: list[str], paths: list[str]) -> str:
    """A program that prints ``secrets_seen(secrets, paths)`` as JSON (for the code sandbox)."""
    import inspect

    return f"import json\n{inspect.getsource(secrets_seen)}\nprint(json.dumps(secrets_seen({secrets!r}, {paths!r})))\n"


class SearchesSecrets(Tool):
    """Replies with ``secrets_seen`` of its arguments' secrets and paths, as JSON."""

    def call(self, arguments: dict):
        return json.dumps(secrets_seen(arguments["secrets"], arguments["paths"]))


class ReadsFile(Tool):
    """Replies with the file at ``path`` (the cluster's token file, in the test)."""

    def call(self, arguments: dict):
        return Path(arguments["path"]).read_text()


class WritesFile(Tool):
    """Writes a file at ``path`` (outside any folder of its own, in the test)."""

    def call(self, arguments: dict):
        Path(arguments["path"]).write_text("written by a tool")
        return "written"


class Connects(Tool):
    """Opens a TCP connection to ``address`` (host:port; the coordinator's, in the test)."""

    def call(self, arguments: dict):
        host, _, port = arguments["address"].rpartition(":")
        with socket.create_connection((host, int(port)), timeout=5):
            return "connected"


class ForgesAnswer(Tool):
    """Sends its env service, on its worker's socket (the fd its command line names), a pickled answer that would
    create the file at ``path`` when unpickled, then waits for the service's reply."""

    def call(self, arguments: dict):
        connection = Connection(int(sys.argv[1]))
        connection.send(("done", Creates(arguments["path"])))
        return connection.recv()


class Creates:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")
