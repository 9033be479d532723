"""GRPO on a random-init Qwen3-MoE served by vLLM, with several syncs: after the second and later syncs the
rollout's logprobs are the trainer's, as they were before any sync.

What it guards against (services/rollout/vllm_worker.py): experts sent under transformers 5's fused names,
which vLLM's MoE models skip without a word (stale experts), and a second ``load_weights`` writing the
checkpoint's layout over the fused-MoE kernel's (vllm-project/vllm#42821: FlashInfer's CUTLASS kernel, vLLM 0.20's
pick for bf16 on an H100, keeps each expert's up rows before its gate rows).

How far apart is "the same": step 1 generates on the weights both loaded from the folder, so its mismatch is
the two engines' bf16 arithmetic alone (and the experts each routes to, where two are nearly tied); a step after
a sync must stay within ten times that. On the CPU, with this model in fp32 (initializer_range 0.1, chosen so a
wrong layout shows: at 0.02 the logits are too flat), bf16 weights moved the k3 KL of the sampled tokens by 0.09
and mean |delta logprob| by 0.12; each expert's gate and up rows swapped moved them by 109 and 2.3.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from services.algos import DistributionDiff, LogprobDiff, distribution_diff, logprob_diff, topk_kl
from services.common.channel import open_weight_channel
from services.common.gloo_channel import prepare_gloo_rendezvous
from services.common.sequences import NO_ROUTE, SequenceBatch
from services.common.weight_sync import WeightSender
from services.coordinator.fleet.clients import RolloutClient
from services.coordinator.fleet.weight_probe import MOE_TOPK_KL
from services.coordinator.settings import Sampling
from services.rollout.config import RolloutServiceConfig
from services.rollout.sampling import SamplingSettings
from services.rollout.vllm_engine import VLLMEngine, expected_expert_checksums
from services.run.models import load_causal_lm
from services.run.routing import RouteTally, replaying
from services.trainer.forward import candidate_logprobs

from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from services.coordctl.tiny_model import SMALL_QWEN3_MOE, build_random_model
from tests.gpu.conftest import cuda_trainer, needs, vllm_rollout
from tests.gpu.test_gpu_grpo import run
from tests.integration.test_grpo_run import logprobs_both_ways

STEPS = 5


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("moe") / "qwen3-moe-random", SMALL_QWEN3_MOE, "bfloat16", seed=0)


def run_config(model: Path, data: Path, replay: str = "disabled") -> str:
    return yaml.safe_dump({
        "data": {"train_files": [str(data)], "train_batch_size": 32, "max_prompt_length": 16,
                 "max_response_length": 32},
        "actor_rollout_ref": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "actor": {"optim": {"lr": 1e-5}, "ppo_mini_batch_size": 32, "ppo_micro_batch_size_per_gpu": 64,
                      "router_replay": {"mode": replay}},
            "rollout": {"name": "vllm", "n": 8},
        },
        "trainer": {"total_training_steps": STEPS, "experiment_name": f"gpu-moe-{replay}"},
    })


def print_rows(rows: list[dict]) -> None:
    """Each step's rollout/trainer mismatch, weight probe (|delta logprob| and top-k KL) and routing agreement."""
    print("\nstep  weights  probs_diff mean     max  mismatch_kl  max|dlogprob|  probe mean|dlp|  probe topk_kl "
          "mean     max  routing_agreement")
    for row in rows:
        print(f"{row['step']:>4}  {row['rollout/weight_version']:>7.0f}"
              f"  {row['training/rollout_probs_diff_mean']:>15.2e}  {row['training/rollout_probs_diff_max']:.2e}"
              f"  {row['training/rollout_mismatch_kl']:>11.2e}  {largest_log_ratio(row):>13.3f}"
              f"  {row.get('weights/probe_logprob_diff_mean', float('nan')):>15.3e}"
              f"  {row.get('weights/probe_topk_kl_mean', float('nan')):>18.3e}"
              f"  {row.get('weights/probe_topk_kl_max', float('nan')):.3e}"
              f"  {row.get('training/routing_agreement', float('nan')):>17.4f}")


def largest_log_ratio(row: dict) -> float:
    """max |log(pi_trainer / pi_rollout)| over the step's tokens, from the importance ratios' extremes."""
    return max(abs(math.log(row["training/rollout_is_ratio/max"])),
               abs(math.log(row["training/rollout_is_ratio/min"])))


@needs(1)
def test_moe_syncs_keep_the_vllm_rollout_on_the_trainers_weights(qwen3_moe, tmp_path):
    """Trainer and a vLLM rollout (no CUDA graphs) on GPU 0, the weights over CUDA IPC."""
    data = write_jsonl(reverse_task_rows(256, 2, 6, seed=3), tmp_path / "reverse.jsonl")
    cluster = LocalCluster(tmp_path / "state", (cuda_trainer(), vllm_rollout(0, 0.3), ServiceSpec(kind="reward")))
    try:
        asyncio.run(cluster.start(timeout_s=180))
        final, version = asyncio.run(run(cluster, run_config(qwen3_moe, data)))
        assert final.state == "finished", final.error
        assert version == STEPS
        addresses = asyncio.run(service_addresses(cluster))
        prompt = [5, 6, 7, 16]
        generated, trainer_logprobs, served = asyncio.run(
            logprobs_both_ways(addresses["rollout"], addresses["trainer"], prompt))
    finally:
        cluster.stop()

    rows = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    print_rows(rows)
    direct = (generated.logprobs - trainer_logprobs).abs()
    print(f"version {served}, rollout vs trainer on its samples: mean |dlogprob| {direct.mean():.3e}, "
          f"max {direct.max():.3e}")

    assert [int(row["rollout/weight_version"]) for row in rows] == list(range(STEPS))
    engines_alone = rows[0]["training/rollout_mismatch_kl"]  # step 1: no sync yet
    for row in rows[2:]:  # after the second and later syncs
        assert row["training/rollout_mismatch_kl"] <= 10 * engines_alone + 1e-3, row["step"]
    assert served == STEPS and set(generated.weight_versions.tolist()) == {STEPS}
    assert float(direct.mean()) < 0.5  # bf16 alone moved it by 0.12 on the CPU, swapped experts by 2.3


async def service_addresses(cluster: LocalCluster) -> dict[str, str]:
    client = CoordinatorClient(cluster.coordinator)
    try:
        return {s.kind: s.address for s in await client.list_services()}
    finally:
        await client.close()


@needs(1)
def test_routing_replay_on_vllm_routes_the_trainer_by_the_rollouts_experts(qwen3_moe, tmp_path):
    """R3 (actor.router_replay.mode R3) with a vLLM rollout: vLLM returns each token's experts
    (enable_return_routed_experts), they travel with the sample and the trainer's passes route by them; every step
    reports the routing agreement, and the rollout's routes have the shape of the tokens it fed."""
    data = write_jsonl(reverse_task_rows(256, 2, 6, seed=3), tmp_path / "reverse.jsonl")
    cluster = LocalCluster(tmp_path / "state", (cuda_trainer(), vllm_rollout(0, 0.3), ServiceSpec(kind="reward")))
    try:
        asyncio.run(cluster.start(timeout_s=180))
        final, version = asyncio.run(run(cluster, run_config(qwen3_moe, data, replay="R3")))
        assert final.state == "finished", final.error
        addresses = asyncio.run(service_addresses(cluster))
        prompt = [5, 6, 7, 16]
        generated = asyncio.run(generate_with_routes(addresses["rollout"], prompt))
    finally:
        cluster.stop()

    rows = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    print_rows(rows)
    assert version == STEPS and [int(row["rollout/weight_version"]) for row in rows] == list(range(STEPS))
    for row in rows:  # the trainer's routers agree with vLLM's on most routes (~90 % in the R3 paper's models)
        assert 0.5 < row["training/routing_agreement"] <= 1.0, row
    routes = generated.routed_experts
    fed = len(prompt) * 4 + int(generated.response_lens.sum()) - 4  # each response's prompt + response - 1
    assert routes.dtype == torch.uint8 and tuple(routes.shape) == (fed, SMALL_QWEN3_MOE["num_hidden_layers"],
                                                                   SMALL_QWEN3_MOE["num_experts_per_tok"])
    assert int(routes.max()) < SMALL_QWEN3_MOE["num_experts"]
    assert all(len(set(token.tolist())) == SMALL_QWEN3_MOE["num_experts_per_tok"] for token in routes[:, 0])


async def generate_with_routes(rollout_address: str, prompt: list[int]):
    rollout = RolloutClient(rollout_address)
    try:
        return await rollout.generate([prompt], Sampling(n=4, temperature=1.0, top_p=1.0, max_new_tokens=6,
                                                         stop_token_ids=(), routed_experts=True),
                                      seed=11, first_index=0, timeout=60)
    finally:
        await rollout.close()


@needs(1)
@pytest.mark.parametrize("kernel", ["triton", "flashinfer_cutlass"])
def test_vllm_computes_with_the_trainers_experts_in_its_kernels_layout_after_every_sync(qwen3_moe, kernel):
    """Issue 44's evidence, on one GPU, for each bf16 fused-MoE kernel vLLM 0.20.1 runs on an H100 or H200
    (``moe_backend``; auto picks FlashInfer's CUTLASS where it runs): a trainer (transformers, bf16, this process)
    sends vLLM new weights 3 times over CUDA IPC; after each sync the experts vLLM computes with, read back from
    its fused-MoE layers' own tensors (w13_weight, w2_weight, in the kernel's layout), equal the trainer's expert by
    expert, and on responses vLLM samples: the share of token-layer routes on which the trainer's routers choose
    vLLM's experts, and the trainer's logprobs against vLLM's with its own routes and with vLLM's replayed."""
    syncs = asyncio.run(experts_after_syncs(qwen3_moe, kernel, syncs=3))
    print(f"\nmoe_backend {kernel}:")
    for version, sync in enumerate(syncs, start=1):
        print(f"  sync {version}: kernel {sync.kernel}, {sync.experts} experts equal of {sync.total}; routing "
              f"agreement {sync.agreement:.4f}; |delta logprob| own routes mean {sync.own.mean:.4f} max "
              f"{sync.own.max:.3f}, vLLM's routes replayed mean {sync.replayed.mean:.4f} max {sync.replayed.max:.3f}; "
              f"probe top-20 KL mean {sync.kl.mean:.3e} max {sync.kl.max:.3e}")
    for sync in syncs:
        assert sync.kernel == {"triton": "TRITON", "flashinfer_cutlass": "FLASHINFER_CUTLASS"}[kernel]
        assert sync.experts == sync.total > 0, sync.mismatched
        assert sync.agreement > 0.5
        assert sync.replayed.mean <= sync.own.mean + 1e-3  # the routes replayed leave the arithmetic alone
        assert sync.kl.mean <= MOE_TOPK_KL["bfloat16"]


@dataclass(frozen=True)
class ExpertSync:
    """One sync's figures (``experts_after_syncs``)."""

    kernel: str  # vLLM's fused-MoE kernel (every layer's)
    experts: int  # layer experts whose w13 and w2 checksums equal the trainer's in that kernel's layout
    total: int
    mismatched: list[str]  # layer and expert of those that differ
    agreement: float  # routes of vLLM's sampled tokens on which the trainer's routers chose vLLM's experts
    own: LogprobDiff  # vLLM's sampled tokens' logprobs against the trainer's, routed by its own routers
    replayed: LogprobDiff  # the same, the trainer routed by vLLM's routes
    kl: DistributionDiff  # the probe's top-20 KL, vLLM against the trainer (own routes, as the weight check)


async def experts_after_syncs(model_path: Path, kernel: str, syncs: int) -> list[ExpertSync]:
    trainer = load_causal_lm(model_path, "bfloat16").to("cuda:0").eval()
    named = [(name, parameter.detach()) for name, parameter in trainer.named_parameters()]
    engine = await VLLMEngine.create(str(model_path), "bfloat16", RolloutServiceConfig(
        engine="vllm", enforce_eager=True, gpu_memory_utilization=0.3, moe_backend=kernel), routed_experts=True)
    store, rendezvous = prepare_gloo_rendezvous("127.0.0.1", 120)
    channel = None
    try:
        joining = asyncio.create_task(engine.join_channel("experts", "cuda_ipc", rendezvous, rank=1, world_size=2, timeout_s=120))
        channel = await asyncio.to_thread(open_weight_channel, "experts", "cuda_ipc", rendezvous=rendezvous, rank=0,
                                          world_size=2, timeout_s=120, device="cuda:0")
        await joining
        sender, generator, results = WeightSender(), torch.Generator(device="cuda:0").manual_seed(0), []
        for version in range(1, syncs + 1):
            with torch.no_grad():  # new weights, as after an update: every expert moved its own way
                for _, tensor in named:
                    tensor.add_(torch.randn(tensor.shape, generator=generator, device="cuda:0",
                                            dtype=torch.float32).to(tensor.dtype) * 0.01)
            receiving = asyncio.create_task(engine.receive_weights("experts", 120))
            await asyncio.to_thread(sender.send, channel, named, version, bucket_bytes=256 << 20)
            assert (await receiving).version == version
            results.append(await compare_sync(engine, trainer, dict(named)))
        return results
    finally:
        if channel is not None:
            channel.close()
        await engine.close()
        del store


async def compare_sync(engine: VLLMEngine, trainer: torch.nn.Module, named: dict) -> ExpertSync:
    [held] = await engine.expert_checksums()
    kernels = {layer.kernel for layer in held.values()}
    mismatched, total = [], 0
    for layer, got in held.items():
        want = expected_expert_checksums(named, layer, got.kernel)
        total += len(want.w13)
        mismatched += [f"{layer}.{e}" for e, (a, b, c, d) in enumerate(zip(got.w13, want.w13, got.w2, want.w2))
                       if a != b or c != d]
    prompts = [[5 + i, 6, 7, 16 + i] for i in range(16)]
    sampling = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=7, stop_token_ids=(),
                                routed_experts=True)
    completions = [group[0] for group in await engine.generate(prompts, sampling, seed_indices=range(16))]
    responses = [c.token_ids for c in completions]
    tally, own, replayed = RouteTally(), [], []
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion.token_ids], device="cuda:0")
        routes = torch.cat([completion.routed_experts.long(),
                            torch.full((1, *completion.routed_experts.shape[1:]), NO_ROUTE)])  # the last: fed none
        with torch.no_grad():
            for replay, into in ((False, own), (True, replayed)):
                with replaying(trainer, routes, replay=replay, tally=tally if not replay else None):
                    logits = trainer(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
                scored = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0].cpu()
                into.append(scored - torch.tensor(completion.logprobs))
    probe = await engine.compute_log_probs(prompts, responses, top_k=20)
    batch = SequenceBatch.of_lists(prompts, responses)
    with torch.no_grad():
        at_top = candidate_logprobs(trainer, batch, probe.top.ids, pad_id=0, temperature=1.0,
                                    device=torch.device("cuda:0"))[:, 1:].cpu()
    return ExpertSync(kernel=",".join(sorted(kernels)), experts=total - len(mismatched), total=total,
                      mismatched=mismatched[:10], agreement=tally.agreement() or 0.0,
                      own=logprob_diff(torch.cat(own), torch.zeros(sum(len(d) for d in own))),
                      replayed=logprob_diff(torch.cat(replayed), torch.zeros(sum(len(d) for d in replayed))),
                      kl=distribution_diff(topk_kl(probe.top.logprobs, at_top)))
