"""The critic's value loss covers the model's tokens only where the batch has a loss mask, on a real float64
value model: what the tool tokens' returns hold changes neither the update nor its metrics."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.common.sequences import SequenceBatch
from services.coordctl.tiny_model import build_tiny_model
from services.run.models import load_value_model
from services.trainer.critic import Critic, CriticSettings
from services.trainer.optim import OptimSettings

OPTIM = OptimSettings(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), grad_clip=1.0, warmup_steps=0,
                      warmup_style="constant", min_lr_ratio=0.0, total_steps=10)
SETTINGS = CriticSettings(mini_batch_size=3, micro_batch_size=2, epochs=1, cliprange_value=0.5, vf_coef=1.0,
                          loss_agg_mode="seq-mean-token-mean", max_response_length=8)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=1, num_heads=2, seed=0)


def update(model_path, returns: torch.Tensor, loss_mask: torch.Tensor | None) -> tuple[dict, list[torch.Tensor]]:
    torch.manual_seed(3)  # the value head's initialisation
    critic = Critic(load_value_model(model_path).double(), OPTIM, pad_id=0, seed=0)
    batch = replace(SequenceBatch.of_lists([[5, 6], [7], [8, 9, 10]], [[11, 12, 13], [14, 15], [16, 17, 18]]),
                    loss_mask=loss_mask)
    old_values = torch.linspace(-0.5, 0.5, 8, dtype=torch.float64)
    metrics = critic.update(batch, old_values, returns, settings=SETTINGS)
    return metrics, [p.detach().clone() for p in critic.model.parameters()]


def test_tool_tokens_returns_change_nothing(model_path):
    tools = torch.tensor([False, True, False, False, True, False, True, True])
    returns = torch.linspace(1.0, 2.0, 8, dtype=torch.float64)
    metrics, weights = update(model_path, returns, ~tools)
    wild_metrics, wild_weights = update(model_path, torch.where(tools, 1e3, returns), ~tools)
    assert wild_metrics == metrics
    for expected, got in zip(weights, wild_weights):
        assert torch.equal(got, expected)
    unmasked, _ = update(model_path, torch.where(tools, 1e3, returns), None)
    assert unmasked["critic/vf_loss"] > 100 * metrics["critic/vf_loss"]
