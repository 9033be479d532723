"""The trainer servicer: wire <-> actor, nothing else.

A streamed request is read to its end before anything is refused, so that
the caller's stream closes cleanly and it receives the refusal's status.

Model work runs on one worker thread, one call at a time; joining a channel
(which blocks until every member has joined) runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from meshrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.channel import ChannelTable, prepare_gloo_rendezvous
from services.common.config import validate
from services.common.nccl_channel import new_unique_id
from services.common.errors import FailedPrecondition
from services.common.run_config import RunConfig
from services.common.sequences import SequenceBatch
from services.common.weight_sync import send_weights
from services.common.wire import BatchAssembler, batch_to_chunks, read_stream
from services.trainer import checkpoint
from services.trainer.actor import Actor, UpdateInputs
from services.trainer.config import TrainerServiceConfig
from services.trainer.critic import Critic
from services.trainer.forward import batched_logprobs
from services.trainer.setup import (ROLES, actor_settings, build_actor, build_critic, build_reference,
                                    critic_settings, pad_id_of)

log = structlog.get_logger()
SEQUENCE_KEYS = ("prompt_ids", "prompt_lens", "response_ids", "response_lens")


async def read_batch(request_iterator, extra: tuple[str, ...] = ()) -> tuple[int, str, dict[str, torch.Tensor]]:
    """Assemble a streamed BatchRequest into (step, role, tensors), checking the tensors agree."""
    assembler = BatchAssembler()
    first = await read_stream(request_iterator, assembler)
    batch = assembler.result(required=SEQUENCE_KEYS + extra)
    for key in SEQUENCE_KEYS:
        if batch[key].dtype != torch.int64 or batch[key].dim() != 1:
            raise ValueError(f"{key} must be a 1-D int64 tensor")
    for ids, lens, least in (("prompt_ids", "prompt_lens", 1), ("response_ids", "response_lens", 0)):
        if (batch[lens] < least).any() or int(batch[lens].sum()) != batch[ids].numel():
            raise ValueError(f"{lens} must be >= {least} each and sum to len({ids})")
    if len(batch["prompt_lens"]) != len(batch["response_lens"]):
        raise ValueError("prompt_lens and response_lens must have one entry per sequence")
    check_token_tensors(batch, extra)
    return (first.step, first.role, batch) if first else (0, "", batch)


def check_token_tensors(batch: dict[str, torch.Tensor], keys: tuple[str, ...]) -> None:
    """Each of ``keys`` is present, finite, with one value per response token."""
    tokens = batch["response_ids"].numel()
    for key in keys:
        if key not in batch:
            raise ValueError(f"batch is missing tensor {key!r}")
        if batch[key].shape != (tokens,):
            raise ValueError(f"{key} must have one value per response token ({tokens}), got {list(batch[key].shape)}")
        if not torch.isfinite(batch[key]).all():
            raise ValueError(f"{key} holds NaN or infinite values")


def sequences(batch: dict[str, torch.Tensor], vocab_size: int) -> SequenceBatch:
    for key in ("prompt_ids", "response_ids"):
        ids = batch[key]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{key} must lie in [0, {vocab_size})")
    return SequenceBatch(*(batch[key] for key in SEQUENCE_KEYS))


@dataclass
class Roles:
    """What this trainer hosts for the current run."""

    run_id: str
    config: RunConfig
    actor: Actor | None
    critic: Critic | None
    reference: torch.nn.Module | None
    pad_id: int

    def hosted(self) -> dict[str, object]:
        return {name: model for name, model in
                (("actor", self.actor), ("critic", self.critic), ("ref", self.reference)) if model is not None}

    def need(self, role: str):
        hosted = self.hosted().get(role)
        if hosted is None:
            raise FailedPrecondition(f"this trainer does not host the {role!r} role of run {self.run_id}")
        return hosted


def build_roles(run_id: str, config: RunConfig, roles: list[str], seed: int, device: str) -> Roles:
    unknown = sorted(set(roles) - set(ROLES))
    if unknown or not roles:
        raise ValueError(f"roles must be a non-empty subset of {list(ROLES)}, got {list(roles)}")
    return Roles(
        run_id, config,
        build_actor(config, seed, device) if "actor" in roles else None,
        build_critic(config, seed, device) if "critic" in roles else None,
        build_reference(config, device) if "ref" in roles else None,
        pad_id_of(config.actor_rollout_ref.model.path),
    )


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, config: TrainerServiceConfig, identity: common_pb2.ServiceIdentity):
        self.config = config
        self.identity = identity
        self.roles: Roles | None = None
        self.weight_version = 0
        self.channels = ChannelTable(config.device)
        self.stores: dict[str, object] = {}
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def _on_model(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, function, *args)

    def _roles(self) -> Roles:
        if self.roles is None:
            raise FailedPrecondition("no run loaded: call InitRun first")
        return self.roles

    async def InitRun(self, request, context):
        import yaml

        run_config = validate(RunConfig, yaml.safe_load(request.run_config_yaml) or {})
        self.roles = await self._on_model(
            build_roles, request.run_id, run_config, list(request.roles), request.seed, self.config.device)
        self.weight_version = 0
        log.info("run_loaded", run_id=request.run_id, roles=list(request.roles),
                 model_path=run_config.actor_rollout_ref.model.path)
        return self._info()

    async def ComputeLogProbs(self, request_iterator, context):
        step, role, batch = await read_batch(request_iterator)
        roles = self._roles()
        role = role or "actor"
        if role not in ("actor", "ref"):
            raise ValueError(f"ComputeLogProbs role must be actor or ref, got {role!r}")
        model = roles.need(role).model if role == "actor" else roles.need("ref")
        actor_config = roles.config.actor_rollout_ref
        logprobs = await self._on_model(
            batched_logprobs, model, sequences(batch, model.config.vocab_size), roles.pad_id,
            actor_config.rollout.temperature, actor_config.actor.ppo_micro_batch_size_per_gpu)
        for chunks in batch_to_chunks({"logprobs": logprobs}):
            yield trainer_pb2.BatchResponse(chunks=chunks)

    async def ComputeValues(self, request_iterator, context):
        _, _, batch = await read_batch(request_iterator)
        roles = self._roles()
        critic = roles.need("critic")
        values = await self._on_model(critic.compute_values, sequences(batch, critic.model.config.vocab_size),
                                      roles.config.critic.ppo_micro_batch_size_per_gpu)
        for chunks in batch_to_chunks({"values": values}):
            yield trainer_pb2.BatchResponse(chunks=chunks)

    async def UpdateActor(self, request_iterator, context):
        step, _, batch = await read_batch(request_iterator, extra=("old_logprobs", "advantages"))
        roles = self._roles()
        actor = roles.need("actor")
        settings = actor_settings(roles.config)
        if settings.use_kl_loss:
            check_token_tensors(batch, ("ref_logprobs",))
        if settings.rollout_is or "rollout_logprobs" in batch:
            check_token_tensors(batch, ("rollout_logprobs",))
        inputs = UpdateInputs(batch["old_logprobs"].float(), batch["advantages"].float(),
                              batch["ref_logprobs"].float() if settings.use_kl_loss else None,
                              batch["rollout_logprobs"].float() if settings.rollout_is else None)
        metrics = await self._on_model(actor.update, sequences(batch, actor.vocab_size), inputs, settings)
        self.weight_version += 1
        log.info("actor_updated", run_id=roles.run_id, step=step, weight_version=self.weight_version)
        return trainer_pb2.UpdateResponse(metrics=metrics, weight_version=self.weight_version)

    async def UpdateCritic(self, request_iterator, context):
        step, _, batch = await read_batch(request_iterator, extra=("values", "returns"))
        roles = self._roles()
        critic = roles.need("critic")
        metrics = await self._on_model(critic.update, sequences(batch, critic.model.config.vocab_size),
                                       batch["values"].float(), batch["returns"].float(), critic_settings(roles.config))
        log.info("critic_updated", run_id=roles.run_id, step=step)
        return trainer_pb2.UpdateResponse(metrics=metrics, weight_version=self.weight_version)

    async def TrainSupervised(self, request_iterator, context):
        _, _, batch = await read_batch(request_iterator)
        roles = self._roles()
        actor = roles.need("actor")
        micro = roles.config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu
        metrics = await self._on_model(actor.train_supervised, sequences(batch, actor.vocab_size), micro)
        self.weight_version += 1
        return trainer_pb2.UpdateResponse(metrics=metrics, weight_version=self.weight_version)

    async def PrepareChannel(self, request, context):
        if request.backend == "nccl":
            return trainer_pb2.PrepareChannelResponse(rendezvous=await asyncio.to_thread(new_unique_id))
        if request.backend != "gloo":
            raise ValueError(f"backend must be gloo or nccl, got {request.backend!r}")
        host = self.identity.address.rpartition(":")[0] or socket.gethostname()
        store, rendezvous = await asyncio.to_thread(prepare_gloo_rendezvous, host, 60.0)
        self.stores[request.channel_id] = store
        return trainer_pb2.PrepareChannelResponse(rendezvous=rendezvous)

    async def JoinChannel(self, request, context):
        if request.rank != 0:
            raise ValueError(f"the trainer is the channel's root and joins as rank 0, not {request.rank}")
        await self.channels.join(
            request.channel_id, request.backend, request.rendezvous, request.rank, request.world_size, request.timeout_s
        )
        log.info("channel_joined", channel_id=request.channel_id, rank=request.rank, world_size=request.world_size)
        return common_pb2.JoinChannelResponse(channel_id=request.channel_id)

    async def BroadcastWeights(self, request, context):
        actor = self._roles().need("actor")
        channel = self.channels.get(request.channel_id)
        if request.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {request.bucket_bytes}")
        started = time.perf_counter()
        total, buckets = await self._on_model(
            send_weights, channel, actor.named_weights(), self.weight_version, request.bucket_bytes
        )
        seconds = time.perf_counter() - started
        log.info("weights_sent", weight_version=self.weight_version, bytes=total, buckets=buckets, seconds=seconds)
        return trainer_pb2.BroadcastWeightsResponse(
            weight_version=self.weight_version, total_bytes=total, buckets=buckets, seconds=seconds
        )

    async def SaveCheckpoint(self, request, context):
        roles = self._roles()
        started = time.perf_counter()
        total = await self._on_model(checkpoint.save, roles, Path(request.path), self.weight_version)
        log.info("checkpoint_saved", run_id=roles.run_id, path=request.path, bytes=total)
        return trainer_pb2.CheckpointResponse(path=request.path, total_bytes=total, weight_version=self.weight_version,
                                              seconds=time.perf_counter() - started)

    async def LoadCheckpoint(self, request, context):
        roles = self._roles()
        started = time.perf_counter()
        self.weight_version = await self._on_model(checkpoint.load, roles, Path(request.path))
        log.info("checkpoint_loaded", run_id=roles.run_id, path=request.path, weight_version=self.weight_version)
        return trainer_pb2.CheckpointResponse(path=request.path, weight_version=self.weight_version,
                                              seconds=time.perf_counter() - started)

    async def Info(self, request, context):
        return self._info()

    def _info(self) -> common_pb2.ServiceInfo:
        roles = self.roles
        return common_pb2.ServiceInfo(
            identity=self.identity, weight_version=self.weight_version, run_id=roles.run_id if roles else "",
            details={"model_path": roles.config.actor_rollout_ref.model.path if roles else "",
                     "device": self.config.device, "roles": ",".join(roles.hosted()) if roles else ""},
        )

    async def close(self) -> None:
        self.channels.close_all()
        self._model_thread.shutdown(wait=False, cancel_futures=True)


def attach(server, config: TrainerServiceConfig, identity: common_pb2.ServiceIdentity) -> TrainerServicer:
    servicer = TrainerServicer(config, identity)
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    return servicer
