"""Three GRPO steps with all four services: on two GPUs (trainer on GPU 0, vLLM rollout on GPU 1), colocated
on one GPU (the rollout asleep while the trainer works), on two GPUs each generating (a rollout beside the
trainer, asleep while it works, and one on GPU 1), and on three GPUs with two rollouts of different speeds
(each step's prompts split in proportion to their measured speeds); and a colocated rollout that cannot wake."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import torch
import yaml

from bench.faults import service_address
from meshrl.v1 import common_pb2, rollout_pb2_grpc
from services.common.rpc import open_channel
from services.coordinator.fleet.clients import RolloutClient
from services.coordinator.fleet.dispatch import split_by_speed
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from tests.gpu.conftest import cuda_trainer, needs, vllm_rollout

STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor", "update_weights")


def run_config(model: Path, data: Path, free_cache_engine: bool = False, steps: int = 3) -> str:
    return yaml.safe_dump({
        "data": {"train_files": [str(data)], "train_batch_size": 32, "max_prompt_length": 16,
                 "max_response_length": 64},
        "actor_rollout_ref": {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "actor": {"optim": {"lr": 1e-6}, "ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 64},
            "rollout": {"name": "vllm", "n": 8, "free_cache_engine": free_cache_engine},
        },
        "trainer": {"total_training_steps": steps, "experiment_name": "gpu-grpo"},
    })


async def run(cluster: LocalCluster, config_yaml: str):
    client = CoordinatorClient(cluster.coordinator)
    try:
        started = await client.start_run(config_yaml)
        async for _ in client.watch(started.run_id):
            pass
        final = await client.get_run(started.run_id)
        services = await client.list_services()
    finally:
        await client.close()
    rollout = RolloutClient(next(s.address for s in services if s.kind == "rollout"))
    try:
        return final, await rollout.weight_version()
    finally:
        await rollout.close()


def three_steps(tmp_path, model: Path, services: tuple[ServiceSpec, ...], colocated: bool
                ) -> tuple[list[dict], LocalCluster]:
    """The metrics of three steps, and the (stopped) cluster that ran them."""
    data = write_jsonl(reverse_task_rows(256, 2, 6, seed=3), tmp_path / "reverse.jsonl")
    cluster = LocalCluster(tmp_path / "state", services)
    try:
        asyncio.run(cluster.start(timeout_s=180))
        final, version = asyncio.run(run(cluster, run_config(model, data, free_cache_engine=colocated)))
    finally:
        cluster.stop()
    assert final.state == "finished", final.error
    assert version == 3
    rows = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    stages = STAGES + (("rollout_sleep", "rollout_wake_up") if colocated else ())
    print("\nstep  " + "  ".join(f"{s:>15}" for s in stages) + "  control-plane rest  step (s)")
    for r in rows:
        rest = r["timing_s/step"] - sum(r[f"timing_s/{s}"] for s in stages)
        print(f"{r['step']:>4}  " + "  ".join(f"{r[f'timing_s/{s}']:>15.3f}" for s in stages)
              + f"  {rest:>18.3f}  {r['timing_s/step']:.3f}")
    print(f"rollout/trainer probs diff mean {rows[-1]['training/rollout_probs_diff_mean']:.2e} "
          f"max {rows[-1]['training/rollout_probs_diff_max']:.2e}")
    return rows, cluster


@needs(2)
def test_three_grpo_steps_on_two_gpus(qwen_05b, tmp_path):
    services = (
        cuda_trainer(),
        vllm_rollout(1, 0.5),
        ServiceSpec(kind="reward"),
    )
    three_steps(tmp_path, qwen_05b, services, colocated=False)


@needs(1)
def test_three_grpo_steps_colocated_on_one_gpu(qwen_05b, tmp_path):
    services = (
        cuda_trainer(),
        vllm_rollout(0, 0.3, "enable_sleep_mode=true"),
        ServiceSpec(kind="reward"),
    )
    rows, _ = three_steps(tmp_path, qwen_05b, services, colocated=True)
    # the weights the rollout woke up with and then received are the trainer's: sampled tokens' probabilities agree
    assert rows[-1]["training/rollout_probs_diff_mean"] < 1e-3


@needs(3)
def test_prompts_split_by_the_rollouts_measured_speeds_on_three_gpus(qwen_05b, tmp_path):
    """Trainer on GPU 0, a vLLM rollout on GPU 1 and one on GPU 2 that schedules 16 sequences at a time (its
    256 samples a step take 16 rounds): from step 2 on each step's 32 prompts follow the speeds measured up to
    the step before, and the capped rollout ends with the smaller share."""
    services = (
        cuda_trainer(),
        vllm_rollout(1, 0.5),
        vllm_rollout(2, 0.5, "max_num_seqs=16"),
        ServiceSpec(kind="reward"),
    )
    rows, cluster = three_steps(tmp_path, qwen_05b, services, colocated=False)
    fast, capped = service_address(cluster, "rollout-1"), service_address(cluster, "rollout-2")
    for before, now in zip(rows, rows[1:]):
        speeds = [before[f"rollout/tokens_per_s/{a}"] for a in (fast, capped)]
        print(f"step {now['step']}: speeds {speeds[0]:.0f} / {speeds[1]:.0f} tokens/s, shares "
              f"{now[f'rollout/share/{fast}']:.3f} / {now[f'rollout/share/{capped}']:.3f}, "
              f"gen {now['timing_s/gen']:.2f} s (step 1, equal shares: {rows[0]['timing_s/gen']:.2f} s)")
        assert [round(now[f"rollout/share/{a}"] * 32) for a in (fast, capped)] == split_by_speed(32, speeds)
    assert rows[-1][f"rollout/share/{fast}"] > rows[-1][f"rollout/share/{capped}"] > 0


@needs(2)
def test_every_gpu_generates_the_rollout_beside_the_trainer_asleep_while_it_trains(qwen_05b, tmp_path):
    """Trainer on GPU 0, a vLLM rollout beside it on GPU 0 (asleep while the trainer works, weights over CUDA
    IPC) and one on GPU 1 (weights over NCCL): both generate every step, each actor update falls while the one
    on GPU 0 sleeps, and the one on GPU 1 never sleeps."""
    services = (
        cuda_trainer(),
        vllm_rollout(0, 0.3, "enable_sleep_mode=true"),
        vllm_rollout(1, 0.5),
        ServiceSpec(kind="reward"),
    )
    rows, cluster = three_steps(tmp_path, qwen_05b, services, colocated=True)
    beside, apart = service_address(cluster, "rollout-1"), service_address(cluster, "rollout-2")
    for row in rows:
        print(f"step {row['step']}: {row['timing_s/step']:.2f} s/step, shares {row[f'rollout/share/{beside}']:.3f} "
              f"(GPU 0, beside the trainer) / {row[f'rollout/share/{apart}']:.3f} (GPU 1)")
        assert row[f"rollout/share/{beside}"] > 0 and row[f"rollout/share/{apart}"] > 0
    logged = {name: [json.loads(line) for line in (cluster.log_dir / f"{name}.log").read_text(errors="replace")
                     .splitlines() if line.startswith("{")] for name in ("rollout-1", "rollout-2", "trainer")}
    slept = list(zip([e["timestamp"] for e in logged["rollout-1"] if e["event"] == "engine_asleep"],
                     [e["timestamp"] for e in logged["rollout-1"] if e["event"] == "engine_awake"]))
    updated = [e["timestamp"] for e in logged["trainer"] if e["event"] == "actor_updated"]
    assert len(slept) == len(updated) == 3 and all(start < at < end for (start, end), at in zip(slept, updated))
    assert not any(e["event"] == "engine_asleep" for e in logged["rollout-2"])
    assert rows[-1]["training/rollout_probs_diff_mean"] < 1e-3  # both served the trainer's weights


@needs(1)
def test_a_colocated_rollout_that_cannot_wake_fails_the_run_naming_the_cause(qwen_05b, tmp_path):
    """While the rollout sleeps, this process takes the GPU memory it freed (leaving the trainer room for its
    step): its WakeUp runs out of memory. The run fails within a bound, the cause in its error and events,
    instead of re-forming the weight channel over and over in state waiting."""
    data = write_jsonl(reverse_task_rows(256, 2, 6, seed=3), tmp_path / "reverse.jsonl")
    services = (
        cuda_trainer(),
        vllm_rollout(0, 0.3, "enable_sleep_mode=true"),
        ServiceSpec(kind="reward"),
    )
    cluster = LocalCluster(tmp_path / "state", services)
    try:
        asyncio.run(cluster.start(timeout_s=180))
        final, events, took_s = asyncio.run(run_taking_memory_while_asleep(cluster, run_config(
            qwen_05b, data, free_cache_engine=True)))
    finally:
        cluster.stop()
    assert final.state == "failed" and "out of memory" in final.error.lower(), final.error
    assert any("wake_up failed" in message for message in events), events
    assert took_s < 300


async def run_taking_memory_while_asleep(cluster: LocalCluster, config_yaml: str, trainer_room: int = 20 << 30):
    """The run, with all but ``trainer_room`` of GPU 0's free memory taken once the rollout is asleep; its end, its
    events' messages and the seconds it took."""
    client = CoordinatorClient(cluster.coordinator)
    rollout = open_channel(next(s.address for s in await client.list_services() if s.kind == "rollout"))
    taken = None
    try:
        started_at, started = time.monotonic(), await client.start_run(config_yaml)
        while taken is None and (await client.get_run(started.run_id)).state not in ("finished", "failed"):
            info = await rollout_pb2_grpc.RolloutStub(rollout).Info(common_pb2.InfoRequest(), timeout=10)
            if info.details.get("asleep") == "true":
                free, _ = torch.cuda.mem_get_info(0)
                taken = torch.empty(max(free - trainer_room, 0), dtype=torch.uint8, device="cuda:0")
            await asyncio.sleep(0.01)
        events = [update.message async for update in client.watch(started.run_id)]
        return await client.get_run(started.run_id), events, time.monotonic() - started_at
    finally:
        del taken
        await rollout.close()
        await client.close()
