"""The weight check after every sync on vLLM in bf16 (issue 30, point 1), on one GPU: a vLLM rollout given wrong
weights (one tensor shifted after each sync, once the bytes arrived and passed their checksums: the rollout
service's corrupt_weight_after_sync) is caught, sent the weights again, then dropped, while an honest vLLM rollout
beside it passes every check; and a colocated run (the rollout asleep while the trainer works) passes every check.
Each prints the measured bf16 figures (the honest rollout's mean and max |delta logprob| per sync, the wrong one's)
and what the check cost beside the step: the figures the default tolerance of vLLM bf16
(services/coordinator/fleet/weight_probe.py, MEASURED) is to be set from."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path


from bench.faults import service_address
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from services.coordinator.fleet.weight_probe import MEASURED
from tests.gpu.conftest import cuda_trainer, needs, vllm_rollout
from tests.gpu.test_gpu_grpo import run_config
from tests.integration.test_weight_probe import run_with_messages

VLLM_BF16 = MEASURED[("vllm", "bfloat16")]
# a middle layer's MLP output: shifted by 0.5 against weights of about 0.02, it changes every later hidden state
CORRUPTED = "model.layers.12.mlp.down_proj.weight"


def probe_events(cluster: LocalCluster) -> list[dict]:
    lines = (cluster.log_dir / "coordinator.log").read_text(errors="replace").splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return [event for event in events if event["event"] == "weight_probe"]


def print_figures(cluster: LocalCluster, run_dir: str) -> list[dict]:
    """Every check's figures, by rollout, and each step's probe seconds beside its step's: returns the step rows."""
    print(f"\nvLLM bf16 weight probe (tolerance mean {VLLM_BF16.mean}, max {VLLM_BF16.max}):")
    for event in probe_events(cluster):
        print(f"  version {event['version']:>3}  {event['address']:<22} mean |delta logprob| {event['diff_mean']:.3e}  "
              f"max {event['diff_max']:.3e}  passed {event['passed']}  {event['error']}")
    metrics = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if "timing_s/step" in r]
    for r in rows:
        print(f"  step {r['step']}: weights/probe_logprob_diff_mean {r.get('weights/probe_logprob_diff_mean', -1):.3e}"
              f" max {r.get('weights/probe_logprob_diff_max', -1):.3e}; timing_s/weight_probe "
              f"{r.get('timing_s/weight_probe', -1):.4f} of step {r['timing_s/step']:.3f} s "
              f"({100 * r.get('timing_s/weight_probe', 0) / r['timing_s/step']:.2f} %)")
    return rows


@needs(1)
def test_a_vllm_rollout_with_wrong_weights_is_caught_resynced_and_dropped_beside_an_honest_one(qwen_05b, tmp_path):
    data = write_jsonl(reverse_task_rows(256, 2, 6, seed=3), tmp_path / "reverse.jsonl")
    cluster = LocalCluster(tmp_path / "state", (
        cuda_trainer(),
        vllm_rollout(0, 0.25),
        vllm_rollout(0, 0.25, f"corrupt_weight_after_sync={CORRUPTED}"),
        ServiceSpec(kind="reward"),
    ))
    try:
        asyncio.run(cluster.start(timeout_s=240))
        honest, wrong = service_address(cluster, "rollout-1"), service_address(cluster, "rollout-2")
        final, messages = asyncio.run(run_with_messages(cluster.coordinator, run_config(qwen_05b, data, steps=3,
                                                                           free_cache_engine=False)))
        rows = print_figures(cluster, final.run_dir) if final.run_dir else []
    finally:
        cluster.stop()
    for message in messages:
        if "weight check" in message:
            print("  " + message)
    assert final.state == "finished", final.error
    left = next(m for m in messages if m.startswith(f"rollout {wrong} left the run"))
    figures = re.search(r"its weight probe of version (\d+): mean \|delta logprob\| (\S+), max (\S+); tolerance", left)
    assert figures, left
    assert float(figures.group(2)) > VLLM_BF16.mean or float(figures.group(3)) > VLLM_BF16.max
    assert not any(m.startswith(f"rollout {honest} left") for m in messages)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the honest rollout's figures, within the tolerance
        assert r["weights/probe_logprob_diff_mean"] <= VLLM_BF16.mean
        assert r["weights/probe_logprob_diff_max"] <= VLLM_BF16.max


@needs(1)
def test_a_colocated_vllm_rollout_passes_the_check_after_every_sync(qwen_05b, tmp_path):
    """Asleep while the trainer works: the check runs once the rollout is awake for the sync (no extra sleep or
    wake-up); the printed seconds are what it costs there."""
    data = write_jsonl(reverse_task_rows(256, 2, 6, seed=3), tmp_path / "reverse.jsonl")
    cluster = LocalCluster(tmp_path / "state", (cuda_trainer(), vllm_rollout(0, 0.3, "enable_sleep_mode=true"),
                                                ServiceSpec(kind="reward")))
    try:
        asyncio.run(cluster.start(timeout_s=240))
        final, messages = asyncio.run(run_with_messages(cluster.coordinator, run_config(qwen_05b, data, steps=4,
                                                                           free_cache_engine=True)))
        rows = print_figures(cluster, final.run_dir) if final.run_dir else []
    finally:
        cluster.stop()
    assert final.state == "finished", final.error
    assert not any("weight check" in m for m in messages)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["weights/probe_logprob_diff_mean"] <= VLLM_BF16.mean
        assert r["weights/probe_logprob_diff_max"] <= VLLM_BF16.max
        assert r["timing_s/weight_probe"] > 0
