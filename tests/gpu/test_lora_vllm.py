"""LoRA on the vLLM rollout engine (one GPU): each adapter version is loaded inside vLLM's worker from the tensors
the weight channel brought, no file written, and a call in flight finishes under the adapter it began with.

- In this process: a LoRA actor (the trainer's RankWorker, rank 64, alpha 128, all-linear, adapters moved to random
  values so that they change the model) sends its adapters over CUDA IPC to a vLLM engine started for a LoRA
  run (max_staleness 1: two versions loaded). The rollout's logprobs match the trainer's for the adapted model,
  not the base's; a long call started under version 1 goes on while version 2 is loaded, ends stamped 1 and
  its logprobs are version 1's; version 3 leaves versions 2 and 3 loaded.
- A LoRA run of three GRPO steps with all four services, trainer and vLLM rollout on GPU 0, starting from a
  PEFT adapter folder of random adapters (lora_adapter_path): each step's rollout/trainer mismatch is a small
  fraction of the adapted model's KL to its base.

Each prints the adapter sync's bytes and seconds.

    python -m pytest tests/gpu/test_lora_vllm.py -s       (skips without a GPU and vLLM)

On an H200 (bench/results/gpu-tests-2026-12-05-c.md) the first test's figures held: gap 0.0111 with the adapter
against 0.669 for the base, the call in flight 0.0129 against version 1 (0.706 against 2), adapters 2 and 3
loaded after version 3; it then failed at an assertion the cut output did not show, most likely comparing
vLLM's list of ids with a set (now compared as sets; not re-run). The second did not finish within 190 s.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch
import yaml

from services.common.channel import open_weight_channel
from services.common.gloo_channel import prepare_gloo_rendezvous
from services.common.weight_sync import WeightSender
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from services.rollout.config import RolloutServiceConfig
from services.rollout.sampling import Completion, SamplingSettings
from services.rollout.vllm_lora import AdapterServing
from services.trainer.ranks import Ranks
from services.trainer.worker import RankWorker
from tests.gpu.conftest import cuda_trainer, needs, vllm_rollout
from tests.gpu.test_gpu_grpo import run
from tests.integration.test_faults import LogTail

RANK, ALPHA = 64, 128
CHANNEL, TIMEOUT_S = "lora-weights", 120.0
B_STD = 0.03  # random lora_B values: each adapted weight moves by about a third of its own size


def lora_worker(model: Path) -> RankWorker:
    """The trainer's RankWorker on GPU 0 with a LoRA actor and its reference (the base, adapters off), in bf16 and
    unsharded (plain tensors, which the test sets by hand)."""
    config = yaml.safe_dump({"actor_rollout_ref": {
        "model": {"path": str(model), "dtype": "bfloat16", "lora_rank": RANK, "lora_alpha": ALPHA},
        "actor": {"use_kl_loss": True, "optim": {"lr": 1e-4}}}})
    worker = RankWorker(Ranks.single("cuda"))
    worker.init_run({}, run_id="lora-vllm", run_config_yaml=config, roles=["actor", "ref"], seed=0)
    return worker


@torch.no_grad()
def move_adapters(actor, seed: int) -> None:
    """Random lora_B (A keeps PEFT's initial values): an adapter that changes what the model samples."""
    generator = torch.Generator().manual_seed(seed)
    for name, parameter in actor.model.named_parameters():
        if "lora_B" in name:
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * B_STD)


@torch.no_grad()
def trainable(actor) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in actor.model.named_parameters() if p.requires_grad}


@torch.no_grad()
def restore(actor, saved: dict[str, torch.Tensor]) -> None:
    for name, parameter in actor.model.named_parameters():
        if name in saved:
            parameter.copy_(saved[name])


def trainer_logprobs(worker: RankWorker, prompts: list[list[int]], completions: list[Completion], role: str
                     ) -> torch.Tensor:
    """The trainer's logprobs of the completions' tokens (completion i answers prompt i // n). [T]"""
    n = len(completions) // len(prompts)
    tensors = {
        "prompt_ids": torch.tensor([t for c in range(len(completions)) for t in prompts[c // n]]),
        "prompt_lens": torch.tensor([len(prompts[c // n]) for c in range(len(completions))]),
        "response_ids": torch.tensor([t for c in completions for t in c.token_ids]),
        "response_lens": torch.tensor([len(c.token_ids) for c in completions])}
    return worker.compute_log_probs(tensors, role=role).float().cpu()


def gap(worker: RankWorker, prompts: list[list[int]], completions: list[Completion], role: str = "actor") -> float:
    """Mean |trainer's logprob - rollout's| over the completions' tokens."""
    served = torch.tensor([lp for c in completions for lp in c.logprobs])
    return float((trainer_logprobs(worker, prompts, completions, role) - served).abs().mean())


async def adapters_on_vllm(model: Path) -> None:
    from services.rollout.vllm_engine import VLLMEngine

    worker = lora_worker(model)
    actor = worker.roles.actor
    config = RolloutServiceConfig(engine="vllm", enforce_eager=True, gpu_memory_utilization=0.3)
    engine = await VLLMEngine.create(str(model), "bfloat16", config, lora=AdapterServing(rank=RANK, versions=2))
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", TIMEOUT_S)
    joining = asyncio.create_task(engine.join_channel(CHANNEL, "cuda_ipc", rendezvous, rank=1, world_size=2,
                                                      timeout_s=TIMEOUT_S))
    channel = await asyncio.to_thread(open_weight_channel, CHANNEL, "cuda_ipc", rendezvous=rendezvous, rank=0,
                                      world_size=2, timeout_s=TIMEOUT_S, device="cuda:0")
    await joining
    sender = WeightSender()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 5000, (16,), generator=generator).tolist() for _ in range(8)]
    short = SamplingSettings(n=2, temperature=1.0, top_p=1.0, max_new_tokens=48, seed=5, stop_token_ids=())
    long = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_new_tokens=1024, seed=5, stop_token_ids=())

    async def sync(version: int, seed: int) -> None:
        move_adapters(actor, seed)
        torch.cuda.synchronize()
        started = time.perf_counter()
        receiving = asyncio.create_task(engine.receive_weights(CHANNEL, TIMEOUT_S))
        sent_bytes, _ = await asyncio.to_thread(sender.send, channel, actor.named_weights(), version,
                                                bucket_bytes=64 << 20)
        swap = await receiving
        took = time.perf_counter() - started
        assert swap.version == engine.weight_version == version
        stages = {stage: round(seconds * 1e3, 2) for stage, seconds in swap.stages.items()}
        print(f"adapter sync {version}: {sent_bytes / 2**20:.1f} MiB in {took * 1e3:.1f} ms from the send's start "
              f"to served (transfer {swap.transfer_s * 1e3:.1f} ms, load {swap.pause_s * 1e3:.1f} ms); stages ms "
              f"{stages}")

    async def generate(sampling: SamplingSettings, count: int) -> list[Completion]:
        groups = await engine.generate(prompts[:count], sampling, seed_indices=range(count))
        return [c for group in groups for c in group]

    try:
        await sync(1, seed=1)
        under_1 = await generate(short, 8)
        assert {(c.first_version, c.last_version) for c in under_1} == {(1, 1)}
        adapted, base = gap(worker, prompts, under_1), gap(worker, prompts, under_1, role="ref")
        print(f"version 1: |trainer - rollout| logprob {adapted:.4f} with the adapter, {base:.4f} for the base")
        assert adapted < 0.05 and adapted < 0.1 * base  # vLLM served the adapter, and the adapter matters
        saved_1 = trainable(actor)

        # a long call under version 1; version 2 is loaded while it runs, without waiting for it
        in_flight = asyncio.create_task(generate(long, 1))
        while engine.gate.generating == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # some of its tokens sampled
        await sync(2, seed=2)
        assert not in_flight.done()
        under_2 = await generate(short, 8)  # new calls get version 2 while the long one goes on under 1
        assert {(c.first_version, c.last_version) for c in under_2} == {(2, 2)}
        assert gap(worker, prompts, under_2) < 0.05
        [kept] = await in_flight
        assert (kept.first_version, kept.last_version) == (1, 1) and len(kept.token_ids) > 100
        under_2_gap = gap(worker, prompts[:1], [kept])
        restore(actor, saved_1)
        under_1_gap = gap(worker, prompts[:1], [kept])
        print(f"the call in flight across the sync: |trainer - rollout| logprob {under_1_gap:.4f} against version "
              f"1, {under_2_gap:.4f} against version 2")
        assert under_1_gap < 0.05 and under_1_gap < 0.1 * under_2_gap

        await sync(3, seed=3)
        loaded = set(await engine.llm.list_loras())  # vLLM 0.20.1 returns a list
        print(f"adapters loaded after version 3: {sorted(loaded)}")
        assert loaded == {2, 3}  # max_staleness + 1 = 2 versions loaded; 1 removed
        under_3 = gap(worker, prompts, await generate(short, 8))
        print(f"version 3: |trainer - rollout| logprob {under_3:.4f}")
        assert under_3 < 0.05
    finally:
        channel.close()
        await engine.close()
        del store


@needs(1)
def test_each_adapter_version_loads_from_memory_and_a_call_in_flight_keeps_its_own(qwen_05b):
    asyncio.run(adapters_on_vllm(qwen_05b))


def random_adapter_folder(model: Path, folder: Path) -> Path:
    """A PEFT adapter folder for ``model`` (rank 64, alpha 128, all-linear) with random lora_B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16),
                          LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear", lora_dropout=0.0))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * B_STD)
    peft.save_pretrained(folder)
    return folder


@needs(1)
def test_a_lora_grpo_run_on_vllm_samples_from_the_trainers_adapters(qwen_05b, tmp_path):
    data = write_jsonl(reverse_task_rows(256, 2, 6, seed=3), tmp_path / "reverse.jsonl")
    adapter = random_adapter_folder(qwen_05b, tmp_path / "adapter")
    config = yaml.safe_dump({
        "data": {"train_files": [str(data)], "train_batch_size": 32, "max_prompt_length": 16,
                 "max_response_length": 64},
        "actor_rollout_ref": {
            "model": {"path": str(qwen_05b), "dtype": "bfloat16", "lora_rank": RANK, "lora_alpha": ALPHA,
                      "lora_adapter_path": str(adapter)},
            # the reward never varies on a random model: the entropy bonus moves the adapters every step, and the
            # KL loss (weight 0) reports how far the adapted policy is from its base on the sampled tokens
            "actor": {"optim": {"lr": 1e-4}, "ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 64,
                      "entropy_coeff": 0.01, "use_kl_loss": True, "kl_loss_coef": 0.0, "kl_loss_type": "k3"},
            "rollout": {"name": "vllm", "n": 8},
        },
        "trainer": {"total_training_steps": 3, "experiment_name": "gpu-lora-vllm"},
    })
    cluster = LocalCluster(tmp_path / "state", (cuda_trainer(), vllm_rollout(0, 0.3), ServiceSpec(kind="reward")))
    try:
        asyncio.run(cluster.start(timeout_s=180))
        final, version = asyncio.run(run(cluster, config))
        sent = [e for e in LogTail(cluster, "trainer").read() if e["event"] == "weights_sent"]
        received = [e for e in LogTail(cluster, "rollout").read() if e["event"] == "weights_received"]
    finally:
        cluster.stop()
    assert final.state == "finished", final.error
    assert version == 3
    for out, back in zip(sent, received):
        print(f"adapter sync {out['weight_version']}: {out['bytes'] / 2**20:.1f} MiB in {out['buckets']} bucket(s), "
              f"trainer {out['seconds'] * 1e3:.1f} ms; rollout transfer {back['transfer_s'] * 1e3:.1f} ms, load "
              f"{back['pause_s'] * 1e3:.1f} ms")
    rows = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        mismatch, kl_to_base = row["training/rollout_mismatch_kl"], row["actor/kl_loss"]
        print(f"step {row['step']}: rollout/trainer mismatch KL {mismatch:.2e}, adapted policy's KL to its base "
              f"{kl_to_base:.2e}, probs diff mean {row['training/rollout_probs_diff_mean']:.2e}, "
              f"update_weights {row['timing_s/update_weights'] * 1e3:.1f} ms")
        assert kl_to_base > 0.01  # the adapter matters: a rollout serving the base would show it as mismatch
        assert mismatch < 0.1 * kl_to_base
