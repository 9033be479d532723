"""Forward passes over a SequenceBatch: per-response-token logprobs, entropies and values.

A micro-batch goes through the model right-padded to its longest row, or,
with ``remove_padding``, packed into one row whose position ids restart for
each sequence (no pad tokens at all; the same outputs), its sequences' bounds
passed along for a variable-length attention kernel (``varlen_attention``).
Logprobs and
entropies come from the logits upcast to fp32 (``algos.token_logprobs``),
whatever dtype the model computes in. With ``chunk_tokens`` they are computed
from the final hidden states of the response positions alone, that many

if TYPE_CHECKING:
    from services.run.models import HFModel
tokens' logits at a time (``chunked_head``); without it, from the whole
micro-batch's logits.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import torch

from services import algos
from services.common.sequences import Padded, SequenceBatch
from services.run.lora import adapter_autocast
from services.run.routing import RouteTally, replaying
from services.trainer.batching import MicroBatching, micro_batch_plan, with_stand_ins
from services.trainer.chunked_head import chunkable, head_replaced
from services.trainer.ranks import Ranks
from services.trainer.varlen_attention import varlen_kwargs

if TYPE_CHECKING:
    from services.run.models import HFModel


def model_inputs(batch: SequenceBatch, pad_id: int, remove_padding: bool, *, device: torch.device) -> Padded:
    return (batch.packed() if remove_padding else batch.padded(pad_id)).to(device)


def run_model(model: HFModel, inputs: Padded, replay_routes: bool = False,
              *, tally: RouteTally | None = None) -> torch.Tensor:
    """The model's output scores (logits, or a value head's) at every position, [rows, L, ...]; every pass of
    the trainer's goes through here (a LoRA model's in ``adapter_autocast``). Where the inputs carry routed
    experts, the model routes by them with ``replay_routes`` (R3), and ``tally`` counts how many of them its own
    routers chose (``routing.replaying``)."""
    packed = {} if inputs.cu_seqlens is None else varlen_kwargs(inputs.cu_seqlens, inputs.max_seqlen)
    routes = contextlib.nullcontext() if inputs.routed_experts is None else replaying(
        model, inputs.routed_experts.flatten(0, 1), replay=replay_routes, tally=tally)
    with adapter_autocast(model, inputs.input_ids.device.type), routes:
        return model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                     position_ids=inputs.position_ids, use_cache=False, **packed).logits


def response_logprobs(model: HFModel, batch: SequenceBatch, pad_id: int, *, temperature: float,
                      with_entropy: bool, device: torch.device, remove_padding: bool = False,
                      chunk_tokens: int = 0, entropy_grad: bool = True, replay_routes: bool = False,
                      tally: RouteTally | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (fp32, from temperature-scaled logits) of the response tokens, flat [T], and their entropies
    (without a gradient unless ``entropy_grad``); ``chunk_tokens`` > 0: at most that many tokens' logits at once,
    where the model allows (``chunkable``). Routed experts of the batch: as ``run_model``."""
    inputs = model_inputs(batch, pad_id, remove_padding, device=device)
    if chunk_tokens > 0 and chunkable(model):
        positions = torch.nn.functional.pad(inputs.response_mask, (0, 1))  # [rows, L]: the last predicts nothing
        targets = inputs.input_ids[:, 1:][inputs.response_mask]
        with head_replaced(model, positions, targets, temperature=temperature, chunk_tokens=chunk_tokens,
                           with_entropy=with_entropy,
                           entropy_grad=entropy_grad):
            scores = run_model(model, inputs, replay_routes, tally=tally)
        return scores[:, 0], scores[:, 1] if with_entropy else None
    logits = run_model(model, inputs, replay_routes, tally=tally)[:, :-1]
    logprobs = inputs.gather_response(algos.token_logprobs(logits, inputs.input_ids[:, 1:], temperature))
    entropy = inputs.gather_response(algos.token_entropy(logits if entropy_grad else logits.detach(), temperature)) \
        if with_entropy else None
    return logprobs, entropy


def response_values(model: HFModel, batch: SequenceBatch, pad_id: int, *, device: torch.device,
                    remove_padding: bool = False) -> torch.Tensor:
    """The value head's output at the position before each response token, flat [T] fp32."""
    inputs = model_inputs(batch, pad_id, remove_padding, device=device)
    return inputs.gather_response(run_model(model, inputs)[:, :-1, 0].float())


@torch.no_grad()
def per_token(compute: Callable[[SequenceBatch, torch.Tensor], torch.Tensor], batch: SequenceBatch,
              micro: MicroBatching, *, ranks: Ranks) -> torch.Tensor | None:
    """``compute`` (a micro-batch and its rows of ``batch`` -> values [T', ...] of its response tokens) over this
    rank's micro-batches.

    Returns on rank 0 the values of the whole batch, [T, ...] in the batch's order, on CPU; None on the others.
    """
    rows = torch.arange(len(batch))
    plan = micro_batch_plan(batch.sequence_lens, rows, ranks.world_size, micro=micro)
    mine = []
    for part, real in with_stand_ins(plan[ranks.rank], batch.sequence_lens, rows):
        values = compute(batch.select(part), part)
        mine.append(values.cpu() if real else values[:0].cpu())  # a stand-in's: none, of the values' shape
    return gather_tokens(batch, plan, mine, ranks=ranks)


def gather_tokens(batch: SequenceBatch, plan: list[list[torch.Tensor]], mine: list[torch.Tensor],
                  *, ranks: Ranks) -> torch.Tensor | None:
    """Per-token values of the rows of ``plan`` (``micro_batch_plan``) gathered from every rank, each of which
    computed ``mine``: values [T', ...] of its real micro-batches, in its plan's order. Returns on rank 0 the
    values of the whole batch, [T, ...] in the batch's order, on CPU (0 for tokens of rows outside the plan); None
    on the others."""
    local = torch.cat(mine) if mine else torch.zeros(0)
    orders = [torch.cat(batches) if batches else torch.zeros(0, dtype=torch.int64) for batches in plan]
    gathered = ranks.gather(local, [int(batch.response_lens[order].sum()) for order in orders])
    if gathered is None:
        return None
    values = torch.zeros((batch.num_response_tokens, *gathered.shape[1:]), dtype=gathered.dtype)
    values[batch.token_index(torch.cat(orders))] = gathered
    return values


def batched_logprobs(model: HFModel, batch: SequenceBatch, pad_id: int, *, temperature: float,
                     micro: MicroBatching, ranks: Ranks) -> torch.Tensor | None:
    """Logprobs of every response token without gradients: flat [T] on rank 0 (CPU), None on the others."""
    model.eval()
    return per_token(lambda part, _: response_logprobs(model, part, pad_id, temperature=temperature,
                                                       with_entropy=False, device=ranks.device,
                                                       remove_padding=micro.remove_padding,
                                                       chunk_tokens=micro.chunk_tokens,
                                                       replay_routes=micro.replay_routes)[0], batch, micro,
                     ranks=ranks)


def vocabulary_logprobs(model: HFModel, batch: SequenceBatch, *, pad_id: int, temperature: float,
                        device: torch.device, remove_padding: bool = False,
                        replay_routes: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """At each response token's position, the whole vocabulary's logprobs (fp32, temperature-scaled) and the
    token there: [T', V], [T'] ids. All positions at once (the weight check's small probe, not a training batch)."""
    inputs = model_inputs(batch, pad_id, remove_padding, device=device)
    logits = run_model(model, inputs, replay_routes)[:, :-1]
    vocabulary = inputs.gather_response(torch.log_softmax(algos.upcast(logits) / temperature, dim=-1))
    return vocabulary, inputs.gather_response(inputs.input_ids[:, 1:])


def candidate_logprobs(model: HFModel, batch: SequenceBatch, candidate_ids: torch.Tensor, *, pad_id: int,
                       temperature: float, device: torch.device, remove_padding: bool = False,
                       replay_routes: bool = False) -> torch.Tensor:
    """At each response token's position, the logprob (fp32, temperature-scaled) of the token itself and of each
    of ``candidate_ids`` there: [T', m] int64 ids -> [T', 1 + m], the token's first."""
    vocabulary, tokens = vocabulary_logprobs(model, batch, pad_id=pad_id, temperature=temperature, device=device,
                                             remove_padding=remove_padding, replay_routes=replay_routes)
    return vocabulary.gather(-1, torch.cat([tokens.unsqueeze(-1), candidate_ids.to(device)], dim=-1))


def top_logprobs(model: HFModel, batch: SequenceBatch, top_k: int, *, pad_id: int, temperature: float,
                 device: torch.device, remove_padding: bool = False, replay_routes: bool = False) -> torch.Tensor:
    """At each response token's position, the logprob (fp32, temperature-scaled) of the token itself and the
    ``top_k`` most likely next tokens (at most the vocabulary), most likely first: [T', 1 + 2k] float64, the
    token's logprob, the k logprobs, then the k ids (exact in float64), in one tensor that the ranks gather as any
    per-token values (``split_top``)."""
    vocabulary, tokens = vocabulary_logprobs(model, batch, pad_id=pad_id, temperature=temperature, device=device,
                                             remove_padding=remove_padding, replay_routes=replay_routes)
    top = vocabulary.topk(min(top_k, vocabulary.shape[-1]), dim=-1)
    return torch.cat([vocabulary.gather(-1, tokens.unsqueeze(-1)).double(), top.values.double(),
                      top.indices.double()], dim=-1)


def split_top(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``top_logprobs``'s [T, 1 + 2k] as the tokens' logprobs [T] float32, the top-k logprobs [T, k] float32 and
    their ids [T, k] int64."""
    k = (packed.shape[-1] - 1) // 2
    return packed[:, 0].float(), packed[:, 1:1 + k].float(), packed[:, 1 + k:].long()


def batched_candidate_logprobs(model: HFModel, batch: SequenceBatch, *, candidate_ids: torch.Tensor,
                               pad_id: int, temperature: float, micro: MicroBatching,
                               ranks: Ranks) -> torch.Tensor | None:
    """``candidate_logprobs`` of every response token without gradients: [T, 1 + m] on rank 0 (CPU), None on the
    others."""
    model.eval()
    return per_token(lambda part, rows: candidate_logprobs(
        model, part, candidate_ids[batch.token_index(rows)], pad_id=pad_id, temperature=temperature,
        device=ranks.device, remove_padding=micro.remove_padding, replay_routes=micro.replay_routes),
        batch, micro, ranks=ranks)


def batched_top_logprobs(model: HFModel, batch: SequenceBatch, top_k: int, *, pad_id: int, temperature: float,
                         micro: MicroBatching, ranks: Ranks) -> torch.Tensor | None:
    """``top_logprobs`` of every response token without gradients: [T, 1 + 2k] on rank 0 (CPU), None on the
    others."""
    model.eval()
    return per_token(lambda part, _: top_logprobs(
        model, part, top_k, pad_id=pad_id, temperature=temperature, device=ranks.device,
        remove_padding=micro.remove_padding, replay_routes=micro.replay_routes), batch, micro, ranks=ranks)


def batched_values(model: HFModel, batch: SequenceBatch, pad_id: int, *, micro: MicroBatching,
                   ranks: Ranks) -> torch.Tensor | None:
    """Values before every response token without gradients: flat [T] on rank 0 (CPU), None on the others."""
    model.eval()
    return per_token(lambda part, _: response_values(model, part, pad_id, device=ranks.device,
                                                     remove_padding=micro.remove_padding),
                     batch, micro, ranks=ranks)
