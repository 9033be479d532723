"""The trainer's model work, done alike on every rank.

Rank 0's servicer checks each request, then calls ``RankWorker.run``: the
command (an op name, JSON arguments and named tensors) goes to the other
ranks, and rank 0 does its part. The other ranks sit in ``follower.follow``,
doing each command they receive until rank 0 says stop. Every op takes the whole batch;
each rank works on its share and rank 0 returns the gathered results (the
other ranks' return values are dropped).

On one rank nothing is relayed and a failed op raises to the caller. On
several, a rank whose op fails ends its process (``ranks.fatal``): its peers
may be waiting in a collective it will never join.

InitRun's run config is parsed once on each rank: rank 0's servicer parses and checks it and hands it to
``init_run`` here; the other ranks parse the YAML relayed with the command. ``init_run`` builds the run's
settings (``settings.RunSettings``) from it once; the ops read those.

The actor's weight version is kept here, on every rank alike: 0 when a run
is loaded, one more after each op that changes the actor's weights
(``update_actor``, ``train_supervised``), the saved one after
``load_checkpoint``. Broadcasts and checkpoints carry it.

Each update's metrics carry verl's memory metrics of this rank 0 (``telemetry.step_memory_metrics``): the
actor's as verl names them (``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb``,
``perf/cpu_memory_used_gb``), the critic's under ``perf/critic/``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import structlog
import torch

from services.common.config import validate
from services.common.request_text import request_yaml
from services.common.errors import FailedPrecondition
from services.run.config import RunConfig
from services.common.sequences import SequenceBatch
from services.common.weight_sync import WeightSender, gather_weights
from services.trainer import checkpoint
from services.trainer.actor import Actor, UpdateInputs
from services.trainer.critic import Critic
from services.trainer.forward import batched_candidate_logprobs, batched_logprobs, batched_top_logprobs, split_top
from services.trainer.ranks import Ranks, fatal
from services.trainer.settings import RunSettings, run_settings
from services.trainer.setup import (ROLES, build_actor, build_critic, build_reference, pad_id_of,
                                    reference_is_actor_base)
from services.trainer.telemetry import release_cached_memory, step_memory_metrics

if TYPE_CHECKING:
    from services.run.models import HFModel

log = structlog.get_logger()
SEQUENCE_KEYS = ("prompt_ids", "prompt_lens", "response_ids", "response_lens")
OPS = ("init_run", "compute_log_probs", "compute_candidate_log_probs", "compute_top_log_probs", "compute_values",
       "update_actor", "update_critic", "train_supervised", "broadcast_weights", "save_checkpoint", "load_checkpoint")
MODEL_OPS = ("compute_log_probs", "compute_candidate_log_probs", "compute_top_log_probs", "compute_values",
             "update_actor", "update_critic", "train_supervised")
STOP = "stop"


@dataclass(kw_only=True)
class Roles:
    """What this trainer hosts for the current run."""

    run_id: str
    settings: RunSettings
    actor: Actor | None
    critic: Critic | None
    reference: HFModel | None  # None also where the reference is the actor's base (reference_is_base)
    pad_id: int
    reference_is_base: bool = False  # the reference is the LoRA actor's base, its adapters switched off

    def hosted(self) -> dict[str, object]:
        reference = self.actor.model if self.reference_is_base and self.actor is not None else self.reference
        return {name: model for name, model in
                (("actor", self.actor), ("critic", self.critic), ("ref", reference)) if model is not None}

    def parameter_counts(self) -> dict[str, int]:
        """Parameters (elements) each hosted role holds, and those it trains (``<role>_trainable``); a reference
        that is the actor's base holds none of its own."""
        counts = {}
        models: tuple[tuple[str, HFModel | None], ...] = (
            ("actor", self.actor.model if self.actor else None), ("critic", self.critic.model if self.critic else None),
            ("ref", self.reference))
        for name, model in models:
            if model is not None:
                counts[name] = sum(p.numel() for p in model.parameters())
                counts[f"{name}_trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if self.reference_is_base:
            counts["ref"] = 0
        return counts

    def need(self, role: str):
        hosted = self.hosted().get(role)
        if hosted is None:
            raise FailedPrecondition(f"this trainer does not host the {role!r} role of run {self.run_id}")
        return hosted


class Updated(NamedTuple):
    """Rank 0's result of an op that trains the actor."""

    metrics: dict[str, float]
    weight_version: int  # of the actor's weights after the op


class Sent(NamedTuple):
    """Rank 0's result of ``broadcast_weights``."""

    total_bytes: int
    buckets: int
    weight_version: int  # of the weights sent


class Saved(NamedTuple):
    """A rank's result of ``save_checkpoint``."""

    total_bytes: int  # written (0 on ranks other than 0)
    weight_version: int  # of the actor's weights saved


def check_roles(roles: list[str]) -> None:
    unknown = sorted(set(roles) - set(ROLES))
    if unknown or not roles:
        raise ValueError(f"roles must be a non-empty subset of {list(ROLES)}, got {list(roles)}")


def parse_run_config(run_config_yaml: str) -> RunConfig:
    """InitRun's run config, read within the limits of a request's YAML (``request_text.request_yaml``);
    ValueError naming the field it refuses or the limit it passes."""
    return validate(RunConfig, request_yaml(run_config_yaml, "run_config_yaml"), "run_config_yaml")


def build_roles(run_id: str, config: RunConfig, roles: list[str], *, seed: int, ranks: Ranks) -> Roles:
    """The roles asked for; with a LoRA actor here, the reference is its base (no second copy is loaded)."""
    check_roles(roles)
    base = reference_is_actor_base(config, roles)
    return Roles(
        run_id=run_id,
        settings=run_settings(config, ranks.device),
        actor=build_actor(config, seed, ranks) if "actor" in roles else None,
        critic=build_critic(config, seed, ranks) if "critic" in roles else None,
        reference=build_reference(config, ranks) if "ref" in roles and not base else None,
        pad_id=pad_id_of(config.actor_rollout_ref.model.path),
        reference_is_base=base,
    )


def unloaded_notice(held: Roles | None, beside: bool) -> str:
    """What a failed InitRun left loaded."""
    if held is None:
        return "no run is loaded"
    if beside:
        return f"run {held.run_id} is still loaded"
    return f"run {held.run_id} was let go first to make room: no run is loaded now; InitRun it again to go on"


def sequences(tensors: dict[str, torch.Tensor], routed: bool = False) -> SequenceBatch:
    """The batch of a request's tensors, with its loss mask where it has one, and with ``routed`` its routed
    experts where it has them (the actor's passes; the reference and critic route by their own routers)."""
    return SequenceBatch(prompt_ids=tensors["prompt_ids"], prompt_lens=tensors["prompt_lens"],
                         response_ids=tensors["response_ids"], response_lens=tensors["response_lens"],
                         loss_mask=tensors.get("loss_mask"),
                         routed_experts=tensors.get("routed_experts") if routed else None)


class RankWorker:
    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        self.roles: Roles | None = None
        self.weight_version = 0  # of the actor's weights (see the module's docstring); the same on every rank
        self.weight_sender = WeightSender()  # rank 0's: what its channels carried, kept from sync to sync

    # ------------------------------------------------------------ relay

    def run(self, op: str, args: dict, tensors: dict[str, torch.Tensor], **local):
        """Rank 0: relay the command to the other ranks, then do it here. ``local``: arguments for rank 0 alone
        (the weight channel)."""
        if self.ranks.world_size == 1:
            return self.execute(op, args, tensors, **local)
        self.ranks.send_command(op, args, tensors)
        try:
            return self.execute(op, args, tensors, **local)
        except BaseException:  # noqa: BLE001 - fatal() logs it and ends the rank: the ranks are out of step
            fatal("relayed_command_failed", op=op, rank=self.ranks.rank)

    def execute(self, op: str, args: dict, tensors: dict[str, torch.Tensor], **local):
        """Do ``op`` here. Colocated (actor_rollout_ref.rollout.free_cache_engine), after an op that ran the
        models their cached GPU memory goes back to the device: the rollout engine wakes up on the same GPU."""
        if op not in OPS:
            raise ValueError(f"unknown trainer command {op!r}")
        result = getattr(self, op)(tensors, **args, **local)
        if op in MODEL_OPS and self.roles is not None and self.roles.settings.free_cache:
            release_cached_memory(self.ranks.device)
        return result

    def stop(self) -> None:
        """Rank 0, on the way out: tell the other ranks to end."""
        if self.ranks.world_size > 1:
            self.ranks.send_command(STOP, {}, {})

    def _roles(self) -> Roles:
        if self.roles is None:
            raise FailedPrecondition("no run loaded: call InitRun first")
        return self.roles

    # ------------------------------------------------------------ ops

    def init_run(self, tensors, run_id: str, run_config_yaml: str, *, roles: list[str], seed: int,
                 config: RunConfig | None = None) -> Roles:
        """Build the run's roles and settings (the servicer checked what can be checked without loading weights).
        ``config``: rank 0's, which its servicer parsed; the other ranks parse ``run_config_yaml``. On one CPU
        rank the roles are built beside the run held now, which stays if they fail to load; on a GPU the run held
        now goes first (the device holds one), and a failure leaves no run loaded, to be given one by another
        InitRun."""
        config = parse_run_config(run_config_yaml) if config is None else config
        held = self.roles
        beside = self.ranks.world_size == 1 and self.ranks.device.type == "cpu"
        if not beside:
            self.roles = None
        try:
            built = build_roles(run_id, config, roles, seed=seed, ranks=self.ranks)
        except torch.OutOfMemoryError:
            raise
        except (OSError, ValueError, KeyError, RuntimeError) as error:  # what transformers raises for bad weights
            raise ValueError(f"actor_rollout_ref.model.path {config.actor_rollout_ref.model.path}: the run's models "
                             f"cannot be loaded ({type(error).__name__}: {error}); "
                             + unloaded_notice(held, beside)) from None
        self.roles, self.weight_version = built, 0
        return self.roles

    def compute_log_probs(self, tensors, role: str, temperature: float = 0.0) -> torch.Tensor | None:
        """The actor's or the reference's logprobs at ``temperature`` (0: the run's) (the reference's from the LoRA
        actor's base, its adapters switched off, where it is that)."""
        roles = self._roles()
        settings = roles.settings
        micro = settings.actor_log_probs if role == "actor" else settings.ref_log_probs
        with self._policy(roles, role) as model:
            return batched_logprobs(model, sequences(tensors, routed=role == "actor"), pad_id=roles.pad_id,
                                    temperature=temperature or settings.temperature, micro=micro, ranks=self.ranks)

    def compute_candidate_log_probs(self, tensors, role: str,
                                    temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As ``compute_log_probs``, and the logprob of each of ``tensors["candidate_ids"]`` [T, m] at its response
        token's position (the weight check's: the rollouts' top-k there): ([T], [T, m]) on rank 0, None on the
        others."""
        roles = self._roles()
        settings = roles.settings
        micro = settings.actor_log_probs if role == "actor" else settings.ref_log_probs
        with self._policy(roles, role) as model:
            scored = batched_candidate_logprobs(
                model, sequences(tensors, routed=role == "actor"), candidate_ids=tensors["candidate_ids"],
                pad_id=roles.pad_id,
                temperature=temperature or settings.temperature, micro=micro, ranks=self.ranks)
        return None if scored is None else (scored[:, 0], scored[:, 1:])

    def compute_top_log_probs(self, tensors, role: str, *, top_k: int,
                              temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """As ``compute_log_probs``, and at each response token's position the ``top_k`` most likely next tokens
        (the weight check's, asked beside the rollouts): ([T], [T, k] logprobs, [T, k] ids) on rank 0, None on the
        others."""
        roles = self._roles()
        settings = roles.settings
        micro = settings.actor_log_probs if role == "actor" else settings.ref_log_probs
        with self._policy(roles, role) as model:
            packed = batched_top_logprobs(model, sequences(tensors, routed=role == "actor"), top_k,
                                          pad_id=roles.pad_id, temperature=temperature or settings.temperature,
                                          micro=micro, ranks=self.ranks)
        return None if packed is None else split_top(packed)

    @staticmethod
    def _policy(roles: Roles, role: str) -> contextlib.AbstractContextManager[HFModel]:
        if role == "actor":
            return contextlib.nullcontext(roles.need("actor").model)
        if roles.reference_is_base:
            return roles.need("actor").base_policy()
        return contextlib.nullcontext(roles.need("ref"))

    def compute_values(self, tensors) -> torch.Tensor | None:
        roles = self._roles()
        return roles.need("critic").compute_values(sequences(tensors), roles.settings.values)

    def update_actor(self, tensors) -> Updated:
        roles = self._roles()
        inputs = UpdateInputs(old_logprobs=tensors.get("old_logprobs"), advantages=tensors["advantages"],
                              ref_logprobs=tensors.get("ref_logprobs"),
                              rollout_logprobs=tensors.get("rollout_logprobs"))
        metrics = roles.need("actor").update(sequences(tensors, routed=True), inputs, roles.settings.actor)
        self.weight_version += 1
        return Updated({**metrics, **step_memory_metrics(self.ranks.device)}, self.weight_version)

    def update_critic(self, tensors) -> dict[str, float]:
        roles = self._roles()
        metrics = roles.need("critic").update(sequences(tensors), old_values=tensors["values"],
                                              returns=tensors["returns"], settings=roles.settings.critic)
        return {**metrics, **step_memory_metrics(self.ranks.device, "perf/critic")}

    def train_supervised(self, tensors) -> Updated:
        roles = self._roles()
        metrics = roles.need("actor").train_supervised(sequences(tensors), roles.settings.actor.micro)
        self.weight_version += 1
        return Updated(metrics, self.weight_version)

    def broadcast_weights(self, tensors, bucket_bytes: int, channel=None) -> Sent | None:
        """Rank 0 sends the actor's weights, stamped with their version, on ``channel`` in the rollout's dtype;
        the other ranks take part in gathering each sharded tensor, in the same order."""
        roles = self._roles()
        named = roles.need("actor").named_weights()
        if self.ranks.rank != 0:
            gather_weights(named)
            return None
        total, buckets = self.weight_sender.send(channel, named, version=self.weight_version,
                                                 bucket_bytes=bucket_bytes, dtype=roles.settings.weights_dtype)
        return Sent(total, buckets, self.weight_version)

    def save_checkpoint(self, tensors, path: str, key: bytes = b"") -> Saved:
        """The roles' state into ``path``, with the weight version, which ``load_checkpoint`` restores; ``key``
        (rank 0's alone: it writes the manifest) signs its manifest."""
        saved = checkpoint.save(self._roles(), Path(path), self.weight_version, ranks=self.ranks, key=key)
        return Saved(saved, self.weight_version)

    def load_checkpoint(self, tensors, path: str) -> int:
        """The roles' state from ``path``; returns the weight version saved there, which the actor's is now."""
        self.weight_version = checkpoint.load(self._roles(), Path(path))
        return self.weight_version

