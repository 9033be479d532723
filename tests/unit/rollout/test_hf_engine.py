"""CPU tests of services/rollout/hf_engine.py (and of sampling.py's hash_seed): sampling helpers and generation on
a tiny model."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch

from services.run.models import load_causal_lm, load_tokenizer
from services.coordctl.tiny_model import build_char_tokenizer, build_tiny_model, check_round_trip
from services.rollout.hf_engine import HFEngine, sample_rows, top_p_filter
from services.rollout.sampling import Completion, SamplingSettings, hash_seed
from services.rollout.swap import GenerationInterrupted

# ---------------------------------------------------------------------------
# sampling helpers


def test_top_p_filter_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3]])
    # sorted mass before each token: 0, 0.5, 0.8 -> with top_p 0.6 the first two (0.5, 0.3) stay
    got = top_p_filter(probs, 0.6)
    torch.testing.assert_close(got, torch.tensor([[0.5, 0.3, 0.0], [0.0, 0.5, 0.3]]))
    # top_p 0.4: the most likely token alone already reaches it
    torch.testing.assert_close(top_p_filter(probs, 0.4), torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.5, 0.0]]))
    # mass exactly reaching top_p: [0.5, 0.25, 0.25] with top_p 0.5 keeps the first token only
    # (dyadic numbers, so the sums are exact)
    torch.testing.assert_close(
        top_p_filter(torch.tensor([[0.25, 0.5, 0.25]]), 0.5), torch.tensor([[0.0, 0.5, 0.0]])
    )
    # top_p 1.0 leaves the rows unchanged
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_sample_rows_reproducible_per_generator():
    probs = torch.full((4, 1000), 1 / 1000)

    def draw(seeds: list[int]) -> list[int]:
        return sample_rows(probs, [torch.Generator().manual_seed(s) for s in seeds]).tolist()

    assert draw([1, 2, 3, 4]) == draw([1, 2, 3, 4])
    assert draw([1, 2, 3, 4]) != draw([5, 6, 7, 8])
    # a row's draw depends only on its own generator, not on its neighbours
    assert draw([1, 2, 3, 4])[0] == draw([1, 9, 9, 9])[0]


def test_sample_rows_respects_zero_probabilities_and_distribution():
    one_hot = torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 8)
    assert sample_rows(one_hot, [torch.Generator().manual_seed(s) for s in range(8)]).tolist() == [2] * 8
    # exponential race samples from probs: 4000 independent draws of [0.5, 0.3, 0.2, 0]
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).expand(4000, 4)
    chosen = sample_rows(probs, [torch.Generator().manual_seed(s) for s in range(4000)])
    freq = torch.bincount(chosen, minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.03, rtol=0)


def test_hash_seed_deterministic_and_distinct():
    assert hash_seed(7, 3, 1) == hash_seed(7, 3, 1)
    grid = list(itertools.product(range(10), range(20), range(8)))
    seeds = [hash_seed(*args) for args in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= s < 2**63 for s in seeds)
    # swapping roles of the arguments does not collide
    assert hash_seed(1, 2, 3) != hash_seed(3, 2, 1) != hash_seed(2, 1, 3)


# ---------------------------------------------------------------------------
# character tokenizer


def test_char_tokenizer_round_trip(tiny):
    _, tokenizer = tiny
    check_round_trip(tokenizer)  # the whole alphabet
    text = "  12 + 30 = 42 ,  two  spaces "
    check_round_trip(tokenizer, text)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_check_round_trip_refuses_a_lossy_text():
    # "é" is outside the alphabet: it becomes <unk> and does not come back
    with pytest.raises(RuntimeError, match="round-trip"):
        check_round_trip(build_char_tokenizer(), "café")


# ---------------------------------------------------------------------------
# engine on a tiny model

SETTINGS = SamplingSettings(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7, stop_token_ids=())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", hidden_size=32, num_layers=1, num_heads=2, seed=0)
    return load_causal_lm(folder), load_tokenizer(folder)


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tokenizer = tiny
    texts = ["12+3=", "a", "reverse: hello world"]  # lengths 5, 1, 20: left padding in every batch
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _engine(tiny, batch_size: int) -> HFEngine:
    model, tokenizer = tiny
    return HFEngine(model, tokenizer.pad_token_id, (tokenizer.eos_token_id,), batch_size=batch_size)


def _reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """log_softmax of a plain forward over the unpadded prompt + response, at each response token."""
    full = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=full).logits[0].float()
    predicting = logits[len(prompt) - 1 : len(prompt) + len(tokens) - 1] / temperature
    return torch.log_softmax(predicting, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1).tolist()


def _check_shapes(results, prompts, sampling: SamplingSettings, stops: set[int]):
    assert len(results) == len(prompts)
    for completions in results:
        assert len(completions) == sampling.n
        for c in completions:
            assert isinstance(c, Completion)
            assert 1 <= len(c.token_ids) <= sampling.max_new_tokens
            assert len(c.logprobs) == len(c.token_ids)
            assert not stops & set(c.token_ids[:-1])  # nothing is generated after a stop token
            if c.token_ids[-1] in stops:
                assert c.finish_reason == "stop"
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == sampling.max_new_tokens


def test_generate_shapes_and_finish_reasons(tiny, prompts):
    _, tokenizer = tiny
    results = _engine(tiny, batch_size=4).generate(prompts, SETTINGS)
    _check_shapes(results, prompts, SETTINGS, {tokenizer.eos_token_id})
    # three samples of one prompt are not all the same
    assert len({tuple(c.token_ids) for c in results[2]}) > 1


def test_generate_stop_tokens(tiny, prompts):
    _, tokenizer = tiny
    stops = tuple(range(0, len(tokenizer), 2))  # half the vocabulary stops: both outcomes occur
    sampling = SamplingSettings(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=3, stop_token_ids=stops)
    results = _engine(tiny, batch_size=4).generate(prompts, sampling)
    _check_shapes(results, prompts, sampling, set(stops) | {tokenizer.eos_token_id})
    reasons = {c.finish_reason for completions in results for c in completions}
    assert "stop" in reasons
    assert any(len(c.token_ids) < 6 for completions in results for c in completions)


def _as_tuples(results):
    return [[(tuple(c.token_ids), c.finish_reason) for c in completions] for completions in results]


def test_same_seed_same_completions_whatever_the_batching(tiny, prompts):
    by_size = {size: _engine(tiny, batch_size=size).generate(prompts, SETTINGS) for size in (1, 4, 9)}
    reference = by_size[4]
    for results in by_size.values():
        assert _as_tuples(results) == _as_tuples(reference)
        for got, want in zip(results, reference):
            for c, d in zip(got, want):
                torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-5, rtol=0)
    # a different seed gives different completions
    other = _engine(tiny, batch_size=4).generate(
        prompts, SamplingSettings(n=3, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=8, stop_token_ids=())
    )
    assert _as_tuples(other) != _as_tuples(reference)


def test_seed_indices_give_each_prompt_its_samples_wherever_it_is_sent(tiny, prompts):
    whole = _engine(tiny, batch_size=4).generate(prompts, SETTINGS)
    # prompts 1.. sent alone, as another replica would get them, seeded from their global index
    tail = _engine(tiny, batch_size=2).generate(prompts[1:], SETTINGS, seed_indices=list(range(1, len(prompts))))
    assert _as_tuples(tail) == _as_tuples(whole[1:])
    # in another order, gathered with others (as an agent loop's turns are): each keeps its own samples
    order = list(reversed(range(len(prompts))))
    gathered = _engine(tiny, batch_size=3).generate([prompts[i] for i in order], SETTINGS, seed_indices=order)
    assert _as_tuples(gathered) == _as_tuples([whole[i] for i in order])
    # without the offset the same prompt draws other samples
    shifted = _engine(tiny, batch_size=4).generate(prompts[2:], SETTINGS)
    assert _as_tuples(shifted) != _as_tuples(whole[2:])


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_match_an_unpadded_forward(tiny, prompts, temperature, top_p):
    model, _ = tiny
    sampling = SamplingSettings(
        n=3, temperature=temperature, top_p=top_p, max_new_tokens=6, seed=11, stop_token_ids=()
    )
    results = _engine(tiny, batch_size=4).generate(prompts, sampling)
    for prompt, completions in zip(prompts, results):
        for c in completions:
            want = _reference_logprobs(model, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(want), atol=1e-5, rtol=0)


def test_tiny_top_p_is_greedy(tiny, prompts):
    model, _ = tiny
    sampling = SamplingSettings(n=2, temperature=1.0, top_p=1e-6, max_new_tokens=6, seed=5, stop_token_ids=())
    results = _engine(tiny, batch_size=4).generate(prompts, sampling)
    for prompt, completions in zip(prompts, results):
        assert completions[0].token_ids == completions[1].token_ids  # only the top token survives
        c = completions[0]
        full = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(prompt) - 1 : -1]
        assert c.token_ids == logits.argmax(-1).tolist()


def test_temperature_zero_decodes_greedily_with_logprobs_at_temperature_one(tiny, prompts):
    model, _ = tiny
    sampling = SamplingSettings(n=2, temperature=0.0, top_p=0.5, max_new_tokens=6, seed=5, stop_token_ids=())
    results = _engine(tiny, batch_size=4).generate(prompts, sampling)
    other_seed = _engine(tiny, batch_size=1).generate(prompts, SamplingSettings(n=2, temperature=0.0, top_p=1.0,
                                                                                max_new_tokens=6, seed=99,
                                                                                stop_token_ids=()))
    assert _as_tuples(results) == _as_tuples(other_seed)  # no randomness left
    for prompt, completions in zip(prompts, results):
        c = completions[0]
        full = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(prompt) - 1 : -1]
        assert c.token_ids == logits.argmax(-1).tolist()
        want = _reference_logprobs(model, prompt, c.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(want), atol=1e-5, rtol=0)


def test_an_interrupt_stops_generation_at_the_next_token_step(tiny, prompts):
    steps = 0

    def before_step() -> int:  # called once per token step: interrupts at the fourth
        nonlocal steps
        steps += 1
        if steps > 3:
            raise GenerationInterrupted
        return 0

    long = SamplingSettings(n=3, temperature=0.02, top_p=1.0, max_new_tokens=50, seed=7, stop_token_ids=())
    with pytest.raises(GenerationInterrupted):
        _engine(tiny, batch_size=9).generate(prompts, long, before_step=before_step)
    assert steps == 4
    # asked and never interrupted, it samples what it samples without being asked
    assert _as_tuples(_engine(tiny, batch_size=9).generate(prompts, SETTINGS, before_step=lambda: 0)) == \
        _as_tuples(_engine(tiny, batch_size=9).generate(prompts, SETTINGS))


def test_each_completion_carries_the_versions_of_its_first_and_last_tokens(tiny, prompts):
    steps = []

    def before_step() -> int:  # the weights of version 4 serve the first three token steps, then those of 5
        steps.append(4 if len(steps) < 3 else 5)
        return steps[-1]

    second_token = _engine(tiny, batch_size=9).generate(prompts, SETTINGS)[0][0].token_ids[1]
    stopping = dataclasses.replace(SETTINGS, stop_token_ids=(second_token,))  # one response ends at it, at least
    results = _engine(tiny, batch_size=9).generate(prompts, stopping, before_step=before_step)
    completions = [c for group in results for c in group]
    assert min(len(c.token_ids) for c in completions) <= 3 < max(len(c.token_ids) for c in completions)
    for c in completions:  # a response that ended by the third token is all version 4
        assert (c.first_version, c.last_version) == (4, 5 if len(c.token_ids) > 3 else 4)


def test_generation_passes_no_deprecated_argument_to_the_model(tiny, prompts):
    # transformers deprecates with FutureWarning (past_key_values -> cache, by 5.24); fail on any, so that a call
    # due to be removed is seen before the release that removes it
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        results = _engine(tiny, batch_size=4).generate(prompts, SETTINGS)
    assert _as_tuples(results) == _as_tuples(_engine(tiny, batch_size=4).generate(prompts, SETTINGS))


def test_a_generate_call_gives_one_seed_index_per_prompt_or_none():
    from meshrl.v1 import rollout_pb2
    from services.rollout.server import seed_indices_of

    assert seed_indices_of(rollout_pb2.SamplingParams(first_index=5), 3) == [5, 6, 7]
    assert seed_indices_of(rollout_pb2.SamplingParams(first_index=5, seed_indices=[9, 2, 4]), 3) == [9, 2, 4]
    with pytest.raises(ValueError, match="seed_indices has 2 entries for 3 prompts"):
        seed_indices_of(rollout_pb2.SamplingParams(seed_indices=[1, 2]), 3)


def test_compute_log_probs_are_the_sampled_tokens_logprobs_at_temperature_one_whatever_the_batching(tiny, prompts):
    """The weight check's scoring: a forward pass over prompt + response gives each response token the logprob a
    plain unpadded forward gives it, and the logprob the engine reported when it sampled it at temperature 1;
    responses of different lengths in one right-padded batch, or one at a time, score alike."""
    model, _ = tiny
    sampling = SamplingSettings(n=1, temperature=1.0, top_p=1.0, max_new_tokens=7, seed=5, stop_token_ids=())
    responses = [group[0] for group in _engine(tiny, batch_size=4).generate(prompts, sampling)]
    together = _engine(tiny, batch_size=4).compute_log_probs(prompts, [c.token_ids for c in responses])
    one_by_one = _engine(tiny, batch_size=1).compute_log_probs(prompts, [c.token_ids for c in responses])
    for prompt, completion, scored, alone in zip(prompts, responses, together, one_by_one):
        want = _reference_logprobs(model, prompt, completion.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(scored), torch.tensor(want), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(scored), torch.tensor(completion.logprobs), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(alone), torch.tensor(scored), atol=1e-5, rtol=0)


def test_the_probe_s_top_k_are_the_most_likely_next_tokens_of_a_plain_forward(tiny, prompts):
    """score(top_k=5): at each response position the 5 most likely tokens of the unpadded forward's log-softmax,
    most likely first, flat over the responses of a right-padded batch; a top_k past the vocabulary gives it all."""
    model, _ = tiny
    responses = [[3, 4, 5], [6], [7, 8]]
    logprobs, top = _engine(tiny, batch_size=4).score(prompts, responses, top_k=5)
    assert logprobs == _engine(tiny, batch_size=1).compute_log_probs(prompts, responses)
    assert top.ids.shape == top.logprobs.shape == (6, 5) and top.ids.dtype == torch.int64
    want = []
    for prompt, response in zip(prompts, responses):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
        want.append(torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(response) - 1], -1))
    full = torch.cat(want)
    torch.testing.assert_close(top.logprobs, full.gather(-1, top.ids), atol=1e-5, rtol=0)
    torch.testing.assert_close(top.logprobs, full.topk(5, dim=-1).values, atol=1e-5, rtol=0)
    assert (top.logprobs[:, :-1] >= top.logprobs[:, 1:]).all()
    _, whole = _engine(tiny, batch_size=4).score(prompts[:1], responses[:1], top_k=10 ** 6)
    assert whole.ids.shape == (3, model.config.vocab_size)


def test_shift_weight_changes_the_logprobs_and_refuses_a_name_the_model_lacks(tmp_path, prompts):
    folder = build_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, seed=0)
    model, tokenizer = load_causal_lm(folder), load_tokenizer(folder)
    engine = HFEngine(model, tokenizer.pad_token_id, (tokenizer.eos_token_id,), batch_size=4)
    response = [[3, 4, 5]] * len(prompts)
    before = engine.compute_log_probs(prompts, response)
    engine.shift_weight("model.norm.weight", 0.5)
    after = engine.compute_log_probs(prompts, response)
    assert max(abs(a - b) for row_a, row_b in zip(before, after) for a, b in zip(row_a, row_b)) > 1e-3
    with pytest.raises(KeyError, match="model.no_such.weight"):
        engine.shift_weight("model.no_such.weight", 0.5)
