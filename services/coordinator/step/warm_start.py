"""The optional supervised warm start before RL: the actor learns the rows' ground-truth responses.

Choices:
- actor_rollout_ref.actor.warm_start.steps supervised steps of batch_size rows each, drawn shuffled (seeded from
  trainer.seed + 1), on the run's rows or, with own_rows, on rows set aside for it that RL never draws.
- The response it teaches is the row's worked solution (extra_info.answer, as verl's GSM8K preprocessing keeps
  it) where it has one, else its ground truth, ending in EOS.
- A stop asked during the warm start lands at its next step boundary: ``progress`` (the steps taught and its
  sampler's place) goes into the checkpoint the loop then saves as step 0, beside the trainer's weights and the
  warm start's optimizer and schedule, and a resume goes on from the next step with the rows it would have drawn.
- A row with a worked multi-turn trajectory (extra_info.turns: the chat messages after the prompt, assistant
  turns and tool replies) is taught token-exactly as the agent loop would produce it (turns.py): the prompt
  rendered by the chat template with the run's tools, then each assistant message's text and EOS (trained),
  each run of tool messages as ``render_reply`` appends them (loss mask 0: not trained).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, NamedTuple

import torch

from services.common.sequences import SequenceBatch
from services.coordinator.fleet.clients import TrainerClient
from services.coordinator.step.sampler import PromptSampler, split_rows
from services.coordinator.settings import LoopSettings
from services.coordinator.agent.turns import (
    CannotExtend, OverBudget, ReplyTokens, SampledTokens, Trajectory, extend, render_prompt, render_reply,
)
from services.coordinator.waiting import Notices
from services.run.data import Prompt


class Taught(NamedTuple):
    """One sequence the warm start teaches: its prompt, its response, and which response tokens train."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[bool]


def warm_start_rows(settings: LoopSettings, prompts: list[Prompt]) -> tuple[list[Prompt], list[Prompt]]:
    """The warm start's rows and RL's: with warm_start.own_rows, a split of ``prompts`` (the same every time),
    else both all of them."""
    if not settings.warm_start_own_rows:
        return prompts, prompts
    taught, rest = split_rows(len(prompts), settings.warm_start_steps * settings.warm_start_batch_size,
                              settings.seed)
    return [prompts[i] for i in taught], [prompts[i] for i in rest]


class WarmStartProgress(NamedTuple):
    """How far a warm start has gone: the steps taught, and its sampler's place right after the last batch drawn."""

    taught: int
    epoch: int
    position: int

    @classmethod
    def done(cls, steps: int) -> WarmStartProgress:
        """A warm start of ``steps`` steps over (a checkpoint taken after it, which keeps no progress)."""
        return cls(taught=steps, epoch=0, position=0)

    @classmethod
    def of_state(cls, state: dict | None) -> WarmStartProgress | None:
        """The progress a checkpoint's loop state records (None: none, as in a checkpoint of an RL step)."""
        return None if state is None else cls(taught=state["taught"], epoch=state["epoch"], position=state["position"])


class WarmStart:
    def __init__(self, *, settings: LoopSettings, actor: TrainerClient, prompts: list[Prompt], tokenizer,
                 notices: Notices, timeout_s: float, should_stop: Callable[[], bool] = lambda: False):
        """``prompts``: the warm start's rows; ``tokenizer``: the model's, to encode the responses it teaches. A
        worked trajectory's tool replies are cut as the agent loop cuts them (multi_turn.max_tool_response_length
        and tool_response_truncate_side; a single-turn run: only data.max_response_length bounds them).
        ``should_stop``: asked before each step; once True, the warm start ends there (``progress`` says where)."""
        self.settings, self.actor, self.prompts, self.tokenizer = settings, actor, prompts, tokenizer
        self.notices, self.timeout_s, self.should_stop = notices, timeout_s, should_stop
        agent = settings.agent
        self.max_reply_tokens = agent.max_reply_tokens if agent is not None else None
        self.truncate_side = agent.truncate_side if agent is not None else "middle"
        self.progress = WarmStartProgress(taught=0, epoch=0, position=0)

    async def run(self, tools: tuple[dict[str, Any], ...] = (), resume: WarmStartProgress | None = None,
                  version: int = 0) -> int:
        """Supervised steps on the ground-truth responses, from ``resume`` (where a stopped warm start left off;
        None: the first step) until the last or a stop; returns the trainer's weight version (``version``, that
        of the weights it starts from, if it teaches nothing). ``tools``: the OpenAI schemas of a multi-turn
        run's tools (rendered into its trajectories' prompts as the agent loop renders them), () for a
        single-turn run."""
        steps = self.settings.warm_start_steps
        sampler = PromptSampler(len(self.prompts), self.settings.warm_start_batch_size, True,
                                seed=self.settings.seed + 1)
        self.progress = resume or self.progress
        sampler.epoch, sampler.position = self.progress.epoch, self.progress.position
        started = time.monotonic()
        for index in range(self.progress.taught, steps):
            if self.should_stop():
                self.notices.log(f"warm start stopped after {index}/{steps} steps: a resume goes on from step "
                                 f"{index + 1}")
                break
            batch = make_taught_batch([self.taught(self.prompts[i], tools) for i in sampler.next_batch()])
            metrics, version = await self.actor.train_supervised(batch, 0, self.timeout_s)
            self.progress = WarmStartProgress(taught=index + 1, epoch=sampler.epoch, position=sampler.position)
            if (index + 1) % max(1, steps // 5) == 0:
                self.notices.log(f"warm start {index + 1}/{steps}: loss {metrics['warm_start/loss']:.3f}, "
                                 f"lr {metrics['warm_start/lr']:.2g} ({time.monotonic() - started:.0f} s)")
        return version

    def taught(self, prompt: Prompt, tools: tuple[dict[str, Any], ...] = ()) -> Taught:
        """What the warm start teaches of a row: its worked trajectory (extra_info.turns, its prompt rendered with
        ``tools``) where it has one, else its prompt and target response, every token trained."""
        if "turns" in prompt.extra_info:
            return self.encode_trajectory(prompt, tools)
        target = self.encode_target(prompt)
        return Taught(prompt_ids=prompt.token_ids, response_ids=target, loss_mask=[True] * len(target))

    def encode_trajectory(self, prompt: Prompt, tools: tuple[dict[str, Any], ...]) -> Taught:
        """A row's worked trajectory as the agent loop would build it: the prompt rendered with the tools, each
        assistant message's text and EOS (trained), each run of tool messages as render_reply appends them after
        it (not trained). ValueError naming the row if its turns are malformed or do not fit
        data.max_response_length."""
        where = f"row {prompt.extra_info.get('index', '?')}: extra_info.turns"
        turns = prompt.extra_info["turns"]
        if not isinstance(turns, list) or not turns or not all(
                isinstance(m, dict) and m.get("role") in ("assistant", "tool") for m in turns):
            raise ValueError(f"{where} must be a list of assistant and tool messages")
        if turns[0]["role"] != "assistant":
            raise ValueError(f"{where} must start with an assistant message")
        if any(a["role"] == b["role"] == "assistant" for a, b in itertools.pairwise(turns)):
            raise ValueError(f"{where} has two assistant messages in a row (a turn without replies ends a "
                             "trajectory)")
        too_long = f"{where} do not fit data.max_response_length ({self.settings.sampling.max_new_tokens} tokens)"
        template_kwargs = {"tools": list(tools)} if tools else {}
        messages: tuple = tuple(prompt.messages)
        trajectory = Trajectory(prompt_ids=render_prompt(self.tokenizer, messages, template_kwargs),
                                max_response_length=self.settings.sampling.max_new_tokens)
        sampled: tuple[int, ...] = ()
        for index, group in enumerate(role_runs(turns)):
            if group[0]["role"] == "assistant":
                text = str(group[0].get("content", ""))
                sampled = (*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id)
                appended: SampledTokens | ReplyTokens = SampledTokens(ids=sampled, logprobs=(0.0,) * len(sampled),
                                                                      weight_version=0)
            else:
                replies = render_reply(self.tokenizer, messages=messages, sampled_ids=sampled, replies=group,
                                       room=trajectory.room, template_kwargs=template_kwargs,
                                       max_reply_tokens=self.max_reply_tokens or trajectory.room,
                                       truncate_side=self.truncate_side)
                if isinstance(replies, CannotExtend):
                    raise ValueError(f"{where}: the replies of part {index} cannot be appended: {replies.reason}")
                if isinstance(replies, OverBudget):
                    raise ValueError(too_long)
                messages, appended = replies.messages, replies
            if len(appended.ids) > trajectory.room:
                raise ValueError(too_long)
            trajectory = extend(trajectory, appended)
        return Taught(prompt_ids=list(trajectory.prompt_ids), response_ids=list(trajectory.response_ids),
                      loss_mask=[bool(kept) for kept in trajectory.loss_mask])

    def encode_target(self, prompt: Prompt) -> list[int]:
        """The response the warm start teaches, ending in EOS: the row's worked solution (extra_info.answer, as
        verl's GSM8K preprocessing keeps it) where it has one, else its ground truth."""
        target = prompt.extra_info.get("answer") or prompt.ground_truth
        ids = self.tokenizer(str(target), add_special_tokens=False)["input_ids"]
        return [*ids, self.tokenizer.eos_token_id]


def role_runs(messages: list[dict]) -> list[list[dict]]:
    """``messages`` cut where the model's turns begin and end: each assistant message alone, each run of other
    messages (the replies to one turn) together."""
    runs: list[list[dict]] = []
    for message in messages:
        if runs and message["role"] != "assistant" and runs[-1][0]["role"] != "assistant":
            runs[-1].append(message)
        else:
            runs.append([message])
    return runs


def make_taught_batch(taught: list[Taught]) -> SequenceBatch:
    """The sequences as one batch; with a loss mask where any of them leaves a token untrained."""
    batch = SequenceBatch.of_lists([t.prompt_ids for t in taught], [t.response_ids for t in taught])
    mask = [kept for t in taught for kept in t.loss_mask]
    return batch if all(mask) else SequenceBatch(prompt_ids=batch.prompt_ids, prompt_lens=batch.prompt_lens,
                                                 response_ids=batch.response_ids,
                                                  response_lens=batch.response_lens, loss_mask=torch.tensor(mask,
                                                                                                            dtype=torch.bool))

