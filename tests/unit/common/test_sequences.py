"""CPU tests of services/common/sequences.py (padding-free batches and their padded view)."""

from __future__ import annotations

import torch

from services.common.sequences import SequenceBatch, join_ragged, ragged_select, split_ragged


def _batch(prompts: list[list[int]], responses: list[list[int]]) -> SequenceBatch:
    prompt_ids, prompt_lens = join_ragged([torch.tensor(p, dtype=torch.int64) for p in prompts], torch.int64)
    response_ids, response_lens = join_ragged([torch.tensor(r, dtype=torch.int64) for r in responses], torch.int64)
    return SequenceBatch(prompt_ids=prompt_ids, prompt_lens=prompt_lens, response_ids=response_ids,
                         response_lens=response_lens)


def _rows(flat: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
    return [piece.tolist() for piece in split_ragged(flat, lengths)]


def test_join_split_round_trip():
    pieces = [[1, 2, 3], [], [4], [5, 6]]
    flat, lengths = join_ragged([torch.tensor(p) for p in pieces], torch.int64)
    assert flat.tolist() == [1, 2, 3, 4, 5, 6] and flat.dtype == torch.int64
    assert lengths.tolist() == [3, 0, 1, 2] and lengths.dtype == torch.int64
    assert _rows(flat, lengths) == pieces
    # plain lists are accepted and cast to the dtype
    flat, lengths = join_ragged([[0.5, 1.5], [2.5]], torch.float32)
    assert flat.dtype == torch.float32 and [p.tolist() for p in split_ragged(flat, lengths)] == [[0.5, 1.5], [2.5]]


def test_join_ragged_of_nothing():
    flat, lengths = join_ragged([], torch.int64)
    assert flat.shape == (0,) and flat.dtype == torch.int64
    assert lengths.shape == (0,)
    assert split_ragged(flat, lengths) == []


def test_ragged_select():
    flat, lengths = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([3, 0, 1, 2])
    assert ragged_select(flat, lengths, torch.tensor([3, 0])).tolist() == [5, 6, 1, 2, 3]
    assert ragged_select(flat, lengths, torch.tensor([1, 2, 2])).tolist() == [4, 4]
    assert ragged_select(flat, lengths, torch.tensor([], dtype=torch.int64)).tolist() == []


def test_select_reorders_and_repeats_rows():
    batch = _batch([[5, 6, 7], [8], [1, 2]], [[9, 10], [11, 12, 13], [3]])
    assert len(batch) == 3 and batch.num_response_tokens == 6
    sub = batch.select(torch.tensor([2, 0, 2]))
    assert _rows(sub.prompt_ids, sub.prompt_lens) == [[1, 2], [5, 6, 7], [1, 2]]
    assert _rows(sub.response_ids, sub.response_lens) == [[3], [9, 10], [3]]
    assert len(sub) == 3 and sub.num_response_tokens == 4
    empty = batch.select(torch.tensor([], dtype=torch.int64))
    assert len(empty) == 0 and empty.num_response_tokens == 0 and empty.prompt_ids.numel() == 0


def test_the_loss_mask_follows_the_rows_it_belongs_to():
    batch = _batch([[5, 6, 7], [8], [1, 2]], [[9, 10], [11, 12, 13], [3]])
    assert batch.loss_mask is None and batch.trained().tolist() == [True] * 6
    assert batch.select(torch.tensor([1])).loss_mask is None
    tools = SequenceBatch(prompt_ids=batch.prompt_ids, prompt_lens=batch.prompt_lens, response_ids=batch.response_ids,
                          response_lens=batch.response_lens,
                          loss_mask=torch.tensor([True, False, True, False, True, True]))
    assert tools.select(torch.tensor([2, 1])).loss_mask.tolist() == [True, True, False, True]


def test_concat_has_a_loss_mask_where_any_part_has_one():
    plain = _batch([[5]], [[9, 10]])
    tools = SequenceBatch(prompt_ids=plain.prompt_ids, prompt_lens=plain.prompt_lens, response_ids=plain.response_ids,
                          response_lens=plain.response_lens,
                          loss_mask=torch.tensor([False, True]))
    assert SequenceBatch.concat([plain, plain]).loss_mask is None
    assert SequenceBatch.concat([plain, tools]).loss_mask.tolist() == [True, True, False, True]


def test_padded_by_hand():
    # row 0: prompt [5, 6, 7], response [9, 10]      -> 5 tokens
    # row 1: prompt [8],       response [11, 12, 13] -> 4 tokens, one pad
    batch = _batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]])
    padded = batch.padded(pad_id=99)
    assert padded.input_ids.tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 99]]
    assert padded.input_ids.dtype == torch.int64
    assert padded.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # position t predicts token t+1; response tokens sit at 3, 4 (row 0) and 1, 2, 3 (row 1),
    # so the predicting positions are 2, 3 and 0, 1, 2.
    assert padded.response_mask.tolist() == [
        [False, False, True, True],
        [True, True, True, False],
    ]
    assert padded.response_mask.dtype == torch.bool


def test_gather_response_is_aligned_with_response_ids():
    batch = _batch([[5, 6, 7], [8], [1, 2, 3, 4]], [[9, 10], [11, 12, 13], []])
    padded = batch.padded()
    # the value at predicting position t is the token at t+1: gathering it gives back response_ids
    next_tokens = padded.input_ids[:, 1:]
    assert padded.gather_response(next_tokens).tolist() == batch.response_ids.tolist() == [9, 10, 11, 12, 13]
    # with logits: a one-hot "model" that puts all mass on the next token gives logprob 0 everywhere
    logits = torch.nn.functional.one_hot(next_tokens, 20).float() * 50.0
    logprobs = padded.gather_response(torch.log_softmax(logits, -1).gather(-1, next_tokens.unsqueeze(-1)).squeeze(-1))
    assert logprobs.shape == (batch.num_response_tokens,)
    torch.testing.assert_close(logprobs, torch.zeros(5), atol=1e-6, rtol=0)


def test_padded_default_pad_and_all_same_length():
    batch = _batch([[1], [2]], [[3, 4], [5, 6]])
    padded = batch.padded()
    assert padded.input_ids.tolist() == [[1, 3, 4], [2, 5, 6]]
    assert padded.attention_mask.tolist() == [[1, 1, 1], [1, 1, 1]]
    assert padded.response_mask.tolist() == [[True, True], [True, True]]


def test_packed_by_hand():
    batch = _batch([[1, 2], [3, 4, 5], [6]], [[7], [], [8, 9, 10]])
    packed = batch.packed()
    assert packed.input_ids.tolist() == [[1, 2, 7, 3, 4, 5, 6, 8, 9, 10]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2, 3]]  # restarting for each sequence
    assert packed.attention_mask is None
    # position t predicts token t+1: 2 -> 7 in the first sequence, 6 -> 8, 8 -> 9, 9 -> 10 in the third
    assert packed.response_mask.int().tolist() == [[0, 1, 0, 0, 0, 0, 1, 1, 1]]
    assert packed.gather_response(packed.input_ids[:, 1:]).tolist() == batch.response_ids.tolist()


def test_packed_forward_equals_the_padded_one(tmp_path):
    """The packed row gives each sequence's outputs exactly as its padded row does (transformers' causal LM
    attends within each sequence when position ids restart; float64, so equal means equal math)."""
    from services.run.models import load_causal_lm
    from services.coordctl.tiny_model import build_tiny_model

    model = load_causal_lm(build_tiny_model(tmp_path / "tiny", 32, 2, num_heads=2, seed=0)).double().eval()
    batch = _batch([[5, 6, 7], [8], [9, 10, 11, 12]], [[13, 14], [15, 16, 17, 18], [19]])
    with torch.no_grad():
        padded, packed = batch.padded(0), batch.packed()
        by_rows = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, use_cache=False).logits
        in_one = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        unpacked = model(input_ids=packed.input_ids, use_cache=False).logits  # positions running on: attends across
    expected = padded.gather_response(by_rows[:, :-1])
    torch.testing.assert_close(packed.gather_response(in_one[:, :-1]), expected, rtol=0, atol=1e-12)
    assert (packed.gather_response(unpacked[:, :-1]) - expected).abs().max() > 1e-3
