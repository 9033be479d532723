"""A client of the coordinator for coordctl and tests: plain values in and out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from grpc_health.v1 import health_pb2, health_pb2_grpc

from meshrl.v1 import coordinator_pb2, coordinator_pb2_grpc
from services.common.rpc import open_channel

TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class RunStatus:
    run_id: str
    name: str
    state: str
    step: int
    total_steps: int
    run_dir: str
    error: str  # why it failed, or (state waiting) what it waits for
    metrics: dict[str, float]
    last_event_id: int  # watch(after_event_id=this) follows on from here (StartRun, ResumeRun: what they began)


@dataclass(frozen=True, kw_only=True)
class RunUpdate:
    kind: str  # step, state or log
    step: int
    state: str
    message: str
    metrics: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class ServiceEntry:
    kind: str
    address: str
    group: str
    state: str
    last_seen_s: float
    service_id: str
    hostname: str = ""
    gpu: str = ""  # "" from a service too old to say
    meshrl_version: str = ""
    weight_version: int | None = None  # None: it holds no weights
    policy_losses: tuple[str, ...] = ()  # a trainer's registered policy losses


def status_from_pb(info: coordinator_pb2.RunInfo) -> RunStatus:
    return RunStatus(run_id=info.run_id, name=info.name, state=info.state, step=info.step,
                     total_steps=info.total_steps, run_dir=info.run_dir, error=info.error, metrics=dict(info.metrics),
                     last_event_id=info.last_event_id)


class CoordinatorClient:
    def __init__(self, address: str):
        self.address = address
        self._channel = open_channel(address)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the coordinator answers its health check as SERVING."""
        health = health_pb2_grpc.HealthStub(self._channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s, wait_for_ready=True)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise ConnectionError(f"coordinator at {self.address} is not serving")

    async def start_run(self, config_yaml: str) -> RunStatus:
        reply = await self._stub.StartRun(coordinator_pb2.StartRunRequest(config_yaml=config_yaml), timeout=TIMEOUT_S)
        return status_from_pb(reply)

    async def get_run(self, run_id: str) -> RunStatus:
        return status_from_pb(await self._stub.GetRun(coordinator_pb2.GetRunRequest(run_id=run_id), timeout=TIMEOUT_S))

    async def list_runs(self) -> list[RunStatus]:
        reply = await self._stub.ListRuns(coordinator_pb2.ListRunsRequest(), timeout=TIMEOUT_S)
        return [status_from_pb(info) for info in reply.runs]

    async def resume_run(self, run_id: str) -> RunStatus:
        return status_from_pb(await self._stub.ResumeRun(coordinator_pb2.GetRunRequest(run_id=run_id),
                                                         timeout=TIMEOUT_S))

    async def stop_run(self, run_id: str) -> RunStatus:
        return status_from_pb(await self._stub.StopRun(coordinator_pb2.GetRunRequest(run_id=run_id), timeout=TIMEOUT_S))

    async def set_reward(self, run_id: str, group: str = "", address: str = "") -> RunStatus:
        request = coordinator_pb2.SetRewardRequest(run_id=run_id, group=group, address=address)
        return status_from_pb(await self._stub.SetReward(request, timeout=TIMEOUT_S))

    async def set_env(self, run_id: str, group: str = "", address: str = "") -> RunStatus:
        request = coordinator_pb2.SetEnvRequest(run_id=run_id, group=group, address=address)
        return status_from_pb(await self._stub.SetEnv(request, timeout=TIMEOUT_S))

    async def watch(self, run_id: str, after_event_id: int = 0) -> AsyncIterator[RunUpdate]:
        """The run's events after ``after_event_id`` (0: all of them), then live ones, until the run ends."""
        request = coordinator_pb2.GetRunRequest(run_id=run_id, after_event_id=after_event_id)
        async for event in self._stub.WatchRun(request):
            yield RunUpdate(kind=event.kind, step=event.step, state=event.state, message=event.message,
                            metrics=dict(event.metrics))

    async def list_services(self) -> list[ServiceEntry]:
        reply = await self._stub.ListServices(coordinator_pb2.ListServicesRequest(), timeout=TIMEOUT_S)
        return [ServiceEntry(kind=s.identity.kind, address=s.identity.address, group=s.identity.group, state=s.state,
                             last_seen_s=s.last_seen_s, service_id=s.identity.service_id,
                             hostname=s.identity.hostname, gpu=s.identity.gpu,
                             meshrl_version=s.identity.meshrl_version,
                             weight_version=s.weight_version if s.HasField("weight_version") else None,
                             policy_losses=tuple(s.identity.policy_losses))
                for s in reply.services]

    async def adv_estimators(self) -> list[str]:
        """The advantage estimators the coordinator has registered."""
        reply = await self._stub.ListServices(coordinator_pb2.ListServicesRequest(), timeout=TIMEOUT_S)
        return list(reply.adv_estimators)

    async def close(self) -> None:
        await self._channel.close()
