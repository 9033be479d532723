"""CPU tests of services/coordinator/fleet/weight_probe.py: which samples make the probe, the tolerance a rollout
is held to, when a probe passes, and that the rollouts of a sync and the actor are asked at once, the actor again
(for their ids) only for a rollout with a top-k id outside the actor's top, and not again for the same version."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import pytest
import torch

from services.algos import DistributionDiff, LogprobDiff
from services.common.sequences import SequenceBatch
from services.coordinator.fleet.clients import RolloutScores, TrainerTop
from services.coordinator.settings import WeightCheckSettings
from services.coordinator.fleet.weight_probe import (MEASURED, MOE_TOPK_KL, TRAINER_TOP_FACTOR, ProbeResult,
                                                     Tolerance, WeightProbe, draw_probe, logprobs_at, tolerance_for)
from services.run.checks import is_mixture_of_experts

DEFAULTS = WeightCheckSettings(sequences=4, tolerance_mean=None, tolerance_max=None)


def batch_of(prompts: list[list[int]], responses: list[list[int]]) -> SequenceBatch:
    return SequenceBatch(
        prompt_ids=torch.tensor([t for p in prompts for t in p], dtype=torch.int64),
        prompt_lens=torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        response_ids=torch.tensor([t for r in responses for t in r], dtype=torch.int64),
        response_lens=torch.tensor([len(r) for r in responses], dtype=torch.int64),
        loss_mask=torch.ones(sum(len(r) for r in responses), dtype=torch.bool))


def test_the_probe_is_the_first_sample_with_a_response_of_each_of_the_first_prompts():
    # 3 prompts x n=2: prompt 0's first sample is empty (its second is taken), prompt 1 has none, prompt 2's first
    prompts = [[1], [1], [2, 2], [2, 2], [3, 3, 3], [3, 3, 3]]
    responses = [[], [10, 11], [], [], [12], [13, 14]]
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    probe = draw_probe(batch_of(prompts, responses), groups, size=4)
    assert probe.prompt_ids.tolist() == [1, 3, 3, 3] and probe.prompt_lens.tolist() == [1, 3]
    assert probe.response_ids.tolist() == [10, 11, 12] and probe.response_lens.tolist() == [2, 1]
    assert probe.loss_mask is None  # every response token is compared
    assert draw_probe(batch_of(prompts, responses), groups, size=1).response_ids.tolist() == [10, 11]
    assert draw_probe(batch_of([[1], [1]], [[], []]), torch.tensor([0, 0]), size=4) is None


def test_the_probe_of_a_batch_whose_trajectories_went_on_in_new_samples_takes_one_sample_of_each_prompt():
    # prompt 0: one trajectory of 3 samples, one of 1; prompt 1: two of 1 (5 + 1 samples, not n=2 per prompt)
    prompts = [[1], [1, 5], [1, 5, 6], [1], [2, 2], [2, 2]]
    responses = [[10], [11], [12], [13], [], [14]]
    probe = draw_probe(batch_of(prompts, responses), torch.tensor([0, 0, 0, 0, 1, 1]), size=4)
    assert probe.prompt_ids.tolist() == [1, 2, 2] and probe.response_ids.tolist() == [10, 14]


def test_a_rollout_is_held_to_the_run_s_tolerances_else_those_measured_for_its_engine_and_dtype():
    assert tolerance_for("hf", "float32", DEFAULTS) == MEASURED[("hf", "float32")]
    assert tolerance_for("vllm", "bfloat16", DEFAULTS) == MEASURED[("vllm", "bfloat16")]
    assert tolerance_for("other", "float32", DEFAULTS) == MEASURED[("vllm", "bfloat16")]  # unknown: the widest
    set_mean = WeightCheckSettings(sequences=4, tolerance_mean=0.125, tolerance_max=None)
    hf = MEASURED[("hf", "float32")]
    assert tolerance_for("hf", "float32", set_mean) == Tolerance(0.125, hf.max, hf.topk_kl)
    every = WeightCheckSettings(sequences=4, tolerance_mean=0.125, tolerance_max=2.0, tolerance_topk_kl=0.5)
    assert tolerance_for("vllm", "bfloat16", every) == Tolerance(0.125, 2.0, 0.5)


def test_a_mixture_of_experts_in_bf16_has_a_top_k_kl_tolerance_of_its_own(tmp_path):
    """Each engine routes the probe by its own routers, and a flipped expert moves a token's distribution."""
    moe = WeightCheckSettings(sequences=4, tolerance_mean=None, tolerance_max=None, mixture_of_experts=True)
    dense = tolerance_for("vllm", "bfloat16", DEFAULTS)
    assert tolerance_for("vllm", "bfloat16", moe) == dense._replace(topk_kl=MOE_TOPK_KL["bfloat16"])
    assert MOE_TOPK_KL["bfloat16"] > dense.topk_kl
    assert tolerance_for("hf", "float32", moe) == MEASURED[("hf", "float32")]  # fp32: none flip on one CPU
    set_kl = WeightCheckSettings(sequences=4, tolerance_mean=None, tolerance_max=None, tolerance_topk_kl=0.5,
                                 mixture_of_experts=True)
    assert tolerance_for("vllm", "bfloat16", set_kl).topk_kl == 0.5
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 8}))
    assert is_mixture_of_experts(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_experts": 0}))
    assert not is_mixture_of_experts(str(tmp_path)) and not is_mixture_of_experts(str(tmp_path / "missing"))


def test_a_probe_passes_only_with_its_mean_its_max_and_its_top_k_kl_within_the_tolerance():
    tolerance = Tolerance(mean=0.01, max=0.1, topk_kl=0.001)

    def result(mean: float, largest: float, kl: float = 0.0) -> ProbeResult:
        return ProbeResult(address="r:1", version=3, diff=LogprobDiff(mean, largest), kl=DistributionDiff(kl, 5 * kl),
                           tolerance=tolerance)

    assert result(0.01, 0.1, 0.001).passed  # on the bounds
    assert not result(0.011, 0.05).passed and not result(0.005, 0.11).passed
    assert not result(0.005, 0.05, 0.0011).passed  # the sampled tokens within, the distributions not
    assert not result(math.inf, math.inf).passed
    assert result(0.02, 0.5, 0.002).described() == (
        "its weight probe of version 3: mean |delta logprob| 0.02, max 0.5; tolerance 0.01 mean, 0.1 max; "
        "top-k KL mean 0.002, max 0.01; tolerance 0.001 mean")
    refused = ProbeResult(address="r:1", version=3, diff=LogprobDiff(math.inf, math.inf),
                          kl=DistributionDiff(math.inf, math.inf), tolerance=tolerance,
                          error="it serves weight version 2")
    assert not refused.passed and "could not score the weight probe of version 3" in refused.described()


def test_a_checkpoint_keeps_the_probe_and_a_resumed_run_checks_with_the_same_one():
    probe = WeightProbe(DEFAULTS, "float32", actor=None, timeout_s=1.0)
    assert probe.state() is None  # not drawn yet: a resumed run draws it anew
    probe.draw(batch_of([[1, 2], [3]], [[4, 5, 6], [7]]), torch.tensor([0, 1]))
    state = json.loads(json.dumps(probe.state()))  # as the run DB keeps it
    assert state == {"prompts": [[1, 2], [3]], "responses": [[4, 5, 6], [7]]}
    resumed = WeightProbe(DEFAULTS, "float32", actor=None, timeout_s=1.0)
    resumed.restore(state)
    for key in ("prompt_ids", "prompt_lens", "response_ids", "response_lens"):
        assert torch.equal(getattr(resumed.sequences, key), getattr(probe.sequences, key)), key
    resumed.draw(batch_of([[9]], [[9]]), torch.tensor([0]))  # drawn once: a later batch does not replace it
    assert resumed.sequences.prompt_ids.tolist() == [1, 2, 3]


def test_logprobs_are_read_from_the_top_tokens_only_where_every_id_is_among_them():
    top_ids = torch.tensor([[7, 3, 9], [2, 8, 5]])
    top_logprobs = torch.tensor([[-0.25, -1.0, -2.0], [-0.5, -0.75, -3.0]])
    assert logprobs_at(torch.tensor([[9, 7], [5, 2]]), top_ids, top_logprobs).tolist() == [[-2.0, -0.25], [-3.0, -0.5]]
    assert logprobs_at(torch.tensor([[9, 7], [5, 4]]), top_ids, top_logprobs) is None  # 4 is not in row 1's top
    assert logprobs_at(torch.tensor([[3], [3]]), top_ids, top_logprobs) is None  # 3 is in row 0's top, not row 1's
    assert logprobs_at(torch.zeros((0, 2), dtype=torch.int64), top_ids[:0], top_logprobs[:0]).shape == (0, 2)
    with pytest.raises(ValueError, match="positions"):
        logprobs_at(torch.tensor([[9, 7]]), top_ids, top_logprobs)


class AskedRollout:
    """A rollout that answers only once ``count`` calls of the check (every rollout's, and the actor's top) have
    been made (their scoring is tested on real services), so a check that asked one after another would wait for
    ever. Its top-2 at every position: ids (offset, offset + 1) with probabilities 0.5 and 0.25."""

    def __init__(self, address: str, everyone: asyncio.Event, asked: list[str], count: int, offset: int):
        self.address, self.everyone, self.asked, self.count, self.offset = address, everyone, asked, count, offset

    async def compute_log_probs(self, batch: SequenceBatch, timeout: float, *, top_k: int = 0) -> RolloutScores:
        self.asked.append(self.address)
        if len(self.asked) >= self.count:
            self.everyone.set()
        await asyncio.wait_for(self.everyone.wait(), timeout=30)
        tokens = batch.num_response_tokens
        return RolloutScores(version=3, logprobs=torch.full((tokens,), -0.5),
                             top_ids=torch.tensor([[self.offset, self.offset + 1]] * tokens),
                             top_logprobs=torch.tensor([[0.5, 0.25]] * tokens).log())


def actor_logprob(ids: torch.Tensor) -> torch.Tensor:
    """The actor's logprob of next token id i: log(0.5) for even i, log(0.125) for odd."""
    return torch.where(ids % 2 == 0, torch.tensor(0.5), torch.tensor(0.125)).log()


class AskedActor:
    """The actor: the logprob of each token -0.5, of next token id i ``actor_logprob(i)``; its top tokens are ids 0
    to ``top_width`` - 1, the even ones first."""

    def __init__(self, asked: list[str], everyone: asyncio.Event | None = None, count: int = 0, top_width: int = 30):
        self.asked, self.everyone, self.count, self.top_width = asked, everyone, count, top_width
        self.candidates: list[tuple[torch.Tensor, float]] = []
        self.tops: list[tuple[int, float]] = []

    async def compute_top_log_probs(self, batch: SequenceBatch, top_k: int, *, timeout: float,
                                    temperature: float = 0.0) -> TrainerTop:
        self.asked.append("actor top")
        self.tops.append((top_k, temperature))
        if self.everyone is not None and len(self.asked) >= self.count:
            self.everyone.set()
        tokens = batch.num_response_tokens
        ids = torch.cat([torch.arange(0, self.top_width, 2), torch.arange(1, self.top_width, 2)])
        return TrainerTop(logprobs=torch.full((tokens,), -0.5), top_logprobs=actor_logprob(ids).repeat(tokens, 1),
                          top_ids=ids.repeat(tokens, 1))

    async def compute_candidate_log_probs(self, batch: SequenceBatch, candidate_ids: torch.Tensor, *,
                                          timeout: float, temperature: float = 0.0):
        self.asked.append("actor ids")
        self.candidates.append((candidate_ids, temperature))
        return torch.full((batch.num_response_tokens,), -0.5), actor_logprob(candidate_ids)


# rollout p = (0.5, 0.25 | tail 0.25), actor q = (0.5, 0.125 | tail 0.375), by hand:
# 0.25 ln 2 + 0.25 ln(2/3) = 0.25 ln(4/3)
HAND_KL = 0.25 * math.log(4 / 3)


def test_the_rollouts_and_the_actor_are_asked_at_once_and_the_kl_read_from_the_actor_s_top():
    asked: list[str] = []
    everyone = asyncio.Event()
    actor = AskedActor(asked, everyone, count=4)
    probe = WeightProbe(DEFAULTS, "float32", actor=actor, timeout_s=30.0)
    probe.draw(batch_of([[1, 2], [3]], [[4, 5, 6], [7]]), torch.tensor([0, 1]))
    rollouts = [AskedRollout(f"r:{i}", everyone, asked, count=4, offset=10 * i) for i in range(3)]
    results = asyncio.run(probe.check(rollouts, {"r:0": "hf", "r:1": "hf", "r:2": "hf"}, version=3))
    assert sorted(asked) == ["actor top", "r:0", "r:1", "r:2"]  # every rollout's ids (0 to 21) in the actor's top
    assert actor.tops == [(DEFAULTS.top_k * TRAINER_TOP_FACTOR, 1.0)] and not actor.candidates
    assert [r.address for r in results] == ["r:0", "r:1", "r:2"]
    assert all(r.diff == LogprobDiff(0.0, 0.0) and r.seconds > 0 and not r.asked_ids for r in results)
    for result in results:
        assert result.kl.mean == pytest.approx(HAND_KL) and result.kl.max == result.kl.mean
    assert all(not r.passed for r in results)  # 0.072, far over the fp32 tolerance


def test_a_rollout_with_an_id_outside_the_actor_s_top_has_the_actor_asked_for_its_ids_and_the_same_kl():
    asked: list[str] = []
    everyone = asyncio.Event()
    actor = AskedActor(asked, everyone, count=3, top_width=30)
    probe = WeightProbe(DEFAULTS, "float32", actor=actor, timeout_s=30.0)
    probe.draw(batch_of([[1, 2], [3]], [[4, 5, 6], [7]]), torch.tensor([0, 1]))
    rollouts = [AskedRollout("r:0", everyone, asked, count=3, offset=0),
                AskedRollout("r:1", everyone, asked, count=3, offset=40)]  # ids 40 and 41: outside
    inside, outside = asyncio.run(probe.check(rollouts, {}, version=3))
    assert sorted(asked[:3]) == ["actor top", "r:0", "r:1"] and asked[3:] == ["actor ids"]
    [(candidates, temperature)] = actor.candidates
    assert candidates.tolist() == [[40, 41]] * 4 and temperature == 1.0  # the outside rollout's ids alone
    assert not inside.asked_ids and outside.asked_ids
    assert inside.kl.mean == pytest.approx(HAND_KL) and outside.kl.mean == pytest.approx(HAND_KL)


def test_the_actor_s_answer_is_kept_for_its_version_and_asked_again_for_another_or_after_a_failure():
    asked: list[str] = []
    everyone = asyncio.Event()
    everyone.set()
    actor = AskedActor(asked)
    probe = WeightProbe(DEFAULTS, "float32", actor=actor, timeout_s=30.0)
    probe.draw(batch_of([[1, 2]], [[4, 5]]), torch.tensor([0]))
    rollout = AskedRollout("r:0", everyone, asked, count=1, offset=0)

    async def checks() -> None:
        await probe.check([rollout], {}, version=3)
        await probe.check([rollout], {}, version=3)  # a re-check after a re-sync
        assert asked.count("actor top") == 1
        await probe.check([rollout], {}, version=4)  # (the rollout answers 3: it fails, not compared)
        assert asked.count("actor top") == 2

        async def broken(*args, **kwargs):
            raise ConnectionError("trainer gone")

        working, actor.compute_top_log_probs = actor.compute_top_log_probs, broken
        with pytest.raises(ConnectionError):
            await probe.check([rollout], {}, version=5)
        actor.compute_top_log_probs = working
        [result] = await probe.check([rollout], {}, version=5)  # asked again, not the failure kept
        assert asked.count("actor top") == 3 and result.error == "it serves weight version 3"

    asyncio.run(checks())


def test_a_rollout_that_fails_or_serves_another_version_is_not_compared_and_fails():
    asked: list[str] = []
    everyone = asyncio.Event()
    actor = AskedActor(asked, everyone, count=4)
    probe = WeightProbe(DEFAULTS, "float32", actor=actor, timeout_s=30.0)
    probe.draw(batch_of([[1, 2]], [[4, 5]]), torch.tensor([0]))

    class Stale(AskedRollout):
        async def compute_log_probs(self, batch, timeout, *, top_k=0):
            return dataclasses.replace(await super().compute_log_probs(batch, timeout, top_k=top_k), version=2)

    class Broken(AskedRollout):
        async def compute_log_probs(self, batch, timeout, *, top_k=0):
            await super().compute_log_probs(batch, timeout, top_k=top_k)
            raise ValueError("no top-k")

    rollouts = [AskedRollout("r:0", everyone, asked, 4, 40), Stale("r:1", everyone, asked, 4, 50),
                Broken("r:2", everyone, asked, 4, 60)]
    honest, stale, broken = asyncio.run(probe.check(rollouts, {}, version=3))
    assert actor.candidates[0][0].tolist() == [[40, 41]] * 2  # the honest rollout's alone
    assert honest.kl.mean == pytest.approx(HAND_KL) and not honest.error
    assert stale.error == "it serves weight version 2" and stale.kl.mean == math.inf and not stale.passed
    assert "no top-k" in broken.error and not broken.passed
