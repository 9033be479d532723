"""CPU tests of services/coordinator/fleet/weight_probe.py: which samples make the probe, the tolerance a rollout
is held to, when a probe passes, and that the rollouts of a sync and the actor are asked at once."""

from __future__ import annotations

import asyncio
import json
import math

import torch

from services.algos import LogprobDiff
from services.common.sequences import SequenceBatch
from services.coordinator.settings import WeightCheckSettings
from services.coordinator.fleet.weight_probe import MEASURED, ProbeResult, Tolerance, WeightProbe, draw_probe, tolerance_for

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
    assert tolerance_for("hf", "float32", set_mean) == Tolerance(0.125, MEASURED[("hf", "float32")].max)
    both = WeightCheckSettings(sequences=4, tolerance_mean=0.125, tolerance_max=2.0)
    assert tolerance_for("vllm", "bfloat16", both) == Tolerance(0.125, 2.0)


def test_a_probe_passes_only_with_its_mean_and_its_max_within_the_tolerance():
    tolerance = Tolerance(mean=0.01, max=0.1)

    def result(mean: float, largest: float) -> ProbeResult:
        return ProbeResult(address="r:1", version=3, diff=LogprobDiff(mean, largest), tolerance=tolerance)

    assert result(0.01, 0.1).passed  # on the bounds
    assert not result(0.011, 0.05).passed and not result(0.005, 0.11).passed
    assert not result(math.inf, math.inf).passed
    assert result(0.02, 0.5).described() == ("its weight probe of version 3: mean |delta logprob| 0.02, max 0.5; "
                                             "tolerance 0.01 mean, 0.1 max")
    refused = ProbeResult(address="r:1", version=3, diff=LogprobDiff(math.inf, math.inf), tolerance=tolerance,
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


class Everyone:
    """Stands in for the rollouts and the actor (their scoring is tested on real services): each answers only once
    every one of them has been asked, so a check that asked them one after another would wait for ever."""

    def __init__(self, count: int):
        self.count, self.asked, self.all_asked = count, [], asyncio.Event()

    async def answer(self, name: str, tokens: int) -> torch.Tensor:
        self.asked.append(name)
        if len(self.asked) == self.count:
            self.all_asked.set()
        await asyncio.wait_for(self.all_asked.wait(), timeout=30)
        return torch.full((tokens,), -0.5)


class AskedRollout:
    def __init__(self, address: str, everyone: Everyone):
        self.address, self.everyone = address, everyone

    async def compute_log_probs(self, batch: SequenceBatch, timeout: float):
        return 3, await self.everyone.answer(self.address, batch.num_response_tokens)


class AskedActor:
    def __init__(self, everyone: Everyone):
        self.everyone = everyone

    async def compute_log_probs(self, batch: SequenceBatch, step: int, timeout: float, temperature: float = 0.0):
        return await self.everyone.answer("actor", batch.num_response_tokens)


def test_the_rollouts_of_a_sync_and_the_actor_are_asked_at_once():
    everyone = Everyone(count=4)
    probe = WeightProbe(DEFAULTS, "float32", actor=AskedActor(everyone), timeout_s=30.0)
    probe.draw(batch_of([[1, 2], [3]], [[4, 5, 6], [7]]), torch.tensor([0, 1]))
    rollouts = [AskedRollout(f"r:{i}", everyone) for i in range(3)]
    results = asyncio.run(probe.check(rollouts, {"r:0": "hf", "r:1": "hf", "r:2": "hf"}, version=3))
    assert sorted(everyone.asked) == ["actor", "r:0", "r:1", "r:2"]
    assert [r.address for r in results] == ["r:0", "r:1", "r:2"] and all(r.passed for r in results)
    assert all(r.diff == LogprobDiff(0.0, 0.0) and r.seconds > 0 for r in results)
