"""A run that would ask a rollout for more than its registered limits is refused before it starts; what a LoRA
run tells its rollouts at InitRun."""

from __future__ import annotations

import json

import pytest

from services.common.config import validate
from services.run.config import RunConfig
from services.coordinator.settings import check_within_rollout_limits, rollout_set_settings

LIMITS = {"max_n": 16, "max_new_tokens": 512, "max_tokens_per_call": 1 << 26}


def config(n=4, max_response_length=256, val_n=1, val_files=()) -> RunConfig:
    return validate(RunConfig, {"data": {"max_response_length": max_response_length, "val_files": list(val_files)},
                                "actor_rollout_ref": {"rollout": {"n": n, "val_kwargs": {"n": val_n}}}})


def test_a_run_within_every_rollouts_limits_passes():
    check_within_rollout_limits(config(n=16, max_response_length=512), {"a:1": LIMITS, "b:2": LIMITS})
    check_within_rollout_limits(config(n=4096), {"old:1": {}})  # a rollout that says no limits checks them itself


@pytest.mark.parametrize("changes, message", [
    ({"n": 9}, "actor_rollout_ref.rollout.n = 9 is over the limit of rollout b:2: max_n = 8"),
    ({"max_response_length": 513}, "data.max_response_length = 513 is over the limit of rollout a:1: "
                                   "max_new_tokens = 512"),
    ({"val_n": 9, "val_files": ["v.jsonl"]}, "actor_rollout_ref.rollout.val_kwargs.n = 9 is over the limit of "
                                             "rollout b:2: max_n = 8"),
])
def test_a_run_over_a_rollouts_limit_is_refused_naming_the_key_and_the_limit(changes, message):
    with pytest.raises(ValueError, match=message):
        check_within_rollout_limits(config(**changes), {"a:1": LIMITS, "b:2": {**LIMITS, "max_n": 8}})


def lora_run(tmp_path, staleness: int, **model) -> RunConfig:
    return validate(RunConfig, {"actor_rollout_ref": {"model": {"path": str(tmp_path), **model}},
                                "trainer": {"async_": {"max_staleness": staleness}}})


def test_a_lora_runs_rollouts_hear_its_rank_and_keep_max_staleness_plus_one_versions(tmp_path):
    full = rollout_set_settings(lora_run(tmp_path, 2))
    assert (full.lora_rank, full.adapter_versions) == (0, 0)
    lora = rollout_set_settings(lora_run(tmp_path, 2, lora_rank=64, lora_alpha=128))
    assert (lora.lora_rank, lora.adapter_versions) == (64, 3)
    # an adapter to train further brings its own rank: the largest of its r and its per-module ranks
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 16, "rank_pattern": {"q_proj": 32}}))
    started = rollout_set_settings(lora_run(tmp_path, 0, lora_rank=8, lora_adapter_path=str(tmp_path)))
    assert (started.lora_rank, started.adapter_versions) == (32, 1)
    merged = rollout_set_settings(lora_run(tmp_path, 2, lora_rank=64, lora={"merge": True}))
    assert (merged.lora_rank, merged.adapter_versions) == (0, 0)  # served as full weights


def test_a_lora_run_whose_warm_start_trains_the_full_weights_has_rollouts_serve_full_weights(tmp_path):
    def settings(**warm_start):
        return rollout_set_settings(validate(RunConfig, {
            "actor_rollout_ref": {"model": {"path": str(tmp_path), "lora_rank": 8},
                                  "actor": {"warm_start": warm_start}}}))

    assert (settings(steps=30).lora_rank, settings(steps=30).adapter_versions) == (0, 0)  # the whole model, merged
    assert settings(steps=30, full_weights=False).lora_rank == 8  # the warm start trains the adapters: adapters
    assert settings(steps=0).lora_rank == 8  # no warm start: the base is the model folder's
