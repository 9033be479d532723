"""Chunked logprobs on one GPU, bf16, on a random model of Qwen2.5-0.5B's shape (152k vocabulary, tied output
layer): the same logprobs, entropies and gradients as the whole micro-batch's logits, and a lower peak.

16 sequences of 64 prompt and 256 response tokens, one forward and backward of a loss of the logprobs and
entropies, once with ``logprob_chunk_tokens`` 0 (today's path) and once with the default 1024. Both compute
the logits in bf16 and upcast them, so they differ by the order of bf16 sums only: logprobs and entropies are
held to today's bf16 agreement (``test_fsdp_gpu``: max 0.1 nats), gradients to a cosine of 0.999.

    python -m pytest tests/gpu/test_chunked_logprobs_gpu.py -s      (skips without a GPU)
"""

from __future__ import annotations

import torch

from services.run.models import load_causal_lm
from services.run.sections.actor_rollout_ref import ModelConfig
from services.common.sequences import SequenceBatch
from services.trainer.forward import response_logprobs
from tests.gpu.conftest import needs

SEQUENCES, PROMPT, RESPONSE = 16, 64, 256
CHECKED = ("model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight", "model.norm.weight")


def synthetic(vocab_size: int) -> SequenceBatch:
    generator = torch.Generator().manual_seed(0)
    return SequenceBatch(prompt_ids=torch.randint(3, vocab_size, (SEQUENCES * PROMPT,), generator=generator),
                         prompt_lens=torch.full((SEQUENCES,), PROMPT),
                         response_ids=torch.randint(3, vocab_size, (SEQUENCES * RESPONSE,), generator=generator),
                         response_lens=torch.full((SEQUENCES,), RESPONSE))


def forward_backward(model, batch: SequenceBatch, chunk_tokens: int) -> dict:
    device = torch.device("cuda")
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    logprobs, entropy = response_logprobs(model, batch, 0, temperature=0.9, with_entropy=True, device=device,
                                          remove_padding=False,
                                          chunk_tokens=chunk_tokens)
    (-logprobs.mean() - 0.01 * entropy.mean()).backward()
    torch.cuda.synchronize()
    grads = dict(model.named_parameters())
    return {"logprobs": logprobs.detach().float().cpu(), "entropy": entropy.detach().float().cpu(),
            "grads": {name: grads[name].grad.float().cpu() for name in CHECKED},
            "peak_gib": (torch.cuda.max_memory_allocated(device) - before) / 2**30}


@needs(1, vllm=False)
def test_chunked_logprobs_match_the_whole_logits_in_bf16(qwen_05b):
    model = load_causal_lm(str(qwen_05b), "bfloat16").cuda()
    model.train()
    batch = synthetic(model.config.vocab_size)
    whole = forward_backward(model, batch, 0)
    chunked = forward_backward(model, batch, ModelConfig().logprob_chunk_tokens)
    logprob_gap = (chunked["logprobs"] - whole["logprobs"]).abs()
    entropy_gap = (chunked["entropy"] - whole["entropy"]).abs()
    cosines = {name: float(torch.nn.functional.cosine_similarity(chunked["grads"][name].flatten(),
                                                                 whole["grads"][name].flatten(), dim=0))
               for name in CHECKED}
    print(f"\nlogprob gap max {logprob_gap.max():.4f} mean {logprob_gap.mean():.5f}; entropy gap max "
          f"{entropy_gap.max():.4f}; gradient cosines {cosines}; peak over the weights: whole "
          f"{whole['peak_gib']:.2f} GiB, chunked {chunked['peak_gib']:.2f} GiB")
    assert logprob_gap.max() < 0.1 and logprob_gap.mean() < 0.02
    assert entropy_gap.max() < 0.1
    assert all(cosine > 0.999 for cosine in cosines.values()), cosines
    assert chunked["peak_gib"] < 0.5 * whole["peak_gib"]
