"""The weight check after every sync on real services: a rollout that computes with weights other than the
trainer's (one tensor shifted after the bytes arrived and passed their checksums: the rollout service's
corrupt_weight_after_sync) is caught, sent the weights again, then dropped with an event naming the version, its
probe's mean and max |delta logprob| and top-k KL and the tolerance, while the run goes on with an honest one; an honest run,
LoRA and generating a step ahead, passes every check with its figures in the step's metrics."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3

import grpc
import pytest
import torch

from bench.faults import service_address
from services.common.sequences import SequenceBatch
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import ServiceSpec
from services.coordinator.fleet.clients import RolloutClient
from services.coordinator.fleet.weight_probe import MEASURED
from tests.integration.test_grpo_run import run_config

HF_FP32 = MEASURED[("hf", "float32")]


async def run_with_messages(coordinator: str, config_yaml: str):
    client = CoordinatorClient(coordinator)
    try:
        started = await client.start_run(config_yaml)
        messages = [update.message async for update in client.watch(started.run_id) if update.message]
        return await client.get_run(started.run_id), messages
    finally:
        await client.close()


def step_metrics(state_dir, run_id: str) -> dict[int, dict[str, float]]:
    with sqlite3.connect(state_dir / "meshrl.db") as db:
        return {step: json.loads(m) for step, m in
                db.execute("SELECT step, metrics_json FROM steps WHERE run_id = ?", (run_id,))}


def check_passed_every_sync(rows: dict[int, dict[str, float]]) -> None:
    """Every step's sync passed the check (its figures within the hf fp32 tolerance) and timed it."""
    for step, metrics in rows.items():
        assert 0 <= metrics["weights/probe_logprob_diff_mean"] <= HF_FP32.mean, (step, metrics)
        assert 0 <= metrics["weights/probe_logprob_diff_max"] <= HF_FP32.max, (step, metrics)
        assert -1e-12 <= metrics["weights/probe_topk_kl_mean"] <= HF_FP32.topk_kl, (step, metrics)
        assert metrics["weights/probe_topk_kl_max"] >= metrics["weights/probe_topk_kl_mean"], (step, metrics)
        print(f"step {step}: probe mean |delta logprob| {metrics['weights/probe_logprob_diff_mean']:.2e}, max "
              f"{metrics['weights/probe_logprob_diff_max']:.2e}; top-k KL mean "
              f"{metrics['weights/probe_topk_kl_mean']:.2e}, max {metrics['weights/probe_topk_kl_max']:.2e}")
        assert 0 < metrics["timing_s/weight_probe"] < metrics["timing_s/update_weights"], (step, metrics)


def test_a_rollout_computing_with_wrong_weights_is_caught_sent_them_again_then_dropped(
        make_cluster, tiny_model, reverse_data):
    steps = 4
    cluster = make_cluster(ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"),
                           ServiceSpec(kind="rollout", settings=("corrupt_weight_after_sync=model.norm.weight",)),
                           ServiceSpec(kind="reward"))
    honest, wrong = service_address(cluster, "rollout-1"), service_address(cluster, "rollout-2")
    final, messages = asyncio.run(run_with_messages(cluster.coordinator, run_config(
        tiny_model, reverse_data, trainer__total_training_steps=steps)))
    assert final.state == "finished", final.error

    # caught after the first sync with the probe (step 1's, version 1), sent version 1 again, caught again, dropped
    caught = [m for m in messages if "failed the weight check after" in m]
    assert caught[0].startswith(f"rollout {wrong} failed the weight check after the sync of version 1 (its weight "
                                "probe of version 1: mean |delta logprob| ")
    assert caught[0].endswith("sending version 1 again")
    left = next(m for m in messages if m.startswith(f"rollout {wrong} left the run"))
    figures = re.search(r"it failed the weight check twice; its weight probe of version 1: mean \|delta logprob\| "
                        r"(\S+), max (\S+); tolerance (\S+) mean, (\S+) max; top-k KL mean (\S+), max (\S+); "
                        r"tolerance (\S+) mean\)", left)
    assert figures, left
    mean, largest, tolerance_mean, tolerance_max, kl_mean, kl_max, tolerance_kl = map(float, figures.groups())
    assert (tolerance_mean, tolerance_max, tolerance_kl) == HF_FP32
    assert mean > tolerance_mean and largest > tolerance_max and largest >= mean
    assert kl_mean > tolerance_kl and kl_max >= kl_mean  # the distributions show it too
    assert len(caught) == 1 and f"its work goes to {honest}" in left
    assert not any(m.startswith(f"rollout {honest} left") for m in messages)
    print("\n" + caught[0] + "\n" + left)

    # the run went on with the honest rollout alone: the wrong one was not taken in again at a step boundary
    rows = step_metrics(cluster.state_dir, final.run_id)
    assert sorted(rows) == list(range(1, steps + 1))
    assert rows[1][f"rollout/samples_by/{wrong}"] > 0  # it served step 1, before the probe was drawn
    assert all(rows[step].get(f"rollout/samples_by/{wrong}", 0) == 0 for step in range(2, steps + 1))
    check_passed_every_sync(rows)  # the honest rollout's figures
    received = [e for e in map(json.loads, filter(lambda line: line.startswith("{"), (
        cluster.log_dir / "rollout-2.log").read_text().splitlines())) if e["event"] == "weights_received"]
    assert [e["weight_version"] for e in received].count(1) == 2  # the sync was repeated once, and only once

    # the RPC the check uses refuses a sequence it cannot score, naming the field
    async def score_out_of_vocabulary():
        rollout = RolloutClient(honest)
        try:
            ids = torch.tensor([1, 2], dtype=torch.int64)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await rollout.compute_log_probs(SequenceBatch(
                    prompt_ids=ids, prompt_lens=torch.tensor([2]), response_ids=torch.tensor([10 ** 6]),
                    response_lens=torch.tensor([1])), timeout=30)
            return refused.value
        finally:
            await rollout.close()

    refused = asyncio.run(score_out_of_vocabulary())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "response_ids must lie in" in refused.details()


def test_a_lora_run_generating_a_step_ahead_passes_the_check_after_every_sync(cluster, tiny_model, reverse_data):
    """Adapter-only syncs: the probe compares the adapted model, on the rollout (base + B @ A merged in) and on the
    trainer (PEFT); with generation a step ahead the probe is scored between the syncs of a running pipeline. The
    run samples at temperature 0.7 and both sides score the probe at 1 (at 0.7 on one side it would fail)."""
    final, messages = asyncio.run(run_with_messages(cluster.coordinator, run_config(
        tiny_model, reverse_data, trainer__total_training_steps=3, trainer__async_={"max_staleness": 1},
        actor_rollout_ref__rollout__temperature=0.7,
        actor_rollout_ref__model__lora_rank=8, actor_rollout_ref__model__lora_alpha=16)))
    assert final.state == "finished", final.error
    assert not any("weight check" in m for m in messages)
    check_passed_every_sync(step_metrics(cluster.state_dir, final.run_id))


def test_the_check_can_be_turned_off(cluster, tiny_model, reverse_data):
    final, _ = asyncio.run(run_with_messages(cluster.coordinator, run_config(
        tiny_model, reverse_data, trainer__total_training_steps=2,
        actor_rollout_ref__rollout__weight_check__enable=False)))
    assert final.state == "finished", final.error
    for metrics in step_metrics(cluster.state_dir, final.run_id).values():
        assert not any(key.startswith("weights/") or key == "timing_s/weight_probe" for key in metrics)


def test_a_run_whose_only_rollout_fails_the_check_fails_naming_the_figures_and_the_keys(
        make_cluster, tiny_model, reverse_data):
    """Not a run waiting for ever for a rollout to pass (the trainer, or the tolerance, is as likely at fault)."""
    cluster = make_cluster(ServiceSpec(kind="trainer"),
                           ServiceSpec(kind="rollout", settings=("corrupt_weight_after_sync=model.norm.weight",)),
                           ServiceSpec(kind="reward"))
    final, messages = asyncio.run(run_with_messages(cluster.coordinator, run_config(
        tiny_model, reverse_data, trainer__total_training_steps=3)))
    assert final.state == "failed"
    assert "no rollout passed the weight check after the sync of version 1" in final.error
    assert "mean |delta logprob|" in final.error and "top-k KL mean" in final.error
    assert "weight_check.tolerance_mean" in final.error and "tolerance_topk_kl" in final.error
    assert any("left the run (it failed the weight check twice" in m for m in messages)
