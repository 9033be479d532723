"""The service registry: who is up, of which kind and group, at which address; on which host and GPUs, with
which meshrl, serving which weight version."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, kw_only=True)
class ServiceRecord:
    service_id: str
    kind: str
    address: str
    group: str
    protocol_version: int
    last_seen: float  # time.monotonic() of the last Register or Heartbeat
    hostname: str = ""
    pid: int = 0
    meshrl_version: str = ""  # "" from a service too old to say, or not installed as a package
    gpu: str = ""  # "cpu", or its GPUs: "cuda:0 NVIDIA H200"
    weight_version: int | None = None  # of its last Register or Heartbeat; None where it holds no weights
    limits: Mapping[str, int] = field(default_factory=dict)  # what one request may ask of it, by setting
    policy_losses: tuple[str, ...] = ()  # a trainer's registered policy losses (none from one too old to say)


class Registry:
    def __init__(self, heartbeat_interval_s: float, misses: int):
        self.heartbeat_interval_s = heartbeat_interval_s
        self.down_after_s = heartbeat_interval_s * misses
        self._records: dict[str, ServiceRecord] = {}
        self._awake_since = 0.0  # time.monotonic() when this process last came back from not running

    def woke(self) -> None:
        """This process did not run for a while (SIGSTOP, a starved machine): the heartbeats sent meanwhile could
        not be taken, so every service gets a fresh window of down_after_s from now to be seen again."""
        self._awake_since = time.monotonic()

    def register(self, record: ServiceRecord) -> None:
        """Add or refresh a service; an older entry at the same address is replaced (a restart)."""
        for service_id, old in list(self._records.items()):
            if old.address == record.address and service_id != record.service_id:
                del self._records[service_id]
        self._records[record.service_id] = replace(record, last_seen=time.monotonic())

    def heartbeat(self, service_id: str, weight_version: int | None = None) -> bool:
        """Refresh a service's last-seen time and the weight version it reports; False if it is unknown (it must
        register again)."""
        record = self._records.get(service_id)
        if record is None:
            return False
        self._records[service_id] = replace(record, last_seen=time.monotonic(), weight_version=weight_version)
        return True

    def deregister(self, service_id: str) -> None:
        self._records.pop(service_id, None)

    def is_up(self, record: ServiceRecord) -> bool:
        return time.monotonic() - max(record.last_seen, self._awake_since) < self.down_after_s

    def all(self) -> list[ServiceRecord]:
        return sorted(self._records.values(), key=lambda r: (r.kind, r.address))

    def up(self, kind: str, group: str | None = None) -> list[ServiceRecord]:
        """Services of ``kind`` (and ``group``) that are up now, in a stable order."""
        return [r for r in self.all() if r.kind == kind and (group is None or r.group == group) and self.is_up(r)]
