"""The torchrun trainer unit, stopped the way systemd stops it: SIGTERM to every process of the unit at once, and
systemd, their subreaper, reaping what the main process leaves behind.

The unit lets torchrun handle every signal but SIGTERM, so torchrun dies of it, which systemd counts as a clean
stop (torchrun exits 1 after a SIGTERM it handles, and the unit would show failed after each stop), while rank 0
finishes, tells the other rank to stop, and both exit 0. No systemd runs here (PID 1 is not systemd): this test
plays its part, in a child process of its own, since being a subreaper lasts as long as the process.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from tests.unit.test_deploy import CONFIG_DIR, ROOT, UNIT_DIR, VENV_BIN, directives, exec_start

UNIT = "meshrl-trainer-torchrun.service"
PR_SET_CHILD_SUBREAPER = 36


def unit_command() -> list[str]:
    """The unit's ExecStart here: this virtual environment, two ranks on the CPU, the trainer.yaml beside the unit with
    no coordinator, on loopback (its /metrics on a free port: another test may hold the unit's)."""
    command = []
    for word in exec_start(UNIT):
        word = word.replace(VENV_BIN, sysconfig.get_path("scripts") + "/").replace(CONFIG_DIR, f"{UNIT_DIR}/")
        command.append("--nproc-per-node=2" if word == "--nproc-per-node=gpu" else word)
    return [*command, "device=cpu", "host=127.0.0.1", "port=0", "metrics_port=0", "coordinator=",
            "torch_threads=1"]


def stop_like_systemd(command: list[str], log: Path, stop_timeout_s: float) -> dict:
    """Start ``command``; once both ranks serve, SIGTERM it and its ranks and reap them all. How each ended
    (``os.waitstatus_to_exitcode``: -15 is killed by SIGTERM; None: not seen, reaped by the agent) and how long the
    stop took."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphaned ranks come to this process
    with log.open("w") as out:
        agent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while log.read_text().count('"ranks_joined"') < 2 or '"serving"' not in log.read_text():
        if agent.poll() is not None or time.monotonic() > deadline:
            return {"error": f"the trainer did not start: {log.read_text()[-2000:]}"}
        time.sleep(0.2)
    ranks = [int(pid) for pid in Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()]
    started = time.monotonic()
    for pid in [agent.pid, *ranks]:
        os.kill(pid, signal.SIGTERM)
    ended: dict[int, int] = {}
    while not {agent.pid, *ranks} <= set(ended) and time.monotonic() < started + stop_timeout_s:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left to this process: the agent reaped its ranks itself
            break
        if pid:
            ended[pid] = os.waitstatus_to_exitcode(status)
        else:
            time.sleep(0.05)
    return {"agent": ended.get(agent.pid), "ranks": [ended.get(pid) for pid in ranks],
            "stop_s": time.monotonic() - started}


def main() -> None:
    command, log, stop_timeout_s = json.loads(sys.argv[1])
    print(json.dumps(stop_like_systemd(command, Path(log), stop_timeout_s)))


def test_the_torchrun_unit_stops_cleanly_the_way_systemd_stops_it(tmp_path):
    log = tmp_path / "trainer.log"
    stop_timeout_s = float(directives(UNIT_DIR / UNIT)["Service"]["TimeoutStopSec"][0])
    environment = {name: value for name, value in os.environ.items() if not name.startswith("MESHRL_")}
    done = subprocess.run([sys.executable, "-c", "from tests.integration.test_systemd_stop import main; main()",
                           json.dumps([unit_command(), str(log), stop_timeout_s])],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "error" not in result, result.get("error")
    assert result["agent"] == -signal.SIGTERM  # what systemd counts as a clean stop
    assert result["ranks"] == [0, 0]
    assert result["stop_s"] < stop_timeout_s
    events = [json.loads(line)["event"] for line in log.read_text().splitlines() if line.startswith("{")]
    assert events.count("stopped") == 1 and events.count("stopped_by_leader") == 1
