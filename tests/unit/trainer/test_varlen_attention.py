"""Packed micro-batches through the varlen attention (``varlen_attention``) against padded rows through
transformers' sdpa, on a tiny Qwen2 with grouped-query attention (4 query heads, 2 key/value heads) in float64:
the same logprobs, entropies and gradients of every parameter, within 1e-12 (on a CPU the varlen function runs
SDPA on each sequence, the GPU's flash kernel is tests/gpu/test_fast_trainer_gpu.py's)."""

from __future__ import annotations

import pytest
import torch

from services.common.sequences import SequenceBatch
from services.coordctl.tiny_model import build_random_model
from services.run.models import load_causal_lm
from services.run.sections.actor_rollout_ref import ModelConfig
from services.trainer.forward import response_logprobs
from services.trainer.settings import packs
from services.trainer.setup import attention

CPU = torch.device("cpu")
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_random_model(tmp_path_factory.mktemp("gqa") / "tiny-gqa", SHAPE, "float32", seed=0)


def logprobs_and_gradients(model, batch, remove_padding: bool):
    model.zero_grad(set_to_none=True)
    logprobs, entropy = response_logprobs(model, batch, 0, temperature=0.8, with_entropy=True, device=CPU,
                                          remove_padding=remove_padding,
                                          chunk_tokens=ModelConfig().logprob_chunk_tokens)
    generator = torch.Generator().manual_seed(5)
    loss = (logprobs * torch.randn(logprobs.shape, generator=generator, dtype=torch.float64)).sum() + (
        entropy * torch.randn(entropy.shape, generator=generator, dtype=torch.float64)).sum()
    loss.backward()
    return logprobs.detach(), entropy.detach(), {name: p.grad for name, p in model.named_parameters()}


def test_packed_varlen_attention_gives_the_padded_logprobs_and_gradients(model_path):
    batch = SequenceBatch.of_lists([[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]],
                       [[16, 17], [18, 19, 20, 21, 22, 23], [24], [25, 26, 27]])
    padded = load_causal_lm(model_path).double()
    varlen = load_causal_lm(model_path, attn_implementation=attention(True)).double()
    assert varlen.config._attn_implementation == "meshrl_varlen" and padded.config._attn_implementation == "sdpa"
    expected = logprobs_and_gradients(padded, batch, remove_padding=False)
    got = logprobs_and_gradients(varlen, batch, remove_padding=True)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=1e-12)
    for name, grad in expected[2].items():
        assert grad.abs().max() > 1e-6, name  # the loss reaches it
        torch.testing.assert_close(got[2][name], grad, rtol=0, atol=1e-12, msg=name)


def test_varlen_attention_refuses_padded_rows(model_path):
    varlen = load_causal_lm(model_path, attn_implementation=attention(True)).double()
    with pytest.raises(ValueError, match="one packed row with its cu_seq_lens_q"):
        response_logprobs(varlen, SequenceBatch.of_lists([[5, 6], [7]], [[8], [9, 10]]), 0, temperature=1.0,
                          with_entropy=False, device=CPU,
                          remove_padding=False)


def test_passes_pack_where_configured_and_by_default_on_a_gpu_only():
    assert packs(None, torch.device("cuda", 0)) and not packs(None, CPU)
    assert packs(True, CPU) and not packs(False, torch.device("cuda", 0))
    assert attention(False) is None
