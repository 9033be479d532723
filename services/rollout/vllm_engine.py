"""The vLLM engine of the rollout service (GPU): AsyncLLM, token ids in and out.

- Prompts go in as token ids and responses come out as token ids: no
  tokenizer runs in the engine (``skip_tokenizer_init``), so nothing is
  re-tokenised; EOS and the run's stop tokens end a response.
- The logprob of each sampled token is the processed one (after
  temperature), the quantity the trainer recomputes.
- Each of the n samples of prompt i is seeded from (seed, its seed index),
  as in the hf engine, so a prompt's samples do not depend on the replica;
  with ``batched_seeded_sampling`` (the default) the workers draw every
  seeded row's noise in one kernel a step (``seeded_sampling``), not vLLM's
  one per row.
- Weights arrive inside vLLM's workers, through the worker extension
  ``services.rollout.vllm_worker.MeshrlWorkerExtension``: the coordinator's
  channel id, unique id and ranks reach it by ``collective_rpc``, and every
  tensor-parallel worker receives the full HF-named tensors, which vLLM's
  ``load_weights`` reslices (with one worker, later syncs copy straight
  into the places the first one showed: ``direct_load``). While calls are
  generating, the workers receive into staging buffers and generation is
  held back (``SwapGate``) only for the swap itself and the prefix-cache
  reset; with nothing generating, they load each bucket as it arrives.
  The requests in flight at a swap finish under the old weights first,
  are aborted and generated again under the new ones (``restart``), or
  (``keep``) are frozen by vLLM's pause (mode ``keep``) for the swap
  and go on under the new weights after ``resume_generation()``, keeping
  their tokens and their KV cache. With prefix caching on (multi-turn runs)
  a keep swap lets the requests in flight finish first, as ``finish`` does
  (``swap_mode``): vLLM 0.20 clears a prefix cache that running requests
  hold only by preempting them. On an H200 a multi-turn run whose every
  sample was caught by such swaps saw the trainer disown the rollout's
  tokens from the first swap on (rollout/trainer mismatch KL 0.58; 0.002 on
  the CPU's hf engine) and collapsed (bench/results/gpu-tests-2026-12-05-c.md;
  this rule has not run on a GPU since). A response
  is stamped with the version served when its call began and the one
  served when its final output came back: the versions of its tokens lie
  between the two (its first token may already be the newer one's).
  A swap that fails partway (the trainer gone, a bucket failing its
  checksum) leaves the model between two versions: Generate is refused as
  unavailable until a sync swaps a whole version in.
- A LoRA run's syncs bring adapters (``vllm_lora``): the engine runs with LoRA enabled and each version is
  loaded from the received tensors, in memory, under a new adapter id; a call is served with the adapter
  current when it began (its LoRARequest) and finishes under it, so the swap neither waits for nor stops
  the calls in flight (except under ``restart``, which samples them again under the new adapter). The last
  max_staleness + 1 versions (and any older one a call in flight still uses) stay loaded, older ones are
  removed. A sync whose adapter fails to load leaves the previous one serving, whole: the engine is not
  damaged, and the weight version it reports stays the previous one.
- Worker processes are spawned, not forked: this process already runs gRPC.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from services.run.models import load_tokenizer
from services.rollout.config import CORRUPTION, RolloutServiceConfig
from services.rollout.direct_load import STACKED
from services.rollout.sampling import Completion, SamplingSettings, ScoredResponses, TopTokens, hash_seed, joined
from services.rollout.swap import GenerationCall, PartialRollout, SwapGate, WeightSwap, failed_swap, not_whole
from services.rollout.vllm_lora import (IN_MEMORY, SPARE_ADAPTERS, AdapterServing, AdapterWindow, LoadedAdapter,
                                        lora_engine_args)

if TYPE_CHECKING:
    import torch

WORKER_EXTENSION = "services.rollout.vllm_worker.MeshrlWorkerExtension"
POLL_S = 0.002  # how often a sync asks the workers whether the weights have arrived while generation goes on


class VLLMEngine:
    def __init__(self, llm, vocab_size: int, eos_id: int | None, *, config: RolloutServiceConfig,
                 gpus: tuple[str, ...], lora: AdapterServing | None = None, routes: RouteLayout | None = None):
        self.llm = llm
        self.routes = routes  # where vLLM's captured routes are the MoE layers' (None: it captures none)
        self.gate = SwapGate()
        self.weight_version = 0
        self.damaged: str | None = None  # why the model is not one whole version (a swap failed partway)
        self.vocab_size = vocab_size
        self.max_model_len = llm.vllm_config.model_config.max_model_len
        self.eos_id = eos_id
        self.channel_ranks = config.tensor_parallel_size
        self.prefix_caching = config.enable_prefix_caching
        self.corrupt_weight = config.corrupt_weight_after_sync
        self.gpus = gpus
        # a LoRA run's adapter versions loaded, and how many calls in flight use each (by adapter id)
        self.adapters = AdapterWindow(lora.versions, lora.versions + SPARE_ADAPTERS) if lora else None
        self.adapter_calls: collections.Counter[int] = collections.Counter()

    @classmethod
    async def create(cls, model_path: str, dtype: str, config: RolloutServiceConfig, *, allow_pickle: bool = False,
                     lora: AdapterServing | None = None, routed_experts: bool = False) -> VLLMEngine:
        """vLLM started on the model; with ``routed_experts`` it captures each token's experts (vLLM's
        enable_return_routed_experts), which a mixture of experts needs for routing replay."""
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        settings = dict(
            model=model_path, dtype=dtype, skip_tokenizer_init=True, seed=0,
            gpu_memory_utilization=config.gpu_memory_utilization,
            tensor_parallel_size=config.tensor_parallel_size, enforce_eager=config.enforce_eager,
            enable_sleep_mode=config.enable_sleep_mode, max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching, logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION, load_format="auto" if allow_pickle else "safetensors",
            enable_return_routed_experts=routed_experts, moe_backend=config.moe_backend,
            **(lora_engine_args(lora) if lora else {}),
        )
        llm = await asyncio.to_thread(start_engine, settings)
        tokenizer = await asyncio.to_thread(load_tokenizer, model_path)
        vocab_size = llm.vllm_config.model_config.get_vocab_size()
        await llm.collective_rpc("meshrl_end_with", args=(os.getpid(),))
        if config.batched_seeded_sampling:
            await llm.collective_rpc("meshrl_batched_seeded_sampling")
        gpus = tuple(await llm.collective_rpc("meshrl_gpu"))
        routes = None
        if routed_experts:
            [moe_layers, *_] = await llm.collective_rpc("meshrl_moe_layers")
            routes = route_layout(moe_layers, llm.vllm_config.model_config.hf_text_config)
        return cls(llm, vocab_size=vocab_size, eos_id=tokenizer.eos_token_id, config=config, gpus=gpus, lora=lora,
                   routes=routes)

    async def generate(self, prompts: list[list[int]], sampling: SamplingSettings,
                       seed_indices: Sequence[int]) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        routes = self.routes if sampling.routed_experts else None
        if sampling.routed_experts and routes is None:
            raise ValueError("params.return_routed_experts: this vLLM rollout was loaded without routed experts "
                             "(InitRun's return_routed_experts: the run's actor.router_replay.mode R3 or "
                             "rollout.enable_rollout_routing_replay)")
        stops = sorted(set(sampling.stop_token_ids) | ({self.eos_id} if self.eos_id is not None else set()))

        async def one(index: int, prompt: list[int], first_version: int, *, request_id: str,
                      adapter: LoadedAdapter | None) -> list[Completion]:
            params = SamplingParams(
                n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                max_tokens=sampling.max_new_tokens, seed=hash_seed(sampling.seed, seed_indices[index], 0) % (1 << 31),
                stop_token_ids=stops, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
            )
            final: Any = None
            async for output in self.llm.generate({"prompt_token_ids": prompt}, params, request_id=request_id,
                                                  lora_request=lora_request_of(adapter)):
                final = output
            # a keep swap of full weights may have come between its tokens; an adapter serves it to the end
            last_version = first_version if adapter else self.weight_version
            return [completion_of(c, stops, first_version, last_version=last_version, prompt_len=len(prompt),
                                  routes=routes)
                    for c in sorted(final.outputs, key=lambda c: c.index)]

        async def attempt(call: GenerationCall) -> list[list[Completion]]:
            if self.damaged:
                raise not_whole(self.damaged)
            version = self.weight_version  # of its first tokens; only a keep swap lets it go on under another
            adapter = self.adapters.current if self.adapters else None  # which stays loaded while this runs
            request_ids = [uuid.uuid4().hex for _ in prompts]
            with self._using(adapter):
                try:  # an interrupt cancels the requests (cancelling AsyncLLM.generate aborts its request in vLLM)
                    return list(await call.unless_interrupted(
                        asyncio.gather(*(one(i, p, first_version=version, request_id=r, adapter=adapter)
                                         for i, (p, r) in enumerate(zip(prompts, request_ids))))))
                except BaseException:  # nothing goes on generating for no one: neither the requests beside one
                    await self.llm.abort(request_ids)  # that failed, nor those of a call cancelled (its client
                    raise  # gone, its deadline passed); vLLM ignores the ids it has finished

        return await self.gate.run(attempt)

    @contextlib.contextmanager
    def _using(self, adapter: LoadedAdapter | None):
        """Count a call in flight under ``adapter`` for the body of the ``with`` (a sync keeps it loaded)."""
        if adapter is None:
            yield
            return
        self.adapter_calls[adapter.adapter_id] += 1
        try:
            yield
        finally:
            self.adapter_calls[adapter.adapter_id] -= 1
            if not self.adapter_calls[adapter.adapter_id]:
                del self.adapter_calls[adapter.adapter_id]

    async def compute_log_probs(self, prompts: list[list[int]], responses: list[list[int]],
                                top_k: int = 0) -> ScoredResponses:
        """Each whole sequence goes in as a prompt with prompt_logprobs=top_k (the logprob of each prompt token
        given those before it, from the raw logits: temperature 1, and the top_k most likely tokens there beside
        it) and one token generated; the response's part is returned. vLLM reads no prefix cache for such a
        request, so it runs on the weights served now. Its requests join those in flight: AsyncLLM schedules them
        beside the running ones at its next step (nothing here waits for the Generate calls in flight; only a
        swap in progress holds them back, at the gate)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        top_k = min(top_k, self.vocab_size)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=top_k, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)

        async def one(prompt: list[int], response: list[int], request_id: str,
                      *, adapter: LoadedAdapter | None) -> tuple[list[float], TopTokens | None]:
            final: Any = None
            async for output in self.llm.generate({"prompt_token_ids": prompt + response}, params,
                                                  request_id=request_id, lora_request=lora_request_of(adapter)):
                final = output
            logprobs = prompt_logprobs_of(final.prompt_logprobs, prompt + response, first=len(prompt))
            return logprobs, top_tokens_of(final.prompt_logprobs, first=len(prompt), k=top_k) if top_k else None

        async def attempt(call: GenerationCall) -> ScoredResponses:
            if self.damaged:
                raise not_whole(self.damaged)
            version = self.weight_version  # the coordinator probes between its syncs, never during one
            adapter = self.adapters.current if self.adapters else None  # a LoRA run's: the adapted model is scored
            request_ids = [uuid.uuid4().hex for _ in prompts]
            with self._using(adapter):
                try:
                    scored = list(await call.unless_interrupted(
                        asyncio.gather(*(one(p, r, rid, adapter=adapter)
                                         for p, r, rid in zip(prompts, responses, request_ids)))))
                except BaseException:
                    await self.llm.abort(request_ids)
                    raise
            tops = [top for _, top in scored if top is not None]
            return ScoredResponses(version=version, logprobs=[logprobs for logprobs, _ in scored],
                                   top=joined(tops) if tops else None)

        return await self.gate.run(attempt)

    async def join_channel(self, channel_id, backend, rendezvous, *, rank, world_size, timeout_s) -> None:
        if backend not in ("nccl", "cuda_ipc"):
            raise ValueError(f"the vllm engine joins nccl or cuda_ipc channels, not {backend!r}")
        await self.llm.collective_rpc("meshrl_join_channel", timeout=timeout_s + 10,
                                      args=(channel_id, backend, bytes(rendezvous), rank, world_size, timeout_s))

    async def receive_weights(self, channel_id: str, timeout_s: float,
                              partial_rollout: PartialRollout = "finish") -> WeightSwap:
        """Receive one broadcast and serve it.

        While calls are generating, every worker receives into staging buffers and generation goes on; then,
        within a short pause, new requests wait, the requests in flight finish under the old weights (or are
        dropped and generated again under the new ones: ``restart``; or are frozen: ``keep``, where prefix caching
        is off: ``swap_mode``), the staged
        buckets are copied in and the prefix cache is cleared (then the frozen requests go on). With nothing
        generating, the workers load each bucket straight into the model as it arrives, in one call,
        generation held back throughout. A LoRA run's adapters: ``_receive_adapter``."""
        if self.adapters is not None:
            return await self._receive_adapter(channel_id, timeout_s, partial_rollout)
        if self.gate.generating == 0:
            return await self._receive_now(channel_id, timeout_s, partial_rollout)
        started = time.perf_counter()
        stages = await self._staged(channel_id, timeout_s)
        received = time.perf_counter()
        mode = swap_mode(partial_rollout, self.prefix_caching)
        async with self.gate.swap(mode):
            drained = time.perf_counter()
            async with self._frozen(mode == "keep" and self.gate.generating > 0, stages):
                applied = await self._swapped_in("meshrl_apply_received", (), timeout_s,
                                                 clear_prefix_cache=self.prefix_caching)
        done = time.perf_counter()
        stages.update(worker_stages(applied), drain=drained - received, apply=done - drained)
        return WeightSwap(version=self.weight_version, transfer_s=received - started, pause_s=done - received,
                          stages=stages)

    async def _staged(self, channel_id: str, timeout_s: float) -> dict[str, float]:
        """Have every worker receive one broadcast into staging buffers while generation goes on, and wait until
        it has arrived (polling the workers, so that the engine core schedules generation in between); returns
        the seconds of starting the receive (``start_rpc``) and of waiting (``wait_rpcs``)."""
        started = time.perf_counter()
        await self.llm.collective_rpc("meshrl_start_receive", timeout=30, args=(channel_id, timeout_s))
        asked = time.perf_counter()
        deadline = started + timeout_s
        while True:
            busy = self.gate.generating > 0
            wait_s = min(POLL_S if busy else timeout_s, max(deadline - time.perf_counter(), 0.0))
            if all(await self.llm.collective_rpc("meshrl_wait_received", timeout=wait_s + 30, args=(wait_s,))):
                break
            if time.perf_counter() > deadline:
                raise TimeoutError(f"weights on channel {channel_id} did not arrive within {timeout_s} s")
            await asyncio.sleep(POLL_S)  # the engine core schedules generation between polls
        return {"start_rpc": asked - started, "wait_rpcs": time.perf_counter() - asked}

    async def _receive_adapter(self, channel_id: str, timeout_s: float, partial_rollout: PartialRollout) -> WeightSwap:
        """Receive a LoRA adapter into staging buffers while generation goes on, then have every worker load it
        under a new id (``meshrl_apply_adapter``) and serve it to the calls that begin from then on. The calls in
        flight go on under the adapters they began with, the swap waiting for none of them (``finish`` and
        ``keep`` alike: vLLM serves a request one adapter to its end); ``restart`` stops them and samples them
        again under the new one. Should a worker fail to load it, the workers that did drop it and the previous
        adapter goes on serving."""
        assert self.adapters is not None
        started = time.perf_counter()
        stages = await self._staged(channel_id, timeout_s)
        received = time.perf_counter()
        async with (self.gate.swap("restart") if partial_rollout == "restart" else contextlib.nullcontext()):
            drained = time.perf_counter()
            kept = self.adapters.kept_beside_new(in_use=set(self.adapter_calls))
            adapter_id = self.adapters.new_id()
            keep_ids = [adapter.adapter_id for adapter in kept] + [adapter_id]
            try:
                applied = await self.llm.collective_rpc("meshrl_apply_adapter", timeout=timeout_s + 30,
                                                        args=(adapter_id, keep_ids))
                versions = {version for version, _ in applied}
                if len(versions) != 1:
                    raise RuntimeError(f"vLLM workers received different adapter versions: {sorted(versions)}")
            except BaseException:
                with contextlib.suppress(Exception):  # (the next sync's removal clears it all the same)
                    await asyncio.shield(self.llm.collective_rpc("meshrl_remove_adapter", timeout=30,
                                                                 args=(adapter_id,)))
                raise
            new = LoadedAdapter(version=versions.pop(), adapter_id=adapter_id)
            self.adapters.serve(kept, new)
            self.weight_version = new.version
        done = time.perf_counter()
        stages.update(worker_stages(applied), drain=drained - received, apply=done - drained)
        return WeightSwap(version=self.weight_version, transfer_s=received - started, pause_s=done - received,
                          stages=stages)

    @contextlib.asynccontextmanager
    async def _frozen(self, freeze: bool, stages: dict[str, float]):
        """With ``freeze``, the requests in flight frozen in vLLM for the body of the ``with``, their KV cache
        kept, then resumed, whatever happened; ``stages`` gets the seconds of freezing and of resuming."""
        if not freeze:
            yield
            return
        started = time.perf_counter()
        try:  # (a swap cancelled while the freeze is on its way resumes all the same)
            # AsyncLLM.pause_generation is this call then a 20 ms sleep, there so that the final outputs of
            # requests it aborts or drains come out before it returns: under keep none do, and the sleep would be
            # 20 ms of every swap's pause. The engine core answers once its step in progress is done.
            await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
            stages["freeze"] = time.perf_counter() - started
            yield
        finally:
            resumed = time.perf_counter()
            await asyncio.shield(self.llm.resume_generation())  # (a cancelled swap waits for it all the same)
            stages["resume"] = time.perf_counter() - resumed

    async def _receive_now(self, channel_id: str, timeout_s: float, partial_rollout: PartialRollout) -> WeightSwap:
        started = time.perf_counter()
        async with self.gate.swap(swap_mode(partial_rollout, self.prefix_caching)):
            drained = time.perf_counter()
            applied = await self._swapped_in("meshrl_receive_now", (channel_id, timeout_s), timeout_s,
                                             clear_prefix_cache=self.prefix_caching)
        done = time.perf_counter()
        stages = {**worker_stages(applied), "drain": drained - started, "receive_rpc": done - drained}
        return WeightSwap(version=self.weight_version, transfer_s=done - drained, pause_s=done - started,
                          stages=stages)

    async def _swapped_in(self, method: str, args: tuple, timeout_s: float,
                          *, clear_prefix_cache: bool) -> list[tuple[int, dict]]:
        """Call the workers' method that swaps weights in (generation is held back) and, alongside it, clear the
        prefix cache if asked (the engine core runs the two one after the other, so it costs no round trip;
        nothing is scheduled in between); the new version is then served. Returns each worker's (version,
        stages)."""
        swap = self.llm.collective_rpc(method, timeout=timeout_s + 30, args=args)
        try:
            if clear_prefix_cache:
                applied, cleared = await asyncio.gather(swap, self.llm.reset_prefix_cache())
                if not cleared:
                    raise RuntimeError("vLLM refused to clear its prefix cache after a weight swap")
            else:
                applied = await swap
            versions = [version for version, _ in applied]
            if len(set(versions)) != 1:
                raise RuntimeError(f"vLLM workers loaded different weight versions: {versions}")
            if self.corrupt_weight:  # a test's deliberately wrong weights (config.corrupt_weight_after_sync)
                await self.llm.collective_rpc("meshrl_shift_weight", timeout=30, args=(self.corrupt_weight, CORRUPTION))
        except BaseException as error:
            self.damaged = failed_swap(self.weight_version, error)
            raise
        self.weight_version, self.damaged = versions[0], None
        return applied

    async def checksums(self) -> list[dict[str, int]]:
        """Each worker's checksum of each of its parameters (tests compare them with the trainer's)."""
        return await self.llm.collective_rpc("meshrl_weight_checksums")

    async def expert_checksums(self) -> list[dict[str, ExpertChecksums]]:
        """Each worker's checksums of the experts each fused-MoE layer computes with, read from the kernel's own
        tensors, by layer (tests compare them with the trainer's: ``expected_expert_checksums``)."""
        workers = await self.llm.collective_rpc("meshrl_expert_checksums")
        return [{layer: ExpertChecksums(kernel, list(w13), list(w2)) for layer, (kernel, w13, w2) in held.items()}
                for held in workers]

    async def memory(self) -> dict[str, float]:
        workers = await self.llm.collective_rpc("meshrl_memory", timeout=30)
        return {key: max(worker[key] for worker in workers) for key in workers[0]}

    async def sleep(self) -> None:
        await self.llm.sleep(level=1)

    async def wake_up(self) -> None:
        await self.llm.wake_up()

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)


def start_engine(settings: dict):
    """vLLM's AsyncLLM with these engine arguments. Run on a thread: the first call imports vLLM, which takes
    seconds, and the service goes on answering Info and health checks meanwhile."""
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(**settings))


def swap_mode(partial_rollout: PartialRollout, prefix_caching: bool) -> PartialRollout:
    """What a full-weight swap does with the requests in flight: the run's ``partial_rollout``, except that with
    prefix caching on ``keep`` becomes ``finish`` (module docstring: the cache cannot be cleared under running
    requests without preempting them)."""
    return "finish" if partial_rollout == "keep" and prefix_caching else partial_rollout


def lora_request_of(adapter: LoadedAdapter | None):
    """vLLM's LoRARequest for ``adapter`` (None: the base model). Its path is never read: the workers loaded the
    adapter under its id before any request named it."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=adapter.name, lora_int_id=adapter.adapter_id, lora_path=IN_MEMORY)


def worker_stages(applied: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Each stage's seconds in the slowest worker, as worker_<stage>."""
    return {f"worker_{stage}": max(seconds[stage] for _, seconds in applied) for stage in applied[0][1]}


def completion_of(output, stops: list[int], first_version: int, *, last_version: int, prompt_len: int,
                  routes: RouteLayout | None = None) -> Completion:
    """Our Completion from a vLLM CompletionOutput: token ids, the sampled tokens' logprobs, the finish, and with
    ``routes`` the experts its tokens were routed to (``routes_of``); its tokens came from weight versions
    ``first_version`` to ``last_version``."""
    tokens = list(output.token_ids)
    logprobs = [output.logprobs[i][token].logprob for i, token in enumerate(tokens)]
    finished_by_stop = output.finish_reason == "stop" or (tokens and tokens[-1] in stops)
    routed = None if routes is None else routes_of(output.routed_experts, routes, fed=prompt_len + len(tokens) - 1)
    return Completion(token_ids=tokens, logprobs=logprobs, finish_reason="stop" if finished_by_stop else "length",
                      first_version=first_version, last_version=last_version, routed_experts=routed)


class RouteLayout(NamedTuple):
    """Where a model's routes are in what vLLM captures, and how they travel."""

    moe_layers: tuple[int, ...]  # the decoder layers with experts, in order: vLLM's capture has a row per decoder
    # layer (zeros at those without experts)
    dtype: torch.dtype  # ``routing.route_dtype`` of its expert count


def route_layout(moe_layers: list[int], hf_config: Any) -> RouteLayout:
    """The layout of a model whose decoder layers ``moe_layers`` hold experts (the workers' fused-MoE layers),
    ``hf_config`` (vLLM's hf_text_config) naming how many (num_experts, or Mixtral's num_local_experts)."""
    from services.run.routing import route_dtype

    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if not moe_layers or not experts:
        raise ValueError("routed experts were asked for, but the model has no mixture-of-experts layers")
    return RouteLayout(moe_layers=tuple(sorted(moe_layers)), dtype=route_dtype(int(experts)))


def routes_of(captured: Any, layout: RouteLayout, fed: int) -> torch.Tensor:
    """The routes of a response as they travel (``routing``): [fed, MoE layers, k] small ints, from vLLM's
    CompletionOutput.routed_experts ([prompt + response tokens - 1, decoder layers, k] int32 numpy: every token
    but the last, the prompt's included, as the sample feeds them to the model). ``fed``: the tokens the response
    fed the model (prompt + response - 1); vLLM's capture must cover exactly those."""
    import torch

    if captured is None:
        raise RuntimeError("vLLM returned no routed experts for a response (was it started with "
                           "enable_return_routed_experts?)")
    routes = torch.as_tensor(captured)
    if routes.dim() != 3 or routes.shape[0] != fed or routes.shape[1] <= max(layout.moe_layers):
        raise RuntimeError(f"vLLM returned routed experts of shape {list(routes.shape)} for a response that fed "
                           f"{fed} tokens through decoder layers {list(layout.moe_layers)}")
    return routes[:, list(layout.moe_layers)].to(layout.dtype)


def prompt_logprobs_of(prompt_logprobs: list, token_ids: list[int], first: int) -> list[float]:
    """The logprobs of ``token_ids[first:]`` from a vLLM request's ``prompt_logprobs`` (one entry per prompt
    token: None for the first, else a dict of token id -> Logprob holding the token itself)."""
    return [prompt_logprobs[i][token_ids[i]].logprob for i in range(first, len(token_ids))]


def top_tokens_of(prompt_logprobs: list, first: int, k: int) -> TopTokens:
    """The k most likely tokens at each position that predicts ``prompt_logprobs``' tokens ``first`` on, from a
    vLLM request's prompt_logprobs (asked with prompt_logprobs=k: each position's dict holds the top k, ranks 1 to
    k, and the prompt's own token with its rank, which may be past k)."""
    import torch

    ids, logprobs = [], []
    for position in prompt_logprobs[first:]:
        top = sorted((entry.rank, token, entry.logprob) for token, entry in position.items() if entry.rank <= k)
        if len(top) != k:
            raise ValueError(f"vLLM returned {len(top)} prompt logprobs of rank 1 to {k} at a position, not {k}")
        ids.append([token for _, token, _ in top])
        logprobs.append([logprob for _, _, logprob in top])
    return TopTokens(ids=torch.tensor(ids, dtype=torch.int64).reshape(-1, k),
                     logprobs=torch.tensor(logprobs, dtype=torch.float32).reshape(-1, k))


async def receive_raw(engine: VLLMEngine, channel_id: str, nbytes: int, *, timeout_s: float) -> None:
    """The workers receive one plain broadcast of ``nbytes`` (the reference the sync benchmark compares to)."""
    await engine.llm.collective_rpc("meshrl_receive_raw", timeout=timeout_s + 10, args=(channel_id, nbytes, timeout_s))


class ExpertChecksums(NamedTuple):
    """One fused-MoE layer's experts as vLLM computes with them: the kernel it runs and each expert's checksum
    (``weight_sync.tensor_checksum``) of its w13_weight (gate and up projections) and of its w2_weight (down)."""

    kernel: str  # vLLM's UnquantizedMoeBackend name: TRITON, FLASHINFER_CUTLASS, ...
    w13: list[int]
    w2: list[int]


KERNEL_W13_ORDER = {"TRITON": ("gate", "up"), "BATCHED_TRITON": ("gate", "up"), "FLASHINFER_CUTLASS": ("up", "gate")}
"""Each expert's w13 rows in vLLM 0.20's bf16 fused-MoE kernels (``convert_to_unquantized_kernel_format``):
the checkpoint's gate then up, except FlashInfer's CUTLASS kernel, which keeps up then gate. Its w2 is the
checkpoint's down projection in every one of them."""


def kernel_expert_layout(gate_up: torch.Tensor, down: torch.Tensor,
                         kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's experts as transformers holds them (gate_up_proj [E, 2I, H]: gate rows then up rows; down_proj
    [E, H, I]) in the layout of vLLM ``kernel`` (tensor parallel size 1): its w13_weight and w2_weight."""
    import torch

    if kernel not in KERNEL_W13_ORDER:
        raise ValueError(f"no known expert layout for vLLM's fused-MoE kernel {kernel} (known: "
                         f"{sorted(KERNEL_W13_ORDER)})")
    gate, up = gate_up.chunk(2, dim=1)
    rows = {"gate": gate, "up": up}
    return torch.cat([rows[part] for part in KERNEL_W13_ORDER[kernel]], dim=1), down


def expected_expert_checksums(named: dict[str, torch.Tensor], layer: str, kernel: str) -> ExpertChecksums:
    """The checksums vLLM's fused-MoE layer ``layer`` (``<...>.mlp.experts``) must show under ``kernel`` when it
    holds the transformers tensors ``named`` (``<layer>.gate_up_proj``, ``<layer>.down_proj``)."""
    from services.common.weight_sync import tensor_checksum

    w13, w2 = kernel_expert_layout(named[f"{layer}.gate_up_proj"], named[f"{layer}.down_proj"], kernel)
    return ExpertChecksums(kernel=kernel, w13=[tensor_checksum(expert) for expert in w13],
                           w2=[tensor_checksum(expert) for expert in w2])


def vllm_layout(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors vLLM holds (tensor parallel size 1) after ``load_weights`` of these HF-named Qwen2/Llama
    tensors: q/k/v and gate/up stacked along dim 0, everything else as it is."""
    import torch

    layout = {}
    for name, tensor in named.items():
        for fused, parts in STACKED:
            if any(f".{part}." in name for part in parts):
                if f".{parts[0]}." in name:
                    layout[name.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat(
                        [named[name.replace(f".{parts[0]}.", f".{part}.")] for part in parts])
                break
        else:
            layout[name] = tensor
    return layout
