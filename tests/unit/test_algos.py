"""CPU tests of services/algos.py against hand-worked numbers and plain-Python references."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from services import algos


# ---------------------------------------------------------------------------
# grpo_advantages


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
    a = 0.5 / math.sqrt(1 / 3)
    s = math.sqrt(13)
    expected = torch.tensor([a, 0.0, -a, 0.0, -a, 0.0, a, -3 / s, -1 / s, 4 / s])
    got = algos.grpo_advantages(scores, group_ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_grpo_advantages_by_hand_without_std():
    scores, group_ids = _grpo_hand_case()
    # Dr. GRPO: score - group mean only; sizes-1 groups still 0.
    expected = torch.tensor([0.5, 0.0, -0.5, 0.0, -0.5, 0.0, 0.5, -3.0, -1.0, 4.0])
    got = algos.grpo_advantages(scores, group_ids, norm_by_std=False)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_grpo_advantages_singleton_and_equal_groups_are_zero():
    # Size-1 groups and all-equal groups (including a value not exact in binary) give 0, never nan.
    scores = torch.tensor([0.1, 7.0, 0.1, 0.1, -2.0])
    group_ids = torch.tensor([3, 4, 3, 3, 8])
    for norm in (True, False):
        got = algos.grpo_advantages(scores, group_ids, norm_by_std=norm)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, torch.zeros(5), atol=1e-6, rtol=0)


def test_grpo_advantages_eps_is_added_to_std():
    # group [0, 2]: mean 1, centred [-1, 1], var 2, std sqrt(2); eps = 1 -> +-1 / (sqrt(2) + 1)
    got = algos.grpo_advantages(torch.tensor([0.0, 2.0]), torch.tensor([0, 0]), eps=1.0)
    d = math.sqrt(2) + 1
    torch.testing.assert_close(got, torch.tensor([-1 / d, 1 / d]), atol=1e-6, rtol=0)


def _grpo_reference(scores: list[float], group_ids: list[int], norm_by_std: bool, eps: float) -> list[float]:
    members: dict[int, list[float]] = {}
    for score, gid in zip(scores, group_ids):
        members.setdefault(gid, []).append(score)
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
        group_ids = []
        for gid in rng.sample(range(1000), rng.randint(1, 8)):
            group_ids += [gid] * rng.randint(1, 7)  # ragged sizes, size 1 included
        rng.shuffle(group_ids)  # interleaved
        scores = [rng.choice([0.0, 1.0, rng.uniform(-3, 3)]) for _ in group_ids]
        expected = _grpo_reference(scores, group_ids, norm_by_std, eps=1e-6)
        got = algos.grpo_advantages(torch.tensor(scores), torch.tensor(group_ids), norm_by_std=norm_by_std)
        torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# ppo_clip_loss

LOW, HIGH = 0.2, 0.28  # clip-higher: ratio is clamped to [0.8, 1.28]


def _ppo_hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ratios = [1.1, 1.5, 0.5, 1.5, 0.5, 0.9, 1.25, 0.78]
    advantages = [1.0, 1.0, -1.0, -2.0, 2.0, -1.0, 1.0, -1.0]
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, -0.1, -2.5, -0.7], dtype=torch.float64)
    new = old + torch.log(torch.tensor(ratios, dtype=torch.float64))
    return new, old, torch.tensor(advantages, dtype=torch.float64)


def test_ppo_clip_loss_by_hand():
    new, old, adv = _ppo_hand_case()
    # token  A   r     -A*r    -A*clip(r,0.8,1.28)  max    clipped?
    #   1   +1  1.10  -1.10   -1.10                -1.10   no  (inside)
    #   2   +1  1.50  -1.50   -1.28                -1.28   yes (above 1+high)
    #   3   -1  0.50  +0.50   +0.80                +0.80   yes (below 1-low)
    #   4   -2  1.50  +3.00   +2.56                +3.00   no  (A<0 above: not clipped)
    #   5   +2  0.50  -1.00   -1.60                -1.00   no  (A>0 below: not clipped)
    #   6   -1  0.90  +0.90   +0.90                +0.90   no  (inside)
    #   7   +1  1.25  -1.25   -1.25                -1.25   no  (1.2 < r < 1.28: only inside with clip-higher)
    #   8   -1  0.78  +0.78   +0.80                +0.80   yes (0.72 < r < 0.8: low is 0.2, not 0.28)
    # sum = -1.10 - 1.28 + 0.80 + 3.00 - 1.00 + 0.90 - 1.25 + 0.80 = 0.87 -> loss 0.87 / 8 = 0.10875
    # clipfrac = 3 / 8 = 0.375
    # approx_kl = mean(old - new) = -ln(1.1 * 1.5 * 0.5 * 1.5 * 0.5 * 0.9 * 1.25 * 0.78) / 8
    #           = -ln(0.542953125) / 8 = 0.076340...
    out = algos.ppo_clip_loss(new, old, adv, LOW, HIGH)
    assert isinstance(out, algos.PolicyLoss)
    assert out.loss.item() == pytest.approx(0.10875, abs=1e-12)
    assert out.clipfrac.item() == pytest.approx(0.375, abs=1e-12)
    assert out.approx_kl.item() == pytest.approx(-math.log(0.542953125) / 8, abs=1e-12)


def test_ppo_clip_loss_symmetric_clip_differs_on_clip_higher_token():
    # Token 7 alone (A=+1, r=1.25): with high=0.28 it is inside -> loss -1.25, not clipped;
    # with high=0.2 it is clamped to 1.2 -> loss -1.2, clipped.
    new, old, adv = (t[6:7] for t in _ppo_hand_case())
    wide = algos.ppo_clip_loss(new, old, adv, 0.2, 0.28)
    narrow = algos.ppo_clip_loss(new, old, adv, 0.2, 0.2)
    assert wide.loss.item() == pytest.approx(-1.25) and wide.clipfrac.item() == 0.0
    assert narrow.loss.item() == pytest.approx(-1.2) and narrow.clipfrac.item() == 1.0


def _ppo_reference(new, old, adv, low, high, num_tokens):
    total = clipped = kl = 0.0
    for lp, olp, a in zip(new, old, adv):
        r = math.exp(lp - olp)
        unclipped = -a * r
        clip = -a * min(max(r, 1 - low), 1 + high)
        total += max(unclipped, clip)
        clipped += clip > unclipped
        kl += olp - lp
    return total / num_tokens, clipped / num_tokens, kl / num_tokens


def test_ppo_clip_loss_random_against_loop_reference():
    gen = torch.Generator().manual_seed(0)
    for t in (1, 7, 50):
        old = -torch.rand(t, generator=gen, dtype=torch.float64) * 3
        new = old + torch.randn(t, generator=gen, dtype=torch.float64) * 0.4
        adv = torch.randn(t, generator=gen, dtype=torch.float64)
        for num_tokens in (None, 3 * t):
            loss, clipfrac, kl = _ppo_reference(new.tolist(), old.tolist(), adv.tolist(), 0.2, 0.3, num_tokens or t)
            out = algos.ppo_clip_loss(new, old, adv, 0.2, 0.3, num_tokens=num_tokens)
            assert out.loss.item() == pytest.approx(loss, abs=1e-10)
            assert out.clipfrac.item() == pytest.approx(clipfrac, abs=1e-6)  # clipfrac is computed in fp32
            assert out.approx_kl.item() == pytest.approx(kl, abs=1e-10)


def test_ppo_clip_loss_micro_batches_sum_to_full_batch_loss_and_gradient():
    gen = torch.Generator().manual_seed(1)
    t, split = 40, 13
    old = -torch.rand(t, generator=gen) * 3
    new_values = old + torch.randn(t, generator=gen) * 0.4
    adv = torch.randn(t, generator=gen)

    full_lp = new_values.clone().requires_grad_(True)
    full = algos.ppo_clip_loss(full_lp, old, adv, 0.2, 0.28)
    full.loss.backward()

    micro_lp = new_values.clone().requires_grad_(True)
    parts = [
        algos.ppo_clip_loss(micro_lp[s], old[s], adv[s], 0.2, 0.28, num_tokens=t)
        for s in (slice(0, split), slice(split, t))
    ]
    for part in parts:
        part.loss.backward()  # gradients accumulate in micro_lp.grad

    assert sum(p.loss.item() for p in parts) == pytest.approx(full.loss.item(), abs=1e-6)
    assert sum(p.clipfrac.item() for p in parts) == pytest.approx(full.clipfrac.item(), abs=1e-6)
    assert sum(p.approx_kl.item() for p in parts) == pytest.approx(full.approx_kl.item(), abs=1e-6)
    assert full.clipfrac.item() > 0  # the case does exercise clipping
    torch.testing.assert_close(micro_lp.grad, full_lp.grad, atol=1e-6, rtol=0)


def test_ppo_clip_loss_gradient_is_zero_on_clipped_tokens():
    new, old, adv = _ppo_hand_case()
    new = new.clone().requires_grad_(True)
    algos.ppo_clip_loss(new, old, adv, LOW, HIGH).loss.backward()
    # d/d logp of -A * r / 8 is -A * r / 8 where unclipped; 0 where the clamp is active.
    ratios = [1.1, 1.5, 0.5, 1.5, 0.5, 0.9, 1.25, 0.78]
    advs = adv.tolist()
    expected = [0.0 if i in (1, 2, 7) else -advs[i] * ratios[i] / 8 for i in range(8)]
    torch.testing.assert_close(new.grad, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------
# token_logprobs / token_entropy


def test_token_logprobs_and_entropy_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0)]])
    # T = 1: softmax([0, ln 3]) = [1, 3] / 4 = [1/4, 3/4]
    lp = algos.token_logprobs(logits, torch.tensor([0]))
    assert lp.item() == pytest.approx(math.log(0.25), abs=1e-6)
    assert algos.token_logprobs(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75), abs=1e-6)
    # entropy = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - (3/4) ln 3 = 0.562335
    assert algos.token_entropy(logits).item() == pytest.approx(math.log(4) - 0.75 * math.log(3), abs=1e-6)
    # T = 2: softmax([0, ln 3 / 2]) = [1, sqrt 3] / (1 + sqrt 3)
    p0, p1 = 1 / (1 + math.sqrt(3)), math.sqrt(3) / (1 + math.sqrt(3))
    assert algos.token_logprobs(logits, torch.tensor([1]), temperature=2.0).item() == pytest.approx(
        math.log(p1), abs=1e-6
    )
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


# ---------------------------------------------------------------------------
# expand_per_token, sequence_nll


def test_expand_per_token():
    got = algos.expand_per_token(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2, 0, 3]))
    assert got.tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]
    assert algos.expand_per_token(torch.zeros(0), torch.zeros(0, dtype=torch.int64)).numel() == 0


def test_sequence_nll():
    lp = torch.tensor([-1.0, -2.0, -3.0])
    assert algos.sequence_nll(lp).item() == pytest.approx(2.0)  # 6 / 3
    assert algos.sequence_nll(lp, num_tokens=6).item() == pytest.approx(1.0)  # 6 / 6
    # two micro-batches with the whole count sum to the full-batch value
    halves = algos.sequence_nll(lp[:1], num_tokens=3) + algos.sequence_nll(lp[1:], num_tokens=3)
    assert halves.item() == pytest.approx(2.0)
