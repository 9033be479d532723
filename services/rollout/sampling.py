"""What a rollout engine is asked for and what it returns, whichever engine it is.

``SamplingSettings`` is one Generate call's sampling (n samples per prompt,
temperature, top-p, length, seed, stop tokens); ``Completion`` is one sampled
response: its token ids, each sampled token's logprob, why it ended and the
weight versions that sampled it (of its first and of its last token: they
differ where new weights were swapped in while it was sampled, under the
swap's ``keep``); ``ScoredResponses`` is what the weight check's probe gets
back: each given response token's logprob, where asked the top-k next tokens
at its position (``TopTokens``), and the one weight version that scored them
all.

Every sequence is seeded on its own, from (request seed, prompt index, sample
index) through ``hash_seed``, never from a generator shared by a batch: a
prompt gets the same samples whichever replica or batch it lands in, and a
Generate call that a weight swap restarts returns exactly what a fresh call
returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class SamplingSettings:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int
    stop_token_ids: tuple[int, ...]
    routed_experts: bool = False  # also record the experts each token was routed to (routing replay)


@dataclass(frozen=True, kw_only=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" or "length"
    first_version: int = 0  # of the weights that sampled its first token (stamped by the engine)
    last_version: int = 0  # of the weights that sampled its last token (>= first_version)
    routed_experts: torch.Tensor | None = None  # [prompt + response tokens - 1, layers, k]: the experts each
    # token fed to the model (all but the last sampled) was routed to, where asked for (routing replay)


class TopTokens(NamedTuple):
    """The most likely next tokens at each scored position (temperature 1): the weight check's whole distributions."""

    ids: torch.Tensor  # [T, k] int64, most likely first
    logprobs: torch.Tensor  # [T, k] float32


def joined(tops: list[TopTokens]) -> TopTokens:
    """Several responses' top tokens, one after the other (flat over their positions)."""
    import torch

    return TopTokens(ids=torch.cat([top.ids for top in tops]), logprobs=torch.cat([top.logprobs for top in tops]))


@dataclass(frozen=True)
class ScoredResponses:
    version: int  # of the weights that scored every token
    logprobs: list[list[float]]  # per response, each of its tokens' logprob (temperature 1) given what is before it
    top: TopTokens | None = None  # at each response token's position, flat over the responses, where asked for


def hash_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A per-sequence seed that does not depend on batching (64-bit mix of the three)."""
    value = (seed * 1_000_003 + prompt_index) * 1_000_033 + sample_index
    value ^= value >> 29
    return (value * 0xBF58476D1CE4E5B9) & 0x7FFFFFFFFFFFFFFF
