"""No request ties up a service: YAML that is small as sent and huge once its aliases or interpolations are
expanded is refused at once, naming the limit, by every service that takes YAML (the coordinator's StartRun, the
trainer's InitRun), which answers afterwards; and a service stops within its grace period after SIGTERM whatever
its threads are doing.

Real processes (a coordinator and a trainer) on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.rpc import open_channel
from services.common.service import OVERDUE_EXIT_CODE, RELEASE_S
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_grpo_run import run_config
from tests.unit.common.test_request_text import alias_bomb, interpolation_bomb

COORDINATOR_GRACE_S = 2.0  # shorter than the default 10 s: the overdue stop's test waits out grace_s + RELEASE_S
TRAINER_GRACE_S = 2.0
ANSWER_S = 30.0  # a deadline no refusal comes near (the bomb held the coordinator past 60 s, for good)
BOMBS = {
    "aliases": (alias_bomb(), "once its aliases are written out (limit MAX_YAML_CHARS)"),
    "interpolations": (interpolation_bomb(), "once its interpolations are resolved (limit MAX_YAML_CHARS"),
    "a resolver": ("trainer: {experiment_name: '${oc.env:MESHRL_TOKEN_FILE}'}", "no resolvers, such as oc.env"),
}


def start(root: Path) -> LocalCluster:
    cluster = LocalCluster(root / "state", (ServiceSpec(kind="trainer", settings=(f"grace_s={TRAINER_GRACE_S}",)),),
                           coordinator_settings=(f"grace_s={COORDINATOR_GRACE_S}",))
    asyncio.run(cluster.start(timeout_s=120))
    return cluster


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    cluster = start(tmp_path_factory.mktemp("bombs"))
    yield cluster
    cluster.stop()


async def trainer_address(coordinator: str) -> str:
    client = CoordinatorClient(coordinator)
    try:
        [trainer] = [s for s in await client.list_services() if s.kind == "trainer"]
        return trainer.address
    finally:
        await client.close()


async def send(address: str, call: str, config_yaml: str) -> tuple[grpc.StatusCode, str]:
    """The status a StartRun or InitRun of ``config_yaml`` ends with, and its details."""
    channel = open_channel(address)
    try:
        if call == "StartRun":
            await coordinator_pb2_grpc.CoordinatorStub(channel).StartRun(
                coordinator_pb2.StartRunRequest(config_yaml=config_yaml), timeout=ANSWER_S)
        else:
            await trainer_pb2_grpc.TrainerStub(channel).InitRun(
                trainer_pb2.TrainerInitRequest(run_id="bomb", run_config_yaml=config_yaml, roles=["actor"]),
                timeout=ANSWER_S)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    finally:
        await channel.close()


async def serving(address: str) -> bool:
    channel = open_channel(address)
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_S)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await channel.close()


@pytest.mark.parametrize("bomb", sorted(BOMBS))
@pytest.mark.parametrize("call", ["StartRun", "InitRun"])
def test_a_yaml_bomb_is_refused_at_once_naming_the_limit_and_the_service_goes_on(mesh, call, bomb):
    text, named = BOMBS[bomb]
    assert len(text) < 1000  # as sent

    async def check():
        address = mesh.coordinator if call == "StartRun" else await trainer_address(mesh.coordinator)
        code, details = await send(address, call, text)
        return code, details, await serving(address)

    code, details, still_serving = asyncio.run(check())
    assert (code, named in details) == (grpc.StatusCode.INVALID_ARGUMENT, True), details
    assert still_serving


def test_the_coordinator_still_lists_its_trainer_after_the_bombs(mesh):
    async def check():
        client = CoordinatorClient(mesh.coordinator)
        try:
            return [(s.kind, s.state) for s in await client.list_services()]
        finally:
            await client.close()

    assert asyncio.run(check()) == [("trainer", "up")]


def reader_waits(fifo: Path) -> int | None:
    """A write end of ``fifo`` once a process has it open to read (its read then waits on us), else None."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: nobody reads it yet
        return None


def test_a_service_stops_within_its_grace_period_whatever_its_threads_are_doing(tmp_path, tiny_model):
    """After the alias bomb, a StartRun whose data file never ends (a pipe that nobody writes, as a file on a hung
    mount reads) holds one of the coordinator's threads for good; SIGTERM still ends the coordinator, grace_s +
    RELEASE_S later, naming the thread; the trainer beside it, idle, stops within its grace period."""
    fifo = tmp_path / "train.jsonl"
    os.mkfifo(fifo)
    cluster = start(tmp_path)
    writers: list[int] = []

    async def hold_a_thread_then_stop():
        trainer = await trainer_address(cluster.coordinator)
        for address, call in ((cluster.coordinator, "StartRun"), (trainer, "InitRun")):
            assert (await send(address, call, alias_bomb()))[0] == grpc.StatusCode.INVALID_ARGUMENT
        start_run = asyncio.ensure_future(send(cluster.coordinator, "StartRun", run_config(tiny_model, fifo)))
        deadline = time.monotonic() + ANSWER_S
        while not writers and time.monotonic() < deadline:
            writers.extend(opened for opened in [reader_waits(fifo)] if opened is not None)
            await asyncio.sleep(0.1)
        assert writers, "the coordinator never opened the data file"
        ended = await asyncio.to_thread(stop_all, cluster.processes)
        await start_run  # its call ends with the coordinator
        return ended

    try:
        ended = asyncio.run(hold_a_thread_then_stop())
    finally:
        for writer in writers:
            os.close(writer)
        cluster.stop()
    log = (tmp_path / "state" / "logs" / "coordinator.log").read_text()
    assert ended["coordinator"][0] == OVERDUE_EXIT_CODE, log[-2000:]
    assert ended["coordinator"][1] < COORDINATOR_GRACE_S + RELEASE_S + 20
    [overdue] = [event for event in map(json.loads, log.splitlines()) if event.get("event") == "stop_overdue"]
    assert set(overdue["busy_threads"]) - {"MainThread"}, overdue  # the thread reading the data, at least
    assert ended["trainer"][0] == 0
    assert ended["trainer"][1] < TRAINER_GRACE_S + 20


def stop_all(processes: dict[str, subprocess.Popen]) -> dict[str, tuple[int | None, float]]:
    """SIGTERM each process at once; how each ended (its exit code, None if it did not within 120 s) and after how
    many seconds."""
    sent = time.monotonic()
    for process in processes.values():
        process.send_signal(signal.SIGTERM)
    ended = {}
    for name, process in processes.items():
        try:
            ended[name] = (process.wait(timeout=max(0.1, sent + 120 - time.monotonic())), time.monotonic() - sent)
        except subprocess.TimeoutExpired:
            ended[name] = (None, time.monotonic() - sent)
    return ended
