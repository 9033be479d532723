"""CPU test of how the vLLM engine reads a probe's logprobs out of a request's prompt_logprobs
(services/rollout/vllm_engine.py; tests/gpu/test_weight_probe_vllm.py runs it on vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

from services.rollout.vllm_engine import prompt_logprobs_of


def test_the_response_part_of_the_prompt_logprobs_is_read_at_each_token_s_own_id():
    # vLLM's shape: None for the first prompt token, then per position a dict holding the token itself (and, where
    # the token is not the most likely one, the most likely beside it)
    tokens = [7, 8, 9, 10]
    logprobs = [None, {8: SimpleNamespace(logprob=-0.5)},
                {9: SimpleNamespace(logprob=-1.25), 3: SimpleNamespace(logprob=-0.25)},
                {10: SimpleNamespace(logprob=-2.0)}]
    assert prompt_logprobs_of(logprobs, tokens, first=2) == [-1.25, -2.0]  # prompt [7, 8], response [9, 10]
    assert prompt_logprobs_of(logprobs, tokens, first=1) == [-0.5, -1.25, -2.0]
