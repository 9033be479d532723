"""How rows are dealt to ranks and cut into micro-batches (services/trainer/batching.py), worked by hand."""

from __future__ import annotations

import torch

from services.trainer.batching import (MicroBatching, balanced_shares, by_token_budget, micro_batch_plan,
                                       with_stand_ins)

LENGTHS = torch.tensor([5, 1, 4, 6, 3])  # tokens of rows 0..4
ROWS = torch.arange(5)


def as_lists(batches: list[torch.Tensor]) -> list[list[int]]:
    return [batch.tolist() for batch in batches]


def test_rows_are_dealt_longest_first_to_the_rank_with_fewest_tokens():
    # 6 (row 3) -> rank 0; 5 (row 0) -> rank 1; 4 -> rank 1 (5 < 6); 3 -> rank 0 (6 < 9);
    # 1 -> rank 0 (9 = 9: the lower rank)
    assert as_lists(balanced_shares(LENGTHS, ROWS, 2)) == [[1, 3, 4], [0, 2]]  # 10 and 9 tokens, in the rows' order
    shuffled = torch.tensor([4, 2, 0, 3, 1])
    assert as_lists(balanced_shares(LENGTHS, shuffled, 2)) == [[4, 3, 1], [2, 0]]  # the given order is kept
    assert as_lists(balanced_shares(LENGTHS, shuffled, 1)) == [[4, 2, 0, 3, 1]]


def test_token_budget_counts_what_the_forward_pass_holds():
    # padded, budget 9: [6] (6 + 5 -> 2 x 6 = 12); [5] (2 x 5 = 10); [4, 3] (2 x 4 = 8; 3 x 4 = 12); [1]
    assert as_lists(by_token_budget(LENGTHS, ROWS, 9, remove_padding=False)) == [[3], [0], [2, 4], [1]]
    # packed, budget 9: [6] (6 + 5 = 11); [5, 4] (9; + 3 = 12); [3, 1]
    assert as_lists(by_token_budget(LENGTHS, ROWS, 9, remove_padding=True)) == [[3], [0, 2], [4, 1]]
    # packed, budget 4: the sequences over the budget get a micro-batch each; then [3, 1] (4)
    assert as_lists(by_token_budget(LENGTHS, ROWS, 4, remove_padding=True)) == [[3], [0], [2], [4, 1]]


def test_every_rank_gets_as_many_micro_batches_and_stand_ins_fill_the_gaps():
    plan = micro_batch_plan(LENGTHS, ROWS, 2, micro=MicroBatching(size=2))
    assert [as_lists(batches) for batches in plan] == [[[1, 3], [4]], [[0, 2], []]]
    assert [(rows.tolist(), real) for rows, real in with_stand_ins(plan[1], LENGTHS, ROWS)] == [
        ([0, 2], True), ([1], False)]  # the stand-in is the shortest row
    # rank 0's rows 1, 3, 4 (1, 6, 3 tokens) packed within 9: [6, 3], [1]; rank 1's 0, 2 (5, 4): [5, 4]
    budget = micro_batch_plan(LENGTHS, ROWS, 2, micro=MicroBatching(size=2, max_tokens=9, remove_padding=True))
    assert [as_lists(batches) for batches in budget] == [[[3, 4], [1]], [[0, 2], []]]
    assert micro_batch_plan(LENGTHS, ROWS[:0], 2, micro=MicroBatching(size=2)) == [[], []]
