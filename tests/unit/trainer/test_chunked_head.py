"""Chunked logprobs (``chunked_head``) against today's formula (``algos.token_logprobs``/``token_entropy`` on the
whole logits), in float64 so that what is compared is the math: the values, entropies and the gradients of a loss
of both with respect to the hidden states, the output weight and bias, and through a real model (tied and untied
output layer, padded and packed rows) every parameter's gradient. The same in float64 means within 1e-12 (the
two sum the same products in other orders; measured: ~2e-15)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from services import algos
from services.common.sequences import SequenceBatch
from services.trainer.chunked_head import chunkable, chunked_logprobs
from services.trainer.forward import response_logprobs

F64 = torch.float64
CPU = torch.device("cpu")


def weighted_loss(logprobs, entropy, generator):
    """A loss with arbitrary weights on every logprob and entropy, as the PPO loss has."""
    loss = (logprobs * torch.randn(logprobs.shape, generator=generator, dtype=F64)).sum()
    return loss if entropy is None else loss + (entropy * torch.randn(entropy.shape, generator=generator,
                                                                      dtype=F64)).sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_values_and_gradients_equal_the_whole_logits_formula(temperature, with_bias, with_entropy):
    generator = torch.Generator().manual_seed(3)
    tokens, hidden_size, vocab = 13, 6, 11  # chunks of 4: 4, 4, 4 and 1 tokens
    hidden = torch.randn(tokens, hidden_size, generator=generator, dtype=F64, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=F64, requires_grad=True)
    bias = torch.randn(vocab, generator=generator, dtype=F64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    inputs = [hidden, weight] + ([bias] if with_bias else [])

    logprobs, entropy = chunked_logprobs(hidden, weight, bias, targets=targets, temperature=temperature, chunk_tokens=4,
                                         with_entropy=with_entropy)
    got = torch.autograd.grad(weighted_loss(logprobs, entropy, torch.Generator().manual_seed(9)), inputs)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    expected_logprobs = algos.token_logprobs(logits, targets, temperature)
    expected_entropy = algos.token_entropy(logits, temperature) if with_entropy else None
    expected = torch.autograd.grad(weighted_loss(expected_logprobs, expected_entropy,
                                                 torch.Generator().manual_seed(9)), inputs)

    assert logprobs.dtype == F64 and logprobs.shape == (tokens,)
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-12)
    if with_entropy:
        torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-12)
    else:
        assert entropy is None
    for name, grad, want in zip(("hidden", "weight", "bias"), got, expected):
        assert want.abs().max() > 1e-3, name  # the loss reaches it
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-12, msg=name)


def test_only_the_entropy_in_the_loss_gives_its_gradient():
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 3, generator=generator, dtype=F64, requires_grad=True)
    weight = torch.randn(7, 3, generator=generator, dtype=F64)
    _, entropy = chunked_logprobs(hidden, weight, None, targets=torch.zeros(5, dtype=torch.int64), temperature=0.5,
                                  chunk_tokens=2,
                                  with_entropy=True)
    (got,) = torch.autograd.grad(entropy.sum(), [hidden])
    (expected,) = torch.autograd.grad(algos.token_entropy(hidden @ weight.T, 0.5).sum(), [hidden])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_a_chunk_of_no_tokens_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_logprobs(torch.zeros(2, 3), torch.zeros(4, 3), None, targets=torch.zeros(2, dtype=torch.int64),
                         temperature=1.0,
                         chunk_tokens=0, with_entropy=False)


def tiny_lm(tied: bool) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
                         max_position_embeddings=64)
    return Qwen2ForCausalLM(config).double()


def batch():
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 40, (n,), generator=generator).tolist() for n in (2, 5, 3)]
    responses = [torch.randint(3, 40, (n,), generator=generator).tolist() for n in (7, 1, 4)]
    return SequenceBatch.of_lists(prompts, responses)


def logprobs_and_gradients(model, chunk_tokens: int, remove_padding: bool):
    model.zero_grad()
    logprobs, entropy = response_logprobs(model, batch(), 0, temperature=0.8, with_entropy=True, device=CPU,
                                          remove_padding=remove_padding,
                                          chunk_tokens=chunk_tokens)
    weighted_loss(logprobs, entropy, torch.Generator().manual_seed(2)).backward()
    return logprobs.detach(), entropy.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("remove_padding", [False, True])
def test_a_model_gives_the_same_logprobs_entropies_and_gradients_chunked(tied, remove_padding):
    model = tiny_lm(tied)
    assert chunkable(model) and (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    whole = logprobs_and_gradients(model, 0, remove_padding)
    chunked = logprobs_and_gradients(model, 3, remove_padding)  # 12 response tokens: four chunks
    assert chunked[0].shape == (batch().num_response_tokens,)
    torch.testing.assert_close(chunked[0], whole[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=1e-12)
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, rtol=0, atol=1e-12, msg=name)
    assert "forward" not in vars(model.lm_head)  # the output layer is itself again


def parameters_reached(loss: torch.Tensor, model: torch.nn.Module) -> int:
    """How many of the model's parameters get a non-zero gradient from ``loss`` (the graph kept)."""
    if not loss.requires_grad:
        return 0
    grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True, allow_unused=True)
    return sum(1 for grad in grads if grad is not None and bool(grad.abs().max() > 0))


@pytest.mark.parametrize("chunk_tokens", [0, 3])
def test_entropies_without_a_gradient_have_the_same_values_and_leave_the_logprobs_gradients_alone(chunk_tokens):
    """An actor with entropy_coeff 0 asks for entropies as a metric only: same values, no gradient from them, and
    the parameters' gradients of the loss (logprobs + 0 x entropy, as the actor's loss then is) unchanged."""
    model = tiny_lm(False)
    got = {}
    for entropy_grad in (True, False):
        model.zero_grad()
        logprobs, entropy = response_logprobs(model, batch(), 0, temperature=0.8, with_entropy=True, device=CPU,
                                              remove_padding=False,
                                              chunk_tokens=chunk_tokens,
                                              entropy_grad=entropy_grad)
        reached = parameters_reached(entropy.sum(), model)
        (weighted_loss(logprobs, None, torch.Generator().manual_seed(2)) - 0.0 * entropy.sum()).backward()
        got[entropy_grad] = entropy.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}, reached
    assert got[True][2] > 0 and got[False][2] == 0
    torch.testing.assert_close(got[False][0], got[True][0], rtol=0, atol=0)
    for name, grad in got[True][1].items():
        torch.testing.assert_close(got[False][1][name], grad, rtol=0, atol=1e-12, msg=name)


def test_soft_capped_logits_are_not_chunked():
    model = tiny_lm(True)
    model.config.final_logit_softcapping = 30.0
    assert not chunkable(model)
