"""Service logs are JSON lines, whole even when several processes (the ranks of a torchrun trainer) append to
one file unbuffered, as LocalCluster starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

WRITER = """
from services.common.logging import configure_logging
log = configure_logging("trainer")
for i in range(2000):
    log.info("ranks_joined", rank={rank}, i=i, padding="x" * 100)
"""


def test_two_processes_appending_to_one_log_never_split_a_line(tmp_path):
    path = tmp_path / "trainer.log"
    with path.open("ab") as log:
        writers = [subprocess.Popen([sys.executable, "-c", WRITER.format(rank=rank)], stdout=log,
                                    stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
                   for rank in range(2)]
        for writer in writers:
            assert writer.wait(60) == 0
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted((e["rank"], e["i"]) for e in events) == [(rank, i) for rank in range(2) for i in range(2000)]
