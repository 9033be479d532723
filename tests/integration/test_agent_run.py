"""Multi-turn runs through real processes: coordinator, trainer, rollout, reward and an env service.

The env service hosts a user's environment (tests/integration/plugins/user_env.py Countdown) that answers every
model turn until the third, so an untrained model goes three turns with it. The tiny model gets a chat template
(its character alphabet only) and its turns end at any digit (stop_token_ids), so that they are short."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest
import yaml

from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_grpo_run import run_config, run_to_end

PLUGINS = Path(__file__).resolve().parent / "plugins"
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] | upper }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %} {% endfor %}"
            "{% if add_generation_prompt %}A:{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model with a chat template over its alphabet."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat") / "tiny-chat"
    folder.mkdir()
    for item in tiny_model.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def agent_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent")
    env_config = root / "env.yaml"
    env_config.write_text(yaml.safe_dump({
        "environments": {"countdown": {"environment": f"{PLUGINS / 'user_env.py'}:Countdown"}}, "workers": 16}))
    services = (ServiceSpec("trainer"), ServiceSpec("rollout"), ServiceSpec("reward"),
                ServiceSpec("env", settings=("--config", str(env_config))))
    cluster = LocalCluster(root / "state", services)
    asyncio.run(cluster.start(timeout_s=120))
    yield cluster
    cluster.stop()


def agent_config(model: Path, data: Path, samples: Path, **changes) -> str:
    from transformers import AutoTokenizer

    digits = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(list("0123456789"))
    return run_config(model, data, data__max_response_length=48, data__max_prompt_length=24,
                      actor_rollout_ref__rollout__stop_token_ids=digits,
                      actor_rollout_ref__rollout__multi_turn={"enable": True, "environment": "countdown"},
                      trainer__total_training_steps=2, trainer__rollout_data_dir=str(samples), **changes)


def test_a_multi_turn_run_trains_on_trajectories_whose_replies_are_masked(agent_cluster, chat_model, reverse_data,
                                                                           tmp_path):
    samples_dir = agent_cluster.state_dir / "agent-samples"
    final, updates, _ = asyncio.run(run_to_end(agent_cluster.coordinator,
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


def test_a_multi_turn_run_without_a_chat_template_is_refused_before_anything_starts(agent_cluster, tiny_model,
                                                                                     reverse_data, tmp_path):
    import grpc

    from services.coordctl.control import CoordinatorClient

    async def start():
        client = CoordinatorClient(agent_cluster.coordinator)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await client.start_run(agent_config(tiny_model, reverse_data, tmp_path / "samples"))
            return refused.value, await client.list_runs()
        finally:
            await client.close()

    refused, runs = asyncio.run(start())
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
