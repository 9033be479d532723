"""The mesh over four hosts (network namespaces on one machine, tests/integration/hosts.py), as a cluster runs:
the coordinator and a reward service on one host, the trainer on a second, a rollout on each of a third and a
fourth; the cluster token and mTLS on; every service bound to its own host's address. A GRPO run crosses the
hosts (weights from the trainer's host to both rollout hosts), then survives a rollout host and the trainer
host losing their network for a while, with every step once and every sample there."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.common.auth import cluster_tls, cluster_token, write_token
from services.coordinator.fleet.clients import RolloutClient
from services.coordctl.cli import app
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import CHILD_ENV, ServiceSpec
from tests.integration.hosts import HostCluster, Hosts, unavailable
from tests.integration.test_faults import LogTail, check_nothing_lost
from tests.integration.test_grpo_run import run_config

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"no hosts to run on: {unavailable()}")

HOSTS = ("node1", "node2", "node3", "node4")  # as docs/operations/by-hand.md names them
PLACEMENT = {"coordinator": "node1", "reward": "node1", "trainer": "node2", "rollout-1": "node3", "rollout-2": "node4"}
BY_HAND = Path(__file__).resolve().parents[2] / "docs" / "operations" / "by-hand.md"
SERVICES = (ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="rollout"),
            ServiceSpec(kind="reward"))


@pytest.fixture(scope="module")
def hosts():
    with Hosts(*HOSTS) as made:
        yield made
    assert not made.left_behind()


@pytest.fixture(scope="module")
def certs(tmp_path_factory, hosts):
    """A CA and a certificate per host, naming the host and its address; one for this test process too."""
    folder = tmp_path_factory.mktemp("certs") / "cluster"
    specs = [f"{name},{hosts.address(name)}" for name in HOSTS] + ["tester"]
    done = CliRunner().invoke(app, ["certs", str(folder), *[arg for spec in specs for arg in ("--host", spec)]])
    assert done.exit_code == 0, done.output
    return folder


@pytest.fixture
def make_cluster(tmp_path, hosts, certs, monkeypatch):
    """A HostCluster on ``hosts`` with a fresh token; this process holds the token and the tester's certificate."""
    monkeypatch.setenv("MESHRL_TOKEN_FILE", str(write_token(tmp_path / "token")))
    monkeypatch.delenv("MESHRL_TOKEN", raising=False)
    monkeypatch.setenv("MESHRL_TLS_CERT", str(certs / "tester.pem"))
    monkeypatch.setenv("MESHRL_TLS_KEY", str(certs / "tester-key.pem"))
    monkeypatch.setenv("MESHRL_TLS_CA", str(certs / "ca.pem"))
    cluster_token.cache_clear()
    cluster_tls.cache_clear()
    clusters = []

    def make(*services: ServiceSpec) -> HostCluster:
        cluster = HostCluster(tmp_path / "state", hosts, certs, PLACEMENT, services or SERVICES)
        clusters.append(cluster)
        asyncio.run(cluster.start(timeout_s=120))
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()
    for host in HOSTS:
        hosts.reconnect(host)
    cluster_token.cache_clear()
    cluster_tls.cache_clear()


def addresses(cluster: HostCluster) -> dict[str, str]:
    """Each service's registered address, by the name the cluster gave it."""

    async def listed():
        client = CoordinatorClient(cluster.coordinator)
        try:
            return await client.list_services()
        finally:
            await client.close()

    by_address = {s.address: s for s in asyncio.run(listed())}
    names = {}
    for name, host in PLACEMENT.items():
        if name != "coordinator":
            [address] = [a for a, s in by_address.items() if a.startswith(cluster.hosts.address(host) + ":")
                         and s.kind == name.partition("-")[0]]
            names[name] = address
    return names


def answers_on_loopback(hosts: Hosts, host: str, port: int) -> bool:
    """Whether anything listens on 127.0.0.1:``port`` in ``host`` (a service bound to 0.0.0.0 or loopback would)."""
    probe = (f"import socket\ntry:\n socket.create_connection(('127.0.0.1', {port}), timeout=5)\nexcept OSError:\n"
             f" raise SystemExit(1)")
    return subprocess.run(hosts.command(host, [sys.executable, "-c", probe])).returncode == 0


async def run_and_watch(cluster: HostCluster, config: str, during=None):
    """Start the run, call ``during(client, run_id, messages)`` beside it if given; the final state, messages."""
    client = CoordinatorClient(cluster.coordinator)
    messages: list[str] = []
    try:
        started = await client.start_run(config)

        async def watch():
            async for update in client.watch(started.run_id):
                messages.append(update.message)

        await asyncio.gather(watch(), *([during(client, started.run_id, messages)] if during else []))
        return await client.get_run(started.run_id), messages
    finally:
        await client.close()


async def weight_versions(addresses_: list[str]) -> list[int]:
    clients = [RolloutClient(address) for address in addresses_]
    try:
        return [(await client.info()).weight_version for client in clients]
    finally:
        await asyncio.gather(*(client.close() for client in clients))


def test_a_grpo_run_across_four_hosts_with_token_and_mtls(make_cluster, tiny_model, reverse_data):
    steps = 4
    cluster = make_cluster()
    placed = addresses(cluster)
    for name, address in placed.items():
        host = PLACEMENT[name]
        assert address.startswith(cluster.hosts.address(host) + ":")
        assert not answers_on_loopback(cluster.hosts, host, int(address.rpartition(":")[2])), name
    assert not answers_on_loopback(cluster.hosts, "node1", int(cluster.coordinator.rpartition(":")[2]))

    final, messages = asyncio.run(run_and_watch(cluster, run_config(
        tiny_model, reverse_data, trainer__total_training_steps=steps)))
    rows = check_nothing_lost(cluster, final, steps)
    rollouts = [placed["rollout-1"], placed["rollout-2"]]
    channel = next(m for m in messages if m.startswith("weight channel"))
    assert all(address in channel for address in rollouts)  # one channel from the trainer's host to both
    for step in range(1, steps + 1):
        assert all(rows[step][f"rollout/samples_by/{address}"] > 0 for address in rollouts)  # both served
    # both rollout hosts hold the weights of the last step: they came over the wire from the trainer's host
    assert asyncio.run(weight_versions(rollouts)) == [rows[steps]["training/weight_version"]] * 2
    received = [e for e in LogTail(cluster, "rollout-2").read() if e["event"] == "weights_received"]
    assert len(received) >= steps


def test_a_rollout_host_cut_off_mid_run_is_left_out_then_taken_back_in_synced(make_cluster, tiny_model, reverse_data):
    steps, cut_at = 24, 3
    one_at_a_time = ServiceSpec(kind="rollout", settings=("batch_size=1",))  # the cut lands inside its share of a step
    cluster = make_cluster(ServiceSpec(kind="trainer"), one_at_a_time, one_at_a_time, ServiceSpec(kind="reward"))
    cut = addresses(cluster)["rollout-2"]
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=steps, data__max_response_length=16)

    async def pull_the_cable(client, run_id, messages):
        await LogTail(cluster, "rollout-2").wait_for("generating", cut_at)
        cluster.hosts.cut("node4")
        while not any(m.startswith(f"rollout {cut} left the run") for m in messages):
            await asyncio.sleep(0.2)
        cluster.hosts.reconnect("node4")

    final, messages = asyncio.run(run_and_watch(cluster, config, pull_the_cable))
    rows = check_nothing_lost(cluster, final, steps)
    left = next(i for i, m in enumerate(messages) if m.startswith(f"rollout {cut} left the run"))
    assert any(f"taken in: {cut}" in message for message in messages[left:])
    serving = [step for step in rows if f"rollout/samples_by/{cut}" in rows[step]]
    back = [step for step in serving if step > cut_at]
    assert back and back == list(range(back[0], steps + 1)), "back in at a boundary, then every step"
    assert back[0] - 1 not in serving  # it was out for a while
    # check_nothing_lost saw every sample of every step generated with the weights of the step before (the
    # least weight version over the step's samples): so it was synced before it served again
    assert asyncio.run(weight_versions([cut])) == [rows[steps]["training/weight_version"]]

def test_the_trainer_host_cut_off_past_the_heartbeat_window_the_run_waits_and_resumes(
        make_cluster, tiny_model, reverse_data):
    steps, cut_at = 10, 4
    cluster = make_cluster()
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=steps, trainer__save_freq=2,
                        trainer__channel_timeout_s=10)
    states = []

    async def pull_the_cable(client, run_id, messages):
        await LogTail(cluster, "trainer").wait_for("actor_updated", cut_at)
        cluster.hosts.cut("node2")
        while (run := await client.get_run(run_id)).state != "waiting":
            await asyncio.sleep(0.2)
        states.append(run)
        await asyncio.sleep(8)  # past the heartbeat window (5 s): the trainer is down, not just slow
        states.append(await client.get_run(run_id))
        cluster.hosts.reconnect("node2")

    final, messages = asyncio.run(run_and_watch(cluster, config, pull_the_cable))
    check_nothing_lost(cluster, final, steps)
    assert [s.state for s in states] == ["waiting", "waiting"]
    assert "the trainer at" in states[0].error
    assert any("then going on from the checkpoint of step" in message for message in messages)


def docs_cluster_commands() -> list[tuple[str, list[str]]]:
    """docs/operations/by-hand.md's first bash block: (the comment that says where, its commands), in order."""
    block = re.search(r"```bash\n(.*?)```", BY_HAND.read_text(), re.S).group(1)
    parts: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("# "):
            parts.append((line[2:], []))
        else:
            parts[-1][1].append(line)
    return parts


def on_hosts(where: str) -> list[str]:
    """The hosts a comment of the docs' block names (``on node3 and on node4``); the last host for ``any machine``."""
    return re.findall(r"node\d", where.partition(":")[0]) or ([HOSTS[-1]] if "any machine" in where else [])


def test_the_docs_cluster_commands_run_as_written_machine_by_machine(hosts, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {name: value for name, value in os.environ.items() if not name.startswith("MESHRL_")}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}:{env['PATH']}", **CHILD_ENV)
    parts = docs_cluster_commands()
    [(once, setup), (every, exports), *starts, (then, checks)] = parts
    assert (on_hosts(once), "every machine" in every, on_hosts(then)) == (["node1"], True, ["node4"]), parts

    def shell(host: str, commands: list[str], **options) -> subprocess.Popen:
        script = "set -e\n" + "\n".join([*exports, *commands, "wait"])
        return subprocess.Popen(hosts.command(host, ["bash", "-c", script]), cwd=home, env=env,
                                start_new_session=True, **options)

    done = shell("node1", setup, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert done.wait(timeout=300) == 0, done.stdout.read().decode()
    running = [shell(host, commands) for where, commands in starts for host in on_hosts(where)]
    try:
        assert sorted(h for where, _ in starts for h in on_hosts(where)) == ["node1", "node2", "node3", "node4"]
        listed = ""
        deadline = time.monotonic() + 120
        while listed.count(" up ") < 4:  # a person would look until all four are up, as this does
            assert time.monotonic() < deadline, listed
            time.sleep(1)
            probe = shell("node4", [checks[0]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            listed = probe.communicate(timeout=60)[0].decode()
        for host in HOSTS:
            assert host in listed  # every service registered under its machine's name
        final = shell("node4", checks, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        output = final.communicate(timeout=600)[0].decode()
        assert final.returncode == 0, output[-3000:]
        assert "(finished, 20/20 steps" in output
    finally:
        for process in running:
            os.killpg(process.pid, signal.SIGTERM)
        for process in running:
            process.wait(timeout=60)
    with sqlite3.connect(home / "meshrl-demo" / "state" / "meshrl.db") as db:
        steps = [s for (s,) in db.execute("SELECT step FROM steps ORDER BY step")]
    assert steps == list(range(0, 21))  # step 0: the validation before training
