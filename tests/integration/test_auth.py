"""Services refuse callers without the cluster's token, and never log it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.auth import cluster_token
from services.common.rpc import CHANNEL_OPTIONS, open_channel


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
