"""The actor's micro-batches accumulate to exactly the gradient of the whole mini-batch, on a real model."""

from __future__ import annotations

import pytest
import torch

from services import algos
from services.common.models import load_causal_lm
from services.coordinator.loop import make_batch
from services.coordinator.tiny_model import build_tiny_model
from services.trainer.actor import Actor, ActorSettings, UpdateInputs
from services.trainer.optim import OptimSettings, chunks

OPTIM = OptimSettings(1e-3, 0.0, (0.9, 0.99), 1.0, 0, "constant", 0.0, 10)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=1, num_heads=2, seed=0)


def settings(mode: str, micro: int) -> ActorSettings:
    return ActorSettings(mini_batch_size=6, micro_batch_size=micro, epochs=1, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         clip_ratio_c=3.0, loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True,
                         kl_loss_coef=0.1, kl_loss_type="low_var_kl", temperature=0.9, max_response_length=7)


def gradient(model_path, mode: str, micro: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = load_causal_lm(model_path).double()
    actor = Actor(model, OPTIM, 1e-3, pad_id=0, seed=0)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 70, (n,), generator=generator).tolist() for n in (2, 5, 3, 4, 1, 6)]
    responses = [torch.randint(3, 70, (n,), generator=generator).tolist() for n in (7, 1, 4, 6, 3, 5)]
    batch = make_batch(prompts, responses)
    tokens = batch.num_response_tokens
    inputs = UpdateInputs(torch.randn(tokens, generator=generator, dtype=torch.float64) - 4,
                          torch.randn(tokens, generator=generator, dtype=torch.float64),
                          torch.randn(tokens, generator=generator, dtype=torch.float64) - 4)
    rows = torch.arange(len(batch))
    scale = algos.LossScale.of(batch.response_lens, 7)
    model.train()
    for part in chunks(rows, micro):
        actor._micro_batch_loss(batch, part, inputs, settings(mode, micro), scale)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_micro_batches_accumulate_to_the_mini_batch_gradient(model_path, mode):
    whole = gradient(model_path, mode, micro=6)
    for micro in (1, 4):
        parts = gradient(model_path, mode, micro=micro)
        for full, accumulated in zip(whole, parts):
            assert torch.allclose(full, accumulated, atol=1e-6, rtol=0), (mode, micro)
