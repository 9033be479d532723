"""CPU tests of a batch whose multi-turn trajectories went on in new samples (services/coordinator/step/generation.py's
Rollouts, and what the loop and the samples file make of it): each trajectory is scored once, is one member of
its prompt's GRPO group, and its advantage reaches every one of its samples' model tokens; numbers by hand."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from services.common.config import validate
from services.coordctl.tiny_model import build_char_tokenizer
from services.coordinator.agent.agent_loop import AgentTrace, trajectory_batch
from services.coordinator.fleet.clients import ScoredSample
from services.coordinator.step.generation import Lineage, Rollouts, reward_samples
from services.coordinator.step.loop import Evaluated, Updates, batch_metrics, estimate_advantages
from services.coordinator.fleet.reward_set import Scored, ScoredBy
from services.coordinator.step.samples import step_records
from services.coordinator.settings import loop_settings
from services.coordinator.agent.turns import Trajectory
from services.run.config import RunConfig
from services.run.data import Prompt

# two prompts, two trajectories each; the first trajectory went on in a second sample
SAMPLES = [Trajectory(prompt_ids=(1, 2), max_response_length=20, response_ids=(5, 6, 7), loss_mask=(1, 1, 1),
                      logprobs=(-0.1, -0.2, -0.3)),
           Trajectory(prompt_ids=(1, 2, 5, 9), max_response_length=10, response_ids=(8, 9, 9, 8), loss_mask=(1, 0, 0,
                                                                                                             1), logprobs=(-0.4, 0.0, 0.0, -0.5)),
           Trajectory(prompt_ids=(1, 2), max_response_length=20, response_ids=(5, 5), loss_mask=(1, 1),
                      logprobs=(-0.1, -0.1)),
           Trajectory(prompt_ids=(3,), max_response_length=20, response_ids=(6, 6), loss_mask=(1, 1), logprobs=(-0.2,
                                                                                                                -0.2)),
           Trajectory(prompt_ids=(3,), max_response_length=20, response_ids=(7,), loss_mask=(1,), logprobs=(-0.3,))]
SAMPLES_PER_TRAJECTORY = [2, 1, 1, 1]
SCORES = [1.0, 0.0, 0.5, 0.5]  # the reward service's, per trajectory
GRPO = 0.5 / (math.sqrt(0.5) + 1e-6)  # prompt 0: scores 1 and 0, mean 0.5, unbiased std sqrt(0.5)


def trace(final_text: str, samples: int) -> AgentTrace:
    return AgentTrace(turns=(), final_text=final_text, env_reward=0.0, episode_service="env-1", rollouts=("r:1",),
                      last_versions=(3,) * samples, ended="answer", tool_calls=Counter(), tool_errors=Counter(),
                      tool_timeouts=Counter(), env_seconds=0.0, restarts=0)


def split_rollouts() -> Rollouts:
    traces = [trace(f"answer {t}", count) for t, count in enumerate(SAMPLES_PER_TRAJECTORY)]
    per_sample = [t for t, count in zip(traces, SAMPLES_PER_TRAJECTORY) for _ in range(count)]
    prompts = [Prompt(token_ids=[1, 2], data_source="d", ground_truth="g0", extra_info={}, messages=()),
               Prompt(token_ids=[3], data_source="d", ground_truth="g1", extra_info={}, messages=())]
    return Rollouts(batch=trajectory_batch(SAMPLES),
                    logprobs=torch.tensor([p for s in SAMPLES for p in s.logprobs]),
                    truncated=torch.zeros(len(SAMPLES), dtype=torch.bool), scores=torch.zeros(len(SAMPLES)),
                    versions=torch.tensor([3] * len(SAMPLES)), last_versions=torch.tensor([3] * len(SAMPLES)),
                    prompts=prompts, n=2, lineage=tuple(Lineage(rollout="r:1", trace=t) for t in per_sample),
                    env_scores=torch.zeros(len(SAMPLES)),
                    samples_per_trajectory=torch.tensor(SAMPLES_PER_TRAJECTORY))


def scored(rollouts: Rollouts) -> Rollouts:
    samples = reward_samples(rollouts, build_char_tokenizer())
    scores = Scored([ScoredSample(score=score, valid=True, error="") for score in SCORES], [ScoredBy("reward-1",
                                                                                                     "w:1")] * len(SCORES))
    return rollouts.with_scores(samples, scores)


def grpo_settings():
    return loop_settings(validate(RunConfig, {"algorithm": {"adv_estimator": "grpo"},
                                              "actor_rollout_ref": {"rollout": {"n": 2}}}))


def test_each_trajectory_is_scored_once_and_its_samples_share_the_score():
    rollouts = split_rollouts()
    samples = reward_samples(rollouts, build_char_tokenizer())
    assert [s.response for s in samples] == ["answer 0", "answer 1", "answer 2", "answer 3"]
    assert [s.ground_truth for s in samples] == ["g0", "g0", "g1", "g1"]
    assert scored(rollouts).scores.tolist() == [1.0, 1.0, 0.0, 0.5, 0.5]
    assert rollouts.group_ids.tolist() == [0, 0, 0, 1, 1]


def test_grpo_counts_a_split_trajectory_once_and_gives_its_advantage_to_every_model_token_of_its_samples():
    estimate = estimate_advantages(grpo_settings(), 0.0, scored(split_rollouts()), evaluated=Evaluated(None, None,
                                                                                                       None))
    a = GRPO  # counted twice (scores 1, 1, 0), it would be (1 - 2/3) / std(1, 1, 0) = 0.577
    assert estimate.advantages.tolist() == pytest.approx([a, a, a, a, 0, 0, a, -a, -a, 0, 0, 0], abs=1e-5)
    # the score on each trajectory's last model token: the first's is in its second sample
    assert estimate.rewards.tolist() == [0, 0, 0, 0, 0, 0, 1.0, 0, 0, 0, 0.5, 0.5]


def test_the_steps_data_metrics_are_per_trajectory():
    rollouts = scored(split_rollouts())
    estimate = estimate_advantages(grpo_settings(), 0.0, rollouts, evaluated=Evaluated(None, None, None))
    metrics = batch_metrics(rollouts, Evaluated(None, None, None), estimate, updates=Updates({}, 4), step_s=1.0,
                                    devices=1)
    assert metrics["critic/score/mean"] == pytest.approx(0.5)  # (1 + 0 + 0.5 + 0.5) / 4, not over 5 samples
    assert metrics["response_length/mean"] == pytest.approx((7 + 2 + 2 + 1) / 4)
    assert metrics["prompt_length/mean"] == pytest.approx((2 + 2 + 1 + 1) / 4)  # each trajectory's first prompt
    assert metrics["perf/total_num_tokens"] == 3 + 4 + 2 + 2 + 1 + (2 + 4 + 2 + 1 + 1)  # every sample's tokens


def test_keeping_prompts_keeps_all_the_samples_of_their_trajectories():
    rollouts = scored(split_rollouts())
    first, second = rollouts.keep_prompts([0]), rollouts.keep_prompts([1])
    assert first.batch.response_lens.tolist() == [3, 4, 2] and first.samples_per_trajectory.tolist() == [2, 1]
    assert first.scores.tolist() == [1.0, 1.0, 0.0]
    assert second.batch.response_lens.tolist() == [2, 1] and second.samples_per_trajectory.tolist() == [1, 1]
    assert second.logprobs.tolist() == pytest.approx([-0.2, -0.2, -0.3])
    assert Rollouts.concat([second, first]).samples_per_trajectory.tolist() == [1, 1, 2, 1]


def test_a_prompt_is_dropped_where_any_sample_of_its_trajectories_fails_a_test():
    rollouts = split_rollouts()
    # the second sample of prompt 0's first trajectory fails (staleness over the limit, say): prompt 0 goes
    assert rollouts.prompts_where_every_sample(torch.tensor([True, False, True, True, True])) == [1]
    assert rollouts.prompts_where_every_sample(torch.tensor([True, True, True, True, False])) == [0]
    assert rollouts.prompts_where_every_sample(torch.ones(5, dtype=torch.bool)) == [0, 1]


def test_the_samples_file_has_a_record_per_sample_naming_its_place_in_the_trajectory():
    rollouts = scored(split_rollouts())
    estimate = estimate_advantages(grpo_settings(), 0.0, rollouts, evaluated=Evaluated(None, None, None))
    records = step_records(1, rollouts, 3, advantages=estimate.advantages)
    assert [(r["trajectory_sample"], r["trajectory_samples"], r["group"]) for r in records] == [
        (0, 2, 0), (1, 2, 0), (0, 1, 0), (0, 1, 1), (0, 1, 1)]
    assert [r["output"] for r in records] == ["answer 0", "answer 0", "answer 1", "answer 2", "answer 3"]
    assert [r["advantage"] for r in records] == pytest.approx([GRPO, GRPO / 2, -GRPO, 0.0, 0.0], abs=1e-5)
