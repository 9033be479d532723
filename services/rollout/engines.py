"""The rollout service's engines behind one async interface, and the choice between them.

An engine is created by InitRun and then called from the servicer:
``generate`` for each Generate call (many may be in flight), ``join_channel``
when the coordinator sets up the weight channel, ``receive_weights`` for
each sync (generation is held back while weights are swapped), ``sleep`` and
``wake_up`` when a trainer shares the GPU, ``close`` at the end.

Both engines receive the weights while generation goes on and swap them in
behind a ``SwapGate`` (``services.rollout.swap``). A LoRA run's syncs carry
adapters (``services.common.adapters``), which the hf engine serves merged into
its base weights (``HFEngine.load_adapter``) and the vLLM engine loads as LoRA
adapters from the received tensors (``services.rollout.vllm_lora``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch

from services.common.adapters import is_adapter
from services.common.channel import ChannelTable, gpu_uuid
from services.common.memory import memory_metrics
from services.run.models import load_causal_lm, load_tokenizer, moved
from services.common.weight_sync import StagedWeights, WeightReceiver
from services.rollout.config import CORRUPTION, RolloutServiceConfig
from services.rollout.hf_engine import HFEngine, WeightsNotLoaded
from services.rollout.sampling import Completion, SamplingSettings, ScoredResponses
from services.rollout.vllm_lora import AdapterServing
from services.rollout.swap import (GenerationCall, GenerationInterrupted, PartialRollout, SwapGate, WeightSwap,
                                   failed_swap, not_whole)

Result = TypeVar("Result")


class Engine(Protocol):
    vocab_size: int
    max_model_len: int  # the longest prompt + response its model takes
    channel_ranks: int  # ranks this engine takes in a weight channel (one per worker)
    weight_version: int  # of the weights it serves now (0 until the first sync)
    gpus: tuple[str, ...]  # UUIDs of the GPUs its workers use (none on CPU): where weights must reach it

    async def generate(self, prompts: list[list[int]], sampling: SamplingSettings,
                       seed_indices: Sequence[int]) -> list[list[Completion]]:
        """``sampling.n`` completions per prompt, prompt i seeded from ``seed_indices[i]``, each stamped with
        the weight versions that sampled its first and its last token."""

    async def compute_log_probs(self, prompts: list[list[int]], responses: list[list[int]],
                                top_k: int = 0) -> ScoredResponses:
        """The logprob (temperature 1) of each token of each response given its prompt and the response tokens
        before it, with ``top_k`` > 0 the top_k most likely next tokens at each of those positions, under the
        weights served now, and their version (the weight check's probe: never during a swap, and taken at once,
        beside the Generate calls in flight rather than after them)."""

    async def join_channel(self, channel_id: str, backend: str, rendezvous: bytes, *, rank: int, world_size: int,
                           timeout_s: float) -> None:
        """Join a weight channel; this engine's workers take ranks rank .. rank + channel_ranks - 1."""

    async def receive_weights(self, channel_id: str, timeout_s: float,
                              partial_rollout: PartialRollout = "finish") -> WeightSwap:
        """Receive one broadcast while generation goes on and swap it in; the Generate calls in flight at the
        swap finish under the old weights first, are sampled again under the new ones (``restart``), or are
        held for the swap itself and go on under the new ones (``keep``). A swap that fails after part of the
        weights went in leaves the engine damaged: Generate is refused (``swap.not_whole``) until a sync swaps a
        whole version in."""

    async def memory(self) -> dict[str, float]:
        """verl's memory metrics of the process holding the model since the previous call (``memory_metrics``;
        the largest worker's where there are several)."""

    async def sleep(self) -> None:
        """Free the GPU memory the engine holds (weights and KV cache) for a trainer on the same GPU."""

    async def wake_up(self) -> None:
        """Take the memory back after sleep."""

    async def close(self) -> None:
        """Release everything."""


class HFRolloutEngine:
    """The transformers engine: all model work (generation, loading weights, scoring the probe) on one thread;
    weights are received into staging buffers on a thread of their own while generation goes on. Work that must
    not wait for a Generate call in flight (a ``keep`` swap, the weight check's probe) is left for the engine
    thread to run between two token steps (``_between_token_steps``): at once when it is idle, else before the
    next token step of the generation it runs, which then goes on."""

    channel_ranks = 1

    def __init__(self, model_path: str, dtype: str, config: RolloutServiceConfig, *, allow_pickle: bool = False):
        tokenizer = load_tokenizer(model_path)
        model = moved(load_causal_lm(model_path, dtype, allow_pickle), config.device)
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.engine = HFEngine(model, pad_id=pad, eos_ids=(eos,), batch_size=config.batch_size)
        self.vocab_size = model.config.vocab_size
        self.max_model_len = model.config.max_position_embeddings
        self.device = config.device
        self.corrupt_weight = config.corrupt_weight_after_sync
        self.gpus: tuple[str, ...] = (gpu_uuid(config.device),) if torch.device(config.device).type == "cuda" else ()
        self.weight_version = 0  # changed only inside a swap, on the engine thread
        self.damaged: str | None = None  # why the model is not one whole version (a swap failed part way)
        self.gate = SwapGate()
        self.channels = ChannelTable(config.device)
        self.receiver = WeightReceiver()  # what its channels carried, kept from sync to sync
        self._staging: StagedWeights | None = None  # the last receive, which may still be on the wire
        self._waiting: collections.deque[tuple[Callable[[], Any], Future[Any]]] = collections.deque()  # work left
        # for the engine thread between token steps, in order (``_between_token_steps``)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def memory(self):
        return memory_metrics(torch.device(self.device))

    async def _on_engine(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    async def generate(self, prompts, sampling, seed_indices):
        def attempt(call: GenerationCall) -> list[list[Completion]]:
            def before_step() -> int:  # on the engine thread, between token steps
                if call.should_stop():
                    raise GenerationInterrupted
                self._run_waiting()
                if self.damaged:  # a keep swap failed part way under this call
                    raise not_whole(self.damaged)
                return self.weight_version

            if self.damaged:
                raise not_whole(self.damaged)
            return self.engine.generate(prompts, sampling, seed_indices=seed_indices, before_step=before_step)

        return await self.gate.run(lambda call: self._on_engine(attempt, call))

    async def compute_log_probs(self, prompts, responses, top_k=0):
        """Scored on the engine thread between two token steps of the generation in flight, if any (not after
        it): the weights cannot change while it runs, and the version it reports is theirs."""
        def score() -> ScoredResponses:
            if self.damaged:
                raise not_whole(self.damaged)
            logprobs, top = self.engine.score(prompts, responses, top_k)
            return ScoredResponses(version=self.weight_version, logprobs=logprobs, top=top)

        return await self.gate.run(lambda call: self._between_token_steps(score))

    def _run_waiting(self) -> None:
        """On the engine thread: run the work left for it (``_between_token_steps``), in the order it was left;
        work whose caller has gone (its future cancelled) is skipped."""
        while self._waiting:
            work, done = self._waiting.popleft()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(work())
            except Exception as error:  # noqa: BLE001 - it goes to whoever left the work
                done.set_exception(error)

    async def _between_token_steps(self, work: Callable[[], Result]) -> Result:
        """``work``'s result, run on the engine thread at once if it is idle, else between two token steps of the
        generation it runs (which then goes on), never after that generation."""
        done: Future[Result] = Future()
        self._waiting.append((work, done))
        self._thread.submit(self._run_waiting)  # whichever comes first: this, or the next token step
        return await asyncio.wrap_future(done)

    async def _leave_channels(self) -> None:
        """Close the channels joined. A receive still on one (a sync the new channel replaces) is abandoned,
        so it fails at once, as its own ReceiveWeights reports, rather than at the channel's deadline; the
        channels close once its thread has ended."""
        await asyncio.to_thread(self.channels.abandon_all)  # gloo waits a moment on each peer: not in the loop
        staging, self._staging = self._staging, None
        if staging is not None:
            with contextlib.suppress(Exception):  # its error went to its own ReceiveWeights
                await asyncio.to_thread(staging.wait, None)
        self.channels.close_all()

    async def join_channel(self, channel_id, backend, rendezvous, *, rank, world_size, timeout_s):
        """Leave the channels joined before, then join this one."""
        await self._leave_channels()
        await self.channels.join(channel_id, backend, rendezvous=rendezvous, rank=rank, world_size=world_size,
                                 timeout_s=timeout_s)

    async def receive_weights(self, channel_id, timeout_s, partial_rollout="finish"):
        """Receive into staging buffers while generation goes on, then swap them in behind the gate, on the
        engine thread (under ``keep``, between two token steps of the generation in flight, if any)."""
        channel = self.channels.get(channel_id)
        started = time.perf_counter()
        self._staging = staged = StagedWeights(channel, self.receiver)
        if not await asyncio.to_thread(staged.wait, timeout_s):
            raise TimeoutError(f"weights on channel {channel_id} did not arrive within {timeout_s} s")
        self._staging = None  # off the wire

        def apply() -> None:  # version and weights change together on the engine thread, even if this is cancelled
            loaded = 0  # buckets copied in
            try:
                named = [pair for bucket in staged.buckets for pair in bucket]
                if is_adapter([name for name, _ in named]):
                    self.engine.load_adapter(named)  # checked whole first: one refused leaves the previous adapter
                else:
                    for bucket in staged.buckets:
                        self.engine.load_weights(bucket)
                        loaded += 1
            except BaseException as error:
                if loaded or not isinstance(error, WeightsNotLoaded):  # part of the new weights went in
                    self.damaged = failed_swap(self.weight_version, error)
                raise
            if self.corrupt_weight:  # a test's deliberately wrong weights (config.corrupt_weight_after_sync)
                self.engine.shift_weight(self.corrupt_weight, CORRUPTION)
            self.weight_version, self.damaged = staged.version, None

        received = time.perf_counter()
        async with self.gate.swap(partial_rollout):
            drained = time.perf_counter()
            await (self._between_token_steps(apply) if partial_rollout == "keep" else self._on_engine(apply))
        done = time.perf_counter()
        stages = {**staged.timer.seconds, "drain": drained - received, "apply": done - drained}
        return WeightSwap(version=self.weight_version, transfer_s=received - started, pause_s=done - received,
                          stages=stages)

    async def sleep(self):
        pass

    async def wake_up(self):
        pass

    async def close(self):
        await self._leave_channels()
        self._thread.shutdown(wait=False, cancel_futures=True)


async def load_engine(config: RolloutServiceConfig, model_path: str, dtype: str, *, allow_pickle: bool = False,
                      lora: AdapterServing | None = None, routed_experts: bool = False) -> Engine:
    """The engine the service is configured for, with the run's model loaded (from safetensors unless
    ``allow_pickle``); for a LoRA run (``lora``) a vLLM engine starts with LoRA enabled, for a run that records
    routed experts (``routed_experts``) with their capture (the hf engine needs neither: it merges each adapter
    into its weights, and records routes through hooks when a call asks)."""
    if config.engine == "vllm":
        from services.rollout.vllm_engine import VLLMEngine

        return await VLLMEngine.create(model_path, dtype, config=config, allow_pickle=allow_pickle, lora=lora,
                                       routed_experts=routed_experts)
    return await asyncio.to_thread(HFRolloutEngine, model_path, dtype, config=config, allow_pickle=allow_pickle)
