"""Seeded sampling in vLLM at the speed of unseeded sampling: every seeded row's noise in one GPU kernel.

meshrl seeds every sample (``sampling.hash_seed``), so that a prompt gets the
same samples whichever replica or batch it lands in. vLLM 0.20 samples by the
exponential race (``argmax(probs / q)``, q ~ Exp(1) per vocabulary entry) and
draws q for a seeded row from that request's own ``torch.Generator``, one
kernel launch per seeded row per decode step (``random_sample`` in
``vllm.v1.sample.ops.topk_topp_sampler``, whose comment says "this can be
slow"): at 256 samples a step that is 256 launches over the 152k vocabulary
every token.

``random_sample`` here draws the same kind of noise for all seeded rows at
once: row r's noise at its decode step t is Philox(key(seed_r, t), column),
made in one Triton kernel (the Philox key is seed * 1_000_003 + t). A
request's generator stays what carries its state: its initial seed is the row's seed, and its offset counts the row's
steps (advanced by one Philox block a step), so a request keeps its stream
when vLLM moves it to another row, and a prompt gets the same noise in any
batch, as before. The samples are not vLLM's own stream's (another generator
makes them), so a run's samples change once when this is switched on; they
follow the same distribution (tests/gpu/test_seeded_sampling.py checks it).

``use_batched_seeded_sampling`` puts it in place of vLLM's, in the worker
process (the vLLM worker extension calls it when the engine starts).
"""

from __future__ import annotations

import torch

STEP = 4  # how far a row's generator offset moves each step (one Philox counter block)
KEY_MULTIPLIER = 1_000_003  # key = seed * this + step: distinct for every seed < 2**31 and step < 1_000_003
SMALLEST_NOISE = 1e-20  # an Exp(1) draw below it is as good as it (the race's winner either way)
BLOCK = 4096  # columns a kernel program fills


def seeded_rows(generators: dict[int, torch.Generator]) -> torch.Tensor:
    """The rows that have their own generator, with each one's seed and step, as a (3, rows) int64 tensor (row
    index, seed, step), read from and advancing each generator (its offset counts the steps it sampled)."""
    table = []
    for row, generator in generators.items():
        offset = generator.get_offset()
        table.append((row, generator.initial_seed(), offset // STEP))
        generator.set_offset(offset + STEP)
    return torch.tensor(table, dtype=torch.int64).T.contiguous()


def fill_seeded_exponentials(q: torch.Tensor, table: torch.Tensor) -> None:
    """Write Exp(1) noise into the rows of ``q`` (rows, vocab; float32, on the GPU) that ``table`` names (from
    ``seeded_rows``), each row's from its seed and step: one kernel launch for all of them."""
    from services.rollout.seeded_kernel import exponential_rows

    table = table.to(q.device, non_blocking=True)
    rows, seeds, steps = table[0], table[1], table[2]
    vocab_size = q.shape[1]
    grid = (table.shape[1], (vocab_size + BLOCK - 1) // BLOCK)
    exponential_rows[grid](q, q.stride(0), rows, seeds, steps, vocab_size, KEY_MULTIPLIER=KEY_MULTIPLIER,
                           SMALLEST_NOISE=SMALLEST_NOISE, BLOCK=BLOCK)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """vLLM's ``random_sample`` (same arguments, same result's meaning: one token id per row, drawn from its
    probabilities by the exponential race) with every seeded row's noise made in one kernel."""
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    if generators:
        fill_seeded_exponentials(q, seeded_rows(generators))
    return probs.div_(q).argmax(dim=-1).view(-1)


def use_batched_seeded_sampling() -> None:
    """Make vLLM's sampler (in this process) draw seeded rows' noise with ``random_sample`` here."""
    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.random_sample = random_sample
