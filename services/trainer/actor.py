"""The actor: a causal LM with its optimizer, on one rank.

Called from the trainer's worker thread, one call at a time:
``compute_log_probs`` for the old-policy logprobs, ``update`` for one PPO
update over a batch, ``train_supervised`` for the warm start, and
``named_weights`` when the weights are broadcast to the rollout engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from services import algos
from services.common.sequences import SequenceBatch


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    grad_clip: float
    warmup_steps: int


@dataclass(frozen=True)
class PPOSettings:
    mini_batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per forward/backward
    epochs: int
    clip_ratio_low: float
    clip_ratio_high: float
    temperature: float


def micro_batches(rows: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """Consecutive slices of ``rows`` holding at most ``size`` rows each."""
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


class Actor:
    def __init__(self, model: torch.nn.Module, optim: OptimSettings, warm_start_lr: float, pad_id: int, seed: int):
        self.model = model
        self.pad_id = pad_id
        self.vocab_size = model.config.vocab_size
        self.device = next(model.parameters()).device
        self.warm_start_lr = warm_start_lr
        self._warm_start_optimizer: torch.optim.Optimizer | None = None
        self.grad_clip = optim.grad_clip
        self.betas = optim.betas
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas
        )
        warmup = max(optim.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.shuffle = torch.Generator().manual_seed(seed)

    def _forward_logprobs(self, batch: SequenceBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs and entropies of the response tokens, flat [T] each."""
        padded = batch.padded(self.pad_id).to(self.device)
        logits = self.model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[:, :-1]
        targets = padded.input_ids[:, 1:]
        logprobs = algos.token_logprobs(logits, targets, temperature)
        entropy = algos.token_entropy(logits.detach(), temperature)
        return padded.gather_response(logprobs), padded.gather_response(entropy)

    @torch.no_grad()
    def compute_log_probs(self, batch: SequenceBatch, temperature: float, micro_batch_size: int) -> torch.Tensor:
        """Logprob of every response token under the current weights, flat [T]."""
        self.model.eval()
        rows = torch.arange(len(batch))
        parts = [self._forward_logprobs(batch.select(r), temperature)[0] for r in micro_batches(rows, micro_batch_size)]
        return torch.cat(parts).cpu() if parts else torch.zeros(0)

    def _optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def _warm_start_step(self) -> float:
        """A step of the warm start's own AdamW, which leaves the RL optimizer's state untouched."""
        if self._warm_start_optimizer is None:
            self._warm_start_optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=self.warm_start_lr, betas=self.betas, weight_decay=0.0)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self._warm_start_optimizer.step()
        self._warm_start_optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def update(
        self, batch: SequenceBatch, old_logprobs: torch.Tensor, advantages: torch.Tensor, ppo: PPOSettings
    ) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; returns verl-named metrics averaged over mini-batches.

        old_logprobs, advantages: flat [T] aligned with batch.response_ids.
        """
        self.model.train()
        starts = torch.cumsum(batch.response_lens, 0) - batch.response_lens
        sums: dict[str, float] = {}
        count = 0
        for _ in range(ppo.epochs):
            order = torch.randperm(len(batch), generator=self.shuffle)
            for mini in micro_batches(order, ppo.mini_batch_size):
                stats = self._update_mini_batch(batch, starts, mini, old_logprobs, advantages, ppo)
                for key, value in stats.items():
                    sums[key] = sums.get(key, 0.0) + value
                count += 1
        metrics = {key: value / max(count, 1) for key, value in sums.items()}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _update_mini_batch(self, batch, starts, mini, old_logprobs, advantages, ppo: PPOSettings) -> dict[str, float]:
        num_tokens = int(batch.response_lens[mini].sum())
        stats = {"actor/pg_loss": 0.0, "actor/pg_clipfrac": 0.0, "actor/ppo_kl": 0.0, "actor/entropy": 0.0}
        for micro in micro_batches(mini, ppo.micro_batch_size):
            token_index = torch.cat([torch.arange(starts[r], starts[r] + batch.response_lens[r]) for r in micro.tolist()])
            logprobs, entropy = self._forward_logprobs(batch.select(micro), ppo.temperature)
            result = algos.ppo_clip_loss(
                logprobs, old_logprobs[token_index].to(self.device), advantages[token_index].to(self.device),
                ppo.clip_ratio_low, ppo.clip_ratio_high, num_tokens,
            )
            result.loss.backward()
            stats["actor/pg_loss"] += float(result.loss.detach())
            stats["actor/pg_clipfrac"] += float(result.clipfrac)
            stats["actor/ppo_kl"] += float(result.approx_kl)
            stats["actor/entropy"] += float(entropy.sum()) / num_tokens
        stats["actor/grad_norm"] = self._optimizer_step()
        return stats

    def train_supervised(self, batch: SequenceBatch, micro_batch_size: int) -> dict[str, float]:
        """One step of next-token NLL on the response tokens (the warm start), with its own optimizer."""
        self.model.train()
        num_tokens = batch.num_response_tokens
        total = 0.0
        for micro in micro_batches(torch.arange(len(batch)), micro_batch_size):
            logprobs, _ = self._forward_logprobs(batch.select(micro), 1.0)
            loss = algos.sequence_nll(logprobs, num_tokens)
            loss.backward()
            total += float(loss.detach())
        return {"warm_start/loss": total, "warm_start/grad_norm": self._warm_start_step()}

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The model's tensors under their Hugging Face names, in a fixed order."""
        return [(name, tensor.detach()) for name, tensor in self.model.state_dict().items()]
