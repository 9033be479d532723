"""The actor: the policy model and its optimizer, on one rank of the trainer's ranks.

On several ranks the model is sharded (FSDP2) and each rank takes its share of
every mini-batch (``batching``); its losses keep the whole mini-batch's
divisors, so the ranks' gradients add up to the mini-batch's gradient.

Called from the trainer's worker thread, one call at a time, on every rank:
``compute_log_probs`` for the old-policy logprobs, ``update`` for one PPO
update over a batch, ``train_supervised`` for the warm start, and
``named_weights`` when the weights are broadcast to the rollout engines.

An update that is one optimizer step over the batch (one epoch, one
mini-batch) may come without old logprobs: the weights have not moved before
its one step, so each micro-batch's own logprobs, detached, are pi_old (the
ratio is 1), and it reports their mismatch with the rollout's.

A batch that carries the rollout's routed experts (an MoE model, routing
replay on) is routed by them in every pass (R3), and each update reports the
share of them the actor's own routers agree with (training/routing_agreement).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from services import algos
from services.algo_registry import POLICY_LOSSES, PolicyLossInputs, PolicyLossParams
from services.common.adapters import FACTOR_A, FACTOR_B, MergedWeight
from services.common.sequences import SequenceBatch
from services.common.weight_sync import Sendable
from services.run.lora import ADAPTER, PEFT_PREFIX, is_lora
from services.run.routing import RouteTally
from services.trainer.batching import MicroBatching, micro_batch_plan, with_stand_ins
from services.trainer.forward import batched_logprobs, gather_tokens, response_logprobs
from services.trainer.mfu import ModelShape, device_peak_flops, mfu, training_flops
from services.trainer.optim import Optimizer, OptimSettings, mean_metrics, shuffled_mini_batches
from services.trainer.ranks import Ranks

if TYPE_CHECKING:
    from services.run.models import HFModel

ROUTES_GIVEN, ROUTES_AGREED = "routing/given", "routing/agreed"
"""A micro-batch's counts of token-layer routes replayed and agreed with (``routing.RouteTally``), summed over the
mini-batch into training/routing_agreement."""


@dataclass(frozen=True, kw_only=True)
class ActorSettings:
    mini_batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per forward/backward
    epochs: int
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float | None
    loss_agg_mode: str  # resolved: the run's, else the policy loss's own
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    temperature: float
    max_response_length: int  # the constant of seq-mean-token-sum-norm
    rollout_is: str | None = None  # rollout correction: weights per token or sequence; None = off
    rollout_is_mode: str = "truncate"  # or mask: what becomes of a weight above the threshold
    rollout_is_threshold: float = 2.0
    max_token_len: int | None = None  # token budget per micro-batch instead of micro_batch_size (use_dynamic_bsz)
    remove_padding: bool = False  # forward passes pack their sequences into one row
    logprob_chunk_tokens: int = 0  # logprobs from the hidden states this many tokens at a time; 0 = all at once
    loss_mode: str = "vanilla"  # the registered policy loss (algo_registry.POLICY_LOSSES)
    clip_cov_ratio: float = 0.0002  # the parameters of clip_cov and kl_cov (actor.policy_loss)
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    replay_routes: bool = False  # route by the rollout's routed experts where the batch has them (R3)

    @property
    def micro(self) -> MicroBatching:
        return MicroBatching(size=self.micro_batch_size, max_tokens=self.max_token_len,
                             remove_padding=self.remove_padding, chunk_tokens=self.logprob_chunk_tokens,
                             replay_routes=self.replay_routes)

    def one_optimizer_step(self, num_rows: int) -> bool:
        """Whether the update of ``num_rows`` sequences is one optimizer step over all of them (one epoch, one
        mini-batch): then it needs no old logprobs."""
        return self.epochs == 1 and self.mini_batch_size >= num_rows

    def check_inputs(self, num_rows: int, given: Collection[str]) -> None:
        """Refuse an update of ``num_rows`` sequences whose token tensors ``given`` (by their names in
        ``UpdateInputs``) lack what these settings need: old_logprobs past one optimizer step, ref_logprobs for the
        KL loss, rollout_logprobs for the rollout correction."""
        if "old_logprobs" not in given and not self.one_optimizer_step(num_rows):
            raise ValueError(f"batch is missing tensor 'old_logprobs': the update of {num_rows} sequences is more "
                             f"than one optimizer step (ppo_epochs {self.epochs}, mini-batches of "
                             f"{self.mini_batch_size} sequences)")
        if self.use_kl_loss and "ref_logprobs" not in given:
            raise ValueError("batch is missing tensor 'ref_logprobs', which use_kl_loss needs")
        if self.rollout_is and "rollout_logprobs" not in given:
            raise ValueError("batch is missing tensor 'rollout_logprobs', which the rollout correction needs")


def policy_loss_params(settings: ActorSettings, scale: algos.LossScale) -> PolicyLossParams:
    """What the policy loss of ``settings`` takes of them, for a mini-batch of ``scale``."""
    return PolicyLossParams(
        clip_ratio_low=settings.clip_ratio_low, clip_ratio_high=settings.clip_ratio_high,
        clip_ratio_c=settings.clip_ratio_c, loss_agg_mode=settings.loss_agg_mode, scale=scale,
        clip_cov_ratio=settings.clip_cov_ratio, clip_cov_lb=settings.clip_cov_lb, clip_cov_ub=settings.clip_cov_ub,
        kl_cov_ratio=settings.kl_cov_ratio, ppo_kl_coef=settings.ppo_kl_coef)


@dataclass(frozen=True, kw_only=True)
class UpdateInputs:
    """Token-aligned tensors an actor update needs besides the sequences, flat [T]."""

    old_logprobs: torch.Tensor | None  # None: one optimizer step, which takes its own logprobs, detached
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None  # needed when use_kl_loss
    rollout_logprobs: torch.Tensor | None = None  # the rollout engine's; needed when rollout_is is set (and
    # without old_logprobs, for the mismatch metrics)

    def given(self) -> set[str]:
        """The names of the tensors these inputs hold."""
        return {field.name for field in fields(self) if getattr(self, field.name) is not None}


class Actor:
    def __init__(self, model: HFModel, optim: OptimSettings, warm_start: OptimSettings, *, pad_id: int, seed: int,
                 ranks: Ranks | None = None, merge_adapters: bool = False, trains_base: bool = False):
        """``warm_start``: the settings of the warm start's own optimizer and schedule (one scheduler step per
        supervised step). ``ranks``: where the (placed, maybe sharded) model trains; None = one rank, on the
        model's device. ``merge_adapters`` (a LoRA model): syncs send the adapted layers' merged weights
        (``lora.merge``), not the adapters' factors. ``trains_base`` (a LoRA model, warm_start.full_weights): the
        warm start trains the full weights under the adapters, and syncs send the whole model, merged."""
        self.model = model
        self.merge_adapters, self.trains_base = merge_adapters, trains_base
        self.ranks = ranks or Ranks.single(next(model.parameters()).device)
        self.pad_id = pad_id
        self.vocab_size = model.config.vocab_size
        self.shape = ModelShape.of(model.config, model.config.vocab_size)
        self.peak_flops = device_peak_flops(self.ranks.device)  # None: no MFU here
        self.optimizer = Optimizer(model.parameters(), optim)
        with self.warm_start_trainable():
            self.warm_start = Optimizer(model.parameters(), warm_start)
        self.shuffle = torch.Generator().manual_seed(seed)

    def compute_log_probs(self, batch: SequenceBatch, temperature: float, micro: MicroBatching) -> torch.Tensor | None:
        """Logprob of every response token under the current weights, flat [T] on rank 0 (None on the others)."""
        return batched_logprobs(self.model, batch, self.pad_id, temperature=temperature, micro=micro, ranks=self.ranks)

    def update(self, batch: SequenceBatch, inputs: UpdateInputs, settings: ActorSettings) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; verl-named metrics averaged over mini-batches, and the update's
        model FLOPs utilization (``mfu``) where the GPU's peak is known. Without old logprobs (one optimizer
        step) and with the rollout's, the rollout/trainer mismatch metrics of the update's own logprobs
        (``algos.mismatch_metrics``, as the coordinator computes them from old logprobs). ``inputs`` must hold
        what ``settings`` need (``ActorSettings.check_inputs``, which the servicer applies to each request)."""
        settings.check_inputs(len(batch), inputs.given())
        self.model.train()
        started = time.perf_counter()
        with self.optimizer.resident():
            reports = [self._update_mini_batch(batch, rows, inputs, settings=settings) for rows in
                       shuffled_mini_batches(len(batch), settings.mini_batch_size, settings.epochs,
                                             generator=self.shuffle)]
        seconds = time.perf_counter() - started  # each optimizer step waited for its gradient norm
        lr = self.optimizer.lr  # the rate this update ran at, as verl logs it
        self.optimizer.advance_schedule()
        metrics = {**mean_metrics(reports), "actor/lr": lr}
        if self.peak_flops is not None:
            flops = settings.epochs * training_flops(self.shape, batch.sequence_lens.tolist())
            metrics["perf/mfu/actor"] = mfu(flops, seconds, self.peak_flops, world_size=self.ranks.world_size)
        return metrics

    def _update_mini_batch(self, batch: SequenceBatch, rows: torch.Tensor, inputs: UpdateInputs,
                           *, settings: ActorSettings) -> dict[str, float]:
        mask = None if batch.loss_mask is None else batch.loss_mask[batch.token_index(rows)]
        scale = algos.LossScale.of(batch.response_lens[rows], settings.max_response_length, mask)
        stats: dict[str, float] = {}
        plan = micro_batch_plan(batch.sequence_lens, rows, self.ranks.world_size, micro=settings.micro)
        # without old logprobs, the rollout's are compared with this pass's own (the mismatch metrics)
        mismatch_with = inputs.rollout_logprobs if inputs.old_logprobs is None else None
        own_logprobs = []  # then the real micro-batches' logprobs
        for micro, real in with_stand_ins(plan[self.ranks.rank], batch.sequence_lens, rows):
            weight = self.ranks.grad_scale if real else 0.0
            micro_stats, logprobs = self._micro_batch_loss(batch, micro, inputs, settings=settings, scale=scale,
                                                           weight=weight)
            for key, value in micro_stats.items():
                stats[key] = stats.get(key, 0.0) + (value if real else 0.0)
            if real and mismatch_with is not None:
                own_logprobs.append(logprobs.cpu())
        stats = self.ranks.sum_metrics(stats)
        routes_given = stats.pop(ROUTES_GIVEN, 0.0)
        routes_agreed = stats.pop(ROUTES_AGREED, 0.0)
        if routes_given:
            stats["training/routing_agreement"] = routes_agreed / routes_given
        if mismatch_with is not None:
            old_logprobs = gather_tokens(batch, plan, own_logprobs, ranks=self.ranks)  # this one step's rows: the batch
            if old_logprobs is not None:  # rank 0
                stats |= algos.mismatch_metrics(mismatch_with, old_logprobs, batch.response_lens,
                                                mask=batch.loss_mask)
        stats["actor/grad_norm"] = self.optimizer.step()
        return stats

    def _micro_batch_loss(self, batch, micro, inputs: UpdateInputs, *, settings: ActorSettings,
                          scale: algos.LossScale, weight: float = 1.0) -> tuple[dict[str, float], torch.Tensor]:
        """Backpropagate ``weight`` x one micro-batch's share of the mini-batch loss; return its share of the
        metrics, and its logprobs, detached (pi_old where ``inputs`` has no old logprobs). Only the tokens of the
        batch's loss mask, where it has one, carry loss (``algos``)."""
        part = batch.select(micro)
        tokens = batch.token_index(micro)
        device = self.ranks.device
        mask = None if part.loss_mask is None else part.loss_mask.to(device)
        tally = RouteTally()
        logprobs, entropy = response_logprobs(
            self.model, part, pad_id=self.pad_id, temperature=settings.temperature, with_entropy=True, device=device,
            remove_padding=settings.remove_padding, chunk_tokens=settings.logprob_chunk_tokens,
            entropy_grad=settings.entropy_coeff != 0,  # else a metric only
            replay_routes=settings.replay_routes, tally=tally)
        assert entropy is not None  # asked for (with_entropy)
        lengths = part.response_lens
        if inputs.old_logprobs is None:  # one optimizer step: the weights are still pi_old's
            old_logprobs = logprobs.detach()
        else:
            old_logprobs = inputs.old_logprobs[tokens].to(device)
        tis = None
        if settings.rollout_is:
            assert inputs.rollout_logprobs is not None  # check_inputs refuses an update without them
            tis = algos.rollout_is_weights(
                old_logprobs=old_logprobs, rollout_logprobs=inputs.rollout_logprobs[tokens].to(device),
                lengths=lengths, level=settings.rollout_is, mode=settings.rollout_is_mode,
                threshold=settings.rollout_is_threshold, mask=mask)
        pg = POLICY_LOSSES.get(settings.loss_mode).fn(
            PolicyLossInputs(logprobs=logprobs, old_logprobs=old_logprobs,
                             advantages=inputs.advantages[tokens].to(device), lengths=lengths, mask=mask,
                             is_weights=None if tis is None else tis.weights),
            policy_loss_params(settings, scale))
        entropy_loss = algos.aggregate(entropy, lengths, settings.loss_agg_mode, scale=scale, mask=mask)
        loss = pg.loss - settings.entropy_coeff * entropy_loss
        stats = {"actor/pg_loss": float(pg.loss.detach()), **pg.metrics, "actor/entropy": float(entropy_loss.detach())}
        if tally.given:  # counts, summed over micro-batches and ranks (the agreement: ``_update_mini_batch``)
            stats |= {ROUTES_GIVEN: float(tally.given), ROUTES_AGREED: float(tally.agreed)}
        if tis is not None:  # shares of the mini-batch's token means, like the statistics above
            stats["rollout_corr/rollout_is_mean"] = float(tis.weights.sum()) / max(scale.num_tokens, 1)
            stats["rollout_corr/rollout_is_ratio_fraction_high"] = float(tis.exceeded.sum()) / max(scale.num_tokens, 1)
        if settings.use_kl_loss:
            assert inputs.ref_logprobs is not None  # check_inputs refuses an update without them
            kl = algos.kl_penalty(logprobs, inputs.ref_logprobs[tokens].to(device), settings.kl_loss_type)
            kl_loss = algos.aggregate(kl, lengths, settings.loss_agg_mode, scale=scale, mask=mask)
            loss = loss + settings.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = float(kl_loss.detach())
        (weight * loss).backward()
        return stats, logprobs.detach()

    def train_supervised(self, batch: SequenceBatch, micro: MicroBatching) -> dict[str, float]:
        """One step of next-token NLL on the response tokens the loss mask keeps (all, without one: the warm
        start's tool replies carry none), with its own optimizer."""
        self.model.train()
        num_tokens = int(batch.trained().sum())
        rows = torch.arange(len(batch))
        plan = micro_batch_plan(batch.sequence_lens, rows, self.ranks.world_size, micro=micro)
        total = 0.0
        with self.warm_start_trainable(), self.warm_start.resident():
            for part, real in with_stand_ins(plan[self.ranks.rank], batch.sequence_lens, rows):
                chosen = batch.select(part)
                logprobs, _ = response_logprobs(self.model, chosen, self.pad_id, temperature=1.0, with_entropy=False,
                                                device=self.ranks.device, remove_padding=micro.remove_padding,
                                                chunk_tokens=micro.chunk_tokens)
                mask = None if chosen.loss_mask is None else chosen.loss_mask.to(logprobs.device)
                loss = algos.sequence_nll(logprobs, num_tokens, mask)
                ((self.ranks.grad_scale if real else 0.0) * loss).backward()
                total += float(loss.detach()) if real else 0.0
            total = self.ranks.sum_metrics({"warm_start/loss": total})["warm_start/loss"]
            lr = self.warm_start.lr  # the rate this step runs at
            metrics = {"warm_start/loss": total, "warm_start/grad_norm": self.warm_start.step(), "warm_start/lr": lr}
        self.warm_start.advance_schedule()
        return metrics

    def named_weights(self) -> list[tuple[str, Sendable]]:
        """What a weight sync sends, in a fixed order: the model's parameters under their Hugging Face names (a tied
        lm_head once); with LoRA, only the adapters' factors (``common.adapters``), or with ``merge_adapters`` the
        adapted layers' merged weights."""
        if is_lora(self.model):
            if self.trains_base:  # the warm start changed the base: rollouts need all of it
                return whole_merged_weights(self.model)
            return merged_weights(self.model) if self.merge_adapters else adapter_factors(self.model)
        return [(name, tensor.detach()) for name, tensor in self.model.named_parameters()]

    @contextmanager
    def warm_start_trainable(self) -> Iterator[None]:
        """Inside the ``with``, what the warm start trains is what requires gradients: a LoRA actor whose warm start
        trains its base (``trains_base``), every weight but the adapters'; any other actor, as it is."""
        if not self.trains_base:
            yield
            return
        was = {name: parameter.requires_grad for name, parameter in self.model.named_parameters()}
        for name, parameter in self.model.named_parameters():
            parameter.requires_grad_(not is_adapter_parameter(name))
        try:
            yield
        finally:
            for name, parameter in self.model.named_parameters():
                parameter.requires_grad_(was[name])

    @contextmanager
    def base_policy(self) -> Iterator[HFModel]:
        """The actor's base model, its adapters switched off for the passes inside the ``with`` (LoRA only): the
        reference policy, without a second copy of the model.

        PEFT's ``disable_adapter`` also freezes the adapters; they are kept trainable through the pass (they take
        no part in it), because FSDP2 settles its mixed-precision dtypes at a model's first forward from the
        parameters that train then, and a first forward with none leaves the gradients in the compute dtype for
        good (pytorch/pytorch#186998): the reference pass may be the first."""
        assert is_lora(self.model), "only a LoRA actor has a base policy (its adapters switched off)"
        trained = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        with self.model.disable_adapter():
            for parameter in trained:
                parameter.requires_grad_(True)
            yield self.model


def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """A PEFT model's adapted layers, in order, each under its name in the base model."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name.removeprefix(PEFT_PREFIX), module


def is_adapter_parameter(name: str) -> bool:
    """Whether a PEFT model's parameter ``name`` is one of its LoRA factors."""
    return ".lora_A." in name or ".lora_B." in name


def whole_merged_weights(model: torch.nn.Module) -> list[tuple[str, Sendable]]:
    """Every weight of a PEFT model under the base model's names, the adapted layers' with their adapters merged
    in (``merged_weights``): what a rollout needs once the warm start has trained the base (a weight tied to
    another once, as ``named_parameters`` gives it)."""
    adapted = {f"{layer}.weight" for layer, _ in lora_layers(model)}
    rest = [(name.removeprefix(PEFT_PREFIX).replace(".base_layer.", "."), parameter.detach())
            for name, parameter in model.named_parameters() if not is_adapter_parameter(name)]
    return merged_weights(model) + [(name, tensor) for name, tensor in rest if name not in adapted]


def adapter_factors(model: torch.nn.Module) -> list[tuple[str, Sendable]]:
    """A PEFT model's LoRA factors as the weight channel carries them: per adapted layer, ``M.lora_A`` and
    ``M.lora_B`` scaled by the adapter's scale, M the layer's name in the base model, both in the dtype of the
    layer's base weight (a sharded factor stays a DTensor, gathered as it is sent).

    The adapters train in fp32, but a rollout computes in its model's dtype (vLLM casts a LoRA to it, the hf
    engine merges it into the base weight), and so does the trainer's forward (``lora.adapter_autocast``): sending
    them in that dtype halves a bf16 model's sync bytes and changes nothing the rollout serves."""
    factors: list[tuple[str, Sendable]] = []
    for layer, module in lora_layers(model):
        dtype = module.get_base_layer().weight.dtype
        a, b = module.lora_A[ADAPTER].weight.detach(), module.lora_B[ADAPTER].weight.detach()
        factors += [(layer + FACTOR_A, a.to(dtype)), (layer + FACTOR_B, (b * module.scaling[ADAPTER]).to(dtype))]
    return factors


def merged_weights(model: torch.nn.Module) -> list[tuple[str, Sendable]]:
    """A PEFT model's adapted layers' weights with their adapters merged in (``common.adapters.MergedWeight``,
    made as each is sent), under the base model's names ``M.weight``: what a rollout that serves the adapters
    merged (``lora.merge``) needs, as the layers no adapter touches never change."""
    return [(f"{layer}.weight", MergedWeight(base=module.get_base_layer().weight.detach(),
                                             a=module.lora_A[ADAPTER].weight.detach(),
                                             b=module.lora_B[ADAPTER].weight.detach(),
                                             scale=float(module.scaling[ADAPTER])))
            for layer, module in lora_layers(model)]
