"""The rollout servicer: wire <-> engine, nothing else."""

from __future__ import annotations

from pathlib import Path

import structlog
import torch

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.errors import FailedPrecondition, NotFound
from services.common.limits import MAX_PROBE_TOP_K, MAX_STOP_TOKENS, check_at_most, check_temperature, check_wait
from services.run.models import refuse_pickled_weights
from services.common.sequences import join_ragged
from services.common.wire import BatchAssembler, batch_to_chunks, read_stream
from services.rollout import telemetry
from services.rollout.config import RolloutServiceConfig
from services.rollout.engines import Engine, load_engine
from services.rollout.sampling import SamplingSettings
from services.rollout.swap import PartialRollout
from services.rollout.vllm_lora import AdapterServing, vllm_max_lora_rank

log = structlog.get_logger()
MODEL_DTYPES = ("float32", "bfloat16", "float16")


def sampling_from_pb(params: rollout_pb2.SamplingParams, config: RolloutServiceConfig) -> SamplingSettings:
    """The call's sampling, once each parameter is known to mean something and to be within the service's
    limits (ValueError or ResourceExhausted naming the field)."""
    if params.n < 1:
        raise ValueError(f"params.n must be >= 1, got {params.n}")
    if params.max_new_tokens < 1:
        raise ValueError(f"params.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    if not 0 < params.top_p <= 1:  # NaN too
        raise ValueError(f"params.top_p must be in (0, 1], got {params.top_p}")
    if len(params.stop_token_ids) > MAX_STOP_TOKENS:
        raise ValueError(f"params.stop_token_ids holds {len(params.stop_token_ids)} ids, more than {MAX_STOP_TOKENS}")
    return SamplingSettings(
        n=check_at_most("params.n", params.n, limit=config.max_n, setting="max_n"),
        temperature=check_temperature("params.temperature", params.temperature), top_p=params.top_p,
        max_new_tokens=check_at_most("params.max_new_tokens", params.max_new_tokens, limit=config.max_new_tokens,
                                     setting="max_new_tokens"),
        seed=params.seed, stop_token_ids=tuple(params.stop_token_ids), routed_experts=params.return_routed_experts,
    )


def adapter_serving_from_pb(request: rollout_pb2.RolloutInitRequest) -> AdapterServing | None:
    """A LoRA run's adapters as InitRun describes them (None for full weights); ValueError for adapter_versions
    without lora_rank."""
    if not request.lora_rank:
        if request.adapter_versions:
            raise ValueError(f"adapter_versions {request.adapter_versions} is for a LoRA run: set lora_rank too")
        return None
    return AdapterServing(rank=request.lora_rank, versions=max(request.adapter_versions, 1))


def partial_rollout_from_pb(request: rollout_pb2.ReceiveWeightsRequest) -> PartialRollout:
    """What the swap does with the Generate calls in flight, from the request's two flags (ValueError for
    both)."""
    if request.keep_in_flight and request.restart_in_flight:
        raise ValueError("keep_in_flight and restart_in_flight exclude each other: set one at most")
    return "keep" if request.keep_in_flight else "restart" if request.restart_in_flight else "finish"


def seed_indices_of(params: rollout_pb2.SamplingParams, prompts: int) -> list[int]:
    """Each prompt's seed index: its seed_indices entry where they are given (one per prompt, else
    INVALID_ARGUMENT), else first_index + its position."""
    if not params.seed_indices:
        return [params.first_index + i for i in range(prompts)]
    if len(params.seed_indices) != prompts:
        raise ValueError(f"seed_indices has {len(params.seed_indices)} entries for {prompts} prompts")
    return list(params.seed_indices)


def check_call_size(prompts: int, sampling: SamplingSettings, config: RolloutServiceConfig) -> None:
    """Refuse a call whose prompts x n x max_new_tokens is over max_tokens_per_call."""
    check_at_most(f"{prompts} prompts x params.n {sampling.n} x params.max_new_tokens {sampling.max_new_tokens}",
                  prompts * sampling.n * sampling.max_new_tokens, limit=config.max_tokens_per_call,
                  setting="max_tokens_per_call")


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, config: RolloutServiceConfig, identity: common_pb2.ServiceIdentity):
        self.config = config
        self.identity = identity
        self.engine: Engine | None = None
        self.run_id = ""
        self.model_path = ""
        self.asleep = False

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise FailedPrecondition("no model loaded: call InitRun first")
        if self.asleep:
            raise FailedPrecondition("the engine is asleep: call WakeUp first")
        return self.engine

    async def InitRun(self, request, context):
        """Load the run's model. The engine held before serves on until the new one is loaded, and stays if
        that fails; but a vLLM engine goes first (its GPUs hold one)."""
        dtype = request.dtype or "float32"
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {list(MODEL_DTYPES)}, got {dtype!r}")
        check_model_folder(request.model_path)
        refuse_pickled_weights(request.model_path, request.allow_pickle, "model_path")
        lora = adapter_serving_from_pb(request)
        if lora and self.config.engine == "vllm":
            vllm_max_lora_rank(lora.rank)  # a rank vLLM cannot serve is refused before the old engine goes
        if self.config.engine == "vllm" and self.engine is not None:
            await self.engine.close()
            self.engine = None
        try:
            engine = await load_engine(self.config, request.model_path, dtype=dtype, allow_pickle=request.allow_pickle,
                                       lora=lora, routed_experts=request.return_routed_experts)
        except (OSError, ValueError, KeyError) as error:  # what transformers and vLLM raise for a folder they refuse
            raise ValueError(f"model_path {request.model_path}: the model cannot be loaded "
                             f"({type(error).__name__}: {error})") from None
        held, self.engine = self.engine, engine
        self.run_id, self.model_path, self.asleep = request.run_id, request.model_path, False
        if held is not None:
            await held.close()
        log.info("model_loaded", run_id=request.run_id, model_path=request.model_path, engine=self.config.engine,
                 lora_rank=request.lora_rank, adapter_versions=request.adapter_versions)
        return self._info()

    async def Generate(self, request_iterator, context):
        assembler = BatchAssembler()
        first = await read_stream(request_iterator, assembler, self.config.stream_limits())
        engine = self._require_engine()
        if first is None:
            raise ValueError("empty Generate stream")
        params = first.params
        sampling = sampling_from_pb(params, self.config)
        batch = assembler.result(required=("prompt_ids", "prompt_lens"))
        prompts = prompt_lists(batch["prompt_ids"], batch["prompt_lens"], engine.vocab_size)
        check_call_size(len(prompts), sampling, self.config)
        check_prompt_lengths(prompts, sampling.max_new_tokens, engine.max_model_len)
        log.info("generating", run_id=self.run_id, prompts=len(prompts), n=sampling.n)
        with telemetry.REQUESTS_IN_FLIGHT.track_inprogress():
            completions = await engine.generate(prompts, sampling, seed_indices_of(params, len(prompts)))
        flat = [c for group in completions for c in group]
        telemetry.GENERATED_SEQUENCES.inc(len(flat))
        telemetry.GENERATED_TOKENS.inc(sum(len(c.token_ids) for c in flat))
        response_ids, response_lens = join_ragged([c.token_ids for c in flat], torch.int64)
        logprobs, _ = join_ragged([c.logprobs for c in flat], torch.float32)
        truncated = torch.tensor([c.finish_reason == "length" for c in flat], dtype=torch.bool)
        versions = torch.tensor([c.first_version for c in flat], dtype=torch.int64)
        out = {"response_ids": response_ids, "response_lens": response_lens, "logprobs": logprobs,
               "truncated": truncated, "weight_versions": versions,
               "last_weight_versions": torch.tensor([c.last_version for c in flat], dtype=torch.int64)}
        if sampling.routed_experts:
            out["routed_experts"] = torch.cat([c.routed_experts for c in flat if c.routed_experts is not None])
        oldest = int(versions.min()) if len(versions) else engine.weight_version
        for chunks in batch_to_chunks(out):
            yield rollout_pb2.GenerateResponse(chunks=chunks, weight_version=oldest)

    async def ComputeLogProbs(self, request_iterator, context):
        assembler = BatchAssembler()
        first = await read_stream(request_iterator, assembler, self.config.stream_limits())
        engine = self._require_engine()
        top_k = first.top_k if first is not None else 0
        if top_k > MAX_PROBE_TOP_K:
            raise ValueError(f"top_k must be at most {MAX_PROBE_TOP_K} (vLLM's max_logprobs), got {top_k}")
        batch = assembler.result(required=("prompt_ids", "prompt_lens", "response_ids", "response_lens"))
        prompts = prompt_lists(batch["prompt_ids"], batch["prompt_lens"], engine.vocab_size)
        responses = token_lists(batch["response_ids"], batch["response_lens"], engine.vocab_size,
                                names=("response_ids", "response_lens"))
        if len(prompts) != len(responses):
            raise ValueError(f"prompt_lens has {len(prompts)} entries, response_lens {len(responses)}: one each per "
                             "sequence")
        check_prompt_lengths([p + r for p, r in zip(prompts, responses)], 1, engine.max_model_len)
        scored = await engine.compute_log_probs(prompts, responses, top_k)
        out = {"logprobs": torch.tensor([value for row in scored.logprobs for value in row], dtype=torch.float32)}
        if scored.top is not None:
            out |= {"top_ids": scored.top.ids.to(torch.int64), "top_logprobs": scored.top.logprobs.float()}
        for chunks in batch_to_chunks(out):
            yield rollout_pb2.ComputeLogProbsResponse(chunks=chunks, weight_version=scored.version)

    async def JoinChannel(self, request, context):
        timeout_s = check_wait("timeout_s", request.timeout_s)
        await self._require_engine().join_channel(
            request.channel_id, request.backend, rendezvous=request.rendezvous, rank=request.rank,
            world_size=request.world_size, timeout_s=timeout_s)
        log.info("channel_joined", channel_id=request.channel_id, rank=request.rank, world_size=request.world_size)
        return common_pb2.JoinChannelResponse(channel_id=request.channel_id)

    async def ReceiveWeights(self, request, context):
        timeout_s = check_wait("timeout_s", request.timeout_s)
        partial_rollout = partial_rollout_from_pb(request)
        swap = await self._require_engine().receive_weights(request.channel_id, timeout_s, partial_rollout)
        log.info("weights_received", weight_version=swap.version, transfer_s=swap.transfer_s, pause_s=swap.pause_s,
                 in_flight=partial_rollout, stages={stage: round(s, 4) for stage, s in swap.stages.items()})
        return common_pb2.WeightVersion(version=swap.version, transfer_s=swap.transfer_s, pause_s=swap.pause_s,
                                        memory=await self._require_engine().memory())

    async def Sleep(self, request, context):
        if not self.asleep:
            await self._require_engine().sleep()
            self.asleep = True
            log.info("engine_asleep", run_id=self.run_id)
        return self._info()

    async def WakeUp(self, request, context):
        if self.engine is None:
            raise FailedPrecondition("no model loaded: call InitRun first")
        if self.asleep:  # waking an engine that is awake is a no-op, so a coordinator may always ask
            await self.engine.wake_up()
            self.asleep = False
            log.info("engine_awake", run_id=self.run_id)
        return self._info()

    async def Info(self, request, context):
        return self._info()

    def weight_version(self) -> int | None:
        return self.engine.weight_version if self.engine is not None else None

    def _info(self) -> common_pb2.ServiceInfo:
        details = {"engine": self.config.engine, "model_path": self.model_path, "device": self.config.device,
                   "asleep": str(self.asleep).lower()}
        if self.config.colocated is not None:
            details["colocated"] = str(self.config.colocated).lower()
        if self.engine is not None:
            details["channel_ranks"] = str(self.engine.channel_ranks)
            details["gpus"] = ",".join(self.engine.gpus)
        version = self.engine.weight_version if self.engine is not None else 0
        return common_pb2.ServiceInfo(identity=self.identity, weight_version=version, run_id=self.run_id,
                                      details=details)

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()


def check_prompt_lengths(prompts: list[list[int]], max_new_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt that, with max_new_tokens more, is longer than the model takes."""
    for index, prompt in enumerate(prompts):
        if len(prompt) + max_new_tokens > max_model_len:
            raise ValueError(f"prompt {index} has {len(prompt)} tokens: with params.max_new_tokens {max_new_tokens} "
                             f"that is more than the {max_model_len} the model takes")


def check_model_folder(model_path: str) -> None:
    """NotFound unless ``model_path`` is a folder; ValueError unless it holds a model's config.json."""
    if not model_path or not Path(model_path).is_dir():
        raise NotFound(f"model_path: no folder {model_path!r}")
    if not (Path(model_path) / "config.json").is_file():
        raise ValueError(f"model_path: no config.json in model folder {model_path}")


def prompt_lists(prompt_ids: torch.Tensor, prompt_lens: torch.Tensor, vocab_size: int) -> list[list[int]]:
    return token_lists(prompt_ids, prompt_lens, vocab_size, names=("prompt_ids", "prompt_lens"))


def token_lists(ids: torch.Tensor, lens: torch.Tensor, vocab_size: int, *, names: tuple[str, str]) -> list[list[int]]:
    """Ragged token ids (``names``: of the ids and the lengths tensors, for the errors) as lists, once they are
    int64, each length is positive and they sum to the ids, and every id is in the vocabulary (ValueError)."""
    ids_name, lens_name = names
    if ids.dtype != torch.int64 or lens.dtype != torch.int64:
        raise ValueError(f"{ids_name} and {lens_name} must be int64")
    if lens.dim() != 1 or (lens < 1).any() or int(lens.sum()) != ids.numel():
        raise ValueError(f"{lens_name} must be positive and sum to len({ids_name})")
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{ids_name} must lie in [0, {vocab_size})")
    return [row.tolist() for row in torch.split(ids, lens.tolist())]


def attach(server, config: RolloutServiceConfig, identity: common_pb2.ServiceIdentity) -> RolloutServicer:
    identity.limits.update(config.request_limits())  # registered with: a run over them is refused at StartRun
    servicer = RolloutServicer(config, identity)
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    return servicer
