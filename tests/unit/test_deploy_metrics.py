"""deploy/prometheus and deploy/grafana against what the services export: the scrape config has a job per service
kind, each at a port the systemd units give that kind's /metrics; the dashboard is valid JSON whose every metric
exists, with the panels an operator looks for, and whose every query Prometheus parses."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from prometheus_client import REGISTRY

from services.common.config import load_config
from services.common.telemetry import WeightVersion
from services.coordinator import telemetry as coordinator_telemetry
from services.coordinator.registry import Registry
from services.reward import telemetry as reward_telemetry  # noqa: F401 - registers the reward's metrics
from services.rollout import telemetry as rollout_telemetry  # noqa: F401 - registers the rollout's metrics
from services.trainer import telemetry as trainer_telemetry
from tests.unit.test_deploy import CONFIG_DIR, MODELS, SERVICES, UNIT_DIR, exec_start

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "meshrl.json"
SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}


def exported_names() -> set[str]:
    """Every sample name a service of any kind exports: the registry a service process fills by importing its
    telemetry, and the collectors each registers when it starts."""
    collectors = [REGISTRY, WeightVersion(lambda: 1), coordinator_telemetry.HeartbeatAges(Registry(1.0, 5)),
                  trainer_telemetry.Memory(torch.device("cpu"))]
    return {family.name + suffix for collector in collectors for family in collector.collect()
            for suffix in SAMPLE_SUFFIXES.get(family.type, ("",))}


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]


def metric_names(query: str) -> set[str]:
    return set(re.findall(r"\b(?:meshrl|process)_\w+", query))


def metrics_ports() -> dict[str, set[int]]:
    """Each kind's /metrics ports under systemd (a GPU rollout's for GPUs 0 to 9)."""
    ports: dict[str, set[int]] = {}
    for name in SERVICES:
        for gpu in range(10) if "@" in name else [0]:
            command = exec_start(name, gpu)
            kind = command[command.index("-m") + 1].removeprefix("services.")
            config_at = command.index("--config") + 1
            source = UNIT_DIR / command[config_at].removeprefix(CONFIG_DIR)
            ports.setdefault(kind, set()).add(load_config(MODELS[kind], source, command[config_at + 1:]).metrics_port)
    return ports


def test_every_metric_of_the_dashboard_is_exported_and_its_panels_are_there():
    queries = dashboard_queries()
    used = set().union(*map(metric_names, queries))
    assert used and used <= exported_names(), used - exported_names()
    assert all(metric_names(query) for query in queries)
    assert {"meshrl_coordinator_run_step", "meshrl_coordinator_step_seconds", "meshrl_coordinator_reward_mean",
            "meshrl_rollout_generated_tokens_total", "meshrl_rpc_duration_seconds_count",
            "meshrl_coordinator_heartbeat_age_seconds"} <= used


def test_the_scrape_config_has_a_job_per_kind_at_the_ports_the_units_serve_metrics_on():
    jobs = {job["job_name"]: [target for group in job["static_configs"] for target in group["targets"]]
            for job in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]}
    ports = metrics_ports()
    assert set(jobs) == {f"meshrl-{kind}" for kind in MODELS}
    for kind, served in ports.items():
        assert None not in served, f"a {kind} unit serves no /metrics"
        assert {int(target.rpartition(":")[2]) for target in jobs[f"meshrl-{kind}"]} <= served, kind


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
def test_prometheus_parses_every_query_of_the_dashboard(tmp_path):
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query{index}", "expr": query.replace("$__rate_interval", "1m")}
        for index, query in enumerate(dashboard_queries())]}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    checked = subprocess.run(["promtool", "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
