"""Prompts for a run: verl-schema rows from local parquet or JSONL files.

Each row needs ``data_source`` (picks the scorer), the prompt (chat messages
or a string, under ``data.prompt_key``) and ``reward_model.ground_truth``.
A bad row is refused when the data is loaded, with its file and row number.
Prompts are rendered with the tokenizer's chat template when it has one,
else the messages' contents are joined as plain text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict[str, Any]


def read_rows(path: Path) -> list[tuple[int, Any]]:
    """(row number, row) pairs: the 1-based line of a JSONL file (blank lines skipped), or parquet row."""
    if not path.exists():
        raise ValueError(f"data file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), start=1))
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} row {number}: not valid JSON ({error.msg})") from None
        return rows
    raise ValueError(f"data file {path}: expected .parquet or .jsonl, got {path.suffix!r}")


def render_prompt(prompt: Any, tokenizer) -> str:
    if isinstance(prompt, str):
        return prompt
    messages = list(prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(message["content"] for message in messages)


def prompt_from_row(row: Any, prompt_key: str, source_key: str, tokenizer, max_len: int) -> Prompt:
    """One validated, tokenised prompt; ValueError names what is wrong with the row."""
    if not isinstance(row, dict):
        raise ValueError(f"a row must be a JSON object, not {type(row).__name__}")
    for key in (source_key, prompt_key, "reward_model"):
        if row.get(key) in (None, ""):
            raise ValueError(f"missing field {key!r}")
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise ValueError("missing field 'reward_model.ground_truth'")
    prompt = row[prompt_key]
    if not isinstance(prompt, str) and not (
        isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "content" in m for m in prompt)
    ):
        raise ValueError(f"field {prompt_key!r} must be a string or a list of chat messages with 'content'")
    token_ids = tokenizer(render_prompt(prompt, tokenizer), add_special_tokens=False)["input_ids"]
    if not token_ids:
        raise ValueError("empty prompt")
    if len(token_ids) > max_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens, over data.max_prompt_length={max_len}")
    extra = row.get("extra_info") or {}
    return Prompt(token_ids, str(row[source_key]), str(reward_model["ground_truth"]), dict(extra))


def load_prompts(files: list[str], prompt_key: str, source_key: str, tokenizer, max_len: int) -> list[Prompt]:
    prompts = []
    for name in files:
        path = Path(name)
        for number, row in read_rows(path):
            try:
                prompts.append(prompt_from_row(row, prompt_key, source_key, tokenizer, max_len))
            except ValueError as error:
                raise ValueError(f"{path} row {number}: {error}") from None
    if not prompts:
        raise ValueError(f"no prompts in {files}")
    return prompts


class PromptSampler:
    """Batches of prompt indices, epoch after epoch, shuffled per epoch from a seed.

    Its whole state is (epoch, position): the order is a function of the seed
    and the epoch, so a run can be resumed from those two numbers.
    """

    def __init__(self, size: int, batch_size: int, shuffle: bool, seed: int):
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
