"""The actor's micro-batches accumulate to exactly the gradient of the whole mini-batch, on a real model."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from services import algos
from services.common.sequences import SequenceBatch
from services.coordctl.tiny_model import build_tiny_model
from services.run.models import load_causal_lm
from services.trainer.actor import Actor, ActorSettings, UpdateInputs
from services.trainer.batching import MicroBatching
from services.trainer.forward import batched_candidate_logprobs, batched_top_logprobs, response_logprobs, split_top
from services.trainer.optim import OptimSettings, chunks
from services.trainer.ranks import Ranks

OPTIM = OptimSettings(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), grad_clip=1.0, warmup_steps=0,
                      warmup_style="constant", min_lr_ratio=0.0, total_steps=10)
WARM_START = OptimSettings(lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), grad_clip=1.0, warmup_steps=0,
                           warmup_style="constant", min_lr_ratio=0.0, total_steps=1)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", hidden_size=32, num_layers=1, num_heads=2, seed=0)


def settings(mode: str, micro: int) -> ActorSettings:
    return ActorSettings(mini_batch_size=6, micro_batch_size=micro, epochs=1, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         clip_ratio_c=3.0, loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True,
                         kl_loss_coef=0.1, kl_loss_type="low_var_kl", temperature=0.9, max_response_length=7)


def tiny_case(model_path) -> tuple[Actor, SequenceBatch, UpdateInputs]:
    """A float64 actor and six sequences (responses of 7, 1, 4, 6, 3 and 5 tokens) with random inputs."""
    torch.manual_seed(0)
    actor = Actor(load_causal_lm(model_path).double(), OPTIM, WARM_START, pad_id=0, seed=0)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 70, (n,), generator=generator).tolist() for n in (2, 5, 3, 4, 1, 6)]
    responses = [torch.randint(3, 70, (n,), generator=generator).tolist() for n in (7, 1, 4, 6, 3, 5)]
    batch = SequenceBatch.of_lists(prompts, responses)
    tokens = batch.num_response_tokens
    inputs = UpdateInputs(old_logprobs=torch.randn(tokens, generator=generator, dtype=torch.float64) - 4,
                          advantages=torch.randn(tokens, generator=generator, dtype=torch.float64),
                          ref_logprobs=torch.randn(tokens, generator=generator, dtype=torch.float64) - 4)
    return actor, batch, inputs


def accumulate(model_path, inputs: UpdateInputs | None, actor_settings: ActorSettings) -> list[torch.Tensor]:
    """The gradient of one mini-batch (the whole batch) accumulated over micro-batches; tiny_case's inputs
    unless ``inputs`` are given."""
    actor, batch, case_inputs = tiny_case(model_path)
    scale = algos.LossScale.of(batch.response_lens, 7)
    actor.model.train()
    for part in chunks(torch.arange(len(batch)), actor_settings.micro_batch_size):
        actor._micro_batch_loss(batch, part, inputs or case_inputs, settings=actor_settings, scale=scale)
    return [p.grad.clone() for p in actor.model.parameters()]


def gradient(model_path, mode: str, micro: int) -> list[torch.Tensor]:
    return accumulate(model_path, None, settings(mode, micro))


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_micro_batches_accumulate_to_the_mini_batch_gradient(model_path, mode):
    whole = gradient(model_path, mode, micro=6)
    for micro in (1, 4):
        parts = gradient(model_path, mode, micro=micro)
        for full, accumulated in zip(whole, parts):
            assert torch.allclose(full, accumulated, atol=1e-6, rtol=0), (mode, micro)


# ---------------------------------------------------------------------------
# rollout correction


def pg_only(**correction) -> ActorSettings:
    """The policy-gradient term alone (no entropy bonus, no KL loss), so its weights are all that changes."""
    return replace(settings("token-mean", 4), entropy_coeff=0.0, use_kl_loss=False, **correction)


def test_correction_with_rollout_logprobs_equal_to_old_changes_no_update(model_path):
    results = []
    for correction in ({}, {"rollout_is": "token"}, {"rollout_is": "sequence", "rollout_is_mode": "mask"}):
        actor, batch, inputs = tiny_case(model_path)
        inputs = replace(inputs, rollout_logprobs=inputs.old_logprobs.clone())
        metrics = actor.update(batch, inputs, replace(settings("token-mean", 4), **correction))
        results.append((metrics, [p.detach().clone() for p in actor.model.parameters()]))
    off_metrics, off_weights = results[0]
    for metrics, weights in results[1:]:  # every weight is exp(0) = 1: the same update, bit for bit
        assert all(torch.equal(off, on) for off, on in zip(off_weights, weights))
        assert {key: value for key, value in metrics.items() if not key.startswith("rollout_corr/")} == off_metrics
        assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-12)
        assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == 0.0


@pytest.mark.parametrize(("ratio", "mode", "factor"), [
    (1.5, "truncate", 1.5),  # under the threshold 2: every token's loss is weighted 1.5
    (3.0, "truncate", 2.0),  # above it: truncated to 2
    (3.0, "mask", 0.0),  # above it: masked, nothing is left of the policy gradient
])
def test_uniform_rollout_ratio_scales_the_policy_gradient(model_path, ratio, mode, factor):
    _, _, inputs = tiny_case(model_path)
    plain = accumulate(model_path, inputs, pg_only())
    # rollout logprobs ln(ratio) below the trainer's: pi_old / pi_rollout = ratio on every token
    shifted = replace(inputs, rollout_logprobs=inputs.old_logprobs - math.log(ratio))
    corrected = accumulate(model_path, shifted, pg_only(rollout_is="token", rollout_is_mode=mode))
    for expected, got in zip(plain, corrected):  # logprobs are fp32 (token_logprobs), so is the agreement
        torch.testing.assert_close(got, factor * expected, rtol=1e-5, atol=1e-7)


def test_masked_response_drops_out_of_the_gradient_like_a_zero_advantage(model_path):
    # The fourth response (tokens 12..17) is 0.2 nats per token less likely under the rollout: its sequence
    # ratio e^1.2 = 3.3 is above 2 and masked; the others' ratios are 1. With token-mean the divisor stays 26
    # tokens, so this is the gradient of the same loss with zero advantages on tokens 12..17.
    _, _, inputs = tiny_case(model_path)
    rollout = inputs.old_logprobs.clone()
    rollout[12:18] -= 0.2
    corrected = accumulate(model_path, replace(inputs, rollout_logprobs=rollout),
                           pg_only(rollout_is="sequence", rollout_is_mode="mask"))
    advantages = inputs.advantages.clone()
    advantages[12:18] = 0.0
    dropped = accumulate(model_path, replace(inputs, advantages=advantages), pg_only())
    for expected, got in zip(dropped, corrected):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_the_lr_logged_is_the_one_the_update_ran_at(model_path):
    """With a 4-step warm-up the first updates run at lr/4, lr/2 (lr_factor), and that is what actor/lr says."""
    _, batch, inputs = tiny_case(model_path)
    actor = Actor(load_causal_lm(model_path).double(), replace(OPTIM, warmup_steps=4), WARM_START, pad_id=0,
                  seed=0)
    logged = [actor.update(batch, inputs, settings("token-mean", 6))["actor/lr"] for _ in range(2)]
    assert logged == pytest.approx([1e-3 / 4, 1e-3 / 2])


def test_the_warm_start_follows_its_own_schedule(model_path):
    """A warm start of 6 steps with a 2-step warm-up and a cosine to 0.1: lr/2, lr, then down the cosine
    (algos.lr_factor over the warm start's steps), logged as warm_start/lr; the actor's RL schedule is untouched."""
    _, batch, _ = tiny_case(model_path)
    warm = replace(WARM_START, warmup_steps=2, warmup_style="cosine", min_lr_ratio=0.1, total_steps=6)
    actor = Actor(load_causal_lm(model_path).double(), replace(OPTIM, warmup_steps=4), warm, pad_id=0, seed=0)
    micro = settings("token-mean", 6).micro
    logged = [actor.train_supervised(batch, micro)["warm_start/lr"] for _ in range(6)]
    expected = [1e-3 * algos.lr_factor(step, 2, 6, style="cosine", min_lr_ratio=0.1) for step in range(6)]
    assert logged == pytest.approx(expected)
    assert logged[:2] == pytest.approx([5e-4, 1e-3])
    assert logged[2] > logged[3] > logged[4] > logged[5] > 1e-4
    assert actor.optimizer.lr == pytest.approx(1e-3 / 4)  # the RL update's warm-up has not begun


def test_the_warm_start_trains_only_the_tokens_the_loss_mask_keeps(model_path):
    """A warm start step over two micro-batches with a loss mask (a tool reply's tokens inside responses, and at
    the end of some): its loss is the NLL of the kept tokens alone, computed here by hand, and so is its gradient
    (the same norm); masked tokens at a response's end, which nothing kept reads, can be anything: the step gives
    the same weights."""
    _, batch, _ = tiny_case(model_path)
    mask = torch.ones(batch.num_response_tokens, dtype=torch.bool)
    # responses of 7, 1, 4, 6, 3, 5 tokens (rows at 0, 7, 8, 12, 18, 21): inside rows 0 and 3, the ends of 1, 2, 5
    mask[[2, 3, 4, 7, 10, 11, 13, 14, 24, 25]] = False
    masked = replace(batch, loss_mask=mask)

    reference = load_causal_lm(model_path).double()
    logprobs, _ = response_logprobs(reference, masked, 0, temperature=1.0, with_entropy=False,
                                    device=torch.device("cpu"))
    hand_loss = -logprobs[mask].sum() / mask.sum()
    hand_loss.backward()
    hand_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))

    def stepped(tails: SequenceBatch) -> tuple[dict[str, float], list[torch.Tensor]]:
        actor = Actor(load_causal_lm(model_path).double(), OPTIM, WARM_START, pad_id=0, seed=0)
        metrics = actor.train_supervised(tails, settings("token-mean", 2).micro)
        return metrics, [p.detach().clone() for p in actor.model.parameters()]

    metrics, weights = stepped(masked)
    assert metrics["warm_start/loss"] == pytest.approx(float(hand_loss.detach()), rel=1e-9)
    assert metrics["warm_start/grad_norm"] == pytest.approx(float(hand_norm), rel=1e-9)
    other_tails = masked.response_ids.clone()
    other_tails[[7, 10, 11, 24, 25]] += 1  # the masked ends of rows 1, 2 and 5
    _, same = stepped(replace(masked, response_ids=other_tails))
    for before, after in zip(weights, same):
        assert torch.equal(before, after)
    _, unmasked = stepped(batch)
    assert not all(torch.equal(a, b) for a, b in zip(weights, unmasked))


# ---------------------------------------------------------------------------
# one optimizer step without old logprobs (actor.recompute_old_log_prob)


def test_one_step_on_its_own_logprobs_is_the_update_on_those_of_a_pass_before_it(model_path):
    """The whole batch in one optimizer step (two micro-batches), with the KL loss and the rollout correction:
    old logprobs from a no-grad pass, or none (each micro-batch's own, detached), give the same weights and loss
    metrics, and the update without them reports the mismatch metrics the coordinator computes from the pass."""
    one_step = replace(settings("token-mean", 4), rollout_is="token")
    actor, batch, inputs = tiny_case(model_path)
    rollout = inputs.old_logprobs.clone()  # tiny_case's random old logprobs stand for the rollout's
    passed = actor.compute_log_probs(batch, one_step.temperature, one_step.micro)
    with_pass = actor.update(batch, replace(inputs, old_logprobs=passed, rollout_logprobs=rollout), one_step)
    own_actor, _, _ = tiny_case(model_path)
    own = own_actor.update(batch, replace(inputs, old_logprobs=None, rollout_logprobs=rollout), one_step)
    for expected, got in zip(actor.model.parameters(), own_actor.model.parameters()):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert own["actor/pg_clipfrac"] == 0.0 and own["actor/ppo_kl"] == 0.0
    mismatch = algos.mismatch_metrics(rollout, passed, batch.response_lens)
    assert set(mismatch) < set(own) and not set(mismatch) & set(with_pass)
    assert {key: own[key] for key in with_pass} == pytest.approx(with_pass, rel=1e-9, abs=1e-12)
    assert {key: own[key] for key in mismatch} == pytest.approx(mismatch, rel=1e-9, abs=1e-12)


def test_more_than_one_optimizer_step_needs_old_logprobs(model_path):
    actor, batch, inputs = tiny_case(model_path)
    for split in ({"mini_batch_size": 3}, {"epochs": 2}):
        with pytest.raises(ValueError, match="old_logprobs"):
            actor.update(batch, replace(inputs, old_logprobs=None), replace(settings("token-mean", 4), **split))


# ---------------------------------------------------------------------------
# a loss mask: tool tokens inside the responses


def test_tool_tokens_give_their_logits_no_gradient(model_path):
    """Every third response token is a tool's: with the policy-gradient, entropy and KL terms and the rollout
    correction on, the logits that predict those tokens get an exactly zero gradient, those of the model's tokens
    do not, and the entropy metric is the mean over the model's tokens."""
    actor, batch, inputs = tiny_case(model_path)
    mask = torch.arange(batch.num_response_tokens) % 3 != 1
    tools = replace(batch, loss_mask=mask)
    actor_settings = replace(settings("token-mean", 4), rollout_is="token")
    inputs = replace(inputs, rollout_logprobs=inputs.old_logprobs - 0.1)
    logits = []

    def keep(_module, _args, output):
        output.retain_grad()
        logits.append(output)

    head = actor.model.get_output_embeddings().register_forward_hook(keep)
    actor.model.train()
    stats, _ = actor._micro_batch_loss(tools, torch.arange(len(batch)), inputs, settings=actor_settings,
                                       scale=algos.LossScale.of(batch.response_lens, 7, mask))
    head.remove()
    grad = logits[0].grad[:, :-1][batch.padded().response_mask]  # [T, V], aligned with the response tokens
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    assert (grad[mask].abs().sum(-1) > 0).all()
    with torch.no_grad():
        _, entropy = response_logprobs(actor.model, batch, 0, temperature=actor_settings.temperature, with_entropy=True,
                                       device=torch.device("cpu"))
    assert stats["actor/entropy"] == pytest.approx(float(entropy[mask].mean()), rel=1e-12)


@pytest.mark.parametrize("micro", [MicroBatching(size=6), MicroBatching(size=2, remove_padding=True)])
def test_candidate_logprobs_are_the_plain_forward_s_log_softmax_at_the_given_ids(model_path, micro):
    """The weight check's trainer side: at each response position, the logprob of the token itself (as the
    logprob pass gives it) and of each candidate id, from one unpadded forward's log-softmax; in micro-batches of
    two rows, packed, the rows' candidates still land on their own positions."""
    actor, batch, _ = tiny_case(model_path)
    generator = torch.Generator().manual_seed(2)
    candidates = torch.randint(0, actor.model.config.vocab_size, (batch.num_response_tokens, 3), generator=generator)
    scored = batched_candidate_logprobs(actor.model, batch, candidate_ids=candidates, pad_id=0, temperature=1.0,
                                        micro=micro, ranks=Ranks.single("cpu"))
    assert scored.shape == (batch.num_response_tokens, 4)
    own = actor.compute_log_probs(batch, 1.0, MicroBatching(size=6))
    torch.testing.assert_close(scored[:, 0], own, atol=1e-9, rtol=0)
    want, start = [], 0
    for row in range(len(batch)):
        prompt = batch.prompt_ids[batch.prompt_lens[:row].sum():batch.prompt_lens[:row + 1].sum()].tolist()
        length = int(batch.response_lens[row])
        response = batch.response_ids[start:start + length].tolist()
        with torch.no_grad():
            logits = actor.model(input_ids=torch.tensor([prompt + response])).logits[0]
        want.append(torch.log_softmax(logits[len(prompt) - 1:len(prompt) + length - 1], -1)
                    .gather(-1, candidates[start:start + length]))
        start += length
    torch.testing.assert_close(scored[:, 1:], torch.cat(want), atol=1e-9, rtol=0)


@pytest.mark.parametrize("micro", [MicroBatching(size=6), MicroBatching(size=2, remove_padding=True)])
def test_top_logprobs_are_the_most_likely_ids_with_the_numbers_the_candidate_pass_gives_them(model_path, micro):
    """The weight check's trainer side, asked beside the rollouts: at each response position the token's logprob
    and the k most likely next ids, most likely first, each with the very logprob (bit for bit) that asking for it
    as a candidate gives: the coordinator reads the rollouts' ids there and may ask for the rest as candidates."""
    actor, batch, _ = tiny_case(model_path)
    vocab = actor.model.config.vocab_size
    packed = batched_top_logprobs(actor.model, batch, 5, pad_id=0, temperature=1.0, micro=micro,
                                  ranks=Ranks.single("cpu"))
    logprobs, top_logprobs, top_ids = split_top(packed)
    assert top_ids.dtype == torch.int64 and top_ids.shape == top_logprobs.shape == (batch.num_response_tokens, 5)
    every = batched_candidate_logprobs(actor.model, batch, pad_id=0, temperature=1.0, micro=micro,
                                       ranks=Ranks.single("cpu"),
                                       candidate_ids=torch.arange(vocab).repeat(batch.num_response_tokens, 1))
    every = every.float()  # as the service sends them
    assert torch.equal(logprobs, every[:, 0])
    want = every[:, 1:].topk(5, dim=-1)
    assert torch.equal(top_ids, want.indices) and torch.equal(top_logprobs, want.values)
    assert (top_logprobs[:, :-1] >= top_logprobs[:, 1:]).all()
    whole = split_top(batched_top_logprobs(actor.model, batch, vocab + 10, pad_id=0, temperature=1.0, micro=micro,
                                           ranks=Ranks.single("cpu")))[2]
    assert whole.shape[1] == vocab  # at most the vocabulary
