"""The coordinator servicer: wire <-> registry and runs, nothing else."""

from __future__ import annotations

import time
from pathlib import Path

from meshrl.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from services.algo_registry import ADV_ESTIMATORS
from services.common.plugins import import_modules
from services.common.service import PROTOCOL_VERSION
from services.coordinator import telemetry
from services.coordinator.config import CoordinatorServiceConfig
from services.coordinator.registry import Registry, ServiceRecord
from services.coordinator.runs.manager import RunManager
from services.coordinator.store import Event, RunRow, RunStore


def run_to_pb(row: RunRow, metrics: dict[str, float], last_event_id: int) -> coordinator_pb2.RunInfo:
    return coordinator_pb2.RunInfo(
        run_id=row.run_id, name=row.name, state=row.state, step=row.step, total_steps=row.total_steps,
        run_dir=row.run_dir, error=row.error, created_at=row.created_at, metrics=metrics, last_event_id=last_event_id,
    )


def event_to_pb(event: Event) -> coordinator_pb2.RunEvent:
    return coordinator_pb2.RunEvent(
        run_id=event.run_id, kind=event.kind, step=event.step, state=event.state, metrics=event.metrics,
        message=event.message, time=event.time,
    )


def optional_version(message: coordinator_pb2.RegisterRequest | coordinator_pb2.HeartbeatRequest) -> int | None:
    """The message's weight_version, None where it was not sent."""
    return message.weight_version if message.HasField("weight_version") else None


def record_from_pb(request: coordinator_pb2.RegisterRequest) -> ServiceRecord:
    identity = request.identity
    if identity.kind not in ("rollout", "trainer", "reward", "env"):
        raise ValueError(f"identity.kind must be rollout, trainer, reward or env, got {identity.kind!r}")
    if not identity.service_id or ":" not in identity.address:
        raise ValueError("identity needs a service_id and an address host:port")
    if identity.protocol_version != PROTOCOL_VERSION:
        raise ValueError(f"protocol_version {identity.protocol_version} is not {PROTOCOL_VERSION}, which this "
                         f"coordinator speaks")
    return ServiceRecord(service_id=identity.service_id, kind=identity.kind, address=identity.address,
                         group=identity.group or "default", protocol_version=identity.protocol_version,
                         last_seen=0.0, hostname=identity.hostname, pid=identity.pid,
                         meshrl_version=identity.meshrl_version, gpu=identity.gpu,
                         weight_version=optional_version(request), limits=dict(identity.limits),
                         policy_losses=tuple(identity.policy_losses))


def status_to_pb(record: ServiceRecord, up: bool, now: float) -> coordinator_pb2.ServiceStatus:
    identity = common_pb2.ServiceIdentity(
        service_id=record.service_id, kind=record.kind, address=record.address, group=record.group,
        protocol_version=record.protocol_version, pid=record.pid, hostname=record.hostname,
        meshrl_version=record.meshrl_version, gpu=record.gpu, limits=record.limits,
        policy_losses=record.policy_losses)
    return coordinator_pb2.ServiceStatus(identity=identity, state="up" if up else "down",
                                         last_seen_s=now - record.last_seen, weight_version=record.weight_version)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorServiceConfig):
        state_dir = Path(config.state_dir)
        self.registry = Registry(config.heartbeat_interval_s, config.heartbeat_misses)
        self.store = RunStore(state_dir / "meshrl.db")
        self.runs = RunManager(self.store, self.registry, state_dir)
        telemetry.watch(self.registry, self.store.list_runs())

    async def Register(self, request, context):
        self.registry.register(record_from_pb(request))
        return coordinator_pb2.RegisterResponse(heartbeat_interval_s=self.registry.heartbeat_interval_s)

    async def Heartbeat(self, request, context):
        return coordinator_pb2.HeartbeatResponse(
            known=self.registry.heartbeat(request.service_id, optional_version(request)))

    async def Deregister(self, request, context):
        self.registry.deregister(request.service_id)
        return coordinator_pb2.HeartbeatResponse(known=False)

    async def ListServices(self, request, context):
        now = time.monotonic()
        return coordinator_pb2.ListServicesResponse(services=[
            status_to_pb(record, self.registry.is_up(record), now) for record in self.registry.all()],
            adv_estimators=ADV_ESTIMATORS.names())

    async def StartRun(self, request, context):
        return self._info(*await self.runs.start_run(request.config_yaml))

    async def GetRun(self, request, context):
        return self._info(self.runs.get_run(request.run_id))

    async def ListRuns(self, request, context):
        return coordinator_pb2.ListRunsResponse(runs=[self._info(row) for row in self.runs.list_runs()])

    async def StopRun(self, request, context):
        return self._info(self.runs.stop_run(request.run_id))

    async def ResumeRun(self, request, context):
        return self._info(*await self.runs.resume_run(request.run_id))

    async def SetReward(self, request, context):
        return self._info(await self.runs.set_reward(request.run_id, request.group, request.address))

    async def SetEnv(self, request, context):
        return self._info(await self.runs.set_env(request.run_id, request.group, request.address))

    async def WatchRun(self, request, context):
        async for event in self.runs.watch(request.run_id, request.after_event_id):
            yield event_to_pb(event)

    def _info(self, row: RunRow, event_mark: int | None = None) -> coordinator_pb2.RunInfo:
        """``event_mark``: the last event before the call that returns this (StartRun, ResumeRun); else the last
        event now."""
        mark = self.store.last_event_id(row.run_id) if event_mark is None else event_mark
        return run_to_pb(row, self.store.last_step_metrics(row.run_id), mark)

    def weight_version(self) -> None:
        return None  # the coordinator neither holds weights nor heartbeats

    async def close(self) -> None:
        await self.runs.close()
        self.store.close()


def attach(server, config: CoordinatorServiceConfig, identity: common_pb2.ServiceIdentity) -> CoordinatorServicer:
    """The coordinator's servicer, offering the built-in advantage estimators and those its adv_estimator_modules
    register."""
    ADV_ESTIMATORS.load_builtins()  # first: a user's module reusing a built-in's name is the one refused
    import_modules(config.adv_estimator_modules, "adv_estimator_modules")
    servicer = CoordinatorServicer(config)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    return servicer
