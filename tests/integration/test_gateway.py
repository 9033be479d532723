"""Agents users already wrote, trained through the run's OpenAI-compatible gateway: real processes (coordinator,
trainer, rollout, reward, env services), and agents written with the openai package alone
(tests/integration/plugins/openai_agents.py) that know the gateway only as the guide documents it.

The env service of group default runs its agents sandboxed (their calls relayed over the worker's socket); the one
of group plain runs them unsandboxed, so that they can write what they saw to MESHRL_AGENT_LOG for the test."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from pathlib import Path

import pytest
import yaml

from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_agent_run import agent_config
from tests.integration.test_grpo_run import run_to_end

AGENTS = Path(__file__).resolve().parent / "plugins" / "openai_agents.py"
AGENTS_SDK = Path(__file__).resolve().parents[2] / "examples" / "local_agent" / "agents_sdk.py"


@pytest.fixture(scope="module")
def gateway_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway")
    environments = {"two_calls": {"agent": f"{AGENTS}:two_calls"}, "hostile": {"agent": f"{AGENTS}:hostile"},
                    "flaky": {"agent": f"{AGENTS}:flaky", "agent_timeout_s": 4},
                    "agents_sdk": {"agent_command": [sys.executable, str(AGENTS_SDK)]}}
    (root / "env-default.yaml").write_text(yaml.safe_dump({"environments": environments, "workers": 8}))
    (root / "env-plain.yaml").write_text(yaml.safe_dump({"environments": environments, "workers": 8,
                                                          "sandbox": False}))
    log = root / "agents.jsonl"
    services = (ServiceSpec(kind="trainer"), ServiceSpec(kind="rollout"), ServiceSpec(kind="reward"),
                ServiceSpec(kind="env", group="default", settings=("--config", str(root / "env-default.yaml"))),
                ServiceSpec(kind="env", group="plain", settings=("--config", str(root / "env-plain.yaml")),
                            env=(("MESHRL_AGENT_LOG", str(log)),)))
    cluster = LocalCluster(root / "state", services)
    asyncio.run(cluster.start(timeout_s=180))
    yield cluster, log
    cluster.stop()


def gateway_run(model: Path, data: Path, samples: Path, environment: str, group: str, steps: int = 1) -> str:
    """A run of ``environment`` on group ``group``'s env service: 4 prompts a step (rows 0-3, then 4-7: unshuffled),
    2 trajectories each."""
    return agent_config(model, data, samples, **{
        "actor_rollout_ref__rollout__multi_turn": {"enable": True, "environment": environment},
        "actor_rollout_ref__rollout__n": 2, "data__train_batch_size": 4, "data__shuffle": False,
        "placement__env": group, "trainer__total_training_steps": steps})


def step_metrics(cluster: LocalCluster, run_id: str, step: int) -> dict:
    db = sqlite3.connect(Path(cluster.state_dir) / "meshrl.db")
    [(metrics_json,)] = db.execute("SELECT metrics_json FROM steps WHERE run_id = ? AND step = ?",
                                   (run_id, step)).fetchall()
    return json.loads(metrics_json)


def log_entries(log: Path, agent: str) -> list[dict]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["agent"] == agent] if log.exists() else []


def test_an_openai_agent_trains_on_the_tokens_it_was_sampled_token_exactly(gateway_cluster, chat_model, reverse_data):
    cluster, log = gateway_cluster
    samples_dir = cluster.state_dir / "gateway-samples"
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, gateway_run(chat_model, reverse_data, samples_dir,
                                                                          "two_calls", "plain", steps=2)))
    assert final.state == "finished", final.error
    metrics = step_metrics(cluster, final.run_id, 2)
    assert metrics["agent/gateway/calls/mean"] == 2.0
    assert metrics["agent/gateway/segments/mean"] == 1.0  # the second call went on from the first: one sample
    assert metrics["agent/episodes_failed/no_calls"] == 0.0

    episodes = log_entries(log, "two_calls")
    assert len(episodes) == 2 * 4 * 2
    for episode in episodes:
        first, second = episode["calls"]
        # the second call's prompt is the first's ids and the ids it sampled, then the reply: never re-rendered
        assert second["prompt_token_ids"][:len(first["prompt_token_ids"]) + len(first["token_ids"])] == \
            first["prompt_token_ids"] + first["token_ids"]
        assert all(lp <= 0.0 for lp in first["logprobs"] + second["logprobs"])
        assert len(first["logprobs"]) == len(first["token_ids"])

    by_texts = {(e["calls"][0]["text"], e["calls"][1]["text"]): e for e in episodes}
    for step in (1, 2):
        records = [json.loads(line) for line in (samples_dir / f"{step}.jsonl").read_text().splitlines()]
        assert len(records) == 4 * 2
        for record in records:
            model_turns = [t for t in record["turns"] if t["role"] == "model"]
            [reply] = [t for t in record["turns"] if t["role"] == "reply"]
            assert record["trajectory_samples"] == 1 and all(t["trained"] for t in model_turns)
            assert all(isinstance(t["weight_version"], int) for t in model_turns)
            first, second = by_texts[(model_turns[0]["text"], model_turns[1]["text"])]["calls"]
            # what trains is what the model sampled, token for token, and the reply the template put between
            assert [t["tokens"] for t in model_turns] == [len(first["token_ids"]), len(second["token_ids"])]
            assert reply["tokens"] == len(second["prompt_token_ids"]) - len(first["prompt_token_ids"]) - \
                len(first["token_ids"])
            assert record["response_length"] == len(second["prompt_token_ids"]) + len(second["token_ids"]) - \
                len(first["prompt_token_ids"])
            assert record["score"] == by_texts[(model_turns[0]["text"], model_turns[1]["text"])]["reward"]


def test_a_sandboxed_agent_reaches_the_gateway_through_its_worker(gateway_cluster, chat_model, reverse_data):
    cluster, _ = gateway_cluster
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, gateway_run(
        chat_model, reverse_data, cluster.state_dir / "sandboxed-samples", "two_calls", "default")))
    assert final.state == "finished", final.error
    metrics = step_metrics(cluster, final.run_id, 1)
    assert metrics["agent/gateway/calls/mean"] == 2.0
    assert metrics["agent/episodes_failed/raised"] == 0.0


def test_hostile_requests_get_openai_error_objects_and_the_run_goes_on(gateway_cluster, chat_model, reverse_data):
    cluster, log = gateway_cluster
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, gateway_run(
        chat_model, reverse_data, cluster.state_dir / "hostile-samples", "hostile", "plain")))
    assert final.state == "finished", final.error
    episodes = log_entries(log, "hostile")
    assert len(episodes) == 4 * 2
    for episode in episodes:
        refusals = episode["refusals"]
        expected = {"unknown_model": (404, "model_not_found"), "n_too_large": (400, "n_too_large"),
                    "over_budget": (400, "context_length_exceeded"), "other_runs_key": (401, "invalid_api_key"),
                    "malformed_json": (400, "invalid_json")}
        for name, (status, code) in expected.items():
            assert refusals[name]["status"] == status, (name, refusals[name])
            error = refusals[name]["body"]["error"] if "error" in refusals[name]["body"] else refusals[name]["body"]
            assert error["code"] == code and error["message"], (name, error)
        assert "otherrun" in json.dumps(refusals["other_runs_key"]["body"])
        assert episode["models"] == [final.run_id]
    metrics = step_metrics(cluster, final.run_id, 1)
    assert metrics["agent/episodes_failed/raised"] == 0.0  # every refusal was an answer, not a failure
    assert metrics["agent/gateway/calls/mean"] >= 1.0  # the stream read whole; the cut one as delivered or not


def test_agents_that_never_call_raise_or_hang_are_counted_and_the_run_goes_on(gateway_cluster, chat_model,
                                                                              reverse_data):
    cluster, _ = gateway_cluster
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, gateway_run(
        chat_model, reverse_data, cluster.state_dir / "flaky-samples", "flaky", "plain", steps=2)))
    assert final.state == "finished", final.error
    failed = {why: sum(step_metrics(cluster, final.run_id, step)[f"agent/episodes_failed/{why}"] for step in (1, 2))
              for why in ("no_calls", "raised", "timed_out")}
    assert all(count > 0 for count in failed.values()), failed


def test_an_agent_written_with_the_openai_agents_sdk_runs_unmodified_as_a_command(gateway_cluster, chat_model,
                                                                                  reverse_data):
    pytest.importorskip("agents")  # openai-agents: the example's framework, not one of meshrl's dependencies
    cluster, _ = gateway_cluster
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, gateway_run(
        chat_model, reverse_data, cluster.state_dir / "sdk-samples", "agents_sdk", "default")))
    assert final.state == "finished", final.error
    metrics = step_metrics(cluster, final.run_id, 1)
    assert metrics["agent/gateway/calls/mean"] >= 1.0
    assert sum(metrics[f"agent/episodes_failed/{why}"] for why in ("no_calls", "raised", "timed_out")) == 0.0
