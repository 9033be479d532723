"""Services refuse callers without the cluster's token, and never log it; a service whose token is refused exits;
a service asked to listen beyond loopback without a token refuses to start, unless allow_open says so."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime

import grpc
import pytest

from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.auth import cluster_token, write_token
from services.common.rpc import CHANNEL_OPTIONS, open_channel
from services.coordctl.local import CHILD_ENV, LocalCluster


async def list_services(address: str, metadata) -> int:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        reply = await stub.ListServices(coordinator_pb2.ListServicesRequest(), metadata=metadata, timeout=10)
        return len(reply.services)


async def with_our_client(address: str) -> int:
    channel = open_channel(address)
    try:
        reply = await coordinator_pb2_grpc.CoordinatorStub(channel).ListServices(
            coordinator_pb2.ListServicesRequest(), timeout=10)
        return len(reply.services)
    finally:
        await channel.close()


def test_calls_without_the_token_or_with_a_wrong_one_are_refused(cluster):
    token = cluster_token()
    assert token  # the local cluster made one
    for metadata in ((), (("authorization", "Bearer not-the-token"),), (("authorization", token),)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(list_services(cluster.coordinator, metadata))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(list_services(cluster.coordinator, (("authorization", f"Bearer {token}"),))) == 3
    assert asyncio.run(with_our_client(cluster.coordinator)) == 3  # our channels carry it
    for log in cluster.log_dir.glob("*.log"):
        assert token not in log.read_text()


def test_a_service_speaking_another_protocol_version_is_refused(cluster):
    from meshrl.v1 import common_pb2

    async def register(version: int):
        channel = open_channel(cluster.coordinator)
        try:
            identity = common_pb2.ServiceIdentity(service_id="rollout-x", kind="rollout", address="127.0.0.1:1",
                                                  protocol_version=version)
            return await coordinator_pb2_grpc.CoordinatorStub(channel).Register(
                coordinator_pb2.RegisterRequest(identity=identity), timeout=10)
        finally:
            await channel.close()

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(register(2))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "protocol_version 2 is not 1" in refused.value.details()
    assert asyncio.run(register(1)).heartbeat_interval_s > 0


@pytest.fixture(scope="module")
def coordinator_alone(tmp_path_factory):
    """A coordinator that demands a token (the local cluster makes one), and no services."""
    local = LocalCluster(tmp_path_factory.mktemp("alone") / "state", services=())
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()


@pytest.mark.parametrize("token", ["not-the-token", None], ids=["wrong token", "no token"])
def test_a_service_whose_token_is_refused_exits_saying_how_to_set_it(coordinator_alone, token):
    env = {name: value for name, value in os.environ.items() if name not in ("MESHRL_TOKEN", "MESHRL_TOKEN_FILE")}
    env.update(CHILD_ENV, **({"MESHRL_TOKEN": token} if token else {}))
    command = [sys.executable, "-m", "services.reward", "--coordinator", coordinator_alone.coordinator,
               "host=127.0.0.1", "port=0", "torch_threads=1"]
    service = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)  # retrying would hang
    assert service.returncode == 2, service.stderr[-2000:]
    *logged, last_line = service.stderr.strip().splitlines()  # structlog's JSON lines, then the plain one
    records = [json.loads(line) for line in logged]
    assert [record["event"] for record in records][-4:] == ["serving", "token_refused", "stopping", "stopped"]
    events = {record["event"]: record for record in records}
    assert events["token_refused"]["coordinator"] == coordinator_alone.coordinator
    assert events["token_refused"]["code"] == "UNAUTHENTICATED"
    assert "MESHRL_TOKEN" in events["token_refused"]["fix"] and "MESHRL_TOKEN_FILE" in events["token_refused"]["fix"]
    serving, stopped = (datetime.fromisoformat(events[name]["timestamp"]) for name in ("serving", "stopped"))
    assert (stopped - serving).total_seconds() < 30  # at its first refusal: retrying would go on past the 60 s
    assert last_line.startswith(f"reward: the coordinator at {coordinator_alone.coordinator} refused this process")
    assert "MESHRL_TOKEN" in last_line and "MESHRL_TOKEN_FILE" in last_line


def without_token(**extra: str) -> dict[str, str]:
    """This process's environment with no cluster token, as a service started by hand might have it."""
    env = {name: value for name, value in os.environ.items() if name not in ("MESHRL_TOKEN", "MESHRL_TOKEN_FILE")}
    return {**env, **CHILD_ENV, **extra}


@pytest.mark.parametrize("kind", ["coordinator", "trainer", "rollout", "reward"])
def test_a_service_open_beyond_loopback_without_a_token_refuses_to_start(kind, tmp_path):
    command = [sys.executable, "-m", f"services.{kind}", "host=0.0.0.0", "port=0", "torch_threads=1",
               *([f"state_dir={tmp_path}"] if kind == "coordinator" else [])]
    started = subprocess.run(command, env=without_token(), capture_output=True, text=True, timeout=120)
    assert started.returncode == 2, started.stderr[-2000:]
    *logged, last_line = started.stderr.strip().splitlines()
    events = [json.loads(line)["event"] for line in logged]
    assert events[-1] == "open_bind_refused" and "serving" not in events  # refused before it bound
    assert last_line.startswith(f"{kind}: cannot start: host=0.0.0.0 listens beyond loopback and no cluster token")
    assert "set MESHRL_TOKEN_FILE" in last_line and "MESHRL_TOKEN to" in last_line
    assert "set allow_open=true" in last_line


def serve_then_stop(command: list[str], env: dict[str, str], log_path) -> list[dict]:
    """Start a service, wait for its serving event, SIGTERM it; its log records (it must exit 0)."""
    with log_path.open("w") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while '"event": "serving"' not in log_path.read_text():
            assert process.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "the service did not start serving"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]


def test_a_service_open_beyond_loopback_starts_when_allow_open_says_so(tmp_path):
    command = [sys.executable, "-m", "services.coordinator", "host=0.0.0.0", "port=0", f"state_dir={tmp_path}",
               "allow_open=true"]
    records = {record["event"]: record for record in serve_then_stop(command, without_token(), tmp_path / "log")}
    assert records["serving_open"]["host"] == "0.0.0.0" and records["serving_open"]["level"] == "warning"
    assert records["serving"]["authentication"] == "none"


def test_a_service_open_beyond_loopback_starts_with_a_token(tmp_path):
    token = write_token(tmp_path / "token")
    command = [sys.executable, "-m", "services.coordinator", "host=0.0.0.0", "port=0", f"state_dir={tmp_path}"]
    records = {record["event"]: record for record in
               serve_then_stop(command, without_token(MESHRL_TOKEN_FILE=str(token)), tmp_path / "log")}
    assert records["serving"]["authentication"] == "cluster token" and "serving_open" not in records
