"""The coordinator's Prometheus metrics (besides every service's: ``services/common/telemetry.py``): its runs by
state, each run's step, step time and training reward, and how long ago each registered service last
heartbeat."""

from __future__ import annotations

import time
from collections import Counter

from prometheus_client import REGISTRY, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.coordinator.registry import Registry
from services.coordinator.store import RunRow

STATES = ("pending", "running", "waiting", "finished", "stopped", "failed", "interrupted")
RUNS = Gauge("meshrl_coordinator_runs", "Runs in the run DB, by state", ["state"])
RUN_STEP = Gauge("meshrl_coordinator_run_step", "The last step a run finished", ["run_id"])
STEP_SECONDS = Gauge("meshrl_coordinator_step_seconds", "Wall time of a run's last step (timing_s/step)",
                     ["run_id"])
REWARD = Gauge("meshrl_coordinator_reward_mean", "Mean training reward of a run's last step (critic/score/mean)",
               ["run_id"])


def count_runs(rows: list[RunRow]) -> None:
    """Set RUNS from every run in the run DB (a state no run is in: 0)."""
    counts = Counter(row.state for row in rows)
    for state in sorted({*STATES, *counts}):
        RUNS.labels(state).set(counts[state])


def step_done(run_id: str, step: int, metrics: dict[str, float]) -> None:
    RUN_STEP.labels(run_id).set(step)
    for gauge, key in ((STEP_SECONDS, "timing_s/step"), (REWARD, "critic/score/mean")):
        if key in metrics:
            gauge.labels(run_id).set(metrics[key])


class HeartbeatAges(Collector):
    """``meshrl_coordinator_heartbeat_age_seconds{service_id, kind, group, address}``, read at each scrape."""

    def __init__(self, registry: Registry):
        self.registry = registry

    def collect(self):
        family = GaugeMetricFamily("meshrl_coordinator_heartbeat_age_seconds", "Seconds since each registered "
                                   "service's last Register or Heartbeat", labels=["service_id", "kind", "group",
                                                                                    "address"])
        now = time.monotonic()
        for record in self.registry.all():
            family.add_metric([record.service_id, record.kind, record.group, record.address], now - record.last_seen)
        yield family


def watch(registry: Registry, rows: list[RunRow]) -> None:
    """Export the registry's heartbeats and the runs in ``rows`` (the run DB's at start)."""
    REGISTRY.register(HeartbeatAges(registry))
    count_runs(rows)
