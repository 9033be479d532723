"""The advantage estimators added to verl's first five (opo, gpg, grpo_passk, remax), through the registry as the
coordinator calls them, in float64 against references written here a different way: plain Python loops over
each group and each response, on lists. Random ragged batches with a loss mask (one response entirely masked),
a group of one response, tied best scores; and small cases worked by hand."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from services import algos, estimators
from services.algo_registry import EstimatorInputs, EstimatorParams

F64 = torch.float64


def run(name: str, scores: list[float], lengths: list[int], groups: list[int], mask: list[bool] | None = None,
        baselines: list[float] | None = None, norm_by_std: bool = True) -> algos.Advantages:
    lengths_t = torch.tensor(lengths)
    mask_t = None if mask is None else torch.tensor(mask)
    rewards = torch.zeros(sum(lengths), dtype=F64)  # each score on its response's last model token
    last = algos.last_token_index(lengths_t) if mask_t is None else algos.last_trained_index(lengths_t, mask_t)
    rewards[last] = torch.tensor(scores, dtype=F64)[lengths_t > 0]
    inputs = EstimatorInputs(rewards=rewards, lengths=lengths_t, group_ids=torch.tensor(groups), mask=mask_t,
                             values=None, baselines=None if baselines is None else torch.tensor(baselines, dtype=F64))
    return estimators.compute_advantages(name, inputs, EstimatorParams(1.0, 1.0, norm_by_std))


def spread(per_response: list[float], lengths: list[int], mask: list[bool] | None) -> list[float]:
    """Each response's value on each of its tokens in the mask, 0 on the others."""
    out, start = [], 0
    for value, n in zip(per_response, lengths):
        out += [value if mask is None or mask[start + t] else 0.0 for t in range(n)]
        start += n
    return out


def random_batch(seed: int) -> dict:
    """Ragged responses in groups of 1 to 5 (one group of one), 0/1 and fractional scores, a loss mask with one
    response entirely masked."""
    rng = random.Random(seed)
    sizes = [1] + [rng.randint(2, 5) for _ in range(rng.randint(2, 4))]
    rng.shuffle(sizes)
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    lengths = [rng.randint(1, 7) for _ in groups]
    scores = [rng.choice([0.0, 1.0, rng.uniform(-1, 2)]) for _ in groups]
    mask = [rng.random() < 0.8 for _ in range(sum(lengths))]
    fully_masked = rng.randrange(len(groups))
    start = sum(lengths[:fully_masked])
    mask[start:start + lengths[fully_masked]] = [False] * lengths[fully_masked]
    return {"scores": scores, "lengths": lengths, "groups": groups, "mask": mask}


def members(groups: list[int]) -> dict[int, list[int]]:
    by_group: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    return by_group


def model_tokens(lengths: list[int], mask: list[bool] | None) -> list[int]:
    counts, start = [], 0
    for n in lengths:
        counts.append(n if mask is None else sum(mask[start:start + n]))
        start += n
    return counts


# ---------------------------------------------------------------- references, group by group


def opo_reference(scores, lengths, groups, mask):
    tokens, out = model_tokens(lengths, mask), [0.0] * len(scores)
    for rows in members(groups).values():
        if len(rows) < 2:
            continue
        weight = sum(tokens[i] for i in rows)
        baseline = sum(tokens[i] * scores[i] for i in rows) / weight if weight else 0.0
        for i in rows:
            out[i] = scores[i] - baseline
    return out


def gpg_reference(scores, groups):
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    out = [0.0] * len(scores)
    for rows in members(groups).values():
        if len(rows) > 1:
            mean = sum(scores[i] for i in rows) / len(rows)
            for i in rows:
                out[i] = alpha * (scores[i] - mean)
    return out


def passk_reference(scores, groups, norm_by_std):
    out = [0.0] * len(scores)
    for rows in members(groups).values():
        if len(rows) < 2:
            continue
        best = rows[0]
        for i in rows:
            if scores[i] > scores[best]:
                best = i
        second = max(scores[i] for i in rows if i != best)
        gap = scores[best] - second
        out[best] = gap / (statistics.stdev([scores[i] for i in rows]) + 1e-6) if norm_by_std else gap
    return out


def remax_reference(scores, lengths, mask, baselines):
    """Per response: the score sits on its last model token (its last token if none), the reward-to-go at a model
    token is the sum of the rewards from it on; advantages are that minus the baseline; both 0 off the mask."""
    advantages, returns, start = [], [], 0
    for score, n, baseline in zip(scores, lengths, baselines):
        trained = [mask is None or mask[start + t] for t in range(n)]
        where = max([t for t in range(n) if trained[t]], default=n - 1)
        rewards = [score if t == where else 0.0 for t in range(n)]
        for t in range(n):
            to_go = sum(rewards[u] for u in range(t, n) if trained[u])
            returns.append(to_go if trained[t] else 0.0)
            advantages.append(to_go - baseline if trained[t] else 0.0)
        start += n
    return advantages, returns


# ---------------------------------------------------------------- by hand


def test_opo_by_hand():
    # one group: scores 1, 0, 1 of lengths 2, 4, 1 -> baseline (2 + 0 + 1) / 7 = 3/7
    out = run("opo", [1.0, 0.0, 1.0], [2, 4, 1], [0, 0, 0])
    assert out.advantages.tolist() == pytest.approx([4 / 7] * 2 + [-3 / 7] * 4 + [4 / 7])
    assert torch.equal(out.returns, out.advantages)


def test_gpg_by_hand():
    # scores 1, 0 | 1, 1 | 0, 0: 3 of 6 non-zero -> alpha 2; centred 0.5, -0.5 | 0, 0 | 0, 0
    out = run("gpg", [1.0, 0.0, 1.0, 1.0, 0.0, 0.0], [1] * 6, [0, 0, 1, 1, 2, 2])
    assert out.advantages.tolist() == pytest.approx([1.0, -1.0, 0, 0, 0, 0])


def test_grpo_passk_by_hand():
    # scores 0, 3, 1: the best (3) gets 3 - 1 = 2, over std 1.5275 with the division; the others 0
    out = run("grpo_passk", [0.0, 3.0, 1.0], [1, 2, 1], [0, 0, 0], norm_by_std=False)
    assert out.advantages.tolist() == pytest.approx([0.0, 2.0, 2.0, 0.0])
    out = run("grpo_passk", [0.0, 3.0, 1.0], [1, 2, 1], [0, 0, 0])
    best = 2 / (1.5275252316519468 + 1e-6)  # std of 0, 3, 1: sqrt(7/3)
    assert out.advantages.tolist() == pytest.approx([0.0, best, best, 0.0], rel=1e-12)


def test_grpo_passk_tied_best_credits_the_first_with_zero():
    out = run("grpo_passk", [1.0, 1.0, 0.0], [1, 1, 1], [0, 0, 0])
    assert out.advantages.tolist() == [0.0, 0.0, 0.0]


def test_remax_by_hand():
    # response of 3 tokens scoring 1 with greedy baseline 0.25: returns 1, 1, 1; advantages 0.75 each
    out = run("remax", [1.0, 0.0], [3, 1], [0, 1], baselines=[0.25, 0.5])
    assert out.returns.tolist() == pytest.approx([1, 1, 1, 0])
    assert out.advantages.tolist() == pytest.approx([0.75, 0.75, 0.75, -0.5])


def test_remax_without_baselines_is_refused():
    with pytest.raises(ValueError, match="remax estimator needs the greedy"):
        run("remax", [1.0], [1], [0])


@pytest.mark.parametrize("name", ["opo", "gpg", "grpo_passk"])
def test_a_group_of_one_gets_no_advantage(name):
    out = run(name, [1.0, 1.0, 0.0], [2, 1, 1], [0, 1, 1])
    assert out.advantages[:2].tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- random ragged batches


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("with_mask", [False, True])
def test_group_estimators_equal_the_loop_references(seed, with_mask):
    case = random_batch(seed)
    mask = case["mask"] if with_mask else None
    scores, lengths, groups = case["scores"], case["lengths"], case["groups"]
    expected = {"opo": opo_reference(scores, lengths, groups, mask), "gpg": gpg_reference(scores, groups),
                "grpo_passk": passk_reference(scores, groups, True)}
    for name, per_response in expected.items():
        out = run(name, scores, lengths, groups, mask)
        expected_tokens = spread(per_response, lengths, mask)
        assert out.advantages.dtype == F64
        assert out.advantages.tolist() == pytest.approx(expected_tokens, rel=1e-12, abs=1e-12), name
        assert out.returns.tolist() == pytest.approx(expected_tokens, rel=1e-12, abs=1e-12), name
    out = run("grpo_passk", scores, lengths, groups, mask, norm_by_std=False)
    assert out.advantages.tolist() == pytest.approx(
        spread(passk_reference(scores, groups, False), lengths, mask), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("with_mask", [False, True])
def test_remax_equals_the_loop_reference(seed, with_mask):
    case = random_batch(seed)
    mask = case["mask"] if with_mask else None
    rng = random.Random(seed + 100)
    baselines = [rng.uniform(-1, 1) for _ in case["scores"]]
    out = run("remax", case["scores"], case["lengths"], case["groups"], mask, baselines)
    advantages, returns = remax_reference(case["scores"], case["lengths"], mask, baselines)
    assert out.advantages.tolist() == pytest.approx(advantages, rel=1e-12, abs=1e-12)
    assert out.returns.tolist() == pytest.approx(returns, rel=1e-12, abs=1e-12)
