"""CPU tests of services/coordinator/registry.py: services registering, heartbeating, going down."""

from __future__ import annotations

import time

import pytest

from services.coordinator.registry import Registry, ServiceRecord


def record(service_id: str, kind: str = "rollout", address: str = "", group: str = "default") -> ServiceRecord:
    return ServiceRecord(service_id=service_id, kind=kind, address=address or f"host:{service_id}", group=group,
                         protocol_version=1, last_seen=0.0)


def test_register_then_up_and_heartbeat_of_unknown_is_false():
    registry = Registry(heartbeat_interval_s=10, misses=3)
    registry.register(record("r1"))
    (up,) = registry.up("rollout")
    assert up.service_id == "r1" and up.last_seen > 0  # last_seen is set by the registry, not the caller
    assert registry.heartbeat("r1") is True
    assert registry.heartbeat("nobody") is False
    registry.deregister("r1")
    registry.deregister("r1")  # twice is harmless
    assert registry.up("rollout") == [] and registry.heartbeat("r1") is False


def test_service_is_down_after_interval_times_misses_and_back_after_a_heartbeat():
    registry = Registry(heartbeat_interval_s=0.1, misses=3)  # down after 0.3 s
    registry.register(record("r1"))
    registry.register(record("r2"))
    assert registry.down_after_s == pytest.approx(0.3)
    time.sleep(0.2)
    registry.heartbeat("r2")
    assert [r.service_id for r in registry.up("rollout")] == ["r1", "r2"]
    time.sleep(0.2)  # r1 last seen 0.4 s ago, r2 0.2 s ago
    assert [r.service_id for r in registry.up("rollout")] == ["r2"]
    assert len(registry.all()) == 2  # down is not forgotten
    assert registry.heartbeat("r1") is True
    assert [r.service_id for r in registry.up("rollout")] == ["r1", "r2"]
    time.sleep(0.35)
    assert registry.up("rollout") == []


def test_re_register_at_same_address_replaces_the_old_id():
    registry = Registry(heartbeat_interval_s=10, misses=3)
    registry.register(record("old", address="10.0.0.1:5000"))
    registry.register(record("other", address="10.0.0.2:5000"))
    registry.register(record("new", address="10.0.0.1:5000"))  # the service restarted
    assert sorted(r.service_id for r in registry.all()) == ["new", "other"]
    assert registry.heartbeat("old") is False
    registry.register(record("new", address="10.0.0.3:5000"))  # same id, moved: one entry
    assert sorted((r.service_id, r.address) for r in registry.all()) == [("new", "10.0.0.3:5000"),
                                                                         ("other", "10.0.0.2:5000")]


def test_up_filters_kind_and_group_in_a_stable_order():
    registry = Registry(heartbeat_interval_s=10, misses=3)
    for service in [record("b", "rollout", "h:2", "g1"), record("a", "rollout", "h:1", "g2"),
                    record("t", "trainer", "h:3", "g1"), record("c", "rollout", "h:0", "g1")]:
        registry.register(service)
    assert [r.service_id for r in registry.up("rollout")] == ["c", "a", "b"]  # by address
    assert [r.service_id for r in registry.up("rollout", "g1")] == ["c", "b"]
    assert [r.service_id for r in registry.up("trainer", "g2")] == []
    assert [r.service_id for r in registry.up("reward")] == []


def test_the_weight_version_is_the_last_reported_and_none_where_none_was():
    registry = Registry(heartbeat_interval_s=10, misses=3)
    registry.register(record("r1"))
    assert registry.all()[0].weight_version is None
    registry.heartbeat("r1", 0)
    assert registry.all()[0].weight_version == 0
    registry.heartbeat("r1", 3)
    assert registry.all()[0].weight_version == 3
    registry.heartbeat("r1")  # it unloaded its model, or is too old to say
    assert registry.all()[0].weight_version is None


def test_the_wire_keeps_what_a_service_says_about_itself_and_tells_version_0_from_none():
    from meshrl.v1 import common_pb2, coordinator_pb2
    from services.coordinator.server import record_from_pb, status_to_pb

    identity = common_pb2.ServiceIdentity(service_id="r1", kind="rollout", address="node1:7072", group="fast",
                                          protocol_version=1, pid=42, hostname="node1", meshrl_version="0.1.0",
                                          gpu="cuda:1 NVIDIA H200")
    served = record_from_pb(coordinator_pb2.RegisterRequest(identity=identity, weight_version=0))
    assert (served.hostname, served.pid, served.meshrl_version, served.gpu, served.weight_version) == (
        "node1", 42, "0.1.0", "cuda:1 NVIDIA H200", 0)
    assert record_from_pb(coordinator_pb2.RegisterRequest(identity=identity)).weight_version is None
    status = status_to_pb(served, up=True, now=served.last_seen + 1.5)
    assert status.identity == identity and status.state == "up" and status.last_seen_s == 1.5
    assert status.HasField("weight_version") and status.weight_version == 0
    assert not status_to_pb(record("r2"), up=False, now=0.0).HasField("weight_version")


def test_after_the_coordinator_did_not_run_every_service_gets_a_fresh_window():
    registry = Registry(heartbeat_interval_s=0.1, misses=3)  # down after 0.3 s
    registry.register(record("r1"))
    time.sleep(0.4)  # the coordinator stopped (SIGSTOP): no heartbeat could be taken
    assert registry.up("rollout") == []
    registry.woke()
    assert [r.service_id for r in registry.up("rollout")] == ["r1"]
    time.sleep(0.35)  # and still silent a whole window after the coordinator came back: down
    assert registry.up("rollout") == []


def test_env_services_register_and_unknown_kinds_are_refused_naming_the_kinds():
    from meshrl.v1 import common_pb2, coordinator_pb2
    from services.coordinator.server import record_from_pb

    def identity(kind: str) -> common_pb2.ServiceIdentity:
        return common_pb2.ServiceIdentity(service_id="e1", kind=kind, address="node1:7074", protocol_version=1)

    assert record_from_pb(coordinator_pb2.RegisterRequest(identity=identity("env"))).kind == "env"
    with pytest.raises(ValueError, match="rollout, trainer, reward or env, got 'judge'"):
        record_from_pb(coordinator_pb2.RegisterRequest(identity=identity("judge")))
