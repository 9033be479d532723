"""Three GRPO steps through the four services as real processes, over gRPC; runs with other algorithms and
settings, and the trainer's UpdateActor with rollout correction called directly.

One cluster serves the module's runs one after the other, as long-running services do (a failed run among
them); the three-step run comes last, as it ends with the cluster's shutdown."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sqlite3
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
import yaml

from meshrl.v1 import common_pb2, rollout_pb2_grpc
from services.common.service import keep_registered
from services.common.sequences import SequenceBatch
from services.coordinator.fleet.clients import RolloutClient, TrainerClient
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.control import CoordinatorClient
from services.coordinator.settings import Sampling


def run_config(model: Path, data: Path, **changes) -> str:
    config = {
        "data": {"train_files": [str(data)], "train_batch_size": 8, "max_prompt_length": 16, "max_response_length": 6},
        "actor_rollout_ref": {
            "model": {"path": str(model)},
            "actor": {"optim": {"lr": 1e-3}, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8},
            "rollout": {"n": 4},
        },
        "trainer": {"total_training_steps": 3, "experiment_name": "it"},
    }
    for dotted, value in changes.items():
        node = config
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return yaml.safe_dump(config)


async def run_to_end(coordinator: str, config_yaml: str):
    client = CoordinatorClient(coordinator)
    try:
        run = await client.start_run(config_yaml)
        updates = [u async for u in client.watch(run.run_id)]
        return await client.get_run(run.run_id), updates, await client.list_services()
    finally:
        await client.close()


async def logprobs_both_ways(rollout_address: str, trainer_address: str, prompt: list[int]):
    """Sample from the rollout, then score the same sequences on the trainer."""
    rollout, trainer = RolloutClient(rollout_address), TrainerClient(trainer_address)
    try:
        generated = await rollout.generate([prompt], Sampling(n=4, temperature=1.0, top_p=1.0, max_new_tokens=6,
                                                              stop_token_ids=()), seed=11, first_index=0, timeout=60)
        responses = [r.tolist() for r in torch.split(generated.response_ids, generated.response_lens.tolist())]
        batch = SequenceBatch.of_lists([prompt] * 4, responses)
        trainer_logprobs = await trainer.compute_log_probs(batch, step=0, timeout=60)
        return generated, trainer_logprobs, await rollout.weight_version()
    finally:
        await rollout.close()
        await trainer.close()


def test_bad_config_and_bad_data_are_refused_before_anything_starts(cluster, tiny_model, reverse_data, tmp_path):
    async def start(config_yaml: str):
        client = CoordinatorClient(cluster.coordinator)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.start_run(config_yaml)
            return refused.value, await client.list_runs()
        finally:
            await client.close()

    error, runs = asyncio.run(start(run_config(tiny_model, reverse_data,
                                               actor_rollout_ref__actor__ppo_mini_batch_size=3)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "actor_rollout_ref.actor.ppo_mini_batch_size" in error.details()

    bad = tmp_path / "bad.jsonl"
    lines = reverse_data.read_text().splitlines()
    lines[4] = '{"data_source": "meshrl/reverse", "prompt": [{"role": "user", "content": "12="}]}'
    bad.write_text("\n".join(lines) + "\n")
    error, runs = asyncio.run(start(run_config(tiny_model, bad)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{bad} row 5" in error.details() and "reward_model" in error.details()
    assert runs == []  # the module's first test: no run on its cluster before these, and none from them


def test_dapo_group_filtering_keeps_only_groups_with_signal(cluster, tiny_model, reverse_data):
    config = run_config(tiny_model, reverse_data, algorithm__filter_groups={"enable": True, "max_num_gen_batches": 3},
                        trainer__total_training_steps=2)
    final, updates, _ = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    db = sqlite3.connect(Path(cluster.state_dir) / "meshrl.db")
    for (metrics_json,) in db.execute("SELECT metrics_json FROM steps WHERE run_id = ?", (final.run_id,)):
        metrics = yaml.safe_load(metrics_json)
        assert 1 <= metrics["training/filter_groups/gen_rounds"] <= 3
        assert 1 <= metrics["training/filter_groups/kept_prompts"] <= 8
        if metrics["training/filter_groups/kept_prompts"] < 8:  # it only stops short after the last round
            assert metrics["training/filter_groups/gen_rounds"] == 3


def test_kl_in_reward_with_adaptive_controller_and_reinforce_plus_plus(cluster, tiny_model, reverse_data):
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=3,
                        algorithm={"adv_estimator": "reinforce_plus_plus", "use_kl_in_reward": True,
                                   "kl_penalty": "low_var_kl",
                                   "kl_ctrl": {"type": "adaptive", "kl_coef": 0.05, "target_kl": 1e-6, "horizon": 100}})
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    steps = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    coefficients = [s["actor/reward_kl_penalty_coeff"] for s in steps]
    assert coefficients[0] == pytest.approx(0.05)
    # step 1: the policy is the reference, KL 0, far under the target: the error clips at -0.2 and the
    # coefficient shrinks by 0.2 * 32 sequences / horizon 100; step 2: KL far above it: it grows as much
    assert steps[0]["actor/reward_kl_penalty"] == 0.0
    assert steps[1]["actor/reward_kl_penalty"] > 1.2e-6
    assert coefficients[1] == pytest.approx(0.05 * (1 - 0.064))
    assert coefficients[2] == pytest.approx(0.05 * (1 - 0.064) * (1 + 0.064))
    assert "timing_s/ref" in steps[0] and "critic/vf_loss" not in steps[0]
    # two mini-batches a step (and the KL in the reward): the old logprobs come from a pass before the update
    assert all("timing_s/old_log_prob" in step for step in steps)


async def update_actor_calls(coordinator: str, config_yaml: str, rollout_logprobs_of,
                             loss_mask: torch.Tensor | None = None) -> list:
    """InitRun on the trainer, then one update_actor per rollout_logprobs_of(old_logprobs): metrics or the error;
    the batch carries ``loss_mask`` where one is given."""
    control = CoordinatorClient(coordinator)
    try:
        address = next(s.address for s in await control.list_services() if s.kind == "trainer")
    finally:
        await control.close()
    trainer = TrainerClient(address)
    try:
        await trainer.init_run("rc", config_yaml, ["actor"], seed=0, timeout=120)
        batch = replace(SequenceBatch.of_lists([[5, 6, 7]] * 4, [[8, 9], [10], [11, 12, 13], [14, 15]]),
                        loss_mask=loss_mask)
        old = await trainer.compute_log_probs(batch, step=1, timeout=60)
        advantages = torch.tensor([1.0, 1.0, -1.0, 0.5, 0.5, 0.5, -0.5, -0.5])
        results = []
        for make in rollout_logprobs_of:
            try:
                metrics, _ = await trainer.update_actor(batch, old, advantages, ref_logprobs=None, step=1, timeout=60,
                                                        rollout_logprobs=make(old))
                results.append(metrics)
            except grpc.aio.AioRpcError as error:
                results.append(error)
        return results
    finally:
        await trainer.close()


def test_update_actor_with_rollout_correction(cluster, tiny_model, reverse_data):
    config = run_config(tiny_model, reverse_data, algorithm__rollout_correction={"enable": True})
    missing, short, nan, tripled = asyncio.run(update_actor_calls(cluster.coordinator, config, [
        lambda old: None,
        lambda old: old[:-1],
        lambda old: torch.full_like(old, math.nan),
        lambda old: old - math.log(3.0),  # pi_old / pi_rollout = 3 on every token: truncated to 2
    ]))
    for error, words in ((missing, "rollout_logprobs"), (short, "one value per response token"), (nan, "NaN")):
        assert isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in error.details()
    assert tripled["rollout_corr/rollout_is_mean"] == pytest.approx(2.0, rel=1e-6)
    assert tripled["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0


def test_update_actor_with_a_loss_mask_counts_only_the_model_tokens(cluster, tiny_model, reverse_data):
    """A batch whose responses hold tool tokens, sent as the coordinator sends it: the rollout's logprobs are far
    off on the tool tokens only (pi_old / pi_rollout = e^30), which the rollout correction and its metrics must not
    see; a mask that is not bool is refused."""
    config = run_config(tiny_model, reverse_data, algorithm__rollout_correction={"enable": True})
    tools = torch.tensor([False, True, False, False, True, False, False, True])
    off_on_tools = asyncio.run(update_actor_calls(cluster.coordinator, config, [
        lambda old: torch.where(tools, old - 30.0, old)], loss_mask=~tools))[0]
    assert off_on_tools["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, rel=1e-6)
    assert off_on_tools["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0
    assert math.isfinite(off_on_tools["actor/pg_loss"]) and off_on_tools["actor/grad_norm"] > 0
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # by the logprob pass, the first call it comes with
        asyncio.run(update_actor_calls(cluster.coordinator, config, [], loss_mask=(~tools).long()))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "loss_mask must be a bool tensor" in refused.value.details()


def test_a_run_with_partial_rollout_restart_asks_every_sync_to_restart(cluster, tiny_model, reverse_data):
    """The run config's choice reaches the rollouts through the coordinator; one step off, samples stay within
    the staleness bound whether the calls in flight at a sync were restarted or not."""
    config = run_config(tiny_model, reverse_data, trainer__async_={"max_staleness": 1},
                        actor_rollout_ref__rollout__partial_rollout="restart")
    earlier = len(logged(cluster, "rollout"))  # what the module's earlier runs had it log
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    synced = [e for e in logged(cluster, "rollout")[earlier:] if e["event"] == "weights_received"]
    assert len(synced) >= 3 and all(e["in_flight"] == "restart" for e in synced)
    steps = [json.loads(line) for line in (Path(final.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(0 <= s["training/off_policy/staleness/max"] <= 1 for s in steps)


def test_every_device_generates_the_rollout_beside_the_trainer_asleep_while_it_works(tmp_path, tiny_model,
                                                                                   reverse_data):
    """Every GPU generating, on CPU (free_cache_engine, sleeping frees nothing here): one rollout shares the
    trainer's device (beside a CPU trainer every rollout does unless it says not), the other is started with
    colocated=false. Each step both generate; the one beside the trainer sleeps while it trains (one still asleep
    at the next step would refuse its Generate and fail the run) and the other never does; the weights reach
    each over a gloo channel of its own, so both end serving version 3 (the one apart sampling with the trainer's
    logprobs)."""
    services = (ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="rollout",
                                                                                      settings=("colocated=false",)),
                ServiceSpec(kind="reward"))
    cluster = LocalCluster(tmp_path / "state", services)
    asyncio.run(cluster.start(timeout_s=120))
    try:
        final, updates, _ = asyncio.run(run_to_end(cluster.coordinator, run_config(
            tiny_model, reverse_data, actor_rollout_ref__rollout__free_cache_engine=True)))
        assert final.state == "finished", final.error
        beside, apart = (logged(cluster, name) for name in ("rollout-1", "rollout-2"))
        address = {name: next(e["address"] for e in events if e["event"] == "serving")
                   for name, events in (("beside", beside), ("apart", apart))}
        db = sqlite3.connect(Path(cluster.state_dir) / "meshrl.db")
        for (metrics_json,) in db.execute("SELECT metrics_json FROM steps WHERE run_id = ?", (final.run_id,)):
            metrics = json.loads(metrics_json)
            assert "timing_s/rollout_sleep" in metrics and "timing_s/rollout_wake_up" in metrics
            assert all(metrics[f"rollout/samples_by/{address[name]}"] > 0 for name in address)
        channels = next(u.message for u in updates if u.message.startswith("weight channels"))
        assert f"(gloo): the actor and rollouts {address['beside']} (sharing its device)" in channels
        assert f"(gloo): the actor and rollouts {address['apart']}" in channels
        # each update happened while the rollout beside the trainer slept; the other never slept
        slept = [(asleep["timestamp"], awake["timestamp"]) for asleep, awake in zip(
            [e for e in beside if e["event"] == "engine_asleep"], [e for e in beside if e["event"] == "engine_awake"])]
        trainer_events = logged(cluster, "trainer")
        updated = [e["timestamp"] for e in trainer_events if e["event"] == "actor_updated"]
        assert len(slept) == len(updated) == 3
        assert all(start < at < end for (start, end), at in zip(slept, updated))
        assert not any(e["event"] in ("engine_asleep", "engine_awake") for e in apart)
        trainer = next(e["address"] for e in trainer_events if e["event"] == "serving")
        assert asyncio.run(weight_version(address["beside"])) == 3
        generated, trainer_logprobs, version = asyncio.run(logprobs_both_ways(address["apart"], trainer, [5, 6, 7]))
        assert version == 3 and torch.allclose(generated.logprobs, trainer_logprobs, atol=1e-5, rtol=0)
    finally:
        cluster.stop()


def logged(cluster: LocalCluster, name: str) -> list[dict]:
    """The JSON events service ``name`` has logged."""
    lines = (cluster.log_dir / f"{name}.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


async def weight_version(rollout_address: str) -> int:
    rollout = RolloutClient(rollout_address)
    try:
        return await rollout.weight_version()
    finally:
        await rollout.close()


class AbsentRollout(rollout_pb2_grpc.RolloutServicer):
    """A rollout that registers, answers and loads a run as any does, but never joins a weight channel: the
    member a channel waits for in vain."""

    def __init__(self):
        self.run_id = ""

    def _info(self) -> common_pb2.ServiceInfo:
        return common_pb2.ServiceInfo(run_id=self.run_id, details={"channel_ranks": "1"})

    async def Info(self, request, context):
        return self._info()

    async def InitRun(self, request, context):
        self.run_id = request.run_id
        return self._info()

    async def JoinChannel(self, request, context):
        await asyncio.Event().wait()  # until the coordinator gives up on it and cancels the call


async def run_with_absent_rollout(coordinator: str, config_yaml: str):
    """``run_to_end`` of a run whose rollout group is ``absent``, where an AbsentRollout is the only member."""
    server = grpc.aio.server()
    rollout_pb2_grpc.add_RolloutServicer_to_server(AbsentRollout(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    identity = common_pb2.ServiceIdentity(service_id=f"absent-rollout-{port}", kind="rollout",
                                          address=f"127.0.0.1:{port}", group="absent", protocol_version=1,
                                          pid=os.getpid(), hostname="localhost", gpu="cpu")
    stop = asyncio.Event()
    registered = asyncio.create_task(keep_registered(identity, coordinator, stop, weight_version=lambda: None))
    client = CoordinatorClient(coordinator)
    try:
        while identity.address not in [s.address for s in await client.list_services() if s.state == "up"]:
            await asyncio.sleep(0.1)  # a run started before it registers would wait for it first
        return await run_to_end(coordinator, config_yaml)
    finally:
        await client.close()
        stop.set()
        await registered
        await server.stop(None)


def test_a_weight_channel_that_cannot_form_ends_the_run_naming_the_cause(cluster, tiny_model, reverse_data):
    """Two runs whose weight channel never forms, as a user sees them end (coordctl status: state and error;
    coordctl watch: the events). cuda_ipc asked of services on CPU is refused by each one that joins (a verdict
    that would come again): the run fails at once, without waiting to recover. A member that never joins (an
    AbsentRollout, the only one of the run's group) makes the trainer's join end at channel_timeout_s, a
    passing cause: the run recovers trainer.max_recoveries=1 time, and then fails; the error names the cause,
    not only how often it was tried."""
    started = time.monotonic()
    refused, events, _ = asyncio.run(run_to_end(cluster.coordinator, run_config(
        tiny_model, reverse_data, trainer__weight_sync_backend="cuda_ipc")))
    assert refused.state == "failed"
    assert "INVALID_ARGUMENT: ValueError: channel backend cuda_ipc needs a CUDA device" in refused.error
    assert [e.state for e in events if e.kind == "state"] == ["running", "failed"]  # never waiting
    assert events[-1].message == refused.error
    timed_out, events, _ = asyncio.run(run_with_absent_rollout(cluster.coordinator, run_config(
        tiny_model, reverse_data, trainer__channel_timeout_s=2.0, trainer__max_recoveries=1,
        placement__rollout="absent")))
    assert time.monotonic() - started < 60
    assert timed_out.state == "failed"
    assert "not all 2 members joined within 2.0 s" in timed_out.error, timed_out.error
    assert timed_out.error.endswith("(in the last of 1 + trainer.max_recoveries=1 attempts)")
    assert [e.state for e in events if e.kind == "state"] == ["running", "waiting", "running", "failed"]
    assert sum("(recovery 1 of 1)" in e.message for e in events) == 1
    assert events[-1].message == timed_out.error


def test_three_grpo_steps(cluster, tiny_model, reverse_data):
    """One mini-batch a step: the update takes its own logprobs as the old ones (no old-logprob pass) and the
    trainer reports their mismatch with the rollout's."""
    final, updates, services = asyncio.run(run_to_end(cluster.coordinator, run_config(
        tiny_model, reverse_data, actor_rollout_ref__actor__ppo_mini_batch_size=8)))
    assert final.state == "finished", final.error
    assert final.step == 3

    # (a) a metrics row per step in the run DB, with the verl-named metrics
    db = sqlite3.connect(Path(cluster.state_dir) / "meshrl.db")
    rows = db.execute("SELECT step, metrics_json FROM steps WHERE run_id = ? ORDER BY step", (final.run_id,)).fetchall()
    assert [step for step, _ in rows] == [1, 2, 3]
    metrics = yaml.safe_load(rows[-1][1])
    for name in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean",
                 "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights", "perf/throughput",
                 "perf/cpu_memory_used_gb", "perf/rollout/cpu_memory_used_gb"):
        assert name in metrics
    # the trainer's and the rollout's resident sets (on a CPU there are no device peaks)
    assert metrics["perf/cpu_memory_used_gb"] > 0.05 and metrics["perf/rollout/cpu_memory_used_gb"] > 0.05
    assert "perf/max_memory_allocated_gb" not in metrics and "perf/rollout/max_memory_allocated_gb" not in metrics
    assert [u.step for u in updates if u.kind == "step"] == [1, 2, 3]
    run_dir = Path(final.run_dir)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    for step in steps:
        assert "timing_s/old_log_prob" not in step
        assert step["actor/pg_clipfrac"] == 0.0 and step["actor/ppo_kl"] == 0.0  # the ratio is 1
        # the rollout's and the trainer's probabilities of the same tokens on the same weights
        assert 0.0 <= step["training/rollout_probs_diff_mean"] <= step["training/rollout_probs_diff_max"] < 1e-4
        assert "training/rollout_probs_diff_std" in step and "training/rollout_is_seq_ratio/mean" in step
    assert (run_dir / "reward.png").stat().st_size > 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["total_training_steps"] == 3

    # (b) the rollout serves weight version 3, and (c) its logprobs equal the trainer's on the same weights
    address = {s.kind: s.address for s in services}
    generated, trainer_logprobs, version = asyncio.run(
        logprobs_both_ways(address["rollout"], address["trainer"], [5, 6, 7, 16]))
    assert version == 3 and set(generated.weight_versions.tolist()) == {3}
    assert generated.logprobs.shape == trainer_logprobs.shape
    assert torch.allclose(generated.logprobs, trainer_logprobs, atol=1e-5, rtol=0)

    # (d) shutdown leaves no process behind
    pids = [p.pid for p in cluster.processes.values()]
    cluster.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
