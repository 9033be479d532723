"""verl's optimizer_offload: the AdamW state lives in CPU memory between update calls and on the parameters'
device during them, and the updates are bit-identical to keeping it in place (on a GPU the state really
travels; on a CPU the round trip still goes through the state's every tensor)."""

from __future__ import annotations

import pytest
import torch

from services.trainer.optim import Optimizer, OptimSettings

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def updated(device: str, offload: bool) -> tuple[list[torch.Tensor], Optimizer]:
    """Three update calls of two optimizer steps each on a small float64 model; its weights after them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double().to(device)
    optimizer = Optimizer(model.parameters(), OptimSettings(lr=1e-2, weight_decay=0.01, betas=(0.9, 0.99),
                                                            grad_clip=1.0, warmup_steps=0, warmup_style="constant",
                                                            min_lr_ratio=0.0, total_steps=10,
                                                            offload=offload))
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        with optimizer.resident():
            for _ in range(2):
                inputs = torch.randn(8, 5, generator=generator, dtype=torch.float64).to(device)
                model(inputs).square().mean().backward()
                optimizer.step()
        optimizer.advance_schedule()
    return [p.detach().cpu() for p in model.parameters()], optimizer


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_optimizer_state_gives_bit_identical_updates_and_rests_in_cpu_memory(device):
    kept, _ = updated(device, offload=False)
    offloaded, optimizer = updated(device, offload=True)
    for got, expected in zip(offloaded, kept):
        assert torch.equal(got, expected)
    states = list(optimizer.adamw.state.values())
    assert len(states) == 4 and all(float(state["step"]) == 6 for state in states)
    assert {value.device.type for state in states for key, value in state.items() if key != "step"} == {"cpu"}
