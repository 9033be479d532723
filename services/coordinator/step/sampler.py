"""The order in which a run takes its prompts: batches, epoch after epoch."""

from __future__ import annotations

import torch


class PromptSampler:
    """Batches of prompt indices, epoch after epoch, shuffled per epoch from a seed.

    Its whole state is (epoch, position): the order is a function of the seed
    and the epoch, so a run can be resumed from those two numbers.
    """

    def __init__(self, size: int, batch_size: int, shuffle: bool, *, seed: int):
        if batch_size > size:
            raise ValueError(f"data.train_batch_size ({batch_size}) is larger than the dataset ({size} prompts)")
        self.size, self.batch_size, self.shuffle, self.seed = size, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed * 100_003 + self.epoch))

    def next_batch(self) -> list[int]:
        """The next batch_size indices; a partial tail of an epoch is skipped."""
        if self.position + self.batch_size > self.size:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order()[self.position : self.position + self.batch_size].tolist()
        self.position += self.batch_size
        return batch


def split_rows(size: int, count: int, seed: int) -> tuple[list[int], list[int]]:
    """``count`` of the indices 0..size-1 chosen by a shuffle seeded from ``seed``, and the others, each in
    increasing order (the same split every time: a resumed run draws from the same rows)."""
    chosen = torch.randperm(size, generator=torch.Generator().manual_seed(seed * 100_019 + 7))[:count]
    taken = torch.zeros(size, dtype=torch.bool)
    taken[chosen] = True
    return torch.nonzero(taken).flatten().tolist(), torch.nonzero(~taken).flatten().tolist()
