"""Hostile users' tools for tests/integration/test_agent_faults.py, loaded by path: each does what a tool must not
do to the env service hosting it. Each is bounded, so that where containment fails the test fails without
harming the machine: Forks starts a bounded count of processes, Hogs allocates only under a memory limit."""

from __future__ import annotations

import json
import os
import resource
import socket
import time
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
    """Starts ``count`` processes that each write their id to ``folder/forked`` and sleep for an hour, then waits
    forever."""

    def call(self, arguments: dict):
        listed = Path(self.config["folder"]) / "forked"
        for _ in range(int(self.config["count"])):
            if os.fork() == 0:
                with listed.open("a") as file:  # one short appended write: whole, among the others'
                    file.write(f"{os.getpid()}\n")
                time.sleep(3600)
                os._exit(0)
        while True:
            time.sleep(1)


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
