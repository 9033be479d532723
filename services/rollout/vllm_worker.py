"""Runs inside each vLLM worker process: the receiving end of the weight channel.

vLLM adds this class to its GPU worker's bases (``worker_extension_cls``);
its methods are called through ``collective_rpc`` and see the worker as
``self``. Names start with ``meshrl_`` so they never clash with the worker's
own (vLLM refuses an extension that would).

A mixture of experts needs more than ``load_weights``. Its experts arrive
fused, as transformers 5 holds them (``experts.gate_up_proj``), a name
vLLM's MoE models skip without a word, so they are sent on one tensor per
expert as a checkpoint names them (``services.run.experts``). And vLLM's
fused-MoE layers keep their weights in a kernel's layout, made after
loading (``process_weights_after_loading``: FlashInfer's CUTLASS kernel,
vLLM 0.20's pick for bf16 on an H100, swaps each expert's gate and up
rows); ``load_weights`` writes the checkpoint's layout over it, the
corruption of vllm-project/vllm#42821. So a model with such layers takes
each sync through vLLM's layerwise reload (``initialize_layerwise_reload``
before the first bucket, ``finalize_layerwise_reload`` after the last),
which loads every layer in the checkpoint's layout, redoes its processing
and copies the result into the tensors the engine computes with.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from services.common.adapters import adapter_pairs, is_adapter
from services.common.channel import gpu_uuid, open_weight_channel
from services.common.lifetime import end_with
from services.common.memory import memory_metrics
from services.common.timing import StageTimer
from services.common.weight_sync import StagedWeights, WeightReceiver, tensor_checksum
from services.rollout.direct_load import DirectLoader
from services.rollout.seeded_sampling import use_batched_seeded_sampling
from services.rollout.vllm_lora import peft_config, peft_tensors, unserved_modules
from services.run.experts import per_expert_tensors


def has_fused_moe(model: torch.nn.Module) -> bool:
    """Whether the model has vLLM fused-MoE layers (their experts' weights are ``w13_weight`` and ``w2_weight``)."""
    return any(hasattr(module, "w13_weight") for module in model.modules())


class MeshrlWorkerExtension:
    # The worker's own attributes used here, set by vLLM's GPU worker (annotations only: no class attributes, so
    # nothing for vLLM's name-clash check to see).
    device: torch.device
    model_runner: Any
    parallel_config: Any

    def meshrl_gpu(self) -> str:
        """The UUID of this worker's GPU."""
        return gpu_uuid(self.device)

    def meshrl_end_with(self, pid: int) -> None:
        """End this worker (and so vLLM's engine core, which ends when a worker does) when the rollout
        service's process ``pid`` ends, however it ends: vLLM's processes are not the service's children by
        PDEATHSIG, and would otherwise hold the GPU after a kill -9."""
        end_with(pid)

    def meshrl_batched_seeded_sampling(self) -> None:
        """Sample every seeded row of a step in one kernel (``seeded_sampling``) instead of one per row."""
        use_batched_seeded_sampling()

    def meshrl_moe_layers(self) -> list[int]:
        """The decoder layers whose MLP is a fused-MoE layer, by index (vLLM's routed-experts capture has a row per
        decoder layer; these are the rows it fills)."""
        from vllm.model_executor.layers.fused_moe.layer import FusedMoE

        return sorted({module.layer_id for module in self.model_runner.model.modules() if isinstance(module, FusedMoE)})

    def meshrl_memory(self) -> dict[str, float]:
        """verl's memory metrics of this worker since the previous call."""
        return memory_metrics(self.device)

    # called by vLLM's collective_rpc with its arguments by position (args=)
    def meshrl_join_channel(self, channel_id: str, backend: str, rendezvous: bytes, first_rank: int,  # noqa: PLR0917
                            world_size: int, timeout_s: float) -> int:
        """Leave the channels joined before, then join this one as rank first_rank + this worker's
        tensor-parallel rank; returns that rank."""
        channels = self.__dict__.setdefault("_meshrl_channels", {})
        rank = first_rank + self.parallel_config.rank
        for old in channels.values():
            old.close()
        channels.clear()
        channels[channel_id] = open_weight_channel(channel_id, backend, rendezvous=bytes(rendezvous), rank=rank,
                                                   world_size=world_size, timeout_s=timeout_s, device=str(self.device))
        return rank

    def _meshrl_channel(self, channel_id: str, timeout_s: float):
        channel = self.__dict__.get("_meshrl_channels", {}).get(channel_id)
        if channel is None:
            raise KeyError(f"channel {channel_id!r} not joined by this worker")
        channel.timeout_s = timeout_s
        return channel

    def meshrl_start_receive(self, channel_id: str, timeout_s: float) -> None:
        """Begin receiving one weight broadcast into staging buffers, on a thread beside the model's work."""
        self._meshrl_staged = StagedWeights(self._meshrl_channel(channel_id, timeout_s), self._meshrl_receiver())

    def meshrl_wait_received(self, wait_s: float) -> bool:
        """Whether the staged broadcast has fully arrived, waiting up to ``wait_s``."""
        return self._meshrl_staged.wait(wait_s)

    def meshrl_apply_received(self) -> tuple[int, dict[str, float]]:
        """Swap the staged weights in; returns their version and the seconds of each stage of their receipt
        and of the swap (``apply``)."""
        staged = self.__dict__.pop("_meshrl_staged")
        if not staged.wait(0):
            raise RuntimeError("the staged weights have not fully arrived")
        started = time.perf_counter()
        with self._meshrl_sync():
            for named in staged.buckets:
                self._meshrl_load(named)
        torch.cuda.synchronize(self.device)
        return staged.version, {**staged.timer.seconds, "apply": time.perf_counter() - started}

    def meshrl_apply_adapter(self, adapter_id: int, keep_ids: list[int]) -> tuple[int, dict[str, float]]:
        """Serve the staged broadcast, a LoRA adapter, as vLLM adapter ``adapter_id``, loaded from the received
        tensors (``vllm_lora``): the new one is built on this worker's GPU, the adapters loaded before and not in
        ``keep_ids`` are removed, and it is added to vLLM's LoRA manager, which moves it into a GPU slot at the
        first step that serves it, as it does any adapter it holds (moving it here would shift the slots under
        a batch whose adapter mapping vLLM keeps from step to step). Returns its version and the seconds of each
        stage of its receipt and of the load (``apply``). Raises, the adapters before it untouched, for a
        broadcast that is not an adapter or adapts a module vLLM does not serve LoRA on."""
        staged = self.__dict__.pop("_meshrl_staged")
        if not staged.wait(0):
            raise RuntimeError("the staged adapter has not fully arrived")
        started = time.perf_counter()
        named = [pair for bucket in staged.buckets for pair in bucket]
        if not is_adapter([name for name, _ in named]):
            raise ValueError("a vLLM rollout serving a LoRA run received full weights, not an adapter")
        manager = self.model_runner.lora_manager  # vLLM's LRUCacheWorkerLoRAManager
        adapters = manager._adapter_manager  # its LoRAModelManager, which holds the loaded adapters
        adapter = in_memory_adapter(adapter_id, named, manager, adapters=adapters, device=self.device)
        for old in set(adapters.list_adapters()) - set(keep_ids):
            adapters.remove_adapter(old)
        adapters.add_adapter(adapter)
        torch.cuda.synchronize(self.device)
        return staged.version, {**staged.timer.seconds, "apply": time.perf_counter() - started}

    def meshrl_remove_adapter(self, adapter_id: int) -> bool:
        """Remove adapter ``adapter_id`` if this worker loaded it (a sync that failed on another worker)."""
        return bool(self.model_runner.lora_manager._adapter_manager.remove_adapter(adapter_id))

    def meshrl_receive_now(self, channel_id: str, timeout_s: float) -> tuple[int, dict[str, float]]:
        """Receive one broadcast straight into the model (nothing is generating): each bucket is loaded while
        the next arrives, through three bucket buffers its receiver keeps. Returns the version and the seconds of
        each stage."""
        timer = StageTimer()
        with timer("receive"):
            channel = self._meshrl_channel(channel_id, timeout_s)
            with self._meshrl_sync():
                version = self._meshrl_receiver().receive(channel, self._meshrl_load, timer, keep_buffers=True)
            torch.cuda.synchronize(self.device)
        return version, timer.seconds

    def _meshrl_receiver(self) -> WeightReceiver:
        """This worker's receiving side, which keeps what its channels carried from sync to sync."""
        return self.__dict__.setdefault("_meshrl_weight_receiver", WeightReceiver())

    def _meshrl_has_fused_moe(self) -> bool:
        return self.__dict__.setdefault("_meshrl_fused_moe", has_fused_moe(self.model_runner.model))

    @contextmanager
    def _meshrl_sync(self) -> Iterator[None]:
        """One sync's loads; for a model with fused-MoE layers, inside vLLM's layerwise reload (module docstring).
        A sync broken off halfway still finalizes: layers that got no weights keep theirs, and the caller counts
        the model damaged."""
        if not self._meshrl_has_fused_moe():
            yield
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self.model_runner.model
        initialize_layerwise_reload(model)
        try:
            yield
        finally:
            finalize_layerwise_reload(model, self.model_runner.model_config)

    def _meshrl_load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket: copied straight into the model when every tensor has a learned view
        (``DirectLoader``), else through ``load_weights``, after which the loader learns where they landed. A
        model with fused-MoE layers always takes ``load_weights`` (inside ``_meshrl_sync``), its experts one
        tensor each, copied: the layerwise reload keeps what it is given until its layer is complete, and the
        bucket's buffer takes the next bucket before that."""
        if is_adapter([name for name, _ in named]):
            raise ValueError("a LoRA adapter came to a vLLM rollout started for full weights (its InitRun had "
                             "lora_rank 0)")
        if self._meshrl_has_fused_moe():
            self.model_runner.model.load_weights(weights=[
                (piece_name, piece.clone()) for name, tensor in named
                for piece_name, piece in per_expert_tensors(name, tensor)])
            return
        direct = self.__dict__.setdefault("_meshrl_direct", DirectLoader(self.model_runner.model))
        if direct.knows(named):
            direct.load(named)
        else:
            self.model_runner.model.load_weights(weights=named)
            direct.learn(named)

    def meshrl_shift_weight(self, name: str, delta: float) -> None:
        """Add ``delta`` to every value of parameter ``name`` as this worker holds it (a test's deliberately wrong
        weights: the rollout service's corrupt_weight_after_sync)."""
        parameters = dict(self.model_runner.model.named_parameters())
        if name not in parameters:
            raise KeyError(f"corrupt_weight_after_sync names {name!r}, which is not a parameter of the vLLM model")
        with torch.no_grad():
            parameters[name].add_(delta)
        torch.cuda.synchronize(self.device)

    def meshrl_weight_checksums(self) -> dict[str, int]:
        """Checksum of each of the model's parameters as this worker holds them (its TP shard)."""
        return {name: tensor_checksum(p.detach()) for name, p in self.model_runner.model.named_parameters()}

    def meshrl_expert_checksums(self) -> dict[str, tuple[str, list[int], list[int]]]:
        """Each fused-MoE layer's kernel (vLLM's UnquantizedMoeBackend name) and the checksum of each expert's
        w13_weight and w2_weight as this worker computes with them (its TP shard, in the kernel's layout), by the
        layer's name (``<...>.mlp.experts``): ``vllm_engine.ExpertChecksums``."""
        from vllm.model_executor.layers.fused_moe.layer import FusedMoE

        checksums = {}
        for name, module in self.model_runner.model.named_modules():
            if isinstance(module, FusedMoE):
                backend = getattr(module.quant_method, "unquantized_backend", None)
                kernel = backend.name if backend is not None else type(module.quant_method).__name__
                checksums[name] = (kernel, [tensor_checksum(expert) for expert in module.w13_weight.detach()],
                                   [tensor_checksum(expert) for expert in module.w2_weight.detach()])
        return checksums

    def meshrl_receive_raw(self, channel_id: str, nbytes: int, timeout_s: float) -> int:
        """Receive one plain broadcast of ``nbytes`` (the wire-speed reference of the benchmarks)."""
        channel = self._meshrl_channel(channel_id, timeout_s)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        channel.broadcast(buffer)
        torch.cuda.synchronize(self.device)
        return nbytes


def in_memory_adapter(adapter_id: int, named: list[tuple[str, torch.Tensor]], manager: Any, *, adapters: Any,
                      device: torch.device) -> Any:
    """vLLM's LoRAModel of a received adapter, built as its folder loader builds one (``_load_adapter``), from
    the tensors (copied: the receiver reuses its buffers) and a PEFT config made for them, on this worker's GPU;
    ValueError for a module vLLM does not serve LoRA on, or a rank over the engine's max_lora_rank."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    served = set(adapters.supported_lora_modules)
    for packed, parts in adapters.packed_modules_mapping.items():
        if packed in served:
            served |= set(parts)
    unserved = unserved_modules(list(adapter_pairs(named)), served)
    if unserved:
        raise ValueError(f"the adapter adapts {unserved[:3]}, which vLLM serves no LoRA on (it does on "
                         f"{sorted(served)})")
    peft = PEFTHelper.from_dict({**peft_config(named), "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft.validate_legal(manager.lora_config)
    model, dtype = adapters.model, manager.lora_config.lora_dtype
    tensors = {name: tensor.to(device=device, dtype=dtype, copy=True) for name, tensor in peft_tensors(named).items()}
    return LoRAModel.from_lora_tensors(
        lora_model_id=adapter_id, tensors=tensors, peft_helper=peft, device=str(device), dtype=dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=getattr(model, "hf_to_vllm_mapper", None),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
