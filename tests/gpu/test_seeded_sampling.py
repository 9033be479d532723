"""The rollout's seeded sampling in one kernel (services/rollout/seeded_sampling.py), on a GPU: each row's draw
depends on its seed and step alone (not on its row or the batch beside it), its stream moves on each step, and
its samples follow the row's probabilities.

    python -m pytest tests/gpu/test_seeded_sampling.py -s      (skips without a GPU; needs triton, not vllm)
"""

from __future__ import annotations

import torch

from services.rollout.seeded_sampling import random_sample
from tests.gpu.conftest import needs

pytestmark = needs(1, vllm=False)


def generators_of(seeds: list[int]) -> dict[int, torch.Generator]:
    return {row: torch.Generator(device="cuda").manual_seed(seed) for row, seed in enumerate(seeds)}


def sample_steps(probs: torch.Tensor, seeds: list[int], steps: int) -> torch.Tensor:
    """(steps, rows) token ids, the same generators sampling each step, as vLLM keeps a request's generator."""
    generators = generators_of(seeds)
    return torch.stack([random_sample(probs.clone(), generators) for _ in range(steps)])


def test_a_rows_draws_depend_on_its_seed_and_step_alone():
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(6, 152_000, device="cuda"), dim=-1)
    seeds = [11, 22, 33, 44, 55, 66]
    together = sample_steps(probs, seeds, steps=5)
    order = [3, 0, 5, 1, 4, 2]
    moved = sample_steps(probs[order], [seeds[i] for i in order], steps=5)
    assert torch.equal(moved, together[:, order])  # each seed's tokens follow it to another row
    alone = sample_steps(probs[2:3], seeds[2:3], steps=5)
    assert torch.equal(alone[:, 0], together[:, 2])  # and do not depend on the rows beside it
    assert len(set(together[:, 0].tolist())) > 1  # the stream moves on from step to step


def test_samples_follow_the_probabilities():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0, 0.0, 0.0], device="cuda")
    rows, steps = 256, 200
    tokens = sample_steps(probs.expand(rows, -1).contiguous(), list(range(1000, 1000 + rows)), steps)
    counts = torch.bincount(tokens.flatten(), minlength=8).double()
    expected = probs.double() * rows * steps
    assert counts[5:].sum() == 0  # a zero-probability token is never drawn
    chi_square = ((counts[:5] - expected[:5]) ** 2 / expected[:5]).sum().item()
    print(f"counts {counts.tolist()}, chi-square {chi_square:.2f} (4 degrees of freedom)")
    assert chi_square < 30.0  # 4 degrees of freedom: p < 1e-5 of exceeding this by chance (the seeds are fixed)


def test_unseeded_rows_beside_seeded_ones():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(4, 1000, device="cuda"), dim=-1)
    seeded = {1: torch.Generator(device="cuda").manual_seed(7), 3: torch.Generator(device="cuda").manual_seed(8)}
    tokens = random_sample(probs.clone(), seeded)
    again = random_sample(probs.clone(), {1: torch.Generator(device="cuda").manual_seed(7),
                                           3: torch.Generator(device="cuda").manual_seed(8)})
    assert tokens.shape == (4,)
    assert torch.equal(tokens[[1, 3]], again[[1, 3]])
