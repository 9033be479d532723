"""No process a service started outlives it, whatever kills it: services killed with SIGKILL as real processes,
their trees (read from /proc before the kill) checked gone.

A reward service starts worker processes (the rules', users' functions') and, through multiprocessing, a
resource tracker; a trainer under torchrun is an agent and its ranks. Started by hand (no launcher's
MESHRL_PARENT_PID): as systemd or Slurm would start them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.coordctl.local import CHILD_ENV


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process, from /proc."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # it ended while we looked
            continue
        table[int(stat.parent.name)] = (int(fields[1]), fields[0])
    return table


def descendants(pid: int) -> dict[int, str]:
    """pid -> command line of each process below ``pid``."""
    children: dict[int, list[int]] = {}
    for child, (parent, _) in process_table().items():
        children.setdefault(parent, []).append(child)
    found, frontier = {}, [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            try:
                found[child] = Path(f"/proc/{child}/cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            frontier.append(child)
    return found


def alive(pids) -> list[int]:
    """Those of ``pids`` still running (a zombie has ended: only its exit status is left)."""
    table = process_table()
    return [pid for pid in pids if pid in table and table[pid][1] != "Z"]


@contextlib.contextmanager
def started(command: list[str], log: Path):
    """The process, started as by hand; it and its tree are killed on the way out should the test leave them."""
    env = {key: value for key, value in os.environ.items() if key != "MESHRL_PARENT_PID"}
    process = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**env, **CHILD_ENV}, start_new_session=True)
    try:
        yield process
    finally:
        tree = descendants(process.pid)
        process.kill()
        process.wait()
        for pid in alive(tree):
            os.kill(pid, signal.SIGKILL)


def wait_for(condition, what: str, process: subprocess.Popen, log: Path, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert process.poll() is None, f"it exited with {process.returncode} before {what}: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s: {log.read_text()[-2000:]}"
        time.sleep(0.2)
    return found


def kill_and_wait_for_tree(process: subprocess.Popen, tree: dict[int, str], within_s: float) -> None:
    """SIGKILL ``process``, then wait until no process of ``tree`` is alive (fail past ``within_s``)."""
    process.kill()
    process.wait()
    killed = time.monotonic()
    while left := alive(tree):
        if time.monotonic() - killed > within_s:
            for pid in left:  # leave nothing behind for the next test
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"alive {within_s} s after the kill: {[tree[pid] for pid in left]}")
        time.sleep(0.1)


def test_a_reward_service_killed_with_sigkill_leaves_no_worker_or_resource_tracker(tmp_path):
    log = tmp_path / "reward.log"
    with started([sys.executable, "-m", "services.reward", "host=127.0.0.1", "port=0", "function_workers=2"],
                 log) as service:

        def workers_and_tracker():
            tree = descendants(service.pid)
            commands = list(tree.values())
            spawned = sum("spawn_main" in c for c in commands) == 2 and any("resource_tracker" in c for c in commands)
            return tree if spawned else None

        tree = wait_for(workers_and_tracker, "rule workers and a resource tracker", service, log)
        kill_and_wait_for_tree(service, tree, within_s=5)


def test_trainer_ranks_end_when_their_torchrun_agent_is_killed_with_sigkill(tmp_path):
    log = tmp_path / "trainer.log"
    with started([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                  "services.trainer", "host=127.0.0.1", "port=0", "torch_threads=1"], log) as agent:
        wait_for(lambda: '"serving"' in log.read_text(errors="replace"), "rank 0 serving", agent, log)
        tree = descendants(agent.pid)
        assert sum("services.trainer" in command for command in tree.values()) == 2, tree
        # rank 0 stops as on SIGTERM (no call in flight: at once), and tells rank 1 to stop
        kill_and_wait_for_tree(agent, tree, within_s=20)
