"""The Prometheus targets of a Slurm job (services/coordctl/local.py, job_targets): one per service that wrote its
ports as deploy/slurm/node.sh has it write them, at its node's address; tests/integration/test_slurm.py scrapes a
real job's."""

from __future__ import annotations

import json

from services.coordctl.local import job_targets, write_targets


def test_each_service_that_serves_metrics_is_a_target_at_its_address_under_its_kinds_job(tmp_path):
    ports = tmp_path / "ports"
    ports.mkdir()
    written = {"coordinator@10.0.0.1": 9001, "trainer@10.0.0.2": 9002, "trainer@10.0.0.3": None,  # rank 0's only
               "rollout@10.0.0.4-gpu0": 9004, "rollout@10.0.0.4-gpu1_2": 9005}
    for name, metrics_port in written.items():
        (ports / f"{name}.json").write_text(json.dumps({"port": 1, "metrics_port": metrics_port}))
    (ports / "reward@10.0.0.1.json.partial").write_text("{")  # still being written: not yet a target
    (ports / "reward.json").write_text(json.dumps({"port": 1, "metrics_port": 9}))  # not a job's: no address
    write_targets(tmp_path / "targets.json", job_targets(ports))
    assert json.loads((tmp_path / "targets.json").read_text()) == [
        {"targets": ["10.0.0.1:9001"], "labels": {"job": "meshrl-coordinator", "service": "coordinator@10.0.0.1"}},
        {"targets": ["10.0.0.4:9004"], "labels": {"job": "meshrl-rollout", "service": "rollout@10.0.0.4-gpu0"}},
        {"targets": ["10.0.0.4:9005"], "labels": {"job": "meshrl-rollout", "service": "rollout@10.0.0.4-gpu1_2"}},
        {"targets": ["10.0.0.2:9002"], "labels": {"job": "meshrl-trainer", "service": "trainer@10.0.0.2"}}]
