"""Which rows each rank takes, and how it cuts them into forward passes.

Every rank holds the whole batch and computes the same plan from the
sequence lengths, so no rank has to be told its rows and rank 0 knows where
each rank's results belong.

- Ranks: a mini-batch's rows are dealt longest first, each to the rank with
  the fewest tokens so far (ties to the lower rank); a rank keeps its rows in
  their given order. One rank takes them all, in order.
- Micro-batches: a fixed number of rows each (``ppo_micro_batch_size_per_gpu``),
  in order; or, with a token budget (``use_dynamic_bsz``), rows longest first,
  each micro-batch filled while its cost stays within the budget. The cost is
  what the forward pass holds: the tokens when it is padding-free
  (``use_remove_padding``), rows x the longest row when it pads each row to the
  longest. A sequence over the budget alone gets a micro-batch of its own.
- Every rank runs the same number of micro-batches, since FSDP's collectives
  must line up across ranks; a rank with fewer runs stand-ins (the shortest
  row of the mini-batch) whose loss counts zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.trainer.optim import chunks


@dataclass(frozen=True, kw_only=True)
class MicroBatching:
    """How a rank cuts its rows into forward passes."""

    size: int  # rows per micro-batch, when there is no token budget
    max_tokens: int | None = None  # token budget per micro-batch (verl's use_dynamic_bsz), or None
    remove_padding: bool = False  # the forward packs its rows into one (cost: tokens) or pads them (rows x longest)
    chunk_tokens: int = 0  # logprobs from the hidden states, this many tokens' logits at a time; 0 = all at once
    replay_routes: bool = False  # route by the batch's routed experts where it has them (R3); else only compare


def balanced_shares(lengths: torch.Tensor, rows: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Split ``rows`` among ``world_size`` ranks with about equal tokens each; each share keeps the given order.

    lengths: [B] tokens of every row of the batch; rows: [R] indices into it."""
    if world_size == 1:
        return [rows]
    loads = [0] * world_size
    members: list[list[int]] = [[] for _ in range(world_size)]
    for position in sorted(range(len(rows)), key=lambda i: (-int(lengths[rows[i]]), i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        members[rank].append(position)
        loads[rank] += int(lengths[rows[position]])
    return [rows[torch.tensor(sorted(positions), dtype=torch.int64)] for positions in members]


def by_token_budget(lengths: torch.Tensor, rows: torch.Tensor, max_tokens: int,
                    *, remove_padding: bool) -> list[torch.Tensor]:
    """Rows longest first, greedily into micro-batches whose cost stays within ``max_tokens``."""
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for row in sorted(rows.tolist(), key=lambda r: (-int(lengths[r]), r)):
        length = int(lengths[row])
        longest = int(lengths[current[0]]) if current else length
        cost = tokens + length if remove_padding else (len(current) + 1) * longest
        if current and cost > max_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(row)
        tokens += length
    if current:
        batches.append(current)
    return [torch.tensor(batch, dtype=torch.int64) for batch in batches]


def micro_batch_plan(lengths: torch.Tensor, rows: torch.Tensor, world_size: int,
                     *, micro: MicroBatching) -> list[list[torch.Tensor]]:
    """Each rank's micro-batches (row indices) of ``rows``; every rank gets as many, a missing one is empty."""
    per_rank = []
    for share in balanced_shares(lengths, rows, world_size):
        if micro.max_tokens is None:
            per_rank.append(list(chunks(share, micro.size)))
        else:
            per_rank.append(by_token_budget(lengths, share, micro.max_tokens, remove_padding=micro.remove_padding))
    count = max(len(batches) for batches in per_rank)
    empty = torch.zeros(0, dtype=torch.int64)
    return [batches + [empty] * (count - len(batches)) for batches in per_rank]


def with_stand_ins(batches: list[torch.Tensor], lengths: torch.Tensor,
                   rows: torch.Tensor) -> list[tuple[torch.Tensor, bool]]:
    """One rank's micro-batches (from ``micro_batch_plan``) as (rows, real); an empty one becomes a stand-in,
    the shortest of ``rows``, that is not real (its outputs and loss do not count)."""
    if not len(rows):
        return []
    stand_in = rows[torch.argmin(lengths[rows])].reshape(1)
    return [(batch, True) if len(batch) else (stand_in, False) for batch in batches]
