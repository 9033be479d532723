"""The coordinator's clients of the other services: domain values in, domain values out.

Protobuf stops here: the loop sees SequenceBatch, tensors and dicts.
Every call has a deadline; batches are streamed in chunks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import NamedTuple

import grpc
import torch

from meshrl.v1 import (common_pb2, env_pb2, env_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2,
                       rollout_pb2_grpc, trainer_pb2, trainer_pb2_grpc)
from services.common.rpc import Connection
from services.common.sequences import SequenceBatch
from services.common.wire import BatchAssembler, batch_to_chunks
from services.coordinator.settings import Sampling

CONTROL_TIMEOUT_S = 30.0


class CheckpointRefused(ValueError):
    """A trainer would not load a checkpoint folder; the message says why (the trainer's words)."""


def sequence_tensors(batch: SequenceBatch) -> dict[str, torch.Tensor]:
    """The batch's tensors under their names on the wire; its loss mask and routed experts only where it has
    them."""
    tensors = {"prompt_ids": batch.prompt_ids, "prompt_lens": batch.prompt_lens,
               "response_ids": batch.response_ids, "response_lens": batch.response_lens}
    if batch.loss_mask is not None:
        tensors["loss_mask"] = batch.loss_mask
    if batch.routed_experts is not None:
        tensors["routed_experts"] = batch.routed_experts
    return tensors


@dataclass(frozen=True, kw_only=True)
class Generated:
    """Responses of one Generate call: row i*n+j is sample j of prompt i."""

    response_ids: torch.Tensor  # [T] int64
    response_lens: torch.Tensor  # [B*n] int64
    logprobs: torch.Tensor  # [T] float32, the rollout engine's
    truncated: torch.Tensor  # [B*n] bool
    weight_versions: torch.Tensor  # [B*n] int64, the weights that sampled each response's first token
    last_weight_versions: torch.Tensor | None = None  # [B*n] int64, its last token's (None: as weight_versions)
    routed_experts: torch.Tensor | None = None  # [sum of prompt + response lens - B*n, layers, k] where asked for

    @property
    def last_versions(self) -> torch.Tensor:
        """The weights that sampled each response's last token (a rollout that does not say: its first's)."""
        return self.weight_versions if self.last_weight_versions is None else self.last_weight_versions


@dataclass(frozen=True, kw_only=True)
class RolloutScores:
    """A rollout's scores of given sequences (the weight check's probe), under the weights it serves."""

    version: int  # of those weights
    logprobs: torch.Tensor  # [T] float32: each response token's, temperature 1
    top_ids: torch.Tensor | None = None  # [T, k] int64: the k most likely next tokens at each response token's
    # position, most likely first, where asked for
    top_logprobs: torch.Tensor | None = None  # [T, k] float32: their logprobs


class TrainerTop(NamedTuple):
    """The actor's scores of given sequences with, at each response token's position, its most likely next tokens
    (the weight check's trainer side)."""

    logprobs: torch.Tensor  # [T] float32: each response token's
    top_logprobs: torch.Tensor  # [T, k] float32: the k most likely next tokens' logprobs, most likely first
    top_ids: torch.Tensor  # [T, k] int64: their ids


@dataclass(frozen=True, kw_only=True)
class Received:
    """A rollout's side of one weight sync."""

    version: int
    transfer_s: float  # receiving (generation may go on meanwhile)
    pause_s: float  # generation held back for the swap
    memory: dict[str, float] = field(default_factory=dict)  # the engine's since its previous sync (verl-named)


@dataclass(frozen=True, kw_only=True)
class RolloutInfo:
    """What a rollout says of itself: the run it has loaded ("" for none) and the weights it serves."""

    run_id: str
    weight_version: int
    channel_ranks: int  # ranks its engine takes in a weight channel
    gpus: frozenset[str] = frozenset()  # UUIDs of the GPUs its engine works on (none on CPU)
    colocated: bool | None = None  # it says it shares the trainer's device (None: it does not say; see GPUs)
    engine: str = ""  # its inference engine: hf or vllm
    service_id: str = ""  # unique for the life of its process: one restarted has another


@dataclass(frozen=True)
class TrainerPlacement:
    """Where a trainer computes."""

    gpu: str  # UUID of the GPU its rank 0 sends weights from ("" on CPU)
    ranks: int  # its processes, one device each


@dataclass(frozen=True, kw_only=True)
class RewardSample:
    """One response to score: the reward service picks its scorer by ``data_source``."""

    data_source: str
    response: str
    ground_truth: str
    extra_info: dict
    prompt: str = ""  # the prompt as text (a reward model scores prompt + response)


@dataclass(frozen=True, kw_only=True)
class ScoredSample:
    score: float
    valid: bool
    error: str
    acc: bool | None = None  # whether the answer is right, where the scorer says (verl's "acc")
    pred: str = ""  # the answer the scorer read in the response (verl's "pred")
    components: tuple[tuple[str, float, float], ...] = ()  # (name, weight, value) of each part of the score
    timed_out: bool = False  # the scorer ran out of time on it (a rule's sample then scores 0)


@dataclass(frozen=True, kw_only=True)
class SyncResult:
    weight_version: int
    total_bytes: int
    buckets: int
    seconds: float


class RolloutClient:
    def __init__(self, address: str):
        self.address = address
        self._conn = Connection(address)
        self._stub = rollout_pb2_grpc.RolloutStub(self._conn.channel)

    async def init_run(self, run_id: str, model_path: str, dtype: str, *, timeout: float,
                       allow_pickle: bool = False, lora_rank: int = 0, adapter_versions: int = 0,
                       routed_experts: bool = False) -> int:
        """Load the run's model (for a LoRA run's adapters up to ``lora_rank``, ``adapter_versions`` of them
        loaded at once; with ``routed_experts``, ready to return each token's experts); returns how many ranks
        the engine takes in a weight channel."""
        async with self._conn.slot():
            info = await self._stub.InitRun(rollout_pb2.RolloutInitRequest(
                run_id=run_id, model_path=model_path, dtype=dtype, allow_pickle=allow_pickle, lora_rank=lora_rank,
                adapter_versions=adapter_versions, return_routed_experts=routed_experts), timeout=timeout)
        return int(info.details.get("channel_ranks", "1"))

    async def generate(self, prompts: list[list[int]], sampling: Sampling, seed: int, *, first_index: int,
                       timeout: float, seed_indices: list[int] | None = None) -> Generated:
        """``sampling.n`` responses per prompt, prompt i seeded from (``seed``, ``first_index`` + i), or from
        (``seed``, ``seed_indices[i]``) where they are given."""
        params = rollout_pb2.SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
            max_new_tokens=sampling.max_new_tokens, seed=seed, first_index=first_index,
            stop_token_ids=list(sampling.stop_token_ids), seed_indices=seed_indices or [],
            return_routed_experts=sampling.routed_experts,
        )
        flat = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64)

        def requests():
            for index, chunks in enumerate(batch_to_chunks({"prompt_ids": flat, "prompt_lens": lens})):
                yield rollout_pb2.GenerateRequest(params=params if index == 0 else None, chunks=chunks)

        assembler = BatchAssembler()
        async with self._conn.slot():
            async for reply in self._stub.Generate(requests(), timeout=timeout):
                assembler.add(reply.chunks)
        out = assembler.result(required=("response_ids", "response_lens", "logprobs", "truncated", "weight_versions"))
        n = sampling.n
        if len(out["response_lens"]) != len(prompts) * n or len(out["weight_versions"]) != len(prompts) * n:
            raise ValueError(f"rollout {self.address} returned {len(out['response_lens'])} responses, "
                             f"not {len(prompts) * n}")
        last = out.get("last_weight_versions")  # (a rollout from before it was sent sends none)
        if last is not None and (len(last) != len(prompts) * n or bool((last < out["weight_versions"]).any())):
            raise ValueError(f"rollout {self.address} returned last_weight_versions that are not one per response, "
                             f"each at least its weight_versions")
        routes = out.get("routed_experts")
        if sampling.routed_experts:
            fed = (lens.repeat_interleave(n) + out["response_lens"] - 1).sum()
            if routes is None or routes.dim() != 3 or routes.shape[0] != int(fed):
                raise ValueError(f"rollout {self.address} returned routed_experts "
                                 f"{None if routes is None else list(routes.shape)}, not {int(fed)} tokens' routes")
        return Generated(response_ids=out["response_ids"], response_lens=out["response_lens"], logprobs=out["logprobs"],
                         truncated=out["truncated"], weight_versions=out["weight_versions"], last_weight_versions=last,
                         routed_experts=routes)

    async def join_channel(self, channel_id: str, backend: str, rendezvous: bytes, *, rank: int, world_size: int,
                           timeout: float) -> None:
        async with self._conn.slot():
            request = join_request(channel_id, backend, rendezvous=rendezvous, rank=rank, world_size=world_size,
                                   timeout=timeout)
            await self._stub.JoinChannel(request, timeout=timeout + 15)

    async def receive_weights(self, channel_id: str, timeout: float, partial_rollout: str = "finish") -> Received:
        """Receive one broadcast; the Generate calls in flight at the swap finish under the old weights
        (``finish``), are sampled again under the new ones (``restart``) or go on under them (``keep``)."""
        request = rollout_pb2.ReceiveWeightsRequest(channel_id=channel_id, timeout_s=timeout,
                                                    restart_in_flight=partial_rollout == "restart",
                                                    keep_in_flight=partial_rollout == "keep")
        async with self._conn.slot():
            reply = await self._stub.ReceiveWeights(request, timeout=timeout + 5)
        return Received(version=reply.version, transfer_s=reply.transfer_s, pause_s=reply.pause_s,
                        memory=dict(reply.memory))

    async def compute_log_probs(self, batch: SequenceBatch, timeout: float, *, top_k: int = 0) -> RolloutScores:
        """The weight version it serves, the logprobs [T] (temperature 1) of the batch's response tokens under it,
        and with ``top_k`` the top_k most likely next tokens at each of their positions."""
        tensors = sequence_tensors(batch)
        tensors.pop("loss_mask", None)
        tensors.pop("routed_experts", None)

        def requests():
            for index, chunks in enumerate(batch_to_chunks(tensors)):
                yield rollout_pb2.ComputeLogProbsRequest(chunks=chunks, top_k=top_k if index == 0 else 0)

        assembler, version = BatchAssembler(), -1
        async with self._conn.slot():
            async for reply in self._stub.ComputeLogProbs(requests(), timeout=timeout):
                assembler.add(reply.chunks)
                version = reply.weight_version
        answer = assembler.result(required=("logprobs",) + (("top_ids", "top_logprobs") if top_k else ()))
        logprobs = answer["logprobs"]
        if logprobs.shape != batch.response_ids.shape:
            raise ValueError(f"rollout {self.address} returned {logprobs.numel()} logprobs for "
                             f"{batch.response_ids.numel()} response tokens")
        if not top_k:
            return RolloutScores(version=version, logprobs=logprobs)
        top_ids, top_logprobs = answer["top_ids"], answer["top_logprobs"]
        if top_ids.dim() != 2 or top_ids.shape[0] != logprobs.numel() or top_ids.shape != top_logprobs.shape:
            raise ValueError(f"rollout {self.address} returned top-k tokens of shape {list(top_ids.shape)} and "
                             f"logprobs {list(top_logprobs.shape)} for {logprobs.numel()} response tokens")
        return RolloutScores(version=version, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_logprobs)

    async def sleep(self, timeout: float) -> None:
        """Free the engine's GPU memory for a trainer on the same GPU; Generate is refused until wake_up."""
        async with self._conn.slot():
            await self._stub.Sleep(common_pb2.InfoRequest(), timeout=timeout)

    async def wake_up(self, timeout: float) -> None:
        async with self._conn.slot():
            await self._stub.WakeUp(common_pb2.InfoRequest(), timeout=timeout)

    async def info(self, timeout: float = CONTROL_TIMEOUT_S) -> RolloutInfo:
        async with self._conn.slot():
            reply = await self._stub.Info(common_pb2.InfoRequest(), timeout=timeout)
        colocated = reply.details.get("colocated", "")
        return RolloutInfo(run_id=reply.run_id, weight_version=reply.weight_version,
                           channel_ranks=int(reply.details.get("channel_ranks", "1")),
                           gpus=frozenset(filter(None, reply.details.get("gpus", "").split(","))),
                           colocated=None if not colocated else colocated == "true",
                           engine=reply.details.get("engine", ""), service_id=reply.identity.service_id)

    async def weight_version(self) -> int:
        return (await self.info()).weight_version

    async def close(self) -> None:
        await self._conn.close()


class TrainerClient:
    def __init__(self, address: str):
        self.address = address
        self._conn = Connection(address)
        self._stub = trainer_pb2_grpc.TrainerStub(self._conn.channel)

    async def init_run(self, run_id: str, run_config_yaml: str, roles: list[str], *, seed: int, timeout: float) -> None:
        async with self._conn.slot():
            await self._stub.InitRun(trainer_pb2.TrainerInitRequest(
                run_id=run_id, run_config_yaml=run_config_yaml, roles=roles, seed=seed), timeout=timeout)

    async def _stream_out(self, method, tensors: dict[str, torch.Tensor], step: int, *, role: str, name: str,
                          timeout: float, temperature: float = 0.0) -> torch.Tensor:
        assembler = BatchAssembler()
        async with self._conn.slot():
            async for reply in method(batch_requests(tensors, step, role, temperature=temperature), timeout=timeout):
                assembler.add(reply.chunks)
        return assembler.result(required=(name,))[name]

    async def compute_log_probs(self, batch: SequenceBatch, step: int, timeout: float, *, role: str = "actor",
                                temperature: float = 0.0) -> torch.Tensor:
        """Logprobs [T] of the response tokens under the actor (role actor) or the reference (role ref), at
        ``temperature`` (0: the run's)."""
        return await self._stream_out(self._stub.ComputeLogProbs, sequence_tensors(batch), step=step, role=role,
                                      name="logprobs", timeout=timeout, temperature=temperature)

    async def compute_candidate_log_probs(self, batch: SequenceBatch, candidate_ids: torch.Tensor, *, timeout: float,
                                          temperature: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's logprobs [T] of the response tokens and [T, m] of ``candidate_ids`` [T, m] at each response
        token's position, at ``temperature`` (0: the run's)."""
        tensors = {**sequence_tensors(batch), "candidate_ids": candidate_ids}
        assembler = BatchAssembler()
        async with self._conn.slot():
            async for reply in self._stub.ComputeLogProbs(batch_requests(tensors, 0, "actor", temperature=temperature),
                                                          timeout=timeout):
                assembler.add(reply.chunks)
        answer = assembler.result(required=("logprobs", "candidate_logprobs"))
        return answer["logprobs"], answer["candidate_logprobs"]

    async def compute_top_log_probs(self, batch: SequenceBatch, top_k: int, *, timeout: float,
                                    temperature: float = 0.0) -> TrainerTop:
        """The actor's logprobs of the response tokens and, at each response token's position, its ``top_k`` most
        likely next tokens (at most the vocabulary), at ``temperature`` (0: the run's)."""
        assembler = BatchAssembler()
        async with self._conn.slot():
            async for reply in self._stub.ComputeLogProbs(
                    batch_requests(sequence_tensors(batch), 0, "actor", temperature=temperature, top_k=top_k),
                    timeout=timeout):
                assembler.add(reply.chunks)
        answer = assembler.result(required=("logprobs", "top_logprobs", "top_ids"))
        return TrainerTop(logprobs=answer["logprobs"], top_logprobs=answer["top_logprobs"], top_ids=answer["top_ids"])

    async def compute_values(self, batch: SequenceBatch, step: int, timeout: float) -> torch.Tensor:
        return await self._stream_out(self._stub.ComputeValues, sequence_tensors(batch), step=step, role="",
                                      name="values", timeout=timeout)

    async def _update(self, method, tensors: dict[str, torch.Tensor], step: int, *, timeout: float):
        async with self._conn.slot():
            reply = await method(batch_requests(tensors, step), timeout=timeout)
        return dict(reply.metrics), reply.weight_version

    async def update_actor(self, batch: SequenceBatch, old_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                           *, ref_logprobs: torch.Tensor | None, step: int, timeout: float,
                           rollout_logprobs: torch.Tensor | None = None) -> tuple[dict[str, float], int]:
        """One PPO update; ``old_logprobs`` None: it is one optimizer step and takes its own; ``rollout_logprobs``
        [T] (the rollout engine's) are needed when rollout correction is on, or for the mismatch metrics without
        old logprobs."""
        tensors = {**sequence_tensors(batch), "advantages": advantages}
        if old_logprobs is not None:
            tensors["old_logprobs"] = old_logprobs
        if ref_logprobs is not None:
            tensors["ref_logprobs"] = ref_logprobs
        if rollout_logprobs is not None:
            tensors["rollout_logprobs"] = rollout_logprobs
        return await self._update(self._stub.UpdateActor, tensors, step=step, timeout=timeout)

    async def update_critic(self, batch: SequenceBatch, values: torch.Tensor, returns: torch.Tensor, *, step: int,
                            timeout: float) -> dict[str, float]:
        tensors = {**sequence_tensors(batch), "values": values, "returns": returns}
        return (await self._update(self._stub.UpdateCritic, tensors, step=step, timeout=timeout))[0]

    async def train_supervised(self, batch: SequenceBatch, step: int, timeout: float) -> tuple[dict[str, float], int]:
        return await self._update(self._stub.TrainSupervised, sequence_tensors(batch), step=step, timeout=timeout)

    async def gpu(self, timeout: float = CONTROL_TIMEOUT_S) -> str:
        """The UUID of the GPU the trainer sends weights from ("" on CPU)."""
        async with self._conn.slot():
            info = await self._stub.Info(common_pb2.InfoRequest(), timeout=timeout)
        return info.details.get("gpu", "")

    async def placement(self, timeout: float = CONTROL_TIMEOUT_S) -> TrainerPlacement:
        """Where the trainer computes: the GPU it sends weights from, and its ranks."""
        async with self._conn.slot():
            info = await self._stub.Info(common_pb2.InfoRequest(), timeout=timeout)
        return TrainerPlacement(gpu=info.details.get("gpu", ""), ranks=int(info.details.get("ranks", "1")))

    async def prepare_channel(self, channel_id: str, backend: str, world_size: int, *, timeout: float,
                              keep_joined: bool = False) -> bytes:
        """The rendezvous of a new channel (the trainer closes its old ones first, after its model work in
        flight: the deadline must cover that; with ``keep_joined`` it keeps them, the new one formed beside)."""
        async with self._conn.slot():
            reply = await self._stub.PrepareChannel(
                trainer_pb2.PrepareChannelRequest(channel_id=channel_id, backend=backend, world_size=world_size,
                                                  keep_joined=keep_joined),
                timeout=timeout)
        return reply.rendezvous

    async def join_channel(self, channel_id: str, backend: str, rendezvous: bytes, *, world_size: int,
                           timeout: float) -> None:
        async with self._conn.slot():
            request = join_request(channel_id, backend, rendezvous=rendezvous, rank=0, world_size=world_size,
                                   timeout=timeout)
            await self._stub.JoinChannel(request, timeout=timeout + 15)

    async def broadcast_weights(self, channel_id: str, bucket_bytes: int, timeout: float) -> SyncResult:
        async with self._conn.slot():
            reply = await self._stub.BroadcastWeights(
                trainer_pb2.BroadcastWeightsRequest(channel_id=channel_id, bucket_bytes=bucket_bytes,
                                                    timeout_s=timeout),
                timeout=timeout + 5)
        return SyncResult(weight_version=reply.weight_version, total_bytes=reply.total_bytes,
                          buckets=reply.buckets, seconds=reply.seconds)

    async def save_checkpoint(self, run_id: str, path: str, timeout: float) -> int:
        """Save the hosted roles into ``path``; returns the bytes written."""
        async with self._conn.slot():
            reply = await self._stub.SaveCheckpoint(trainer_pb2.CheckpointRequest(run_id=run_id, path=path),
                                                    timeout=timeout)
        return reply.total_bytes

    async def load_checkpoint(self, run_id: str, path: str, timeout: float) -> int:
        """Restore the hosted roles from ``path``; returns the actor weight version there. CheckpointRefused
        when the trainer refuses the folder (damaged, incomplete, not of these roles)."""
        async with self._conn.slot():
            try:
                reply = await self._stub.LoadCheckpoint(trainer_pb2.CheckpointRequest(run_id=run_id, path=path),
                                                        timeout=timeout)
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise CheckpointRefused(error.details()) from None
                raise
        return reply.weight_version

    async def close(self) -> None:
        await self._conn.close()


class RewardClient:
    def __init__(self, address: str):
        self.address = address
        self._conn = Connection(address)
        self._stub = reward_pb2_grpc.RewardStub(self._conn.channel)

    async def score(self, samples: list[RewardSample], timeout: float) -> tuple[list[ScoredSample], str]:
        """Score the samples; returns one score each and the replica's id."""
        request = reward_pb2.ScoreRequest(samples=[
            reward_pb2.Sample(data_source=s.data_source, response=s.response, ground_truth=s.ground_truth,
                              extra_info_json=json.dumps(s.extra_info), prompt=s.prompt)
            for s in samples
        ])
        async with self._conn.slot():
            reply = await self._stub.Score(request, timeout=timeout)
        if len(reply.scores) != len(samples):
            raise ValueError(f"reward {self.address} returned {len(reply.scores)} scores for {len(samples)} samples")
        return [ScoredSample(score=s.score, valid=s.valid, error=s.error, acc=s.acc if s.HasField("acc") else None,
                             pred=s.pred, components=tuple((c.name, c.weight, c.value) for c in s.components),
                             timed_out=s.timed_out)
                for s in reply.scores], reply.service_id

    async def close(self) -> None:
        await self._conn.close()


Message = dict[str, str]  # a chat message: role, content (and a tool reply's name)


@dataclass(frozen=True, kw_only=True)
class EnvStep:
    """An environment's answer to one model turn."""

    messages: list[Message]  # the reply: tool messages, or the environment's observation (none: nothing to say)
    reward: float
    done: bool
    info: dict  # what the environment reports besides: tool calls and their outcomes, ...


@dataclass(frozen=True, kw_only=True)
class EnvDescription:
    """An env service: who it is, what it hosts (environment name -> its tools' OpenAI schemas), and how many
    episodes it can hold open at once."""

    service_id: str
    meshrl_version: str
    environments: dict[str, tuple[dict, ...]]
    workers: int
    agents: frozenset[str] = frozenset()  # the environments whose episodes run a user's agent (the run's gateway)


class GatewayAccess(NamedTuple):
    """What an agent environment's episode is given: the run's gateway (http://host:port/v1), the episode's key
    and the model's name there."""

    url: str
    key: str
    model: str


def message_of(pb: env_pb2.ChatMessage) -> Message:
    message = {"role": pb.role, "content": pb.content}
    return message | {"name": pb.name} if pb.name else message


class EnvClient:
    def __init__(self, address: str):
        self.address = address
        self._conn = Connection(address)
        self._stub = env_pb2_grpc.EnvStub(self._conn.channel)

    async def describe(self, timeout: float = CONTROL_TIMEOUT_S) -> EnvDescription:
        async with self._conn.slot():
            info = await self._stub.Info(common_pb2.InfoRequest(), timeout=timeout)
        return EnvDescription(
            service_id=info.identity.service_id, meshrl_version=info.identity.meshrl_version,
            environments={e.name: tuple(json.loads(tool.schema_json) for tool in e.tools) for e in info.environments},
            workers=info.workers, agents=frozenset(e.name for e in info.environments if e.runs_agent))

    async def reset(self, episode_id: str, row: dict, environment: str, *, max_parallel_calls: int,
                    timeout: float, access: GatewayAccess | None = None) -> list[Message]:
        """Open an episode of ``environment`` on ``row`` (at most ``max_parallel_calls`` tool calls run per turn;
        an agent environment's: its agent calls the gateway as ``access`` says): the messages it adds before the
        model's first turn."""
        gateway = {"gateway_url": access.url, "episode_key": access.key, "model": access.model} if access else {}
        async with self._conn.slot():
            reply = await self._stub.Reset(env_pb2.ResetRequest(
                episode_id=episode_id, row_json=json.dumps(row), env_name=environment,
                max_parallel_calls=max_parallel_calls, **gateway), timeout=timeout)
        return [message_of(m) for m in reply.messages]

    async def step(self, episode_id: str, content: str, timeout: float) -> EnvStep:
        """The model's turn ``content`` (its text as sampled) into the episode; the environment's answer."""
        async with self._conn.slot():
            reply = await self._stub.Step(env_pb2.StepRequest(
                episode_id=episode_id, message=env_pb2.ChatMessage(role="assistant", content=content)),
                timeout=timeout)
        return EnvStep(messages=[message_of(m) for m in reply.messages], reward=reply.reward, done=reply.done,
                       info=json.loads(reply.info_json or "{}"))

    async def close_episode(self, episode_id: str, timeout: float = CONTROL_TIMEOUT_S) -> None:
        async with self._conn.slot():
            await self._stub.Close(env_pb2.CloseRequest(episode_id=episode_id), timeout=timeout)

    async def close(self) -> None:
        await self._conn.close()


def join_request(channel_id: str, backend: str, rendezvous: bytes, *, rank: int, world_size: int, timeout: float):
    return common_pb2.JoinChannelRequest(channel_id=channel_id, backend=backend, rank=rank, world_size=world_size,
                                         rendezvous=rendezvous, timeout_s=timeout)


def batch_requests(tensors: dict[str, torch.Tensor], step: int, role: str = "", *, temperature: float = 0.0,
                   top_k: int = 0):
    for chunks in batch_to_chunks(tensors):
        yield trainer_pb2.BatchRequest(step=step, chunks=chunks, role=role, temperature=temperature, top_k=top_k)
