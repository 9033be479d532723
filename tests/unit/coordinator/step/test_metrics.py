"""CPU tests of services/coordinator/step/metrics.py: step metrics under verl's names, against numbers by hand."""

from __future__ import annotations

import collections
import itertools
import math
import statistics

import pytest
import torch

from services.algos import mismatch_metrics, summary
from services.coordinator.step.metrics import (PromptResults, best_of_k, data_metrics, majority_of_k, pass_at_k,
                                          rollout_balance, sample_counts, throughput, validation_metrics, worst_of_k)


def test_throughput_is_per_device_by_hand():
    # 32 prompts x 8 samples x (64 prompt + 256 response tokens) = 81,920 tokens in 5.12 s: 16,000 tokens/s,
    # 8,000 per GPU on two (trainer and rollout on one each), 16,000 colocated on one
    assert throughput(81920, 5.12, 2) == pytest.approx(8000.0)
    assert throughput(81920, 5.12, 1) == pytest.approx(16000.0)
    # a CPU run of one trainer and two rollouts: 3 processes; 900 tokens in 2 s -> 150 per process
    assert throughput(900, 2.0, 3) == pytest.approx(150.0)


def test_rollout_balance_by_hand():
    counts = {"rollout/samples_by/a:1": 48.0, "rollout/samples_by/b:2": 16.0, "reward/samples_by/r": 64.0}
    assert rollout_balance(counts, {"a:1": 300.0, "b:2": 100.0, "gone:3": 5.0}) == {
        "rollout/share/a:1": 0.75, "rollout/share/b:2": 0.25,
        "rollout/tokens_per_s/a:1": 300.0, "rollout/tokens_per_s/b:2": 100.0}
    assert rollout_balance({"rollout/samples_by/a:1": 8.0}, {}) == {"rollout/share/a:1": 1.0}  # not yet measured


def test_summary_by_hand():
    assert summary("x", torch.tensor([1, 2, 6])) == {"x/mean": 3.0, "x/max": 6.0, "x/min": 1.0}
    assert summary("x", torch.tensor([], dtype=torch.int64)) == {"x/mean": 0.0, "x/max": 0.0, "x/min": 0.0}
    assert summary("y", torch.tensor([True, False, False, True])) == {"y/mean": 0.5, "y/max": 1.0, "y/min": 0.0}


def test_data_metrics_by_hand():
    # two sequences: 2 tokens and 1 token
    metrics = data_metrics(
        scores=torch.tensor([1.0, 0.0]),
        rewards=torch.tensor([0.0, 1.0, -0.5]),  # sequence sums: 1.0 and -0.5
        advantages=torch.tensor([0.5, -1.5, 1.0]),
        returns=torch.tensor([2.0, 1.0, 0.0]),
        values=torch.tensor([1.0, 1.0, 0.0]),
        response_lens=torch.tensor([2, 1]),
        prompt_lens=torch.tensor([4, 6]),
        truncated=torch.tensor([False, True]),
        rollout_logprobs=torch.log(torch.tensor([0.5, 0.25, 0.9])),
        old_logprobs=torch.log(torch.tensor([0.4, 0.25, 0.6])),
    )
    expected = {
        "critic/score/mean": 0.5, "critic/score/max": 1.0, "critic/score/min": 0.0,
        "critic/rewards/mean": 0.25, "critic/rewards/max": 1.0, "critic/rewards/min": -0.5,
        "critic/advantages/mean": 0.0, "critic/advantages/max": 1.0, "critic/advantages/min": -1.5,
        "critic/returns/mean": 1.0, "critic/returns/max": 2.0, "critic/returns/min": 0.0,
        "critic/values/mean": 2 / 3, "critic/values/max": 1.0, "critic/values/min": 0.0,
        # returns - values = [1, 0, 0]: unbiased var 1/3; var(returns) = 1 -> 1 - (1/3) / 1
        "critic/vf_explained_var": 2 / 3,
        "response_length/mean": 1.5, "response_length/max": 2.0, "response_length/min": 1.0,
        "response_length/clip_ratio": 0.5,
        "prompt_length/mean": 5.0, "prompt_length/max": 6.0, "prompt_length/min": 4.0,
        # |0.5 - 0.4| = 0.1, |0.25 - 0.25| = 0, |0.9 - 0.6| = 0.3; unbiased var (0.01 + 0.09 - 3 (0.4/3)^2) / 2 = 7/300
        "training/rollout_probs_diff_mean": (0.1 + 0.0 + 0.3) / 3,
        "training/rollout_probs_diff_max": 0.3,
        "training/rollout_probs_diff_std": math.sqrt(7 / 300),
        # centred rollout probs [-1, -6, 7] / 20, old probs [-1, -10, 11] / 60:
        # sum of products 138 / 1200, sums of squares 86 / 400 and 222 / 3600 -> 138 / sqrt(86 * 222)
        "training/rollout_actor_probs_pearson_corr": 138 / math.sqrt(86 * 222),
        # ratios pi_old / pi_rollout r = [0.8, 1, 2/3]; k3 = r - ln r - 1, summed: 37/15 - 3 - ln(0.8 * 2/3)
        "training/rollout_mismatch_kl": (-8 / 15 - math.log(8 / 15)) / 3,
        "training/rollout_is_ratio/mean": (0.8 + 1 + 2 / 3) / 3, "training/rollout_is_ratio/max": 1.0,
        "training/rollout_is_ratio/min": 2 / 3,
        # per response: 0.8 * 1 and 2/3
        "training/rollout_is_seq_ratio/mean": (0.8 + 2 / 3) / 2, "training/rollout_is_seq_ratio/max": 0.8,
        "training/rollout_is_seq_ratio/min": 2 / 3,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key


def test_data_metrics_with_a_loss_mask_count_the_model_tokens_only():
    # the second token of the first response is a tool's, with wild numbers that must not show
    tensors = {"scores": torch.tensor([1.0, 0.0]), "rewards": torch.tensor([0.0, 0.0, 1.0, -0.5]),
               "advantages": torch.tensor([0.5, 99.0, -1.5, 1.0]), "returns": torch.tensor([2.0, 99.0, 1.0, 0.0]),
               "values": torch.tensor([1.0, 99.0, 1.0, 0.0]), "response_lens": torch.tensor([3, 1]),
               "prompt_lens": torch.tensor([4, 6]), "truncated": torch.tensor([False, True]),
               "rollout_logprobs": torch.log(torch.tensor([0.5, 1e-9, 0.25, 0.9])),
               "old_logprobs": torch.log(torch.tensor([0.4, 0.99, 0.25, 0.6]))}
    masked = data_metrics(**tensors, loss_mask=torch.tensor([True, False, True, True]))
    model = torch.tensor([True, False, True, True])
    plain = data_metrics(**{**tensors, **{key: tensors[key][model] for key in (
        "rewards", "advantages", "returns", "values", "rollout_logprobs", "old_logprobs")},
        "response_lens": torch.tensor([2, 1])})
    lengths = {key for key in masked if key.startswith("response_length/")}
    assert masked["response_length/max"] == 3.0  # the whole response, tool tokens too: what max_response_length caps
    assert {key: masked[key] for key in masked.keys() - lengths} == pytest.approx(
        {key: plain[key] for key in plain.keys() - lengths}, abs=1e-6)


def test_data_metrics_of_an_empty_step_are_zero():
    empty, lengths = torch.tensor([]), torch.tensor([], dtype=torch.int64)
    metrics = data_metrics(empty, empty, empty, returns=empty, values=None, response_lens=lengths, prompt_lens=lengths,
                           truncated=torch.tensor([], dtype=torch.bool),
                           rollout_logprobs=empty, old_logprobs=empty)
    assert all(value == 0.0 and not math.isnan(value) for value in metrics.values())


def test_mismatch_metrics_random_against_independent_reference():
    generator = torch.Generator().manual_seed(5)
    lengths = torch.tensor([3, 0, 5, 1, 4])
    rollout = -torch.rand(13, generator=generator, dtype=torch.float64) * 3
    old = rollout + 0.3 * torch.randn(13, generator=generator, dtype=torch.float64)
    metrics = mismatch_metrics(rollout, old, lengths)
    p_rollout, p_old = [math.exp(v) for v in rollout.tolist()], [math.exp(v) for v in old.tolist()]
    diffs = [abs(a - b) for a, b in zip(p_rollout, p_old)]
    ratios = [b / a for a, b in zip(p_rollout, p_old)]
    seq_ratios, start = [], 0
    for n in lengths.tolist():
        if n:
            seq_ratios.append(math.prod(ratios[start:start + n]))
        start += n
    expected = {
        "training/rollout_probs_diff_mean": statistics.fmean(diffs), "training/rollout_probs_diff_max": max(diffs),
        "training/rollout_probs_diff_std": statistics.stdev(diffs),
        "training/rollout_actor_probs_pearson_corr": statistics.correlation(p_rollout, p_old),
        "training/rollout_mismatch_kl": statistics.fmean(r - math.log(r) - 1 for r in ratios),
        "training/rollout_is_ratio/mean": statistics.fmean(ratios), "training/rollout_is_ratio/max": max(ratios),
        "training/rollout_is_ratio/min": min(ratios),
        "training/rollout_is_seq_ratio/mean": statistics.fmean(seq_ratios),
        "training/rollout_is_seq_ratio/max": max(seq_ratios), "training/rollout_is_seq_ratio/min": min(seq_ratios),
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-6, abs=1e-12), key  # summary() is fp32


def test_mismatch_metrics_of_identical_policies():
    logprobs = torch.log(torch.tensor([0.5, 0.25, 0.9, 0.1], dtype=torch.float64))
    metrics = mismatch_metrics(logprobs, logprobs.clone(), torch.tensor([1, 3]))
    assert metrics["training/rollout_probs_diff_max"] == 0.0 and metrics["training/rollout_mismatch_kl"] == 0.0
    assert metrics["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert all(metrics[f"training/rollout_is_{level}/{stat}"] == 1.0
               for level in ("ratio", "seq_ratio") for stat in ("mean", "max", "min"))
    # a single token: no spread, so no correlation
    one = mismatch_metrics(logprobs[:1], logprobs[:1], torch.tensor([1]))
    assert one["training/rollout_actor_probs_pearson_corr"] == 0.0


# ---------------------------------------------------------------------------
# validation metrics (verl's val-core / val-aux), against numbers worked out by hand


def test_sample_counts_double_up_to_n():
    assert [sample_counts(n) for n in (1, 2, 4, 5, 8)] == [[], [2], [2, 4], [2, 4, 5], [2, 4, 8]]


def test_best_and_worst_of_k_by_hand():
    # two draws from {0, 1} with replacement: the best is 1 unless both draws are 0 (1/4)
    assert best_of_k([0.0, 1.0], 2) == pytest.approx((0.75, math.sqrt(0.75 - 0.75 ** 2)))
    assert worst_of_k([1.0, 0.0], 2) == pytest.approx((0.25, math.sqrt(0.75 - 0.75 ** 2)))
    # {0.2, 0.5, 0.9}, k = 2: the best is 0.2 w.p. 1/9, 0.5 w.p. 3/9, 0.9 w.p. 5/9
    mean = (0.2 * 1 + 0.5 * 3 + 0.9 * 5) / 9
    second = (0.04 * 1 + 0.25 * 3 + 0.81 * 5) / 9
    assert best_of_k([0.9, 0.2, 0.5], 2) == pytest.approx((mean, math.sqrt(second - mean ** 2)))
    assert best_of_k([0.3, 0.7], 1) == pytest.approx((0.5, 0.2))  # one draw: the mean, and the values' spread


def test_best_of_k_against_enumerating_every_draw():
    values, k = [0.1, 0.4, 0.4, 1.0], 3
    draws = list(itertools.product(values, repeat=k))
    best = [max(d) for d in draws]
    assert best_of_k(values, k) == pytest.approx((statistics.fmean(best), statistics.pstdev(best)))


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3, 2) / C(4, 2) of the pairs miss it
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0


def majority_by_enumeration(values: list[float], preds: list[str], k: int) -> float:
    """The expected majority value over every equally likely draw of k (the tie rule: first read wins)."""
    order = list(dict.fromkeys(preds))
    total = 0.0
    for draw in itertools.product(range(len(values)), repeat=k):
        counts = collections.Counter(preds[i] for i in draw)
        winner = max(order, key=lambda answer: (counts[answer], -order.index(answer)))
        total += values[preds.index(winner)]
    return total / len(values) ** k


@pytest.mark.parametrize(("values", "preds", "k"), [
    ([1.0, 1.0, 0.0], ["a", "a", "b"], 1),
    ([1.0, 0.0, 0.0, 1.0], ["7", "8", "8", "7"], 3),
    ([0.0, 1.0, 0.5], ["x", "y", "z"], 2),
])
def test_majority_of_k_is_the_enumerated_expectation_within_bootstrap_noise(values, preds, k):
    mean, std = majority_of_k(values, preds, k)
    assert mean == pytest.approx(majority_by_enumeration(values, preds, k), abs=0.05)
    assert majority_of_k(values, preds, k) == (mean, std)  # seeded: the same every time
    assert majority_of_k([0.5] * 3, ["same"] * 3, 2) == (0.5, 0.0)


def test_validation_metrics_by_hand():
    results = [PromptResults(data_source="src", scores=[1.0, 0.0], accs=[True, False], preds=["3", "4"]),
               PromptResults(data_source="src", scores=[1.0, 1.0], accs=[True, True], preds=["3", "3"]),
               PromptResults(data_source="rm", scores=[0.25], accs=None, preds=[""])]
    metrics = validation_metrics(results)
    # src: prompt 1 has mean 0.5, best of 2 0.75, worst of 2 0.25, pass@1 0.5, pass@2 1; prompt 2 all 1
    assert metrics["val-core/src/reward/mean@2"] == 0.75 and metrics["val-core/src/acc/mean@2"] == 0.75
    assert metrics["val-core/src/reward/best@2/mean"] == pytest.approx(0.875)
    assert metrics["val-aux/src/reward/worst@2/mean"] == pytest.approx(0.625)
    assert metrics["val-aux/src/reward/std@2"] == pytest.approx(0.25)
    assert metrics["val-aux/src/acc/pass@1"] == 0.75 and metrics["val-aux/src/acc/pass@2"] == 1.0
    # maj@2 of prompt 1: draws 33 -> 1, 44 -> 0, 34 and 43 tie -> "3" (read first) -> 1: 3/4; prompt 2: 1
    assert metrics["val-core/src/acc/maj@2/mean"] == pytest.approx(0.875, abs=0.03)
    assert "val-aux/src/reward/pass@1" not in metrics  # pass@k counts right answers: acc only
    # a reward model's source: one response, no answers read or judged
    assert {k: v for k, v in metrics.items() if "/rm/" in k} == {"val-core/rm/reward/mean@1": 0.25}
