"""A reward model: a local AutoModelForSequenceClassification folder with one output, batched.

The text it reads is the prompt followed by the response, as decoded by the
coordinator. Padding is on the right with the model's pad id, so that the
model's own rule (the score at the last non-pad token) applies; a batch
gives each sequence the same score it gets alone.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from services.run.models import load_tokenizer


class RewardModel:
    def __init__(self, path: str, device: str, batch_size: int):
        from transformers import AutoModelForSequenceClassification

        folder = Path(path)
        if not (folder / "config.json").exists():
            raise ValueError(f"reward model {path}: no config.json in that folder")
        self.tokenizer = load_tokenizer(folder)
        self.model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).to(device).eval()
        if self.model.config.pad_token_id is None:
            raise ValueError(f"reward model {path}: config.json needs pad_token_id to find each sequence's end")
        self.device, self.batch_size = device, batch_size
        self._lock = threading.Lock()  # one forward at a time, whichever scoring thread asks

    @torch.no_grad()
    def score(self, texts: list[str]) -> list[float]:
        """One score per text, in batches."""
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] or [self.model.config.pad_token_id]
                   for t in texts[start : start + self.batch_size]]
            width = max(len(x) for x in ids)
            input_ids = torch.full((len(ids), width), self.model.config.pad_token_id, dtype=torch.int64)
            mask = torch.zeros_like(input_ids)
            for row, sequence in enumerate(ids):
                input_ids[row, : len(sequence)] = torch.tensor(sequence)
                mask[row, : len(sequence)] = 1
            with self._lock:
                logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores
