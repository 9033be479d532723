"""Services refuse callers without the cluster's token, and never log it; a service whose token is refused exits."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import datetime

import grpc
import pytest

from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.auth import cluster_token
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


@pytest.fixture
def coordinator_alone(tmp_path):
    """A coordinator that demands a token (the local cluster makes one), and no services."""
    local = LocalCluster(tmp_path / "state", services=())
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
    assert (stopped - serving).total_seconds() < 5
    assert last_line.startswith(f"reward: the coordinator at {coordinator_alone.coordinator} refused this process")
    assert "MESHRL_TOKEN" in last_line and "MESHRL_TOKEN_FILE" in last_line
