"""The coordinator's metrics: runs counted by state, a step's gauges, each registered service's heartbeat age."""

from __future__ import annotations

import time
from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.coordinator import telemetry
from services.coordinator.registry import Registry, ServiceRecord
from services.coordinator.store import RunRow


def gauge(name: str, **labels: str) -> float:
    return next(sample.value for metric in (telemetry.RUNS, telemetry.RUN_STEP, telemetry.STEP_SECONDS, telemetry.REWARD)
                for family in metric.collect() for sample in family.samples
                if sample.name == name and sample.labels == labels)


def row(run_id: str, state: str) -> RunRow:
    return RunRow(run_id=run_id, name="name", state=state, config_yaml="", run_dir="", step=0, total_steps=10,
                  error="", created_at=0.0)


def test_runs_are_counted_by_state_and_a_state_none_is_in_reads_zero():
    telemetry.count_runs([row("a", "running"), row("b", "finished"), row("c", "finished")])
    assert gauge("meshrl_coordinator_runs", state="running") == 1
    assert gauge("meshrl_coordinator_runs", state="finished") == 2
    assert gauge("meshrl_coordinator_runs", state="waiting") == 0
    telemetry.count_runs([row("a", "stopped"), row("b", "finished"), row("c", "finished")])
    assert gauge("meshrl_coordinator_runs", state="running") == 0


def test_a_step_sets_the_runs_step_time_and_reward_and_leaves_what_it_lacks():
    telemetry.step_done("run-1", 3, {"timing_s/step": 0.5, "critic/score/mean": 0.25})
    telemetry.step_done("run-1", 4, {"timing_s/step": 0.75})
    assert gauge("meshrl_coordinator_run_step", run_id="run-1") == 4
    assert gauge("meshrl_coordinator_step_seconds", run_id="run-1") == 0.75
    assert gauge("meshrl_coordinator_reward_mean", run_id="run-1") == 0.25


def test_each_registered_service_has_its_heartbeat_age():
    registry = Registry(heartbeat_interval_s=1.0, misses=5)
    record = ServiceRecord(service_id="rollout-a", kind="rollout", address="h:1", group="default", protocol_version=1,
                           last_seen=0.0)
    registry.register(record)
    registry.register(replace(record, service_id="reward-b", kind="reward", address="h:2"))
    registry._records["reward-b"] = replace(registry._records["reward-b"], last_seen=time.monotonic() - 30)
    collectors = CollectorRegistry()
    collectors.register(telemetry.HeartbeatAges(registry))
    [family] = text_string_to_metric_families(generate_latest(collectors).decode())
    ages = {sample.labels["service_id"]: sample.value for sample in family.samples}
    assert ages["rollout-a"] < 5 and 30 <= ages["reward-b"] < 35
    assert {sample.labels["kind"] for sample in family.samples} == {"rollout", "reward"}
