"""CPU tests of the rollout servicer's edge: what a Generate or InitRun call may ask for."""

from __future__ import annotations

import pytest

from meshrl.v1 import rollout_pb2
from services.common.errors import NotFound, ResourceExhausted
from services.rollout.config import RolloutServiceConfig
from services.rollout.server import (check_call_size, check_model_folder, check_prompt_lengths, partial_rollout_from_pb,
                                     sampling_from_pb)

CONFIG = RolloutServiceConfig(max_n=16, max_new_tokens=100, max_tokens_per_call=1000)


def params(**changes) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(**{"n": 2, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8, **changes})


def test_sampling_within_the_limits_is_taken_as_sent():
    sampling = sampling_from_pb(params(n=16, temperature=0.0, top_p=0.5, max_new_tokens=100, seed=3,
                                       stop_token_ids=[1, 2]), CONFIG)
    assert (sampling.n, sampling.temperature, sampling.top_p, sampling.max_new_tokens, sampling.seed,
            sampling.stop_token_ids) == (16, 0.0, 0.5, 100, 3, (1, 2))


@pytest.mark.parametrize("changes, field", [
    ({"n": 0}, "params.n"), ({"max_new_tokens": -1}, "params.max_new_tokens"),
    ({"temperature": 1e-300}, "params.temperature"), ({"temperature": float("nan")}, "params.temperature"),
    ({"top_p": float("nan")}, "params.top_p"), ({"top_p": 0.0}, "params.top_p"),
    ({"stop_token_ids": list(range(1025))}, "params.stop_token_ids"),
])
def test_a_parameter_that_means_nothing_is_refused_naming_it(changes, field):
    with pytest.raises(ValueError, match=field):
        sampling_from_pb(params(**changes), CONFIG)


@pytest.mark.parametrize("changes, setting", [({"n": 2**31 - 1}, "max_n"), ({"max_new_tokens": 101}, "max_new_tokens")])
def test_a_parameter_over_its_limit_is_refused_naming_the_setting(changes, setting):
    with pytest.raises(ResourceExhausted, match=rf"\(setting {setting}\)"):
        sampling_from_pb(params(**changes), CONFIG)


def test_a_call_of_more_tokens_than_max_tokens_per_call_is_refused():
    check_call_size(62, sampling_from_pb(params(n=2, max_new_tokens=8), CONFIG), CONFIG)  # 992 tokens
    with pytest.raises(ResourceExhausted, match=r"63 prompts x params.n 2 x params.max_new_tokens 8 = 1008 .* 1000"):
        check_call_size(63, sampling_from_pb(params(n=2, max_new_tokens=8), CONFIG), CONFIG)


def test_a_prompt_longer_with_its_response_than_the_model_takes_is_refused_naming_it():
    check_prompt_lengths([[1] * 3, [1] * 92, []], 8, 100)
    with pytest.raises(ValueError, match="prompt 1 has 93 tokens: with params.max_new_tokens 8 that is more than"):
        check_prompt_lengths([[1] * 3, [1] * 93, [1] * 5], 8, 100)


def test_a_model_folder_must_exist_and_hold_a_config(tmp_path):
    with pytest.raises(NotFound, match="model_path: no folder"):
        check_model_folder(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="model_path: no config.json"):
        check_model_folder(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    check_model_folder(str(tmp_path))


def test_a_sync_keeps_restarts_or_finishes_the_calls_in_flight_and_refuses_both_flags():
    def partial_rollout(**flags) -> str:
        return partial_rollout_from_pb(rollout_pb2.ReceiveWeightsRequest(channel_id="c", **flags))

    assert (partial_rollout(), partial_rollout(restart_in_flight=True), partial_rollout(keep_in_flight=True)) == \
        ("finish", "restart", "keep")
    with pytest.raises(ValueError, match="keep_in_flight and restart_in_flight exclude each other"):
        partial_rollout(keep_in_flight=True, restart_in_flight=True)
