"""coordctl as a person uses it, as real processes: Ctrl-C through a pipe, a second Ctrl-C, the messages of a
newcomer's mistakes, `coordctl init` feeding services started by hand, and the services table after a run."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from services.coordctl.control import CoordinatorClient
from services.run.config import RunConfig
from tests.integration.test_grpo_run import run_config, run_to_end
from tests.logger_files import tensorboard_scalars
from tests.unit.run.test_verl_configs import GRPO_SCRIPT, as_the_shell_passes

COORDCTL = [sys.executable, "-m", "services.coordctl.cli"]


def coordctl(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*COORDCTL, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def steps_done(state_dir: Path) -> int:
    lines = [json.loads(line) for path in state_dir.glob("runs/*/metrics.jsonl") for line in path.read_text().splitlines()]
    return max((line["step"] for line in lines if "critic/score/mean" in line), default=0)


def terminal_env(**changes: str) -> dict[str, str]:
    """A user's fresh terminal: no cluster token set (this test process may hold one from an earlier test)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MESHRL_TOKEN")}, **changes}


def start_local(state_dir: Path, cache: Path, *overrides: str) -> subprocess.Popen:
    """coordctl start-run --local writing into a pipe, as `... | tee log` does; straight to its RL steps (no warm
    start: what these tests look at is the RL loop's)."""
    return subprocess.Popen([*COORDCTL, "start-run", "--local", "trainer.total_training_steps=400",
                             "trainer.test_freq=-1", "actor_rollout_ref.actor.warm_start.steps=0",
                             "--state-dir", str(state_dir), *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=terminal_env(MESHRL_CACHE=str(cache)))


def wait_for_step(state_dir: Path, step: int, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while steps_done(state_dir) < step:
        assert process.poll() is None, process.stdout.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the run did not get going"
        time.sleep(0.2)


def said_until(process: subprocess.Popen, text: str) -> str:
    """What ``process`` writes until a line with ``text`` (all it wrote, if it ends first)."""
    said = ""
    while line := process.stdout.readline().decode():
        said += line
        if text in line:
            break
    return said


def run_row_and_events(state_dir: Path) -> tuple[tuple, list[tuple]]:
    db = sqlite3.connect(state_dir / "meshrl.db")
    [row] = db.execute("SELECT run_id, state, step, error FROM runs").fetchall()
    return row, db.execute("SELECT kind, step, message FROM events ORDER BY id").fetchall()


@pytest.fixture
def stopped_afterwards():
    """Takes each coordctl process a test starts and stops it after the test, whatever the outcome (its pipe
    closed, then Ctrl-C, then kill), so that a test that fails part-way leaves no run going under the next."""
    started: list[subprocess.Popen] = []
    yield started.append
    for process in started:
        if process.poll() is None:
            process.stdout.close()
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_ctrl_c_with_the_pipe_closed_stops_at_a_step_boundary_and_loses_nothing(tmp_path, local_cache,
                                                                               stopped_afterwards):
    state_dir = tmp_path / "state"
    process = start_local(state_dir, local_cache)
    stopped_afterwards(process)
    wait_for_step(state_dir, 3, process)
    process.stdout.close()  # the tee that Ctrl-C killed
    process.send_signal(signal.SIGINT)  # and Ctrl-C itself
    assert process.wait(timeout=120) == 1  # the run did not finish: exit 1, after a clean stop
    (run_id, state, step, error), events = run_row_and_events(state_dir)
    assert state == "stopped" and error == ""
    checkpoints = [s for kind, s, _ in events if kind == "checkpoint"]
    assert checkpoints == [step] and steps_done(state_dir) == step  # the last step trained is saved: none lost
    messages = " | ".join(message for _, _, message in events)
    assert "stop requested" in messages
    assert "recovery" not in messages and "does not answer" not in messages and "shut down" not in messages
    assert not list(state_dir.glob("runs/*/checkpoints/*.tmp"))


def test_a_second_ctrl_c_stops_at_once_and_says_what_resume_redoes(tmp_path, local_cache, stopped_afterwards):
    state_dir = tmp_path / "state"
    process = start_local(state_dir, local_cache, "trainer.save_freq=2")
    stopped_afterwards(process)
    wait_for_step(state_dir, 5, process)
    process.send_signal(signal.SIGINT)
    said = said_until(process, "stopping the run at its next step boundary")  # the first Ctrl-C was taken
    process.send_signal(signal.SIGINT)
    output = said + process.communicate(timeout=120)[0].decode()
    assert "stopping the run at its next step boundary" in output
    assert "stopping now: the run goes on from the last checkpoint (step" in output
    assert f"coordctl resume --local --state-dir {state_dir.resolve()}" in output
    (run_id, state, step, _), events = run_row_and_events(state_dir)
    assert state in ("stopped", "interrupted") and not [m for _, _, m in events if "recovery" in m]
    resumed = subprocess.Popen([*COORDCTL, "resume", "--local", "--state-dir", str(state_dir), run_id],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=terminal_env(MESHRL_CACHE=str(local_cache)))
    stopped_afterwards(resumed)
    wait_for_step(state_dir, step + 2, resumed)
    resumed.send_signal(signal.SIGINT)
    output = resumed.communicate(timeout=120)[0].decode()
    checkpoint = max(s for kind, s, _ in events if kind == "checkpoint")
    assert f"run {run_id} " in output and f", from step {checkpoint}" in output
    assert f"| {checkpoint}/400 [" in output  # the progress bar starts where the run goes on, not at step 1
    assert "| 1/400 [" not in output
    # TensorBoard (the default logger) shows each step once, as metrics.jsonl does: a step after the checkpoint
    # that the first attempt trained is the resumed attempt's
    [run_dir] = state_dir.glob("runs/*")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rewards = {row["step"]: row["critic/score/mean"] for row in rows if "critic/score/mean" in row}
    assert tensorboard_scalars(run_dir / "tensorboard")["critic/score/mean"] == pytest.approx(rewards, rel=1e-6)


def test_ctrl_c_in_a_warm_start_stops_at_its_next_step_and_resume_goes_on_from_there_from_any_folder(
        tmp_path, local_cache):
    """Ctrl-C during the warm start lands at its next step boundary, not after the whole warm start: a checkpoint
    of step 0 keeps what it taught and where it was, and resume --local goes on with its next step, then RL, with
    the services the run was started with: here an env service for its tool, which the default services lack. All
    run from another folder than the repository's: the example's tool config is found beside it."""
    state_dir, repository = tmp_path / "state", Path(__file__).resolve().parents[2]
    small = ["actor_rollout_ref.actor.warm_start.steps=300", "actor_rollout_ref.actor.warm_start.batch_size=4",
             "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.test_freq=-1", "trainer.val_before_train=false",
             "local.lookup_task.rows=500"]
    process = subprocess.Popen([*COORDCTL, "start-run", "--local", str(repository / "examples" / "local_tools.yaml"),
                                *small, "--state-dir", str(state_dir)], cwd=tmp_path, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env=terminal_env(MESHRL_CACHE=str(local_cache)))
    said = ""
    try:
        said = said_until(process, "warm start 60/300")
    finally:
        process.send_signal(signal.SIGINT)
        output = said + process.communicate(timeout=180)[0].decode()
    assert process.returncode == 1 and "checkpoint of step 0 saved in" in output, output[-2000:]
    assert "stopping the run at its next step boundary (in its warm start, the next warm-start step's)" in output
    assert output.count("multi_turn.tool_config_path=") == 1, output[:3000]  # noted, and not again as a run event
    [taught] = re.findall(r"warm start stopped after (\d+)/300 steps: a resume goes on from step", output)
    assert 60 <= int(taught) < 300 and "warm start 300/300" not in output
    (run_id, state, step, _), events = run_row_and_events(state_dir)
    assert state == "stopped" and step == 0 and [s for kind, s, _ in events if kind == "checkpoint"] == [0]
    [loop_state] = sqlite3.connect(state_dir / "meshrl.db").execute("SELECT loop_state_json FROM checkpoints")
    assert json.loads(loop_state[0])["warm_start"]["taught"] == int(taught)

    resumed = subprocess.Popen([*COORDCTL, "resume", "--local", "--state-dir", str(state_dir), run_id],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=terminal_env(MESHRL_CACHE=str(local_cache)))
    try:
        wait_for_step(state_dir, 1, resumed, timeout_s=240)  # the warm start's steps left, then step 1
    finally:  # stopped as a person stops it, whatever happened (its local services stop with it)
        resumed.send_signal(signal.SIGINT)
        output = resumed.communicate(timeout=120)[0].decode()
    assert "resumed from the checkpoint of step 0" in output and "env replicas of group default" in output, output
    assert "warm start 300/300" in output and "warm start 60/300" not in output  # on from where it stopped
    assert "waiting" not in output

    # its export is evaluated calling the tool, as it was trained: the export records the run's multi_turn
    # settings, and eval --local starts an env service for them
    exported = tmp_path / "exported"
    done = coordctl("export", run_id, str(exported), "--state-dir", str(state_dir))
    assert done.returncode == 0, done.stderr
    [run_dir] = state_dir.glob("runs/*")
    held_out = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["val_files"][0]
    evaluated = subprocess.run([*COORDCTL, "eval", str(exported), "--local", "--data", held_out, "--out",
                                str(tmp_path / "eval.jsonl"), "--state-dir", str(tmp_path / "eval")], cwd=tmp_path,
                               capture_output=True, text=True, timeout=300,
                               env=terminal_env(MESHRL_CACHE=str(local_cache)))
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]
    assert "env replicas of group default" in evaluated.stdout and "meshrl/lookup: acc/mean@1" in evaluated.stdout
    [metrics] = [json.loads(line) for path in (tmp_path / "eval").glob("runs/*/metrics.jsonl")
                 for line in path.read_text().splitlines()]
    assert metrics["val/agent/tool_call_rate"] > 0 and metrics["val/num_turns/max"] == 3  # call, reply, answer


def read_until(process: subprocess.Popen, text: str) -> str:
    """The output of ``process`` up to the line holding ``text``, and that line's following two (read as it comes)."""
    lines: list[str] = []
    while not any(text in line for line in lines[:-2]) or len(lines) < 3:
        line = process.stdout.readline().decode()
        assert line, "".join(lines)[-2000:]
        lines.append(line)
    return "".join(lines)


def test_another_terminal_sees_the_local_run_and_what_it_waits_for(tmp_path, local_cache):
    state_dir = tmp_path / "state"
    process = start_local(state_dir, local_cache)
    try:
        said = read_until(process, "from another terminal")
        coordinator = re.search(r"coordinator at (\S+);", said).group(1)
        assert f"MESHRL_TOKEN_FILE={state_dir.resolve() / 'token'}" in said
        assert (state_dir / "token").stat().st_mode & 0o777 == 0o600
        wait_for_step(state_dir, 3, process)
        terminal = terminal_env(MESHRL_TOKEN_FILE=str(state_dir / "token"))
        runs = subprocess.run([*COORDCTL, "runs", "--coordinator", coordinator], capture_output=True, text=True,
                              env=terminal, timeout=60)
        assert " running " in runs.stdout, runs.stderr
        run_id = runs.stdout.splitlines()[1].split()[0]
        trainer = subprocess.run(["pgrep", "-P", str(process.pid), "-f", "services.trainer"], capture_output=True,
                                 text=True).stdout.split()
        os.kill(int(trainer[0]), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while "waiting for: Unavailable: the trainer at" not in (status := subprocess.run(
                [*COORDCTL, "status", run_id, "--coordinator", coordinator], capture_output=True, text=True,
                env=terminal, timeout=60).stdout):
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        assert f"{run_id}  waiting  step 0/400" in status  # no checkpoint yet: it goes on from the start
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=120)


def test_a_newcomers_mistakes_get_true_messages(tmp_path):
    cache = {"MESHRL_CACHE": str(tmp_path / "cache")}
    assert coordctl("--version").stdout.startswith("meshrl ")
    unreachable = coordctl("runs", "--coordinator", "127.0.0.1:9")
    assert unreachable.returncode == 1
    assert "no coordinator answers at 127.0.0.1:9" in unreachable.stderr and "MESHRL_COORDINATOR" in unreachable.stderr
    both = coordctl("start-run", "--local", "--coordinator", "10.0.0.1:7070", env=cache)
    assert both.returncode == 2 and "--local starts its own coordinator" in both.stderr
    misspelt = coordctl("start-run", "--local", "data.trian_batch_size=4", env=cache)
    assert "did you mean train_batch_size" in misspelt.stderr
    missing = coordctl("start-run", "--local", f"actor_rollout_ref.model.path={tmp_path / 'nothing'}", env=cache)
    assert missing.returncode == 2 and "actor_rollout_ref.model.path:" in missing.stderr and "not a folder" in missing.stderr
    started = time.monotonic()
    planned = coordctl("start-run", "--local", "--dry-run", "trainer.total_epochs=2", "~trainer.total_training_steps",
                       env=cache)
    assert planned.returncode == 0, planned.stderr
    assert "would start on this machine: a coordinator, then a trainer, a rollout, a reward" in planned.stdout
    assert "# read: 20000 training prompts, 256 held-out, 1250 steps" in planned.stdout  # 2 epochs of 625 steps
    assert yaml.safe_load(planned.stdout.split("# read:")[0])["trainer"]["total_training_steps"] == 1250
    assert time.monotonic() - started < 60
    assert not (tmp_path / "meshrl-runs").exists()  # nothing started


def test_init_gives_services_started_by_hand_a_run_that_works(cluster, tmp_path):
    folder = tmp_path / "demo"
    done = coordctl("init", str(folder), "--coordinator-host", "coord-host")
    assert done.returncode == 0, done.stderr
    assert "python -m services.coordinator host=0.0.0.0 port=7070" in done.stdout
    assert f"export MESHRL_TOKEN_FILE={folder / 'token'}" in done.stdout
    assert (folder / "token").stat().st_mode & 0o777 == 0o600
    config = yaml.safe_load((folder / "run.yaml").read_text())
    assert Path(config["actor_rollout_ref"]["model"]["path"]).is_dir() and "local" not in config
    config["trainer"]["total_training_steps"] = 2
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, yaml.safe_dump(config)))
    assert final.state == "finished", final.error
    assert (Path(final.run_dir) / "validation" / "step_000002.jsonl").exists()  # its held-out data came too


@pytest.mark.parametrize("command", [["stop", "no-such-run"], ["status", "no-such-run"]])
def test_a_run_that_is_not_there_is_named(cluster, command):
    done = coordctl(*command, "--coordinator", cluster.coordinator)
    assert done.returncode == 1 and "NOT_FOUND" in done.stderr and "no-such-run" in done.stderr


def services_table(output: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The header of `coordctl services` and its rows by kind, each a dict by column (cells are two or more spaces
    apart; a cell holds single spaces at most: "0.4 s", "cuda:0 NVIDIA H200"). The algorithms each service
    registered follow the table after a blank line."""
    header, *lines = output.partition("\n\n")[0].splitlines()
    columns = header.split()
    rows = [dict(zip(columns, re.split(r" {2,}", line.strip()), strict=True)) for line in lines]
    return columns, {row["KIND"]: row for row in rows}


async def reported_weight_versions(coordinator: str) -> dict[str, int | None]:
    client = CoordinatorClient(coordinator)
    try:
        return {entry.kind: entry.weight_version for entry in await client.list_services()}
    finally:
        await client.close()


def test_the_services_table_shows_each_services_host_gpu_version_and_weights_after_a_run(cluster, tiny_model,
                                                                                        reverse_data):
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, run_config(tiny_model, reverse_data,
                                                                         trainer__total_training_steps=2)))
    assert final.state == "finished", final.error
    synced = int(final.metrics["training/weight_version"])  # the last step trained it, then synced it to the rollout
    assert synced == 2
    deadline = time.monotonic() + 30  # the heartbeat after the sync (every 1 s) carries it, however loaded we are
    while (reported := asyncio.run(reported_weight_versions(cluster.coordinator))) != {
            "trainer": synced, "rollout": synced, "reward": None}:
        assert time.monotonic() < deadline, reported
        time.sleep(0.2)

    listed = coordctl("services", "--coordinator", cluster.coordinator)
    assert listed.returncode == 0, listed.stderr
    columns, rows = services_table(listed.stdout)
    assert columns == ["HOST", "KIND", "GROUP", "ADDRESS", "GPU", "VERSION", "WEIGHTS", "SEEN", "STATE", "ID"]
    assert sorted(rows) == ["reward", "rollout", "trainer"]
    for kind, row in rows.items():
        assert row["HOST"] == socket.gethostname() and row["GROUP"] == "default" and row["STATE"] == "up"
        assert row["GPU"] == "cpu" and row["VERSION"] == version("meshrl")
        assert row["ADDRESS"].startswith("127.0.0.1:") and row["ID"].startswith(f"{kind}-")
        seen, unit = row["SEEN"].split()
        assert unit == "s" and 0 <= float(seen) < 5.0  # within the down window (1 s heartbeats, 5 missed)
    assert rows["trainer"]["WEIGHTS"] == rows["rollout"]["WEIGHTS"] == str(synced)
    assert rows["reward"]["WEIGHTS"] == "-"
    table, _, algorithms = listed.stdout.partition("\n\n")
    header, *lines = table.splitlines()
    assert {line.index(" up ") + 1 for line in lines} == {header.index("STATE")}  # aligned under its header
    estimators, losses = algorithms.splitlines()
    assert estimators.startswith(f"advantage estimators (coordinator {cluster.coordinator}): gae, grpo, rloo, ")
    assert losses == (f"policy losses (trainer {rows['trainer']['ADDRESS']}): vanilla, gspo, cispo, geo_mean, "
                      "clip_cov, kl_cov, gpg")


def test_a_verl_command_line_with_no_config_file_plans_a_run_on_meshrls_defaults_without_a_coordinator():
    """verl's GRPO GSM8K script with SGLang, as typed after `coordctl start-run --dry-run` instead of
    `python3 -m verl.trainer.main_ppo`: exit 0, the resolved config shown (each key the script leaves out at
    meshrl's default), what meshrl does not use said once each, and no coordinator asked (none answers there)."""
    typed = as_the_shell_passes(GRPO_SCRIPT.replace("rollout.name=vllm", "rollout.name=sglang"))
    planned = coordctl("start-run", "--dry-run", "--coordinator", "127.0.0.1:9", *typed,
                       "actor_rollout_ref.hybrid_engine=True")
    assert planned.returncode == 0, planned.stderr
    shown = yaml.safe_load(planned.stdout.split("# not read here")[0])
    assert (shown["algorithm"]["adv_estimator"], shown["actor_rollout_ref"]["rollout"]["n"]) == ("grpo", 5)
    assert shown["actor_rollout_ref"]["rollout"]["name"] == "sglang"
    assert shown["trainer"]["rpc_timeout_s"] == RunConfig().trainer.rpc_timeout_s  # not in the script
    for note in ("# note: actor_rollout_ref.rollout.name=sglang: meshrl has no SGLang engine",
                 "# note: actor_rollout_ref.hybrid_engine=True: verl's actor and rollout in one process",
                 "# note: trainer.n_gpus_per_node=8, trainer.nnodes=1: verl's Ray placement"):
        assert planned.stdout.count(note) == 1, planned.stdout
    assert "# would send it to the coordinator at 127.0.0.1:9" in planned.stdout


def test_hydras_config_path_and_name_name_the_run_config_and_a_missing_one_is_named(tmp_path):
    folder = tmp_path / "config"
    folder.mkdir()
    (folder / "gsm8k_grpo.yaml").write_text(yaml.safe_dump({
        "actor_rollout_ref": {"model": {"path": "/models/qwen"}, "rollout": {"n": 3}},
        "data": {"train_files": "/data/train.parquet", "train_batch_size": 16}}))
    planned = coordctl("start-run", "--dry-run", f"--config-path={folder}", "--config-name=gsm8k_grpo",
                       "data.max_prompt_length=64")
    assert planned.returncode == 0, planned.stderr
    shown = yaml.safe_load(planned.stdout.split("# not read here")[0])
    assert (shown["actor_rollout_ref"]["rollout"]["n"], shown["data"]["train_batch_size"],
            shown["data"]["max_prompt_length"]) == (3, 16, 64)
    missing = coordctl("start-run", "--dry-run", "--config-path", str(folder), "--config-name", "gsm8k_ppo")
    assert missing.returncode == 2
    assert f"--config-name gsm8k_ppo: there is no config file {folder / 'gsm8k_ppo.yaml'}" in missing.stderr
