"""The critic: a value head on the causal LM's body (one value per token) and its optimizer.

Called from the trainer's worker thread, on every rank: ``compute_values``
before the advantages are computed, ``update`` with the returns afterwards.
Several ranks share the work as the actor's do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services import algos
from services.common.sequences import SequenceBatch
from services.trainer.batching import MicroBatching, micro_batch_plan, with_stand_ins
from services.trainer.forward import batched_values, response_values
from services.trainer.mfu import ModelShape, device_peak_flops, mfu, training_flops
from services.trainer.optim import Optimizer, OptimSettings, mean_metrics, shuffled_mini_batches
from services.trainer.ranks import Ranks

if TYPE_CHECKING:
    from services.run.models import HFModel


@dataclass(frozen=True, kw_only=True)
class CriticSettings:
    mini_batch_size: int  # sequences per optimizer step
    micro_batch_size: int
    epochs: int
    cliprange_value: float
    vf_coef: float
    loss_agg_mode: str
    max_response_length: int
    max_token_len: int | None = None  # token budget per micro-batch instead of micro_batch_size (use_dynamic_bsz)
    remove_padding: bool = False

    @property
    def micro(self) -> MicroBatching:
        return MicroBatching(size=self.micro_batch_size, max_tokens=self.max_token_len,
                             remove_padding=self.remove_padding)


class Critic:
    def __init__(self, model: HFModel, optim: OptimSettings, pad_id: int, *, seed: int,
                 ranks: Ranks | None = None):
        self.model = model
        self.ranks = ranks or Ranks.single(next(model.parameters()).device)
        self.pad_id = pad_id
        self.shape = ModelShape.of(model.config, 1)  # a value model's head: one output (load_value_model)
        self.peak_flops = device_peak_flops(self.ranks.device)  # None: no MFU here
        self.optimizer = Optimizer(model.parameters(), optim)
        self.shuffle = torch.Generator().manual_seed(seed + 1)

    def compute_values(self, batch: SequenceBatch, micro: MicroBatching) -> torch.Tensor | None:
        """V(s_t) before each response token, flat [T] on rank 0 (None on the others)."""
        return batched_values(self.model, batch, self.pad_id, micro=micro, ranks=self.ranks)

    def update(self, batch: SequenceBatch, old_values: torch.Tensor, returns: torch.Tensor,
               *, settings: CriticSettings) -> dict[str, float]:
        """Clipped value-loss epochs over shuffled mini-batches; verl-named metrics, and perf/mfu/critic as the
        actor's."""
        self.model.train()
        started = time.perf_counter()
        with self.optimizer.resident():
            reports = [self._update_mini_batch(batch, rows, old_values, returns=returns, settings=settings) for rows in
                       shuffled_mini_batches(len(batch), settings.mini_batch_size, settings.epochs,
                                             generator=self.shuffle)]
        seconds = time.perf_counter() - started
        lr = self.optimizer.lr  # the rate this update ran at, as verl logs it
        self.optimizer.advance_schedule()
        metrics = {**mean_metrics(reports), "critic/lr": lr}
        if self.peak_flops is not None:
            flops = settings.epochs * training_flops(self.shape, batch.sequence_lens.tolist())
            metrics["perf/mfu/critic"] = mfu(flops, seconds, self.peak_flops, world_size=self.ranks.world_size)
        return metrics

    def _update_mini_batch(self, batch, rows, old_values, *, returns, settings: CriticSettings) -> dict[str, float]:
        mask = None if batch.loss_mask is None else batch.loss_mask[batch.token_index(rows)]
        scale = algos.LossScale.of(batch.response_lens[rows], settings.max_response_length, mask)
        device = self.ranks.device
        stats = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0, "critic/vpred_mean": 0.0}
        plan = micro_batch_plan(batch.sequence_lens, rows, self.ranks.world_size, micro=settings.micro)
        for micro, real in with_stand_ins(plan[self.ranks.rank], batch.sequence_lens, rows):
            part = batch.select(micro)
            tokens = batch.token_index(micro)
            values = response_values(self.model, part, self.pad_id, device=device,
                                     remove_padding=settings.remove_padding)
            part_mask = None if part.loss_mask is None else part.loss_mask.to(device)
            result = algos.value_loss(values, old_values[tokens].to(device), returns[tokens].to(device),
                                      lengths=part.response_lens, cliprange_value=settings.cliprange_value,
                                      mode=settings.loss_agg_mode,
                                      scale=scale, mask=part_mask)
            ((self.ranks.grad_scale if real else 0.0) * settings.vf_coef * result.loss).backward()
            if real:
                stats["critic/vf_loss"] += float(result.loss.detach())
                stats["critic/vf_clipfrac"] += float(result.clipfrac)
                stats["critic/vpred_mean"] += float(algos.masked(values.detach(), part_mask).sum()) / max(
                    scale.num_tokens, 1)
        stats = self.ranks.sum_metrics(stats)
        stats["critic/grad_norm"] = self.optimizer.step()
        return stats
