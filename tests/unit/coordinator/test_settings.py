"""A run that would ask a rollout for more than its registered limits is refused before it starts."""

from __future__ import annotations

import pytest

from services.common.config import validate
from services.run.config import RunConfig
from services.coordinator.settings import check_within_rollout_limits

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
