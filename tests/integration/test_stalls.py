"""No wedge, no unseen stall, on real processes: abandoned Generate calls stop taking the rollout's engine, and a
stopped (SIGSTOP) reward service is dropped from the run, or waited for with its name in the run's status.

One cluster for the module: a coordinator, a trainer, a rollout and two reward services."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import time

import grpc
import pytest

from bench.faults import service_address
from services.coordinator.fleet.clients import RolloutClient
from services.coordinator.settings import Sampling
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_faults import samples
from tests.integration.test_grpo_run import run_config

BUSY_PROMPTS = [[5, 6, 7]] * 128
BUSY = Sampling(n=128, temperature=1.0, top_p=1.0, max_new_tokens=64, stop_token_ids=())  # a minute's work here


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    local = LocalCluster(tmp_path_factory.mktemp("stalls") / "state",
                         (ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="reward"),
                          ServiceSpec(kind="reward")))
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()


def test_a_generate_abandoned_by_its_client_stops_taking_the_engine(cluster, tiny_model):
    async def scenario() -> float:
        addresses = {s.kind: s.address for s in await cluster_services(cluster)}
        rollout = RolloutClient(addresses["rollout"])
        try:
            await rollout.init_run("abandoned", str(tiny_model), "float32", timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await rollout.generate(BUSY_PROMPTS, BUSY, 0, first_index=0, timeout=1.0)  # its deadline passes
            assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            started = time.monotonic()
            small = Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, stop_token_ids=())
            generated = await rollout.generate([[5, 6, 7]], small, 0, first_index=0, timeout=60)
            assert len(generated.response_lens) == 2
            return time.monotonic() - started
        finally:
            await rollout.close()

    assert asyncio.run(scenario()) < 5.0  # not behind the abandoned work (12 s before, behind a quarter of it)


def test_a_stopped_reward_service_is_dropped_or_waited_for_by_name(cluster, tiny_model, reverse_data):
    """SIGSTOP one of the two reward services mid-run: the run goes on with the other, with an event naming the
    stopped one. Then SIGSTOP the other too: the run waits, its status naming it, and goes on at its SIGCONT."""
    first, second = "reward-2", "reward-3"
    by_name = {name: service_address(cluster, name) for name in (first, second)}
    pids = {name: cluster.processes[name].pid for name in (first, second)}
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=500)
    seen: dict[str, int] = {}  # what happened -> the run's step then

    async def scenario():
        client = CoordinatorClient(cluster.coordinator)
        try:
            run = await client.start_run(config)
            async for update in client.watch(run.run_id):
                if update.kind == "step" and update.step == 2 and "stopped first" not in seen:
                    os.kill(pids[first], signal.SIGSTOP)
                    seen["stopped first"] = update.step
                if update.message.startswith(f"reward {by_name[first]} left the run") and "first left" not in seen:
                    seen["first left"] = update.step
                if update.kind == "step" and seen.get("first left", update.step) <= update.step - 2 \
                        and "stopped second" not in seen:
                    os.kill(pids[second], signal.SIGSTOP)  # two steps scored by it alone
                    seen["stopped second"] = update.step
                if update.kind == "state" and update.state == "waiting":
                    seen["waiting"] = update.step
                    status = await client.get_run(run.run_id)
                    assert status.state == "waiting" and f"{by_name[second]} left the run" in status.error
                    os.kill(pids[second], signal.SIGCONT)
                if update.kind == "step" and "waiting" in seen and update.step >= seen["waiting"] + 2:
                    await client.stop_run(run.run_id)
            return await client.get_run(run.run_id)
        finally:
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)
            await client.close()

    final = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert final.state == "stopped", final.error
    assert list(seen) == ["stopped first", "first left", "stopped second", "waiting"]
    with sqlite3.connect(cluster.state_dir / "meshrl.db") as db:
        rows = {step: json.loads(m) for step, m in
                db.execute("SELECT step, metrics_json FROM steps WHERE run_id = ?", (final.run_id,))}
    assert sorted(rows) == list(range(1, final.step + 1))
    assert all(samples(metrics, "reward") == 8 * 4 for metrics in rows.values())  # nothing lost
    alone = range(seen["first left"] + 1, seen["stopped second"] + 1)  # scored with the first one out
    second_id = f"-{by_name[second].rpartition(':')[2]}-{pids[second]}"  # reward-<host>-<port>-<pid>
    assert alone and all([s.endswith(second_id) for s in scorers(rows[step])] == [True] for step in alone)
    assert final.step > seen["waiting"] + 1  # it went on after the wait


def scorers(metrics: dict[str, float]) -> list[str]:
    return [k.removeprefix("reward/samples_by/") for k in metrics if k.startswith("reward/samples_by/")]


async def cluster_services(cluster: LocalCluster):
    client = CoordinatorClient(cluster.coordinator)
    try:
        return await client.list_services()
    finally:
        await client.close()
