"""The data section (verl's ``data``): the files a run trains and validates on, its batch of prompts, and how
long prompts and responses may be. The rows themselves are read by services/run/data.py."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import PositiveInt

from services.common.config import Section


def as_list(value: object) -> object:
    """verl takes one path or a list of them."""
    return [value] if isinstance(value, str) else value


class DataConfig(Section):
    train_files: list[str] = []
    """Local parquet or JSONL files in verl's schema (data_source, prompt, reward_model.ground_truth, ...)."""
    train_batch_size: PositiveInt = 32
    """Prompts per step."""
    max_prompt_length: PositiveInt = 512
    """Prompts with more tokens are refused when the data is loaded, naming the row."""
    max_response_length: PositiveInt = 256
    """Most tokens sampled per response."""
    prompt_key: str = "prompt"
    """Row field holding the prompt: a list of chat messages or a string."""
    reward_fn_key: str = "data_source"
    """Row field that picks the reward scorer."""
    shuffle: bool = True
    """Shuffle the rows each epoch (seeded by trainer.seed)."""
    val_files: list[str] = []
    """Held-out parquet or JSONL files in the same schema, for validation (trainer.test_freq,
    trainer.val_before_train, trainer.val_only): every row is generated with rollout.val_kwargs and scored by
    the run's reward services; empty = no validation (verl's data.val_files)."""
    val_batch_size: PositiveInt | None = None
    """verl's key, deprecated there: validation sends every held-out prompt at once, spread over the rollouts;
    accepted and not used."""
    filter_overlong_prompts: bool = False
    """Drop the rows whose prompt is longer than max_prompt_length (how many is an event of the run) instead of
    truncating or refusing them (verl's key)."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """A prompt longer than max_prompt_length that is not dropped: error = the data is refused, naming the
    row; left = its last max_prompt_length tokens are kept; right = its first; middle = its first and last
    halves (verl's key)."""

    return_raw_chat: bool = False
    """verl's key (its agent loop needs the chat messages, not the rendered prompt): meshrl keeps every row's
    messages beside its tokens, so it is accepted and changes nothing."""

    _one_or_more_files = pydantic.field_validator("train_files", "val_files", mode="before")(as_list)
