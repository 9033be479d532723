"""The trainer servicer's edge: a batch as the coordinator sends it (``clients.sequence_tensors``, streamed as
BatchRequests) is read back by ``read_batch`` into the worker's SequenceBatch, with its loss mask or without."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.limits import StreamLimits
from services.common.sequences import SequenceBatch
from services.coordinator.fleet.clients import batch_requests, sequence_tensors
from services.trainer.server import read_batch
from services.trainer.worker import sequences

LIMITS = StreamLimits(max_bytes=1 << 20, timeout_s=10.0)


def round_trip(tensors: dict[str, torch.Tensor], extra: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    async def stream():
        for request in batch_requests(tensors, step=3):
            yield request

    first, batch = asyncio.run(read_batch(stream(), LIMITS, extra))
    step = first.step
    assert step == 3
    return batch


def with_mask(batch: SequenceBatch, mask: list[bool]) -> SequenceBatch:
    return SequenceBatch(prompt_ids=batch.prompt_ids, prompt_lens=batch.prompt_lens, response_ids=batch.response_ids,
                         response_lens=batch.response_lens,
                         loss_mask=torch.tensor(mask))


def test_a_batch_with_a_loss_mask_arrives_with_it():
    sent = with_mask(SequenceBatch.of_lists([[5, 6], [7]], [[8, 9, 10], [11, 12]]), [True, False, True, True, False])
    advantages = torch.arange(5, dtype=torch.float32)
    received = round_trip({**sequence_tensors(sent), "advantages": advantages}, extra=("advantages",))
    assert torch.equal(received["advantages"], advantages)
    batch = sequences(received)
    for field in ("prompt_ids", "prompt_lens", "response_ids", "response_lens", "loss_mask"):
        assert torch.equal(getattr(batch, field), getattr(sent, field)), field


def test_a_batch_without_one_arrives_as_before():
    sent = SequenceBatch.of_lists([[5, 6], [7]], [[8, 9, 10], [11, 12]])
    assert set(sequence_tensors(sent)) == {"prompt_ids", "prompt_lens", "response_ids", "response_lens"}
    received = round_trip(sequence_tensors(sent))
    assert "loss_mask" not in received
    assert sequences(received).loss_mask is None


@pytest.mark.parametrize("mask", [torch.tensor([1, 0, 1, 1, 0]), torch.tensor([True, False, True])])
def test_a_loss_mask_not_one_bool_per_response_token_is_refused(mask):
    tensors = {**sequence_tensors(SequenceBatch.of_lists([[5, 6], [7]], [[8, 9, 10], [11, 12]])), "loss_mask": mask}
    with pytest.raises(ValueError, match="loss_mask must be a bool tensor with one value per response token"):
        round_trip(tensors)
