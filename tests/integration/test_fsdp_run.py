"""A trainer of two CPU ranks under torchrun (FSDP2 over gloo) serving a LoRA run, then a whole GRPO run, with the
rollout and reward services as real processes: one cluster for the module, as long-running services serve run after
run; the GRPO run comes last, as it ends with the cluster's shutdown."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from services.coordctl.local import LocalCluster, ServiceSpec
from tests.integration.test_grpo_run import logprobs_both_ways, run_config, run_to_end
from tests.integration.test_model_out import coordctl, transformers_logprobs


@pytest.fixture(scope="module")
def two_rank_cluster(tmp_path_factory):
    local = LocalCluster(tmp_path_factory.mktemp("two-ranks") / "state", (
        ServiceSpec(kind="trainer", ranks=2), ServiceSpec(kind="rollout"), ServiceSpec(kind="reward")))
    asyncio.run(local.start(timeout_s=120))
    yield local
    local.stop()


def trainer_events(cluster: LocalCluster) -> list[dict]:
    """The trainer's JSON log events. Its two ranks share the log file, and one rank's progress bar (transformers'
    "Loading weights", which ends its line only when done) can stand before the other's event on a line: each
    event is read from the first ``{`` of its line."""
    decoder, events = json.JSONDecoder(), []
    for line in (cluster.log_dir / "trainer.log").read_text().splitlines():
        start = line.find('{"')
        if start >= 0:
            events.append(decoder.raw_decode(line, start)[0])
    return events


def children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def test_a_lora_run_on_a_two_rank_fsdp_trainer(two_rank_cluster, tiny_model, reverse_data, tmp_path):
    cluster = two_rank_cluster
    config = run_config(tiny_model, reverse_data, trainer__total_training_steps=2, trainer__save_freq=2,
                        actor_rollout_ref__model__lora_rank=8, actor_rollout_ref__actor__optim__lr=1e-2,
                        actor_rollout_ref__actor__use_kl_loss=True)
    final, _, services = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    events = trainer_events(cluster)
    assert [e["ranks"] for e in events if e["event"] == "run_loaded" and e["run_id"] == final.run_id] == [2]

    # the adapters gathered from both ranks' shards reach the rollout: its logprobs are the trainer's
    address = {s.kind: s.address for s in services}
    generated, trainer_logprobs, version = asyncio.run(
        logprobs_both_ways(address["rollout"], address["trainer"], [5, 6, 7, 16]))
    assert version == 2
    assert torch.allclose(generated.logprobs, trainer_logprobs, atol=1e-5, rtol=0)

    # both ranks' shards of the adapters export to one adapter folder that PEFT loads
    saved = Path(final.run_dir) / "checkpoints" / "step_000002" / "actor-ref"  # the trainer hosts both roles
    assert sorted(path.name for path in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    merged = tmp_path / "merged"
    done = coordctl("export", final.run_dir, str(merged))
    assert done.returncode == 0, done.stderr
    response = generated.response_ids[:int(generated.response_lens[0])].tolist()
    assert torch.allclose(transformers_logprobs(merged, [5, 6, 7, 16], response), trainer_logprobs[:len(response)],
                          atol=1e-5, rtol=0)


def test_grpo_run_on_a_two_rank_trainer(two_rank_cluster, tiny_model, reverse_data, tmp_path):
    cluster = two_rank_cluster
    config = run_config(tiny_model, reverse_data, trainer__save_freq=2, trainer__total_training_steps=4,
                        actor_rollout_ref__actor__use_dynamic_bsz=True,
                        actor_rollout_ref__actor__ppo_max_token_len_per_gpu=64)
    final, _, services = asyncio.run(run_to_end(cluster.coordinator, config))
    assert final.state == "finished", final.error
    assert final.step == 4

    # the run was trained by two FSDP ranks
    events = trainer_events(cluster)
    assert sorted(e["rank"] for e in events if e["event"] == "ranks_joined") == [0, 1]
    assert [e["ranks"] for e in events if e["event"] == "run_loaded" and e["run_id"] == final.run_id] == [2]

    # the rollout serves the trainer's version 4, whose weights came from the shards: its logprobs are the trainer's
    address = {s.kind: s.address for s in services}
    generated, trainer_logprobs, version = asyncio.run(
        logprobs_both_ways(address["rollout"], address["trainer"], [5, 6, 7, 16]))
    assert version == 4 and set(generated.weight_versions.tolist()) == {4}
    assert torch.allclose(generated.logprobs, trainer_logprobs, atol=1e-5, rtol=0)

    # the checkpoint of step 4, in two ranks' shards, exports to one Hugging Face folder with the trainer's weights
    exported = tmp_path / "exported"
    done = coordctl("export", final.run_dir, str(exported))
    assert done.returncode == 0, done.stderr
    response = generated.response_ids[:int(generated.response_lens[0])].tolist()
    assert torch.allclose(transformers_logprobs(exported, [5, 6, 7, 16], response),
                          trainer_logprobs[:len(response)], atol=1e-5, rtol=0)

    # both ranks wrote their shards into the checkpoint of step 2 (of the trainer group hosting the actor)
    saved = Path(final.run_dir) / "checkpoints" / "step_000002" / "actor"
    assert (saved / "trainer_state.pt").exists()
    assert sorted(path.name for path in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]

    # stopping the torchrun agent ends both ranks
    agent = cluster.processes["trainer"].pid
    ranks = children(agent)
    assert len(ranks) == 2
    cluster.stop()
    for pid in [agent, *ranks]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
