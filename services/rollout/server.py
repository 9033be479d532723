"""The rollout servicer: wire <-> engine, nothing else.

Engine work (generation, weight loading) runs on one worker thread, so a
weight swap never interleaves with a generation; joining a channel (which
blocks until every member has joined) runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import structlog
import torch

from meshrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.channel import ChannelTable
from services.common.errors import FailedPrecondition
from services.common.models import load_causal_lm, load_tokenizer
from services.common.sequences import join_ragged
from services.common.weight_sync import receive_weights
from services.common.wire import BatchAssembler, batch_to_chunks
from services.rollout.config import RolloutServiceConfig
from services.rollout.hf_engine import HFEngine, SamplingSettings

log = structlog.get_logger()


def sampling_from_pb(params: rollout_pb2.SamplingParams) -> SamplingSettings:
    if params.n < 1:
        raise ValueError(f"params.n must be >= 1, got {params.n}")
    if not params.temperature > 0:
        raise ValueError(f"params.temperature must be > 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"params.top_p must be in (0, 1], got {params.top_p}")
    if params.max_new_tokens < 1:
        raise ValueError(f"params.max_new_tokens must be >= 1, got {params.max_new_tokens}")
    return SamplingSettings(
        params.n, params.temperature, params.top_p, params.max_new_tokens, params.seed, tuple(params.stop_token_ids)
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, config: RolloutServiceConfig, identity: common_pb2.ServiceIdentity):
        self.config = config
        self.identity = identity
        self.engine: HFEngine | None = None
        self.vocab_size = 0
        self.run_id = ""
        self.model_path = ""
        self.weight_version = 0
        self.channels = ChannelTable()
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def _on_engine(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, function, *args)

    def _require_engine(self) -> HFEngine:
        if self.engine is None:
            raise FailedPrecondition("no model loaded: call InitRun first")
        return self.engine

    async def InitRun(self, request, context):
        def load():
            tokenizer = load_tokenizer(request.model_path)
            model = load_causal_lm(request.model_path, request.dtype or "float32").to(self.config.device)
            eos = tokenizer.eos_token_id
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
            return HFEngine(model, pad, (eos,), self.config.batch_size), model.config.vocab_size

        self.engine, self.vocab_size = await self._on_engine(load)
        self.run_id, self.model_path, self.weight_version = request.run_id, request.model_path, 0
        log.info("model_loaded", run_id=request.run_id, model_path=request.model_path)
        return self._info()

    async def Generate(self, request_iterator, context):
        engine = self._require_engine()
        assembler, params = BatchAssembler(), None
        async for message in request_iterator:
            if params is None:
                params = message.params
            assembler.add(message.chunks)
        if params is None:
            raise ValueError("empty Generate stream")
        sampling = sampling_from_pb(params)
        batch = assembler.result(required=("prompt_ids", "prompt_lens"))
        prompts = self._prompts(batch["prompt_ids"], batch["prompt_lens"])
        completions, version = await self._on_engine(self._generate, engine, prompts, sampling, params.first_index)
        flat = [c for group in completions for c in group]
        response_ids, response_lens = join_ragged([c.token_ids for c in flat], torch.int64)
        logprobs, _ = join_ragged([c.logprobs for c in flat], torch.float32)
        truncated = torch.tensor([c.finish_reason == "length" for c in flat], dtype=torch.bool)
        out = {"response_ids": response_ids, "response_lens": response_lens, "logprobs": logprobs, "truncated": truncated}
        for chunks in batch_to_chunks(out):
            yield rollout_pb2.GenerateResponse(chunks=chunks, weight_version=version)

    def _generate(self, engine, prompts, sampling, first_index):
        return engine.generate(prompts, sampling, first_index), self.weight_version

    def _prompts(self, prompt_ids: torch.Tensor, prompt_lens: torch.Tensor) -> list[list[int]]:
        if prompt_ids.dtype != torch.int64 or prompt_lens.dtype != torch.int64:
            raise ValueError("prompt_ids and prompt_lens must be int64")
        if prompt_lens.dim() != 1 or (prompt_lens < 1).any() or int(prompt_lens.sum()) != prompt_ids.numel():
            raise ValueError("prompt_lens must be positive and sum to len(prompt_ids)")
        if prompt_ids.numel() and (prompt_ids.min() < 0 or prompt_ids.max() >= self.vocab_size):
            raise ValueError(f"prompt_ids must lie in [0, {self.vocab_size})")
        return [p.tolist() for p in torch.split(prompt_ids, prompt_lens.tolist())]

    async def JoinChannel(self, request, context):
        await self.channels.join(
            request.channel_id, request.backend, request.rendezvous, request.rank, request.world_size, request.timeout_s
        )
        log.info("channel_joined", channel_id=request.channel_id, rank=request.rank, world_size=request.world_size)
        return common_pb2.JoinChannelResponse(channel_id=request.channel_id)

    async def ReceiveWeights(self, request, context):
        engine = self._require_engine()
        channel = self.channels.get(request.channel_id)
        self.weight_version = await self._on_engine(receive_weights, channel, engine.load_weights)
        log.info("weights_received", weight_version=self.weight_version)
        return common_pb2.WeightVersion(version=self.weight_version)

    async def Info(self, request, context):
        return self._info()

    def _info(self) -> common_pb2.ServiceInfo:
        return common_pb2.ServiceInfo(
            identity=self.identity, weight_version=self.weight_version, run_id=self.run_id,
            details={"engine": self.config.engine, "model_path": self.model_path, "device": self.config.device},
        )

    async def close(self) -> None:
        self.channels.close_all()
        self._engine_thread.shutdown(wait=False, cancel_futures=True)


def attach(server, config: RolloutServiceConfig, identity: common_pb2.ServiceIdentity) -> RolloutServicer:
    servicer = RolloutServicer(config, identity)
    rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
    return servicer
