"""What a person watching a --local run sees, as real processes: `coordctl watch` in a real terminal (tmux) redraws
one table in place as the steps go by, and each step's kept samples name the rollout and reward services that
made them (read back as the file and as `coordctl samples`)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.test_cli import COORDCTL, read_until, start_local, terminal_env, wait_for_step

TMUX = shutil.which("tmux")


class Pane:
    """One tmux pane on a server of its own, running a command in a terminal of ``width`` x ``height``."""

    def __init__(self, command: list[str], env: dict[str, str], width: int = 120, height: int = 30):
        self.server = ["tmux", "-L", f"meshrl-test-{os.getpid()}-{id(self)}"]  # a server name of this process's own
        subprocess.run([*self.server, "new-session", "-d", "-x", str(width), "-y", str(height),
                        shlex.join(command)], env=env, check=True, timeout=30)

    def lines(self) -> list[str]:
        shown = subprocess.run([*self.server, "capture-pane", "-p"], capture_output=True, text=True, check=True,
                               timeout=30).stdout
        return shown.splitlines()

    def close(self) -> None:
        subprocess.run([*self.server, "kill-server"], capture_output=True, timeout=30)


def table_steps(lines: list[str]) -> list[int]:
    """The steps in the table's rows (the lines under the header that start with a number)."""
    header = next(index for index, line in enumerate(lines) if line.startswith("STEP"))
    return [int(line.split()[0]) for line in lines[header + 1:] if re.match(r"\s*\d+\s", line)]


def frame_after(pane: Pane, step: int, timeout_s: float = 120) -> list[str]:
    """The pane once its table shows a step past ``step``."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = pane.lines()
        if any(line.startswith("STEP") for line in lines) and max(table_steps(lines), default=-1) > step:
            return lines
        assert time.monotonic() < deadline, "\n".join(lines)
        time.sleep(0.3)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, local_cache):
    """A --local run going (400 steps, stopped after the module): its state folder, coordinator and id."""
    folder = tmp_path_factory.mktemp("live")
    process = start_local(folder / "state", local_cache)
    try:
        said = read_until(process, "from another terminal")
        coordinator = re.search(r"coordinator at (\S+);", said).group(1)
        run_id = re.search(r"^run (\S+) pending", read_until(process, " pending, from step 0"), re.M).group(1)
        yield folder / "state", coordinator, run_id, process
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=120)


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (Debian: apt-get install tmux; .ci/run installs it)")
def test_watch_redraws_one_table_in_place_as_the_steps_go_by(local_run):
    state_dir, coordinator, run_id, process = local_run
    env = terminal_env(MESHRL_TOKEN_FILE=str(state_dir / "token"), TERM="xterm-256color")
    pane = Pane([sys.executable, "-m", "services.coordctl.cli", "watch", run_id, "--coordinator", coordinator], env)
    try:
        first = frame_after(pane, 2)
        later = frame_after(pane, max(table_steps(first)) + 2)
    finally:
        pane.close()
    for frame in (first, later):
        assert frame[0] == f"{run_id}  running  step {max(table_steps(frame))}/400", frame
        assert frame[1] == "services up  reward 1/1  rollout 1/1  trainer 1/1"
        assert sum(line.startswith("STEP") for line in frame) == 1  # one table, not one per redraw
        assert table_steps(frame) == list(range(table_steps(frame)[0], max(table_steps(frame)) + 1))
    assert first.index(next(l for l in first if l.startswith("STEP"))) == later.index(
        next(l for l in later if l.startswith("STEP")))  # drawn over itself, where it was
    assert max(table_steps(later)) > max(table_steps(first))
    validated = next(line for line in later if re.match(r"\s*0\s", line))  # the validation before training
    assert re.match(r"\s*0\s+-\s+0\.\d{3}\s", validated), validated

    watch = f"{shlex.join(COORDCTL)} watch {run_id} --coordinator {coordinator}"
    piped = subprocess.run(["bash", "-c", f"{watch} | head -n 8"], capture_output=True, text=True, env=env, timeout=60)
    lines = piped.stdout.splitlines()
    assert lines[0] == "run running" and piped.stderr == "", piped.stdout + piped.stderr  # and quiet once head is done
    assert any(re.match(r"step 1/400  reward \d\.\d{3}  step_s \d+\.\d\d  gen_s ", line) for line in lines), lines


def test_each_kept_sample_names_the_weights_rollout_and_reward_service_that_made_it(local_run):
    state_dir, coordinator, run_id, process = local_run
    wait_for_step(state_dir, 3, process)
    run_dir = state_dir / "runs" / run_id
    env = terminal_env(MESHRL_TOKEN_FILE=str(state_dir / "token"))
    listed = subprocess.run([*COORDCTL, "services", "--coordinator", coordinator], capture_output=True, text=True,
                            env=env, timeout=60).stdout
    table = listed.split("\n\n")[0]  # the services' table; the algorithms each registered follow it
    services = {row.split()[1]: row.split() for row in table.splitlines()[1:]}  # HOST KIND GROUP ADDRESS ... ID
    step = next(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                if json.loads(line).get("step") == 2 and "critic/score/mean" in line)
    records = [json.loads(line) for line in (run_dir / "rollout_data" / "2.jsonl").read_text().splitlines()]
    assert len(records) == 32 * 8  # the local default's batch: every response of the step
    assert {(r["rollout"], r["reward_service"], r["reward_address"]) for r in records} == {
        (services["rollout"][3], services["reward"][-1], services["reward"][3])}
    trained_from = int(step["training/weight_version"]) - 1
    assert {r["weight_version"] + r["staleness"] for r in records} == {trained_from}  # versions the run went by
    assert {r["staleness"] for r in records} <= {0, 1}  # the local default generates one step ahead
    assert sum(r["score"] for r in records) / len(records) == pytest.approx(step["critic/score/mean"], abs=1e-6)
    for record in records:
        assert record["score"] == pytest.approx(sum(c["weight"] * c["value"] for c in record["reward_components"]))
        assert record["input"].endswith("=") and record["step"] == 2
    for group in range(32):  # GRPO: a group's advantages sum to zero
        assert sum(r["advantage"] for r in records if r["group"] == group) == pytest.approx(0.0, abs=1e-4)

    shown = subprocess.run([*COORDCTL, "samples", run_id, "--step", "2", "--limit", "2", "--coordinator", coordinator],
                           capture_output=True, text=True, env={**env, "COLUMNS": "100"}, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert f"{run_dir.resolve() / 'rollout_data' / '2.jsonl'}: 2 of 256 samples of step 2" in shown.stdout
    rollout, reward = services["rollout"], services["reward"]
    assert f"rollout {rollout[3]}  reward {reward[-1]} ({reward[3]})" in shown.stdout
    assert f"    prompt    {records[1]['input']}" in shown.stdout and "#2 " not in shown.stdout
