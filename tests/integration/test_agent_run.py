"""Multi-turn runs through real processes: coordinator, trainer, rollout, reward and env services.

The run's env service (group default) hosts a user's environment (tests/integration/plugins/user_env.py
Countdown) that answers every model turn until the third, so an untrained model goes three turns with it; the
one of group b hosts the same environment ending after two turns, the one of group c another environment (runs
are swapped to them). The tiny model gets a chat template (its character alphabet only) and its turns end at any
digit (stop_token_ids), so that they are short."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml

from services.coordctl.control import CoordinatorClient
from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.conftest import with_chat_template
from tests.integration.test_grpo_run import run_config, run_to_end

PLUGINS = Path(__file__).resolve().parent / "plugins"


@pytest.fixture(scope="module")
def agent_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    countdown = f"{PLUGINS / 'user_env.py'}:Countdown"
    env_configs = {"default": {"countdown": {"environment": countdown}},
                   "b": {"countdown": {"environment": countdown, "options": {"turns": 2}}},
                   "c": {"guess": {"environment": f"{PLUGINS / 'user_env.py'}:GuessNumber"}}}
    for group, environments in env_configs.items():
        workers = {"default": 16, "b": 8, "c": 1}[group]
        (root / f"env-{group}.yaml").write_text(yaml.safe_dump({"environments": environments, "workers": workers}))
    services = (ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="reward"),
                *(ServiceSpec(kind="env", group=group, settings=("--config", str(root / f"env-{group}.yaml")))
                  for group in env_configs))
    cluster = LocalCluster(root / "state", services)
    asyncio.run(cluster.start(timeout_s=120))
    yield cluster
    cluster.stop()


def agent_config(model: Path, data: Path, samples: Path, **changes) -> str:
    from transformers import AutoTokenizer

    digits = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(list("0123456789"))
    settings = {"data__max_response_length": 48, "data__max_prompt_length": 24,
                "actor_rollout_ref__rollout__stop_token_ids": digits,
                "actor_rollout_ref__rollout__multi_turn": {"enable": True, "environment": "countdown"},
                "trainer__total_training_steps": 2, "trainer__rollout_data_dir": str(samples)}
    return run_config(model, data, **{**settings, **changes})


def test_a_multi_turn_run_trains_on_trajectories_whose_replies_are_masked(agent_cluster, chat_model, reverse_data,
                                                                           tmp_path):
    samples_dir = agent_cluster.state_dir / "agent-samples"
    final, _, _ = asyncio.run(run_to_end(agent_cluster.coordinator,
                                               agent_config(chat_model, reverse_data, samples_dir)))
    assert final.state == "finished", final.error
    assert final.step == 2

    db = sqlite3.connect(Path(agent_cluster.state_dir) / "meshrl.db")
    [(metrics_json,)] = db.execute("SELECT metrics_json FROM steps WHERE run_id = ? AND step = 2",
                                   (final.run_id,)).fetchall()
    metrics = json.loads(metrics_json)
    for name in ("num_turns/min", "num_turns/max", "num_turns/mean", "agent/tool_call_rate",
                 "agent/model_tokens/mean", "agent/tool_tokens/mean", "agent/env_seconds/mean"):
        assert name in metrics, name

    assert (Path(final.run_dir) / "agent.png").stat().st_size > 0  # turns and tool calls per step, plotted
    records = [json.loads(line) for line in (samples_dir / "2.jsonl").read_text().splitlines()]
    assert len(records) == 8 * 4
    three_turns = [r for r in records if r["ended"] == "done"]
    assert three_turns, "no trajectory went its three turns"
    for record in three_turns:
        roles = [turn["role"] for turn in record["turns"]]
        assert roles == ["model", "reply", "model", "reply", "model"]
        assert [turn["trained"] for turn in record["turns"]] == [True, False, True, False, True]
        assert all(turn["weight_version"] is not None for turn in record["turns"] if turn["role"] == "model")
        assert all(turn["text"] == "again" for turn in record["turns"] if turn["role"] == "reply")
        assert record["env_reward"] == pytest.approx(0.75)
        # the score: the reward service's of the final turn plus the environment's (env_reward_weight 1)
        scored = sum(c["weight"] * c["value"] for c in record["reward_components"])
        assert record["score"] == pytest.approx(scored + 0.75)
        model_tokens = sum(t["tokens"] for t in record["turns"] if t["trained"])
        reply_tokens = sum(t["tokens"] for t in record["turns"] if not t["trained"])
        assert model_tokens + reply_tokens == record["response_length"]
        assert record["output"] == record["turns"][-1]["text"]


# As chat_model's template, but an assistant turn that others follow loses its text (as Qwen3's loses its
# thinking): no reply can be appended to the tokens sampled, so every reply starts a new sample.
STRIPPING_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] | upper }}:"
                      "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}"
                      "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %} {% endfor %}"
                      "{% if add_generation_prompt %}A:{% endif %}")


@pytest.fixture(scope="module")
def stripping_model(chat_model, tmp_path_factory) -> Path:
    return with_chat_template(chat_model, tmp_path_factory.mktemp("stripping") / "tiny-chat-stripping",
                              STRIPPING_TEMPLATE)


def test_a_template_that_rewrites_earlier_turns_trains_each_trajectory_as_samples_of_fresh_prompts(
        agent_cluster, stripping_model, reverse_data):
    samples_dir = agent_cluster.state_dir / "stripping-samples"
    # one mini-batch of the batch's 32 trajectories: the update would take its own old logprobs, but the samples
    # outnumber the trajectories, so a logprob pass comes first
    config = agent_config(stripping_model, reverse_data, samples_dir, trainer__total_training_steps=1,
                          actor_rollout_ref__actor__ppo_mini_batch_size=8)
    final, _, _ = asyncio.run(run_to_end(agent_cluster.coordinator, config))
    assert final.state == "finished", final.error

    db = sqlite3.connect(Path(agent_cluster.state_dir) / "meshrl.db")
    [(metrics_json,)] = db.execute("SELECT metrics_json FROM steps WHERE run_id = ? AND step = 1",
                                   (final.run_id,)).fetchall()
    records = [json.loads(line) for line in (samples_dir / "1.jsonl").read_text().splitlines()]
    firsts = [r for r in records if r["trajectory_sample"] == 0]
    assert len(firsts) == 8 * 4  # one record per sample, every trajectory's first among them
    assert json.loads(metrics_json)["agent/new_samples"] == len(records) - len(firsts) > 0
    # a turn with text (an empty one, its stop token alone, loses nothing) is rewritten once a reply follows
    three_turns = [r for r in firsts if r["ended"] == "done" and all(t["text"] for t in r["turns"])]
    assert three_turns, "no trajectory went its three turns, each with text"
    for record in three_turns:  # each reply started a new sample: three, each one model turn, trained
        assert record["trajectory_samples"] == 3
        assert [(t["role"], t["sample"]) for t in record["turns"]] == [
            ("model", 0), ("reply", 1), ("model", 1), ("reply", 2), ("model", 2)]
    for record in records:
        own = [t for t in record["turns"] if t["sample"] == record["trajectory_sample"]]
        # a sample's response: its model turns and the replies appended to it (one that opened it: 0 tokens)
        assert record["response_length"] == sum(t["tokens"] for t in own)
        assert [t["trained"] for t in own] == [t["role"] == "model" for t in own]


def test_a_multi_turn_run_without_a_chat_template_is_refused_before_anything_starts(agent_cluster, tiny_model,
                                                                                     reverse_data, tmp_path):
    async def start():
        client = CoordinatorClient(agent_cluster.coordinator)
        try:
            before = await client.list_runs()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.start_run(agent_config(tiny_model, reverse_data, tmp_path / "samples"))
            return refused.value, before, await client.list_runs()
        finally:
            await client.close()

    refused, before, after = asyncio.run(start())
    assert [r.run_id for r in after] == [r.run_id for r in before]  # nothing was started
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "actor_rollout_ref.rollout.multi_turn.enable" in refused.details()
    assert "no chat template" in refused.details()


def test_a_run_naming_an_environment_no_env_service_hosts_fails_naming_what_they_host(agent_cluster, chat_model,
                                                                                      reverse_data, tmp_path):
    config = yaml.safe_load(agent_config(chat_model, reverse_data, agent_cluster.state_dir / "chess-samples"))
    config["actor_rollout_ref"]["rollout"]["multi_turn"]["environment"] = "chess"
    final, _, _ = asyncio.run(run_to_end(agent_cluster.coordinator, yaml.safe_dump(config)))
    assert final.state == "failed"
    assert "multi_turn.environment = 'chess'" in final.error and "countdown" in final.error


def env_set(coordinator: str, run_id: str, group: str) -> subprocess.CompletedProcess:
    """``coordctl env set RUN --group GROUP``, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "services.coordctl.cli", "env", "set", run_id, "--group", group,
                           "--coordinator", coordinator], capture_output=True, text=True, timeout=120)


async def swap_stop_and_resume(coordinator: str, config_yaml: str):
    """Start the run; after step 1 swap its env services to group b, then to group c, which is refused; stop the
    run once group b runs its batches, and resume it to its end. The run's id, the refusal, and the run's events
    (kind, message)."""
    client = CoordinatorClient(coordinator)
    refusals, events = [], []
    try:
        run = await client.start_run(config_yaml)
        async for update in client.watch(run.run_id):
            events.append((update.kind, update.message))
            if update.kind == "step" and update.step == 1:
                await client.set_env(run.run_id, group="b")
                try:  # through the client, not coordctl's process: the run must still be going when it lands
                    await client.set_env(run.run_id, group="c")
                except grpc.aio.AioRpcError as refused:
                    refusals.append(refused)
            elif update.kind == "env" and "switched to group b" in update.message:
                await client.stop_run(run.run_id)  # its checkpoint is taken with group b's services in use
        resumed = await client.resume_run(run.run_id)
        events += [(u.kind, u.message) async for u in client.watch(run.run_id, resumed.last_event_id)]
        return run.run_id, refusals, events
    finally:
        await client.close()


def test_env_services_swapped_mid_run_run_its_episodes_from_the_next_boundary_and_after_a_resume(
        agent_cluster, chat_model, reverse_data):
    coordinator, samples_dir = agent_cluster.coordinator, agent_cluster.state_dir / "swap-samples"
    config = agent_config(chat_model, reverse_data, samples_dir, trainer__total_training_steps=8)
    run_id, [to_c], events = asyncio.run(swap_stop_and_resume(coordinator, config))

    assert to_c.code() == grpc.StatusCode.FAILED_PRECONDITION and "env swap to group c refused" in to_c.details()
    assert "does not host the run's environment 'countdown' (it hosts: guess)" in to_c.details()
    messages = [message for kind, message in events if kind == "env"]
    assert "env swap to group b accepted; applies at the next step boundary" in messages
    [switched] = [m for m in messages if "switched to group b" in m]  # once: the resumed run goes on with group b
    first_b = int(switched.split("from step ")[1].split(":")[0])
    assert first_b >= 3  # accepted after step 1 was reported, once step 2 had begun
    [resumed] = [m for kind, m in events if kind == "log" and m.startswith("resumed from the checkpoint of step")]
    assert int(resumed.split("step ")[1]) >= first_b

    async def outcome():
        client = CoordinatorClient(coordinator)
        try:
            return await client.get_run(run_id), await client.list_services()
        finally:
            await client.close()

    final, services = asyncio.run(outcome())
    assert final.state == "finished" and final.step == 8, final.error
    env_ids = {s.group: s.service_id for s in services if s.kind == "env"}
    for step in range(1, 9):
        records = [json.loads(line) for line in (samples_dir / f"{step}.jsonl").read_text().splitlines()]
        ran_on = {record["env_service"].split(" ")[0] for record in records}
        assert ran_on == {env_ids["default"] if step < first_b else env_ids["b"]}, step
        done = [record for record in records if record["ended"] == "done"]
        assert done, f"no trajectory of step {step} went its turns"
        turns = 3 if step < first_b else 2  # group b's Countdown ends after two turns
        for record in done:
            assert [turn["role"] for turn in record["turns"]] == ["model", "reply"] * (turns - 1) + ["model"]
            assert record["env_reward"] == pytest.approx(0.25 * turns)


def test_a_single_turn_run_has_no_env_services_to_swap(agent_cluster, tiny_model, reverse_data):
    final, _, _ = asyncio.run(run_to_end(agent_cluster.coordinator,
                                         run_config(tiny_model, reverse_data, trainer__total_training_steps=1)))
    assert final.state == "finished", final.error
    refused = env_set(agent_cluster.coordinator, final.run_id, "b")
    assert refused.returncode == 1
    assert f"run {final.run_id} is not multi-turn" in refused.stderr
    assert "actor_rollout_ref.rollout.multi_turn.enable is off" in refused.stderr
