"""deploy/slurm/meshrl.sbatch under a real Slurm (tests/integration/slurm.py): slurmctld and four slurmd, each
node a network namespace with its own address and host name (tests/integration/hosts.py). One job over the
four nodes: the coordinator and a reward service on node1, a trainer of two CPU ranks over node2 and node3
(torchrun, c10d rendezvous across the nodes), a rollout on node4.

Checked: docs/operations/slurm.md's Slurm commands, run as written, give a run that finishes with every step;
every service ran on its role's node (the network namespace of its process, the host name it registered under,
the address it bound); the token file is 0600 and the token in no process's command line or environment; the command the
job prints to follow the run works from the login node; nothing of the job is left when it ends. Then,
mid-run: a plain scancel (every process of the job gets SIGTERM at once: the run is recorded stopped at the
last step it completed, every service stops by itself); scancel of the batch script alone (it stops the run at
its next step boundary, where it saves a checkpoint, then the services; a second job with --resume finishes
it); a service that dies (its step ends: the script stops the run the same way and fails the job). None leaves
a process behind. A misspelt key fails the job before any service starts."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from services.common.auth import cluster_token
from services.coordctl.control import CoordinatorClient
from tests.integration.hosts import Hosts
from tests.integration.slurm import SlurmCluster, unavailable
from tests.integration.test_grpo_run import run_config

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"no Slurm cluster to run on: {unavailable()}")

REPO = Path(__file__).resolve().parents[2]
SLURM_PAGE = REPO / "docs" / "operations" / "slurm.md"
SBATCH = REPO / "deploy" / "slurm" / "meshrl.sbatch"
NODES = ("node1", "node2", "node3", "node4")
CONTROLLER = "slurmctl"  # the host slurmctld runs on
PLACES = {"coordinator": {"node1"}, "reward": {"node1"}, "trainer": {"node2", "node3"}, "rollout": {"node4"}}
KILL_WAIT_S = 30
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with Hosts(*NODES, CONTROLLER) as hosts:
        with SlurmCluster(hosts, CONTROLLER, tmp_path_factory.mktemp("slurm"), KILL_WAIT_S) as cluster:
            yield cluster
    assert not hosts.left_behind()


@dataclass
class Job:
    """A meshrl.sbatch job and its folder (MESHRL_STATE)."""

    slurm: SlurmCluster
    id: str
    state: Path
    output: Path

    def fields(self) -> dict[str, str]:
        return self.slurm.job(self.id)

    def running(self) -> bool:
        return self.fields()["JobState"] in ("PENDING", "RUNNING", "CONFIGURING")

    def db(self, query: str, *args) -> list[tuple]:
        try:
            with sqlite3.connect(f"file:{self.state / 'meshrl.db'}?mode=ro", uri=True) as db:
                return db.execute(query, args).fetchall()
        except sqlite3.OperationalError:  # not made yet, or its tables not yet
            return []

    def steps(self) -> list[int]:
        return [step for (step,) in self.db("SELECT step FROM steps ORDER BY step")]

    def checkpoints(self) -> list[int]:
        return [step for (step,) in self.db("SELECT step FROM checkpoints ORDER BY step")]

    def run(self) -> tuple[str, str, str, str]:
        """run_id, state, error and run_dir of the job's one run."""
        [run] = self.db("SELECT run_id, state, error, run_dir FROM runs")
        return run

    def events(self, log: str) -> list[dict]:
        lines = (self.state / "logs" / log).read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def wait_until(self, ready, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while not (found := ready()):
            assert self.running(), f"job {self.id} ended before {what}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{self.tail()}"
            time.sleep(0.5)
        return found

    def tail(self) -> str:
        logs = sorted((self.state / "logs").glob("*.log")) if (self.state / "logs").exists() else []
        return "\n".join(f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}"
                         for path in [self.output, *logs] if path.exists())


def submit(slurm: SlurmCluster, folder: Path, model: Path, data: Path, **changes) -> Job:
    """meshrl.sbatch over the four nodes (trainer on two) for run_config's run of ``model`` on ``data``, every
    service with one torch thread."""
    folder.mkdir()
    (folder / "run.yaml").write_text(run_config(model, data, **changes))
    return sbatch_meshrl(slurm, folder, "job", str(folder / "run.yaml"))


def sbatch_meshrl(slurm: SlurmCluster, folder: Path, name: str, *arguments: str) -> Job:
    """meshrl.sbatch ``arguments`` as job ``name`` (its output in ``folder``/``name``.out) with state in
    ``folder``/state."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MESHRL_")}
    env.update({"MESHRL_PYTHON": sys.executable, "MESHRL_TRAINER_NODES": "2", "MESHRL_IFNAME": "eth0",
                "MESHRL_STATE": str(folder / "state"), **THREADS})
    env.update({f"MESHRL_{kind}_SETTINGS": "torch_threads=1" for kind in ("COORDINATOR", "TRAINER", "ROLLOUT",
                                                                            "REWARD")})
    output = folder / f"{name}.out"
    job_id = slurm.sbatch("--nodes=4", f"--output={output}", str(SBATCH), *arguments, env=env)
    return Job(slurm, job_id, folder / "state", output)


def job_processes(slurm: SlurmCluster, job: Job) -> dict[int, tuple[list[str], str]]:
    """The processes Slurm started for ``job`` (their environment names it and this cluster): pid -> (command
    line, the node whose network namespace it runs in)."""
    marks = (f"SLURM_JOB_ID={job.id}".encode(), f"SLURM_CONF={slurm.conf}".encode())
    namespaces = {os.stat(f"/run/netns/{namespace}").st_ino: name for name, namespace in slurm.hosts.namespaces.items()}
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            if all(mark in environ for mark in marks):
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
                found[int(entry.name)] = (argv, namespaces.get(os.stat(entry / "ns" / "net").st_ino, "root"))
        except OSError:  # gone meanwhile, or a kernel thread
            continue
    return found


def service_kind(argv: list[str]) -> str | None:
    """coordinator, reward, trainer (a rank), rollout, torchrun (the trainer's agent), or None (the scripts, srun,
    coordctl)."""
    if "torch.distributed.run" in argv:
        return "torchrun"
    modules = [argv[i + 1].removeprefix("services.") for i, arg in enumerate(argv[:-1]) if arg == "-m"]
    return modules[0] if modules and modules[0] in PLACES else None


def all_command_lines() -> list[bytes]:
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                lines.append((entry / "cmdline").read_bytes())
            except OSError:
                continue
    return lines


async def registered(coordinator: str) -> list:
    client = CoordinatorClient(coordinator)
    try:
        return await client.list_services()
    finally:
        await client.close()


def check_nothing_left(slurm: SlurmCluster, job: Job) -> None:
    left = job_processes(slurm, job)
    assert not left, f"left running after job {job.id}: {left}"


def service_events(job: Job, kind: str) -> list[str]:
    return [e["event"] for node in sorted(PLACES[kind]) for e in job.events(f"{kind}-{node}.log")]


def check_stopped_by_themselves(job: Job, kinds=tuple(PLACES)) -> None:
    """Each service of ``kinds`` logged its own graceful stop (SIGTERM: finish the call in flight, deregister);
    the trainer's second rank stopped when its leader told it to."""
    for kind in kinds:
        assert "stopped" in service_events(job, kind), kind
    if "trainer" in kinds:
        assert "stopped_by_leader" in service_events(job, "trainer")


def docs_slurm_commands() -> list[str]:
    """docs/operations/slurm.md's first bash block, comments and all."""
    return re.search(r"```bash\n(.*?)```", SLURM_PAGE.read_text(), re.S).group(1).splitlines()


def test_the_docs_slurm_job_runs_as_written_across_four_nodes(slurm, tmp_path, monkeypatch):
    """docs/operations/slurm.md's commands, as written, on the login node (this machine's own network, where
    slurmctld runs) in a checkout, from a terminal with no meshrl settings: a job over the four nodes, the trainer
    on two."""
    home = tmp_path / "home"
    home.mkdir()
    env = {key: value for key, value in slurm.env.items() if not key.startswith("MESHRL_")}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}:{env['PATH']}", **THREADS)
    commands = docs_slurm_commands()
    assert commands[0].startswith("# on the login node, in the meshrl checkout"), commands
    done = subprocess.run(["bash", "-c", "set -e\n" + "\n".join(commands)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
    folder = home / "meshrl-demo"
    job = Job(slurm, job_id, folder / "meshrl-state" / job_id, folder / f"slurm-{job_id}.out")
    job.wait_until(lambda: [step for step in job.steps() if step > 0], 300, "first step")

    # while it runs: each service runs in its role's node, and the token is in no command line or environment
    token = (job.state / "token").read_text().strip()
    processes = job_processes(slurm, job)
    placed: dict[str, list[str]] = {}
    for argv, node in processes.values():
        if (kind := service_kind(argv)) is not None:
            placed.setdefault(kind, []).append(node)
    assert {kind: sorted(nodes) for kind, nodes in placed.items()} == {
        "coordinator": ["node1"], "reward": ["node1"], "trainer": ["node2", "node3"],
        "torchrun": ["node2", "node3"], "rollout": ["node4"]}, processes
    assert not [line for line in all_command_lines() if token.encode() in line]
    for pid, (argv, _) in processes.items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()  # as the process started (a script's exports not)
        except OSError:
            continue
        assert token.encode() not in environ and b"MESHRL_TOKEN=" not in environ, argv
        if service_kind(argv) is not None:
            assert f"MESHRL_TOKEN_FILE={job.state / 'token'}".encode() in environ, argv

    # the coordinator's registry: each service under its node's host name, at that node's address
    monkeypatch.setenv("MESHRL_TOKEN_FILE", str(job.state / "token"))
    cluster_token.cache_clear()
    [serving] = [e for e in job.events("coordinator-node1.log") if e["event"] == "serving"]
    services = asyncio.run(registered(serving["address"]))
    cluster_token.cache_clear()
    assert sorted(s.kind for s in services) == ["reward", "rollout", "trainer"]
    for service in services:
        assert service.hostname in PLACES[service.kind], service
        assert service.address.startswith(slurm.hosts.address(service.hostname) + ":"), service

    # the job's Prometheus targets: each service's /metrics at its node's address, served with the token only
    targets = job.wait_until(lambda: re.search(r"for file_sd_configs: (\S+)", job.output.read_text()), 60,
                             "the targets file")
    listed_file = Path(targets.group(1))
    groups = job.wait_until(lambda: listed if len(listed := targets_listed(listed_file)) == 4 else None, 60,
                            "a target for each service")
    assert sorted(group["labels"]["job"] for group in groups) == [
        "meshrl-coordinator", "meshrl-reward", "meshrl-rollout", "meshrl-trainer"]
    for group in groups:
        [target] = group["targets"]
        kind = group["labels"]["job"].removeprefix("meshrl-")
        assert any(target.startswith(slurm.hosts.address(node) + ":") for node in PLACES[kind]), group
        assert scrape(target, token) == 200 and scrape(target, None) == 401, group

    # the output says how another machine follows the run; that command, as printed, from the login node
    follow = job.wait_until(lambda: re.search(r"from any machine that reaches node1: (.*); after the job",
                                              job.output.read_text()), 60, "how to follow the run")
    watched = subprocess.run(["bash", "-c", f"{follow.group(1)} | head -n 3"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert watched.returncode == 0 and watched.stdout.startswith("run running"), watched.stdout + watched.stderr

    final = slurm.wait(job.id, 600)
    assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), job.tail()
    run_id, state, error, run_dir = job.run()
    assert (state, error) == ("finished", "")
    assert job.steps() == list(range(0, 21))  # step 0: the validation before training
    config = yaml.safe_load((folder / "run.yaml").read_text())
    batch = config["data"]["train_batch_size"] * config["actor_rollout_ref"]["rollout"]["n"]
    metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "critic/score/mean" in m]
    assert [m["step"] for m in trained] == list(range(1, 21))
    for m in trained:  # every sample generated on node4
        rollout = {k: v for k, v in m.items() if k.startswith("rollout/samples_by/")}
        assert list(rollout.values()) == [batch], rollout
        assert all(k.removeprefix("rollout/samples_by/").startswith(slurm.hosts.address("node4") + ":")
                   for k in rollout)
    assert (job.state / "token").stat().st_mode & 0o777 == 0o600

    # the logs: one per service and node; each bound to its node's address (not 0.0.0.0 or loopback)
    for kind, nodes in PLACES.items():  # (the trainer's rank 0 serves, on one of its nodes)
        bound = {node: [e["address"] for e in job.events(f"{kind}-{node}.log") if e["event"] == "serving"]
                 for node in nodes}
        assert any(bound.values()), kind
        for node, addresses in bound.items():
            assert all(address.startswith(slurm.hosts.address(node) + ":") for address in addresses), (kind, node)
    ranks = {node: [e["rank"] for e in job.events(f"trainer-{node}.log") if e["event"] == "ranks_joined"]
             for node in ("node2", "node3")}
    assert sorted(ranks["node2"] + ranks["node3"]) == [0, 1], ranks  # one rank on each trainer node
    check_stopped_by_themselves(job)
    check_nothing_left(slurm, job)
    assert f"run {run_id} finished" in job.output.read_text()


def targets_listed(path: Path) -> list[dict]:
    """The groups of a Prometheus targets file; none before it is written."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []


def scrape(target: str, token: str | None) -> int:
    """The status of a GET of ``target``'s /metrics presenting ``token`` (as Prometheus's authorization does)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{target}/metrics", headers=headers),
                                    timeout=10) as reply:
            return reply.status if b"meshrl_rpc_duration_seconds" in reply.read() else -1
    except urllib.error.HTTPError as refused:
        return refused.code


def kill_rollout(slurm: SlurmCluster, job: Job) -> None:
    """kill -9 the rollout service: the job's step on node4 ends, as when a service crashes."""
    [pid] = [pid for pid, (argv, _) in job_processes(slurm, job).items() if service_kind(argv) == "rollout"]
    os.kill(pid, signal.SIGKILL)


STOPS = {
    "scancel": lambda slurm, job: slurm.run("scancel", job.id),
    "scancel-batch-term": lambda slurm, job: slurm.run("scancel", "--batch", "--signal=TERM", job.id),
    "rollout-killed": kill_rollout,
}


@pytest.mark.parametrize("stop", STOPS)
def test_a_job_stopped_mid_run_leaves_nothing(slurm, tmp_path, tiny_model, reverse_data, stop):
    total = 14 if stop == "scancel-batch-term" else 2000  # that one is then resumed to its end
    job = submit(slurm, tmp_path / "job", tiny_model, reverse_data, trainer__total_training_steps=total,
                 trainer__save_freq=1)
    job.wait_until(lambda: len(job.checkpoints()) >= 2, 240, "two steps checkpointed")
    STOPS[stop](slurm, job)
    final = slurm.wait(job.id, KILL_WAIT_S + 120)
    check_nothing_left(slurm, job)

    # the run is stopped; every step it completed is recorded, the last one (or the one before) checkpointed
    run_id, state, error, run_dir = job.run()
    steps, checkpoints = job.steps(), job.checkpoints()
    assert state == "stopped"
    assert checkpoints == list(range(1, len(checkpoints) + 1)) and len(checkpoints) >= 2
    assert steps == list(range(1, len(steps) + 1)) and steps[-1] - checkpoints[-1] in (0, 1), (steps, checkpoints)
    metrics = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics][:len(steps)] == steps
    output = job.output.read_text()
    if stop == "scancel":
        # every process got SIGTERM at once: each service began its graceful stop (one in a collective with a
        # peer that has gone, such as the weight sync, fails), the coordinator recorded the run stopped; a service
        # it saw go first made it go back to the last checkpoint (steps after it are redone on resume)
        assert final["JobState"] == "CANCELLED"
        assert error == "the coordinator shut down"
        check_stopped_by_themselves(job, ["coordinator"])
        assert all("stopping" in service_events(job, kind) for kind in PLACES)
    elif stop == "scancel-batch-term":
        # the script alone got it: it stopped the run at a step boundary, where it saved a checkpoint, then the
        # services, each of which stopped by itself
        assert (final["JobState"], final["ExitCode"]) == ("FAILED", "143:0"), job.tail()
        assert f"SIGTERM: stopping run {run_id} at its next step boundary" in output
        assert error == "" and steps[-1] == checkpoints[-1] < total
        check_stopped_by_themselves(job)

        # a second job, on the first's folder, continues the run from that checkpoint to its end
        resumed = sbatch_meshrl(slurm, tmp_path / "job", "resumed", "--resume", run_id)
        final = slurm.wait(resumed.id, 300)
        assert (final["JobState"], final["ExitCode"]) == ("COMPLETED", "0:0"), resumed.tail()
        assert job.run()[1:3] == ("finished", "")
        assert job.steps() == list(range(1, total + 1))
        assert f"run {run_id} finished" in resumed.output.read_text()
        check_nothing_left(slurm, resumed)
    else:
        # the rollout's step ended: the script stopped the run (waiting for a rollout by then), then the others
        # (the trainer too, unless the rollout died in the middle of a weight sync: then its two ranks end there)
        assert (final["JobState"], final["ExitCode"]) == ("FAILED", "1:0"), job.tail()
        assert "the rollout step ended during the run" in output
        assert f"no rollout: stopping run {run_id} at its next step boundary" in output
        assert "no rollout" in error
        check_stopped_by_themselves(job, ["coordinator", "reward"])


def test_a_bad_run_config_is_refused_before_any_service_starts(slurm, tmp_path, tiny_model, reverse_data):
    job = submit(slurm, tmp_path / "job", tiny_model, reverse_data, trainer__total_trainig_steps=3)
    final = slurm.wait(job.id, 120)
    assert (final["JobState"], final["ExitCode"]) == ("FAILED", "1:0")
    output = job.output.read_text()
    assert "trainer.total_trainig_steps: unknown key (did you mean total_training_steps?)" in output, output
    assert "nothing was started" in output
    assert not list((job.state / "logs").glob("*.log"))  # no service wrote a log: none started
    check_nothing_left(slurm, job)
