"""The asynchronous pipeline through the real services: the same GRPO run with trainer.async_.max_staleness
K=1 and K=0 on one cluster, same seed, read back from the run DB. K=1 runs long enough to show learning; K=0,
the synchronous loop it is compared with, only as long as the comparison needs (its first step, and the
rollout's idle share, which stays within a few points from step to step)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

from services.common.config import to_yaml
from services.coordctl.resolve import resolve_config
from services.coordctl.local import LocalCluster
from tests.integration.test_faults import samples
from tests.integration.test_learning import EXAMPLES, assert_learned, run_to_end

STEPS = 40
SYNC_STEPS = 10
SAMPLES = 32 * 8  # the embedded default's batch: 32 prompts x 8 samples


def step_rows(state_dir: Path, run_id: str) -> dict[int, dict[str, float]]:
    with sqlite3.connect(state_dir / "meshrl.db") as db:
        return {step: json.loads(m) for step, m in
                db.execute("SELECT step, metrics_json FROM steps WHERE run_id = ?", (run_id,))}


def test_one_step_off_keeps_staleness_within_one_and_learns(tmp_path, monkeypatch, local_cache):
    monkeypatch.setenv("MESHRL_CACHE", str(local_cache))
    cluster = LocalCluster(tmp_path / "state")
    runs = {}
    try:
        asyncio.run(cluster.start(timeout_s=120))
        for k, steps in ((1, STEPS), (0, SYNC_STEPS)):
            config, _ = resolve_config([str(EXAMPLES / "local_grpo.yaml"), f"trainer.total_training_steps={steps}",
                                        f"trainer.async_.max_staleness={k}", "trainer.val_before_train=false",
                                        "trainer.test_freq=-1"], local=True)  # training alone is compared
            run, _ = asyncio.run(run_to_end(cluster.coordinator, to_yaml(config)))
            assert run.state == "finished", run.error
            runs[k] = step_rows(cluster.state_dir, run.run_id), run.run_dir
    finally:
        cluster.stop()

    (ahead, ahead_dir), (sync, _) = runs[1], runs[0]
    for rows, steps in ((ahead, STEPS), (sync, SYNC_STEPS)):
        assert sorted(rows) == list(range(1, steps + 1))  # every step once
        for step, metrics in rows.items():
            assert samples(metrics, "rollout") == SAMPLES and samples(metrics, "reward") == SAMPLES, step
            assert metrics["training/off_policy/dropped_samples"] == 0, step
    # K=1: no sample ever more than one version older than the weights it trained; and it is really ahead
    assert all(m["training/off_policy/staleness/max"] <= 1 for m in ahead.values())
    assert sum(m["training/off_policy/staleness/max"] == 1 for m in ahead.values()) >= STEPS * 3 // 4
    assert all(m["training/weight_version"] - 1 - m["rollout/weight_version"] <= 1 for m in ahead.values())
    # K=0 is the synchronous loop: every sample from the weights the step trains from
    assert all(m["training/off_policy/staleness/max"] == 0 for m in sync.values())
    # step 1 of both comes from the same weights, prompts and seeds: the same samples and scores; the update
    # differs only by K=1's importance weights, pi_old / pi_rollout = 1 up to the engines' float noise
    for name in ("critic/score/mean", "response_length/mean", "critic/advantages/max", "training/rollout_probs_diff_mean"):
        assert ahead[1][name] == sync[1][name], name
    for name in ("actor/pg_loss", "actor/grad_norm"):
        assert abs(ahead[1][name] - sync[1][name]) <= 1e-4 * abs(sync[1][name]), name
    # the correction is on by itself with staleness, and every run logs the mismatch
    assert all("rollout_corr/rollout_is_mean" in m for m in ahead.values())
    assert not any("rollout_corr/rollout_is_mean" in m for m in sync.values())
    assert all("training/rollout_probs_diff_max" in m and "timing_s/rollout_pause" in m for m in ahead.values())
    idle = {k: sum(m["perf/rollout_idle_fraction"] for m in rows.values()) / len(rows) for k, (rows, _) in runs.items()}
    assert idle[1] < idle[0], idle
    assert_learned([ahead[step]["critic/score/mean"] for step in range(1, STEPS + 1)])
    jsonl = [json.loads(line) for line in (Path(ahead_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in jsonl] == list(range(1, STEPS + 1))
