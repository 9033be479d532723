"""GRPO on a random-init Qwen3-MoE served by vLLM, with several syncs: after the second and later syncs the
rollout's logprobs are the trainer's, as they were before any sync.

What it guards against (services/rollout/vllm_worker.py): experts sent under transformers 5's fused names,
which vLLM's MoE models skip without a word (stale experts), and a second ``load_weights`` writing the
checkpoint's layout over the fused-MoE kernel's (vllm-project/vllm#42821: FlashInfer's CUTLASS kernel, vLLM 0.20's
pick for bf16 on an H100, keeps each expert's up rows before its gate rows).

How far apart is "the same": step 1 generates on the weights both loaded from the folder, so its mismatch is
the two engines' bf16 arithmetic alone (and the experts each routes to, where two are nearly tied); a step after
a sync must stay within ten times that. On the CPU, with this model in fp32 (initializer_range 0.1, chosen so a
wrong layout shows: at 0.02 the logits are too flat), bf16 weights moved the k3 KL of the sampled tokens by 0.09
and mean |delta logprob| by 0.12; each expert's gate and up rows swapped moved them by 109 and 2.3.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import yaml

from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from services.coordctl.tiny_model import build_random_model
from tests.gpu.conftest import cuda_trainer, needs, vllm_rollout
from tests.gpu.test_gpu_grpo import run
from tests.integration.test_grpo_run import logprobs_both_ways

STEPS = 5
# 8 experts of 1024, 2 a token, 4 layers 512 wide (head_dim 64): sizes vLLM's fused-MoE kernels take as they are
MOE_SHAPE = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                 norm_topk_prob=True, vocab_size=2048, initializer_range=0.1, tie_word_embeddings=False,
                 max_position_embeddings=512)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("moe") / "qwen3-moe-random", MOE_SHAPE, "bfloat16", seed=0)


def run_config(model: Path, data: Path) -> str:
    return yaml.safe_dump({
        "data": {"train_files": [str(data)], "train_batch_size": 32, "max_prompt_length": 16,
                 "max_response_length": 32},
        "actor_rollout_ref": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "actor": {"optim": {"lr": 1e-5}, "ppo_mini_batch_size": 32, "ppo_micro_batch_size_per_gpu": 64},
            "rollout": {"name": "vllm", "n": 8},
        },
        "trainer": {"total_training_steps": STEPS, "experiment_name": "gpu-moe"},
    })


def largest_log_ratio(row: dict) -> float:
    """max |log(pi_trainer / pi_rollout)| over the step's tokens, from the importance ratios' extremes."""
    return max(abs(math.log(row["training/rollout_is_ratio/max"])),
               abs(math.log(row["training/rollout_is_ratio/min"])))


@needs(1)
def test_moe_syncs_keep_the_vllm_rollout_on_the_trainers_weights(qwen3_moe, tmp_path):
    """Trainer and a vLLM rollout (no CUDA graphs) on GPU 0, the weights over CUDA IPC."""
    data = write_jsonl(reverse_task_rows(256, 2, 6, seed=3), tmp_path / "reverse.jsonl")
    cluster = LocalCluster(tmp_path / "state", (cuda_trainer(), vllm_rollout(0, 0.3), ServiceSpec(kind="reward")))
    try:
        asyncio.run(cluster.start(timeout_s=180))
        final, version = asyncio.run(run(cluster, run_config(qwen3_moe, data)))
        assert final.state == "finished", final.error
        assert version == STEPS
        addresses = asyncio.run(service_addresses(cluster))
        prompt = [5, 6, 7, 16]
        generated, trainer_logprobs, served = asyncio.run(
            logprobs_both_ways(addresses["rollout"], addresses["trainer"], prompt))
    finally:
        cluster.stop()

    rows = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    print("\nstep  weights  probs_diff mean     max  mismatch_kl  max|dlogprob|")
    for row in rows:
        print(f"{row['step']:>4}  {row['rollout/weight_version']:>7.0f}"
              f"  {row['training/rollout_probs_diff_mean']:>15.2e}  {row['training/rollout_probs_diff_max']:.2e}"
              f"  {row['training/rollout_mismatch_kl']:>11.2e}"
              f"  {largest_log_ratio(row):>13.3f}")
    direct = (generated.logprobs - trainer_logprobs).abs()
    print(f"version {served}, rollout vs trainer on its samples: mean |dlogprob| {direct.mean():.3e}, "
          f"max {direct.max():.3e}")

    assert [int(row["rollout/weight_version"]) for row in rows] == list(range(STEPS))
    engines_alone = rows[0]["training/rollout_mismatch_kl"]  # step 1: no sync yet
    for row in rows[2:]:  # after the second and later syncs
        assert row["training/rollout_mismatch_kl"] <= 10 * engines_alone + 1e-3, row["step"]
    assert served == STEPS and set(generated.weight_versions.tolist()) == {STEPS}
    assert float(direct.mean()) < 0.5  # bf16 alone moved it by 0.12 on the CPU, swapped experts by 2.3


async def service_addresses(cluster: LocalCluster) -> dict[str, str]:
    client = CoordinatorClient(cluster.coordinator)
    try:
        return {s.kind: s.address for s in await client.list_services()}
    finally:
        await client.close()
