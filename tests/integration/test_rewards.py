"""Reward services as real processes: users' functions that fail or hang, answers no rule can check in time,
requests nested too deep, a plugin that cannot be imported, a replica killed mid-run, and a swap of reward
services while a run goes on."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from meshrl.v1 import reward_pb2, reward_pb2_grpc
from services.common.rpc import open_channel
from services.coordinator.fleet.clients import RewardClient, RewardSample
from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from services.coordctl.tiny_model import build_tiny_reward_model
from services.reward.reward_model import RewardModel
from tests.integration.test_grpo_run import run_config

PLUGINS = Path(__file__).resolve().parent / "plugins"


def reward_config(tmp_path: Path, name: str, scorers: dict, **settings) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"scorers": scorers, **settings}))
    return str(path)


def component(function: str) -> list[dict]:
    return [{"function": f"{PLUGINS / 'user_rewards.py'}:{function}"}]


@pytest.fixture(scope="module")
def reward_cluster(tmp_path_factory):
    """Coordinator and one reward service whose data sources map to users' functions and rules (1 s per sample);
    its reward model is in the folder ``rm`` beside the state dir."""
    root = tmp_path_factory.mktemp("rewards")
    scorers = {name: component(name) for name in ("length_match", "raises", "hangs", "garbage", "verdict")}
    scorers["combined"] = [{"rule": "meshrl/reverse", "weight": 0.5}, *[dict(c, weight=0.5) for c in component("length_match")]]
    scorers["rm"] = [{"reward_model": str(build_tiny_reward_model(root / "rm", 32, 1, seed=0))}]
    scorers["math_and_form"] = [{"rule": "lighteval/MATH", "weight": 0.8},
                                {"rule": "format", "options": {"pattern": "boxed"}, "weight": 0.2}]
    config = reward_config(root, "reward", scorers, sample_timeout_s=1.0, function_workers=2)
    cluster = LocalCluster(root / "state", (ServiceSpec(kind="reward", settings=("--config", config)),))
    asyncio.run(cluster.start(timeout_s=60))
    yield cluster
    cluster.stop()


async def reward_address(coordinator: str) -> str:
    control = CoordinatorClient(coordinator)
    [service] = await control.list_services()
    await control.close()
    return service.address


async def score_through_service(coordinator: str, batches: list[list[RewardSample]]):
    client = RewardClient(await reward_address(coordinator))
    try:
        return [await client.score(samples, timeout=30) for samples in batches]
    finally:
        await client.close()


def test_user_functions_that_raise_hang_or_return_garbage_cost_only_their_sample(reward_cluster):
    batch = [RewardSample(data_source=source, response=response, ground_truth=truth, extra_info={}) for source,
             response, truth in (
        ("length_match", "abc", "xyz"), ("raises", "abc", "xyz"), ("hangs", "abc", "xyz"), ("garbage", "abc", "xyz"),
        ("combined", "321", "321"), ("nobody", "1", "1"), ("verdict", "42", "42"))]
    started = time.monotonic()
    [(scores, _), (again, _)] = asyncio.run(score_through_service(reward_cluster.coordinator, [batch, batch[:1]]))
    elapsed = time.monotonic() - started
    good, raised, hung, garbage, combined, unknown, verdict = scores
    assert good.valid and good.score == 1.0 and good.error == ""
    assert not raised.valid and raised.score == 0.0 and "RuntimeError: cannot score 'abc'" in raised.error
    assert not hung.valid and "did not return within 1.0 s" in hung.error
    assert not garbage.valid and "'very good'" in garbage.error
    assert combined.valid and combined.score == pytest.approx(1.0)  # 0.5 * reverse + 0.5 * length
    assert (combined.pred, combined.acc) == ("321", True)  # the reverse rule's reading and full marks
    assert (good.pred, good.acc) == ("", None)  # a function that says neither
    assert (verdict.score, verdict.pred, verdict.acc) == (0.5, "42", True)  # verl's reward_extra_info
    assert not unknown.valid and "no scorer for data_source 'nobody'" in unknown.error
    assert again[0].valid and again[0].score == 1.0  # the service goes on after the hang
    assert elapsed < 20


def test_reward_model_scores_prompt_and_response_in_batches(reward_cluster):
    batch = [RewardSample(data_source="rm", response=response, ground_truth="", extra_info={},
                          prompt=prompt) for prompt, response in (("12=", "21"), ("345=", "543"), ("7=", ""))]
    [(scores, _)] = asyncio.run(score_through_service(reward_cluster.coordinator, [batch]))
    model = RewardModel(str(reward_cluster.state_dir.parent / "rm"), "cpu", batch_size=1)
    expected = model.score(["12=21", "345=543", "7="])
    assert all(s.valid for s in scores)
    assert [s.score for s in scores] == pytest.approx(expected, abs=1e-5)


def test_math_answers_too_big_to_check_time_out_score_zero_and_the_service_goes_on(reward_cluster):
    normal = [RewardSample(data_source="lighteval/MATH", response=r"so \boxed{\frac{1}{2}}", ground_truth="0.5",
                           extra_info={}),  # equal for math-verify only
              RewardSample(data_source="math", response=r"\boxed{4}", ground_truth="5",
                           extra_info={}), RewardSample(data_source="openai/gsm8k", response="so #### 7",
                                                        ground_truth="7", extra_info={})]
    expected = [(1.0, True, False), (0.0, False, False), (1.0, True, False)]  # score, acc, timed_out
    hostile = [RewardSample(data_source="lighteval/MATH", response=r"so \boxed{9^{9^{9}}}", ground_truth="3",
                            extra_info={}),  # math-verify: hours on either
               RewardSample(data_source="math", response=r"\boxed{99999999!}", ground_truth="3", extra_info={}),
               RewardSample(data_source="math_and_form", response=r"so \boxed{9^{9^{9}}}", ground_truth="3",
                            extra_info={})]
    [(first, _)] = asyncio.run(score_through_service(reward_cluster.coordinator, [normal]))  # the rules warm up
    started = time.monotonic()
    [(scores, _)] = asyncio.run(score_through_service(reward_cluster.coordinator, [hostile + normal]))
    elapsed = time.monotonic() - started
    [(after, _)] = asyncio.run(score_through_service(reward_cluster.coordinator, [normal]))
    assert all((s.score, s.valid, s.acc, s.timed_out) == (0.0, True, False, True) for s in scores[:2])
    assert (scores[2].score, scores[2].valid, scores[2].timed_out) == (pytest.approx(0.2), True, True)  # the format's
    for batch in (first, scores[3:], after):
        assert [(s.score, s.acc, s.timed_out) for s in batch] == expected
    assert elapsed < 10


def test_extra_info_nested_too_deep_is_refused_naming_the_field(reward_cluster):
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    request = reward_pb2.ScoreRequest(samples=[
        reward_pb2.Sample(data_source="exact_match", response="1", ground_truth="1"),
        reward_pb2.Sample(data_source="exact_match", response="1", ground_truth="1", extra_info_json=deep)])

    async def score() -> grpc.aio.AioRpcError:
        channel = open_channel(await reward_address(reward_cluster.coordinator))
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await reward_pb2_grpc.RewardStub(channel).Score(request, timeout=30)
            return refused.value
        finally:
            await channel.close()

    refused = asyncio.run(score())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "samples[1].extra_info_json nests deeper than 64 levels" in refused.details()


def test_a_plugin_that_fails_to_import_is_refused_at_start(tmp_path):
    config = reward_config(tmp_path, "broken", {"x": [{"function": f"{PLUGINS / 'broken_import.py'}:score"}]})
    result = subprocess.run([sys.executable, "-m", "services.reward", "--config", config, "port=0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "broken_import.py" in result.stderr and "a_module_that_does_not_exist" in result.stderr


@pytest.fixture
def two_groups(tmp_path):
    """Trainer, rollout, two reward replicas in group a (partial credit), one in group b (exact match)."""
    exact = reward_config(tmp_path, "exact", {"meshrl/reverse": [{"rule": "exact_match"}]})
    services = (ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="reward", group="a"),
                ServiceSpec(kind="reward", group="a"),
                ServiceSpec(kind="reward", group="b", settings=("--config", exact)))
    cluster = LocalCluster(tmp_path / "state", services)
    asyncio.run(cluster.start(timeout_s=120))
    yield cluster
    cluster.stop()


async def run_with_actions(coordinator: str, config_yaml: str, actions: dict):
    """Run to the end, calling actions[step](client, run_id) once step has finished."""
    client = CoordinatorClient(coordinator)
    try:
        run = await client.start_run(config_yaml)
        async for update in client.watch(run.run_id):
            if update.kind == "step" and update.step in actions:
                await actions.pop(update.step)(client, run.run_id)
        return await client.get_run(run.run_id)
    finally:
        await client.close()


def steps_of(run_dir: str) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_replica_killed_then_reward_swapped_mid_run(two_groups, tiny_model, reverse_data):
    cluster = two_groups
    group_a = [name for name, spec in zip(cluster.processes, (None, *cluster.services)) if spec and spec.group == "a"]
    refusals = []

    async def kill_one_replica(client, run_id):
        os.kill(cluster.processes[group_a[0]].pid, signal.SIGKILL)

    async def refused_then_accepted_swap(client, run_id):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.set_reward(run_id, address="127.0.0.1:9")  # nothing listens there
        refusals.append(refused.value)
        await client.set_reward(run_id, group="b")

    config = run_config(tiny_model, reverse_data, placement={"reward": "a"}, trainer__total_training_steps=6)
    final = asyncio.run(run_with_actions(cluster.coordinator, config, {2: kill_one_replica,
                                                                       4: refused_then_accepted_swap}))
    assert final.state == "finished", final.error
    assert refusals[0].code() == grpc.StatusCode.FAILED_PRECONDITION and "refused" in refusals[0].details()

    steps = steps_of(final.run_dir)
    per_step = [{k.removeprefix("reward/samples_by/"): v for k, v in s.items() if k.startswith("reward/samples_by/")}
                for s in steps]
    assert all(sum(counts.values()) == 8 * 4 for counts in per_step)  # no sample lost or counted twice
    events = asyncio.run(reward_events(cluster.coordinator, final.run_id))
    assert [e for e in events if "refused" in e] and [e for e in events if "accepted" in e]
    [switched] = [e for e in events if "switched to group b" in e]
    first_b = int(switched.split("from step ")[1].split(":")[0])  # the first step group b scored (step 4 done)
    assert first_b in (5, 6)
    replicas_a = set(per_step[0]) | set(per_step[1])
    replica_b = set(per_step[-1])
    assert len(replicas_a) == 2 and len(replica_b) == 1 and not replica_b & replicas_a
    assert all(set(counts) <= replicas_a for counts in per_step[:first_b - 1])
    assert all(set(counts) == replica_b for counts in per_step[first_b - 1:])
    # group b scores exact match, 0 or 1 per sample: the mean is a multiple of 1/32
    assert all(round(s["critic/score/mean"] * 32, 6).is_integer() for s in steps[first_b - 1:])


async def reward_events(coordinator: str, run_id: str) -> list[str]:
    control = CoordinatorClient(coordinator)
    try:
        return [u.message async for u in control.watch(run_id) if u.kind == "reward"]
    finally:
        await control.close()
