"""The optional supervised warm start before RL: the actor learns the rows' ground-truth responses.

Choices:
- actor_rollout_ref.actor.warm_start.steps supervised steps of batch_size rows each, drawn shuffled (seeded from
  trainer.seed + 1), on the run's rows or, with own_rows, on rows set aside for it that RL never draws.
- The response it teaches is the row's worked solution (extra_info.answer, as verl's GSM8K preprocessing keeps
  it) where it has one, else its ground truth, ending in EOS.
"""

from __future__ import annotations

import time

import torch

from services.common.sequences import SequenceBatch, join_ragged
from services.coordinator.clients import TrainerClient
from services.coordinator.sampler import PromptSampler, split_rows
from services.coordinator.settings import LoopSettings
from services.coordinator.waiting import Notices
from services.run.data import Prompt


def warm_start_rows(settings: LoopSettings, prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """The warm start's rows and RL's: with warm_start.own_rows, a split of ``prompts`` (the same every time),
    else both all of them."""
    if not settings.warm_start_own_rows:
        return prompts, prompts
    taught, rest = split_rows(len(prompts), settings.warm_start_steps * settings.warm_start_batch_size,
                              settings.seed)
    return [prompts[i] for i in taught], [prompts[i] for i in rest]


class WarmStart:
    def __init__(self, *, settings: LoopSettings, actor: TrainerClient, prompts: list[Prompt], tokenizer,
                 notices: Notices, timeout_s: float):
        """``prompts``: the warm start's rows; ``tokenizer``: the model's, to encode the responses it teaches."""
        self.settings, self.actor, self.prompts, self.tokenizer = settings, actor, prompts, tokenizer
        self.notices, self.timeout_s = notices, timeout_s

    async def run(self) -> int:
        """Supervised steps on the ground-truth responses; returns the trainer's weight version."""
        steps, version = self.settings.warm_start_steps, 0
        if not steps:
            return version
        sampler = PromptSampler(len(self.prompts), self.settings.warm_start_batch_size, True, self.settings.seed + 1)
        started = time.monotonic()
        for index in range(steps):
            chosen = [self.prompts[i] for i in sampler.next_batch()]
            batch = make_batch([p.token_ids for p in chosen], [self.encode_target(p) for p in chosen])
            metrics, version = await self.actor.train_supervised(batch, 0, self.timeout_s)
            if (index + 1) % max(1, steps // 5) == 0:
                self.notices.log(f"warm start {index + 1}/{steps}: loss {metrics['warm_start/loss']:.3f}, "
                                 f"lr {metrics['warm_start/lr']:.2g} ({time.monotonic() - started:.0f} s)")
        return version

    def encode_target(self, prompt: Prompt) -> list[int]:
        """The response the warm start teaches, ending in EOS: the row's worked solution (extra_info.answer, as
        verl's GSM8K preprocessing keeps it) where it has one, else its ground truth."""
        target = prompt.extra_info.get("answer") or prompt.ground_truth
        ids = self.tokenizer(str(target), add_special_tokens=False)["input_ids"]
        return [*ids, self.tokenizer.eos_token_id]


def make_batch(prompts: list[list[int]], responses: list[list[int]]) -> SequenceBatch:
    prompt_ids, prompt_lens = join_ragged([torch.tensor(p) for p in prompts], torch.int64)
    response_ids, response_lens = join_ragged([torch.tensor(r) for r in responses], torch.int64)
    return SequenceBatch(prompt_ids, prompt_lens, response_ids, response_lens)
