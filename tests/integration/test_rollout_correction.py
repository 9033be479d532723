"""Rollout correction over the wire: UpdateActor takes the rollout's logprobs, checks them and weights the loss."""

from __future__ import annotations

import asyncio
import math

import grpc
import pytest
import torch

from services.coordinator.clients import TrainerClient
from services.coordctl.control import CoordinatorClient
from services.coordinator.loop import make_batch
from tests.integration.test_grpo_run import run_config


async def update_actor_calls(coordinator: str, config_yaml: str, rollout_logprobs_of) -> list:
    """InitRun on the trainer, then one update_actor per rollout_logprobs_of(old_logprobs): metrics or the error."""
    control = CoordinatorClient(coordinator)
    try:
        address = next(s.address for s in await control.list_services() if s.kind == "trainer")
    finally:
        await control.close()
    trainer = TrainerClient(address)
    try:
        await trainer.init_run("rc", config_yaml, ["actor"], seed=0, timeout=120)
        batch = make_batch([[5, 6, 7]] * 4, [[8, 9], [10], [11, 12, 13], [14, 15]])
        old = await trainer.compute_log_probs(batch, step=1, timeout=60)
        advantages = torch.tensor([1.0, 1.0, -1.0, 0.5, 0.5, 0.5, -0.5, -0.5])
        results = []
        for make in rollout_logprobs_of:
            try:
                metrics, _ = await trainer.update_actor(batch, old, advantages, None, step=1, timeout=60,
                                                        rollout_logprobs=make(old))
                results.append(metrics)
            except grpc.aio.AioRpcError as error:
                results.append(error)
        return results
    finally:
        await trainer.close()


def test_update_actor_with_rollout_correction(cluster, tiny_model, reverse_data):
    config = run_config(tiny_model, reverse_data, algorithm__rollout_correction={"enable": True})
    missing, short, nan, tripled = asyncio.run(update_actor_calls(cluster.coordinator, config, [
        lambda old: None,
        lambda old: old[:-1],
        lambda old: torch.full_like(old, math.nan),
        lambda old: old - math.log(3.0),  # pi_old / pi_rollout = 3 on every token: truncated to 2
    ]))
    for error, words in ((missing, "rollout_logprobs"), (short, "one value per response token"), (nan, "NaN")):
        assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in error.details()
    assert tripled["rollout_corr/rollout_is_mean"] == pytest.approx(2.0, rel=1e-6)
    assert tripled["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0
