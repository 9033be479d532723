"""CPU tests, in float64, of the loss mask in services/algos.py: tool tokens inside a response train nothing.

Two responses hold tool tokens among the model's. Each term of the actor's loss (policy gradient with rollout
correction, entropy, KL) and the critic's value loss, computed by ``algos`` with the mask, must give the tool
tokens' logits (values) an exactly zero gradient, and equal a reference written here without ``algos``: plain
Python over the model's tokens only, as if the tool tokens had been taken out of the response mask by hand.
"""

from __future__ import annotations

import math

import pytest
import torch

from services import algos, estimators, policy_losses
from services.algo_registry import EstimatorInputs, EstimatorParams

F64 = torch.float64
LENGTHS = torch.tensor([6, 4])
# response 0: model, model, tool, tool, model, model; response 1: model, tool, model, model
MASK = torch.tensor([True, True, False, False, True, True, True, False, True, True])
VOCAB = 5
MAX_RESPONSE_LENGTH = 8


def compute_advantages(name, rewards, lengths, group_ids, values, gamma, lam, norm_by_std, mask=None, baselines=None):
    """The registered estimator ``name`` on these tensors (the coordinator's call)."""
    inputs = EstimatorInputs(rewards=rewards, lengths=lengths, group_ids=group_ids, mask=mask, values=values,
                             baselines=baselines)
    return estimators.compute_advantages(name, inputs, EstimatorParams(gamma, lam, norm_by_std))


def case() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tokens = int(LENGTHS.sum())
    return {
        "logits": torch.randn(tokens, VOCAB, generator=generator, dtype=F64),
        "targets": torch.randint(0, VOCAB, (tokens,), generator=generator),
        "old_logprobs": torch.randn(tokens, generator=generator, dtype=F64) * 0.3 - 1.6,
        "rollout_logprobs": torch.randn(tokens, generator=generator, dtype=F64) * 0.3 - 1.6,
        "ref_logprobs": torch.randn(tokens, generator=generator, dtype=F64) * 0.3 - 1.6,
        "advantages": torch.randn(tokens, generator=generator, dtype=F64),
    }


def model_tokens() -> list[list[int]]:
    """Each response's flat indices of the model's tokens (the ones MASK keeps)."""
    starts = [0, int(LENGTHS[0])]
    return [[i for i in range(start, start + int(n)) if MASK[i]] for start, n in zip(starts, LENGTHS.tolist())]


def reference_aggregate(per_token: dict[int, float], mode: str) -> float:
    """verl's aggregation over the model's tokens only: their count is the token count of each response."""
    responses = model_tokens()
    sums = [sum(per_token[i] for i in tokens) for tokens in responses]
    if mode == "token-mean":
        return sum(sums) / sum(len(tokens) for tokens in responses)
    if mode == "seq-mean-token-sum":
        return sum(sums) / len(responses)
    if mode == "seq-mean-token-mean":
        return sum(s / len(tokens) for s, tokens in zip(sums, responses)) / len(responses)
    return sum(sums) / len(responses) / MAX_RESPONSE_LENGTH  # seq-mean-token-sum-norm, verl >= 0.7.1


def reference_terms(data: dict[str, torch.Tensor], mode: str) -> dict[str, float]:
    """Policy-gradient (token-level truncated rollout correction, threshold 2, dual-clip 3), entropy and k3 KL
    losses, by hand."""
    pg, entropy, kl = {}, {}, {}
    for i in [i for tokens in model_tokens() for i in tokens]:
        row = data["logits"][i].tolist()
        log_z = math.log(sum(math.exp(x) for x in row))
        logprob = row[int(data["targets"][i])] - log_z
        old, advantage = float(data["old_logprobs"][i]), float(data["advantages"][i])
        ratio = math.exp(logprob - old)
        loss = max(-advantage * ratio, -advantage * min(max(ratio, 0.8), 1.28))
        if advantage < 0:
            loss = min(loss, -advantage * 3.0)
        pg[i] = min(math.exp(old - float(data["rollout_logprobs"][i])), 2.0) * loss
        entropy[i] = -sum(math.exp(x - log_z) * (x - log_z) for x in row)
        log_ratio = float(data["ref_logprobs"][i]) - logprob
        kl[i] = math.exp(log_ratio) - log_ratio - 1
    return {name: reference_aggregate(values, mode) for name, values in (("pg", pg), ("entropy", entropy),
                                                                          ("kl", kl))}


def masked_terms(data: dict[str, torch.Tensor], logits: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """The same three losses from ``algos``, given the mask."""
    scale = algos.LossScale.of(LENGTHS, MAX_RESPONSE_LENGTH, MASK)
    logprobs = algos.token_logprobs(logits, data["targets"])
    weights = algos.rollout_is_weights(data["old_logprobs"], data["rollout_logprobs"], LENGTHS, level="token",
                                       mode="truncate", threshold=2.0, mask=MASK)
    pg = policy_losses.policy_loss(logprobs, data["old_logprobs"], data["advantages"], lengths=LENGTHS,
                                   clip_ratio_low=0.2,
                           clip_ratio_high=0.28, clip_ratio_c=3.0, mode=mode, scale=scale,
                           is_weights=weights.weights, mask=MASK)
    entropy = algos.aggregate(algos.token_entropy(logits), LENGTHS, mode, scale=scale, mask=MASK)
    kl = algos.aggregate(algos.kl_penalty(logprobs, data["ref_logprobs"], "k3"), LENGTHS, mode, scale=scale, mask=MASK)
    return {"pg": pg.loss, "entropy": entropy, "kl": kl}


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("term", ["pg", "entropy", "kl"])
def test_tool_tokens_have_no_gradient_and_the_loss_of_the_model_tokens_alone(mode, term):
    data = case()
    logits = data["logits"].clone().requires_grad_(True)
    loss = masked_terms(data, logits, mode)[term]
    loss.backward()
    assert logits.grad is not None
    assert torch.equal(logits.grad[~MASK], torch.zeros(int((~MASK).sum()), VOCAB, dtype=F64)), (mode, term)
    assert logits.grad[MASK].abs().sum() > 0
    assert float(loss.detach()) == pytest.approx(reference_terms(data, mode)[term], rel=1e-12, abs=1e-12)


def test_whatever_the_tool_tokens_hold_changes_nothing():
    """Tool tokens with wild inputs (huge logits, advantages, a rollout logprob far off) give the same loss."""
    data = case()
    wild = {key: value.clone() for key, value in data.items()}
    wild["logits"][~MASK] = 1e4
    for key in ("advantages", "old_logprobs", "rollout_logprobs", "ref_logprobs"):
        wild[key][~MASK] = -50.0
    for mode in algos.LOSS_AGG_MODES:
        plain, changed = masked_terms(data, data["logits"], mode), masked_terms(wild, wild["logits"], mode)
        for term in plain:
            assert float(changed[term]) == float(plain[term]), (mode, term)


def test_rollout_correction_weights_skip_tool_tokens():
    """Tool tokens get weight 0 and never exceed; a response's sequence ratio multiplies its model tokens' only."""
    data = case()
    old, rollout = data["old_logprobs"], data["rollout_logprobs"].clone()
    rollout[~MASK] = old[~MASK] - 30.0  # a ratio of e^30 on every tool token: ignored
    weights = algos.rollout_is_weights(old, rollout, LENGTHS, level="sequence", mode="mask", threshold=1e9,
                                       mask=MASK)
    assert torch.equal(weights.weights[~MASK], torch.zeros(int((~MASK).sum()), dtype=F64))
    assert not weights.exceeded[~MASK].any()
    for tokens in model_tokens():
        expected = math.exp(sum(float(old[i] - rollout[i]) for i in tokens))
        for i in tokens:
            assert float(weights.weights[i]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_value_loss_covers_the_model_tokens_only(mode):
    generator = torch.Generator().manual_seed(4)
    tokens = int(LENGTHS.sum())
    values = torch.randn(tokens, generator=generator, dtype=F64).requires_grad_(True)
    old_values = torch.randn(tokens, generator=generator, dtype=F64)
    returns = torch.randn(tokens, generator=generator, dtype=F64)
    scale = algos.LossScale.of(LENGTHS, MAX_RESPONSE_LENGTH, MASK)
    result = algos.value_loss(values, old_values, returns, lengths=LENGTHS, cliprange_value=0.2, mode=mode, scale=scale,
                              mask=MASK)
    result.loss.backward()
    assert values.grad is not None
    assert torch.equal(values.grad[~MASK], torch.zeros(int((~MASK).sum()), dtype=F64))
    per_token = {}
    for i in [i for indices in model_tokens() for i in indices]:
        v, old, r = float(values.detach()[i]), float(old_values[i]), float(returns[i])
        per_token[i] = max((v - r) ** 2, (min(max(v, old - 0.2), old + 0.2) - r) ** 2)
    assert float(result.loss.detach()) == pytest.approx(0.5 * reference_aggregate(per_token, mode), rel=1e-12)


def test_loss_scale_counts_the_model_tokens():
    assert algos.LossScale.of(LENGTHS, MAX_RESPONSE_LENGTH, MASK) == algos.LossScale(7, 2, MAX_RESPONSE_LENGTH)
    assert algos.LossScale.of(LENGTHS, MAX_RESPONSE_LENGTH) == algos.LossScale(10, 2, MAX_RESPONSE_LENGTH)


def test_mismatch_metrics_describe_the_model_tokens_only():
    data = case()
    rollout = data["rollout_logprobs"].clone()
    rollout[~MASK] = data["old_logprobs"][~MASK] - 30.0
    metrics = algos.mismatch_metrics(rollout, data["old_logprobs"], LENGTHS, mask=MASK)
    kept = algos.mismatch_metrics(rollout[MASK], data["old_logprobs"][MASK], torch.tensor([4, 3]))
    assert metrics == pytest.approx(kept, rel=1e-12)


# ---------------------------------------------------------------------------
# advantages: the coordinator's side


def test_the_score_sits_on_the_last_model_token():
    tools_last = torch.tensor([True, True, False, False, True, False, True, False, True, True])
    rewards = algos.token_rewards(torch.tensor([2.0, 3.0]), LENGTHS, mask=tools_last)
    assert rewards.tolist() == [0, 0, 0, 0, 2.0, 0, 0, 0, 0, 3.0]
    kl = torch.ones(10)
    penalised = algos.token_rewards(torch.tensor([2.0, 3.0]), LENGTHS, kl, kl_coef=0.5, mask=tools_last)
    assert penalised.tolist() == [-0.5, -0.5, 0, 0, 1.5, 0, -0.5, 0, -0.5, 2.5]


def reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """Plain GAE over one response's model tokens, taken out of it by hand."""
    advantages, running, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * next_value - values[t] + gamma * lam * running
        advantages[t], next_value = running, values[t]
    return advantages


def test_gae_passes_over_tool_tokens_as_if_they_were_taken_out():
    generator = torch.Generator().manual_seed(5)
    rewards = torch.randn(10, generator=generator)
    values = torch.randn(10, generator=generator)
    result = compute_advantages("gae", rewards, LENGTHS, torch.tensor([0, 1]), values, 0.9, 0.8, True, MASK)
    raw, model_returns = [], []
    for tokens in model_tokens():
        advantages = reference_gae([float(rewards[i]) for i in tokens], [float(values[i]) for i in tokens], 0.9, 0.8)
        raw += advantages
        model_returns += [a + float(values[i]) for a, i in zip(advantages, tokens)]
    mean, std = sum(raw) / len(raw), math.sqrt(sum((a - sum(raw) / len(raw)) ** 2 for a in raw) / (len(raw) - 1))
    whitened = [(a - mean) / math.sqrt(std ** 2 + algos.WHITEN_EPS) for a in raw]
    assert result.advantages[MASK].tolist() == pytest.approx(whitened, rel=1e-5, abs=1e-6)
    assert result.returns[MASK].tolist() == pytest.approx(model_returns, rel=1e-5, abs=1e-6)
    assert not result.advantages[~MASK].any() and not result.returns[~MASK].any()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_every_estimator_leaves_tool_tokens_without_advantage(estimator):
    rewards = algos.token_rewards(torch.tensor([1.0, 0.0]), LENGTHS, mask=MASK)
    result = compute_advantages(estimator, rewards, LENGTHS, torch.tensor([0, 0]), None, 0.9, 1.0, True, MASK)
    assert not result.advantages[~MASK].any() and not result.returns[~MASK].any()
    assert result.advantages[MASK].abs().sum() > 0
