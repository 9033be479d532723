"""The registered policy losses, as the trainer calls them, in float64 against references written here a different
way: a Python loop over each response and each of its tokens, on torch scalars (so autograd gives the
reference's gradient too), from each paper's formula. Random ragged batches with a loss mask (one response
entirely masked), advantages per token and per response, rollout-correction weights per token and per
response, each aggregation; the metrics under verl's names; micro-batches adding up to the mini-batch."""

from __future__ import annotations

import math
import random

import pytest
import torch

from services import algos
from services.algo_registry import POLICY_LOSSES, PolicyLossInputs, PolicyLossParams

F64 = torch.float64
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MAX_LENGTH = 9
LOW, HIGH = 0.2, 0.28


# ---------------------------------------------------------------- a batch, and how the references see it


def random_batch(seed: int, advantages_per: str = "token", weights_per: str | None = None, masked: bool = True):
    """A ragged batch: lengths 1..MAX_LENGTH (one response of 1 token), logprobs in (-3, 0), old logprobs up to
    +-0.5 away (many ratios outside the clip range), advantages per token or per response, a loss mask with one
    response entirely masked, rollout-correction weights per token or per response (or none)."""
    rng = random.Random(seed)
    lengths = [1] + [rng.randint(1, MAX_LENGTH) for _ in range(rng.randint(3, 6))]
    rng.shuffle(lengths)
    total = sum(lengths)
    logprobs = [-rng.uniform(0.01, 3.0) for _ in range(total)]
    old = [lp + rng.uniform(-0.5, 0.5) for lp in logprobs]
    if advantages_per == "token":
        advantages = [rng.gauss(0, 1) for _ in range(total)]
    else:
        advantages = [a for n in lengths for a in [rng.gauss(0, 1)] * n]
    mask = [rng.random() < 0.8 for _ in range(total)] if masked else [True] * total
    if masked:
        off = rng.randrange(len(lengths))
        start = sum(lengths[:off])
        mask[start:start + lengths[off]] = [False] * lengths[off]
    if weights_per is None:
        weights = None
    elif weights_per == "token":
        weights = [rng.uniform(0.3, 2.0) for _ in range(total)]
    else:
        weights = [w for n in lengths for w in [rng.uniform(0.3, 2.0)] * n]
    return {"lengths": lengths, "logprobs": logprobs, "old": old, "advantages": advantages, "mask": mask,
            "weights": weights}


def call(name: str, batch: dict, mode: str | None = None, scale_of: dict | None = None, **params):
    """The registered loss on ``batch`` (float64), its metrics, and the gradient of its loss w.r.t. the logprobs."""
    logprobs = torch.tensor(batch["logprobs"], dtype=F64, requires_grad=True)
    lengths = torch.tensor(batch["lengths"])
    mask = torch.tensor(batch["mask"])
    whole = scale_of or batch
    scale = algos.LossScale.of(torch.tensor(whole["lengths"]), MAX_LENGTH, torch.tensor(whole["mask"]))
    inputs = PolicyLossInputs(
        logprobs=logprobs, old_logprobs=torch.tensor(batch["old"], dtype=F64),
        advantages=torch.tensor(batch["advantages"], dtype=F64), lengths=lengths, mask=mask,
        is_weights=None if batch["weights"] is None else torch.tensor(batch["weights"], dtype=F64))
    settings = {"clip_ratio_low": LOW, "clip_ratio_high": HIGH, "clip_ratio_c": 3.0,
                "loss_agg_mode": mode or POLICY_LOSSES.get(name).loss_agg_mode, "scale": scale, **params}
    out = POLICY_LOSSES.get(name).fn(inputs, PolicyLossParams(**settings))
    out.loss.backward()
    return out, logprobs.grad


def responses(batch: dict, logprobs: list[torch.Tensor]):
    """Per response: a list of its tokens as (logprob scalar with grad, old, advantage, trained, weight)."""
    out, start = [], 0
    for n in batch["lengths"]:
        weights = batch["weights"] or [1.0] * len(batch["mask"])
        out.append([(logprobs[t], batch["old"][t], batch["advantages"][t], batch["mask"][t], weights[t])
                    for t in range(start, start + n)])
        start += n
    return out


def aggregate_reference(per_response_terms: list[list[torch.Tensor]], mode: str) -> torch.Tensor:
    """verl's aggregations, from each response's list of trained-token terms."""
    count = len(per_response_terms)
    tokens = sum(len(terms) for terms in per_response_terms)
    sums = [sum(terms, torch.zeros((), dtype=F64)) for terms in per_response_terms]
    if mode == "token-mean":
        return sum(sums, torch.zeros((), dtype=F64)) / max(tokens, 1)
    if mode == "seq-mean-token-sum":
        return sum(sums, torch.zeros((), dtype=F64)) / count
    if mode == "seq-mean-token-mean":
        return sum((s / max(len(terms), 1) for s, terms in zip(sums, per_response_terms)),
                   torch.zeros((), dtype=F64)) / count
    return sum(sums, torch.zeros((), dtype=F64)) / count / MAX_LENGTH  # seq-mean-token-sum-norm, verl >= 0.7.1


def reference(name: str, batch: dict, mode: str | None = None, **params):
    """(loss, gradient w.r.t. every logprob, metrics) of loss ``name`` from its paper's formula, token by token."""
    leaves = [torch.tensor(v, dtype=F64, requires_grad=True) for v in batch["logprobs"]]
    mode = mode or POLICY_LOSSES.get(name).loss_agg_mode
    loss, metrics = REFERENCES[name](responses(batch, leaves), mode, **params)
    loss.backward()
    return loss, [0.0 if leaf.grad is None else float(leaf.grad) for leaf in leaves], metrics


def token_metric(per_response, flag) -> float:
    trained = [tok for resp in per_response for tok in resp if tok[3]]
    return sum(flag(tok) for tok in trained) / max(len(trained), 1)


def ref_vanilla(per_response, mode, c=3.0):
    terms = []
    for resp in per_response:
        kept = []
        for lp, old, a, trained, w in resp:
            if not trained:
                continue
            ratio = torch.exp(torch.clamp(lp - old, -20, 20))
            term = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - LOW, 1 + HIGH))
            if a < 0:
                term = torch.minimum(term, torch.tensor(-a * c, dtype=F64))
            kept.append(w * term)
        terms.append(kept)
    return aggregate_reference(terms, mode), {"actor/ppo_kl": token_metric(per_response, lambda t: t[1] - float(t[0].detach()))}


def ref_gspo(per_response, mode):
    """GSPO: s_i = exp(mean of the response's log-ratios); token i,t contributes -A_t * s_i,t with s_i,t = s_i
    in value and s_i * grad log pi_t in gradient; clipped at [1 - low, 1 + high] as a whole."""
    terms, clipped = [], 0
    for resp in per_response:
        trained = [tok for tok in resp if tok[3]]
        if not trained:
            terms.append([])
            continue
        s = math.exp(sum(float(lp.detach()) - old for lp, old, *_ in trained) / len(trained))
        kept = []
        for lp, _old, a, _t, w in trained:
            s_t = s * torch.exp(lp - lp.detach())
            unclipped, bounded = -a * s_t, -a * torch.clamp(s_t, 1 - LOW, 1 + HIGH)
            clipped += float(bounded.detach()) > float(unclipped.detach())
            kept.append(w * torch.maximum(unclipped, bounded))
        terms.append(kept)
    count = sum(len(t) for t in terms)
    return aggregate_reference(terms, mode), {"actor/pg_clipfrac": clipped / max(count, 1),
                                              "actor/pg_clipfrac_lower": 0.0}


def ref_cispo(per_response, mode):
    """CISPO: -sg(clip(r_t, 1 - low, 1 + high)) A_t log pi_t."""
    terms = []
    for resp in per_response:
        kept = []
        for lp, old, a, trained, w in resp:
            if trained:
                weight = min(max(math.exp(float(lp.detach()) - old), 1 - LOW), 1 + HIGH)
                kept.append(-w * weight * a * lp)
        terms.append(kept)
    clipfrac = token_metric(per_response, lambda t: not (1 - LOW <= math.exp(float(t[0].detach()) - t[1]) <= 1 + HIGH))
    return aggregate_reference(terms, mode), {"actor/pg_clipfrac": clipfrac}


def ref_geo_mean(per_response, mode):
    """GMPO: per response, -mean(A) * exp(mean over tokens of the log-ratio clipped on the side sign(A_t) picks);
    a mean over responses; a response's rollout weight is the geometric mean of its tokens'."""
    per_sequence = []
    for resp in per_response:
        trained = [tok for tok in resp if tok[3]]
        if not trained:
            per_sequence.append(torch.zeros((), dtype=F64))
            continue
        logs = []
        for lp, old, a, _t, _w in trained:
            log_ratio = lp - old
            if a > 0:
                logs.append(torch.clamp(log_ratio, max=HIGH) if float(log_ratio.detach()) > HIGH else log_ratio)
            elif a < 0:
                logs.append(torch.clamp(log_ratio, min=-LOW) if float(log_ratio.detach()) < -LOW else log_ratio)
            else:
                logs.append(0 * log_ratio)
        mean_advantage = sum(a for _, _, a, _, _ in trained) / len(trained)
        weight = math.exp(sum(math.log(w) for *_, w in trained) / len(trained))
        per_sequence.append(-mean_advantage * torch.exp(sum(logs) / len(trained)) * weight)
    out = lambda t, sign: t[3] and (t[2] * sign > 0) and not (-LOW <= float(t[0].detach()) - t[1] <= HIGH)  # noqa: E731
    return sum(per_sequence) / len(per_response), {
        "actor/pg_clipfrac": token_metric(per_response, lambda t: out(t, 1)),
        "actor/pg_clipfrac_lower": token_metric(per_response, lambda t: out(t, -1))}


def ref_gpg(per_response, mode):
    terms = [[-w * a * lp for lp, _o, a, trained, w in resp if trained] for resp in per_response]
    return aggregate_reference(terms, mode), {"actor/pg_clipfrac": 0.0}


def covariances(per_response) -> dict[tuple[int, int], float]:
    """(A - mean A)(log pi - mean log pi) of each trained token, means over the trained tokens."""
    trained = {(i, t): tok for i, resp in enumerate(per_response) for t, tok in enumerate(resp) if tok[3]}
    mean_a = sum(tok[2] for tok in trained.values()) / len(trained)
    mean_lp = sum(float(tok[0].detach()) for tok in trained.values()) / len(trained)
    return {key: (tok[2] - mean_a) * (float(tok[0].detach()) - mean_lp) for key, tok in trained.items()}


def ref_clip_cov(per_response, mode, taken_out=None, lb=1.0, ub=5.0):
    """Clip-Cov: PPO's clipped surrogate (no dual-clip) with the tokens ``taken_out`` contributing 0 (all the
    candidates where None: tokens PPO left unclipped whose covariance is in (lb, ub))."""
    cov = covariances(per_response)
    terms, candidates = [], set()
    for i, resp in enumerate(per_response):
        kept = []
        for t, (lp, old, a, trained, w) in enumerate(resp):
            if not trained:
                continue
            ratio = torch.exp(lp - old)
            unclipped, bounded = -a * ratio, -a * torch.clamp(ratio, 1 - LOW, 1 + HIGH)
            if float(bounded.detach()) <= float(unclipped.detach()) and lb < cov[(i, t)] < ub:
                candidates.add((i, t))
            gone = (i, t) in (taken_out if taken_out is not None else candidates)
            kept.append(0 * lp if gone else w * torch.maximum(unclipped, bounded))
        terms.append(kept)
    count = len(cov)
    gone = taken_out if taken_out is not None else candidates
    return aggregate_reference(terms, mode), {"actor/pg_clipfrac": len(gone) / count, "candidates": candidates}


def ref_kl_cov(per_response, mode, ratio=0.0002, coef=0.1):
    """KL-Cov: -A r_t, plus coef |log r_t| on the max(1, int(N ratio)) trained tokens of largest covariance."""
    cov = covariances(per_response)
    chosen = set(sorted(cov, key=lambda key: -cov[key])[:max(1, int(len(cov) * ratio))])
    terms = []
    for i, resp in enumerate(per_response):
        kept = []
        for t, (lp, old, a, trained, w) in enumerate(resp):
            if trained:
                term = -a * torch.exp(lp - old)
                penalty = coef * torch.abs(lp - old) if (i, t) in chosen else 0 * lp
                kept.append(w * (term + penalty))
        terms.append(kept)
    return aggregate_reference(terms, mode), {
        "actor/ppo_kl": token_metric(per_response, lambda tok: abs(float(tok[0].detach()) - tok[1])),
        "actor/pg_clipfrac": 0.0}


REFERENCES = {"vanilla": ref_vanilla, "gspo": ref_gspo, "cispo": ref_cispo, "geo_mean": ref_geo_mean,
              "gpg": ref_gpg, "clip_cov": ref_clip_cov, "kl_cov": ref_kl_cov}


def assert_matches(out, grad, expected_loss, expected_grad, expected_metrics):
    assert float(out.loss.detach()) == pytest.approx(float(expected_loss.detach()), rel=1e-10, abs=1e-12)
    assert grad.tolist() == pytest.approx(expected_grad, rel=1e-9, abs=1e-12)
    for key, value in expected_metrics.items():
        if key.startswith("actor/"):
            assert out.metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key


# ---------------------------------------------------------------- random ragged batches


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("advantages_per", ["token", "sequence"])
@pytest.mark.parametrize("weights_per", [None, "token", "sequence"])
@pytest.mark.parametrize("name", ["gspo", "cispo", "geo_mean", "gpg", "vanilla"])
def test_loss_equals_its_papers_formula_token_by_token(name, seed, advantages_per, weights_per):
    batch = random_batch(seed, advantages_per, weights_per)
    out, grad = call(name, batch)
    assert_matches(out, grad, *reference(name, batch))
    approx_kl = sum(o - lp for o, lp, m in zip(batch["old"], batch["logprobs"], batch["mask"]) if m) / sum(
        batch["mask"])
    assert out.metrics["actor/ppo_kl"] == pytest.approx(approx_kl, rel=1e-10)
    assert set(out.metrics) == {"actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["gspo", "cispo", "gpg", "vanilla", "kl_cov"])
def test_each_aggregation_mode_is_honoured(name, mode):
    batch = random_batch(11, "token", "token")
    out, grad = call(name, batch, mode)
    assert_matches(out, grad, *reference(name, batch, mode))


def test_geo_mean_is_a_mean_over_responses_whatever_the_mode():
    batch = random_batch(12, "sequence")
    losses = {float(call("geo_mean", batch, mode)[0].loss.detach()) for mode in MODES}
    assert len(losses) == 1


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("weights_per", [None, "token"])
def test_clip_cov_takes_out_every_candidate_when_the_ratio_allows(seed, weights_per):
    batch = random_batch(seed, "token", weights_per)
    params = {"clip_cov_ratio": 1.0, "clip_cov_lb": 0.02, "clip_cov_ub": 0.9}
    out, grad = call("clip_cov", batch, **params)
    loss, expected_grad, metrics = reference("clip_cov", batch, lb=0.02, ub=0.9)
    assert metrics["candidates"], "the case must have candidates"
    assert_matches(out, grad, loss, expected_grad, metrics)


@pytest.mark.parametrize("seed", range(6))
def test_clip_cov_takes_out_its_ratio_of_tokens_at_random_among_the_candidates(seed):
    batch = random_batch(seed, "token", masked=False)
    trained = len(batch["mask"])
    ratio = 2.5 / trained  # two tokens
    torch.manual_seed(seed)
    out, grad = call("clip_cov", batch, clip_cov_ratio=ratio, clip_cov_lb=0.0, clip_cov_ub=5.0)
    _, full_grad, metrics = reference("clip_cov", batch, taken_out=set(), lb=0.0, ub=5.0)
    positions = [(i, t) for i, n in enumerate(batch["lengths"]) for t in range(n)]
    gone = {positions[k] for k in range(trained) if grad[k] == 0 and full_grad[k] != 0}
    assert len(gone) == min(2, len(metrics["candidates"])) and gone <= metrics["candidates"]
    loss, expected_grad, expected = reference("clip_cov", batch, taken_out=gone, lb=0.0, ub=5.0)
    assert_matches(out, grad, loss, expected_grad, expected)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ratio", [0.0002, 0.2])
@pytest.mark.parametrize("weights_per", [None, "sequence"])
def test_kl_cov_penalises_the_tokens_of_largest_covariance(seed, ratio, weights_per):
    batch = random_batch(seed, "token", weights_per)
    out, grad = call("kl_cov", batch, kl_cov_ratio=ratio, ppo_kl_coef=0.5)
    assert_matches(out, grad, *reference("kl_cov", batch, ratio=ratio, coef=0.5))


# ---------------------------------------------------------------- edges


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "geo_mean", "clip_cov", "kl_cov", "gpg"])
def test_an_all_masked_batch_has_zero_loss_gradient_and_metrics(name):
    batch = random_batch(3)
    batch["mask"] = [False] * len(batch["mask"])
    batch["logprobs"][0] = -math.inf  # a masked token's NaN or inf must not leak
    out, grad = call(name, batch)
    assert float(out.loss.detach()) == 0.0 and not grad.any() and not torch.isnan(grad).any()
    assert all(value == 0.0 for value in out.metrics.values())


@pytest.mark.parametrize("name", ["vanilla", "gspo", "cispo", "geo_mean", "gpg"])
def test_micro_batches_add_up_to_the_mini_batch(name):
    batch = random_batch(21, "sequence", "token")
    whole, whole_grad = call(name, batch)
    cut = len(batch["lengths"]) // 2
    split = sum(batch["lengths"][:cut])
    parts = []
    for rows, tokens in ((slice(0, cut), slice(0, split)), (slice(cut, None), slice(split, None))):
        part = {key: (value[rows] if key == "lengths" else value[tokens]) if value is not None else None
                for key, value in batch.items()}
        parts.append(call(name, part, scale_of=batch))
    assert float(sum(p[0].loss.detach() for p in parts)) == pytest.approx(float(whole.loss.detach()), rel=1e-12)
    assert torch.cat([p[1] for p in parts]).tolist() == pytest.approx(whole_grad.tolist(), rel=1e-10, abs=1e-15)
    for key, value in whole.metrics.items():
        assert sum(p[0].metrics[key] for p in parts) == pytest.approx(value, rel=1e-10, abs=1e-15), key


def test_gspo_uses_one_ratio_per_response():
    # one response, 2 tokens, log-ratios +0.1 and -0.3: s = exp(-0.1) = 0.905, inside [0.8, 1.28]; A = 1 on both:
    # loss (seq-mean-token-mean) = -s; each token's gradient -s / 2 (GSPO's s * mean grad log pi)
    batch = {"lengths": [2], "logprobs": [-1.0, -2.0], "old": [-1.1, -1.7], "advantages": [1.0, 1.0],
             "mask": [True, True], "weights": None}
    out, grad = call("gspo", batch)
    s = math.exp(-0.1)
    assert float(out.loss.detach()) == pytest.approx(-s) and grad.tolist() == pytest.approx([-s / 2, -s / 2])
