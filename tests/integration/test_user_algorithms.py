"""A user's advantage estimator and policy loss, from examples/plugins/, loaded as docs/guides/custom-algorithms.md
says (the coordinator's adv_estimator_modules, the trainer's policy_loss_modules), drive a run of real processes
end to end; names no service registered are refused before anything starts; coordctl services lists them; and
remax runs with its greedy baselines."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_cli import coordctl
from tests.integration.test_grpo_run import run_config, run_to_end

PLUGINS = Path(__file__).resolve().parents[2] / "examples" / "plugins"
ESTIMATOR, LOSS = PLUGINS / "range_norm_estimator.py", PLUGINS / "trust_region_pg_loss.py"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Coordinator (with the example estimator), trainer (with the example loss), rollout and reward."""
    services = (ServiceSpec(kind="trainer", settings=(f"policy_loss_modules=[{LOSS}]",)), ServiceSpec(kind="rollout"),
                ServiceSpec(kind="reward"))
    local = LocalCluster(tmp_path_factory.mktemp("cluster") / "state", services,
                         coordinator_settings=(f"adv_estimator_modules=[{ESTIMATOR}]",))
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()


def test_coordctl_services_lists_the_users_algorithms_beside_the_built_ins(cluster):
    listed = coordctl("services", "--coordinator", cluster.coordinator)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.partition("\n\n")[2].splitlines()
    estimators = lines[0].partition(": ")[2].split(", ")
    losses = [line.partition(": ")[2].split(", ") for line in lines if line.startswith("policy losses (trainer")]
    assert {"grpo", "opo", "gpg", "grpo_passk", "remax", "range_norm"} <= set(estimators)
    assert losses == [["vanilla", "gspo", "cispo", "geo_mean", "clip_cov", "kl_cov", "gpg", "trust_region_pg"]]


@pytest.mark.parametrize(("key", "name", "listed"), [
    ("algorithm__adv_estimator", "no_such_estimator", "range_norm"),
    ("actor_rollout_ref__actor__policy_loss__loss_mode", "no_such_loss", "trust_region_pg"),
])
def test_a_name_no_service_registered_is_refused_listing_those_that_are(cluster, tiny_model, reverse_data, key, name,
                                                                       listed):
    async def start():
        client = CoordinatorClient(cluster.coordinator)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.start_run(run_config(tiny_model, reverse_data, **{key: name}))
            return refused.value, await client.list_runs()
        finally:
            await client.close()

    refused, runs = asyncio.run(start())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert repr(name) in refused.details() and listed in refused.details()
    assert runs == []  # nothing started


def test_the_users_estimator_and_loss_drive_a_run(cluster, tiny_model, reverse_data):
    final, updates, _ = asyncio.run(run_to_end(cluster.coordinator, run_config(
        tiny_model, reverse_data, algorithm__adv_estimator="range_norm",
        actor_rollout_ref__actor__policy_loss__loss_mode="trust_region_pg", trainer__total_training_steps=3)))
    assert final.state == "finished", final.error
    steps = [u.metrics for u in updates if u.kind == "step"]
    assert len(steps) == 3
    for metrics in steps:  # the estimator's own metric, and the loss's under verl's names
        assert 0 <= metrics["critic/range_norm/groups_with_signal"] <= 8
        assert 0 <= metrics["actor/pg_clipfrac"] <= 1 and "actor/ppo_kl" in metrics
    # advantages in [-1, 1] (range-normalised), nonzero where a group had signal
    assert all(-1.0 <= m["critic/advantages/min"] and m["critic/advantages/max"] <= 1.0 for m in steps)
    assert any(m["critic/range_norm/groups_with_signal"] > 0 and m["critic/advantages/max"] > 0 for m in steps)


def test_remax_generates_and_scores_a_greedy_baseline_each_step(cluster, tiny_model, reverse_data):
    final, updates, _ = asyncio.run(run_to_end(cluster.coordinator, run_config(
        tiny_model, reverse_data, algorithm__adv_estimator="remax",
        actor_rollout_ref__actor__policy_loss__loss_mode="gspo", trainer__total_training_steps=2)))
    assert final.state == "finished", final.error
    steps = [u.metrics for u in updates if u.kind == "step"]
    assert len(steps) == 2 and all(m["timing_s/gen_max"] > 0 for m in steps)
