"""A LoRA run (actor_rollout_ref.model.lora_rank > 0) on real services: the rollout serves what the trainer
trains (adapter-only syncs), the reference is the base (KL loss on), a stopped and resumed run ends with the
metrics of one never stopped, and its export, merged or as a PEFT adapter folder, is the trainer's model."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import torch

from services.run.models import load_causal_lm
from tests.integration.test_grpo_run import logprobs_both_ways, run_config, run_to_end
from tests.integration.test_model_out import coordctl, transformers_logprobs
from tests.integration.test_resume import comparable, resume, run

STEPS = 4
PROMPT = [5, 6, 7, 16]


def lora_config(tiny_model, reverse_data) -> str:
    return run_config(tiny_model, reverse_data, trainer__total_training_steps=STEPS, trainer__save_freq=2,
                      actor_rollout_ref__model__lora_rank=8, actor_rollout_ref__model__lora_alpha=16,
                      actor_rollout_ref__actor__optim__lr=1e-2, actor_rollout_ref__actor__use_kl_loss=True)


def test_a_lora_run_syncs_adapters_resumes_exactly_and_exports(cluster, tiny_model, reverse_data, tmp_path):
    config = lora_config(tiny_model, reverse_data)
    final, _, services = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    straight = comparable(final.run_dir)
    assert all(row["actor/kl_loss"] > 0 for step, row in straight.items() if step > 1)  # against the base

    # the rollout serves the trainer's last version: base + the adapters it was sent
    address = {s.kind: s.address for s in services}
    generated, trainer_logprobs, version = asyncio.run(
        logprobs_both_ways(address["rollout"], address["trainer"], PROMPT))
    assert version == STEPS and set(generated.weight_versions.tolist()) == {STEPS}
    assert torch.allclose(generated.logprobs, trainer_logprobs, atol=1e-5, rtol=0)
    events = [json.loads(line) for line in (cluster.log_dir / "trainer.log").read_text().splitlines()
              if line.startswith("{")]
    sent = [e["bytes"] for e in events if e["event"] == "weights_sent"]
    base_bytes = sum(p.numel() * 4 for p in load_causal_lm(tiny_model).parameters())
    assert sent and max(sent) < base_bytes / 2  # the adapters, not the model

    # merged export: transformers loads it and scores as the trainer does
    merged = tmp_path / "merged"
    done = coordctl("export", final.run_dir, str(merged))
    assert done.returncode == 0, done.stderr
    response = generated.response_ids[:int(generated.response_lens[0])].tolist()
    want = trainer_logprobs[:len(response)]
    assert torch.allclose(transformers_logprobs(merged, PROMPT, response), want, atol=1e-5, rtol=0)

    # adapter export: PEFT loads it onto the base model folder and scores as the trainer does
    adapter = tmp_path / "adapter"
    done = coordctl("export", final.run_dir, str(adapter), "--adapter")
    assert done.returncode == 0, done.stderr
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_causal_lm(tiny_model), str(adapter)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + response])).logits[0].float()
    predicting = logits[len(PROMPT) - 1: len(PROMPT) + len(response) - 1]
    got = torch.log_softmax(predicting, -1).gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)

    # stopped after step 2 and resumed: the same metrics as the run that never stopped
    stopped = asyncio.run(run(cluster.coordinator, config, stop_after=2))
    assert stopped.state == "stopped" and 2 <= stopped.step < STEPS
    resumed, again = asyncio.run(resume(cluster.coordinator, stopped.run_id))
    assert resumed.step == stopped.step  # from the checkpoint of the step it stopped after
    assert again.state == "finished" and again.step == STEPS
    got_metrics = comparable(again.run_dir)
    assert sorted(got_metrics) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got_metrics[step] == straight[step], f"step {step} differs after the resume"


def test_a_merged_lora_run_sends_the_adapted_layers_merged_and_the_rollout_serves_them(cluster, tiny_model,
                                                                                       reverse_data):
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=2, trainer__save_freq=0,
                        actor_rollout_ref__model__lora_rank=8, actor_rollout_ref__model__lora__merge=True,
                        actor_rollout_ref__actor__optim__lr=1e-2)
    final, _, services = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    address = {s.kind: s.address for s in services}
    generated, trainer_logprobs, version = asyncio.run(
        logprobs_both_ways(address["rollout"], address["trainer"], PROMPT))
    assert version == 2
    assert torch.allclose(generated.logprobs, trainer_logprobs, atol=1e-5, rtol=0)

    # each sync carried the weights of the layers the adapters adapt (every linear layer of the decoder), whole
    base = load_causal_lm(tiny_model)
    adapted = [module.weight for name, module in base.named_modules()
               if isinstance(module, torch.nn.Linear) and name != "lm_head"]
    events = [json.loads(line) for line in (cluster.log_dir / "trainer.log").read_text().splitlines()
              if line.startswith("{")]
    loaded = next(i for i, e in enumerate(events) if e["event"] == "run_loaded" and e["run_id"] == final.run_id)
    this_run = itertools.takewhile(lambda e: e["event"] != "run_loaded", events[loaded + 1:])
    sent = [e["bytes"] for e in this_run if e["event"] == "weights_sent"]
    assert sent and set(sent) == {sum(-(-weight.numel() * 4 // 16) * 16 for weight in adapted)}


def test_a_full_weight_export_refuses_adapter(cluster, tiny_model, reverse_data, tmp_path):
    final, _, _ = asyncio.run(run_to_end(cluster.coordinator, run_config(
        tiny_model, reverse_data, trainer__total_training_steps=1, trainer__save_freq=1)))
    assert final.state == "finished", final.error
    done = coordctl("export", final.run_dir, str(tmp_path / "adapter"), "--adapter")
    assert done.returncode == 2
    assert "trained the actor's full weights (actor_rollout_ref.model.lora_rank is 0)" in done.stderr
    assert not Path(tmp_path / "adapter").exists()
