"""Padding-free batches of prompt + response token sequences.

A batch of B sequences is stored flat: all prompt tokens concatenated with
their lengths, all response tokens concatenated with theirs. Token-level
values (logprobs, advantages) are flat tensors aligned with ``response_ids``.
In a multi-turn response, tool and environment tokens sit among the model's:
``loss_mask`` says which response tokens are the model's, the ones that train.
This is the form batches travel in, between every service.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

NO_ROUTE = -1
"""Routing replay: a position given no routed experts (padding, a sequence's last token); its router chooses."""


def split_ragged(flat: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """Cut a flat tensor into B pieces of the given lengths."""
    return list(torch.split(flat, lengths.tolist()))


def join_ragged(pieces: Sequence[torch.Tensor | Sequence[int]],
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate pieces (tensors or lists) into (flat, lengths)."""
    lengths = torch.tensor([len(p) for p in pieces], dtype=torch.int64)
    flat = torch.cat([torch.as_tensor(p, dtype=dtype) for p in pieces]) if pieces else torch.zeros(0, dtype=dtype)
    return flat, lengths


def ragged_index(lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Flat indices of the given rows' tokens, in the order given. [B], [R] -> [sum of their lengths]."""
    starts = torch.cumsum(lengths, 0) - lengths
    pieces = [torch.arange(int(starts[r]), int(starts[r] + lengths[r])) for r in rows.tolist()]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)


def ragged_select(flat: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The flat tokens of the given rows, in the order given."""
    return flat[ragged_index(lengths, rows)]


@dataclass(frozen=True, kw_only=True)
class Padded:
    """A view of a SequenceBatch for a causal LM forward pass: rows right-padded (``padded``), or all
    sequences packed into one row without padding (``packed``)."""

    input_ids: torch.Tensor  # [B, L] int64, prompt then response then pad; packed: [1, N]
    attention_mask: torch.Tensor | None  # [B, L] int64; packed: None
    response_mask: torch.Tensor  # [B, L-1] bool: position t predicts a response token at t+1
    position_ids: torch.Tensor | None = None  # packed: [1, N], restarting at 0 for each sequence
    cu_seqlens: torch.Tensor | None = None  # packed: [B+1] int32, where each sequence starts, then N
    max_seqlen: int = 0  # packed: the longest sequence
    routed_experts: torch.Tensor | None = None  # [B, L, layers, k] int64: each position's routes, NO_ROUTE where
    # none was recorded (padding, each sequence's last token); None: the batch carries none

    def to(self, device: torch.device | str) -> Padded:
        """The tensors the forward pass takes, on ``device``; the routed experts stay where they are."""
        def moved(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        return replace(self, input_ids=self.input_ids.to(device), attention_mask=moved(self.attention_mask),
                       response_mask=self.response_mask.to(device), position_ids=moved(self.position_ids),
                       cu_seqlens=moved(self.cu_seqlens))

    def gather_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """[B, L-1] values at predicting positions -> flat [T] aligned with response_ids."""
        return per_position[self.response_mask]


@dataclass(frozen=True, kw_only=True)
class SequenceBatch:
    prompt_ids: torch.Tensor  # [P] int64
    prompt_lens: torch.Tensor  # [B] int64
    response_ids: torch.Tensor  # [T] int64
    response_lens: torch.Tensor  # [B] int64
    loss_mask: torch.Tensor | None = None  # [T] bool: the model's tokens (they train); None: every response token
    routed_experts: torch.Tensor | None = None  # [sum of (sequence_lens - 1), layers, k] small ints: the experts
    # the rollout routed each token but each sequence's last to (routing replay); None: not recorded

    def __len__(self) -> int:
        return len(self.prompt_lens)

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_lens.sum())

    @property
    def sequence_lens(self) -> torch.Tensor:
        """Tokens of each sequence, prompt and response. [B]"""
        return self.prompt_lens + self.response_lens

    def token_index(self, rows: torch.Tensor) -> torch.Tensor:
        """Flat indices (into response_ids and token-aligned tensors) of the given rows' tokens, in order."""
        return ragged_index(self.response_lens, rows)

    def select(self, rows: torch.Tensor) -> SequenceBatch:
        """The sub-batch of the given rows (indices), in that order."""
        return SequenceBatch(
            prompt_ids=ragged_select(self.prompt_ids, self.prompt_lens, rows),
            prompt_lens=self.prompt_lens[rows],
            response_ids=ragged_select(self.response_ids, self.response_lens, rows),
            response_lens=self.response_lens[rows],
            loss_mask=None if self.loss_mask is None else self.loss_mask[self.token_index(rows)],
            routed_experts=None if self.routed_experts is None else ragged_select(
                self.routed_experts, self.sequence_lens - 1, rows),
        )

    def trained(self) -> torch.Tensor:
        """The loss mask, all True where the batch has none. [T] bool"""
        if self.loss_mask is None:
            return torch.ones(self.num_response_tokens, dtype=torch.bool)
        return self.loss_mask

    @staticmethod
    def of_lists(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 loss_masks: Sequence[Sequence[int]] | None = None) -> SequenceBatch:
        """A batch of token ids given as lists: prompt i with response i (and its loss mask, where given)."""
        prompt_ids, prompt_lens = join_ragged(prompts, torch.int64)
        response_ids, response_lens = join_ragged(responses, torch.int64)
        loss_mask = None if loss_masks is None else join_ragged(loss_masks, torch.bool)[0]
        return SequenceBatch(prompt_ids=prompt_ids, prompt_lens=prompt_lens, response_ids=response_ids,
                             response_lens=response_lens, loss_mask=loss_mask)

    @staticmethod
    def concat(batches: list[SequenceBatch]) -> SequenceBatch:
        """One batch of all of ``batches``' sequences; it has a loss mask where any of them has one, routed
        experts where all of them have them."""
        def joined(field: str) -> torch.Tensor:
            return torch.cat([getattr(b, field) for b in batches])

        loss_mask = None if all(b.loss_mask is None for b in batches) else torch.cat([b.trained() for b in batches])
        routed = all(b.routed_experts is not None for b in batches) and bool(batches)
        return SequenceBatch(prompt_ids=joined("prompt_ids"), prompt_lens=joined("prompt_lens"),
                             response_ids=joined("response_ids"), response_lens=joined("response_lens"),
                             loss_mask=loss_mask, routed_experts=joined("routed_experts") if routed else None)

    def position_routes(self) -> list[torch.Tensor]:
        """Each sequence's routed experts, one row per position ([S, layers, k] int64), the last NO_ROUTE."""
        assert self.routed_experts is not None
        pieces = split_ragged(self.routed_experts.long(), self.sequence_lens - 1)
        return [torch.nn.functional.pad(piece, (0, 0, 0, 0, 0, 1), value=NO_ROUTE) for piece in pieces]

    def padded(self, pad_id: int = 0) -> Padded:
        """Right-padded prompt+response rows and the mask of response predictions."""
        prompts = split_ragged(self.prompt_ids, self.prompt_lens)
        responses = split_ragged(self.response_ids, self.response_lens)
        total = (self.prompt_lens + self.response_lens).tolist()
        width = max(total, default=1)
        input_ids = torch.full((len(self), width), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(self), width), dtype=torch.int64)
        response_mask = torch.zeros((len(self), max(width - 1, 0)), dtype=torch.bool)
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            sequence = torch.cat([prompt, response])
            input_ids[row, : len(sequence)] = sequence
            attention_mask[row, : len(sequence)] = 1
            response_mask[row, len(prompt) - 1 : len(sequence) - 1] = True
        routes = None
        if self.routed_experts is not None:
            routes = torch.full((len(self), width, *self.routed_experts.shape[1:]), NO_ROUTE, dtype=torch.int64)
            for row, piece in enumerate(self.position_routes()):
                routes[row, : len(piece)] = piece
        return Padded(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                      routed_experts=routes)

    def packed(self) -> Padded:
        """All sequences in one row, no padding, position ids restarting at 0 for each sequence, and the
        sequences' bounds (``cu_seqlens``) for a variable-length attention kernel.

        Given position ids and no attention mask, transformers' causal LMs attend within each sequence only
        (under sdpa it finds the sequences where the position ids restart; the trainer's varlen attention
        takes ``cu_seqlens``), so each sequence's outputs are those of its padded row."""
        lengths = self.sequence_lens.tolist()
        prompts = split_ragged(self.prompt_ids, self.prompt_lens)
        responses = split_ragged(self.response_ids, self.response_lens)
        input_ids = torch.cat([torch.cat([p, r]) for p, r in zip(prompts, responses)]) if lengths else (
            torch.zeros(0, dtype=torch.int64))
        position_ids = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)
        response_mask = torch.zeros(max(len(input_ids) - 1, 0), dtype=torch.bool)
        start = 0
        for prompt_len, length in zip(self.prompt_lens.tolist(), lengths):
            response_mask[start + prompt_len - 1 : start + length - 1] = True
            start += length
        starts = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
        routes = None if self.routed_experts is None else torch.cat(self.position_routes())[None]
        return Padded(input_ids=input_ids[None], attention_mask=None, response_mask=response_mask[None],
                      position_ids=position_ids[None], cu_seqlens=starts, max_seqlen=max(lengths, default=0),
                      routed_experts=routes)
