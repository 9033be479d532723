"""CPU tests of services/algos.py against hand-worked numbers and independent references.

Every estimator, loss mode and KL estimator gets (1) a small case whose
arithmetic is written out in a comment and (2) a comparison on random inputs
with ragged lengths against a reference written here without calling
``algos``: plain Python loops, or numpy on right-padded ``[B, L]`` arrays with a
``response_mask``, the way verl's core_algos.py does it. The module under test
is padding-free (flat ``[T]`` tensors plus ``lengths [B]``); ``_padded`` and
``_flat`` convert between the two layouts.
"""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
import torch

from services import algos, estimators, policy_losses
from services.algo_registry import EstimatorInputs, EstimatorParams
from services.trainer.optim import Optimizer, OptimSettings

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
F64 = torch.float64


def compute_advantages(name, rewards, lengths, group_ids, values, gamma, lam, norm_by_std, mask=None, baselines=None):
    """The registered estimator ``name`` on these tensors (the coordinator's call)."""
    inputs = EstimatorInputs(rewards=rewards, lengths=lengths, group_ids=group_ids, mask=mask, values=values,
                             baselines=baselines)
    return estimators.compute_advantages(name, inputs, EstimatorParams(gamma, lam, norm_by_std))


# ---------------------------------------------------------------------------
# layout conversion and verl-style padded references (independent of algos)


def _padded(flat, lengths: list[int], width: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat [T] -> right-padded [B, width] values (0 in the padding) and response_mask [B, width]."""
    flat = np.asarray(flat, dtype=np.float64)
    out = np.zeros((len(lengths), width))
    mask = np.zeros((len(lengths), width))
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = flat[start:start + n]
        mask[b, :n] = 1.0
        start += n
    assert start == len(flat)
    return out, mask


def _flat(padded: np.ndarray, lengths: list[int]) -> np.ndarray:
    """Right-padded [B, L] -> flat [T] of the unpadded tokens."""
    return np.array([padded[b, t] for b, n in enumerate(lengths) for t in range(n)], dtype=np.float64)


def _masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    return float((x * mask).sum() / mask.sum())


def _masked_whiten(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """verl's masked_whiten: unbiased masked variance, eps 1e-8 inside the square root."""
    mean = _masked_mean(x, mask)
    n = mask.sum()
    var = _masked_mean((x - mean) ** 2, mask) * n / (n - 1)
    return (x - mean) / math.sqrt(var + 1e-8)


def _ref_gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float):
    """verl's compute_gae_advantage_return on [B, L]: values masked, so V after the last token is 0."""
    values = values * mask
    batch, width = rewards.shape
    advantages = np.zeros((batch, width))
    last = np.zeros(batch)
    for t in reversed(range(width)):
        next_values = values[:, t + 1] if t < width - 1 else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last = delta + gamma * lam * last
        advantages[:, t] = last
    returns = advantages + values
    return _masked_whiten(advantages, mask), returns


def _ref_discounted(rewards: np.ndarray, mask: np.ndarray, gamma: float) -> np.ndarray:
    """verl's REINFORCE++ returns: running = r_t + gamma running, reset outside the response."""
    returns = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return returns


def _ref_agg(loss: np.ndarray, mask: np.ndarray, mode: str) -> float:
    """verl's agg_loss on [B, L]; the padded width is max_response_length."""
    if mode == "token-mean":
        return _masked_mean(loss, mask)
    seq_sums = (loss * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return float(seq_sums.mean())
    if mode == "seq-mean-token-mean":
        return float((seq_sums / mask.sum(-1)).mean())
    if mode == "seq-mean-token-sum-norm":  # verl >= 0.7.1 (PR #5417): a mean over sequences, then / the horizon
        return float(seq_sums.mean() / loss.shape[-1])
    raise AssertionError(mode)


def _ref_agg_weights(mask: np.ndarray, mode: str) -> np.ndarray:
    """d(aggregate)/d(per-token loss) for each [B, L] position."""
    if mode == "token-mean":
        return mask / mask.sum()
    if mode == "seq-mean-token-sum":
        return mask / mask.shape[0]
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdims=True) / mask.shape[0]
    return mask / mask.shape[0] / mask.shape[1]


def _ref_policy(logp, old, adv, mask, low, high, c, mode):
    """verl's compute_policy_loss (vanilla, dual-clip) on [B, L]; also the gradient wrt logp."""
    neg_kl = np.clip(logp - old, -20.0, 20.0)
    ratio = np.exp(neg_kl)
    losses1 = -adv * ratio
    losses2 = -adv * np.clip(ratio, 1 - low, 1 + high)
    clip_losses1 = np.maximum(losses1, losses2)
    clipfrac = _masked_mean((losses2 > losses1).astype(float), mask)
    # the gradient of -A r wrt logp is -A r, and 0 where the clamp (or dual-clip bound) is the active branch
    grad = np.where(losses1 >= losses2, losses1, 0.0)
    if c is None:
        losses, lower = clip_losses1, 0.0
    else:
        losses3 = -adv * c
        lower = _masked_mean(((clip_losses1 > losses3) & (adv < 0)).astype(float), mask)
        losses = np.where(adv < 0, np.minimum(losses3, clip_losses1), clip_losses1)
        grad = np.where((adv < 0) & (clip_losses1 > losses3), 0.0, grad)
    loss = _ref_agg(losses, mask, mode)
    return loss, clipfrac, lower, _masked_mean(-neg_kl, mask), grad * _ref_agg_weights(mask, mode)


def _ref_value(vpreds, old_values, returns, mask, cliprange, mode):
    """verl's compute_value_loss on [B, L]."""
    clipped = np.clip(vpreds, old_values - cliprange, old_values + cliprange)
    losses1 = (vpreds - returns) ** 2
    losses2 = (clipped - returns) ** 2
    loss = 0.5 * _ref_agg(np.maximum(losses1, losses2), mask, mode)
    return loss, _masked_mean((losses2 > losses1).astype(float), mask)


def _group_members(scores: list[float], group_ids: list[int]) -> dict[int, list[float]]:
    members: dict[int, list[float]] = {}
    for score, gid in zip(scores, group_ids):
        members.setdefault(gid, []).append(score)
    return members


def _ragged_lengths(rng: np.random.Generator, batch: int, max_len: int, min_len: int) -> list[int]:
    return [int(n) for n in rng.integers(min_len, max_len + 1, size=batch)]


def _random_groups(rng: random.Random) -> list[int]:
    """Interleaved group ids with ragged group sizes, singletons included."""
    group_ids = []
    for gid in rng.sample(range(1000), rng.randint(1, 8)):
        group_ids += [gid] * rng.randint(1, 7)
    rng.shuffle(group_ids)
    return group_ids


def _t(values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _close(got: torch.Tensor, expected, atol: float = 1e-6, rtol: float = 0.0) -> None:
    torch.testing.assert_close(got.double(), torch.as_tensor(np.asarray(expected, dtype=np.float64)),
                               atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------
# helpers: expand_per_token, sequence_sums, last_token_index, whiten


def test_expand_per_token():
    got = algos.expand_per_token(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2, 0, 3]))
    assert got.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]
    assert algos.expand_per_token(torch.zeros(0), torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_sequence_sums_and_last_token_index_by_hand():
    # tokens [1 | (none) | 2 3 | 4 5 6] -> sums [1, 0, 5, 15]; flat last indices 0, 2, 5 (the empty one is skipped)
    per_token = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    lengths = torch.tensor([1, 0, 2, 3])
    assert algos.sequence_sums(per_token, lengths).tolist() == [1.0, 0.0, 5.0, 15.0]
    assert algos.last_token_index(lengths).tolist() == [0, 2, 5]
    # lengths [2, 0, 3, 1]: cumsum - 1 = [1, 1, 4, 5], the zero-length entry dropped -> [1, 4, 5]
    assert algos.last_token_index(torch.tensor([2, 0, 3, 1])).tolist() == [1, 4, 5]


def test_whiten_by_hand():
    # [1, 2, 3, 4]: mean 2.5, squared deviations 2.25 + .25 + .25 + 2.25 = 5, unbiased var 5/3
    got = algos.whiten(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64))
    s = math.sqrt(5 / 3 + 1e-8)
    _close(got, [-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s], atol=1e-12)
    # constant input: deviations 0 -> 0 (the 1e-8 keeps it finite); one token -> 0; no tokens -> empty
    _close(algos.whiten(torch.tensor([2.0, 2.0, 2.0])), [0.0, 0.0, 0.0], atol=0)
    _close(algos.whiten(torch.tensor([5.0])), [0.0], atol=0)
    assert algos.whiten(torch.zeros(0)).numel() == 0


def test_whiten_random_against_masked_whiten():
    rng = np.random.default_rng(7)
    for _ in range(5):
        lengths = _ragged_lengths(rng, 6, 9, 0)
        flat = rng.normal(2.0, 3.0, sum(lengths))
        padded, mask = _padded(flat, lengths, 9)
        expected = _flat(_masked_whiten(padded, mask), lengths)
        _close(algos.whiten(_t(flat)), expected, atol=1e-10)


# ---------------------------------------------------------------------------
# token_rewards, kl_penalty, adaptive_kl_coef


def test_token_rewards_by_hand():
    # lengths [2, 0, 3]: score 1 on flat token 1, the empty sequence's 5 goes nowhere, -2 on token 4
    scores, lengths = torch.tensor([1.0, 5.0, -2.0]), torch.tensor([2, 0, 3])
    assert algos.token_rewards(scores, lengths).tolist() == [0.0, 1.0, 0.0, 0.0, -2.0]
    # minus 0.5 * kl on every token: kl [.1 .2 .3 .4 .5] -> [-.05, 1 - .1, -.15, -.2, -2 - .25]
    kl = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5])
    got = algos.token_rewards(scores, lengths, kl, kl_coef=0.5)
    _close(got, [-0.05, 0.9, -0.15, -0.2, -2.25])
    assert algos.token_rewards(torch.tensor([3.0]), torch.tensor([0])).numel() == 0


def test_token_rewards_random_against_padded_reference():
    rng = np.random.default_rng(11)
    for _ in range(5):
        lengths = _ragged_lengths(rng, 7, 8, 0)
        scores = rng.normal(size=7)
        kl = rng.normal(size=sum(lengths))
        kl_padded, mask = _padded(kl, lengths, 8)
        # verl: token_level_scores holds the score at the last valid position; rewards = scores - beta * kld * mask
        token_scores = np.zeros((7, 8))
        for b, n in enumerate(lengths):
            if n:
                token_scores[b, n - 1] = scores[b]
        expected = _flat(token_scores - 0.3 * kl_padded * mask, lengths)
        got = algos.token_rewards(_t(scores), torch.tensor(lengths), _t(kl), kl_coef=0.3)
        _close(got, expected, atol=1e-6)


def test_kl_penalty_by_hand():
    logp = _t([-1.0, -2.0])
    ref = _t([-1.5, -1.0])
    # logp - ref = [0.5, -1.0]
    _close(algos.kl_penalty(logp, ref, "kl"), [0.5, -1.0], atol=1e-12)
    _close(algos.kl_penalty(logp, ref, "k1"), [0.5, -1.0], atol=1e-12)
    _close(algos.kl_penalty(logp, ref, "abs"), [0.5, 1.0], atol=1e-12)
    # 0.5 * [0.25, 1.0]
    _close(algos.kl_penalty(logp, ref, "mse"), [0.125, 0.5], atol=1e-12)
    _close(algos.kl_penalty(logp, ref, "k2"), [0.125, 0.5], atol=1e-12)
    # x = ref - logp = [-0.5, 1.0]: e^-0.5 + 0.5 - 1 = 0.1065307, e^1 - 1 - 1 = 0.7182818
    k3 = [math.exp(-0.5) - 0.5, math.e - 2]
    _close(algos.kl_penalty(logp, ref, "low_var_kl"), k3, atol=1e-12)
    _close(algos.kl_penalty(logp, ref, "k3"), k3, atol=1e-12)


def test_kl_penalty_low_var_kl_clamp_engages():
    # x = ref - logp:  2.5 -> e^2.5 - 3.5 = 8.682494 (below 10, untouched)
    #                  5   -> e^5 - 6 = 142.41 -> 10;  -15 -> e^-15 + 14 = 14.0000003 -> 10
    #                  40  -> past the +-20 guard on x; still 10, and finite in fp32
    x = [2.5, 5.0, -15.0, 40.0]
    logp = _t([0.0] * 4)
    got = algos.kl_penalty(logp, _t(x), "low_var_kl")
    _close(got, [math.exp(2.5) - 3.5, 10.0, 10.0, 10.0], atol=1e-12)
    got32 = algos.kl_penalty(torch.zeros(4), torch.tensor(x), "k3")
    assert torch.isfinite(got32).all() and got32[1:].tolist() == [10.0, 10.0, 10.0]


def _ref_kl(logp: float, ref: float, name: str) -> float:
    d = logp - ref
    if name in ("kl", "k1"):
        return d
    if name == "abs":
        return abs(d)
    if name in ("mse", "k2"):
        return 0.5 * d * d
    x = ref - logp
    return min(max(math.exp(x) - x - 1, -10.0), 10.0)


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_penalty_random_against_loop_reference(name):
    rng = random.Random(name)
    logp = [-rng.uniform(0, 6) for _ in range(60)]
    ref = [lp + rng.gauss(0, 1.5) for lp in logp]  # a few |x| > 2.9 reach the k3 clamp
    expected = [_ref_kl(a, b, name) for a, b in zip(logp, ref)]
    _close(algos.kl_penalty(_t(logp), _t(ref), name), expected, atol=1e-10)


def test_kl_penalty_unknown_estimator_raises():
    with pytest.raises(ValueError, match="'k4'"):
        algos.kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def test_adaptive_kl_coef_by_hand():
    # kl 0.11, target 0.1: error 0.1 (inside the clip) -> 0.1 * (1 + 0.1 * 256 / 10000) = 0.100256
    assert algos.adaptive_kl_coef(0.1, 0.11, 256, target=0.1, horizon=10000) == pytest.approx(0.100256, abs=1e-12)
    # kl 1.0: error 9 -> clipped to +0.2 -> 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    assert algos.adaptive_kl_coef(0.1, 1.0, 256, target=0.1, horizon=10000) == pytest.approx(0.100512, abs=1e-12)
    # kl 0: error -1 -> clipped to -0.2 -> 0.1 * (1 - 0.00512) = 0.099488
    assert algos.adaptive_kl_coef(0.1, 0.0, 256, target=0.1, horizon=10000) == pytest.approx(0.099488, abs=1e-12)
    # kl 0.09: error -0.1 -> 2.0 * (1 - 0.1 * 500 / 1000) = 1.9
    assert algos.adaptive_kl_coef(2.0, 0.09, 500, target=0.1, horizon=1000) == pytest.approx(1.9, abs=1e-12)
    # on target: unchanged
    assert algos.adaptive_kl_coef(0.3, 0.05, 64, target=0.05, horizon=100) == pytest.approx(0.3, abs=1e-15)


# ---------------------------------------------------------------------------
# gae


def test_gae_by_hand_gamma_1_lam_1():
    # lengths [2, 0, 1]; rewards [0, 1 | | 2]; values [0.5, 0.25 | | 1.0]; gamma = lam = 1
    # seq 1, t=1: delta = 1 + 0 - 0.25 = 0.75, A = 0.75
    #        t=0: delta = 0 + 0.25 - 0.5 = -0.25, A = -0.25 + 0.75 = 0.5   (= 1 - V_0)
    # seq 3, t=0: delta = 2 - 1 = 1, A = 1
    # returns = A + V = [1.0, 1.0, 2.0]
    # whiten [0.5, 0.75, 1]: mean 0.75, deviations [-.25, 0, .25], unbiased var .125 / 2 = .0625
    out = estimators.gae_advantages(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.5, 0.25, 1.0]), torch.tensor([2, 0,
                                                                                                                 1]),
                                    gamma=1.0, lam=1.0)
    s = math.sqrt(0.0625 + 1e-8)
    _close(out.returns, [1.0, 1.0, 2.0])
    _close(out.advantages, [-0.25 / s, 0.0, 0.25 / s], atol=1e-5)


def test_gae_by_hand_gamma_09_lam_08():
    # lengths [3, 1]; rewards [0, 0, 1 | 2]; values [0.5, 0.4, 0.6 | 0.5]; gamma 0.9, lam 0.8 (gamma lam = 0.72)
    # seq 1, t=2: delta = 1 + 0 - 0.6 = 0.4,             A2 = 0.4
    #        t=1: delta = 0 + 0.9 * 0.6 - 0.4 = 0.14,     A1 = 0.14 + 0.72 * 0.4 = 0.428
    #        t=0: delta = 0 + 0.9 * 0.4 - 0.5 = -0.14,    A0 = -0.14 + 0.72 * 0.428 = 0.16816
    # seq 2, t=0: delta = 2 - 0.5 = 1.5,                  A = 1.5
    # returns = A + V = [0.66816, 0.828, 1.0, 2.0]
    out = estimators.gae_advantages(torch.tensor([0.0, 0.0, 1.0, 2.0]), torch.tensor([0.5, 0.4, 0.6, 0.5]), torch.tensor([3, 1]),
                    gamma=0.9, lam=0.8)
    raw = [0.16816, 0.428, 0.4, 1.5]
    _close(out.returns, [0.66816, 0.828, 1.0, 2.0])
    # whitened over all four tokens: mean 0.62404, unbiased var from statistics.variance
    mean, var = statistics.fmean(raw), statistics.variance(raw)
    _close(out.advantages, [(a - mean) / math.sqrt(var + 1e-8) for a in raw], atol=1e-5)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.95)])
def test_gae_random_against_padded_reference(gamma, lam):
    rng = np.random.default_rng(int(gamma * 100 + lam * 10))
    width = 10
    for _ in range(4):
        lengths = _ragged_lengths(rng, 6, width, 0)
        if sum(lengths) < 2:
            continue
        rewards = rng.normal(size=sum(lengths))
        values = rng.normal(size=sum(lengths))
        r_pad, mask = _padded(rewards, lengths, width)
        v_pad, _ = _padded(values, lengths, width)
        exp_adv, exp_ret = _ref_gae(r_pad, v_pad, mask, gamma, lam)
        out = estimators.gae_advantages(_t(rewards, torch.float32), _t(values, torch.float32), torch.tensor(lengths),
                                        gamma=gamma, lam=lam)
        _close(out.returns, _flat(exp_ret, lengths), atol=1e-5, rtol=1e-5)
        _close(out.advantages, _flat(exp_adv, lengths), atol=1e-5, rtol=1e-5)


def gae_reference(rewards: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, gamma: float,
                  lam: float) -> algos.Advantages:
    """algos.gae as it was before it was vectorised: a Python loop over every token of every sequence."""
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    start = 0
    for length in lengths.tolist():
        running, next_value = 0.0, 0.0
        for t in range(start + length - 1, start - 1, -1):
            delta = float(rewards[t]) + gamma * next_value - float(values[t])
            running = delta + gamma * lam * running
            advantages[t] = running
            next_value = float(values[t])
        start += length
    returns = advantages + values.float()
    return algos.Advantages(algos.whiten(advantages), returns)


def discounted_returns_reference(rewards: torch.Tensor, lengths: torch.Tensor, gamma: float) -> torch.Tensor:
    """algos.discounted_returns as it was before it was vectorised: a Python loop over every token."""
    returns = torch.zeros_like(rewards, dtype=torch.float32)
    start = 0
    for length in lengths.tolist():
        running = 0.0
        for t in range(start + length - 1, start - 1, -1):
            running = float(rewards[t]) + gamma * running
            returns[t] = running
        start += length
    return returns


# ragged batches for the vectorised recursions: lengths of 1 among longer ones, empty responses, a single
# sequence (long and of one token), and no sequences at all
RAGGED_CASES = ([1, 5, 1, 3, 8, 1], [4, 0, 1, 7, 0], [1], [9], [1, 1, 1], [], [0, 0])


def _random_ragged_cases(seed: int):
    rng = np.random.default_rng(seed)
    for lengths in [*RAGGED_CASES, *(_ragged_lengths(rng, int(rng.integers(2, 9)), 12, 1) for _ in range(6))]:
        t = sum(lengths)
        yield (torch.tensor(lengths, dtype=torch.int64), torch.tensor(rng.normal(size=t), dtype=torch.float32),
               torch.tensor(rng.normal(size=t), dtype=torch.float32))


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.95)])
def test_gae_equals_loop_reference_on_ragged_batches(gamma, lam):
    for lengths, rewards, values in _random_ragged_cases(11):
        got = estimators.gae_advantages(rewards, values, lengths, gamma=gamma, lam=lam)
        expected = gae_reference(rewards, values, lengths, gamma, lam)
        assert got.advantages.dtype == got.returns.dtype == torch.float32
        assert got.returns.shape == (int(lengths.sum()),)
        torch.testing.assert_close(got.returns, expected.returns, atol=1e-6, rtol=0)
        torch.testing.assert_close(got.advantages, expected.advantages, atol=1e-6, rtol=0)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_discounted_returns_equals_loop_reference_on_ragged_batches(gamma):
    for lengths, rewards, _ in _random_ragged_cases(12):
        got = estimators.discounted_returns(rewards, lengths, gamma)
        assert got.dtype == torch.float32 and got.shape == (int(lengths.sum()),)
        torch.testing.assert_close(got, discounted_returns_reference(rewards, lengths, gamma), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------
# grpo_advantages, rloo_advantages


def _grpo_hand_case() -> tuple[torch.Tensor, torch.Tensor]:
    # Four groups, interleaved (ids are neither contiguous nor sorted):
    #   group 5 at rows 0, 2, 4, 6 with scores [1, 0, 0, 1]
    #   group 2 at rows 1, 3       with scores [3, 3]      (all equal)
    #   group 9 at row  5          with score  [4]         (size 1)
    #   group 1 at rows 7, 8, 9    with scores [2, 4, 9]
    scores = torch.tensor([1.0, 3.0, 0.0, 3.0, 0.0, 4.0, 1.0, 2.0, 4.0, 9.0])
    group_ids = torch.tensor([5, 2, 5, 2, 5, 9, 5, 1, 1, 1])
    return scores, group_ids


def test_grpo_advantages_by_hand_with_std():
    scores, group_ids = _grpo_hand_case()
    # group 5: mean 0.5, centred [+.5, -.5, -.5, +.5], sum of squares 1,
    #          unbiased var 1/3, std sqrt(1/3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 2: centred [0, 0] -> 0 (0 / (0 + eps))
    # group 9: size 1 -> 0
    # group 1: mean 5, centred [-3, -1, 4], sum of squares 26, var 13, std 3.605551
    #          -> [-0.832050, -0.277350, 1.109400]
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    s = math.sqrt(13) + 1e-6
    expected = [a, 0.0, -a, 0.0, -a, 0.0, a, -3 / s, -1 / s, 4 / s]
    got = estimators.grpo_advantages(scores, group_ids)
    assert got.dtype == torch.float32
    _close(got, expected, atol=1e-6)


def test_grpo_advantages_by_hand_without_std():
    scores, group_ids = _grpo_hand_case()
    # Dr. GRPO: score - group mean only; size-1 groups still 0.
    got = estimators.grpo_advantages(scores, group_ids, norm_by_std=False)
    _close(got, [0.5, 0.0, -0.5, 0.0, -0.5, 0.0, 0.5, -3.0, -1.0, 4.0], atol=1e-6)


def test_grpo_advantages_singleton_and_equal_groups_are_zero():
    # Size-1 groups and all-equal groups (including a value not exact in binary) give 0, never nan.
    scores = torch.tensor([0.1, 7.0, 0.1, 0.1, -2.0])
    group_ids = torch.tensor([3, 4, 3, 3, 8])
    for norm in (True, False):
        got = estimators.grpo_advantages(scores, group_ids, norm_by_std=norm)
        assert torch.isfinite(got).all()
        _close(got, [0.0] * 5, atol=1e-6)


def test_grpo_advantages_eps_is_added_to_std():
    # group [0, 2]: mean 1, centred [-1, 1], var 2, std sqrt(2); eps = 1 -> +-1 / (sqrt(2) + 1)
    got = estimators.grpo_advantages(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), eps=1.0)
    d = math.sqrt(2) + 1
    _close(got, [-1 / d, 1 / d], atol=1e-6)


def _grpo_reference(scores: list[float], group_ids: list[int], norm_by_std: bool, eps: float) -> list[float]:
    members = _group_members(scores, group_ids)
    out = []
    for score, gid in zip(scores, group_ids):
        group = members[gid]
        if len(group) == 1:
            out.append(0.0)
            continue
        centred = score - statistics.fmean(group)
        out.append(centred / (statistics.stdev(group) + eps) if norm_by_std else centred)
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_random_against_loop_reference(norm_by_std):
    rng = random.Random(1234)
    for _ in range(20):
        group_ids = _random_groups(rng)
        scores = [rng.choice([0.0, 1.0, rng.uniform(-3, 3)]) for _ in group_ids]
        expected = _grpo_reference(scores, group_ids, norm_by_std, eps=1e-6)
        got = estimators.grpo_advantages(torch.tensor(scores), torch.tensor(group_ids), norm_by_std=norm_by_std)
        _close(got, expected, atol=1e-5, rtol=1e-5)


def test_rloo_advantages_by_hand():
    scores, group_ids = _grpo_hand_case()
    # group 5 [1, 0, 0, 1]: 1 - (0 + 0 + 1) / 3 = 2/3;  0 - (1 + 0 + 1) / 3 = -2/3
    # group 2 [3, 3]: 3 - 3 = 0;  group 9 (size 1): 0
    # group 1 [2, 4, 9]: 2 - 13/2 = -4.5;  4 - 11/2 = -1.5;  9 - 6/2 = 6
    got = estimators.rloo_advantages(scores, group_ids)
    assert got.dtype == torch.float32
    _close(got, [2 / 3, 0.0, -2 / 3, 0.0, -2 / 3, 0.0, 2 / 3, -4.5, -1.5, 6.0], atol=1e-6)


def test_rloo_advantages_random_against_loop_reference():
    rng = random.Random(99)
    for _ in range(20):
        group_ids = _random_groups(rng)
        scores = [rng.choice([0.0, 1.0, rng.uniform(-3, 3)]) for _ in group_ids]
        expected = []
        for i, (score, gid) in enumerate(zip(scores, group_ids)):
            others = [s for j, (s, g) in enumerate(zip(scores, group_ids)) if g == gid and j != i]
            expected.append(score - sum(others) / len(others) if others else 0.0)
        _close(estimators.rloo_advantages(torch.tensor(scores), torch.tensor(group_ids)), expected, atol=1e-5)


# ---------------------------------------------------------------------------
# reinforce_plus_plus, reinforce_plus_plus_baseline


def test_reinforce_plus_plus_by_hand():
    # lengths [3, 0, 1]; rewards [0, 0, 1 | | 2]
    # gamma 0.9: G = [0.81, 0.9, 1 | 2];  gamma 1: G = [1, 1, 1 | 2]
    rewards, lengths = torch.tensor([0.0, 0.0, 1.0, 2.0]), torch.tensor([3, 0, 1])
    for gamma, returns in ((0.9, [0.81, 0.9, 1.0, 2.0]), (1.0, [1.0, 1.0, 1.0, 2.0])):
        out = estimators.reinforce_plus_plus_advantages(rewards, lengths, gamma)
        _close(out.returns, returns)
        mean, var = statistics.fmean(returns), statistics.variance(returns)
        _close(out.advantages, [(g - mean) / math.sqrt(var + 1e-8) for g in returns], atol=1e-5)
    # gamma 1 in numbers: mean 1.25, deviations [-.25, -.25, -.25, .75], var (3 * .0625 + .5625) / 3 = .25
    _close(estimators.reinforce_plus_plus_advantages(rewards, lengths, 1.0).advantages, [-0.5, -0.5, -0.5, 1.5], atol=1e-5)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_random_against_padded_reference(gamma):
    rng = np.random.default_rng(5)
    for _ in range(4):
        lengths = _ragged_lengths(rng, 6, 9, 0)
        if sum(lengths) < 2:
            continue
        rewards = rng.normal(size=sum(lengths))
        r_pad, mask = _padded(rewards, lengths, 9)
        returns = _ref_discounted(r_pad, mask, gamma)
        out = estimators.reinforce_plus_plus_advantages(_t(rewards, torch.float32), torch.tensor(lengths), gamma)
        _close(out.returns, _flat(returns, lengths), atol=1e-5)
        _close(out.advantages, _flat(_masked_whiten(returns, mask), lengths), atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_baseline_by_hand():
    # scores [1, 0, 3, 5], groups [7, 7, 7, 2], lengths [2, 1, 3, 2]
    # group 7: mean 4/3 -> centred [-1/3, -4/3, 5/3]; group 2 is a singleton -> 0
    # per token: [-1/3, -1/3 | -4/3 | 5/3, 5/3, 5/3 | 0, 0], mean (-2/3 - 4/3 + 5) / 8 = 3/8
    # deviations from 3/8, in 24ths: [-17, -17 | -41 | 31, 31, 31 | -9, -9] (they sum to 0)
    # sum of squares: (2 * 289 + 1681 + 3 * 961 + 2 * 81) / 576 = 5304 / 576; unbiased var 5304 / 576 / 7 = 221/168
    # whitened = deviation / sqrt(221/168 + 1e-8): [-0.617584, -0.617584, -1.489468, 1.126183 x 3, -0.326956 x 2]
    # verl returns (scores, scores): the returns are those whitened advantages too.
    out = estimators.reinforce_plus_plus_baseline_advantages(torch.tensor([1.0, 0.0, 3.0, 5.0]), torch.tensor([7, 7, 7, 2]),
                                             torch.tensor([2, 1, 3, 2]))
    s = math.sqrt(221 / 168 + 1e-8)
    expected = [d / 24 / s for d in (-17, -17, -41, 31, 31, 31, -9, -9)]
    assert expected == pytest.approx([-0.617584, -0.617584, -1.489468, 1.126183, 1.126183, 1.126183, -0.326956,
                                      -0.326956], abs=1e-6)
    _close(out.advantages, expected, atol=1e-6)
    _close(out.returns, expected, atol=1e-6)


def test_compute_advantages_reinforce_plus_plus_baseline_returns_are_the_advantages():
    # The same case through compute_advantages: each score on its response's last token.
    # rewards [0, 1 | 0 | 0, 0, 3 | 0, 5]; the expected numbers are the hand-worked ones above.
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 5.0])
    out = compute_advantages("reinforce_plus_plus_baseline", rewards, torch.tensor([2, 1, 3, 2]),
                                   torch.tensor([7, 7, 7, 2]), None, 1.0, 1.0, True)
    s = math.sqrt(221 / 168 + 1e-8)
    expected = [d / 24 / s for d in (-17, -17, -41, 31, 31, 31, -9, -9)]
    _close(out.advantages, expected, atol=1e-6)
    _close(out.returns, expected, atol=1e-6)


def test_reinforce_plus_plus_baseline_random_against_padded_reference():
    rng = random.Random(3)
    np_rng = np.random.default_rng(3)
    for _ in range(10):
        group_ids = _random_groups(rng)
        scores = [rng.choice([0.0, 1.0, rng.uniform(-3, 3)]) for _ in group_ids]
        lengths = _ragged_lengths(np_rng, len(group_ids), 6, 1)
        members = _group_members(scores, group_ids)
        centred = [s - statistics.fmean(members[g]) if len(members[g]) > 1 else 0.0
                   for s, g in zip(scores, group_ids)]
        _, mask = _padded(np.zeros(sum(lengths)), lengths, 6)
        per_token = np.array(centred)[:, None] * mask  # verl: scores.unsqueeze(-1).tile(...) * response_mask
        if np.var(_flat(per_token, lengths)) <= 1e-6:  # whitening a constant amplifies float32 rounding
            continue
        whitened = _flat(_masked_whiten(per_token, mask), lengths)  # verl: masked_whiten(...); returns the same
        out = estimators.reinforce_plus_plus_baseline_advantages(torch.tensor(scores), torch.tensor(group_ids), torch.tensor(lengths))
        _close(out.advantages, whitened, atol=1e-4, rtol=1e-4)
        _close(out.returns, whitened, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------
# aggregate


def test_aggregate_by_hand():
    # per-token [1 | 2 3 | 4 5 6], lengths [1, 2, 3], max_response_length 4; sequence sums [1, 5, 15]
    per_token, lengths = _t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), torch.tensor([1, 2, 3])
    scale = algos.LossScale.of(lengths, 4)
    assert scale == algos.LossScale(num_tokens=6, num_sequences=3, max_response_length=4)
    expected = {
        "token-mean": 21 / 6,  # 3.5
        "seq-mean-token-sum": 21 / 3,  # 7
        "seq-mean-token-mean": (1 / 1 + 5 / 2 + 15 / 3) / 3,  # 8.5 / 3
        "seq-mean-token-sum-norm": 21 / 3 / 4,  # by the 3 sequences and the constant 4 (verl >= 0.7.1)
    }
    for mode, value in expected.items():
        assert algos.aggregate(per_token, lengths, mode, scale=scale).item() == pytest.approx(value, abs=1e-12), mode
    # a micro-batch of a bigger mini-batch (12 tokens, 6 sequences) divides by the mini-batch's counts
    big = algos.LossScale(12, 6, 4)
    assert algos.aggregate(per_token, lengths, "token-mean", scale=big).item() == pytest.approx(21 / 12)
    assert algos.aggregate(per_token, lengths, "seq-mean-token-sum", scale=big).item() == pytest.approx(21 / 6)
    assert algos.aggregate(per_token, lengths, "seq-mean-token-mean", scale=big).item() == pytest.approx(8.5 / 6)
    assert algos.aggregate(per_token, lengths, "seq-mean-token-sum-norm", scale=big).item() == pytest.approx(21 / 6 / 4)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_random_against_agg_loss(mode):
    rng = np.random.default_rng(MODES.index(mode))
    for width in (5, 12):
        lengths = _ragged_lengths(rng, 7, 5, 1)
        loss = rng.normal(size=sum(lengths))
        padded, mask = _padded(loss, lengths, width)
        got = algos.aggregate(_t(loss), torch.tensor(lengths), mode, scale=algos.LossScale.of(torch.tensor(lengths),
                                                                                              width))
        assert got.item() == pytest.approx(_ref_agg(padded, mask, mode), abs=1e-12)


def test_aggregate_unknown_mode_raises():
    with pytest.raises(ValueError, match="'token-sum'"):
        algos.aggregate(torch.ones(2), torch.tensor([2]), "token-sum", scale=algos.LossScale(2, 1, 2))


# ---------------------------------------------------------------------------
# policy_loss

LOW, HIGH, C = 0.2, 0.28, 3.0  # clip-higher: ratio is clamped to [0.8, 1.28]; dual-clip bound 3 |A|
HAND_RATIOS = [1.1, 1.5, 0.5, 1.5, 0.5, 20.0, 1.25, 0.78]
HAND_ADVANTAGES = [1.0, 1.0, -1.0, -2.0, 2.0, -1.0, 1.0, -1.0]
HAND_LENGTHS = [3, 5]


def _policy_hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    old = _t([-1.0, -2.0, -0.5, -3.0, -1.5, -3.5, -2.5, -0.7])
    new = old + torch.log(_t(HAND_RATIOS))
    return new, old, _t(HAND_ADVANTAGES), torch.tensor(HAND_LENGTHS)


# token  A   r      -A*r    -A*clip(r,0.8,1.28)  max    clipped?           dual-clip (bound -3A)
#   1   +1  1.10  -1.10   -1.10                -1.10   no  (inside)        A > 0: untouched
#   2   +1  1.50  -1.50   -1.28                -1.28   yes (above 1+high)
#   3   -1  0.50  +0.50   +0.80                +0.80   yes (below 1-low)   0.8 < 3
#  ---- sequence 2 ----
#   4   -2  1.50  +3.00   +2.56                +3.00   no  (A<0 above)     3 < 6: untouched
#   5   +2  0.50  -1.00   -1.60                -1.00   no  (A>0 below)
#   6   -1  20.0  +20.0   +1.28                +20.0   no                  20 > 3: capped to 3
#   7   +1  1.25  -1.25   -1.25                -1.25   no  (1.2 < r < 1.28: inside only with clip-higher)
#   8   -1  0.78  +0.78   +0.80                +0.80   yes (0.72 < r < 0.8: low is 0.2, not 0.28)
# with dual-clip:    sequence sums -1.10 - 1.28 + 0.80 = -1.58 and 3 - 1 + 3 - 1.25 + 0.8 = 4.55, total 2.97
# without (c=None):  token 6 stays 20, so sequence 2 = 3 - 1 + 20 - 1.25 + 0.8 = 21.55, total 19.97
# clipfrac = 3/8 (tokens 2, 3, 8); clipfrac_lower = 1/8 (token 6) with dual-clip, 0 without
# approx_kl = mean(old - new) = -ln(1.1 * 1.5 * 0.5 * 1.5 * 0.5 * 20 * 1.25 * 0.78) / 8 = -ln(12.065625) / 8
HAND_EXPECTED = {  # (dual-clip at 3, no dual-clip); max_response_length 6
    "token-mean": (2.97 / 8, 19.97 / 8),
    "seq-mean-token-sum": (2.97 / 2, 19.97 / 2),
    "seq-mean-token-mean": ((-1.58 / 3 + 4.55 / 5) / 2, (-1.58 / 3 + 21.55 / 5) / 2),
    "seq-mean-token-sum-norm": (2.97 / 2 / 6, 19.97 / 2 / 6),
}


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_by_hand(mode):
    new, old, adv, lengths = _policy_hand_case()
    scale = algos.LossScale.of(lengths, 6)
    with_c, without_c = HAND_EXPECTED[mode]
    out = policy_losses.policy_loss(new, old, adv, lengths=lengths, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                    clip_ratio_c=C,
                            mode=mode, scale=scale)
    assert isinstance(out, policy_losses.PolicyLoss)
    assert out.loss.item() == pytest.approx(with_c, abs=1e-12)
    assert out.clipfrac.item() == pytest.approx(3 / 8, abs=1e-7)
    assert out.clipfrac_lower.item() == pytest.approx(1 / 8, abs=1e-7)
    assert out.approx_kl.item() == pytest.approx(-math.log(12.065625) / 8, abs=1e-12)
    off = policy_losses.policy_loss(new, old, adv, lengths=lengths, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                    clip_ratio_c=None,
                            mode=mode, scale=scale)
    assert off.loss.item() == pytest.approx(without_c, abs=1e-12)
    assert off.clipfrac.item() == pytest.approx(3 / 8, abs=1e-7)
    assert off.clipfrac_lower.item() == 0.0


def test_policy_loss_clip_higher_differs_on_one_token():
    # Token 7 alone (A=+1, r=1.25): with high=0.28 it is inside -> loss -1.25, not clipped;
    # with high=0.2 it is clamped to 1.2 -> loss -1.2, clipped.
    new, old, adv, _ = _policy_hand_case()
    new, old, adv = new[6:7], old[6:7], adv[6:7]
    lengths = torch.tensor([1])
    scale = algos.LossScale.of(lengths, 1)
    wide = policy_losses.policy_loss(new, old, adv, lengths=lengths, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                     clip_ratio_c=C,
                             mode="token-mean", scale=scale)
    narrow = policy_losses.policy_loss(new, old, adv, lengths=lengths, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                       clip_ratio_c=C,
                               mode="token-mean", scale=scale)
    assert wide.loss.item() == pytest.approx(-1.25) and wide.clipfrac.item() == 0.0
    assert narrow.loss.item() == pytest.approx(-1.2) and narrow.clipfrac.item() == 1.0


def test_policy_loss_gradient_by_hand():
    new, old, adv, lengths = _policy_hand_case()
    new = new.clone().requires_grad_(True)
    out = policy_losses.policy_loss(new, old, adv, lengths=lengths, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                    clip_ratio_c=C,
                            mode="token-mean", scale=algos.LossScale.of(lengths, 6))
    out.loss.backward()
    # d/d logp of -A * r / 8 is -A * r / 8 where the unclipped term is active; 0 where the clamp is
    # (tokens 2, 3, 8) or the dual-clip bound (token 6) is.
    expected = [0.0 if i in (1, 2, 5, 7) else -HAND_ADVANTAGES[i] * HAND_RATIOS[i] / 8 for i in range(8)]
    _close(new.grad, expected, atol=1e-12)


def _random_policy_batch(rng: np.random.Generator, batch: int, width: int):
    lengths = _ragged_lengths(rng, batch, width, 1)
    t = sum(lengths)
    old = -rng.random(t) * 3
    new = old + rng.normal(0.0, 0.4, t)
    adv = rng.normal(size=t)
    # a few negative-advantage tokens with a huge ratio, for dual-clip
    for i in rng.choice(t, size=min(3, t), replace=False):
        new[i], adv[i] = old[i] + rng.uniform(1.5, 4.0), -abs(adv[i]) - 0.1
    return lengths, new, old, adv


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("low,high,c", [(0.2, 0.28, 3.0), (0.2, 0.2, None), (0.1, 0.3, 2.0)])
def test_policy_loss_random_against_padded_reference(mode, low, high, c):
    rng = np.random.default_rng(17)
    width = 9
    for _ in range(3):
        lengths, new, old, adv = _random_policy_batch(rng, 6, width)
        pads = [_padded(x, lengths, width)[0] for x in (new, old, adv)]
        mask = _padded(new, lengths, width)[1]
        loss, clipfrac, lower, kl, grad = _ref_policy(*pads, mask, low, high, c, mode)
        logp = _t(new).requires_grad_(True)
        out = policy_losses.policy_loss(logp, _t(old), _t(adv), lengths=torch.tensor(lengths), clip_ratio_low=low,
                                clip_ratio_high=high, clip_ratio_c=c, mode=mode,
                                scale=algos.LossScale.of(torch.tensor(lengths), width))
        out.loss.backward()
        assert out.loss.item() == pytest.approx(loss, abs=1e-10)
        assert out.clipfrac.item() == pytest.approx(clipfrac, abs=1e-6)  # statistics are fp32
        assert out.clipfrac_lower.item() == pytest.approx(lower, abs=1e-6)
        assert out.approx_kl.item() == pytest.approx(kl, abs=1e-10)
        _close(logp.grad, _flat(grad, lengths), atol=1e-10)
        assert clipfrac > 0 and (c is None or lower > 0)  # the case does exercise both clips


# ---------------------------------------------------------------------------
# rollout correction: rollout_log_ratio, rollout_is_weights, policy_loss with is_weights

# Three responses of lengths 2, 0 and 2 (the middle one empty); threshold 2.
# token  rollout logp  ratio pi_old/pi_rollout   sequence ratio (product over the response)
#   1    -1.0          0.5                       0.5 * 3.0 = 1.5
#   2    -2.0          3.0  (> 2)                1.5
#  ---- response 2: no tokens ----
#   3    -0.5          1.5                       1.5 * 2.0 = 3.0 (> 2)
#   4    -3.0          2.0  (= 2: not above)     3.0 (> 2)
# token    truncate: [0.5, 2, 1.5, 2]      mask: [0.5, 0, 1.5, 2]       exceeded [F, T, F, F]
# sequence truncate: [1.5, 1.5, 2, 2]      mask: [1.5, 1.5, 0, 0]       exceeded [F, F, T, T]
IS_ROLLOUT = [-1.0, -2.0, -0.5, -3.0]
IS_RATIOS = [0.5, 3.0, 1.5, 2.0]
IS_LENGTHS = [2, 0, 2]
IS_EXPECTED = {
    ("token", "truncate"): ([0.5, 2.0, 1.5, 2.0], [False, True, False, False]),
    ("token", "mask"): ([0.5, 0.0, 1.5, 2.0], [False, True, False, False]),
    ("sequence", "truncate"): ([1.5, 1.5, 2.0, 2.0], [False, False, True, True]),
    ("sequence", "mask"): ([1.5, 1.5, 0.0, 0.0], [False, False, True, True]),
}


def _is_hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rollout = _t(IS_ROLLOUT)
    return rollout + torch.log(_t(IS_RATIOS)), rollout, torch.tensor(IS_LENGTHS)


def test_rollout_log_ratio_by_hand():
    old, rollout, lengths = _is_hand_case()
    _close(algos.rollout_log_ratio(old, rollout, lengths, level="token"), np.log(IS_RATIOS), atol=1e-12)
    # ln 1.5, 0 for the empty response, ln 3
    _close(algos.rollout_log_ratio(old, rollout, lengths, level="sequence"), np.log([1.5, 1.0, 3.0]), atol=1e-12)


@pytest.mark.parametrize("level,mode", list(IS_EXPECTED))
def test_rollout_is_weights_by_hand(level, mode):
    old, rollout, lengths = _is_hand_case()
    out = algos.rollout_is_weights(old, rollout, lengths, level=level, mode=mode, threshold=2.0)
    assert isinstance(out, algos.RolloutISWeights)
    weights, exceeded = IS_EXPECTED[level, mode]
    _close(out.weights, weights, atol=1e-12)
    assert out.exceeded.tolist() == exceeded


def test_rollout_is_weights_safety_bound_engages():
    # token 1: log-ratio -25 -> clamped to -20; response 2: 12 + 18 = 30 -> clamped to 20 before exp
    old, rollout, lengths = _t([-26.0, 11.0, 17.0]), _t([-1.0, -1.0, -1.0]), torch.tensor([1, 2])
    _close(algos.rollout_log_ratio(old, rollout, lengths, level="token"), [-20.0, 12.0, 18.0])
    _close(algos.rollout_log_ratio(old, rollout, lengths, level="sequence"), [-20.0, 20.0])
    seq = algos.rollout_is_weights(old, rollout, lengths, level="sequence", mode="truncate", threshold=5.0)
    _close(seq.weights, [math.exp(-20.0), 5.0, 5.0], atol=1e-15)
    assert torch.isfinite(algos.rollout_is_weights(_t([500.0]), _t([-500.0]), torch.tensor([1]), level="token",
                                                   mode="mask",
                                                   threshold=2.0).weights).all()


def test_rollout_is_weights_equal_rollout_logprobs_are_one():
    old = _t([-0.3, -2.0, -1.1, -0.05, -4.0])
    for level in algos.ROLLOUT_IS_LEVELS:
        for mode in algos.ROLLOUT_IS_MODES:
            out = algos.rollout_is_weights(old, old.clone(), torch.tensor([3, 0, 2]), level=level, mode=mode,
                                           threshold=2.0)
            assert out.weights.tolist() == [1.0] * 5 and not out.exceeded.any()


def test_rollout_is_weights_are_detached():
    old = _t([-1.0, -2.0]).requires_grad_(True)
    rollout = _t([-1.5, -1.0]).requires_grad_(True)
    for level in algos.ROLLOUT_IS_LEVELS:
        out = algos.rollout_is_weights(old, rollout, torch.tensor([2]), level=level, mode="truncate", threshold=2.0)
        assert not out.weights.requires_grad


@pytest.mark.parametrize("lengths", [[], [0, 0]])
def test_rollout_is_weights_of_no_tokens_are_empty(lengths):
    empty = torch.zeros(0, dtype=F64)
    for level in algos.ROLLOUT_IS_LEVELS:
        out = algos.rollout_is_weights(empty, empty, torch.tensor(lengths, dtype=torch.int64), level=level, mode="mask",
                                       threshold=2.0)
        assert out.weights.shape == (0,) and out.exceeded.shape == (0,)


def test_rollout_is_weights_unknown_level_or_mode_raises():
    one, lengths = _t([0.0]), torch.tensor([1])
    with pytest.raises(ValueError, match="'geometric'"):
        algos.rollout_is_weights(one, one, lengths, level="geometric", mode="truncate", threshold=2.0)
    with pytest.raises(ValueError, match="'clip'"):
        algos.rollout_is_weights(one, one, lengths, level="token", mode="clip", threshold=2.0)


def _ref_is_weights(old: list[float], rollout: list[float], lengths: list[int], level: str, mode: str,
                    threshold: float) -> tuple[list[float], list[bool]]:
    """Loop reference: per-token or per-response ratio with math.exp, the +-20 bound, then truncate or mask."""
    weights, exceeded, start = [], [], 0
    for n in lengths:
        logs = [min(max(old[t] - rollout[t], -20.0), 20.0) for t in range(start, start + n)]
        if level == "sequence":
            total = min(max(sum(old[t] - rollout[t] for t in range(start, start + n)), -20.0), 20.0)
            logs = [total] * n
        for log_ratio in logs:
            ratio = math.exp(log_ratio)
            exceeded.append(ratio > threshold)
            weights.append(min(ratio, threshold) if mode == "truncate" else (0.0 if ratio > threshold else ratio))
        start += n
    return weights, exceeded


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_is_weights_random_against_loop_reference(level, mode):
    rng = np.random.default_rng(23)
    for threshold in (1.2, 2.0, 5.0):
        lengths = _ragged_lengths(rng, 12, 8, 0)
        t = sum(lengths)
        rollout = -rng.random(t) * 4
        old = rollout + rng.normal(0.0, 0.5, t)
        old[rng.choice(t, size=2, replace=False)] += 30.0  # beyond the safety bound
        weights, exceeded = _ref_is_weights(old.tolist(), rollout.tolist(), lengths, level, mode, threshold)
        out = algos.rollout_is_weights(_t(old), _t(rollout), torch.tensor(lengths), level=level, mode=mode,
                                       threshold=threshold)
        _close(out.weights, weights, atol=1e-12, rtol=1e-12)
        assert out.exceeded.tolist() == exceeded
        assert 0 < sum(exceeded) < t  # the case does exercise the threshold


def test_policy_loss_with_is_weights_by_hand():
    # Per-token losses of the hand case (dual-clip at 3): [-1.10, -1.28, 0.80, 3.00, -1.00, 3.00, -1.25, 0.80].
    # Weights [2, 1, 0.5, 0, 1, 1, 1, 1]: -2.20 - 1.28 + 0.40 + 0 - 1.00 + 3.00 - 1.25 + 0.80 = -1.53, over 8 tokens.
    # The gradient is each token's unweighted gradient times its weight: token 1 -1.1/8 * 2, token 4 (A=-2, r=1.5)
    # 3/8 * 0, tokens 5 and 7 -1/8 and -1.25/8; tokens 2, 3, 6 and 8 are clipped or capped (0).
    new, old, adv, lengths = _policy_hand_case()
    new = new.clone().requires_grad_(True)
    weights = _t([2.0, 1.0, 0.5, 0.0, 1.0, 1.0, 1.0, 1.0])
    out = policy_losses.policy_loss(new, old, adv, lengths=lengths, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                    clip_ratio_c=C,
                            mode="token-mean", scale=algos.LossScale.of(lengths, 6), is_weights=weights)
    assert out.loss.item() == pytest.approx(-1.53 / 8, abs=1e-12)
    assert out.clipfrac.item() == pytest.approx(3 / 8, abs=1e-7)  # the statistics do not see the weights
    out.loss.backward()
    _close(new.grad, [-1.1 / 8 * 2, 0.0, 0.0, 0.0, -1.0 / 8, 0.0, -1.25 / 8, 0.0], atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_with_unit_is_weights_equals_without(mode):
    new, old, adv, lengths = _policy_hand_case()
    scale = algos.LossScale.of(lengths, 6)
    grads = []
    for weights in (None, torch.ones(8, dtype=F64)):
        logp = new.clone().requires_grad_(True)
        out = policy_losses.policy_loss(logp, old, adv, lengths=lengths, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                        clip_ratio_c=C,
                                mode=mode, scale=scale, is_weights=weights)
        out.loss.backward()
        grads.append((out.loss.item(), logp.grad))
    assert grads[0][0] == grads[1][0]
    assert torch.equal(grads[0][1], grads[1][1])


def test_policy_loss_all_masked_is_zero_with_zero_gradient():
    new, old, adv, lengths = _policy_hand_case()
    new = new.clone().requires_grad_(True)
    out = policy_losses.policy_loss(new, old, adv, lengths=lengths, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                                    clip_ratio_c=C,
                            mode="token-mean", scale=algos.LossScale.of(lengths, 6),
                            is_weights=torch.zeros(8, dtype=F64))
    out.loss.backward()
    assert out.loss.item() == 0.0 and not new.grad.any()


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_with_is_weights_random_against_padded_reference(mode):
    # verl's TIS: pg_losses * rollout_is_weights, then agg_loss; the gradient scales token by token.
    rng = np.random.default_rng(29)
    width = 9
    lengths, new, old, adv = _random_policy_batch(rng, 6, width)
    weights = rng.uniform(0.0, 2.0, len(new))
    pads = [_padded(x, lengths, width)[0] for x in (new, old, adv)]
    mask = _padded(new, lengths, width)[1]
    w = _padded(weights, lengths, width)[0]
    neg_kl = np.clip(pads[0] - pads[1], -20.0, 20.0)
    ratio = np.exp(neg_kl)
    losses = np.maximum(-pads[2] * ratio, -pads[2] * np.clip(ratio, 1 - LOW, 1 + HIGH))
    losses = np.where(pads[2] < 0, np.minimum(-pads[2] * C, losses), losses)
    _, _, _, _, grad = _ref_policy(*pads, mask, LOW, HIGH, C, mode)
    logp = _t(new).requires_grad_(True)
    out = policy_losses.policy_loss(logp, _t(old), _t(adv), lengths=torch.tensor(lengths), clip_ratio_low=LOW,
                            clip_ratio_high=HIGH, clip_ratio_c=C, mode=mode,
                            scale=algos.LossScale.of(torch.tensor(lengths), width), is_weights=_t(weights))
    out.loss.backward()
    assert out.loss.item() == pytest.approx(_ref_agg(losses * w, mask, mode), abs=1e-10)
    _close(logp.grad, _flat(grad * w, lengths), atol=1e-10)


# ---------------------------------------------------------------------------
# value_loss, explained_variance

# token  V     Vold  R     clip(V, Vold +- 0.5)  (V-R)^2  (clip-R)^2  max    clipped?
#   1    1.0   0.8   2.0   1.0                   1        1           1      no (equal)
#   2    2.0   1.0   3.0   1.5                   1        2.25        2.25   yes
#  ---- sequence 2 ----
#   3    2.0   1.0   0.0   1.5                   4        2.25        4      no
#   4    0.0   1.0   1.0   0.5                   1        0.25        1      no
#   5   -1.0   0.0   0.0  -0.5                   1        0.25        1      no
#   6    0.0   1.0  -1.0   0.5                   1        2.25        2.25   yes
# sequence sums 3.25 and 8.25, total 11.5; clipfrac 2/6
VALUE_CASE = ([1.0, 2.0, 2.0, 0.0, -1.0, 0.0], [0.8, 1.0, 1.0, 1.0, 0.0, 1.0], [2.0, 3.0, 0.0, 1.0, 0.0, -1.0])
VALUE_EXPECTED = {  # 0.5 * aggregate; max_response_length 4
    "token-mean": 0.5 * 11.5 / 6,
    "seq-mean-token-sum": 0.5 * 11.5 / 2,
    "seq-mean-token-mean": 0.5 * (3.25 / 2 + 8.25 / 4) / 2,
    "seq-mean-token-sum-norm": 0.5 * 11.5 / 2 / 4,
}


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_by_hand(mode):
    lengths = torch.tensor([2, 4])
    values, old_values, returns = (_t(x) for x in VALUE_CASE)
    out = algos.value_loss(values, old_values, returns, lengths=lengths, cliprange_value=0.5, mode=mode,
                           scale=algos.LossScale.of(lengths, 4))
    assert isinstance(out, algos.ValueLoss)
    assert out.loss.item() == pytest.approx(VALUE_EXPECTED[mode], abs=1e-12)
    assert out.clipfrac.item() == pytest.approx(2 / 6, abs=1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_random_against_padded_reference(mode):
    rng = np.random.default_rng(23)
    for _ in range(3):
        lengths = _ragged_lengths(rng, 6, 8, 1)
        t = sum(lengths)
        old_values = rng.normal(size=t)
        values = old_values + rng.normal(0.0, 0.5, t)
        returns = rng.normal(size=t)
        pads = [_padded(x, lengths, 8)[0] for x in (values, old_values, returns)]
        mask = _padded(values, lengths, 8)[1]
        loss, clipfrac = _ref_value(*pads, mask, 0.2, mode)
        out = algos.value_loss(_t(values), _t(old_values), _t(returns), lengths=torch.tensor(lengths),
                               cliprange_value=0.2, mode=mode,
                               scale=algos.LossScale.of(torch.tensor(lengths), 8))
        assert out.loss.item() == pytest.approx(loss, abs=1e-10)
        assert out.clipfrac.item() == pytest.approx(clipfrac, abs=1e-6)
        assert clipfrac > 0


def test_explained_variance_by_hand():
    # returns [1, 2, 3, 4], values [1, 2, 3, 3]: residual [0, 0, 0, 1], unbiased var (3 * 1/16 + 9/16) / 3 = 1/4;
    # Var(returns) = 5/3 -> 1 - (1/4) / (5/3) = 1 - 0.15 = 0.85
    returns = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert algos.explained_variance(returns, torch.tensor([1.0, 2.0, 3.0, 3.0])) == pytest.approx(0.85, abs=1e-6)
    assert algos.explained_variance(returns, returns) == pytest.approx(1.0, abs=1e-7)
    # a constant prediction at the mean explains nothing: residual variance = Var(returns)
    assert algos.explained_variance(returns, torch.full((4,), 2.5)) == pytest.approx(0.0, abs=1e-6)
    assert algos.explained_variance(torch.tensor([1.0]), torch.tensor([0.0])) == 0.0


def test_explained_variance_random_against_statistics():
    rng = random.Random(8)
    returns = [rng.gauss(0, 2) for _ in range(40)]
    values = [r + rng.gauss(0, 1) for r in returns]
    residual = [r - v for r, v in zip(returns, values)]
    expected = 1 - statistics.variance(residual) / (statistics.variance(returns) + 1e-8)
    assert algos.explained_variance(_t(returns), _t(values)) == pytest.approx(expected, abs=1e-10)


# ---------------------------------------------------------------------------
# micro-batch accumulation: micro-batch losses with the mini-batch's LossScale add up to the mini-batch


MICRO_SPLITS = ((0, 3, 7), (0, 2, 5, 7))  # sequence boundaries: 2 and 3 micro-batches


def _micro_slices(lengths: list[int], bounds: tuple[int, ...]):
    """(token slice, sequence slice) of each micro-batch."""
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    return [(slice(starts[a], starts[b]), slice(a, b)) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_micro_batches_sum_to_full_batch_loss_and_gradient(mode):
    rng = np.random.default_rng(31)
    width = 10
    lengths, new, old, adv = _random_policy_batch(rng, 7, width)
    lens = torch.tensor(lengths)
    scale = algos.LossScale.of(lens, width)

    full_lp = _t(new).requires_grad_(True)
    full = policy_losses.policy_loss(full_lp, _t(old), _t(adv), lengths=lens, clip_ratio_low=LOW, clip_ratio_high=HIGH,
                             clip_ratio_c=C, mode=mode, scale=scale)
    full.loss.backward()
    assert full.clipfrac.item() > 0 and full.clipfrac_lower.item() > 0  # the case does exercise both clips

    for bounds in MICRO_SPLITS:
        micro_lp = _t(new).requires_grad_(True)
        parts = [policy_losses.policy_loss(micro_lp[tok], _t(old)[tok], _t(adv)[tok], lengths=lens[seq],
                                           clip_ratio_low=LOW,
                                   clip_ratio_high=HIGH, clip_ratio_c=C, mode=mode, scale=scale)
                 for tok, seq in _micro_slices(lengths, bounds)]
        total = sum(p.loss for p in parts)
        total.backward()
        assert total.item() == pytest.approx(full.loss.item(), abs=1e-6)
        for field in ("clipfrac", "clipfrac_lower", "approx_kl"):
            summed = sum(getattr(p, field).item() for p in parts)
            assert summed == pytest.approx(getattr(full, field).item(), abs=1e-6), field
        torch.testing.assert_close(micro_lp.grad, full_lp.grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_value_loss_micro_batches_sum_to_full_batch_loss_and_gradient(mode):
    rng = np.random.default_rng(37)
    width = 10
    lengths = _ragged_lengths(rng, 7, width, 1)
    t = sum(lengths)
    old_values, returns = rng.normal(size=t), rng.normal(size=t)
    values = old_values + rng.normal(0.0, 0.5, t)
    lens = torch.tensor(lengths)
    scale = algos.LossScale.of(lens, width)

    full_v = _t(values).requires_grad_(True)
    full = algos.value_loss(full_v, _t(old_values), _t(returns), lengths=lens, cliprange_value=0.2, mode=mode,
                            scale=scale)
    full.loss.backward()
    assert full.clipfrac.item() > 0

    for bounds in MICRO_SPLITS:
        micro_v = _t(values).requires_grad_(True)
        parts = [algos.value_loss(micro_v[tok], _t(old_values)[tok], _t(returns)[tok], lengths=lens[seq],
                                  cliprange_value=0.2, mode=mode,
                                  scale=scale)
                 for tok, seq in _micro_slices(lengths, bounds)]
        total = sum(p.loss for p in parts)
        total.backward()
        assert total.item() == pytest.approx(full.loss.item(), abs=1e-6)
        assert sum(p.clipfrac.item() for p in parts) == pytest.approx(full.clipfrac.item(), abs=1e-6)
        torch.testing.assert_close(micro_v.grad, full_v.grad, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------
# lr_factor, groups_with_signal


def test_lr_factor_warmup_then_constant():
    # warmup 4: (step + 1) / 4 -> 0.25, 0.5, 0.75, 1.0; then 1.0 for good
    got = [algos.lr_factor(s, 4, 100, style="constant", min_lr_ratio=0.0) for s in range(8)]
    assert got == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert algos.lr_factor(0, 0, 100, style="constant", min_lr_ratio=0.0) == 1.0  # no warmup


def test_lr_factor_warmup_first_updates_by_hand():
    # W = 4: update k (scheduler step k - 1) runs at lr * k / 4 -> 1/4, 2/4, 3/4 for the first three updates;
    # verl's step / W would give 0, 1/4, 2/4 (its first update at lr 0), which meshrl does not do.
    for style in ("constant", "cosine"):
        assert [algos.lr_factor(s, 4, 100, style=style, min_lr_ratio=0.0) for s in range(3)] == [0.25, 0.5, 0.75]
    # The trainer's Optimizer applies it that way (peak lr 1e-3, one optimizer step per update call). With a
    # constant gradient of 1, AdamW's bias-corrected moments are m = v = 1 at every step, so each step moves the
    # weight by -lr_k / (1 + 1e-8): -2.5e-4, -5e-4, -7.5e-4 (no weight decay).
    weight = torch.nn.Parameter(torch.zeros(1, dtype=F64))
    optimizer = Optimizer([weight], OptimSettings(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.999), grad_clip=1.0,
                                                  warmup_steps=4, warmup_style="constant", min_lr_ratio=0.0,
                                                  total_steps=100))
    moves = []
    for _ in range(3):
        before = weight.item()
        weight.grad = torch.ones(1, dtype=F64)
        optimizer.step()
        optimizer.advance_schedule()
        moves.append(weight.item() - before)
    assert moves == pytest.approx([-2.5e-4 / (1 + 1e-8), -5e-4 / (1 + 1e-8), -7.5e-4 / (1 + 1e-8)], abs=1e-15)


def test_lr_factor_cosine_by_hand():
    # warmup 4, total 14, min 0.1: the cosine spans steps 4..14 (10 steps)
    f = [algos.lr_factor(s, 4, 14, style="cosine", min_lr_ratio=0.1) for s in range(20)]
    assert f[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # same warmup ramp
    assert f[4] == pytest.approx(1.0)  # progress 0: 0.1 + 0.9 * 0.5 * (1 + cos 0) = 1
    assert f[9] == pytest.approx(0.55)  # progress 1/2: 0.1 + 0.9 * 0.5 * (1 + cos pi/2) = 0.55
    # progress 1/5 at step 6: 0.1 + 0.45 * (1 + cos(pi/5)) = 0.1 + 0.45 * 1.809017 = 0.914058
    assert f[6] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 5)), abs=1e-12)
    assert f[14] == pytest.approx(0.1)  # reaches min_lr_ratio at total_steps
    assert f[19] == pytest.approx(0.1)  # and stays there
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # non-increasing after warmup
    # no warmup, min 0: step 0 -> 1, step 5 of 10 -> 0.5, step 10 -> 0
    assert [algos.lr_factor(s, 0, 10, style="cosine", min_lr_ratio=0.0) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5,
                                                                                                               0.0])


def test_lr_factor_unknown_style_raises():
    with pytest.raises(ValueError, match="'linear'"):
        algos.lr_factor(5, 0, 10, style="linear", min_lr_ratio=0.0)


def test_groups_with_signal_by_hand():
    # interleaved groups: 4 -> scores [1, 0, 1] (signal); 9 -> [2, 2, 2] (all equal); 7 -> [5] (single);
    #                     1 -> [0.5, 0.5] (all equal)
    group_ids = torch.tensor([4, 9, 4, 9, 4, 7, 9, 1, 1])
    scores = torch.tensor([1.0, 2.0, 0.0, 2.0, 1.0, 5.0, 2.0, 0.5, 0.5])
    got = algos.groups_with_signal(scores, group_ids)
    assert got.dtype == torch.bool
    assert got.tolist() == [True, False, True, False, True, False, False, False, False]
    assert algos.groups_with_signal(torch.zeros(0), torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_groups_with_signal_random_against_loop_reference():
    rng = random.Random(21)
    for _ in range(20):
        group_ids = _random_groups(rng)
        scores = [rng.choice([0.0, 1.0]) for _ in group_ids]
        members = _group_members(scores, group_ids)
        expected = [len(set(members[g])) > 1 for g in group_ids]
        assert algos.groups_with_signal(torch.tensor(scores), torch.tensor(group_ids)).tolist() == expected


# ---------------------------------------------------------------------------
# token_logprobs / token_entropy / sequence_nll


def test_token_logprobs_and_entropy_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    # T = 1: softmax([0, ln 3]) = [1, 3] / 4 = [1/4, 3/4]
    assert algos.token_logprobs(logits, torch.tensor([0])).item() == pytest.approx(math.log(0.25), abs=1e-6)
    assert algos.token_logprobs(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75), abs=1e-6)
    # entropy = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - (3/4) ln 3 = 0.562335
    assert algos.token_entropy(logits).item() == pytest.approx(math.log(4) - 0.75 * math.log(3), abs=1e-6)
    # T = 2: softmax([0, ln 3 / 2]) = [1, sqrt 3] / (1 + sqrt 3)
    p0, p1 = 1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))
    got = algos.token_logprobs(logits, torch.tensor([1]), temperature=2.0).item()
    assert got == pytest.approx(math.log(p1), abs=1e-6)
    h = -(p0 * math.log(p0) + p1 * math.log(p1))
    assert algos.token_entropy(logits, temperature=2.0).item() == pytest.approx(h, abs=1e-6)


def test_token_logprobs_shapes_and_fp32_output():
    # [B, L, V] logits with [B, L] tokens -> [B, L]; half-precision logits come back as fp32.
    logits = torch.tensor([[[0.0, math.log(3.0), -math.inf], [1.0, 1.0, 1.0]]], dtype=torch.bfloat16)
    tokens = torch.tensor([[1, 2]])
    lp = algos.token_logprobs(logits, tokens)
    assert lp.shape == (1, 2) and lp.dtype == torch.float32
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.75), -math.log(3)]]), atol=1e-2, rtol=0)
    ent = algos.token_entropy(logits.float()[..., :2])
    assert ent.shape == (1, 2)
    assert ent[0, 1].item() == pytest.approx(math.log(2), abs=1e-6)  # uniform over 2


def test_token_logprobs_and_entropy_random_against_loop_reference():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 7, generator=gen, dtype=F64) * 3
    tokens = torch.randint(0, 7, (5,), generator=gen)
    for temperature in (1.0, 0.7):
        lp = algos.token_logprobs(logits, tokens, temperature)
        ent = algos.token_entropy(logits, temperature)
        for i, row in enumerate(logits.tolist()):
            scaled = [x / temperature for x in row]
            top = max(scaled)
            log_z = top + math.log(sum(math.exp(x - top) for x in scaled))
            logp = [x - log_z for x in scaled]
            assert lp[i].item() == pytest.approx(logp[int(tokens[i])], abs=1e-5)
            assert ent[i].item() == pytest.approx(-sum(math.exp(q) * q for q in logp), abs=1e-5)


def test_sequence_nll():
    lp = torch.tensor([-1.0, -2.0, -3.0])
    assert algos.sequence_nll(lp).item() == pytest.approx(2.0)  # 6 / 3
    assert algos.sequence_nll(lp, num_tokens=6).item() == pytest.approx(1.0)  # 6 / 6
    # two micro-batches with the whole count sum to the full-batch value
    halves = algos.sequence_nll(lp[:1], num_tokens=3) + algos.sequence_nll(lp[1:], num_tokens=3)
    assert halves.item() == pytest.approx(2.0)


def test_sequence_nll_with_a_loss_mask_counts_only_the_kept_tokens():
    lp = torch.tensor([-1.0, -2.0, -3.0, -6.0], requires_grad=True)
    mask = torch.tensor([True, False, True, False])
    loss = algos.sequence_nll(lp, mask=mask)
    assert loss.item() == pytest.approx(2.0)  # (1 + 3) / 2
    loss.backward()
    assert lp.grad.tolist() == [-0.5, 0.0, -0.5, 0.0]  # a masked token's gradient is exactly zero
    assert algos.sequence_nll(lp, num_tokens=4, mask=mask).item() == pytest.approx(1.0)  # 4 / the batch's 4


# ---------------------------------------------------------------------------
# logprob_diff (the weight check's comparison)


def test_logprob_diff_by_hand():
    # |delta| = 0.5, 0.25, 0, 1.25: mean 2 / 4 = 0.5, max 1.25 (dyadic numbers: exact)
    rollout = torch.tensor([-1.0, -2.25, -0.5, -4.0])
    trainer = torch.tensor([-1.5, -2.0, -0.5, -2.75])
    assert algos.logprob_diff(rollout, trainer) == algos.LogprobDiff(mean=0.5, max=1.25)
    assert algos.logprob_diff(trainer, rollout) == algos.LogprobDiff(mean=0.5, max=1.25)  # symmetric
    assert algos.logprob_diff(trainer, trainer) == algos.LogprobDiff(mean=0.0, max=0.0)


# topk_kl (the weight check's comparison of whole next-token distributions)


def test_topk_kl_by_hand():
    """A vocabulary of 5; the rollout's p = (0.5, 0.2, 0.15, 0.1, 0.05), its top-2 ids 0 and 1. Worked by hand:
    - q = (0.4, 0.3, 0.1, 0.1, 0.1): buckets {0}, {1}, tail: p (0.5, 0.2, 0.3), q (0.4, 0.3, 0.3);
      KL = 0.5 ln(5/4) + 0.2 ln(2/3) + 0.3 ln 1 = 0.5 * 0.2231435513 - 0.2 * 0.4054651081 = 0.0304787594.
    - q = (0.1, 0.1, 0.4, 0.3, 0.1), whose own top-2 (ids 2, 3) shares none of p's: p (0.5, 0.2, 0.3), q (0.1, 0.1,
      0.8); KL = 0.5 ln 5 + 0.2 ln 2 + 0.3 ln(3/8) = 0.8047189562 + 0.1386294361 - 0.2942487759 = 0.6490996164.
    - q = p: 0 at every position."""
    p_top = torch.tensor([[0.5, 0.2], [0.5, 0.2], [0.5, 0.2]]).log()
    q_at = torch.tensor([[0.4, 0.3], [0.1, 0.1], [0.5, 0.2]]).log()
    kl = algos.topk_kl(p_top, q_at)
    assert kl.dtype == torch.float64
    assert kl.tolist() == pytest.approx([0.0304787594, 0.6490996164, 0.0], abs=1e-7)
    assert algos.distribution_diff(kl) == pytest.approx((sum(kl.tolist()) / 3, float(kl[1])))


def test_topk_kl_is_at_most_the_kl_over_the_whole_vocabulary():
    """A coarsening of both distributions: never above their full KL (here random distributions, k = 3 of 11)."""
    generator = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(64, 11, generator=generator) * 2, dim=-1)
    q = torch.log_softmax(torch.randn(64, 11, generator=generator) * 2, dim=-1)
    top = p.topk(3, dim=-1)
    coarse = algos.topk_kl(top.values, q.gather(-1, top.indices))
    full = (p.exp() * (p - q)).sum(dim=-1).double()
    assert (coarse <= full + 1e-6).all() and (coarse >= -1e-9).all()
    assert float(coarse.mean()) > 0.1 * float(full.mean())  # it is not blind: most of the divergence shows


def test_topk_kl_of_a_vocabulary_smaller_than_k_and_of_a_tail_that_rounds_to_0():
    # the top-3 of a 2-token vocabulary: its third "token" has probability 0 and adds nothing; both tails are 0
    p_top = torch.tensor([[0.75, 0.25, 0.0]]).log()
    q_at = torch.tensor([[0.5, 0.5, 0.0]]).log()
    assert algos.topk_kl(p_top, q_at).item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5))
    # p has all its mass on its top-1, q none there: finite and large, not nan
    assert algos.topk_kl(torch.tensor([[0.0]]), torch.tensor([[-50.0]])).item() == pytest.approx(50.0)
    assert algos.distribution_diff(torch.tensor([0.5, math.nan])).max == math.inf
    assert algos.distribution_diff(torch.tensor([])) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same tokens"):
        algos.topk_kl(torch.zeros(2, 3), torch.zeros(2, 2))


def test_logprob_diff_counts_a_non_finite_logprob_as_infinitely_far_and_no_tokens_as_equal():
    trainer = torch.tensor([-1.0, -2.0])
    for bad in (math.nan, -math.inf, math.inf):
        diff = algos.logprob_diff(torch.tensor([-1.0, bad]), trainer)
        assert diff.mean == math.inf and diff.max == math.inf
    assert algos.logprob_diff(torch.tensor([]), torch.tensor([])) == algos.LogprobDiff(0.0, 0.0)
    with pytest.raises(ValueError, match="same tokens"):
        algos.logprob_diff(torch.tensor([-1.0]), trainer)
