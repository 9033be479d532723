"""Logprobs and entropies straight from the final hidden states, a chunk of tokens at a time.

The output layer turns each token's hidden state into [vocabulary] logits; a
micro-batch's logits in fp32, with log_softmax and the entropy's terms beside
them, are what a trainer with a large vocabulary holds most of (64 sequences
of 320 tokens x 152k x 4 bytes is 12 GB a copy). Here the logits of at most
``chunk_tokens`` tokens exist at once: the forward keeps only the hidden
states and the output weight, and the backward recomputes each chunk's logits
to form its gradient (the idea of fused linear cross-entropy kernels).

Per chunk the numbers are today's formula (``algos.token_logprobs`` and
``algos.token_entropy``): logits in the weight's dtype, upcast to at least
fp32, divided by the temperature. With z those scaled logits, L their
logsumexp, p = softmax(z) = exp(z - L) and H the entropy, the forward keeps
L and H of each token and computes

    logp_y = z_y - L        H = L - sum(p * z)

and the backward, from the gradients g of the logprobs and h of the
entropies (d logp_y / dz = onehot(y) - p, d H / dz = -p * (log p + H)),

    d z = p * (-g - h * (H - L) - h * z) + g * onehot(y)

divided by the temperature for the logits, then through the output layer:
d hidden = d logits @ W, d W = d logits^T @ hidden (accumulated over the
chunks in fp32, or float64), d bias = the sum of d logits over tokens. Each
of those is one or two passes over a chunk's [tokens x vocabulary] logits.

``head_replaced`` puts this computation in place of a Hugging Face causal
LM's output layer for one forward pass, so it runs inside the model's own
forward: under FSDP2 the root module has gathered the output weight (tied to
the input embeddings or not) before it, and its backward hooks see the
results as the model's output.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch

from services import algos

if TYPE_CHECKING:
    from services.run.models import HFModel

# what some architectures do to the logits after the output layer: their logits are not the head's alone
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 *, temperature: float) -> torch.Tensor:
    """The output layer's logits, upcast to at least fp32 and temperature-scaled (a fresh tensor). [N, H] -> [N, V]"""
    logits = algos.upcast(torch.nn.functional.linear(hidden, weight, bias))
    return logits if temperature == 1.0 else logits.div_(temperature)


class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) -> logprobs [N], entropies [N] (empty
    unless asked for; without a gradient unless ``entropy_grad``), in the logits' upcast dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk_tokens: int,  # noqa: PLR0917
                with_entropy: bool, entropy_grad: bool):  # (Function.apply passes its arguments positionally)
        dtype = algos.upcast(weight[:0]).dtype
        logprobs = torch.empty(len(hidden), dtype=dtype, device=hidden.device)
        entropy = torch.empty(len(hidden) if with_entropy else 0, dtype=dtype, device=hidden.device)
        logsumexp = torch.empty(len(hidden), dtype=dtype, device=hidden.device)
        for start in range(0, len(hidden), chunk_tokens):
            end = start + chunk_tokens
            logits = chunk_logits(hidden[start:end], weight, bias, temperature=temperature)
            lse = logsumexp[start:end] = torch.logsumexp(logits, dim=-1)
            logprobs[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - lse
            if with_entropy:
                entropy[start:end] = lse - (logits - lse[:, None]).exp_().mul_(logits).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, entropy, logsumexp)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # an output the loss does not use gets None, not zeros
        ctx.mark_non_differentiable(*(() if with_entropy and entropy_grad else (entropy,)))
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, entropy, logsumexp = ctx.saved_tensors
        dtype = logsumexp.dtype
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=dtype) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=dtype) if bias is not None and ctx.needs_input_grad[2] else None
        with_entropy = grad_entropy is not None and len(entropy) > 0
        for start in range(0, len(hidden), ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            chunk, lse = hidden[start:end], logsumexp[start:end, None]
            logits = chunk_logits(chunk, weight, bias, temperature=ctx.temperature)
            probs = (logits - lse).exp_()
            grad_logprob = (grad_logprobs[start:end, None] if grad_logprobs is not None
                            else torch.zeros_like(lse))
            if with_entropy:  # d z = p * (-g - h * (H - L) - h * z), in place of the logits
                grad_h = grad_entropy[start:end, None]
                grad_z = logits.mul_(-grad_h).sub_(grad_logprob + grad_h * (entropy[start:end, None] - lse))
                grad_z.mul_(probs)
            else:
                grad_z = probs.mul_(-grad_logprob)
            grad_z.scatter_add_(-1, targets[start:end, None], grad_logprob)
            grad_logits = (grad_z if ctx.temperature == 1.0 else grad_z.div_(ctx.temperature)).to(weight.dtype)
            del logits, probs, grad_z
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ chunk).to(dtype)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0).to(dtype)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, targets: torch.Tensor,
                     temperature: float, chunk_tokens: int, with_entropy: bool,
                     entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each target and (``with_entropy``) each position's entropy, from hidden states [N, H] through
    the output layer ``weight`` [V, H] (+ ``bias`` [V]), at most ``chunk_tokens`` tokens' logits at once. Without
    ``entropy_grad`` the entropies are values only: a loss that weighs them by 0 costs no backward passes."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    logprobs, entropy = ChunkedLogprobs.apply(hidden, weight, bias, targets, temperature, chunk_tokens, with_entropy,
                                              entropy_grad)
    return logprobs, entropy if with_entropy else None


def chunkable(model: HFModel) -> bool:
    """Whether the model's logits are its output layer's alone: a plain linear layer with nothing applied after
    it (no soft-capping or scaling, which some architectures add)."""
    config = getattr(model, "config", None)
    return (isinstance(model.get_output_embeddings(), torch.nn.Linear)
            and not any(getattr(config, name, None) not in (None, 1.0) for name in LOGIT_TRANSFORMS))


@contextmanager
def head_replaced(model: HFModel, positions: torch.Tensor, targets: torch.Tensor, *, temperature: float,
                  chunk_tokens: int, with_entropy: bool, entropy_grad: bool = True) -> Iterator[None]:
    """For the forward passes inside the ``with``, the model's output is, instead of its logits, the logprobs of
    ``targets`` [T] (and the entropies) at the hidden states' ``positions`` ([rows, L] bool, row-major order):
    [T, 2] logprob and entropy (entropy 0 unless ``with_entropy``)."""
    head = model.get_output_embeddings()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        logprobs, entropy = chunked_logprobs(hidden[positions], head.weight, head.bias, targets=targets,
                                             temperature=temperature,
                                             chunk_tokens=chunk_tokens, with_entropy=with_entropy,
                                             entropy_grad=entropy_grad)
        return torch.stack([logprobs, entropy if entropy is not None else torch.zeros_like(logprobs)], dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward
