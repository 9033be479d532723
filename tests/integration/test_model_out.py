"""The job around the engine, on real processes: validation while a run trains, its checkpoint exported to a
Hugging Face folder, that folder loaded by transformers, scored by `coordctl eval` and trained from again."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from services.run.models import load_causal_lm, load_value_model
from services.coordctl.synthetic import reverse_task_rows, write_jsonl
from services.common.sequences import SequenceBatch
from services.coordinator.fleet.clients import TrainerClient
from tests.integration.test_grpo_run import run_config, run_to_end

CORE = "val-core/meshrl/reverse/reward/mean@1"


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    rows = reverse_task_rows(16, 2, 4, seed=5, split="test", held_out_share=0.5)
    return write_jsonl(rows, tmp_path_factory.mktemp("held-out") / "test.jsonl")


def coordctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.coordctl.cli", *args], capture_output=True, text=True,
                          timeout=300)


def transformers_logprobs(folder: Path, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The response tokens' logprobs under the model folder, loaded by transformers, in one plain forward."""
    model = load_causal_lm(folder).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    predicting = logits[len(prompt) - 1: len(prompt) + len(response) - 1]
    return torch.log_softmax(predicting, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


async def trainer_logprobs(address: str, prompt: list[int], response: list[int]) -> torch.Tensor:
    trainer = TrainerClient(address)
    try:
        return await trainer.compute_log_probs(SequenceBatch.of_lists([prompt], [response]), step=0, timeout=60)
    finally:
        await trainer.close()


def test_validate_export_evaluate_and_train_again(cluster, tiny_model, reverse_data, held_out, tmp_path):
    config = run_config(tiny_model, reverse_data, data__val_files=[str(held_out)], trainer__test_freq=3,
                        trainer__save_freq=3)
    final, updates, services = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    run_dir = Path(final.run_dir)

    # validation of the starting weights and after step 3, with verl's names, in metrics.jsonl and the run DB
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    validations = [line for line in lines if "val/weight_version" in line]
    assert [(v["step"], v["val/weight_version"]) for v in validations] == [(0, 0.0), (3, 3.0)]
    assert all(0.0 <= v[CORE] <= 1.0 and "val-core/meshrl/reverse/acc/mean@1" in v for v in validations)
    db = sqlite3.connect(Path(cluster.state_dir) / "meshrl.db")
    (row,) = db.execute("SELECT metrics_json FROM steps WHERE run_id = ? AND step = 3", (final.run_id,)).fetchone()
    assert {"critic/score/mean", CORE} <= json.loads(row).keys()  # one record for step 3: training and validation
    assert [u.message.startswith("validation of step") for u in updates if u.kind == "validation"] == [True, True]
    samples = [json.loads(line) for line in (run_dir / "validation" / "step_000003.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and {"prompt", "response", "score", "acc", "pred", "weight_version"} <= samples[0].keys()
    assert sum(s["score"] for s in samples) / 16 == pytest.approx(validations[-1][CORE])

    # export: a Hugging Face folder whose weights give the trainer's logprobs
    exported = tmp_path / "exported"
    done = coordctl("export", str(run_dir), str(exported))
    assert done.returncode == 0, done.stderr
    assert "exported the actor of step 3" in done.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in exported.iterdir()}
    assert json.loads((exported / "meshrl_export.json").read_text())["data"] == {
        "max_prompt_length": 16, "max_response_length": 6, "truncation": "error", "return_raw_chat": False}
    prompt, response = [5, 6, 7, 16], [9, 12, 3]
    address = {s.kind: s.address for s in services}
    assert torch.allclose(transformers_logprobs(exported, prompt, response),
                          asyncio.run(trainer_logprobs(address["trainer"], prompt, response)), atol=1e-5, rtol=0)
    refused = coordctl("export", str(run_dir), str(tmp_path / "other"), "--step", "2")
    assert refused.returncode == 2 and "no checkpoint of step 2; it has steps [3]" in refused.stderr

    # coordctl eval scores the exported folder through the rollout and reward services: the same greedy,
    # seeded responses as the last validation, so the same score
    results = tmp_path / "eval.jsonl"
    done = coordctl("eval", str(exported), "--data", str(held_out), "--max-response-length", "6", "--out",
                    str(results), "data.max_prompt_length=16", "--coordinator", cluster.coordinator)
    assert done.returncode == 0, done.stderr
    assert "meshrl/reverse: acc/mean@1 " in done.stdout and "reward/mean@1" in done.stdout
    evaluated = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(e["prompt"], e["response"]) for e in evaluated] == [(s["prompt"], s["response"]) for s in samples]
    assert sum(e["score"] for e in evaluated) / 16 == pytest.approx(validations[-1][CORE])
    # with services of its own and a response length given over the run's recorded one (1040 tokens, more than
    # the model's positions): refused, naming why, by the coordinator it started (not one at the default address)
    refused = coordctl("eval", str(exported), "--local", "--state-dir", str(tmp_path / "eval-state"), "--data",
                       str(held_out), "--max-response-length", "1024")
    assert refused.returncode == 1 and "the local coordinator refused: INVALID_ARGUMENT" in refused.stderr
    assert "data.max_prompt_length + data.max_response_length" in refused.stderr and "7070" not in refused.stderr

    # a run starts from the exported folder
    again, _, _ = asyncio.run(run_to_end(cluster.coordinator, run_config(exported, reverse_data,
                                                                         trainer__total_training_steps=1)))
    assert again.state == "finished", again.error


def test_the_quick_start_run_exports_without_flags_and_evaluates_at_its_lengths(held_out, tmp_path):
    # coordctl start-run --local as the quick start types it, a few steps long: it saves its last step
    cache, state_dir = tmp_path / "cache", tmp_path / "state"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MESHRL_TOKEN")}, "MESHRL_CACHE": str(cache)}
    started = subprocess.run([sys.executable, "-m", "services.coordctl.cli", "start-run", "--local",
                              "trainer.total_training_steps=3", "--state-dir", str(state_dir)],
                             capture_output=True, text=True, timeout=600, env=env)
    assert started.returncode == 0, started.stdout[-2000:] + started.stderr[-2000:]
    [run_dir] = state_dir.glob("runs/*")
    exported = tmp_path / "exported"
    done = coordctl("export", run_dir.name, str(exported), "--state-dir", str(state_dir))
    assert done.returncode == 0, done.stderr
    assert "exported the actor of step 3" in done.stdout
    # no length flags: the run's 16 + 6 tokens, which fit the tiny model (512 + 512 would not)
    done = coordctl("eval", str(exported), "--local", "--state-dir", str(tmp_path / "eval-state"), "--data",
                    str(held_out), "--out", str(tmp_path / "eval.jsonl"))
    assert done.returncode == 0, done.stderr
    assert "meshrl/reverse: acc/mean@1 " in done.stdout
    [eval_dir] = (tmp_path / "eval-state").glob("runs/*")
    evaluated = yaml.safe_load((eval_dir / "config.yaml").read_text())["data"]
    assert (evaluated["max_prompt_length"], evaluated["max_response_length"]) == (16, 6)


def test_a_critic_exports_as_a_value_model(cluster, tiny_model, reverse_data, tmp_path):
    config = run_config(tiny_model, reverse_data, algorithm__adv_estimator="gae", trainer__total_training_steps=2,
                        trainer__save_freq=2)
    final, _, services = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    exported = tmp_path / "critic"
    done = coordctl("export", final.run_dir, str(exported), "--role", "critic")
    assert done.returncode == 0, done.stderr
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["Qwen2ForTokenClassification"]

    prompt, response = [5, 6, 7, 16], [9, 12, 3]
    model = load_value_model(exported).eval()
    with torch.no_grad():  # the value before each response token, as the trainer's critic computes it
        values = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1, 0]

    async def trainer_values():
        trainer = TrainerClient({s.kind: s.address for s in services}["trainer"])
        try:
            return await trainer.compute_values(SequenceBatch.of_lists([prompt], [response]), step=0, timeout=60)
        finally:
            await trainer.close()

    assert torch.allclose(values, asyncio.run(trainer_values()), atol=1e-5, rtol=0)
