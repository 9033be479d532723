"""CPU test of how the vLLM engine reads a probe's logprobs out of a request's prompt_logprobs
(services/rollout/vllm_engine.py; tests/gpu/test_weight_probe_vllm.py runs it on vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.rollout.vllm_engine import prompt_logprobs_of, top_tokens_of


def test_the_response_part_of_the_prompt_logprobs_is_read_at_each_token_s_own_id():
    # vLLM's shape: None for the first prompt token, then per position a dict holding the token itself (and, where
    # the token is not the most likely one, the most likely beside it)
    tokens = [7, 8, 9, 10]
    logprobs = [None, {8: SimpleNamespace(logprob=-0.5)},
                {9: SimpleNamespace(logprob=-1.25), 3: SimpleNamespace(logprob=-0.25)},
                {10: SimpleNamespace(logprob=-2.0)}]
    assert prompt_logprobs_of(logprobs, tokens, first=2) == [-1.25, -2.0]  # prompt [7, 8], response [9, 10]
    assert prompt_logprobs_of(logprobs, tokens, first=1) == [-0.5, -1.25, -2.0]


def test_the_top_k_of_each_response_position_are_read_by_rank_without_the_prompt_token_past_k():
    # prompt_logprobs=2: each position holds ranks 1 and 2, and the prompt's own token with its rank (here 5 at
    # the second position: past k, left out; at the first it is rank 1 itself)
    tokens = [7, 8, 9]
    logprobs = [None,
                {8: SimpleNamespace(logprob=-0.5, rank=1), 3: SimpleNamespace(logprob=-1.5, rank=2)},
                {9: SimpleNamespace(logprob=-4.0, rank=5), 4: SimpleNamespace(logprob=-1.0, rank=2),
                 2: SimpleNamespace(logprob=-0.75, rank=1)}]
    top = top_tokens_of(logprobs, first=1, k=2)
    assert top.ids.tolist() == [[8, 3], [2, 4]] and top.logprobs.tolist() == [[-0.5, -1.5], [-0.75, -1.0]]
    assert prompt_logprobs_of(logprobs, tokens, first=1) == [-0.5, -4.0]
    assert top_tokens_of(logprobs, first=3, k=2).ids.shape == (0, 2)  # no response tokens
    with pytest.raises(ValueError, match="1 prompt logprobs of rank 1 to 2"):
        top_tokens_of([None, {8: SimpleNamespace(logprob=-0.5, rank=1)}], first=1, k=2)
