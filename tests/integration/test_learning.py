"""The local examples learn the synthetic task through the real services (a small step budget).

One cluster serves both runs at once, as long-running services serve several runs placed on their own groups:
PPO with GAE (its critic placed on a second trainer service, a KL loss against the reference on the first) and
GRPO on a trainer and rollout of group grpo, which also writes W&B (offline), and whose TensorBoard and W&B files
are read back with their own readers. Both score on the one reward service.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from services.common.config import to_yaml
from services.coordctl.resolve import resolve_config
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_grpo_run import logged
from tests.logger_files import tensorboard_scalars, wandb_history

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 40


@pytest.fixture
def cluster_for_both_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the coordinator's W&B writes its run folder only
    services = (ServiceSpec(kind="trainer"), ServiceSpec(kind="trainer", group="critics"), ServiceSpec(kind="rollout"),
                ServiceSpec(kind="reward"), ServiceSpec(kind="trainer", group="grpo"), ServiceSpec(kind="rollout",
                                                                                                   group="grpo"))
    local = LocalCluster(tmp_path / "state", services)
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()


async def run_to_end(coordinator: str, config_yaml: str):
    client = CoordinatorClient(coordinator)
    try:
        run = await client.start_run(config_yaml)
        async for _ in client.watch(run.run_id):
            pass
        return await client.get_run(run.run_id), await client.list_services()
    finally:
        await client.close()


def rewards(run_dir: str) -> list[float]:
    """The mean reward of each step (the lines of validations, which the local default runs too, left out)."""
    lines = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [line["critic/score/mean"] for line in lines if "critic/score/mean" in line]


def metrics_by_name(run_dir: str) -> dict[str, dict[int, float]]:
    """metrics.jsonl as name -> step -> value."""
    by_name: dict[str, dict[int, float]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for name, value in row.items():
            if name not in ("step", "time"):
                by_name.setdefault(name, {})[row["step"]] = value
    return by_name


def assert_loggers_hold(run_dir: str) -> None:
    """TensorBoard's event files and W&B's offline run hold every metric of every step that metrics.jsonl does."""
    written = metrics_by_name(run_dir)
    assert {"critic/score/mean", "actor/pg_loss", "timing_s/gen", "val-core/meshrl/reverse/acc/mean@1"} <= set(written)
    scalars = tensorboard_scalars(Path(run_dir) / "tensorboard")
    assert set(scalars) == set(written)
    for name, steps in written.items():
        assert scalars[name] == pytest.approx(steps, rel=1e-6, nan_ok=True), name  # float32 in the event files
    history = wandb_history(Path(run_dir))
    assert set(history) == {step for steps in written.values() for step in steps}
    for name, steps in written.items():
        assert {step: history[step][name] for step in steps} == pytest.approx(steps, nan_ok=True), name


def assert_learned(scores: list[float]) -> None:
    first, last = sum(scores[:5]) / 5, sum(scores[-10:]) / 10
    assert last > first + 0.1 and last > 0.75, f"reward did not rise clearly: {first:.3f} -> {last:.3f}"


def test_ppo_with_gae_and_grpo_learn(cluster_for_both_runs, monkeypatch, local_cache):
    monkeypatch.setenv("MESHRL_CACHE", str(local_cache))
    cluster = cluster_for_both_runs
    ppo, _ = resolve_config([str(EXAMPLES / "local_ppo.yaml"), f"trainer.total_training_steps={STEPS}",
                          "placement.critic=critics", "actor_rollout_ref.actor.use_kl_loss=true"], local=True)
    grpo, _ = resolve_config([str(EXAMPLES / "local_grpo.yaml"), f"trainer.total_training_steps={STEPS}",
                              "trainer.logger=[console,tensorboard,wandb]", "placement.actor=grpo",
                              "placement.rollout=grpo"], local=True)

    async def both():
        return await asyncio.gather(run_to_end(cluster.coordinator, to_yaml(ppo)),
                                    run_to_end(cluster.coordinator, to_yaml(grpo)))

    (ppo_run, services), (grpo_run, _) = asyncio.run(both())
    assert ppo_run.state == "finished", ppo_run.error
    assert_learned(rewards(ppo_run.run_dir))
    assert grpo_run.state == "finished", grpo_run.error
    assert_learned(rewards(grpo_run.run_dir))
    assert_loggers_hold(grpo_run.run_dir)

    db = sqlite3.connect(cluster.state_dir / "meshrl.db")
    (ppo_metrics,) = db.execute("SELECT metrics_json FROM steps WHERE run_id = ? AND step = ?",
                                (ppo_run.run_id, STEPS)).fetchone()
    names = set(json.loads(ppo_metrics))
    assert {"critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/values/mean",
            "critic/returns/mean", "critic/advantages/mean", "actor/kl_loss", "actor/pg_clipfrac_lower",
            "timing_s/values", "timing_s/ref", "timing_s/update_critic", "timing_s/old_log_prob"} <= names
    trainers = {s.group: s for s in services if s.kind == "trainer"}
    assert set(trainers) == {"default", "critics", "grpo"}
    critic_log = (cluster.log_dir / "trainer-1.log").read_text()  # the second trainer, group critics
    assert critic_log.count('"critic_updated"') == STEPS and '"actor_updated"' not in critic_log
    for name, run in (("trainer-0", ppo_run), ("trainer-4", grpo_run)):  # each run's actor on its own group's
        assert {e["run_id"] for e in logged(cluster, name) if e["event"] == "actor_updated"} == {run.run_id}, name
    (grpo_metrics,) = db.execute("SELECT metrics_json FROM steps WHERE run_id = ? AND step = ?",
                                 (grpo_run.run_id, STEPS)).fetchone()
    assert "critic/vf_loss" not in json.loads(grpo_metrics)
