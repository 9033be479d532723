"""GRPO on a tiny Qwen3-MoE mixture of experts (built here, random init): the trainer holds it with FSDP2 on the
CPU, the transformers rollout serves it, and after every sync the rollout computes with the trainer's weights,
experts included."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch

from services.coordctl.local import ONE_OF_EACH, ServiceSpec
from services.coordctl.tiny_model import build_tiny_model
from services.coordinator.fleet.weight_probe import MEASURED
from tests.integration.test_grpo_run import logprobs_both_ways, run_config, run_to_end
from tests.integration.test_model_out import transformers_logprobs

STEPS = 5
# |p_rollout - p_trainer| of the same tokens on the same weights, fp32 on one CPU. Measured on this run
# (2026-12-05): max 7e-9 to 1.2e-8 at every step. A rollout left on stale experts (their tensors skipped by the
# hf engine's load_weights, tried once) gave max 8e-5 at step 2 and 1.1e-4 at step 3. The bound sits ~80x above
# the first and ~100x below the second.
PROBS_DIFF_MAX = 1e-6
HF_FP32 = MEASURED[("hf", "float32")]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """4 experts, 2 per token, each 64 wide."""
    return build_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-moe", hidden_size=32, num_layers=2, num_heads=2,
                            seed=0, num_experts=4, experts_per_token=2)


def test_grpo_on_a_mixture_of_experts_syncs_every_expert(make_cluster, moe_model, reverse_data):
    config = json.loads((moe_model / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("qwen3_moe", 4, 2)
    cluster = make_cluster(*ONE_OF_EACH)
    final, _, services = asyncio.run(run_to_end(cluster.coordinator, run_config(
        moe_model, reverse_data, trainer__total_training_steps=STEPS, actor_rollout_ref__actor__strategy="fsdp2",
        actor_rollout_ref__actor__ppo_mini_batch_size=8)))
    assert final.state == "finished", final.error
    assert final.step == STEPS

    # step s generates on the weights of sync s - 1; from step 3 on, after the second and later syncs, the
    # rollout's probabilities of its tokens are the trainer's (the update recomputes them: one mini-batch)
    steps = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [int(step["rollout/weight_version"]) for step in steps] == list(range(STEPS))
    # throughput per device: the trainer and the rollout, one process each on the CPU
    assert all(step["perf/devices"] == 2 for step in steps)
    assert steps[-1]["perf/throughput"] == pytest.approx(
        steps[-1]["perf/total_num_tokens"] / steps[-1]["timing_s/step"] / 2)
    for step in steps[2:]:
        assert step["training/rollout_probs_diff_max"] < PROBS_DIFF_MAX, (step["step"], step)
    check_probe_figures(steps)

    # the rollout serves the last version, its logprobs the trainer's; the weights moved from the initial ones
    # (so a rollout left on stale experts would have shown above)
    address = {s.kind: s.address for s in services}
    prompt = [5, 6, 7, 16]
    generated, trainer_logprobs, version = asyncio.run(
        logprobs_both_ways(address["rollout"], address["trainer"], prompt))
    assert version == STEPS and set(generated.weight_versions.tolist()) == {STEPS}
    assert torch.allclose(generated.logprobs, trainer_logprobs, atol=1e-5, rtol=0)
    response = generated.response_ids[:int(generated.response_lens[0])].tolist()
    initial = transformers_logprobs(moe_model, prompt, response)
    assert (initial - trainer_logprobs[:len(response)]).abs().max() > 1e-3


def test_routing_replay_routes_the_trainer_by_the_rollouts_experts_and_a_corrupt_expert_is_caught(
        make_cluster, moe_model, reverse_data):
    """R3 on (actor.router_replay.mode): every update reports its routers' agreement with the rollout's recorded
    routes, and the rollout's and trainer's probabilities of the sampled tokens stay together; then a rollout
    computing with one expert shifted after the checksums passed is caught by the weight check."""
    steps = 3
    cluster = make_cluster(*ONE_OF_EACH)
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, run_config(
        moe_model, reverse_data, trainer__total_training_steps=steps,
        actor_rollout_ref__actor__router_replay__mode="R3", actor_rollout_ref__actor__ppo_mini_batch_size=8,
        actor_rollout_ref__actor__strategy="fsdp2")))  # the hooks on the routers of a model FSDP2 holds
    assert final.state == "finished", final.error
    rows = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        # one optimizer step a batch, its pass on the weights that sampled (fp32, one CPU): the trainer's routers
        # choose as the rollout's did on (nearly) every token and layer; a flip needs two router logits within
        # rounding of each other
        assert 0.99 <= row["training/routing_agreement"] <= 1.0, row
        assert row["training/rollout_mismatch_kl"] < 1e-6, row
    check_probe_figures(rows)

    corrupt = make_cluster(ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout", settings=(
        "corrupt_weight_after_sync=model.layers.0.mlp.experts.1.up_proj.weight",)), ServiceSpec(kind="reward"))
    final, _, _ = asyncio.run(run_to_end(corrupt.coordinator, run_config(
        moe_model, reverse_data, trainer__total_training_steps=steps,
        actor_rollout_ref__actor__router_replay__mode="R3")))
    assert final.state == "failed"
    assert "no rollout passed the weight check after the sync of version 1" in final.error
    print("\n" + final.error)
    kl = re.search(r"top-k KL mean (\S+), max (\S+)", final.error)
    assert kl and float(kl.group(1)) > HF_FP32.topk_kl, final.error  # the distributions show the expert too


def check_probe_figures(rows: list[dict]) -> None:
    """Every sync's weight probe within the hf fp32 tolerance, its top-k KL too; the figures printed."""
    for row in rows:
        assert row["weights/probe_logprob_diff_mean"] <= HF_FP32.mean, row
        assert -1e-12 <= row["weights/probe_topk_kl_mean"] <= HF_FP32.topk_kl, row
        print(f"step {row['step']}: probe mean |delta logprob| {row['weights/probe_logprob_diff_mean']:.2e}, max "
              f"{row['weights/probe_logprob_diff_max']:.2e}; top-k KL mean {row['weights/probe_topk_kl_mean']:.2e}, "
              f"max {row['weights/probe_topk_kl_max']:.2e}")
