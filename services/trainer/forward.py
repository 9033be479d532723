"""Forward passes over a SequenceBatch: per-response-token logprobs, entropies and values."""

from __future__ import annotations

import torch

from services import algos
from services.common.sequences import SequenceBatch


def response_logprobs(model: torch.nn.Module, batch: SequenceBatch, pad_id: int, temperature: float,
                      with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (fp32, from temperature-scaled logits) of the response tokens, flat [T], and their entropies."""
    device = next(model.parameters()).device
    padded = batch.padded(pad_id).to(device)
    logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[:, :-1]
    logprobs = padded.gather_response(algos.token_logprobs(logits, padded.input_ids[:, 1:], temperature))
    entropy = padded.gather_response(algos.token_entropy(logits, temperature)) if with_entropy else None
    return logprobs, entropy


def response_values(model: torch.nn.Module, batch: SequenceBatch, pad_id: int) -> torch.Tensor:
    """The value head's output at the position before each response token, flat [T] fp32."""
    device = next(model.parameters()).device
    padded = batch.padded(pad_id).to(device)
    values = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[:, :-1, 0]
    return padded.gather_response(values.float())


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: SequenceBatch, pad_id: int, temperature: float,
                     micro_batch_size: int) -> torch.Tensor:
    """Logprobs of every response token, in micro-batches, without gradients. [T] on CPU."""
    model.eval()
    parts = [response_logprobs(model, batch.select(rows), pad_id, temperature, False)[0].cpu()
             for rows in torch.arange(len(batch)).split(micro_batch_size)]
    return torch.cat(parts) if parts else torch.zeros(0)


@torch.no_grad()
def batched_values(model: torch.nn.Module, batch: SequenceBatch, pad_id: int, micro_batch_size: int) -> torch.Tensor:
    model.eval()
    parts = [response_values(model, batch.select(rows), pad_id).cpu()
             for rows in torch.arange(len(batch)).split(micro_batch_size)]
    return torch.cat(parts) if parts else torch.zeros(0)
