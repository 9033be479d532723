"""The trainer servicer: wire <-> worker, nothing else.

A streamed request is read to its end before anything is refused, so that
the caller's stream closes cleanly and it receives the refusal's status.
Requests are checked here, before any rank starts on them (``worker``).

Model work runs on one worker thread, one call at a time; on a trainer of
several ranks that thread also relays each call to the other ranks. Joining
a channel (which blocks until every member has joined) runs on a thread of
its own.
"""

from __future__ import annotations

import asyncio
import math
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch

from meshrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.channel import ChannelTable, gpu_uuid
from services.common.gloo_channel import prepare_gloo_rendezvous, rendezvous_host
from services.common.nccl_channel import new_unique_id
from services.common.errors import FailedPrecondition
from services.algo_registry import POLICY_LOSSES
from services.common.plugins import import_modules
from services.common.limits import MIN_TEMPERATURE, StreamLimits, check_wait
from services.common.manifest import checkpoint_key
from services.run.lora import check_lora
from services.run.models import check_weights, refuse_pickled_weights
from services.common.paths import inside
from services.run.config import RunConfig
from services.common.wire import BatchAssembler, batch_to_chunks, read_stream
from services.trainer import checkpoint, telemetry
from services.trainer.actor import ActorSettings
from services.trainer.config import TrainerServiceConfig
from services.trainer.ranks import join
from services.trainer.setup import actor_sharding, critic_sharding, pad_id_of
from services.trainer.worker import SEQUENCE_KEYS, Roles, RankWorker, check_roles, parse_run_config

if TYPE_CHECKING:
    from services.run.models import HFModel

log = structlog.get_logger()


async def read_batch(request_iterator, limits: StreamLimits,
                     extra: tuple[str, ...] = ()) -> tuple[trainer_pb2.BatchRequest, dict[str, torch.Tensor]]:
    """Assemble a streamed BatchRequest (within ``limits``) into (its first message, for the settings it carries;
    tensors), checking the tensors agree."""
    assembler = BatchAssembler()
    first = await read_stream(request_iterator, assembler, limits)
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
    check_loss_mask(batch)
    check_routed_experts(batch)
    return first or trainer_pb2.BatchRequest(), batch


def check_loss_mask(batch: dict[str, torch.Tensor]) -> None:
    """A loss mask, where the batch has one, is bool with one value per response token."""
    mask = batch.get("loss_mask")
    if mask is None:
        return
    tokens = batch["response_ids"].numel()
    if mask.dtype != torch.bool or mask.shape != (tokens,):
        raise ValueError(f"loss_mask must be a bool tensor with one value per response token ({tokens}), "
                         f"got {mask.dtype} {list(mask.shape)}")


def check_routed_experts(batch: dict[str, torch.Tensor]) -> None:
    """Routed experts, where the batch has them, are small integers [R, layers, k], R each sequence's tokens but
    its last (the rollout never fed its last token to the model)."""
    routes = batch.get("routed_experts")
    if routes is None:
        return
    fed = int((batch["prompt_lens"] + batch["response_lens"] - 1).sum())
    if routes.dtype not in (torch.uint8, torch.int16) or routes.dim() != 3 or routes.shape[0] != fed:
        raise ValueError(f"routed_experts must be uint8 or int16 [{fed}, layers, top_k] (each sequence's tokens but "
                         f"its last), got {routes.dtype} {list(routes.shape)}")


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


def check_vocab(batch: dict[str, torch.Tensor], model: HFModel) -> dict[str, torch.Tensor]:
    """The batch's four sequence tensors (and its loss mask, where it has one), once their token ids are known to
    be in the model's vocabulary."""
    vocab_size = model.config.vocab_size
    for key in ("prompt_ids", "response_ids"):
        ids = batch[key]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"{key} must lie in [0, {vocab_size})")
    return {key: batch[key] for key in (*SEQUENCE_KEYS, "loss_mask", "routed_experts") if key in batch}


def check_candidate_ids(batch: dict[str, torch.Tensor], model: HFModel) -> torch.Tensor:
    """A request's candidate_ids, once they are int64 [T, m], a row per response token, and in the vocabulary."""
    ids = batch["candidate_ids"]
    tokens = batch["response_ids"].numel()
    if ids.dtype != torch.int64 or ids.dim() != 2 or ids.shape[0] != tokens:
        raise ValueError(f"candidate_ids must be int64 [{tokens} response tokens, m], got {ids.dtype} "
                         f"{list(ids.shape)}")
    vocab_size = model.config.vocab_size
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"candidate_ids must lie in [0, {vocab_size})")
    return ids


def actor_update_tensors(batch: dict[str, torch.Tensor], settings: ActorSettings,
                         model: HFModel) -> dict[str, torch.Tensor]:
    """The tensors of an actor update, once they are known to be what ``settings`` need
    (``ActorSettings.check_inputs``) and each is sound (ref_logprobs, needed for the KL loss only, is dropped
    without it)."""
    settings.check_inputs(len(batch["response_lens"]), batch.keys())
    optional = ("old_logprobs", "rollout_logprobs") + (("ref_logprobs",) if settings.use_kl_loss else ())
    given = tuple(key for key in optional if key in batch)
    check_token_tensors(batch, given)
    tensors = {**check_vocab(batch, model), "advantages": batch["advantages"].float()}
    return tensors | {key: batch[key].float() for key in given}


def check_init(config: RunConfig, roles: list[str], world_size: int) -> None:
    """Refuse what building the roles would fail on, before any rank starts on it and before the run loaded now is
    let go: roles, sharding, the model folders' config.json, tokenizer and safetensors headers (not the weights)."""
    check_roles(roles)
    actor_sharding(config, world_size)
    critic_sharding(config, world_size)
    actor_path = config.actor_rollout_ref.model.path
    for field, folder in (("actor_rollout_ref.model.path", actor_path),
                          ("critic.model.path", config.critic.model.path)):
        if folder and not (Path(folder) / "config.json").exists():
            raise ValueError(f"{field}: no config.json in model folder {folder}")
        if folder:
            refuse_pickled_weights(folder, config.actor_rollout_ref.model.allow_pickle, field)
    try:
        pad_id_of(actor_path)
    except (OSError, ValueError) as error:
        raise ValueError(f"actor_rollout_ref.model.path: no tokenizer loads from {actor_path} ({error})") from None
    if {"actor", "ref"} & set(roles):
        check_weights(actor_path)
    if "actor" in roles:
        check_lora(config.actor_rollout_ref.model, actor_path, "actor_rollout_ref.model")
    if "critic" in roles:
        check_lora(config.critic.model, config.critic.model.path or actor_path, "critic.model", value_model=True)
    if "critic" in roles:
        check_weights(config.critic.model.path or actor_path, body_only=True)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, config: TrainerServiceConfig, identity: common_pb2.ServiceIdentity, worker: RankWorker):
        self.config = config
        self.identity = identity
        self.worker = worker
        self.channels = ChannelTable(config.device)
        self.stores: dict[str, object] = {}
        device = worker.ranks.device
        self._gpu = gpu_uuid(device) if device.type == "cuda" else ""  # where rank 0 sends weights from
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def _on_model(self, function, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(
            self._model_thread, functools.partial(function, *args, **kwargs))

    async def _run(self, op: str, args: dict, tensors: dict[str, torch.Tensor], **local):
        """Do one op on every rank (on the model thread); rank 0's result."""
        with telemetry.OP_SECONDS.labels(op).time():
            return await self._on_model(self.worker.run, op, args, tensors, **local)

    def _roles(self) -> Roles:
        if self.worker.roles is None:
            raise FailedPrecondition("no run loaded: call InitRun first")
        return self.worker.roles

    async def InitRun(self, request, context):
        run_config = await asyncio.to_thread(parse_run_config, request.run_config_yaml)  # off the loop
        await asyncio.to_thread(check_init, run_config, list(request.roles), self.worker.ranks.world_size)
        # the other ranks parse the YAML relayed; this rank takes the config parsed here
        await self._run("init_run", {"run_id": request.run_id, "run_config_yaml": request.run_config_yaml,
                                     "roles": list(request.roles), "seed": request.seed}, {}, config=run_config)
        log.info("run_loaded", run_id=request.run_id, roles=list(request.roles),
                 model_path=run_config.actor_rollout_ref.model.path, ranks=self.worker.ranks.world_size)
        return self._info()

    async def ComputeLogProbs(self, request_iterator, context):
        first, batch = await read_batch(request_iterator, self.config.stream_limits())
        roles = self._roles()
        role = first.role or "actor"
        if role not in ("actor", "ref"):
            raise ValueError(f"ComputeLogProbs role must be actor or ref, got {role!r}")
        model = roles.need(role).model if role == "actor" else roles.need("ref")  # (for its vocabulary)
        temperature = first.temperature  # 0: the run's
        if temperature and not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
            raise ValueError(f"ComputeLogProbs temperature must be 0 (the run's) or at least {MIN_TEMPERATURE}, got "
                             f"{temperature}")
        tensors, args = check_vocab(batch, model), {"role": role, "temperature": temperature}
        if first.top_k < 0 or (first.top_k and "candidate_ids" in batch):
            raise ValueError(f"ComputeLogProbs top_k must be 0 or positive, and not with candidate_ids; got "
                             f"{first.top_k}{' with candidate_ids' if 'candidate_ids' in batch else ''}")
        if first.top_k:
            logprobs, top_logprobs, top_ids = await self._run("compute_top_log_probs", {**args, "top_k": first.top_k},
                                                              tensors)
            out = {"logprobs": logprobs, "top_logprobs": top_logprobs, "top_ids": top_ids}
        elif "candidate_ids" in batch:
            tensors["candidate_ids"] = check_candidate_ids(batch, model)
            logprobs, at_candidates = await self._run("compute_candidate_log_probs", args, tensors)
            out = {"logprobs": logprobs, "candidate_logprobs": at_candidates.float()}
        else:
            out = {"logprobs": await self._run("compute_log_probs", args, tensors)}
        for chunks in batch_to_chunks(out):
            yield trainer_pb2.BatchResponse(chunks=chunks)

    async def ComputeValues(self, request_iterator, context):
        _, batch = await read_batch(request_iterator, self.config.stream_limits())
        critic = self._roles().need("critic")
        values = await self._run("compute_values", {}, check_vocab(batch, critic.model))
        for chunks in batch_to_chunks({"values": values}):
            yield trainer_pb2.BatchResponse(chunks=chunks)

    async def UpdateActor(self, request_iterator, context):
        first, batch = await read_batch(request_iterator, self.config.stream_limits(), extra=("advantages",))
        step = first.step
        roles = self._roles()
        tensors = actor_update_tensors(batch, roles.settings.actor, roles.need("actor").model)
        updated = await self._run("update_actor", {}, tensors)
        log.info("actor_updated", run_id=roles.run_id, step=step, weight_version=updated.weight_version)
        return trainer_pb2.UpdateResponse(metrics=updated.metrics, weight_version=updated.weight_version)

    async def UpdateCritic(self, request_iterator, context):
        first, batch = await read_batch(request_iterator, self.config.stream_limits(), extra=("values", "returns"))
        step = first.step
        roles = self._roles()
        critic = roles.need("critic")
        tensors = {**check_vocab(batch, critic.model), "values": batch["values"].float(),
                   "returns": batch["returns"].float()}
        metrics = await self._run("update_critic", {}, tensors)
        log.info("critic_updated", run_id=roles.run_id, step=step)
        return trainer_pb2.UpdateResponse(metrics=metrics, weight_version=self.worker.weight_version)

    async def TrainSupervised(self, request_iterator, context):
        _, batch = await read_batch(request_iterator, self.config.stream_limits())
        actor = self._roles().need("actor")
        updated = await self._run("train_supervised", {}, check_vocab(batch, actor.model))
        return trainer_pb2.UpdateResponse(metrics=updated.metrics, weight_version=updated.weight_version)

    async def PrepareChannel(self, request, context):
        if request.backend not in ("gloo", "nccl", "cuda_ipc"):
            raise ValueError(f"backend must be gloo, nccl or cuda_ipc, got {request.backend!r}")
        # A new channel replaces the run's old ones (a rollout came or went, or a sync failed), unless it is
        # formed beside them (keep_joined: one channel per transport). A broadcast may still be on an old one,
        # waiting for a member that stopped: abandoning the old from here ends it at once, and frees the model
        # thread, where the old channel is then closed.
        if not request.keep_joined:
            await asyncio.to_thread(self.channels.abandon_all)
            await self._on_model(self.channels.close_all)
            self.stores.clear()
        if request.backend == "nccl":
            return trainer_pb2.PrepareChannelResponse(rendezvous=await asyncio.to_thread(new_unique_id))
        host = rendezvous_host(self.config.host, self.config.coordinator)
        store, rendezvous = await asyncio.to_thread(prepare_gloo_rendezvous, host, 60.0)
        self.stores[request.channel_id] = store
        return trainer_pb2.PrepareChannelResponse(rendezvous=rendezvous)

    async def JoinChannel(self, request, context):
        if request.rank != 0:
            raise ValueError(f"the trainer is the channel's root and joins as rank 0, not {request.rank}")
        await self.channels.join(request.channel_id, request.backend, request.rendezvous, rank=request.rank,
                                 world_size=request.world_size, timeout_s=check_wait("timeout_s", request.timeout_s))
        log.info("channel_joined", channel_id=request.channel_id, rank=request.rank, world_size=request.world_size)
        return common_pb2.JoinChannelResponse(channel_id=request.channel_id)

    async def BroadcastWeights(self, request, context):
        self._roles().need("actor")
        channel = self.channels.get(request.channel_id)
        if request.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {request.bucket_bytes}")
        started = time.perf_counter()
        sent = await self._run("broadcast_weights", {"bucket_bytes": request.bucket_bytes}, {}, channel=channel)
        seconds = time.perf_counter() - started
        log.info("weights_sent", weight_version=sent.weight_version, bytes=sent.total_bytes, buckets=sent.buckets,
                 seconds=seconds)
        return trainer_pb2.BroadcastWeightsResponse(
            weight_version=sent.weight_version, total_bytes=sent.total_bytes, buckets=sent.buckets, seconds=seconds
        )

    async def SaveCheckpoint(self, request, context):
        roles = self._roles()
        path = inside(self.config.checkpoint_root, request.path, "path")
        key = await asyncio.to_thread(checkpoint_key, Path(self.config.checkpoint_root))
        await asyncio.to_thread(checkpoint.check_replaceable, path, roles.run_id, key)
        started = time.perf_counter()
        saved = await self._run("save_checkpoint", {"path": str(path)}, {}, key=key)
        log.info("checkpoint_saved", run_id=roles.run_id, path=request.path, bytes=saved.total_bytes)
        return trainer_pb2.CheckpointResponse(path=request.path, total_bytes=saved.total_bytes,
                                              weight_version=saved.weight_version,
                                              seconds=time.perf_counter() - started)

    async def LoadCheckpoint(self, request, context):
        roles = self._roles()
        path = inside(self.config.checkpoint_root, request.path, "path")
        key = await asyncio.to_thread(checkpoint_key, Path(self.config.checkpoint_root))
        await asyncio.to_thread(checkpoint.check_complete, roles, path, key)
        started = time.perf_counter()
        version = await self._run("load_checkpoint", {"path": str(path)}, {})
        log.info("checkpoint_loaded", run_id=roles.run_id, path=request.path, weight_version=version)
        return trainer_pb2.CheckpointResponse(path=request.path, weight_version=version,
                                              seconds=time.perf_counter() - started)

    async def Info(self, request, context):
        return self._info()

    def weight_version(self) -> int | None:
        """The actor's version, when this trainer hosts the actor of a loaded run."""
        roles = self.worker.roles
        return self.worker.weight_version if roles is not None and roles.actor is not None else None

    def _info(self) -> common_pb2.ServiceInfo:
        roles = self.worker.roles
        return common_pb2.ServiceInfo(
            identity=self.identity, weight_version=self.worker.weight_version, run_id=roles.run_id if roles else "",
            details={"model_path": roles.settings.model_path if roles else "",
                     "device": self.config.device, "roles": ",".join(roles.hosted()) if roles else "",
                     "ranks": str(self.worker.ranks.world_size), "gpu": self._gpu,
                     "parameters": ",".join(f"{role}={count}" for role, count in
                                            (roles.parameter_counts() if roles else {}).items())},
        )

    async def close(self) -> None:
        await asyncio.to_thread(self.channels.abandon_all)  # a broadcast in flight ends, freeing the model thread
        await self._on_model(self.channels.close_all)
        await self._on_model(self.worker.stop)
        self._model_thread.shutdown(wait=False, cancel_futures=True)
        self.worker.ranks.close()


def attach(server, config: TrainerServiceConfig, identity: common_pb2.ServiceIdentity) -> TrainerServicer:
    """Rank 0's servicer; under torchrun this first waits for the other ranks to join. It offers the built-in policy
    losses and those its policy_loss_modules register (listed in ``identity``)."""
    POLICY_LOSSES.load_builtins()  # first: a user's module reusing a built-in's name is the one refused
    import_modules(config.policy_loss_modules, "policy_loss_modules")
    identity.policy_losses.extend(POLICY_LOSSES.names())
    servicer = TrainerServicer(config, identity, RankWorker(join(config.device, config.collective_timeout_s)))
    telemetry.watch_memory(servicer.worker.ranks.device)
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
    return servicer
